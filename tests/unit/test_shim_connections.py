"""`blazar.shim.connections`: the shim's HTTP protocol, in a real uvicorn server on
loopback, on asyncio's loop and on uvloop. A request must be read whole within the
read deadline (shortened here); what follows the read is not bounded; a head past its
bound is refused; uvicorn's concurrency limit still applies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvicorn
import uvloop
from starlette.types import Receive, Scope, Send

from blazar.cli import daemon
from blazar.shim import connections

DEADLINE_S = 0.4
# More than loopback's socket buffers hold, so that most of it waits in the transport.
BIG_BYTES = 12 * 1024 * 1024

LOOPS = pytest.mark.parametrize(
    "loop_factory", [None, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)


def run(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
    main: Callable[[], Awaitable[None]],
) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(main(), 20)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(bounded())


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connections, "READ_DEADLINE_S", DEADLINE_S)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """/slow answers after 2.5 deadlines; /stream sends 3 parts a deadline apart; any
    other path answers with the length of the body it read."""
    assert scope["type"] == "http"
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            await asyncio.sleep(DEADLINE_S)
            await send({"type": "http.response.body", "body": b"part;", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] == "/big":
        body = b"x" * BIG_BYTES
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(2.5 * DEADLINE_S)
        body = b"slow"
    else:
        read = 0
        more = True
        while more:
            message = await receive()
            read += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = str(read).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(limit_concurrency: int | None = None) -> AsyncIterator[int]:
    """The port of a uvicorn server on the shim's protocol and listener, as `_shim`
    configures it (but for the app and the limit)."""
    sock = daemon._listen("127.0.0.1:0", what="HTTP")
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http=connections.BoundedHttpToolsProtocol,
            limit_concurrency=limit_concurrency,
            lifespan="off",
            log_level="error",
            # A test that fails with a request still open ends, rather than waits for it.
            timeout_graceful_shutdown=1,
            access_log=False,
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done()
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(port: int, first: bytes = b"") -> Connection:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if first:
        writer.write(first)
    return reader, writer


async def response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response's status and body (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    if "content-length" in headers:
        return status, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")
    return status, body


async def closed_after(reader: asyncio.StreamReader) -> float:
    """Seconds until the server closes the connection (whatever it sent first)."""
    started = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        while await reader.read(65536):
            pass
    return time.monotonic() - started


def request(path: str, body: bytes = b"", extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


@LOOPS
def test_a_request_not_read_whole_in_time_is_closed_while_others_are_served(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None, short_deadline: None
) -> None:
    async def main() -> None:
        async with serving() as port:
            silent = await connect(port)
            headers = await connect(port, b"POST /echo HTTP/1.1\r\nHost: x\r\n")
            body = await connect(
                port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
            )
            slow = [silent, headers, body]
            closing = [asyncio.create_task(closed_after(reader)) for reader, _ in slow]
            # A byte now and then does not extend the deadline.
            for _ in range(int(2 * DEADLINE_S / 0.1)):
                await asyncio.sleep(0.1)
                for _, writer in slow[1:]:
                    if not writer.is_closing():
                        writer.write(b"X")
            # Served meanwhile, on a fresh connection.
            reader, writer = await connect(port, request("/echo", b"12345"))
            assert await response(reader) == (200, b"5")
            writer.close()
            waited = await asyncio.gather(*closing)
            assert all(DEADLINE_S * 0.8 < w < DEADLINE_S + 0.6 for w in waited), waited
            for _, w in slow:
                w.close()

    run(loop_factory, main)


@LOOPS
def test_the_answer_and_the_idle_time_between_requests_are_not_bounded(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None, short_deadline: None
) -> None:
    async def main() -> None:
        async with serving() as port:
            reader, writer = await connect(port, request("/stream"))
            assert await response(reader) == (200, b"part;part;part;")
            await asyncio.sleep(2 * DEADLINE_S)  # keep-alive's time, not the deadline's
            writer.write(request("/echo", b"abc"))
            assert await response(reader) == (200, b"3")
            writer.close()

    run(loop_factory, main)


@LOOPS
def test_a_pipelined_request_is_read_under_its_deadline_once_the_answer_before_it_ends(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None, short_deadline: None
) -> None:
    async def main() -> None:
        async with serving() as port:
            # The second request's body is not all in while the first is answered.
            pipelined = request("/slow") + request("/echo", b"abcde")[:-3]
            reader, writer = await connect(port, pipelined)
            stalled, stalled_writer = await connect(port, pipelined)
            assert await response(reader) == (200, b"slow")
            writer.write(b"cde")
            assert await response(reader) == (200, b"5")
            writer.close()
            # Its time started when the answer before it ended.
            assert await response(stalled) == (200, b"slow")
            assert DEADLINE_S * 0.8 < await closed_after(stalled) < DEADLINE_S + 0.6
            stalled_writer.close()

    run(loop_factory, main)


async def exchange(port: int, parts: list[bytes], *, pause_s: float = 0.0) -> bytes:
    """All the server sends until it closes the connection, while `parts` are sent (a
    pause after each); sending stops quietly where the server refused the rest."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))

    async def send() -> None:
        with contextlib.suppress(OSError):
            for part in parts:
                await loop.sock_sendall(sock, part)
                await asyncio.sleep(pause_s)

    sending = asyncio.create_task(send())
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await loop.sock_recv(sock, 65536):
            received += chunk
    await sending
    sock.close()
    return received


