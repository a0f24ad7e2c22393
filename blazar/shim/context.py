"""Per-request identity: the request id, the caller's credentials and session key.

`RequestIdMiddleware` gives every HTTP request an `x-request-id` (echoed in the
response, bound to structlog's contextvars, and forwarded to the daemon as gRPC
metadata) and writes the one summary log line per request.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import structlog
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
# Requests with the same key stay on one replica (the gRPC `session`), in every dialect.
SESSION_HEADER = "x-blazar-session"
# The SLOPolicy a request is admitted under (the gRPC `slo`), in every dialect.
SLO_HEADER = "x-blazar-slo"
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

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        items = [(REQUEST_ID_HEADER, self.request_id)]
        if self.authorization:
            items.append(("authorization", self.authorization))
        return tuple(items)


def of(request: Request) -> RequestContext:
    """The context of a request that went through `RequestIdMiddleware`."""
    request_id = request.scope.get(_SCOPE_KEY) or new_request_id()
    authorization = request.headers.get("authorization")
    if not authorization and (key := request.headers.get("x-api-key")):
        authorization = f"Bearer {key}"
    return RequestContext(
        request_id=str(request_id),
        authorization=authorization,
        session=request.headers.get(SESSION_HEADER, ""),
        slo=request.headers.get(SLO_HEADER, ""),
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
