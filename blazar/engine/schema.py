"""JSON schema to GBNF: which documents a `json_schema` constraint lets the model write.

Pure (no llama.cpp context, no IO). llama-cpp-python's `SchemaConverter` builds the
grammar, with corrections, so that every document the grammar allows parses as JSON
and validates against the schema (as `jsonschema`, with Python's `re`, checks it):

- String `pattern`s are translated here (`pattern_expression`). The converter's own
  translation let a pattern's `.` or `[^x]` write a raw `"` or backslash into the JSON
  text, copied `\\d` or `\\w` into GBNF (which has neither), and matched the pattern
  against the escaped text instead of the string's value. Where ECMA-262 (the pattern
  language) and Python's `re` read a pattern differently, the grammar allows only what
  both accept, or the pattern is refused.
- Keywords the converter ignores (`minimum`, `uniqueItems`, a `format` such as
  `email`, ...) and combinations it gets wrong (a `$ref` or `enum` with sibling
  constraints, `type` lists with other keywords, `oneOf` without a discriminator each
  branch requires as a constant of its own, ...)
  are refused with a 400 that names them, rather than promised and not kept.
- It reads a subschema that allows anything as something narrower or nothing:
  `items: {}` (Pydantic's `list[Any]`) and `true` fail, `{}` elsewhere is "any object",
  and a schema of annotations only (Pydantic's `Any`) is refused. Such subschemas are
  written here as any JSON value; a `false` one (no value) is refused.
- It named a `$ref`'s rule by the ref's last segment and reused any rule of that
  name (a property's, a built-in's), and its built-in rules took any rule whose name
  came out as theirs once made a valid rule name (a property "integral part"): the
  grammar wrote one value's rule for another. Each ref gets its own rule here.
- Its string character rule lets raw control characters into strings, which no JSON
  parser accepts; llama.cpp's own converter has since excluded them.
- Its `date` format lets every month have 31 days and the year be 0000, which the
  `date` format check of validators refuses; the rule written here does not.
- Its literals (constants, enum values, property names) escaped only quotes and line
  breaks in GBNF, so JSON text with a backslash escape came out wrong or broke the
  grammar, and characters outside the BMP came out as surrogate bytes. Literals are
  written here (`_literal`), and constants as the JSON text a model would write.
- It writes an enum as one alternative per value, and llama.cpp's grammar checks
  each live alternative against the whole vocabulary: a 100-value enum cost 0.3 s per
  token, 8,000 values 25 s, on the decode thread every slot shares. Enums are written
  as a trie here (`alternation`): 20 ms for 8,000 values; so is an `anyOf` of
  constants.

A grammar may be stricter than its schema (a pattern's control characters other than
\\b \\f \\n \\r \\t cannot be written, an object takes no properties beyond those
listed), never looser.
"""

from __future__ import annotations

import copy
import functools
import itertools
import re
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from blazar.api import errors, jsonschemas, jsontext

# Keywords whose constraint the converter leaves out of the grammar.
UNENFORCED = frozenset(
    {
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minProperties", "maxProperties", "uniqueItems", "contains", "minContains",
        "maxContains", "not", "if", "then", "else", "dependentRequired",
        "dependentSchemas", "dependencies", "patternProperties", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems",
    }
)  # fmt: skip
# The string formats JSON Schema defines, which validators check (with a format
# checker, as OpenAI's structured outputs promise), and those the converter writes
# into the grammar. Other `format` values are annotations no validator checks.
_CHECKED_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
        "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference",
        "uuid", "uri-template", "json-pointer", "relative-json-pointer", "regex",
    }
)  # fmt: skip
_ENFORCED_FORMATS = frozenset({"date-time", "date", "time", "uuid"})
# The converter spells a length or item count out, one copy of the item per unit
# (maxLength as that many nested optional groups): `minLength: 1000000000` ran for
# minutes and gigabytes before any bound on the grammar's size could look at it. Past
# this count a bound is refused (maxLength past about 1,000 also nests deeper than
# `gbnf.MAX_NESTING`).
MAX_REPETITIONS = 1000
_REPETITIONS = ("minLength", "maxLength", "minItems", "maxItems")
# Keywords whose value maps names to subschemas (the names are not keywords).
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
# Keywords whose value is a subschema, or a list of them, where the converter cannot
# read a boolean schema (it reads `additionalProperties: true/false` itself).
_SUBSCHEMA = frozenset({"items", "additionalItems"})
_SUBSCHEMA_LISTS = frozenset({"prefixItems", "anyOf", "allOf", "oneOf"})
# Any JSON value, as the converter can read it: it takes `items: {}` for no items at
# all, writes `{}` elsewhere as "any object", and refuses a schema of annotations only
# (`{"title": "X"}`, what Pydantic writes for `Any`).
_ANY_VALUE = {"type": ["object", "array", "string", "number", "boolean", "null"]}
# Keywords whose value is data, not a schema (so are `x-` extensions).
_DATA = frozenset({"enum", "const", "default", "examples", "example", "discriminator"})
# Keywords that constrain nothing.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "example", "$schema", "$id", "$comment",
     "$defs", "definitions", "deprecated", "readOnly", "writeOnly", "discriminator"}
)  # fmt: skip

