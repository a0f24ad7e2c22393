"""Refuses a request that came back to a daemon it passed through (`blazar.api.via`).

Pure ASGI middleware, before any route: the answer is 508 Loop Detected in OpenAI's
error envelope, which is what a daemon's upstream client reads (no other client sends
`x-blazar-via`), so the sending Lane's probe and requests fail saying why. A header
that is not a list of daemon ids is refused with its InvalidRequest, in the envelope
`render` gives (the dialect of the path).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from blazar.api import errors, via
from blazar.shim import browsers, validation


class LoopGuard:
    def __init__(self, app: ASGIApp, *, render: browsers.Render) -> None:
        self.app = app
        self._render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            ids = via.hops(Headers(scope=scope).get(via.HEADER))
        except errors.InvalidRequest as err:
            blamed = validation.invalid(err.message, param=via.HEADER)
            refusal = await self._render(Request(scope, receive), blamed)
            await refusal(scope, receive, send)
            return
        if via.came_back(ids):
            response = JSONResponse(
                {"error": {"message": via.LOOP_MESSAGE, "type": "loop_detected"}},
                status_code=via.LOOP_STATUS,
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
