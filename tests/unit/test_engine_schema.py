"""JSON schema to GBNF: patterns translated over JSON string text, unenforced keywords
refused. (That the grammars really hold is shown with the model in
tests/integration/test_structured_output.py.)"""

from __future__ import annotations

import datetime
import random
import re
from typing import Any

import pytest

from blazar.api import errors, jsonschemas
from blazar.engine import schema

RAW = "[\\x20-\\x21\\x23-\\x5B\\x5D-\\x7E\\x80-\\uD7FF\\uE000-\\U0010FFFF]"
# ECMA's '.': no line terminators (U+2028, U+2029 included).
DOT_RAW = "[\\x20-\\x21\\x23-\\x5B\\x5D-\\x7E\\x80-\\u2027\\u202A-\\uD7FF\\uE000-\\U0010FFFF]"
ALL_ESCAPES = '"\\\\b" | "\\\\t" | "\\\\n" | "\\\\f" | "\\\\r" | "\\\\\\"" | "\\\\\\\\"'
ANYTHING = f"({RAW} | {ALL_ESCAPES})*"


@pytest.mark.parametrize(
    ("pattern", "expression"),
    [
        ("^\\d{5}$", "([\\x30-\\x39]{5})"),
        ("^[A-Z][a-z]+ [A-Z]\\.$", '([\\x41-\\x5A] [\\x61-\\x7A]+ " " [\\x41-\\x5A] ".")'),
        ("^(foo|bar)+$", '(("f" "o" "o" | "b" "a" "r")+)'),
        ("^(?:x|)y{2,}z?$", '(("x" | "") "y"{2,} "z"?)'),
        ("^x{1,3}?$", '("x"{1,3})'),  # lazy: the same strings
        # A quote or backslash in the value is its escape in the JSON text.
        ('^a"b\\\\c$', '("a" "\\\\\\"" "b" "\\\\\\\\" "c")'),
        ("^\\n$", '("\\\\n")'),
        # '.' is anything but a line break, written as JSON allows.
        (
            "^.$",
            f'(({DOT_RAW} | "\\\\b" | "\\\\t" | "\\\\f" | "\\\\\\"" | "\\\\\\\\"))',
        ),
        # Unanchored ends match anything, as JSON Schema's search does.
        ("ab", f'{ANYTHING} ("a" "b") {ANYTHING}'),
        ("^ab", f'("a" "b") {ANYTHING}'),
        # A literal '{' that starts no repetition; an escaped '$' at the end.
        ("^{a}\\$$", '("{" "a" "}" "$")'),
        ("^[^\\x00-\\x7F]$", "([\\x80-\\uD7FF\\uE000-\\U0010FFFF])"),
    ],
)
def test_pattern_expression(pattern: str, expression: str) -> None:
    assert schema.pattern_expression(pattern) == expression


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("^(?=a)b$", "lookarounds"),
        ("^(a)\\1$", "'\\1'"),
        ("^a\\b$", "'\\b'"),
        ("^(a$", "unbalanced '('"),
        ("^a)$", "unbalanced ')'"),
        ("^[a-$", "unbalanced '['"),
        ("^[z-a]$", "out of order"),
        ("^*a$", "nothing to repeat"),
        ("^a**$", "cannot follow"),
        ("^a{3,1}$", "is empty"),
        ("^a^b$", "start or the end"),
        ("^[\\x01]$", "\\u escape"),
    ],
)
def test_unsupported_pattern_is_invalid(pattern: str, fragment: str) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        schema.pattern_expression(pattern)
    assert fragment in info.value.message


