"""The shim's one client of the daemon's public gRPC API (`blazar.v1.Inference`).

It owns the translation of gRPC failures into `blazar.api.errors` and the guarantee
that a generation RPC is cancelled (so the engine frees its slot) whenever the HTTP
side stops reading early: client gone, error while rendering, or shutdown. Every
generation goes through `chat` or `complete`, where the admission gates
(`blazar.shim.gates`) refuse it without a call, or tag it on its way: a refused
generation is a `ChunkStream` that raises the refusal on its first read, as the
daemon's own refusal would come, so each dialect renders it the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.requests import Request

from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import errors, modelnames, via
from blazar.rpc import status
from blazar.shim import gates

# A probe must answer even when the daemon hangs; load balancers poll every few seconds.
_HEALTH_TIMEOUT_S = 2.0

# Where a generation ran, on every dialect's HTTP response: the Lane (the one asked for,
# or its spillover Lane), its replica index, and the prompt tokens its cache already held
# (streamed as well as whole, since the daemon names them with its first chunk; not
# from an upstream Lane's stream, whose server says so only at its end).
LANE_HEADER = "x-blazar-lane"
REPLICA_HEADER = "x-blazar-replica"
PREFIX_REUSED_HEADER = "x-blazar-prefix-reused"
# The prompt's tokens in all, told with the first chunk as the reused ones are.
PROMPT_TOKENS_HEADER = "x-blazar-prompt-tokens"
# When admission expected the first token (milliseconds from arrival), if it predicted.
PREDICTED_TTFT_HEADER = "x-blazar-predicted-ttft-ms"
# The data plane's initial metadata keys, and the headers they become (inference.proto).
_HEADERS_OF_METADATA = {
    "blazar-lane": LANE_HEADER,
    "blazar-replica": REPLICA_HEADER,
    "blazar-prefix-reused": PREFIX_REUSED_HEADER,
    "blazar-prompt-tokens": PROMPT_TOKENS_HEADER,
    "blazar-predicted-ttft-ms": PREDICTED_TTFT_HEADER,
}


def listed_model(response: inference_pb2.ListModelsResponse, name: str) -> inference_pb2.ModelInfo:
    """The entry of a model list called `name` (a Lane's name or alias, as
    `modelnames.lookups` tries it); ModelNotFound if none. What each dialect's lookup
    of one model reads."""
    for candidate in modelnames.lookups(name):
        for info in response.models:
            if info.id == candidate:
                return info
    raise errors.ModelNotFound.of(name)


def embedding_headers(response: inference_pb2.EmbedResponse) -> dict[str, str]:
    """`x-blazar-lane` and `x-blazar-replica` of an embedding; none when nothing was
    embedded (a preload) or the daemon sent no routing."""
    if not response.HasField("routing"):
        return {}
    return {
        LANE_HEADER: response.routing.lane,
        REPLICA_HEADER: str(response.routing.replica),
    }


def final_headers(final: inference_pb2.Final) -> dict[str, str]:
    """The routing headers of a finished generation; none when the daemon sent no routing."""
    if not final.HasField("routing"):
        return {}
    headers = {
        REPLICA_HEADER: str(final.routing.replica),
        PREFIX_REUSED_HEADER: str(final.routing.prefix_tokens_reused),
    }
    if final.routing.lane:
        headers[LANE_HEADER] = final.routing.lane
    return headers


class _Call(Protocol):
    """What a ChunkStream reads: a grpc.aio streaming call, or `_Refused`."""

    async def read(self) -> object: ...

    async def initial_metadata(self) -> Any: ...

    def cancel(self) -> bool: ...


class _Refused:
    """A call never made: a closed admission gate refused it (`gates.AdmissionGates`)."""

    def __init__(self, err: errors.BlazarError) -> None:
        self.err = err

    async def read(self) -> object:
        raise self.err

    async def initial_metadata(self) -> Any:
        return ()

    def cancel(self) -> bool:
        return False


class ChunkStream:
    """One server-streaming generation call, read chunk by chunk.

    Use as an async iterator inside `async with`: leaving the block cancels the call
    if it has not finished, which is how a client disconnect reaches the engine.
    Errors arrive as `blazar.api.errors.BlazarError`, never as `grpc.RpcError`;
    transport failures (daemon down) become `Unavailable`.
    """

    def __init__(self, call: _Call) -> None:
        self._call = call

    @classmethod
    def refused(cls, err: errors.BlazarError) -> ChunkStream:
        """A stream that raises `err` on its first read, with no call behind it."""
        return cls(_Refused(err))

    @property
    def refusal(self) -> errors.BlazarError | None:
        """The error of a stream made by `refused`, known before any read: a caller
        that would wait for the first chunk (racing a disconnect) can raise it at once,
        without a pass of the event loop per request in a flood."""
        return self._call.err if isinstance(self._call, _Refused) else None

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> inference_pb2.Chunk:
        try:
            message = await self._call.read()
        except grpc.RpcError as exc:
            raise status.from_rpc_error(exc) from None
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        # A response or EOF, which typeshed can only spell `object`.
        return cast(inference_pb2.Chunk, message)

    async def routing_headers(self) -> dict[str, str]:
        """`x-blazar-lane`, `x-blazar-replica` (and `x-blazar-prefix-reused`,
        `x-blazar-prompt-tokens`, `x-blazar-predicted-ttft-ms`) from the daemon's initial
        metadata, which it sends with the first chunk: call this once the first chunk
        (or the end) is in. Empty when the daemon named no replica (the call failed
        first)."""
        try:
            metadata = await self._call.initial_metadata()
        except grpc.RpcError:
            return {}
        headers: dict[str, str] = {}
        for key, value in metadata or ():
            header = _HEADERS_OF_METADATA.get(key)
            if header is not None:
                headers[header] = value if isinstance(value, str) else value.decode()
        return headers

    def cancel(self) -> None:
        """Cancel the RPC; a no-op once it has finished."""
        self._call.cancel()

    async def __aenter__(self) -> ChunkStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class InferenceClient:
    """Calls `blazar.v1.Inference` and the daemon's gRPC health service on one channel;
    generations through `gates` (none: every one goes to the daemon)."""

    def __init__(
        self, channel: grpc.aio.Channel, *, gates: gates.AdmissionGates | None = None
    ) -> None:
        self._inference = inference_pb2_grpc.InferenceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._gates = gates

    def chat(
        self, request: inference_pb2.ChatRequest, *, metadata: Sequence[tuple[str, str]]
    ) -> ChunkStream:
        """The generation's stream: the daemon's, or a closed gate's refusal."""
        return self._generate(self._inference.Chat, request, metadata)

    def complete(
        self, request: inference_pb2.CompleteRequest, *, metadata: Sequence[tuple[str, str]]
    ) -> ChunkStream:
        """As `chat`."""
        return self._generate(self._inference.Complete, request, metadata)

    def _generate(
        self,
        rpc: Callable[..., grpc.aio.UnaryStreamCall[Any, inference_pb2.Chunk]],
        request: gates.Generation,
        metadata: Sequence[tuple[str, str]],
    ) -> ChunkStream:
        found = self._gates
        if found is None:
            return ChunkStream(rpc(request, metadata=tuple(metadata)))
        through = next((value for key, value in metadata if key == via.HEADER), "")
        decided = found.admit(request, via=through)
        if isinstance(decided, errors.BlazarError):
            return ChunkStream.refused(decided)
        call = rpc(request, metadata=(*metadata, decided.metadata()))
        # However it ends, it is no longer on its way to admission.
        call.add_done_callback(lambda _: found.settled(decided))
        return ChunkStream(call)

    async def list_models(
        self, *, metadata: Sequence[tuple[str, str]]
    ) -> inference_pb2.ListModelsResponse:
        try:
            response: inference_pb2.ListModelsResponse = await self._inference.ListModels(
                inference_pb2.ListModelsRequest(), metadata=tuple(metadata)
            )
        except grpc.RpcError as exc:
            raise status.from_rpc_error(exc) from None
        return response

    async def embed(
        self, request: inference_pb2.EmbedRequest, *, metadata: Sequence[tuple[str, str]]
    ) -> inference_pb2.EmbedResponse:
        response: inference_pb2.EmbedResponse = await _unary(
            self._inference.Embed, request, metadata
        )
        return response

    async def tokenize(
        self, request: inference_pb2.TokenizeRequest, *, metadata: Sequence[tuple[str, str]]
    ) -> inference_pb2.TokenizeResponse:
        response: inference_pb2.TokenizeResponse = await _unary(
            self._inference.Tokenize, request, metadata
        )
        return response

    async def keep_alive(
        self, request: inference_pb2.KeepAliveRequest, *, metadata: Sequence[tuple[str, str]]
    ) -> inference_pb2.KeepAliveResponse:
        response: inference_pb2.KeepAliveResponse = await _unary(
            self._inference.KeepAlive, request, metadata
        )
        return response

    def watch_admission(
        self, watcher: str
    ) -> grpc.aio.UnaryStreamCall[Any, inference_pb2.AdmissionGates]:
        """The daemon's closed admission gates, as they change, for the watcher whose
        tags go on its generations (`blazar.shim.gates`)."""
        call: grpc.aio.UnaryStreamCall[Any, inference_pb2.AdmissionGates] = (
            self._inference.WatchAdmission(inference_pb2.WatchAdmissionRequest(watcher=watcher))
        )
        return call

    async def serving(self) -> bool:
        """True when the daemon's overall health (service "") is SERVING."""
        try:
            response: health_pb2.HealthCheckResponse = await self._health.Check(  # type: ignore[attr-defined]  # typeshed's HealthStub declares no RPCs
                health_pb2.HealthCheckRequest(service=""), timeout=_HEALTH_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def client_of(request: Request) -> InferenceClient:
    """The client `blazar.shim.app` put on the application state during its lifespan."""
    client: InferenceClient = request.app.state.inference
    return client


async def _unary(call: Any, request: Any, metadata: Sequence[tuple[str, str]]) -> Any:
    """A unary call of the daemon's Inference API; its error as the BlazarError the
    daemon sent."""
    try:
        return await call(request, metadata=tuple(metadata))
    except grpc.RpcError as exc:
        raise status.from_rpc_error(exc) from None
