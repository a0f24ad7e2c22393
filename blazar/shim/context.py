"""Per-request identity: the request id, the caller's credentials and session key, and
Blazar's own `x-blazar-*` request headers, read the same way in every dialect.

`RequestIdMiddleware` gives every HTTP request an `x-request-id` (echoed in the
response, bound to structlog's contextvars, and forwarded to the daemon as gRPC
metadata) and writes the one summary log line per request. `tool_choice` and
`parallel_tool_calls` read the `x-blazar-tool-choice` and `x-blazar-parallel-tool-calls`
headers, for dialects whose requests cannot say either.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, via
from blazar.shim import validation

REQUEST_ID_HEADER = "x-request-id"
# Requests with the same key stay on one replica (the gRPC `session`), in every dialect.
SESSION_HEADER = "x-blazar-session"
# The SLOPolicy a request is admitted under (the gRPC `slo`), in every dialect.
SLO_HEADER = "x-blazar-slo"
# Whether, and which, tools the model must call, for dialects whose requests cannot
# say (Ollama's): `auto`, `none`, `required` or a tool's name (see `tool_choice`).
TOOL_CHOICE_HEADER = "x-blazar-tool-choice"
# Whether the model may make more than one call in its turn, for dialects whose
# requests cannot say (Ollama's): `true` or `false` (see `parallel_tool_calls`).
PARALLEL_TOOL_CALLS_HEADER = "x-blazar-parallel-tool-calls"
_TOOL_CHOICES = {
    "auto": inference_pb2.ToolChoice.MODE_AUTO,
    "none": inference_pb2.ToolChoice.MODE_NONE,
    "required": inference_pb2.ToolChoice.MODE_REQUIRED,
}
_SCOPE_KEY = "blazar.request_id"

_log = structlog.get_logger("blazar.shim")


@dataclass(frozen=True)
class RequestContext:
    """What the shim forwards to the daemon about the HTTP caller."""

    request_id: str
    # `Bearer <key>`, from `Authorization` or Anthropic-style `x-api-key`.
    authorization: str | None
    # The `x-blazar-session` header; empty when not sent. Dialects fall back to their
    # own field (OpenAI's `user`) for the request's `session`.
    session: str = ""
    # The `x-blazar-slo` header; empty: the Lane's policy.
    slo: str = ""
    # The `x-blazar-tool-choice` header as sent; empty when not sent (see `tool_choice`).
    tool_choice: str = ""
    # The `x-blazar-parallel-tool-calls` header as sent (see `parallel_tool_calls`).
    parallel_tool_calls: str = ""
    # The `x-blazar-via` header as sent (the daemons the request went through, which
    # `loops.LoopGuard` checked); the data plane's upstream client adds this daemon.
    via: str = ""

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        items = [(REQUEST_ID_HEADER, self.request_id)]
        if self.authorization:
            # Escaped like the others: a placeholder key with a byte gRPC metadata cannot
            # carry (no auth file checks it) is ignored, not a 500; with an auth file,
            # `keys.KeyGuard` has refused such a key already (no tenant holds it).
            items.append(("authorization", _metadata_text(self.authorization)))
        if self.slo:
            # As metadata too, for the RPCs with no `slo` field (Embed, Tokenize): the
            # data plane checks the name on every route.
            items.append((SLO_HEADER, _metadata_text(self.slo)))
        if self.via:
            items.append((via.HEADER, _metadata_text(self.via)))
        return tuple(items)


def _metadata_text(value: str) -> str:
    """`value` as gRPC metadata can carry it (printable ASCII); other characters
    escaped, so that a name no policy can have is still refused by name."""
    return "".join(c if " " <= c <= "~" else f"\\x{ord(c):02x}" for c in value)


def of(request: Request) -> RequestContext:
    """The context of a request that went through `RequestIdMiddleware`."""
    request_id = request.scope.get(_SCOPE_KEY) or new_request_id()
    return RequestContext(
        request_id=str(request_id),
        authorization=authorization(request.headers),
        session=request.headers.get(SESSION_HEADER, ""),
        slo=request.headers.get(SLO_HEADER, ""),
        tool_choice=request.headers.get(TOOL_CHOICE_HEADER, ""),
        parallel_tool_calls=request.headers.get(PARALLEL_TOOL_CALLS_HEADER, ""),
        via=request.headers.get(via.HEADER, ""),
    )


def authorization(headers: Headers) -> str | None:
    """The caller's credentials as an `Authorization` value: that header, else
    Anthropic-style `x-api-key` as `Bearer <key>`; None when neither is sent."""
    found = headers.get("authorization")
    if not found and (key := headers.get("x-api-key")):
        found = f"Bearer {key}"
    return found


def tool_choice(value: str, *, tools: Sequence[str]) -> inference_pb2.ToolChoice | None:
    """The `x-blazar-tool-choice` header (`value`) for a request offering `tools` (their
    names): None when not sent (the default, auto); else `auto`, `none`, `required`, or
    the name of one of the tools, which the model must then call (a tool named like one
    of the three words cannot be named here). Anything else, and `required` or a name
    with no tools to call, is an InvalidRequest naming the header."""
    value = value.strip()
    if not value:
        return None
    mode = _TOOL_CHOICES.get(value)
    if mode == inference_pb2.ToolChoice.MODE_REQUIRED and not tools:
        raise _bad_tool_choice(
            f"'{TOOL_CHOICE_HEADER}: required' needs tools to call, and the request has none."
        )
    if mode is not None:
        return inference_pb2.ToolChoice(mode=mode)
    if value in tools:
        return inference_pb2.ToolChoice(mode=inference_pb2.ToolChoice.MODE_NAMED, name=value)
    offered = f"the request's tools: {', '.join(tools)}" if tools else "the request has no tools"
    raise _bad_tool_choice(
        f"Invalid value for the '{TOOL_CHOICE_HEADER}' header: {value!r} is not auto, none, "
        f"required or the name of a tool ({offered})."
    )


def _bad_tool_choice(message: str) -> errors.InvalidRequest:
    return validation.invalid(message, param=TOOL_CHOICE_HEADER)


def parallel_tool_calls(value: str) -> bool | None:
    """The `x-blazar-parallel-tool-calls` header (`value`): None when not sent (the
    default: calls may be parallel), else `true` or `false`; anything else is an
    InvalidRequest naming the header."""
    value = value.strip()
    if not value:
        return None
    if value in ("true", "false"):
        return value == "true"
    raise validation.invalid(
        f"Invalid value for the '{PARALLEL_TOOL_CALLS_HEADER}' header: {value!r}; use true "
        "or false.",
        param=PARALLEL_TOOL_CALLS_HEADER,
    )


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Pure ASGI middleware (BaseHTTPMiddleware would buffer streaming responses)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope[_SCOPE_KEY] = request_id
        started = time.monotonic()
        status_code = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                _log.info(
                    "http request",
                    method=scope["method"],
                    path=scope["path"],
                    status=status_code,
                    duration_ms=round((time.monotonic() - started) * 1000, 1),
                )