@pytest.mark.parametrize(
    ("document", "found"),
    [
        ({"type": "integer", "minimum": 0}, ["minimum"]),
        (
            {
                "type": "object",
                "properties": {
                    # A property may be called like a keyword.
                    "minimum": {"type": "integer", "maximum": 5},
                    "tags": {"type": "array", "uniqueItems": True, "items": {"not": {}}},
                },
            },
            [
                "properties.minimum.maximum",
                "properties.tags.uniqueItems",
                "properties.tags.items.not",
            ],
        ),
        (
            {"anyOf": [{"type": "number", "multipleOf": 2}, {"type": "null"}]},
            ["anyOf[0].multipleOf"],
        ),
        (
            {"$defs": {"n": {"type": "integer", "exclusiveMaximum": 3}}},
            ["$defs.n.exclusiveMaximum"],
        ),
        ({"type": "string", "pattern": "^a$", "maxLength": 4}, ["maxLength (with pattern)"]),
        # Data is not schema; enforced keywords pass.
        ({"enum": [{"minimum": 1}], "default": {"if": 0}, "x-extra": {"not": 0}}, []),
        ({"const": {"not": 1}, "example": {"maximum": 1}}, []),
        ({"type": "string", "minLength": 1, "maxLength": 4}, []),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}, []),
        # Combinations llama-cpp-python's converter drops or gets wrong.
        ({"type": ["string", "null"], "enum": ["red", None]}, ["type (a list, with enum)"]),
        ({"type": "string", "enum": ["a", 1]}, ["enum (values that are not of type string)"]),
        ({"$ref": "#/$defs/s", "maxLength": 2}, ["$ref (with maxLength)"]),
        (
            {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            ["oneOf (without a discriminator: use anyOf)"],
        ),
        (
            {"allOf": [{"$ref": "#/definitions/Color"}], "definitions": {"Color": {"enum": ["r"]}}},
            ["allOf (other than of object schemas with properties)"],
        ),
        # The converter writes an allOf as one object of every part's properties and
        # drops all else: a part's other keywords, one of two schemas for a property,
        # and properties beside the allOf (or the allOf beside properties).
        (
            {
                "allOf": [
                    {"properties": {"a": {"type": "string"}}, "additionalProperties": False},
                    {"type": "string", "properties": {"b": {"type": "integer"}}},
                ]
            },
            [
                "allOf[0] (additionalProperties beside properties)",
                "allOf[1] (type beside properties)",
            ],
        ),
        (
            {"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": {}}}]},
            ["allOf (property 'a' in more than one part)"],
        ),
        (
            {"properties": {"x": {}}, "allOf": [{"properties": {"y": {}}, "required": ["y"]}]},
            ["allOf (with properties)"],
        ),
        (
            {
                "type": "object",
                "allOf": [
                    {"type": "object", "properties": {"a": {}}, "required": ["a"]},
                    {"properties": {"b": {}}, "title": "B"},
                ],
            },
            [],
        ),
        (
            {"type": "object", "properties": {"a": {}}, "required": ["b"]},
            ["required (names not in properties: b)"],
        ),
        (
            {
                "properties": {"age": {"type": "integer"}},
                "additionalProperties": {"type": "string"},
            },
            ["additionalProperties (other than false, with properties)"],
        ),
        ({"type": "array", "minItems": 2}, ["minItems (without items)"]),
        # Found by tests/integration/fuzz/test_engine_requests.py: minLength 1e9 ran for
        # minutes in the converter, which spells each repetition out.
        (
            {"type": "string", "minLength": 10**9},
            ["minLength (over 1,000: the grammar spells out each one)"],
        ),
        (
            {"type": "string", "maxLength": 1001},
            ["maxLength (over 1,000: the grammar spells out each one)"],
        ),
        (
            {"type": "array", "items": {}, "maxItems": 1e12},
            ["maxItems (over 1,000: the grammar spells out each one)"],
        ),
        (
            {"properties": {"a": {"type": "array", "items": {}, "minItems": 5000}}},
            ["properties.a.minItems (over 1,000: the grammar spells out each one)"],
        ),
        ({"type": "string", "minLength": 1000, "maxLength": 1000}, []),
        ({"prefixItems": [{}], "maxItems": 1}, ["maxItems (with prefixItems)"]),
        ({"type": "string", "format": "date", "maxLength": 5}, ["maxLength (with format)"]),
        # Formats validators check but the grammar does not write: refused, as is one
        # the converter drops for a pattern. Formats no validator knows are annotations.
        ({"type": "string", "format": "email"}, ["format (email is not enforced)"]),
        ({"format": "ipv4"}, ["format (ipv4 is not enforced)"]),
        ({"type": "string", "format": "date", "pattern": "^2"}, ["format (with pattern)"]),
        ({"type": "string", "format": "date-time"}, []),
        # Bounds no value can meet: the converter kept the lower one and wrote on.
        (
            {"type": "string", "minLength": 5, "maxLength": 2},
            ["minLength (above maxLength)"],
        ),
        (
            {"type": "array", "items": {}, "minItems": 3, "maxItems": 1},
            ["minItems (above maxItems)"],
        ),
        ({"type": "string", "minLength": 2, "maxLength": 2}, []),
        ({"type": "string", "format": "uuid"}, []),
        ({"type": "string", "format": "password"}, []),
        ({"type": "integer", "format": "int32"}, []),
        # A false subschema allows nothing: no grammar can write it.
        ({"type": "array", "items": False}, ["items (false: no value is allowed)"]),
        ({"properties": {"a": False}}, ["properties.a (false: no value is allowed)"]),
        (
            {"anyOf": [False, {"type": "string"}]},
            ["anyOf (a false schema: no value is allowed)"],
        ),
        # What the converter handles: nullable via anyOf, typed enums, described refs.
        ({"anyOf": [{"type": "string"}, {"type": "null"}], "description": "x"}, []),
        ({"type": "integer", "enum": [1, 2.0]}, []),
        ({"$ref": "#/$defs/s", "description": "a ref"}, []),
        ({"oneOf": [{"type": "object"}], "discriminator": {"propertyName": "kind"}}, []),
    ],
)
def test_unenforced_keywords(document: dict[str, Any], found: list[str]) -> None:
    assert list(schema.unenforced_keywords(document)) == found


