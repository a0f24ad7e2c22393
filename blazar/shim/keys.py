"""The shim's key check: with an auth file, every route but the open ones needs a key
one of its tenants holds, checked before the route reads anything.

The data plane owns the keys (`blazar.dataplane.access`) and checks every call again;
the daemon hands the shim that check (`require`), so that routes which answer without
a call (a stored response looked up by id, Ollama's pull, push, create, copy and
delete, a path no route serves) refuse a caller without a key as the model routes do:
401 in the dialect's envelope, before they parse a body or say whether something
exists. Only the browser checks (`browsers.BrowserGuard`: a foreign `Origin`, a POST
that is not JSON, a preflight, which browsers send without credentials) come first;
they do no work either.

Open without a key (`OPEN_PATHS`): the probes `/healthz` and `/readyz`, `/metrics`,
and Ollama's `/` and `/api/version` (clients ask them before anything else, and they
say only that a server is there).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from blazar.api import errors
from blazar.shim import browsers, context

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/", "/api/version"})

_log = structlog.get_logger("blazar.shim")

# Raises errors.Unauthenticated unless the `Authorization` value holds a key in force.
Require = Callable[[str | None], None]


class KeyGuard:
    """Pure ASGI middleware (see the module docstring); with `require` None (no data
    plane's check given, as in the shim's own tests) every request passes."""

    def __init__(self, app: ASGIApp, *, require: Require | None, render: browsers.Render) -> None:
        self.app = app
        self._require = require
        self._render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._require is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            self._require(context.authorization(Headers(scope=scope)))
        except errors.BlazarError as err:
            client = scope.get("client")
            _log.info(
                "request.rejected",
                method=scope["method"],
                path=scope["path"],
                client=f"{client[0]}:{client[1]}" if client else "",
                reason=err.reason,
                credential=err.metadata.get("credential", ""),
            )
            response = await self._render(Request(scope, receive), err)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
