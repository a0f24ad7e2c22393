"""Streaming plumbing shared by dialects: SSE and NDJSON framing, client-disconnect handling.

A generation must stop the moment its HTTP client goes away, so that the daemon
cancels the engine sequence and frees the slot. Two windows need care: before the
response starts (waiting for the first chunk or, non-streaming, for the whole answer)
and while it streams. `until_disconnected` covers the first, `EventStream` the second.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

# What nginx logs for "client closed the connection before the response".
CLIENT_CLOSED_REQUEST = 499


class ClientDisconnected(Exception):
    """The HTTP client went away before the awaited work finished."""


def sse_event(data: str, *, event: str | None = None) -> bytes:
    """One server-sent event; `data` must be a single line (compact JSON is)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising ClientDisconnected if the client leaves.

    Only for use after the request body has been read: it consumes `receive()`.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """A `text/event-stream` response that stops its body as soon as the client leaves.

    Starlette's StreamingResponse notices a disconnect only on ASGI spec < 2.4; this one
    always watches `receive()`, so a stream idling in an admission queue is cancelled
    too. Cancelling the body iterator runs its `finally`/`async with` blocks, which is
    where dialects cancel the gRPC call.
    """

    media_type = "text/event-stream"

    def __init__(
        self, body: AsyncIterator[bytes], *, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(
            status_code=200,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})},
            media_type=self.media_type,
        )
        # Response.__init__ set content-length for an empty body; a stream has none.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._iterator = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            streamer.cancel()
            watcher.cancel()
            results = await asyncio.gather(streamer, watcher, return_exceptions=True)
        failure = results[0]
        if isinstance(failure, Exception) and not isinstance(failure, OSError):
            raise failure

    async def _stream(self, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for piece in self._iterator:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self._iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class LineStream(EventStream):
    """Newline-delimited JSON (`application/x-ndjson`, Ollama's streams), with the same
    disconnect handling as `EventStream`."""

    media_type = "application/x-ndjson"
