"""`blazar.shim.loops` and `blazar.api.via`: a request that comes back to a daemon it
went through (directly, or round other daemons) is refused before any route; the client
reads why."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2 as pb
from blazar.api import errors, kinds, via
from blazar.enginehost import upstream
from blazar.shim import http_errors, loops
from tests.unit import fake_inference

OTHER = "0123456789abcdef"  # another daemon's id


async def render(request: Request, err: errors.BlazarError) -> Response:
    return JSONResponse({"refused": err.message}, status_code=http_errors.http_status(err))


def guarded() -> tuple[loops.LoopGuard, list[int]]:
    reached: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(1)
        await JSONResponse({"data": []})(scope, receive, send)

    return loops.LoopGuard(app, render=render), reached


@pytest.mark.parametrize(
    ("header", "status"),
    [
        (None, 200),
        ("", 200),
        (OTHER, 200),
        (f"{OTHER},{'f' * via.MAX_ID_CHARS}", 200),
        (", ".join([OTHER] * via.MAX_HOPS), 200),
        (via.DAEMON_ID, 508),
        (f"{OTHER}, {via.DAEMON_ID}", 508),
        # A -> B -> A: this daemon sent it on first, then another one sent it back.
        (f"{via.DAEMON_ID}, {OTHER}", 508),
        (f"{via.DAEMON_ID}, {OTHER}, fedcba9876543210", 508),
        # Not a list of daemon ids: the caller's mistake, in its dialect's envelope.
        (", ".join([OTHER] * (via.MAX_HOPS + 1)), 400),
        ("f" * (via.MAX_ID_CHARS + 1), 400),
        (f"{OTHER},,{OTHER}", 400),
        ("a b", 400),
    ],
    # The same ids in every process (pytest-xdist's workers collect apart).
    ids=lambda v: v.replace(via.DAEMON_ID, "self") if isinstance(v, str) else None,
)
def test_a_request_that_came_back_is_508(header: str | None, status: int) -> None:
    app, reached = guarded()

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shim") as client:
            headers = {via.HEADER: header} if header is not None else {}
            return await client.get("/v1/models", headers=headers)

    answer = asyncio.run(main())
    assert answer.status_code == status, answer.text
    assert bool(reached) is (status == 200)
    if status == 400:
        assert f"Invalid '{via.HEADER}' header" in answer.json()["refused"]


def test_each_daemon_appends_itself_and_the_first_one_sees_it_come_back() -> None:
    """A -> B -> A, each daemon's header as the next one reads it."""
    to_b = via.forwarded(via.hops(None), daemon_id="a")
    back_to_a = via.forwarded(via.hops(to_b), daemon_id="b")
    assert (to_b, back_to_a) == ("a", "a, b")
    assert not via.came_back(via.hops(to_b), daemon_id="b")
    assert via.came_back(via.hops(back_to_a), daemon_id="a")


def test_a_daemon_sends_on_no_request_that_went_through_max_hops() -> None:
    """Every id is bounded and so is their number: no chain grows the header without end."""
    full = tuple(f"d{i}" for i in range(via.MAX_HOPS))
    assert via.forwarded(full[:-1], daemon_id="me").endswith(f"d{via.MAX_HOPS - 2}, me")
    with pytest.raises(errors.Unavailable, match=f"went through {via.MAX_HOPS} Blazar daemons"):
        via.forwarded(full, daemon_id="me")


def test_the_shim_passes_the_daemons_a_request_went_through_to_the_data_plane() -> None:
    """As gRPC metadata under the same key, for the data plane's upstream client; a
    header that is not a list of ids is refused in the path's dialect's envelope."""

    async def main() -> tuple[list[dict[str, str]], httpx.Response, httpx.Response]:
        async with fake_inference.fake_daemon() as daemon:
            daemon.fake.scripts["m"] = [fake_inference.delta("x"), fake_inference.final()]
            async with fake_inference.asgi_client(daemon.target) as client:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                ok = await client.post(
                    "/v1/chat/completions", json=body, headers={via.HEADER: f"{OTHER}, b"}
                )
                assert ok.status_code == 200, ok.text
                plain = await client.post("/v1/chat/completions", json=body)
                assert plain.status_code == 200, plain.text
                openai = await client.post(
                    "/v1/chat/completions", json=body, headers={via.HEADER: "a b"}
                )
                ollama = await client.post("/api/chat", json=body, headers={via.HEADER: "a b"})
            return daemon.fake.metadata, openai, ollama

    metadata, openai, ollama = asyncio.run(main())
    assert [m.get(via.HEADER) for m in metadata] == [f"{OTHER}, b", None]
    assert openai.status_code == 400
    assert openai.json()["error"]["param"] == via.HEADER
    assert ollama.status_code == 400
    assert f"Invalid '{via.HEADER}' header" in ollama.json()["error"]


def test_the_upstream_client_adds_this_daemon_to_those_the_request_went_through() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers[via.HEADER])
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": []})
        return httpx.Response(
            200,
            content=b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
            b"data: [DONE]\n\n",
        )

    spec = kinds.Upstream.model_validate({"url": "http://u/v1", "model": "m"})
    client = upstream.UpstreamClient(spec, transport=httpx.MockTransport(answer))
    request = engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(messages=[pb.Message(role="user", content="hi")])
    )

    async def main() -> None:
        try:
            await client.probe()
            async for _ in client.generate(request, model="m"):
                pass
            async for _ in client.generate(request, model="m", through=(OTHER,)):
                pass
            with pytest.raises(errors.Unavailable, match="went through"):
                async for _ in client.generate(request, model="m", through=("d",) * via.MAX_HOPS):
                    pass
        finally:
            await client.close()

    asyncio.run(main())
    assert seen == [via.DAEMON_ID, via.DAEMON_ID, f"{OTHER}, {via.DAEMON_ID}"]


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
