"""`blazar.shim.browsers`: other origins' pages and bodies that are not JSON are refused
before any route runs; an allowed origin gets CORS."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from blazar.api import errors
from blazar.shim import browsers, http_errors

ALLOWED = "https://app.example"


async def render(request: Request, err: errors.BlazarError) -> Response:
    return JSONResponse({"reason": err.reason}, status_code=http_errors.http_status(err))


def serve(method: str, headers: dict[str, str]) -> tuple[httpx.Response, int]:
    """The guarded app's answer, and how many requests reached the app behind it."""
    reached = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal reached
        reached += 1
        await JSONResponse({"ok": True})(scope, receive, send)

    guarded = browsers.BrowserGuard(app, allow_origins=[ALLOWED + "/"], render=render)

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://shim") as client:
            return await client.request(method, "/v1/chat/completions", headers=headers)

    return asyncio.run(main()), reached


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("method", "headers", "status", "reason"),
    [
        ("POST", JSON, 200, None),
        ("POST", {"content-type": "application/json; charset=utf-8"}, 200, None),
        ("POST", {"content-type": "Application/JSON"}, 200, None),
        ("GET", {}, 200, None),
        # A body that declares no type, as LiteLLM's Ollama providers send it.
        ("POST", {}, 200, None),
        ("POST", {"content-type": "application/octet-stream"}, 200, None),
        # ... but not from a page: a script's request carries its origin.
        ("POST", {"origin": ALLOWED}, 415, "UNSUPPORTED_MEDIA_TYPE"),
        (
            "POST",
            {"content-type": "application/octet-stream", "origin": ALLOWED},
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        ("POST", {"content-type": "text/html"}, 415, "UNSUPPORTED_MEDIA_TYPE"),
        ("POST", {"content-type": "text/plain"}, 415, "UNSUPPORTED_MEDIA_TYPE"),
        # What `curl -d` declares, as in Ollama's examples: a form of that type
        # percent-encodes `{` and `"`, so it cannot send JSON; a page's script can.
        ("POST", {"content-type": "application/x-www-form-urlencoded"}, 200, None),
        (
            "POST",
            {"content-type": "application/x-www-form-urlencoded", "origin": ALLOWED},
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        (
            "POST",
            {"content-type": "multipart/form-data; boundary=x"},
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        ("POST", {"content-type": "application/jsonp"}, 415, "UNSUPPORTED_MEDIA_TYPE"),
        ("POST", {**JSON, "origin": "https://evil.example"}, 403, "ORIGIN_NOT_ALLOWED"),
        ("GET", {"origin": "https://evil.example"}, 403, "ORIGIN_NOT_ALLOWED"),
        ("POST", {**JSON, "origin": "null"}, 403, "ORIGIN_NOT_ALLOWED"),
        ("POST", {**JSON, "origin": "http://app.example"}, 403, "ORIGIN_NOT_ALLOWED"),
        (
            "OPTIONS",
            {"origin": "https://evil.example", "access-control-request-method": "POST"},
            403,
            "ORIGIN_NOT_ALLOWED",
        ),
        ("POST", {**JSON, "origin": ALLOWED}, 200, None),
        # An allowed page still sends JSON only.
        ("POST", {"content-type": "text/plain", "origin": ALLOWED}, 415, "UNSUPPORTED_MEDIA_TYPE"),
    ],
)
def test_refusals_come_before_the_app(
    method: str, headers: dict[str, str], status: int, reason: str | None
) -> None:
    response, reached = serve(method, headers)
    assert response.status_code == status
    if reason is None:
        assert reached == 1
    else:
        assert response.json() == {"reason": reason}
        assert reached == 0
        assert "access-control-allow-origin" not in response.headers


def test_an_allowed_origin_gets_a_preflight_and_cors_headers() -> None:
    response, reached = serve(
        "OPTIONS",
        {
            "origin": ALLOWED,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, x-api-key",
        },
    )
    assert (response.status_code, reached) == (204, 0)
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert response.headers["access-control-allow-headers"] == "authorization, x-api-key"
    assert response.headers["vary"] == "Origin"
    response, reached = serve("POST", {**JSON, "origin": ALLOWED})
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert "retry-after" in response.headers["access-control-expose-headers"]
