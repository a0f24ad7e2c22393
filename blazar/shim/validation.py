"""Parse an HTTP JSON body into a dialect's pydantic model, or explain what is wrong.

Pure. Failures are `blazar.api.errors.InvalidRequest` whose message names the field
(`messages[0].content`) and whose metadata carries it as `param`, so every dialect can
render a 400 that tells the user what to fix.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import pydantic

from blazar.api import errors

M = TypeVar("M", bound=pydantic.BaseModel)

PARAM_KEY = "param"


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate `raw` against `model`; unknown fields are the model's business."""
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.InvalidRequest(
            f"We could not parse the JSON body of your request ({exc}). "
            "The body must be a JSON object."
        ) from None
    if not isinstance(document, dict):
        raise errors.InvalidRequest(
            f"The request body must be a JSON object, not {_json_type(document)}."
        )
    try:
        return model.model_validate(document, strict=True)
    except pydantic.ValidationError as exc:
        raise invalid_field(exc, document) from None


def invalid_field(exc: pydantic.ValidationError, document: Any) -> errors.InvalidRequest:
    """The most specific problem in `exc`, located in the user's own terms."""
    problems = exc.errors(include_url=False, include_context=False, include_input=False)
    # Unions report one error per member; the deepest one is nearest to the user's mistake.
    problem = max(problems, key=lambda p: len(p["loc"]))
    missing = problem["type"] == "missing"
    path = field_path(problem["loc"], document, missing=missing)
    if missing:
        message = f"Missing required parameter: '{path}'."
    else:
        message = f"Invalid value for '{path}': {problem['msg']}."
    return errors.InvalidRequest(message, metadata={PARAM_KEY: path})


def field_path(loc: tuple[int | str, ...], document: Any, *, missing: bool = False) -> str:
    """Render a pydantic location as `a.b[0].c`, following only real keys of `document`
    (plus, for a missing field, the last key).

    Pydantic adds union member tags (`str`, `list[ContentPart]`) and validator names to
    locations; those are not keys in the user's JSON, so the walk skips them.
    """
    path = ""
    node = document
    for position, item in enumerate(loc):
        missing_key = missing and position == len(loc) - 1
        if isinstance(item, int) and isinstance(node, list) and 0 <= item < len(node):
            path += f"[{item}]"
            node = node[item]
        elif isinstance(item, str) and isinstance(node, dict) and (item in node or missing_key):
            path += f".{item}" if path else item
            node = node.get(item)
    return path or "body"


def _json_type(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null"
