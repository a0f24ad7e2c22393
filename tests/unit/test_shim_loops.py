"""`blazar.shim.loops` and `blazar.api.via`: a request an upstream Lane of this daemon
sent to this daemon is refused before any route; the client reads why."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2 as pb
from blazar.api import errors, kinds, via
from blazar.enginehost import upstream
from blazar.shim import loops


def guarded() -> tuple[loops.LoopGuard, list[int]]:
    reached: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(1)
        await JSONResponse({"data": []})(scope, receive, send)

    return loops.LoopGuard(app), reached


@pytest.mark.parametrize(
    ("header", "refused"),
    [
        (None, False),
        ("0123456789abcdef", False),  # another daemon's
        (via.DAEMON_ID, True),
        (f"0123456789abcdef, {via.DAEMON_ID}", True),
    ],
)
def test_a_request_that_came_back_is_508(header: str | None, refused: bool) -> None:
    app, reached = guarded()

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shim") as client:
            headers = {via.HEADER: header} if header is not None else {}
            return await client.get("/v1/models", headers=headers)

    answer = asyncio.run(main())
    assert (answer.status_code == 508) is refused
    assert bool(reached) is not refused


def test_an_upstream_lane_pointed_at_its_own_daemon_says_so() -> None:
    """The probe fails naming the loop (the Lane is not Available) and a request is
    UNAVAILABLE with the same words. Found on a daemon: a Lane whose url was the
    daemon's own was Ready, and each request waited out its first-byte timeout."""
    app, _ = guarded()
    spec = kinds.Upstream.model_validate({"url": "http://shim/v1", "model": "loop"})
    client = upstream.UpstreamClient(spec, transport=httpx.ASGITransport(app=app))

    async def main() -> upstream.Probe:
        try:
            probe = await client.probe()
            request = engine_pb2.GenerateRequest(
                chat=engine_pb2.ChatInput(messages=[pb.Message(role="user", content="hi")])
            )
            with pytest.raises(errors.Unavailable, match="leads to this daemon itself"):
                async for _ in client.generate(request, model="loop"):
                    pass
            return probe
        finally:
            await client.close()

    probe = asyncio.run(main())
    assert not probe.ok and "HTTP 508" in probe.message and "this daemon itself" in probe.message