_LOOSE_CHAR_RULE = 'char ::= [^"\\\\] |'
_STRICT_CHAR_RULE = 'char ::= [^"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF] |'

# The converter's date lets every month have 31 days and the year be 0000, which a
# validator's `date` format (Python's `date.fromisoformat`, for jsonschema) refuses.
# This one takes exactly what that accepts: February 29 only in leap years.
_LOOSE_DATE_RULE = "date ::= "
_YEAR = '( [1-9] [0-9] [0-9] [0-9] | "0" [1-9] [0-9] [0-9] | "00" [1-9] [0-9] | "000" [1-9] )'
_LEAP_YEAR = (
    '( [0-9] [0-9] ( "0" [48] | [2468] [048] | [13579] [26] ) '
    '| ( "0" [48] | [2468] [048] | [13579] [26] ) "00" )'
)
_STRICT_DATE_RULE = (
    f'date ::= {_YEAR} "-" ( ( "0" [13578] | "1" [02] ) "-" ( "0" [1-9] | [12] [0-9] | "3" [01] ) '
    '| ( "0" [469] | "11" ) "-" ( "0" [1-9] | [12] [0-9] | "30" ) '
    '| "02" "-" ( "0" [1-9] | "1" [0-9] | "2" [0-8] ) ) '
    f'| {_LEAP_YEAR} "-02-29"'
)

_MAX_CODEPOINT = 0x10FFFF
# Characters JSON text cannot hold raw inside a string (DEL is excluded as well, as
# llama.cpp's converter does), and the escapes written for those it can express.
_RAW_FORBIDDEN = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F), (0xD800, 0xDFFF))
_ESCAPES = {
    0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"
}  # fmt: skip
# ECMA-262's white space and line terminators (`\\s`).
_ECMA_SPACE: tuple[tuple[int, int], ...] = (
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
    (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF),
)  # fmt: skip
_CHAR_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
Ranges = tuple[tuple[int, int], ...]
# {n}, {n,}, {n,m}: ASCII digits and no spaces, as both ECMA-262 and Python read them.
_REPETITION = re.compile(r"\{([0-9]+)(?:(,)([0-9]*))?\}")
_OPEN_REPETITION = re.compile(r"\{,[0-9]+\}")
_ALL: Ranges = ((0, _MAX_CODEPOINT),)
# A class member's characters: those it surely matches and those it may match. ECMA-262
# (the pattern's language) and Python's `re` (what validators such as `jsonschema` run)
# differ on `\\d`, `\\w` and `\\s` outside ASCII, so a class keeps only what both match
# and a negated class leaves out whatever either might.
Bounds = tuple[Ranges, Ranges]


