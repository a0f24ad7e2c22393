"""JSON schema to GBNF: which documents a `json_schema` constraint lets the model write.

Pure (no llama.cpp context, no IO). llama-cpp-python's `SchemaConverter` builds the
grammar, with three corrections, so that every document the grammar allows parses as
JSON and validates against the schema:

- String `pattern`s are translated here (`pattern_expression`). The converter's own
  translation let a pattern's `.` or `[^x]` write a raw `"` or backslash into the JSON
  text, copied `\\d` or `\\w` into GBNF (which has neither), and matched the pattern
  against the escaped text instead of the string's value.
- Keywords the converter ignores (`minimum`, `uniqueItems`, ...) are refused with a
  400 that names them, rather than promised and not kept.
- Its string character rule lets raw control characters into strings, which no JSON
  parser accepts; llama.cpp's own converter has since excluded them.

A grammar may be stricter than its schema (a pattern's control characters other than
\\b \\f \\n \\r \\t cannot be written), never looser.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from blazar.api import errors

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
# Keywords whose value maps names to subschemas (the names are not keywords).
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
# Keywords whose value is data, not a schema.
_DATA = frozenset({"enum", "const", "default", "examples"})

_LOOSE_CHAR_RULE = 'char ::= [^"\\\\] |'
_STRICT_CHAR_RULE = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'

_MAX_CODEPOINT = 0x10FFFF
# Characters JSON text cannot hold raw inside a string (DEL is excluded as well, as
# llama.cpp's converter does), and the escapes written for those it can express.
_RAW_FORBIDDEN = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))
_ESCAPES = {
    0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"
}  # fmt: skip
_CLASS_ESCAPES: dict[str, tuple[tuple[int, int], ...]] = {
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x2028, 0x2029), (0xFEFF, 0xFEFF)),
}
_CHAR_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
Ranges = tuple[tuple[int, int], ...]
# ECMA-262's `.`: anything but a line break.
_DOT: Ranges = ((0x00, 0x09), (0x0B, 0x0C), (0x0E, _MAX_CODEPOINT))


def grammar(schema: dict[str, Any]) -> str:
    """GBNF for the documents valid against `schema`; InvalidRequest when it cannot be."""
    unenforced = sorted(set(unenforced_keywords(schema)))
    if unenforced:
        raise errors.InvalidRequest(
            "The JSON schema uses keywords the output grammar cannot enforce: "
            + ", ".join(unenforced)
            + ". Remove them (and check the values yourself) so that the output is "
            "guaranteed to validate."
        )
    from llama_cpp import llama_grammar

    base: Any = llama_grammar.SchemaConverter

    class Converter(base):  # type: ignore[misc]
        def _visit_pattern(self, pattern: str, name: str) -> str:
            rule: str = self._add_rule(name, f'"\\"" {pattern_expression(pattern)} "\\"" space')
            return rule

    try:
        converter = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        resolved = converter.resolve_refs(schema, "input")
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
    return "\n".join(
        _STRICT_CHAR_RULE + line[len(_LOOSE_CHAR_RULE) :]
        if line.startswith(_LOOSE_CHAR_RULE)
        else line
        for line in text.splitlines()
    )


def unenforced_keywords(schema: Any, path: str = "") -> Iterator[str]:
    """`path.keyword` for each keyword of `schema` (and its subschemas) that the grammar
    would not enforce."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from unenforced_keywords(item, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key in UNENFORCED:
            yield where
        elif key in ("minLength", "maxLength") and "pattern" in schema:
            yield f"{where} (with pattern)"
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from unenforced_keywords(sub, f"{where}.{name}")
        elif key not in _DATA:
            yield from unenforced_keywords(value, where)


# --- patterns ---------------------------------------------------------------------------


def pattern_expression(pattern: str) -> str:
    """A GBNF expression for the JSON text (between the quotes) of every string that
    matches the ECMA-262 `pattern`, as JSON Schema means it (a search: unanchored ends
    match anything)."""
    body = pattern
    anchored_start = body.startswith("^")
    anchored_end = body.endswith("$") and not body.endswith("\\$")
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

    def fail(self, what: str) -> None:
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
            return _class_expression(
                _subtract(((0, _MAX_CODEPOINT),), ((0x0A, 0x0A), (0x0D, 0x0D)))
            )
        if c == "\\":
            return _class_expression(self.escape(in_class=False))
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
        elif c == "{" and self._repetition_ahead(self.i):
            end = self.body.index("}", self.i)
            counts = self.body[self.i + 1 : end].split(",")
            self.i = end + 1
            low = int(counts[0])
            high = counts[1].strip() if len(counts) == 2 else str(low)
            if high and int(high) < low:
                self.fail(f"the repetition {{{low},{high}}} is empty")
            out = f"{{{low},{high}}}" if len(counts) == 2 else f"{{{low}}}"
        else:
            return ""
        if self.peek() == "?":  # lazy: the same strings
            self.i += 1
        if self.peek() in ("*", "+", "?") or (
            self.peek() == "{" and self._repetition_ahead(self.i)
        ):
            self.fail("a quantifier cannot follow another")
        return out

    def _repetition_ahead(self, at: int) -> bool:
        """Whether a `{n}`, `{n,}` or `{n,m}` begins at `at` (else '{' is a literal)."""
        end = self.body.find("}", at)
        if end < 0:
            return False
        counts = self.body[at + 1 : end].split(",")
        return (
            1 <= len(counts) <= 2
            and counts[0].isdigit()
            and all(c.strip().isdigit() for c in counts[1:] if c.strip())
        )

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c == "":
                self.fail("unbalanced '['")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            low = self.class_member()
            if self.peek() == "-" and self.body[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                high = self.class_member()
                if (
                    len(low) != 1
                    or len(high) != 1
                    or low[0][0] != low[0][1]
                    or high[0][0] != high[0][1]
                ):
                    self.fail("a range needs a single character at each end")
                if high[0][0] < low[0][0]:
                    self.fail("a range is out of order")
                ranges.append((low[0][0], high[0][0]))
            else:
                ranges.extend(low)
        merged = _normalize(tuple(ranges))
        return _subtract(((0, _MAX_CODEPOINT),), merged) if negated else merged

    def class_member(self) -> Ranges:
        c = self.peek()
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        return ((ord(c), ord(c)),)

    def escape(self, *, in_class: bool) -> Ranges:
        c = self.peek()
        if c == "":
            self.fail("it ends with a lone backslash")
        self.i += 1
        if c.lower() in _CLASS_ESCAPES:
            ranges = _CLASS_ESCAPES[c.lower()]
            return _subtract(((0, _MAX_CODEPOINT),), ranges) if c.isupper() else ranges
        if c in _CHAR_ESCAPES:
            return ((_CHAR_ESCAPES[c], _CHAR_ESCAPES[c]),)
        if c in ("x", "u"):
            digits = 2 if c == "x" else 4
            code = self.body[self.i : self.i + digits]
            if len(code) != digits or not all(h in "0123456789abcdefABCDEF" for h in code):
                self.fail(f"'\\{c}' needs {digits} hex digits")
            self.i += digits
            return ((int(code, 16), int(code, 16)),)
        if c == "b" and in_class:
            return ((0x08, 0x08),)
        if c.isalnum():
            self.fail(f"the escape '\\{c}' is not supported")
        return ((ord(c), ord(c)),)


def _single(ranges: Ranges) -> bool:
    return len(ranges) == 1 and ranges[0][0] == ranges[0][1]


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


def _literal(text: str) -> str:
    """A GBNF string literal for `text` (no control characters)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