REFUSED = b"HTTP/1.1 400 "


def assert_head_too_large(got: bytes) -> None:
    """400, and a JSON body in OpenAI's error envelope, which every path outside
    Ollama's and Anthropic's speaks."""
    assert got.startswith(REFUSED), got[:200]
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"\r\ncontent-type: application/json\r\n" in head.lower(), head
    assert json.loads(body) == {
        "error": {
            "message": connections.HEAD_TOO_LARGE,
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


START = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 1\r\n"


@LOOPS
@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ([b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(15)], False),
        ([b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(17)], True),
        ([b"X-Pad: " + b"p" * (1 << 20) + b"\r\n"], True),
    ],
    ids=["15KiB", "17KiB", "1MiB-line"],
)
@pytest.mark.parametrize("pause_s", [0.0, 0.005], ids=["one-write", "a-field-a-write"])
def test_a_head_past_its_bound_is_refused(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
    fields: list[bytes],
    refused: bool,
    pause_s: float,
) -> None:
    async def main() -> None:
        async with serving() as port:
            parts = (
                [START, *fields, b"\r\nA"] if pause_s else [b"".join([START, *fields, b"\r\nA"])]
            )
            got = await exchange(port, parts, pause_s=pause_s)
            if refused:
                assert_head_too_large(got)
            else:
                assert got.startswith(b"HTTP/1.1 200 "), got[:200]
                assert got.endswith(b"\r\n\r\n1")

    run(loop_factory, main)


@LOOPS
def test_a_head_still_arriving_is_refused_once_past_its_bound(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> None:
    """httptools gathers a header line whole before it hands it over: one that never
    ends must not grow for the whole read deadline (8 s here)."""

    async def main() -> None:
        async with serving() as port:
            parts = [b"POST /echo HTTP/1.1\r\nX-Pad: ", *[b"p" * 1024] * 64]
            started = time.monotonic()
            got = await exchange(port, parts, pause_s=0.002)
            assert_head_too_large(got)
            assert time.monotonic() - started < 2

    run(loop_factory, main)


@LOOPS
@pytest.mark.parametrize("pause_s", [0.0, 0.002], ids=["whole-head", "head-still-arriving"])
@pytest.mark.parametrize("path", [b"/api/chat", b"/", b"/v1/messages", b"/v1/messages?beta=true"])
def test_a_head_past_its_bound_is_refused_in_its_paths_dialect(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None, path: bytes, pause_s: float
) -> None:
    """Ollama's paths get Ollama's `{"error": ...}`, Anthropic's its envelope and a
    request id (the OpenAI envelope is `assert_head_too_large`'s)."""

    async def main() -> None:
        async with serving() as port:
            start = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n"
            if pause_s:
                parts = [start + b"X-Pad: ", *[b"p" * 1024] * 64]
            else:
                pads = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(17))
                parts = [start + pads + b"Content-Length: 1\r\n\r\nA"]
            got = await exchange(port, parts, pause_s=pause_s)
            assert got.startswith(REFUSED), got[:200]
            head, _, body = got.partition(b"\r\n\r\n")
            if path.startswith(b"/v1/messages"):
                request_id = head.lower().partition(b"\r\nrequest-id: ")[2].split(b"\r\n")[0]
                assert request_id, head
                assert json.loads(body) == {
                    "type": "error",
                    "error": {
                        "type": "invalid_request_error",
                        "message": connections.HEAD_TOO_LARGE,
                    },
                    "request_id": request_id.decode(),
                }
            else:
                assert json.loads(body) == {"error": connections.HEAD_TOO_LARGE}

    run(loop_factory, main)