def grammar(schema: dict[str, Any]) -> str:
    """GBNF for the documents valid against `schema`; InvalidRequest when it cannot be."""
    # The checks below read keywords by their meaning (`required` as a list of names):
    # a schema that is not one (`"required": 5`) stops here, not in a TypeError.
    jsonschemas.check(schema)
    schema = _any_value_subschemas(schema)
    unenforced = sorted({*unenforced_keywords(schema), *overlapping_one_of(schema)})
    if unenforced:
        raise errors.InvalidRequest(
            "The JSON schema uses keywords the output grammar cannot enforce: "
            + ", ".join(unenforced)
            + ". Remove them (and check the values yourself) so that the output is "
            "guaranteed to validate."
        )
    from llama_cpp import llama_grammar

    base: Any = llama_grammar.SchemaConverter

    class Converter(base):  # type: ignore[misc]  # llama_cpp.llama_grammar is untyped: subclassing Any
        def _visit_pattern(self, pattern: str, name: str) -> str:
            rule: str = self._add_rule(name, f'"\\"" {pattern_expression(pattern)} "\\"" space')
            return rule

        # The converter's own literal escapes only quotes and line breaks, so the JSON
        # text of a const, enum value or property name with a backslash (every JSON
        # escape has one) reached the output unescaped or broke the grammar.
        def _format_literal(self, literal: str) -> str:
            return _literal(literal)

        def _generate_constant_rule(self, value: Any) -> str:
            return _literal(jsontext.dumps(value))

        # The converter names a ref's rule by the ref's last segment and reuses any
        # rule already of that name: `#/$defs/a` took a property `a`'s rule, and
        # `#/$defs/string` the built-in string's. Here each ref has a rule of its own.
        def _resolve_ref(self, ref: str) -> str:
            found = ref_rules.get(ref)
            if found is None:
                if ref in self._refs_being_resolved:
                    raise KeyError(ref)  # refers to itself
                self._refs_being_resolved.add(ref)
                found = self.visit(self._refs[ref], ref.split("/")[-1])
                self._refs_being_resolved.remove(ref)
                ref_rules[ref] = found
            return found

        def visit(self, node: dict[str, Any], name: str) -> str:
            # The converter keeps its built-in rules' names (`string`, `integral-part`,
            # ...) from schemas' rules before it replaces the characters a rule name
            # cannot hold, and its built-ins take whatever rule has their name: a
            # property "integral part" became the digits of every number. Replaced
            # first, such a name is told apart from the built-in's.
            name = llama_grammar.INVALID_RULE_CHARS_RE.sub("-", name)
            # The converter writes an enum (or an anyOf of constants) as one
            # alternative per value. llama.cpp's grammar keeps a stack per alternative
            # alive and checks every one against the whole vocabulary each step: 100
            # values cost 0.1-0.3 s a token, 8,000 half a minute, for every slot of
            # the replica. A trie keeps one stack per distinct next character.
            values = _constants(node)
            if values is not None and "const" not in node:
                rule: str = self._add_rule(
                    name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root",
                    alternation([jsontext.dumps(value) for value in values]),
                )
                return rule
            found: str = super().visit(node, name)
            return found

    ref_rules: dict[str, str] = {}
    try:
        converter = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        # resolve_refs rewrites the schema it is given.
        resolved = converter.resolve_refs(copy.deepcopy(schema), "input")
        converter.visit(resolved, "")
        text: str = converter.format_grammar()
    except errors.InvalidRequest:
        raise
    except KeyError as exc:
        raise errors.InvalidRequest(
            f"The JSON schema cannot be turned into a grammar: {exc} is not defined, or "
            "refers to itself (recursive schemas are not supported)."
        ) from None
    except (AssertionError, ValueError, TypeError, AttributeError, IndexError) as exc:
        # The converter reports unsupported schemas with asserts and whatever breaks.
        detail = str(exc) or type(exc).__name__
        raise errors.InvalidRequest(
            f"The JSON schema cannot be turned into a grammar: {detail}."
        ) from None
    except RecursionError:
        raise errors.InvalidRequest(
            "The JSON schema cannot be turned into a grammar: it nests or refers to "
            "itself too deeply."
        ) from None
    # Rules end at "\n" only: `splitlines` also breaks at U+2028, U+2029 and NEL,
    # which a literal holds as themselves (a const or enum value with one).
    return "\n".join(_strict_rule(line) for line in text.split("\n"))


