"""OpenAI's error envelope: any `BlazarError` as `{"error": {message, type, param,
code}}` with its HTTP status, and the parameter it blames in the client's own terms.

Pure: no IO, no clock, no logging.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from blazar.api import errors
from blazar.shim import http_errors, validation
from blazar.shim.openai import protocol


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: protocol.ErrorBody
    headers: dict[str, str]


@dataclass(frozen=True)
class Blame:
    """The parameters of one request that errors about its prompt (too long, empty)
    and its constraint blame: OpenAI names `messages` or `prompt`, and the constraint
    is whichever of `response_format`, `grammar` and `json_schema` was sent."""

    prompt: str = "messages"
    constraint: str = "response_format"
    # Where a tool's own fields sit: under `function` in Chat Completions
    # (`tools[0].function.parameters`), on the tool itself in the Responses API.
    tool_fields: str = ".function"
    # Whether the canonical request's turns are `prompt`'s items one for one, as
    # Chat Completions' `messages` are; otherwise an error in a turn blames `prompt`.
    turns_align: bool = True


CHAT_BLAME = Blame()
COMPLETION_BLAME = Blame(prompt="prompt")
EMBEDDING_BLAME = Blame(prompt="input")


# The OpenAI parameter behind the other fields of the gRPC request an error can blame.
_PARAMS = {
    "sampling.logit_bias": "logit_bias",
    "sampling.stop": "stop",
    "inputs": "input",
    "dimensions": "dimensions",
}


def error_response(err: errors.BlazarError, *, blame: Blame = CHAT_BLAME) -> ErrorResponse:
    """OpenAI's `{"error": {message, type, param, code}}` with the matching HTTP status."""
    status = http_errors.http_status(err)
    headers = http_errors.headers(err)
    field = err.metadata.get(errors.FIELD_KEY, "")
    param = err.metadata.get(validation.PARAM_KEY) or (
        {"prompt": blame.prompt, "constraint": blame.constraint}.get(field)
        or _PARAMS.get(field)
        or _tool_param(field, blame)
    )
    code: str | None = err.metadata.get(validation.CODE_KEY)
    if isinstance(err, errors.ModelNotFound):
        code, param = "model_not_found", "model"
    elif isinstance(err, errors.ContextLengthExceeded):
        code, param = "context_length_exceeded", param or blame.prompt
    elif status in (413, 429):
        code = err.reason.lower()
    elif status == 401:
        code = "invalid_api_key"
    body: protocol.ErrorBody = {
        "error": {
            "message": err.message,
            "type": _error_type(status),
            "param": param,
            "code": code,
        }
    }
    return ErrorResponse(status=status, body=body, headers=headers)


# Fields of a request's tools and tool turns that are one level deeper in OpenAI's
# shape: `tools[0].parameters` is `tools[0].function.parameters`.
_TOOL_FIELD = re.compile(
    r"^((?:tools|messages\[\d+\]\.tool_calls)\[\d+\])\.(name|parameters|arguments)$"
)


def _tool_param(field: str, blame: Blame) -> str | None:
    if field in ("tools", "tool_choice"):
        return field
    if field.startswith("messages[") and not blame.turns_align:
        return blame.prompt
    m = _TOOL_FIELD.match(field)
    if m:
        return f"{m.group(1)}{blame.tool_fields}.{m.group(2)}"
    # `messages[2].tool_calls[0]`: the same path in OpenAI's shape.
    return field if field.startswith("messages[") else None


def _error_type(status: int) -> str:
    # OpenAI answers most client mistakes, including a wrong key, as invalid_request_error.
    if status >= 500:
        return "server_error"
    if status == 429:
        return "rate_limit_error"
    if status == 403:
        return "permission_error"
    return "invalid_request_error"


def invalid(message: str, *, param: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, metadata={validation.PARAM_KEY: param})
