"""`blazar.shim.keys`: with the data plane's check given, every path but the open ones
is refused before it runs unless the caller's key passes the check."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from structlog.testing import capture_logs

from blazar.api import errors
from blazar.shim import http_errors, keys

GOOD = "Bearer bz-good"


async def render(request: Request, err: errors.BlazarError) -> Response:
    return JSONResponse({"reason": err.reason}, status_code=http_errors.http_status(err))


def require(authorization: str | None) -> None:
    if authorization != GOOD:
        raise errors.Unauthenticated("No key.")


def serve(
    method: str, path: str, headers: dict[str, str], *, check: keys.Require | None = require
) -> tuple[httpx.Response, int]:
    """The guarded app's answer, and how many requests reached the app behind it."""
    reached = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal reached
        reached += 1
        await JSONResponse({"ok": True})(scope, receive, send)

    guarded = keys.KeyGuard(app, require=check, render=render)

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://shim") as client:
            return await client.request(method, path, headers=headers)

    return asyncio.run(main()), reached


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("POST", "/v1/chat/completions", {}, 401),
        ("POST", "/v1/chat/completions", {"authorization": "Bearer bz-bad"}, 401),
        ("POST", "/v1/chat/completions", {"authorization": GOOD}, 200),
        ("POST", "/v1/messages", {"x-api-key": "bz-good"}, 200),
        ("POST", "/v1/messages", {"x-api-key": "bz-bad"}, 401),
        ("GET", "/v1/responses/resp_1", {}, 401),
        ("DELETE", "/api/delete", {}, 401),
        ("GET", "/no/such/path", {}, 401),
        ("GET", "/healthz/", {}, 401),  # only the open paths themselves
        *[(m, p, {}, 200) for p in sorted(keys.OPEN_PATHS) for m in ("GET", "HEAD")],
    ],
)
def test_only_the_open_paths_pass_without_a_key(
    method: str, path: str, headers: dict[str, str], status: int
) -> None:
    response, reached = serve(method, path, headers)
    assert response.status_code == status
    assert reached == (status == 200)
    if status == 401:
        assert response.json() == {"reason": "UNAUTHENTICATED"}


def test_without_a_check_every_request_passes() -> None:
    response, reached = serve("POST", "/v1/chat/completions", {}, check=None)
    assert (response.status_code, reached) == (200, 1)


def test_a_refused_caller_is_logged_with_where_it_came_from_and_never_its_key() -> None:
    with capture_logs() as logs:
        serve("POST", "/v1/chat/completions", {"authorization": "Bearer bz-bad"})
        serve("POST", "/v1/chat/completions", {"authorization": GOOD})
    rejected = [line for line in logs if line["event"] == "request.rejected"]
    assert len(rejected) == 1
    assert rejected[0]["reason"] == "UNAUTHENTICATED"
    assert rejected[0]["path"] == "/v1/chat/completions"
    assert rejected[0]["client"].startswith("127.0.0.1:")
    assert "bz-bad" not in repr(rejected[0])
