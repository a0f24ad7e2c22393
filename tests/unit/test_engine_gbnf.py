"""Grammar bounds, checked before llama.cpp's recursive parser sees a grammar."""

from __future__ import annotations

import json

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.engine import gbnf, gbnf_empty, sampling


@pytest.mark.parametrize(
    ("grammar", "depth"),
    [
        ('root ::= "a"', 0),
        ('root ::= ("a" ("b" | "c"))*', 2),
        # Parentheses inside literals, character classes and comments are characters.
        ('root ::= "((((" [()] "\\")((("  # (((\nx ::= ("a")', 1),
        ('root ::= [\\]((] ("a")', 1),
        # Unbalanced closers do not go below zero; the parser refuses them anyway.
        ('root ::= ))) ("a")', 1),
        ("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, 5000),
    ],
)
def test_nesting_counts_groups_only(grammar: str, depth: int) -> None:
    assert gbnf.nesting(grammar) == depth


def test_a_grammar_nested_past_the_bound_is_refused_by_name() -> None:
    # 60,000 nested groups killed the engine with SIGSEGV before this check.
    deep = "root ::= " + "(" * 60_000 + '"a"' + ")" * 60_000
    with pytest.raises(errors.InvalidRequest, match="nests 60,000 groups") as caught:
        sampling.grammar_of(inference_pb2.Constraint(grammar=deep))
    assert "at most 1,000" in caught.value.message
    at_bound = "root ::= " + "(" * gbnf.MAX_NESTING + '"a"' + ")" * gbnf.MAX_NESTING
    assert sampling.grammar_of(inference_pb2.Constraint(grammar=at_bound)) == at_bound


def test_a_grammar_with_too_many_rules_or_bytes_is_refused() -> None:
    # A chain of rules, each referring to the next: 200,000 of them killed llama.cpp.
    chain = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(20_000))
    with pytest.raises(errors.InvalidRequest, match="20,001 rules; at most 10,000"):
        sampling.grammar_of(inference_pb2.Constraint(grammar=chain))
    huge = 'root ::= "' + "a" * gbnf.MAX_BYTES + '"'
    with pytest.raises(errors.InvalidRequest, match="bytes of GBNF; at most 1,048,576"):
        sampling.grammar_of(inference_pb2.Constraint(grammar=huge))


@pytest.mark.parametrize(
    ("grammar", "widest"),
    [
        ('root ::= "a"', 1),
        ('root ::= "a" | "b"\nx ::= "c" | "d" | "e"', 3),
        # A group counts apart from the rule around it.
        ('root ::= ("a" | "b" | "c" | "d") | "e"', 4),
        # Bars inside literals, character classes and comments are characters.
        ('root ::= "|||" [|] "\\"|" # | | |\nx ::= "a"', 1),
        ("root ::= " + " | ".join(f'"w{i}"' for i in range(600)), 600),
    ],
)
def test_widest_counts_the_alternatives_of_one_rule_or_group(grammar: str, widest: int) -> None:
    assert gbnf.widest(grammar) == widest


def test_a_grammar_too_wide_is_refused_and_a_schema_enum_is_not() -> None:
    # Found by tests/integration/fuzz/test_engine_requests.py: 60,000 alternatives (under
    # 1 MiB) held the engine's decode thread for minutes a token.
    wide = "root ::= " + " | ".join(f'"w{i}"' for i in range(gbnf.MAX_ALTERNATIVES + 1))
    with pytest.raises(errors.InvalidRequest, match="257 alternatives in one rule or group"):
        sampling.grammar_of(inference_pb2.Constraint(grammar=wide))
    at_bound = "root ::= " + " | ".join(f'"w{i}"' for i in range(gbnf.MAX_ALTERNATIVES))
    assert sampling.grammar_of(inference_pb2.Constraint(grammar=at_bound)) == at_bound
    # The same many choices as an enum are a trie, as narrow as its alphabet.
    enum = json.dumps({"enum": [f"w{i}" for i in range(20_000)]})
    assert sampling.grammar_of(inference_pb2.Constraint(json_schema=enum))


def test_the_request_field_is_named_when_resolving() -> None:
    deep = "root ::= " + "(" * 2000 + '"a"' + ")" * 2000
    with pytest.raises(errors.InvalidRequest) as caught:
        sampling.resolve(
            inference_pb2.Sampling(), constraint=inference_pb2.Constraint(grammar=deep)
        )
    assert caught.value.metadata[errors.FIELD_KEY] == sampling.CONSTRAINT_FIELD


@pytest.mark.parametrize(
    ("grammar", "found"),
    [
        ('root ::= "a"{1,0} x{3} y{2,} z{4,5}', [(1, 0), (3, 3), (2, None), (4, 5)]),
        # Braces in literals, classes and comments are characters.
        ('root ::= "{9,1}" [{1,0}] # {5,2}\n', []),
    ],
)
def test_repetitions_are_read_outside_literals(
    grammar: str, found: list[tuple[int, int | None]]
) -> None:
    assert list(gbnf.repetitions(grammar)) == found


def test_a_repetition_whose_most_is_below_its_least_is_refused() -> None:
    """llama.cpp's parser loops for ever on `{1,0}`: the engine's thread would spin."""
    with pytest.raises(errors.InvalidRequest, match=r"\{3,2\} times: the most \(2\)"):
        gbnf.check_bounds('root ::= "a"{3,2}')
    gbnf.check_bounds('root ::= "a"{0,0} "b"{2,}')


@pytest.mark.parametrize(
    ("grammar", "found"),
    [
        ('root ::= ("a"?){0,200}', [("root", 200)]),
        ('root ::= ("a"?){100,}', [("root", 100)]),
        ('root ::= x{0,100}\nx ::= "a"?', [("root", 100)]),
        ('root ::= x*\nx ::= y | ""\ny ::= "b"', [("root", 1)]),
        # Nested ones multiply, through groups and rules (capped just past the bound).
        ('root ::= (("a"?){0,5}){0,6}', [("root", 30), ("root", 5)]),
        ('root ::= x{0,8}\nx ::= ("a"?){0,8}', [("root", 33), ("x", 8)]),
        ('root ::= ("a" | ""){0,5} # ("b"?){0,99}\n', [("root", 5)]),
        # Its part always matches something: any count is cheap.
        ('root ::= ("a" "b"?){0,200}', []),
        ('root ::= "[" x ("," x){0,9} "]"\nx ::= [0-9]+', []),
    ],
)
def test_emptiable_repeats_are_found_through_groups_and_rules(
    grammar: str, found: list[tuple[str, int]]
) -> None:
    assert list(gbnf_empty.emptiable_repeats(grammar)) == found


def test_a_part_that_can_match_nothing_repeated_past_the_bound_is_refused() -> None:
    """("a"?){0,200} took 129 s for 4 tokens, every other stream of the engine waiting."""
    gbnf.check_bounds('root ::= ("a"?){0,32}')
    with pytest.raises(errors.InvalidRequest, match="can match nothing more than 32 times"):
        gbnf.check_bounds('root ::= ("a"?){0,33}')
    # 32 of 32 nested: more than 200 s for 4 tokens.
    with pytest.raises(errors.InvalidRequest, match="can match nothing more than 32 times"):
        gbnf.check_bounds('root ::= (("a"?){0,32}){0,32}')
    # A chain of 10,000 rules, the last empty, is one pass of the worklist.
    chain = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(9990))
    gbnf.check_bounds(chain + 'r9990 ::= ""\n')
