"""Parse an HTTP JSON body into a dialect's pydantic model, or explain what is wrong.

Pure. Failures are `blazar.api.errors.InvalidRequest` whose message names the field
(`messages[0].content`) and whose metadata carries it as `param`, so every dialect can
render a 400 that tells the user what to fix. A body model that derives from
`StrictBody` refuses the top-level fields it does not know, all of them by name, in
the words its API uses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeAlias, TypeVar

import pydantic

from blazar.api import errors, jsontext

M = TypeVar("M", bound=pydantic.BaseModel)

PARAM_KEY = "param"
# The metadata key of a machine-readable error code a dialect may show (OpenAI's
# `error.code`), for errors the shim finds before the daemon sees the request.
CODE_KEY = "code"
UNKNOWN_PARAMETER = "unknown_parameter"

# `json.loads` turns a `\uD800` escape (or, decoding bytes with surrogatepass, its
# UTF-8 form) into a surrogate code point, and joins a valid pair into one character,
# so any surrogate left in a string is unpaired.
_SURROGATE = re.compile("[\\ud800-\\udfff]")

# Where a node sits in the document: (parent's path, key or index), None at the top.
_Path: TypeAlias = "tuple[_Path, int | str] | None"


class StrictBody(pydantic.BaseModel):
    """A whole request body that refuses the top-level fields it does not declare,
    rather than drop them and answer as if they had not been sent: a field a client
    sends must do something, or be refused. A field sent as null is one not sent, as
    OpenAI treats it (an argument it does not recognise passes when null). Nested
    objects keep their own model's policy.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = field_names(cls)
        return {k: v for k, v in data.items() if v is not None or k in known}

    @classmethod
    def unknown_fields_message(cls, names: Sequence[str]) -> str:
        """What the 400 says about `names` (sorted, at least one); an API overrides it
        with its own words."""
        quoted = ", ".join(f"'{name}'" for name in names)
        plural = "s" if len(names) > 1 else ""
        return f"Unknown parameter{plural}: {quoted}."


def field_names(model: type[pydantic.BaseModel]) -> frozenset[str]:
    """The top-level keys `model` takes, under the names clients send (aliases)."""
    return frozenset(info.alias or name for name, info in model.model_fields.items())


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate `raw` against `model`; unknown fields are the model's business, but every
    string in the body, known or not, must be valid Unicode."""
    try:
        document = jsontext.loads(raw)
    except jsontext.NotJSON as exc:
        raise errors.InvalidRequest(
            f"We could not parse the JSON body of your request ({exc}). "
            "The body must be a JSON object."
        ) from None
    if not isinstance(document, dict):
        raise errors.InvalidRequest(
            f"The request body must be a JSON object, not {errors.json_type(document)}."
        )
    _check_unicode(document)
    try:
        return model.model_validate(document, strict=True)
    except pydantic.ValidationError as exc:
        if issubclass(model, StrictBody) and (unknown := unknown_fields(exc)):
            raise errors.InvalidRequest(
                model.unknown_fields_message(unknown),
                metadata={PARAM_KEY: unknown[0], CODE_KEY: UNKNOWN_PARAMETER},
            ) from None
        raise invalid_field(exc, document) from None


def unknown_fields(exc: pydantic.ValidationError) -> list[str]:
    """The top-level fields `exc` refuses as not declared, sorted: reported before any
    other problem, since a client that sent them meant something the server does not
    do, and every one of them at once, so that one answer names all there are."""
    return sorted(
        str(problem["loc"][0])
        for problem in exc.errors(include_url=False, include_context=False, include_input=False)
        if problem["type"] == "extra_forbidden" and len(problem["loc"]) == 1
    )


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


def _check_unicode(document: dict[str, Any]) -> None:
    """InvalidRequest naming a string (key or value) that holds an unpaired surrogate:
    such a string has no UTF-8 form, so neither protobuf, the engine nor our own JSON
    responses could carry it.

    One pass without recursion (a body may nest as deep as `json.loads` allows). A
    container's path is a linked list of (parent, key), rendered only for the offender,
    so the walk stays linear in the size of the body however deep or wide it is.
    """
    stack: list[tuple[dict[str, Any] | list[Any], _Path]] = [(document, None)]
    while stack:
        node, path = stack.pop()
        entries = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in entries:
            # `isascii` is O(1) on CPython's compact strings: most never reach the regex.
            if isinstance(key, str) and not key.isascii() and (bad := _SURROGATE.search(key)):
                raise _not_unicode(bad, (path, key), what="key")
            if isinstance(value, str):
                if not value.isascii() and (bad := _SURROGATE.search(value)):
                    raise _not_unicode(bad, (path, key), what="string")
            elif value and isinstance(value, dict | list):
                stack.append((value, (path, key)))


def _not_unicode(bad: re.Match[str], path: _Path, *, what: str) -> errors.InvalidRequest:
    items: list[int | str] = []
    while path is not None:
        path, item = path
        items.append(item)
    rendered = ""
    for item in reversed(items):
        if isinstance(item, int):
            rendered += f"[{item}]"
        else:
            # The name goes back in a JSON response, which cannot hold a lone surrogate.
            name = item.encode("utf-8", "backslashreplace").decode("utf-8")
            rendered += f".{name}" if rendered else name
    rendered = rendered or "body"
    return errors.InvalidRequest(
        f"Invalid value for '{rendered}': the {what} contains an unpaired surrogate "
        f"(\\u{ord(bad.group()):04x} at character {bad.start()}), so it is not valid "
        "Unicode. A character outside the BMP must be escaped as a surrogate pair.",
        metadata={PARAM_KEY: rendered},
    )


def invalid(message: str, *, param: str) -> errors.InvalidRequest:
    """A 400 about the request's field `param` (its path, `options.top_k`)."""
    return errors.InvalidRequest(message, metadata={PARAM_KEY: param})