@pytest.mark.parametrize(
    ("pattern", "python_only"),
    [
        # Whitespace to Python (and, but for U+0085, to ECMA too): never written for \\S.
        ("^\\S+$", "\u3000"),
        ("^[^\\s]+$", "\u0085"),
        ("^\\S$", "\u2003"),
        # Digits and word characters outside ASCII: Python's \\d and \\w match them.
        ("^\\D$", "\u0663"),
        ("^[^\\d]$", "\u0663"),
        ("^\\W$", "\u00e9"),
        ("^[^\\w]$", "\u00b2"),
    ],
)
def test_negated_shorthands_leave_out_what_either_engine_matches(
    pattern: str, python_only: str
) -> None:
    expression = schema.pattern_expression(pattern)
    assert not _covers(expression, ord(python_only)), (pattern, expression)
    # ... while '!', which is neither space, digit nor word character to either, stays.
    assert _covers(expression, ord("!"))


def _covers(expression: str, code: int) -> bool:
    """Whether a GBNF class in `expression` lists `code` (\\xNN, \\uNNNN, \\UNNNNNNNN)."""
    char = r"\\[xuU]([0-9A-F]+)"
    for m in re.finditer(f"{char}(?:-{char})?", expression):
        low = int(m.group(1), 16)
        if low <= code <= int(m.group(2) or m.group(1), 16):
            return True
    return False


@pytest.mark.parametrize(
    ("pattern", "expression"),
    [
        # Both engines read a quantifier with a space as literal text.
        ("^a{1, 3}$", '("a" "{" "1" "," " " "3" "}")'),
        ("^a{2,}$", '("a"{2,})'),
        # An escaped backslash before the final '$' leaves the anchor an anchor.
        ("^a\\\\$", '("a" "\\\\\\\\")'),
    ],
)
def test_quantifiers_and_anchors_as_both_engines_read_them(pattern: str, expression: str) -> None:
    assert schema.pattern_expression(pattern) == expression


@pytest.mark.parametrize(("pattern", "fragment"), [("^a{,3}$", "'{,n}'"), ("^[\\01]$", "octal")])
def test_patterns_the_engines_disagree_on_are_refused(pattern: str, fragment: str) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        schema.pattern_expression(pattern)
    assert fragment in info.value.message


