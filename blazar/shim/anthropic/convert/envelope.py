"""Any `BlazarError` in Anthropic's error envelope, with Anthropic's error types.

Pure: no IO, no clock, no logging.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from blazar.api import errors
from blazar.shim import http_errors
from blazar.shim.anthropic import protocol

# Anthropic answers an overloaded API with 529, where the other dialects say 503.
OVERLOADED_STATUS = 529

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
    OVERLOADED_STATUS: "overloaded_error",
}


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: protocol.ErrorBody
    headers: dict[str, str]


# The metadata key under which an error raised in this dialect carries Anthropic's
# `error.details.error_code`, which clients act on (the `anthropic` client's message
# threads fall back to sending the whole conversation on `thread_unsupported_request`).
ERROR_CODE_KEY = "anthropic_error_code"

# A canonical tool's `parameters` are Anthropic's `input_schema`.
_PARAMETERS = re.compile(r"\b(tools\[\d+\])\.parameters\b")


def error_response(err: errors.BlazarError, *, request_id: str = "") -> ErrorResponse:
    """Anthropic's `{"type": "error", "error": {type, message}, "request_id"}`, with the
    status every dialect shares but for an unavailable server, which Anthropic calls
    overloaded (529). A 429 carries `retry-after`, as does an unavailable server with a
    hint (`http_errors.headers`)."""
    status = http_errors.http_status(err)
    if status == 503:
        status = OVERLOADED_STATUS
    message = err.message
    sizes = err.sizes() if isinstance(err, errors.ContextLengthExceeded) else None
    if sizes is not None:
        message = _overflow_message(sizes)
    if err.metadata.get(errors.FIELD_KEY, "").startswith("tools"):
        message = _PARAMETERS.sub(r"\1.input_schema", message)
    detail: protocol.ErrorDetail = {
        "type": _ERROR_TYPES.get(status, "api_error"),
        "message": message,
    }
    if code := err.metadata.get(ERROR_CODE_KEY):
        detail["details"] = {"error_code": code}
    body: protocol.ErrorBody = {"type": "error", "error": detail}
    if request_id:
        body["request_id"] = request_id
    return ErrorResponse(status=status, body=body, headers=http_errors.headers(err))


def _overflow_message(sizes: errors.ContextSizes) -> str:
    """A request that does not fit, in Anthropic's words, by which clients tell it from
    other bad requests (langchain-anthropic's ContextOverflowError looks for "prompt is
    too long", LiteLLM's ContextWindowExceededError for that or "exceed context limit")."""
    some = "at least " if sizes.at_least else ""
    if sizes.prompt_tokens > sizes.context_length:
        return (
            f"prompt is too long: {some}{sizes.prompt_tokens} tokens > "
            f"{sizes.context_length} maximum"
        )
    return (
        f"input length and `max_tokens` exceed context limit: {some}{sizes.prompt_tokens} + "
        f"{sizes.max_tokens} > {sizes.context_length}, decrease input length or `max_tokens` "
        "and try again"
    )
