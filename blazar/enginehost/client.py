"""The one typed client of an engine worker's `blazar.engine.v1.Engine` service.

An `EngineClient` holds one gRPC channel to one worker's Unix socket and offers its
RPCs as typed methods; the supervisor, the health monitor and the data plane all talk
to engines through it. `EnginePool` keeps one client per socket for callers that reach
many replicas (the data plane, the monitor), so a channel is opened once per replica,
not once per call.

Errors are gRPC's (`grpc.aio.AioRpcError`): each caller decides what a failure means
to it (the data plane maps it with `blazar.rpc.status.from_rpc_error`, the probes
count it as a miss).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeAlias

import grpc

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc
from blazar._proto.v1 import inference_pb2
from blazar.rpc import engine_metadata

if TYPE_CHECKING:
    # A Generate stream: async-iterable over chunks, `cancel()` frees the engine's slot.
    GenerateCall: TypeAlias = grpc.aio.UnaryStreamCall[
        engine_pb2.GenerateRequest, inference_pb2.Chunk
    ]


def prefix_reused(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The prompt tokens a Generate call's initial metadata says the cache held; None
    when it does not say (an engine that sends no such key, or an unreadable value)."""
    return _count(metadata, engine_metadata.PREFIX_REUSED_KEY)


def prompt_tokens(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The prompt's tokens, as a Generate call's initial metadata says; None as for
    `prefix_reused`."""
    return _count(metadata, engine_metadata.PROMPT_TOKENS_KEY)


def _count(metadata: Iterable[tuple[str, str | bytes]] | None, wanted: str) -> int | None:
    for key, value in metadata or ():
        if key == wanted:
            text = value.decode() if isinstance(value, bytes) else value
            return int(text) if text.isdigit() else None
    return None


# Each client's channel keeps its own connection ("subchannel"). gRPC otherwise shares
# one per target across channels, with its reconnect backoff: a fresh client for a
# restarted worker would inherit the backoff its dead predecessor's channel ran into, and
# fail its first calls for up to that long (1 s, growing) although the worker serves.
_CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


class EngineClient:
    """One engine worker, reached over its Unix socket."""

    def __init__(self, socket: str, *, process: int | None = None) -> None:
        self.socket = socket
        # The worker's pid when the caller knew it: a restarted worker on the same
        # socket gets a fresh channel (see `EnginePool.client`).
        self.process = process
        self._channel = grpc.aio.insecure_channel(f"unix:{socket}", options=_CHANNEL_OPTIONS)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)

    async def health(self, *, timeout: float) -> engine_pb2.HealthResponse:
        response: engine_pb2.HealthResponse = await self._stub.Health(
            engine_pb2.HealthRequest(), timeout=timeout
        )
        return response

    def generate(self, request: engine_pb2.GenerateRequest) -> GenerateCall:
        """Start a generation; iterate the call for its chunks, cancel it to stop."""
        call: GenerateCall = self._stub.Generate(request)
        return call

    async def embed(self, request: inference_pb2.EmbedRequest) -> inference_pb2.EmbedResponse:
        response: inference_pb2.EmbedResponse = await self._stub.Embed(request)
        return response

    async def tokenize(
        self, request: inference_pb2.TokenizeRequest
    ) -> inference_pb2.TokenizeResponse:
        response: inference_pb2.TokenizeResponse = await self._stub.Tokenize(request)
        return response

    async def drain(self, *, grace: float, timeout: float) -> None:
        """Ask the worker to refuse new work and finish what it has within `grace`
        seconds (then cancel the rest); returns when it has."""
        await self._stub.Drain(engine_pb2.DrainRequest(grace_seconds=grace), timeout=timeout)

    async def park(self, request_id: str, *, timeout: float) -> engine_pb2.ParkResponse:
        """Park a running generation (preemption): its slot is free once this returns,
        its stream pauses. NOT_FOUND when it is gone, FAILED_PRECONDITION when it is
        not running (waiting for a slot, or parked already)."""
        response: engine_pb2.ParkResponse = await self._stub.Park(
            engine_pb2.ParkRequest(request_id=request_id), timeout=timeout
        )
        return response

    async def resume(
        self, request_id: str, *, timeout: float | None = None
    ) -> engine_pb2.ResumeResponse:
        """Resume a parked generation in the next free slot; returns when it runs again
        (a caller that stops waiting does not undo it). NOT_FOUND when it is gone,
        FAILED_PRECONDITION when it is not parked."""
        response: engine_pb2.ResumeResponse = await self._stub.Resume(
            engine_pb2.ResumeRequest(request_id=request_id), timeout=timeout
        )
        return response

    async def close(self) -> None:
        await self._channel.close()


class EnginePool:
    """One `EngineClient` per engine socket, opened on first use."""

    def __init__(self) -> None:
        self._clients: dict[str, EngineClient] = {}
        self._stale: list[EngineClient] = []

    def client(self, socket: str, *, process: int | None = None) -> EngineClient:
        """The socket's client. Given the worker's pid, a client opened for another
        process on that socket is replaced: the channel to a worker that died may sit in
        gRPC's reconnect backoff and fail the first calls to its restarted successor."""
        found = self._clients.get(socket)
        stale = found is not None and None not in (process, found.process)
        if stale and found is not None and found.process != process:
            self._stale.append(found)
            found = None
        if found is None:
            found = self._clients[socket] = EngineClient(socket, process=process)
        return found

    async def retain(self, sockets: Iterable[str]) -> None:
        """Close the clients of every socket not in `sockets` (replicas that are gone)."""
        keep = set(sockets)
        for socket in set(self._clients) - keep:
            await self._clients.pop(socket).close()
        while self._stale:
            await self._stale.pop().close()

    async def retire(self, serving: Iterable[tuple[str, int | None]]) -> None:
        """Close the replaced clients (see `client`) whose process, (socket, pid), is
        none of `serving`: a restarted worker's predecessor is gone, and every call on
        its channel has failed. One whose process still serves is kept: a caller routed
        before the restart swaps the two back, and calls may run on either."""
        keep = set(serving)
        gone = [c for c in self._stale if (c.socket, c.process) not in keep]
        self._stale = [c for c in self._stale if (c.socket, c.process) in keep]
        for stale in gone:
            await stale.close()

    async def close(self) -> None:
        await self.retain(())