def test_grammar_leaves_the_callers_schema_alone() -> None:
    document = {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s"}
    schema.grammar(document)
    assert document == {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s"}


def test_unenforced_keyword_is_refused_by_name() -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        schema.grammar({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}})
    assert "properties.n.minimum" in info.value.message


def test_grammar_uses_the_pattern_translation_and_strict_strings() -> None:
    text = schema.grammar(
        {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^\\d{5}$"},
                "s": {"type": "string"},
            },
        }
    )
    assert '"\\"" ([\\x30-\\x39]{5}) "\\"" space' in text
    # Strings outside patterns hold no raw control character either.
    assert 'char ::= [^"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF] |' in text


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        # Found by fuzzing: each was a TypeError (an HTTP 500), read before validation.
        (
            {"type": "object", "properties": {"a": {}}, "required": 5},
            "['required']: 5 is not of type 'array'",
        ),
        ({"type": "object", "properties": []}, "['properties']: [] is not of type 'object'"),
        ({"$schema": [], "type": "object"}, "['$schema']: [] is not a string"),
        ({"$schema": 5}, "['$schema']: 5 is not a string"),
        ({"type": "strin"}, "['type']: 'strin' is not valid"),
    ],
)
def test_a_schema_that_is_not_valid_json_schema_is_refused(
    document: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(errors.InvalidRequest, match="not a valid JSON Schema") as info:
        schema.grammar(document)
    assert fragment in info.value.message


def test_an_unknown_schema_draft_is_read_as_the_latest() -> None:
    assert jsonschemas.problem({"$schema": "https://example.com/mine", "type": "string"}) is None
    assert schema.grammar({"$schema": "https://example.com/mine", "type": "string"})


def test_recursive_schema_is_refused_clearly() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    with pytest.raises(errors.InvalidRequest) as info:
        schema.grammar(tree)
    assert "recursive schemas are not supported" in info.value.message


@pytest.mark.parametrize(
    ("value", "literal"),
    [
        # GBNF literals of the JSON text: a backslash and a quote escaped once more,
        # characters outside ASCII as themselves, a lone surrogate as its JSON escape.
        ("é😀", '"\\"é😀\\""'),
        ("a\\b", '"\\"a\\\\\\\\b\\""'),
        ('say "hi"', '"\\"say \\\\\\"hi\\\\\\"\\""'),
        ("a\nb", '"\\"a\\\\nb\\""'),
        ("\ud800", '"\\"\\\\ud800\\""'),
        ({"k": 1}, '"{\\"k\\": 1}"'),
        # Unicode's line breaks other than "\n" are plain characters to JSON and GBNF:
        # splitting the grammar at them cut the literal and made the output invalid JSON.
        ("a\u2028b\u2029c\x85d", '"\\"a\u2028b\u2029c\x85d\\""'),
    ],
)
def test_constants_are_written_as_their_json_text(value: Any, literal: str) -> None:
    assert schema.grammar({"const": value}).split("\n")[0] == f"root ::= {literal}"


@pytest.mark.parametrize(
    ("texts", "expression"),
    [
        (["a"], '"a"'),
        (["ab", "ac"], '"a" ("b" | "c")'),
        (["a", "ab"], '"a" ("" | "b")'),
        (["x", "y", "x"], '("x" | "y")'),
        (["v1", "v10", "v2"], '"v" ("1" ("" | "0") | "2")'),
        (['"a"', '"b"'], '"\\"" ("a\\"" | "b\\"")'),
    ],
)
def test_alternation_writes_common_prefixes_once(texts: list[str], expression: str) -> None:
    assert schema.alternation(texts) == expression


def _gbnf_regex(expression: str) -> re.Pattern[str]:
    """A Python regex for a GBNF expression of literals, groups and alternatives."""

    def literal(m: re.Match[str]) -> str:
        text = re.sub(
            r"\\(x[0-9A-F]{2}|.)",
            lambda e: chr(int(e[1][1:], 16)) if e[1].startswith("x") else e[1],
            m[1],
        )
        return f"(?:{re.escape(text)})"

    body = re.sub(r'"((?:[^"\\]|\\.)*)"', literal, expression)
    return re.compile(body.replace("(", "(?:").replace("(?:?:", "(?:"), re.VERBOSE)


def test_alternation_matches_exactly_its_texts() -> None:
    rng = random.Random(5)
    alphabet = 'ab"\\\n\té😀'
    for _ in range(200):
        texts = ["".join(rng.choices(alphabet, k=rng.randint(0, 5))) for _ in range(6)]
        pattern = _gbnf_regex(schema.alternation(texts))
        for text in texts:
            assert pattern.fullmatch(text), (texts, text)
        for text in {t + c for t in texts for c in "ab"} | {t[:-1] for t in texts if t}:
            assert bool(pattern.fullmatch(text)) == (text in texts), (texts, text)


def test_an_enum_with_no_values_is_refused() -> None:
    with pytest.raises(errors.InvalidRequest, match="no values"):
        schema.grammar({"enum": []})


def test_an_enum_is_written_as_a_trie() -> None:
    rule = schema.grammar({"enum": ["red", "green", 1, None]}).splitlines()[0]
    assert rule == 'root ::= ("\\"" ("green\\"" | "red\\"") | "1" | "null")'


@pytest.mark.parametrize(
    ("document", "rule"),
    [
        (
            {"anyOf": [{"const": "ab"}, {"enum": ["ac", 1], "title": "t"}]},
            'root ::= ("\\"a" ("b\\"" | "c\\"") | "1")',
        ),
        ({"type": "string", "enum": ["x", "y"]}, 'root ::= "\\"" ("x\\"" | "y\\"")'),
        # Not only constants: the converter's own union.
        (
            {"anyOf": [{"const": "a"}, {"type": "integer"}]},
            "root ::= alternative-0 | integer",
        ),
    ],
)
def test_unions_of_constants_are_written_as_a_trie(document: dict[str, Any], rule: str) -> None:
    assert rule in schema.grammar(document).splitlines()


def test_a_date_format_allows_exactly_the_dates_validators_accept() -> None:
    """`format: date` is checked with Python's `date.fromisoformat` (jsonschema's format
    checker): no 2023-02-30, no year 0000, and February 29 only in leap years."""
    text = schema.grammar({"type": "string", "format": "date"})
    rule = next(line for line in text.splitlines() if line.startswith("date ::= "))
    pattern = _gbnf_regex(rule.removeprefix("date ::= "))
    rng = random.Random(3)
    years = [0, 1, 4, 100, 400, 1900, 2000, 2023, 2024, 9999, *rng.sample(range(10000), 40)]
    for year in years:
        for month in range(14):
            for day in range(33):
                value = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    datetime.date.fromisoformat(value)
                    valid = True
                except ValueError:
                    valid = False
                assert bool(pattern.fullmatch(value)) == valid, value


ANY_VALUE = "array | string | number | boolean | null"


@pytest.mark.parametrize(
    ("document", "rule"),
    [
        # What Pydantic writes for list[Any] and for a field of type Any.
        ({"type": "array", "items": {}}, "item"),
        ({"type": "object", "properties": {"x": {"title": "X"}}, "required": ["x"]}, "x"),
        ({"type": "array", "items": True, "minItems": 1}, "item"),
        ({"type": "object", "additionalProperties": {"description": "d"}}, "additional-value"),
        ({"anyOf": [True, {"type": "integer"}]}, "alternative-0"),
    ],
)
def test_a_subschema_that_allows_anything_allows_any_value(
    document: dict[str, Any], rule: str
) -> None:
    """`true`, `{}` and a schema of annotations only allow any JSON value; the converter
    refused the last and read `{}` as "any object" or, for items, as no items at all."""
    lines = schema.grammar(document).splitlines()
    assert any(line.startswith(f"{rule} ::= ") and line.endswith(ANY_VALUE) for line in lines), (
        lines
    )


def _rules(text: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in text.splitlines())


@pytest.mark.parametrize(
    "defined",
    [
        # A property's rule of the same name: the converter reused it for the ref.
        {"a": {"type": "string", "maxLength": 3}},
        # A built-in rule's name: the converter took the built-in string.
        {"a": {"type": "string"}, "string": {"type": "integer"}},
    ],
)
def test_a_ref_is_written_as_its_own_definition(defined: dict[str, Any]) -> None:
    name = list(defined)[-1]
    document = {
        "type": "object",
        "properties": {"a": defined["a"], "b": {"$ref": f"#/$defs/{name}"}},
        "required": ["a", "b"],
        "$defs": {name: {"type": "integer"}},
    }
    rules = _rules(schema.grammar(document))
    assert rules["b-kv"].endswith(" b") and rules["b"] == "integer", rules


@pytest.mark.parametrize("name", ["integral part", "decimal_part", "date time", "time string"])
def test_a_name_like_a_built_in_rules_leaves_the_built_in_alone(name: str) -> None:
    """A property whose name, once written as a rule name, is a built-in rule's
    (`integral part` is `integral-part`) got that name, and the built-in string,
    number and date-time rules referred to the property's rule instead."""
    from llama_cpp import llama_grammar

    document = {
        "type": "object",
        "properties": {
            name: {"const": "x"},
            "n": {"type": "number"},
            "s": {"type": "string"},
            "t": {"type": "string", "format": "date-time"},
        },
    }
    builtins = {**llama_grammar.PRIMITIVE_RULES, **llama_grammar.STRING_FORMAT_RULES}
    rules = _rules(schema.grammar(document))
    for rule, body in rules.items():
        if rule in builtins and rule not in ("char", "date"):  # rewritten strict here
            assert body == builtins[rule].content, (rule, body)


_CAT = {"properties": {"kind": {"const": "cat", "type": "string"}}, "required": ["kind"]}
_DOG = {"properties": {"kind": {"enum": ["dog", "puppy"]}}, "required": ["kind"]}


@pytest.mark.parametrize(
    ("document", "found"),
    [
        # Pydantic's discriminated union: refs to objects with a constant each.
        (
            {
                "$defs": {"Cat": _CAT, "Dog": _DOG},
                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                "discriminator": {"propertyName": "kind"},
            },
            [],
        ),
        # The converter writes a oneOf as an anyOf: "ab" matched both branches.
        (
            {
                "oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}],
                "discriminator": {"propertyName": "kind"},
            },
            [
                "oneOf (branch 0 does not require 'kind' to be a constant)",
                "oneOf (branch 1 does not require 'kind' to be a constant)",
            ],
        ),
        (
            {
                "properties": {
                    "pet": {
                        "oneOf": [_CAT, {**_DOG, "properties": {"kind": {"enum": ["cat"]}}}],
                        "discriminator": {"propertyName": "kind"},
                    }
                }
            },
            ["properties.pet.oneOf (branches 0 and 1 both allow 'kind' 'cat')"],
        ),
        (
            {
                "oneOf": [_CAT, {**_DOG, "required": []}],
                "discriminator": {"propertyName": "kind"},
            },
            ["oneOf (branch 1 does not require 'kind' to be a constant)"],
        ),
    ],
)
def test_a_one_of_is_accepted_only_when_its_discriminator_parts_the_branches(
    document: dict[str, Any], found: list[str]
) -> None:
    assert list(schema.overlapping_one_of(document)) == found
    if found:
        with pytest.raises(errors.InvalidRequest, match=re.escape(found[0])):
            schema.grammar(document)
    else:
        schema.grammar(document)


def test_a_null_in_the_schema_is_no_cause_to_start_over_from_its_root() -> None:
    """Found by the body fuzzer: a JSON null as the value of a keyword JSON Schema does
    not define (which it allows) sent the oneOf check back to the schema's root, until
    RecursionError: a 500."""
    document = {"type": "object", "properties": {"city": {"type": "string", "note": None}}}
    assert list(schema.overlapping_one_of(document)) == []
    schema.grammar(document)
