"""What keeps a web page from driving a local Blazar: origins and JSON bodies.

A page in the user's browser may send requests to 127.0.0.1 like any other site, and
for a "simple" request (a form's content types, no custom headers) the browser asks
nobody first. So, before any route runs:

- A request with an `Origin` header (browsers send one with every cross-origin
  request and every POST) whose origin `serve --allow-origin` does not name is
  refused, 403 `ORIGIN_NOT_ALLOWED`; none is allowed by default. For an allowed origin,
  a preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered 204 with
  the CORS headers, and every response carries `Access-Control-Allow-Origin`.
- A POST whose body is not declared `application/json` (the type every official
  client sends, and one a page cannot send without a preflight) is refused, 415
  `UNSUPPORTED_MEDIA_TYPE`, unless it has no `Origin` and declares no type (no
  `Content-Type`, or `application/octet-stream`, which RFC 9110 reads the same) or
  `application/x-www-form-urlencoded`: no page sends the first (a form always declares
  its type, and a script's request carries its origin), and a form of the second
  percent-encodes every `{` and `"`, so its body is never a JSON object. Clients that
  wrap Ollama's API send the first (LiteLLM's `ollama` and `ollama_chat` providers),
  and `curl -d` the second, as in Ollama's own examples, since Ollama parses a body as
  JSON whatever it declares. `text/plain` and `multipart/form-data` stay refused: a
  form of either type can carry a JSON body.

Refusals are rendered by the caller's `render` (each dialect's own envelope).
Clients that are not browsers send no `Origin` and are unaffected by the first rule.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blazar.api import errors

Render = Callable[[Request, errors.BlazarError], Awaitable[Response]]

JSON = "application/json"
# What a body that declares no type is taken to be (RFC 9110, section 8.3).
UNDECLARED = "application/octet-stream"
# What `curl -d` declares: a form of this type cannot write a JSON object.
FORM = "application/x-www-form-urlencoded"
_ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
_PREFLIGHT_MAX_AGE_S = "600"
# Headers a page's script may read: the ones Blazar adds and a 429's Retry-After(-ms).
_EXPOSE = ", ".join(
    ("x-request-id", "request-id", "retry-after", "retry-after-ms", "x-blazar-lane",
     "x-blazar-replica", "x-blazar-prefix-reused", "x-blazar-prompt-tokens",
     "x-blazar-predicted-ttft-ms")
)  # fmt: skip


def _media_type(content_type: str | None) -> str | None:
    """A Content-Type's media type, lowercased and without its parameters."""
    if content_type is None:
        return None
    return content_type.split(";", 1)[0].strip().lower()


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type declares JSON (`application/json`, parameters allowed)."""
    return _media_type(content_type) == JSON


def body_allowed(content_type: str | None, *, origin: str | None) -> bool:
    """Whether a POST's body may reach the routes (see the module docstring): JSON, or
    from no browser's page (no `Origin`) a body that declares no type or curl's form
    type (read as JSON all the same)."""
    media = _media_type(content_type)
    return media == JSON or (media in (None, UNDECLARED, FORM) and origin is None)


class BrowserGuard:
    """Pure ASGI middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, allow_origins: Collection[str], render: Render) -> None:
        self.app = app
        self._allowed = {o.rstrip("/") for o in allow_origins}
        self._render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        method = scope["method"]
        if origin is not None and origin.rstrip("/") not in self._allowed:
            shown = origin[:200]
            refused: errors.BlazarError = errors.OriginNotAllowed(
                f"Requests from web pages of origin '{shown}' are refused; the server's "
                "owner can allow an origin with `blazar serve --allow-origin ORIGIN`.",
                metadata={"origin": shown},
            )
            await self._refuse(scope, receive, send, refused)
            return
        if (
            origin is not None
            and method == "OPTIONS"
            and "access-control-request-method" in headers
        ):
            await self._preflight(origin, headers, send)
            return
        if method == "POST" and not body_allowed(headers.get("content-type"), origin=origin):
            sent = headers.get("content-type")
            err = errors.UnsupportedMediaType(
                f"The request body must be JSON, sent with `Content-Type: {JSON}` "
                f"(it was {repr(sent[:100]) if sent else 'sent without a Content-Type'}); "
                f"with curl, add -H 'content-type: {JSON}'.",
                metadata={"content_type": (sent or "")[:100]},
            )
            await self._refuse(scope, receive, send, err)
            return
        if origin is None:
            await self.app(scope, receive, send)
            return

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"access-control-expose-headers", _EXPOSE.encode()),
                    (b"vary", b"Origin"),
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_cors)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, err: errors.BlazarError
    ) -> None:
        response = await self._render(Request(scope, receive), err)
        await response(scope, receive, send)

    async def _preflight(self, origin: str, headers: Headers, send: Send) -> None:
        allow = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", _ALLOW_METHODS.encode()),
            (b"access-control-max-age", _PREFLIGHT_MAX_AGE_S.encode()),
            (b"vary", b"Origin"),
        ]
        wanted = headers.get("access-control-request-headers")
        if wanted:
            allow.append((b"access-control-allow-headers", wanted.encode("latin-1")))
        await send({"type": "http.response.start", "status": 204, "headers": allow})
        await send({"type": "http.response.body", "body": b""})
