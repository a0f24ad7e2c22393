"""The data plane's relay against fake engines on real Unix sockets (Blazar's own
boundary): a replica that refuses before its first chunk is skipped."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from blazar._proto.engine.v1 import engine_pb2_grpc
from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import errors
from blazar.api.kinds import Kind, Lane, LaneSpec, LaneStatus, ReplicaStatus
from blazar.api.meta import ObjectMeta
from blazar.dataplane import server
from blazar.rpc import status
from blazar.store.memory import MemoryStore


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, *, refuse: bool, text: str) -> None:
        self.refuse = refuse
        self.text = text
        self.calls = 0

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
        self.calls += 1
        if self.refuse:
            await status.abort(context, errors.Unavailable("draining"))
        yield inference_pb2.Chunk(delta=inference_pb2.Delta(text=self.text, tokens=1))
        yield inference_pb2.Chunk(
            final=inference_pb2.Final(finish_reason=inference_pb2.FINISH_REASON_STOP)
        )


@contextlib.asynccontextmanager
async def engines(*fakes: FakeEngine) -> AsyncIterator[list[str]]:
    directory = Path(tempfile.mkdtemp(prefix="bz-", dir="/tmp"))
    servers, sockets = [], []
    for i, fake in enumerate(fakes):
        srv = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(fake, srv)
        socket = str(directory / f"e{i}.sock")
        srv.add_insecure_port(f"unix:{socket}")
        await srv.start()
        servers.append(srv)
        sockets.append(socket)
    try:
        yield sockets
    finally:
        for srv in servers:
            await srv.stop(0)


def lane(sockets: list[str]) -> Lane:
    return Lane(
        metadata=ObjectMeta(name="l"),
        spec=LaneSpec(model="m", replicas=len(sockets)),
        status=LaneStatus(
            replica_statuses=[
                ReplicaStatus(index=i, state="Ready", socket=s) for i, s in enumerate(sockets)
            ]
        ),
    )


async def complete(fakes: list[FakeEngine]) -> tuple[list[inference_pb2.Chunk], Exception | None]:
    async with engines(*fakes) as sockets:
        store = MemoryStore()
        store.apply_all([lane(sockets)])
        store.update_status(Kind.LANE, "l", lane(sockets).status)
        plane = await server.start(store=store, address="127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                chunks: list[inference_pb2.Chunk] = []
                try:
                    async for chunk in stub.Complete(
                        inference_pb2.CompleteRequest(model="l", prompt="hi")
                    ):
                        chunks.append(chunk)
                except grpc.aio.AioRpcError as exc:
                    return chunks, exc
                return chunks, None
        finally:
            await plane.stop(grace=0)


def test_a_refusing_replica_is_skipped() -> None:
    refusing, serving = FakeEngine(refuse=True, text="no"), FakeEngine(refuse=False, text="yes")
    chunks, error = asyncio.run(complete([refusing, serving]))
    assert error is None
    assert [c.delta.text for c in chunks if c.HasField("delta")] == ["yes"]
    assert chunks[-1].final.routing.replica == 1
    assert (refusing.calls, serving.calls) == (1, 1)


def test_every_replica_refusing_is_unavailable() -> None:
    fakes = [FakeEngine(refuse=True, text="a"), FakeEngine(refuse=True, text="b")]
    chunks, error = asyncio.run(complete(fakes))
    assert chunks == []
    assert isinstance(error, grpc.aio.AioRpcError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert [f.calls for f in fakes] == [1, 1]


def test_a_healthy_first_replica_is_used_once() -> None:
    first, second = FakeEngine(refuse=False, text="x"), FakeEngine(refuse=False, text="y")
    chunks, error = asyncio.run(complete([first, second]))
    assert error is None and (first.calls, second.calls) == (1, 0)
    assert chunks[-1].final.routing.replica == 0
