"""Relaying one generation from the daemon to an HTTP client, as every dialect does it.

A dialect's routes parse and convert; these helpers do the waiting in between, the
same way for all: `first_chunk` holds the response until the first chunk is in (so an
early error keeps its HTTP status and the headers can name the replica), `collect`
gathers a whole answer for a non-streaming response, and `guarded` renders a bug in
the dialect's own error envelope. All of them cancel the gRPC call when the client
goes away or anything fails, so the engine frees the slot at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Protocol, TypeAlias, TypeVar

import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import canonical, inference, streaming

_log = structlog.get_logger("blazar.shim")

Handler: TypeAlias = Callable[[Request], Awaitable[Response]]
Event = TypeVar("Event", covariant=True)


class Renderer(Protocol[Event]):
    """A dialect's rendering of one generation stream, chunk by chunk."""

    @property
    def finished(self) -> bool:
        """Whether the final chunk was rendered."""
        ...

    def render(self, chunk: inference_pb2.Chunk) -> Iterable[Event]: ...


async def first_chunk(
    request: Request, stream: inference.ChunkStream
) -> tuple[inference_pb2.Chunk | None, dict[str, str]]:
    """The stream's first chunk (None when it ended at once) and the routing headers
    known by then. Raises `streaming.ClientDisconnected` or the daemon's
    `BlazarError`, having cancelled the call."""
    if (refused := stream.refusal) is not None:
        raise refused  # a closed gate's: no call to wait for
    try:
        first = await streaming.until_disconnected(request, anext(stream, None))
        headers = await stream.routing_headers()
    except BaseException:
        stream.cancel()
        raise
    if first is not None and first.HasField("final"):
        headers.update(inference.final_headers(first.final))
    return first, headers


async def rendered(
    stream: inference.ChunkStream,
    renderer: Renderer[Event],
    first: inference_pb2.Chunk | None,
    *,
    opening: Iterable[Event] = (),
    failure: Callable[[errors.BlazarError], Iterable[Event]],
) -> AsyncIterator[Event]:
    """A streamed response's events, after its headers went out: `opening`, then each
    chunk rendered, from `first` on. A failure from then on (the daemon's error, a
    stream that ended without its final chunk, a bug) can only be told in the stream:
    `failure` renders it as the dialect's error event. Leaving for any reason, the
    client gone included, cancels the gRPC call."""
    async with stream:
        try:
            for event in opening:
                yield event
            if first is not None:
                for event in renderer.render(first):
                    yield event
                async for chunk in stream:
                    for event in renderer.render(chunk):
                        yield event
            if not renderer.finished:
                raise canonical.truncated()
        except errors.BlazarError as err:
            for event in failure(err):
                yield event
        except Exception:
            _log.exception("stream failed")
            for event in failure(internal_error()):
                yield event


async def collect(
    request: Request, stream: inference.ChunkStream
) -> tuple[canonical.Answer, dict[str, str]]:
    """The whole generation, and the headers a streamed answer would carry (the
    replica, admission's predicted first token, the reused prefix). Raises
    `streaming.ClientDisconnected` or `BlazarError` (a stream without its final chunk
    is `canonical.truncated`)."""
    if (refused := stream.refusal) is not None:
        raise refused  # a closed gate's: no call to wait for
    answer = canonical.Answer()

    async def read_all() -> dict[str, str]:
        async with stream:
            async for chunk in stream:
                answer.add(chunk)
            return await stream.routing_headers()

    headers = await streaming.until_disconnected(request, read_all())
    headers.update(inference.final_headers(answer.finished()))
    return answer, headers


def internal_error() -> errors.BlazarError:
    """What a client is told of a bug: nothing of its details."""
    return errors.BlazarError("The server had an error while processing your request.")


def guarded(handler: Handler, *, render: Callable[[errors.BlazarError], Response]) -> Handler:
    """`handler`, with a bug answered as a 500 in the dialect's envelope (`render`)
    instead of Starlette's plain text, and a client gone while sending its body as 499."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientDisconnect:
            # Gone while sending its body: nobody to answer, and not a server failure.
            return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
        except Exception:
            _log.exception("request failed")
            return render(internal_error())

    guarded.__name__ = handler.__name__
    return guarded