def _strict_rule(line: str) -> str:
    """A line of the converter's grammar, with its loose character and date rules
    replaced (see `_STRICT_CHAR_RULE`, `_STRICT_DATE_RULE`)."""
    if line.startswith(_LOOSE_CHAR_RULE):
        return _STRICT_CHAR_RULE + line[len(_LOOSE_CHAR_RULE) :]
    if line.startswith(_LOOSE_DATE_RULE):
        return _STRICT_DATE_RULE
    return line


def _any_value_subschemas(node: Any) -> Any:
    """`node` with each subschema that allows any value (`true`, `{}`, annotations only)
    written so that the converter allows any value; a `false` one is left for
    `unenforced_keywords` to refuse."""
    if not isinstance(node, dict):
        return node

    def sub(value: Any) -> Any:
        if value is True:
            return dict(_ANY_VALUE)
        if isinstance(value, dict) and all(key in _ANNOTATIONS for key in value):
            return {**value, **_ANY_VALUE}
        return _any_value_subschemas(value)

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA or key.startswith("x-"):
            out[key] = value
        elif key in _SUBSCHEMA or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = sub(value)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [sub(v) for v in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: sub(v) for name, v in value.items()}
        else:
            out[key] = _any_value_subschemas(value)
    return out


def unenforced_keywords(schema: Any, path: str = "") -> Iterator[str]:
    """`path.keyword` for each keyword of `schema` (and its subschemas) that the grammar
    would not enforce, with what about it is not enforced."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from unenforced_keywords(item, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    yield from _combination_gaps(schema, path)
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key in UNENFORCED:
            yield where
        elif key in _SUBSCHEMA and value is False:
            yield f"{where} (false: no value is allowed)"
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list) and False in value:
            yield f"{where} (a false schema: no value is allowed)"
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if sub is False:
                    yield f"{where}.{name} (false: no value is allowed)"
                yield from unenforced_keywords(sub, f"{where}.{name}")
        elif key not in _DATA and not key.startswith("x-"):
            yield from unenforced_keywords(value, where)


def _combination_gaps(node: dict[str, Any], path: str) -> Iterator[str]:
    """Keyword combinations llama-cpp-python's converter gets wrong: it keeps one keyword
    and drops its siblings, or lets through documents that do not validate."""
    at = f"{path}." if path else ""
    constraints = sorted(k for k in node if k not in _ANNOTATIONS and not k.startswith("x-"))

    def beside(key: str, allowed: frozenset[str] = frozenset()) -> Iterator[str]:
        others = [k for k in constraints if k != key and k not in allowed]
        if key in node and others:
            yield f"{at}{key} (with {', '.join(others)})"

    yield from beside("$ref")
    yield from beside("anyOf")
    yield from beside("enum", frozenset({"type"}))
    yield from beside("const", frozenset({"type"}))
    if isinstance(node.get("type"), list) and len(constraints) > 1:
        yield f"{at}type (a list, with {', '.join(k for k in constraints if k != 'type')})"
    for key in ("enum", "const"):
        values = node.get(key) if key == "enum" else [node.get(key)]
        kind = node.get("type")
        typed = key in node and isinstance(kind, str) and isinstance(values, list)
        if typed and any(not _is_json_type(v, str(kind)) for v in values or ()):
            yield f"{at}{key} (values that are not of type {kind})"
    if "oneOf" in node and "discriminator" not in node:
        yield f"{at}oneOf (without a discriminator: use anyOf)"
    if "allOf" in node:
        parts = node["allOf"] if isinstance(node["allOf"], list) else []
        if not all(isinstance(p, dict) and "properties" in p and "$ref" not in p for p in parts):
            yield f"{at}allOf (other than of object schemas with properties)"
        else:
            yield from _all_of_gaps(parts, at)
        # The converter writes the sibling properties and drops the allOf, or the
        # allOf and drops the siblings.
        yield from beside("allOf", frozenset({"type"}))
    properties = node.get("properties")
    if isinstance(properties, dict):
        missing = [n for n in node.get("required", []) if n not in properties]
        if missing:
            yield f"{at}required (names not in properties: {', '.join(map(str, missing))})"
        if node.get("additionalProperties", False) is not False:
            yield f"{at}additionalProperties (other than false, with properties)"
    elif node.get("required"):
        yield f"{at}required (without properties)"
    if "items" not in node and "prefixItems" not in node:
        yield from (f"{at}{k} (without items)" for k in ("minItems", "maxItems") if k in node)
    if "prefixItems" in node:
        yield from (
            f"{at}{k} (with prefixItems)" for k in ("items", "minItems", "maxItems") if k in node
        )
    for key in ("minLength", "maxLength"):
        for other in ("pattern", "format"):
            if key in node and other in node:
                yield f"{at}{key} (with {other})"
    for key in _REPETITIONS:
        count = node.get(key)
        if isinstance(count, int | float) and count > MAX_REPETITIONS:
            yield f"{at}{key} (over {MAX_REPETITIONS:,}: the grammar spells out each one)"
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
        least, most = node.get(low), node.get(high)
        # No value can meet these; the converter wrote the lower bound and dropped the other.
        if isinstance(least, int) and isinstance(most, int) and least > most:
            yield f"{at}{low} (above {high})"
    fmt = node.get("format")
    if node.get("type") in (None, "string") and isinstance(fmt, str):
        # The converter writes a pattern rather than a format when a node has both.
        if fmt in _ENFORCED_FORMATS and "pattern" in node:
            yield f"{at}format (with pattern)"
        elif fmt in _CHECKED_FORMATS - _ENFORCED_FORMATS:
            yield f"{at}format ({fmt} is not enforced)"


# `overlapping_one_of`'s "start at the root": a JSON null in the schema is None, so
# None cannot say it (found by the body fuzzer: a null under a keyword JSON Schema does
# not define recursed from the root again until RecursionError, a 500).
_ROOT: Any = object()


def overlapping_one_of(root: Any, node: Any = _ROOT, path: str = "") -> Iterator[str]:
    """`path.oneOf` for each oneOf (with a discriminator) of `root` whose branches a
    document might match more than one of. The converter writes a oneOf as an anyOf,
    which keeps only "at least one"; with a discriminator that each branch requires as
    a constant of its own, no document matches two."""
    node = root if node is _ROOT else node
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from overlapping_one_of(root, item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    branches = node.get("oneOf")
    if isinstance(branches, list) and len(branches) > 1 and "discriminator" in node:
        at = f"{path}.oneOf" if path else "oneOf"
        discriminator = node["discriminator"]
        name = discriminator.get("propertyName") if isinstance(discriminator, dict) else None
        seen: dict[str, int] = {}
        for i, branch in enumerate(branches):
            values = _discriminator_values(root, branch, name)
            if values is None:
                yield f"{at} (branch {i} does not require {name!r} to be a constant)"
                continue
            for value in values:
                key = jsontext.dumps(float(value) if _is_json_type(value, "number") else value)
                if key in seen and seen[key] != i:
                    yield f"{at} (branches {seen[key]} and {i} both allow {name!r} {value!r})"
                seen.setdefault(key, i)
    for key, value in node.items():
        if key not in _DATA and not key.startswith("x-"):
            yield from overlapping_one_of(root, value, f"{path}.{key}" if path else key)


def _discriminator_values(root: Any, branch: Any, name: Any) -> list[Any] | None:
    """The values an object schema `branch` (or the local `$ref` it is) requires its
    property `name` to take, or None when it does not require it to be a constant."""
    for _ in range(32):  # a ref to a ref ...; a cycle is refused elsewhere
        ref = branch.get("$ref") if isinstance(branch, dict) else None
        if not isinstance(ref, str):
            break
        branch = _pointer(root, ref)
    if not isinstance(branch, dict) or not isinstance(name, str):
        return None
    properties, required = branch.get("properties"), branch.get("required")
    if not isinstance(properties, dict) or not isinstance(required, list):
        return None
    if name not in required or name not in properties:
        return None
    return _constants(properties[name])


def _pointer(root: Any, ref: str) -> Any:
    """What the local reference `ref` (`#/$defs/x`) points to in `root`, else None."""
    if not ref.startswith("#/"):
        return None
    target = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    return target


def _all_of_gaps(parts: list[dict[str, Any]], at: str) -> Iterator[str]:
    """What the converter drops of an allOf of object schemas: it writes one object of
    all the parts' properties (each required) and nothing else of any part, and of a
    property two parts list, one part's schema."""
    kept = {"properties", "required"}
    for i, part in enumerate(parts):
        other = sorted(
            k
            for k in part
            if k not in kept and k not in _ANNOTATIONS and not k.startswith("x-")
            and not (k == "type" and part[k] == "object")
        )  # fmt: skip
        if other:
            yield f"{at}allOf[{i}] ({', '.join(other)} beside properties)"
    seen: set[str] = set()
    for part in parts:
        properties = part["properties"] if isinstance(part["properties"], dict) else {}
        for name in properties:
            if name in seen:
                yield f"{at}allOf (property {name!r} in more than one part)"
            seen.add(name)