@LOOPS
@pytest.mark.parametrize(
    ("path", "field", "expected"),
    [
        (b"/v1/models", b"X-Test: a\x01b", {"error": {"message": connections.NOT_HTTP, "type": "invalid_request_error", "param": None, "code": None}}),
        (b"/api/tags", b"Authorization: Bearer a\x00b", {"error": connections.NOT_HTTP}),
        (b"/v1/messages", b"X-T\x01est: ab", {"type": "error", "error": {"type": "invalid_request_error", "message": connections.NOT_HTTP}}),
        (b"/api/chat", b"Content-Length: abc", {"error": connections.NOT_HTTP}),
    ],
    ids=["openai-value", "ollama-nul", "anthropic-name", "ollama-length"],
)  # fmt: skip
def test_a_header_httptools_cannot_parse_is_refused_in_its_paths_dialect(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
    path: bytes,
    field: bytes,
    expected: dict[str, object],
) -> None:
    """A control character in a header is llhttp's parse error: 400 in the JSON of the
    dialect the path speaks, not uvicorn's plain text, and the connection closes."""

    async def main() -> None:
        async with serving() as port:
            got = await exchange(
                port, [b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + field + b"\r\n\r\n"]
            )
            assert got.startswith(REFUSED), got[:200]
            head, _, body = got.partition(b"\r\n\r\n")
            assert b"\r\ncontent-type: application/json\r\n" in head.lower(), head
            assert b"\r\nconnection: close" in head.lower(), head
            answer = json.loads(body)
            answer.pop("request_id", None)
            assert answer == expected

    run(loop_factory, main)


@LOOPS
def test_past_the_concurrency_limit_a_request_is_answered_503(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> None:
    async def main() -> None:
        async with serving(limit_concurrency=3) as port:
            held = [await connect(port, request("/slow")) for _ in range(2)]
            await asyncio.sleep(0.1)
            reader, writer = await connect(port, request("/echo", b"ab"))
            assert (await response(reader))[0] == 503
            writer.close()
            for held_reader, held_writer in held:
                assert await response(held_reader) == (200, b"slow")
                held_writer.close()
            await asyncio.sleep(0.1)
            reader, writer = await connect(port, request("/echo", b"ab"))
            assert await response(reader) == (200, b"2")
            writer.close()

    run(loop_factory, main)


@pytest.mark.parametrize(
    ("before", "after", "stalled"),
    [
        (10_000_000, 10_000_000, True),  # took nothing
        (10_000_000, 10_000_000 - 1000, True),  # a drip
        (10_000_000, 10_000_000 - connections.MIN_DRAIN_BYTES, False),
        (1000, 1, True),  # less than all that waited
        (1000, 0, False),  # all of it
        (0, 0, False),
    ],
)
def test_a_client_that_takes_too_little_of_its_answer_is_stalled(
    before: int, after: int, stalled: bool
) -> None:
    assert connections.stalled(before=before, after=after) is stalled


async def read_all(
    reader: asyncio.StreamReader, *, pause_s: float = 0.0, until: int | None = None
) -> int:
    """Bytes read until the connection ends (or `until` are), `pause_s` between 1 MiB
    reads."""
    got = 0
    with contextlib.suppress(ConnectionResetError):
        while (until is None or got < until) and (chunk := await reader.read(1 << 20)):
            got += len(chunk)
            await asyncio.sleep(pause_s)
    return got


@LOOPS
def test_a_client_that_stops_reading_its_answer_is_cut_off(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(connections, "WRITE_STALL_S", DEADLINE_S)

    async def main() -> None:
        async with serving() as port:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(request("/big"))
            await asyncio.sleep(4 * DEADLINE_S)  # reads nothing meanwhile
            assert await read_all(reader) < BIG_BYTES
            writer.close()
            # One that reads along gets all of it, however long that takes.
            reader, writer = await connect(port, request("/big"))
            assert await read_all(reader, pause_s=DEADLINE_S / 40, until=BIG_BYTES) >= BIG_BYTES
            writer.close()

    run(loop_factory, main)
