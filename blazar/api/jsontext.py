"""JSON text from a caller, parsed with one set of refusals.

`json.loads` fails in three ways on text a caller controls, and only one of them is a
`JSONDecodeError`: an integer literal past CPython's 4,300-digit conversion limit is a
plain `ValueError` (so is undecodable bytes), and the C decoder recurses once per level
of nesting until the interpreter's limit (`RecursionError`). Every caller-facing parse
goes through `loads`, which turns all three into `NotJSON`, so none of them escapes as
an internal error, and refuses what Python reads but JSON has not (NaN, Infinity, a
number past a double's range).
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn


class NotJSON(ValueError):
    """The text is not JSON Blazar can read; the message says why, for the caller."""


def loads(text: str | bytes) -> Any:
    """The JSON value of `text`, or NotJSON. Python's decoder also reads NaN and
    (-)Infinity, which JSON does not have, and turns a number past a double's range
    (1e400) into infinity; both are refused here: a NaN temperature would reach a range
    check and be called "more than 2", an infinite enum value be written out as
    `Infinity`, which is not JSON either."""
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise NotJSON("its arrays and objects are nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the digit limit
        raise NotJSON(str(exc)) from None


def _constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(f"the number {shown} is out of a double's range")
    return value