def _is_json_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        whole = isinstance(value, float) and value.is_integer()
        return whole or (isinstance(value, int) and not isinstance(value, bool))
    checks: dict[str, Any] = {
        "string": lambda v: isinstance(v, str),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    check = checks.get(kind)
    return bool(check(value)) if check is not None else True


# --- patterns ---------------------------------------------------------------------------


def pattern_expression(pattern: str) -> str:
    """A GBNF expression for the JSON text (between the quotes) of every string that
    matches the ECMA-262 `pattern`, as JSON Schema means it (a search: unanchored ends
    match anything)."""
    body = pattern
    anchored_start = body.startswith("^")
    # '$' ends the pattern unless escaped: preceded by an odd number of backslashes.
    anchored_end = body.endswith("$") and (len(body) - 1 - len(body[:-1].rstrip("\\"))) % 2 == 0
    body = body[1 if anchored_start else 0 : len(body) - 1 if anchored_end else len(body)]
    parser = _PatternParser(pattern, body)
    expression = parser.alternation()
    if parser.i != len(body):
        parser.fail("unbalanced ')'")
    anything = _class_expression(((0, _MAX_CODEPOINT),)) + "*"
    parts = [
        *([] if anchored_start else [anything]),
        f"({expression})",
        *([] if anchored_end else [anything]),
    ]
    return " ".join(parts)


class _PatternParser:
    """Recursive descent over a regular expression, emitting GBNF as it goes."""

    def __init__(self, pattern: str, body: str) -> None:
        self.pattern = pattern
        self.body = body
        self.i = 0

    def fail(self, what: str) -> NoReturn:
        raise errors.InvalidRequest(
            f"The JSON schema's pattern {self.pattern!r} cannot be turned into a grammar: {what}."
        )

    def peek(self) -> str:
        return self.body[self.i] if self.i < len(self.body) else ""

    def alternation(self) -> str:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return " | ".join(b or '""' for b in branches)

    def sequence(self) -> str:
        items: list[str] = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            items.append(atom + self.quantifier())
        return " ".join(items)

    def atom(self) -> str:
        c = self.peek()
        self.i += 1
        if c == "(":
            if self.body.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                self.fail("lookarounds and named groups are not supported")
            inner = self.alternation()
            if self.peek() != ")":
                self.fail("unbalanced '('")
            self.i += 1
            return f"({inner or chr(34) * 2})"
        if c == "[":
            return _class_expression(self.char_class())
        if c == ".":
            # ECMA's '.' leaves out line terminators; Python's only '\\n'.
            return _class_expression(
                _subtract(_ALL, ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)))
            )
        if c == "\\":
            return _class_expression(self.escape(in_class=False)[0])
        if c in ("^", "$"):
            self.fail(f"'{c}' is supported only at the start or the end")
        if c in ("*", "+", "?") or (c == "{" and self._repetition_ahead(self.i - 1)):
            self.fail(f"nothing to repeat before '{c}'")
        return _class_expression(((ord(c), ord(c)),))

    def quantifier(self) -> str:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            out = c
        elif c == "{" and (match := _REPETITION.match(self.body, self.i)):
            self.i = match.end()
            low, comma, high = match.group(1), match.group(2), match.group(3)
            if high and int(high) < int(low):
                self.fail(f"the repetition {match.group(0)} is empty")
            out = (
                f"{{{int(low)},{int(high)}}}"
                if high
                else f"{{{int(low)},}}"
                if comma
                else f"{{{int(low)}}}"
            )
        elif c == "{" and _OPEN_REPETITION.match(self.body, self.i):
            # Python reads {,n} as {0,n}, ECMA-262 as the literal text: no translation suits both.
            self.fail("'{,n}' means different things to different engines; write '{0,n}'")
        else:
            return ""
        if self.peek() == "?":  # lazy: the same strings
            self.i += 1
        if self.peek() in ("*", "+", "?") or _REPETITION.match(self.body, self.i):
            self.fail("a quantifier cannot follow another")
        return out

    def _repetition_ahead(self, at: int) -> bool:
        """Whether a `{n}`, `{n,}` or `{n,m}` begins at `at` (else '{' is a literal)."""
        return _REPETITION.match(self.body, at) is not None

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        surely: list[tuple[int, int]] = []
        maybe: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c == "":
                self.fail("unbalanced '['")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            member = self.class_member()
            if self.peek() == "-" and self.body[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                start, end = _one_character(member), _one_character(self.class_member())
                if start is None or end is None:
                    self.fail("a range needs a single character at each end")
                if end < start:
                    self.fail("a range is out of order")
                surely.append((start, end))
                maybe.append((start, end))
            else:
                surely.extend(member[0])
                maybe.extend(member[1])
        if negated:
            return _subtract(_ALL, _normalize(tuple(maybe)))
        return _normalize(tuple(surely))

    def class_member(self) -> Bounds:
        c = self.peek()
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        return ((ord(c), ord(c)),), ((ord(c), ord(c)),)

    def escape(self, *, in_class: bool) -> Bounds:
        c = self.peek()
        if c == "":
            self.fail("it ends with a lone backslash")
        self.i += 1
        if c.lower() in ("d", "w", "s"):
            surely, maybe = _shorthand(c.lower())
            return (
                (_subtract(_ALL, maybe), _subtract(_ALL, surely))
                if c.isupper()
                else (surely, maybe)
            )
        if c == "0" and self.peek().isdigit():
            self.fail("octal escapes are not supported")
        if c in _CHAR_ESCAPES:
            code = _CHAR_ESCAPES[c]
        elif c in ("x", "u"):
            digits = 2 if c == "x" else 4
            text = self.body[self.i : self.i + digits]
            if len(text) != digits or not all(h in "0123456789abcdefABCDEF" for h in text):
                self.fail(f"'\\{c}' needs {digits} hex digits")
            self.i += digits
            code = int(text, 16)
        elif c == "b" and in_class:
            code = 0x08
        elif c.isalnum():
            self.fail(f"the escape '\\{c}' is not supported")
        else:
            code = ord(c)
        return ((code, code),), ((code, code),)


@functools.cache
def _python_classes() -> dict[str, Ranges]:
    """The characters Python's `re` matches with `\\d`, `\\w` and `\\s` (computed once,
    in about half a second, when a pattern first uses one)."""
    everything = "".join(map(chr, range(_MAX_CODEPOINT + 1)))
    return {
        name: tuple((m.start(), m.end() - 1) for m in re.finditer(f"\\{name}+", everything))
        for name in "dws"
    }


def _shorthand(name: str) -> Bounds:
    """(matched by both ECMA-262 and Python, matched by either) for `\\d`, `\\w`, `\\s`."""
    ecma = {
        "d": ((0x30, 0x39),),
        "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
        "s": _ECMA_SPACE,
    }[name]
    python = _python_classes()[name]
    return _intersect(ecma, python), _normalize(ecma + python)


def _one_character(bounds: Bounds) -> int | None:
    """The character a class member stands for, if it is exactly one."""
    surely, maybe = bounds
    if surely == maybe and len(surely) == 1 and surely[0][0] == surely[0][1]:
        return surely[0][0]
    return None


def _normalize(ranges: Ranges) -> Ranges:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)


