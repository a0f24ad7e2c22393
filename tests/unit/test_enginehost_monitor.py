"""Engine health on /metrics: ready replicas polled over their sockets into gauges."""

from __future__ import annotations

import asyncio
import functools
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ParamSpec

import grpc
import pytest
from prometheus_client import REGISTRY

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc
from blazar.api.replicas import ReplicaObservation, ReplicaState
from blazar.enginehost import monitor


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, health: engine_pb2.HealthResponse) -> None:
        self.health = health

    async def Health(
        self, request: engine_pb2.HealthRequest, context: Any
    ) -> engine_pb2.HealthResponse:
        return self.health


@asynccontextmanager
async def fake_engine(health: engine_pb2.HealthResponse) -> AsyncIterator[str]:
    """An Engine server on a Unix socket, as a worker listens; yields the socket path."""
    with tempfile.TemporaryDirectory(prefix="bz-", dir="/tmp") as d:
        socket = str(Path(d) / "engine.sock")
        server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(FakeEngine(health), server)
        server.add_insecure_port(f"unix:{socket}")
        await server.start()
        try:
            yield socket
        finally:
            await server.stop(grace=None)


def replica(lane: str, index: int, socket: str, state: ReplicaState) -> ReplicaObservation:
    return ReplicaObservation(lane=lane, index=index, state=state, revision="r", socket=socket)


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


HEALTH = engine_pb2.HealthResponse(
    slots=[
        engine_pb2.SlotStatus(index=0, busy=True, cached_tokens=700),
        engine_pb2.SlotStatus(index=1, busy=False, cached_tokens=300),
        engine_pb2.SlotStatus(index=2, busy=False, cached_tokens=0),
    ],
    memory_bytes=400_000_000,
    kv_bytes=56_623_104,
)


P = ParamSpec("P")


def in_own_loop(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Run the test in an event loop of its own, as the rest of the suite does with
    asyncio.run. (Under anyio's runner, a callback that gRPC's poller left for an
    earlier test's closed loop raised into whichever test ran next: this module's
    first test failed in 5 of about 90 runs of the unit suite here.)"""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


# The fake engine answers at once, but a busy CI host can hold a first RPC over a fresh
# channel past the daemon's 2 s; these tests are not about that timeout.
PATIENT_S = 30.0


@in_own_loop
async def test_ready_replicas_are_published_and_vanish_when_they_go() -> None:
    async with fake_engine(HEALTH) as socket:
        observed = [
            replica("mon-a", 0, socket, ReplicaState.READY),
            # Not ready: never asked, never shown.
            replica("mon-a", 1, socket, ReplicaState.STARTING),
        ]
        health = monitor.HealthMonitor(observe=lambda: observed, timeout=PATIENT_S)
        [sample] = await health.poll_once()
        assert (sample.busy, sample.free, sample.cached_tokens) == (1, 2, 1000)
        a0 = {"lane": "mon-a", "replica": "0"}
        assert value("blazar_engine_slots", **a0, state="busy") == 1
        assert value("blazar_engine_slots", **a0, state="free") == 2
        assert value("blazar_engine_cached_tokens", **a0) == 1000
        assert value("blazar_engine_kv_bytes", **a0) == 56_623_104
        assert value("blazar_engine_memory_bytes", **a0) == 400_000_000
        assert value("blazar_engine_cached_tokens", lane="mon-a", replica="1") is None

        observed[0] = replica("mon-a", 0, socket, ReplicaState.DRAINING)
        assert await health.poll_once() == []
        assert value("blazar_engine_cached_tokens", **a0) is None
        assert value("blazar_engine_slots", **a0, state="busy") is None


@in_own_loop
async def test_a_replica_that_does_not_answer_loses_its_series() -> None:
    async with fake_engine(HEALTH) as socket:
        observed = [replica("mon-b", 0, socket, ReplicaState.READY)]
        health = monitor.HealthMonitor(observe=lambda: observed, timeout=PATIENT_S)
        await health.poll_once()
        assert value("blazar_engine_cached_tokens", lane="mon-b", replica="0") == 1000
    # The server is gone; the socket path no longer answers.
    assert await health.poll_once() == []
    assert value("blazar_engine_cached_tokens", lane="mon-b", replica="0") is None


@in_own_loop
async def test_run_polls_until_stopped_then_clears() -> None:
    async with fake_engine(HEALTH) as socket:
        observed = [replica("mon-c", 0, socket, ReplicaState.READY)]
        health = monitor.HealthMonitor(observe=lambda: observed, interval=0.01, timeout=PATIENT_S)
        stop = asyncio.Event()
        task = asyncio.create_task(health.run(stop))
        for _ in range(200):
            if value("blazar_engine_cached_tokens", lane="mon-c", replica="0") == 1000:
                break
            await asyncio.sleep(0.01)
        assert value("blazar_engine_cached_tokens", lane="mon-c", replica="0") == 1000
        stop.set()
        await asyncio.wait_for(task, 5)
    assert value("blazar_engine_cached_tokens", lane="mon-c", replica="0") is None


@pytest.mark.parametrize(("failure", "expected"), [("", 0), ("the model drafter failed", 1)])
@in_own_loop
async def test_a_failed_drafter_shows(failure: str, expected: int) -> None:
    """A replica whose drafter failed decodes on, slower; its operator must see it."""
    health = engine_pb2.HealthResponse()
    health.CopyFrom(HEALTH)
    health.speculation.kind = "model"
    health.speculation.failure = failure
    async with fake_engine(health) as socket:
        monitor_ = monitor.HealthMonitor(
            observe=lambda: [replica("mon-s", 0, socket, ReplicaState.READY)], timeout=PATIENT_S
        )
        await monitor_.poll_once()
        assert value("blazar_engine_speculation_failed", lane="mon-s", replica="0") == expected
        monitor_.publisher.publish(())
        assert value("blazar_engine_speculation_failed", lane="mon-s", replica="0") is None


@in_own_loop
async def test_a_replica_without_speculation_has_no_speculation_series() -> None:
    async with fake_engine(HEALTH) as socket:
        monitor_ = monitor.HealthMonitor(
            observe=lambda: [replica("mon-n", 0, socket, ReplicaState.READY)], timeout=PATIENT_S
        )
        await monitor_.poll_once()
        assert value("blazar_engine_slots", lane="mon-n", replica="0", state="free") == 2
        assert value("blazar_engine_speculation_failed", lane="mon-n", replica="0") is None
