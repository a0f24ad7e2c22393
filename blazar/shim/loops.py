"""Refuses a request that came back to the daemon that sent it upstream (`blazar.api.via`).

Pure ASGI middleware, before any route: the answer is 508 Loop Detected in OpenAI's
error envelope, which is what the daemon's own upstream client reads (no other client
sends `x-blazar-via`), so the sending Lane's probe and requests fail saying why.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from blazar.api import via


class LoopGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and via.came_back(Headers(scope=scope).get(via.HEADER)):
            response = JSONResponse(
                {"error": {"message": via.LOOP_MESSAGE, "type": "loop_detected"}},
                status_code=via.LOOP_STATUS,
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
