"""JSON text from a caller, parsed with one set of refusals.

`json.loads` fails in three ways on text a caller controls, and only one of them is a
`JSONDecodeError`: an integer literal past CPython's 4,300-digit conversion limit is a
plain `ValueError` (so is undecodable bytes), and the C decoder recurses once per level
of nesting until the interpreter's limit (`RecursionError`). Every caller-facing parse
goes through `loads`, which turns all three into `NotJSON`, so none of them escapes as
an internal error, and refuses what Python reads but JSON has not (NaN, Infinity, a
number past a double's range). With `whole_characters`, it also refuses strings that
are not Unicode text: `"\\ud800"` (half of a UTF-16 surrogate pair, escaped) decodes
to a Python string no UTF-8 encoder takes, which fails wherever it is next written out
(a grammar handed to llama.cpp); callers that check each field's text themselves, to
name the field, leave it off.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn


class NotJSON(ValueError):
    """The text is not JSON Blazar can read; the message says why, for the caller."""


def loads(text: str | bytes, *, whole_characters: bool = False, unique_keys: bool = False) -> Any:
    """The JSON value of `text`, or NotJSON. Python's decoder also reads NaN and
    (-)Infinity, which JSON does not have, and turns a number past a double's range
    (1e400) into infinity; both are refused here: a NaN temperature would reach a range
    check and be called "more than 2", an infinite enum value be written out as
    `Infinity`, which is not JSON either. With `unique_keys`, an object that gives a
    key twice is refused too, where Python keeps the last (a manifest: as YAML's
    loader refuses it, `blazar.api.manifests`)."""
    hook = _unique if unique_keys else None
    try:
        value = json.loads(
            text, parse_constant=_constant, parse_float=_finite, object_pairs_hook=hook
        )
    except RecursionError:
        raise NotJSON("its arrays and objects are nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the digit limit
        raise NotJSON(str(exc)) from None
    if whole_characters:
        pattern = _SURROGATE_BYTES if isinstance(text, bytes) else _SURROGATE
        if pattern.search(text):  # type: ignore[arg-type]
            _refuse_lone_surrogates(value)
    return value


def dumps(value: Any) -> str:
    """`value` as JSON text, non-ASCII characters written as themselves (as a model
    writes them), except where half of a surrogate pair (read from a `"\\ud800"`
    escape) leaves only the \\u escapes: that text has a UTF-8 form, so it can go on
    the wire, into a prompt or into a grammar."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


# A \u escape of a UTF-16 surrogate (D800-DFFF): only then can a lone one be decoded.
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(value: Any) -> None:
    """NotJSON when a string or key of `value` holds half of a surrogate pair (a pair
    written as two escapes decodes to one character, which is fine)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                half = f"\\u{ord(item[exc.start]):04x}"
                raise NotJSON(
                    f"the string escape {half} is half of a UTF-16 surrogate pair, not a "
                    "character (write the pair, or the character itself)"
                ) from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {json.dumps(key)} is given twice in one object")
        out[key] = value
    return out


def _constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(f"the number {shown} is out of a double's range")
    return value
