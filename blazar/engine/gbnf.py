"""Bounds on a GBNF grammar, checked before llama.cpp's parser sees it.

llama.cpp parses a grammar by recursive descent, one C++ frame per nested group, and
walks chains of rule references recursively when it builds the grammar's stacks; no
depth is bounded. Measured with the llama.cpp that llama-cpp-python 0.3.36 vendors, on
a thread with an 8 MiB stack: 10,000 nested groups parse, 30,000 kill the process
(SIGSEGV); a chain of 50,000 rules each referring to the next parses, 200,000 kill it.
A crash takes the engine and every stream on it down, so a grammar past these bounds
is refused here, by name, well below what was seen to crash:

- `MAX_NESTING` groups inside each other (parentheses, outside literals, character
  classes and comments): a tenth of the 10,000 seen to parse;
- `MAX_RULES` rules, which bounds any chain of rules referring to the next: a fifth of
  the 50,000 seen to parse;
- `MAX_BYTES` of grammar text, what llama.cpp allocates for it. A JSON schema's enum of
  20,000 values makes about 170 KB of grammar (one rule, a trie), which must pass;
- a repetition `{m,n}` whose maximum is below its minimum: llama.cpp's parser loops for
  ever on it (measured: `"a"{1,0}` and `"a"{3,2}` still parsing after 60 s, the thread
  at full CPU; `{0,0}` and `{0,50000}` parse at once, a minimum past its own bound is
  refused by the parser);
- a part that can match nothing, repeated more than `gbnf_empty.MAX_EMPTIABLE_REPEAT`
  times (time, as below; see `gbnf_empty`);
- `MAX_ALTERNATIVES` in one rule or group. This one is about time, not a crash:
  llama.cpp keeps a stack per live alternative and checks each against the whole
  vocabulary when it constrains a step, on the decode thread every slot of the engine
  shares. Measured on the 2-core dev box under load, for one step over Gemma 3's
  262,144 tokens: 1 alternative 0.28 s, 64 1.6 s, 256 3.0 s, 1,000 9.9 s; the fuzz run
  sent 60,000 (under 1 MiB), minutes a token while every other stream waited. Many
  choices are written as a trie instead (a JSON schema's `enum` is, see
  `schema.alternation`), which keeps one stack per distinct next character.

Pure: a scan of the text, no llama.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from blazar.api import errors
from blazar.engine import gbnf_empty

MAX_NESTING = 1000
MAX_RULES = 10_000
MAX_BYTES = 1024 * 1024
MAX_ALTERNATIVES = 256


def check_bounds(grammar: str, *, what: str = "The grammar") -> None:
    """InvalidRequest when `grammar` is larger or nests deeper than llama.cpp is known to
    survive; `what` names it in the message (a grammar made from a schema says so)."""
    size = len(grammar.encode())
    if size > MAX_BYTES:
        raise errors.InvalidRequest(
            f"{what} is {size:,} bytes of GBNF; at most {MAX_BYTES:,} are accepted."
        )
    rules = grammar.count("::=")  # an upper bound: "::=" inside a literal counts too
    if rules > MAX_RULES:
        raise errors.InvalidRequest(
            f"{what} has {rules:,} rules; at most {MAX_RULES:,} are accepted."
        )
    depth = nesting(grammar)
    if depth > MAX_NESTING:
        raise errors.InvalidRequest(
            f"{what} nests {depth:,} groups inside each other; at most {MAX_NESTING:,} are "
            "accepted."
        )
    for low, high in repetitions(grammar):
        if high is not None and high < low:
            raise errors.InvalidRequest(
                f"{what} repeats something {{{low},{high}}} times: the most ({high}) is below "
                f"the least ({low})."
            )
    limit = gbnf_empty.MAX_EMPTIABLE_REPEAT
    for rule, count in gbnf_empty.emptiable_repeats(grammar):
        if count > limit:
            raise errors.InvalidRequest(
                f"{what} repeats a part of rule '{rule}' that can match nothing more than "
                f"{limit} times (repetitions nested in one another multiply); llama.cpp "
                "follows every way of skipping it, at every step. Make the repeated part "
                "match at least one character, or repeat it fewer times."
            )
    wide = widest(grammar)
    if wide > MAX_ALTERNATIVES:
        raise errors.InvalidRequest(
            f"{what} has {wide:,} alternatives in one rule or group; at most "
            f"{MAX_ALTERNATIVES:,} are accepted (each is checked against the whole "
            "vocabulary at every step). Write many choices as a tree of shared prefixes, "
            "or as a JSON schema enum."
        )


def nesting(grammar: str) -> int:
    """The deepest nesting of parenthesised groups, outside string literals, character
    classes and comments (where a parenthesis is only a character)."""
    depth = deepest = 0
    for _, c in _structure(grammar):
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
    return deepest


def widest(grammar: str) -> int:
    """The most alternatives (`|`-separated) of one rule's body or one parenthesised
    group, outside string literals, character classes and comments."""
    # One count per open group; the bottom one is the current rule's body.
    counts = [1]
    widest_seen = 1
    for i, c in _structure(grammar):
        if c == "(":
            counts.append(1)
        elif c == ")":
            if len(counts) > 1:
                counts.pop()
        elif c == "|":
            counts[-1] += 1
            widest_seen = max(widest_seen, counts[-1])
        elif c == ":" and grammar.startswith("::=", i) and len(counts) == 1:
            counts[0] = 1  # a new rule begins
    return widest_seen


_REPETITION = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")


def repetitions(grammar: str) -> Iterator[tuple[int, int | None]]:
    """Each `{m}`, `{m,}` and `{m,n}` outside string literals, character classes and
    comments, as (m, n): n is m for `{m}`, None for `{m,}`."""
    for i, c in _structure(grammar):
        if c != "{":
            continue
        found = _REPETITION.match(grammar, i)
        if found is None:
            continue  # not a repetition the parser reads; it refuses it
        low = int(found.group(1))
        if found.group(2) is None:
            yield low, low
        else:
            yield low, int(found.group(3)) if found.group(3) else None


def _structure(grammar: str) -> Iterator[tuple[int, str]]:
    """Each character of the grammar outside string literals, character classes and
    comments, with its index: what the bounds above count."""
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c in '"[':
            i = gbnf_empty.skip_quoted(grammar, i + 1, '"' if c == '"' else "]")
            continue
        if c == "#":
            newline = grammar.find("\n", i)
            i = n if newline < 0 else newline
            continue
        yield i, c
        i += 1
