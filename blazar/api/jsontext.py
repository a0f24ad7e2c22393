"""JSON text from a caller, parsed with one set of refusals.

`json.loads` fails in three ways on text a caller controls, and only one of them is a
`JSONDecodeError`: an integer literal past CPython's 4,300-digit conversion limit is a
plain `ValueError` (so is undecodable bytes), and the C decoder recurses once per level
of nesting until the interpreter's limit (`RecursionError`). Every caller-facing parse
goes through `loads`, which turns all three into `NotJSON`, so none of them escapes as
an internal error.
"""

from __future__ import annotations

import json
from typing import Any


class NotJSON(ValueError):
    """The text is not JSON Blazar can read; the message says why, for the caller."""


def loads(text: str | bytes, **options: Any) -> Any:
    """`json.loads(text, **options)`, or NotJSON."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise NotJSON("its arrays and objects are nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the digit limit
        raise NotJSON(str(exc)) from None