def _subtract(ranges: Ranges, removed: Ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    for low, high in _normalize(ranges):
        for r_low, r_high in _normalize(removed):
            if r_high < low or r_low > high:
                continue
            if r_low > low:
                out.append((low, r_low - 1))
            low = r_high + 1
            if low > high:
                break
        if low <= high:
            out.append((low, high))
    return tuple(out)


def _intersect(ranges: Ranges, kept: Ranges) -> Ranges:
    return _subtract(ranges, _subtract(((0, _MAX_CODEPOINT),), kept))


def _class_expression(ranges: Ranges) -> str:
    """GBNF writing one character of `ranges` as JSON string text: raw when JSON allows
    it, else its escape (characters without a short escape are left out)."""
    raw = _subtract(ranges, _RAW_FORBIDDEN)
    escaped = [_ESCAPES[code] for code in sorted(_ESCAPES) if _intersect(ranges, ((code, code),))]
    if raw == ranges and len(raw) == 1 and raw[0][0] == raw[0][1]:
        return _literal(chr(raw[0][0]))
    options = []
    if raw:
        options.append("[" + "".join(_range_text(low, high) for low, high in raw) + "]")
    options.extend(_literal(text) for text in escaped)
    if not options:
        raise errors.InvalidRequest(
            "The JSON schema's pattern needs a character that a JSON string can only "
            "hold as a \\u escape, which the output grammar does not write."
        )
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _range_text(low: int, high: int) -> str:
    return _char_text(low) if low == high else f"{_char_text(low)}-{_char_text(high)}"


def _char_text(code: int) -> str:
    if code <= 0xFF:
        return f"\\x{code:02X}"
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


def _constants(node: Any) -> list[Any] | None:
    """The values a schema allows when it is a list of them (an `enum`, a `const`, an
    `anyOf` of those), else None."""
    if not isinstance(node, dict) or isinstance(node.get("type"), list):
        return None
    keys = {k for k in node if k not in _ANNOTATIONS and not k.startswith("x-")} - {"type"}
    if keys == {"const"}:
        return [node["const"]]
    if keys == {"enum"} and isinstance(node["enum"], list):
        return list(node["enum"])
    if keys == {"anyOf"} and isinstance(node["anyOf"], list) and node["anyOf"]:
        members = [_constants(member) for member in node["anyOf"]]
        if all(m is not None for m in members):
            return [value for m in members if m is not None for value in m]
    return None


def alternation(texts: Sequence[str]) -> str:
    """GBNF matching exactly `texts`, common prefixes written once (a trie)."""
    if not texts:
        raise errors.InvalidRequest("The JSON schema has an enum with no values.")
    return _trie(sorted(set(texts)))


def _trie(texts: list[str]) -> str:
    """`texts`: sorted, distinct, non-empty list (one may be "")."""
    branches = ['""'] if texts[0] == "" else []
    rest = texts[1:] if texts[0] == "" else texts
    for _, grouped in itertools.groupby(rest, key=lambda text: text[0]):
        group = list(grouped)
        prefix = _shared_prefix(group[0], group[-1])  # sorted: theirs is everyone's
        if len(group) == 1:
            branches.append(_literal(prefix))
        else:
            branches.append(f"{_literal(prefix)} {_trie([text[len(prefix) :] for text in group])}")
    return branches[0] if len(branches) == 1 else "(" + " | ".join(branches) + ")"


def _shared_prefix(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return a[:i]
    return a if len(a) <= len(b) else b


def literal(text: str) -> str:
    """A GBNF string literal that matches exactly `text`."""
    return _literal(text)


def _literal(text: str) -> str:
    """A GBNF string literal that matches exactly `text`."""
    return '"' + "".join(_literal_char(c) for c in text) + '"'


def _literal_char(c: str) -> str:
    if c in '"\\':
        return "\\" + c
    return _char_text(ord(c)) if ord(c) < 0x20 or ord(c) == 0x7F else c
