"""How large a request the daemon's gRPC server takes, and how it refuses a larger one.

gRPC refuses a message over its receive limit itself, with RESOURCE_EXHAUSTED and
no Blazar metadata, which callers read as "overloaded, retry later". So the server
lets gRPC take in up to `RECEIVE_CEILING_BYTES` and `RequestSizeLimit` refuses any
request over `MAX_REQUEST_BYTES` as the caller's fault: INVALID_ARGUMENT with a
message that states the limit. Only a message over the ceiling still meets gRPC's own
refusal, which `blazar.rpc.status.from_rpc_error` reads as an InvalidRequest too.

`MAX_REQUEST_BYTES` is gRPC's default. An engine worker takes in up to
`ENGINE_RECEIVE_BYTES` from the data plane, so a request that passes here is not
refused one hop later once the data plane has wrapped it (request id, settings).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from google.protobuf import message as protobuf_message

from blazar.api import errors
from blazar.rpc import status

MAX_REQUEST_BYTES = 4 * 2**20
# Every call gRPC takes in is buffered whole before any handler or key check runs: at
# 64 MiB, eight unauthenticated calls at once held 600 MB of the daemon's memory
# after they were refused. Twice the limit leaves room to say what the limit is.
RECEIVE_CEILING_BYTES = 2 * MAX_REQUEST_BYTES

# Calls the daemon's gRPC server runs at once, over every connection: past it a new
# call is refused at once with RESOURCE_EXHAUSTED (grpcio's own), so a client opening
# streams without end cannot grow the daemon's memory without end. Above what the HTTP
# shim may have open (`shim.connections.LIMIT_CONCURRENCY`, 1,024, over one channel)
# plus room for gRPC callers and the CLI.
MAX_CONCURRENT_RPCS = 4096
# Streams one HTTP/2 connection may carry at once (more wait in the client).
MAX_CONCURRENT_STREAMS = 2048

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", RECEIVE_CEILING_BYTES),
    # grpcio sets SO_REUSEPORT by default, so a second daemon could bind the same port
    # and the kernel would share connections between the two. Off: the second bind fails.
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
)
ENGINE_RECEIVE_BYTES = MAX_REQUEST_BYTES + 2**20
# What a gRPC client takes in by default, so the most one answer may carry from an engine
# through the data plane and the shim to a client: each hop keeps gRPC's default. An
# answer whose size the request decides (embeddings, a text's tokens) is kept under it,
# with room for the Lane's name the data plane adds.
MAX_ANSWER_BYTES = 4 * 2**20 - 4096
ENGINE_SERVER_OPTIONS = (("grpc.max_receive_message_length", ENGINE_RECEIVE_BYTES),)


def request_too_large(
    size: int, *, limit: int = MAX_REQUEST_BYTES
) -> errors.RequestTooLarge | None:
    """The error for a request of `size` bytes; None when it is within the limit."""
    if size <= limit:
        return None
    return status.request_too_large(size, limit=limit)


_Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
# A handler's behaviour. typeshed declares `RpcMethodHandler`'s for the sync server
# (plain functions of a sync context); grpc.aio's are coroutine or async generator
# functions of (request, aio context), which only an open signature covers.
_Behaviour: TypeAlias = Callable[..., Any]
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # not subscriptable at run time


class RequestSizeLimit(grpc.aio.ServerInterceptor):
    """Reads every unary request before its handler runs, and refuses with
    INVALID_ARGUMENT one over `limit` bytes, or one protobuf cannot parse (a string
    field that is not UTF-8, which a hand-made or C++ client can send: gRPC's own
    decoding answered it UNKNOWN).

    Streaming requests pass untouched (each message is bounded by the ceiling only);
    the daemon serves none but reflection's.
    """

    def __init__(self, limit: int = MAX_REQUEST_BYTES) -> None:
        self._limit = limit

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        # The handler is given the bytes (no deserializer), which `_read` parses.
        read = self._reader(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._checked_unary(handler.unary_unary, read),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._checked_stream(handler.unary_stream, read),
                response_serializer=handler.response_serializer,
            )
        return handler

    def _reader(
        self, deserialize: Callable[[bytes], Any] | None
    ) -> Callable[[bytes, _Context], Awaitable[Any]]:
        async def read(raw: bytes, context: _Context) -> Any:
            err = request_too_large(len(raw), limit=self._limit)
            if err is not None:
                await status.abort(context, err)
            if deserialize is None:
                return raw
            try:
                return deserialize(raw)
            except protobuf_message.DecodeError as exc:
                await status.abort(
                    context, errors.InvalidRequest(f"The request is not a valid message: {exc}")
                )

        return read

    def _checked_unary(
        self, behaviour: _Behaviour, read: Callable[[bytes, _Context], Awaitable[Any]]
    ) -> _Behaviour:
        async def checked(raw: bytes, context: _Context) -> Any:
            return await behaviour(await read(raw, context), context)

        return checked

    def _checked_stream(
        self, behaviour: _Behaviour, read: Callable[[bytes, _Context], Awaitable[Any]]
    ) -> _Behaviour:
        # grpc.aio tells a generator handler from a writer one (context.write) by its
        # function type, so the wrapper must be of the same kind.
        if inspect.isasyncgenfunction(behaviour):

            async def generate(raw: bytes, context: _Context) -> AsyncIterator[Any]:
                request = await read(raw, context)
                # aclosing: a caller that leaves must end the handler's stream now.
                async with contextlib.aclosing(behaviour(request, context)) as responses:
                    async for response in responses:
                        yield response

            return generate

        async def write(raw: bytes, context: _Context) -> None:
            await behaviour(await read(raw, context), context)

        return write
