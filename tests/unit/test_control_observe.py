"""Control's Logs and Top over a real gRPC server on port 0: a MemoryStore, a log
directory written by the test as engines write it, and engine Health samples given
as the health monitor would hold them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest

from blazar._proto.v1 import control_pb2, control_pb2_grpc
from blazar.api import errors
from blazar.api.kinds import Kind, LaneStatus
from blazar.cli import printers
from blazar.dataplane import server
from blazar.enginehost.monitor import Sample
from blazar.rpc import status
from blazar.store.memory import MemoryStore

DOCS = [
    {
        "apiVersion": "blazar.dev/v1alpha1",
        "kind": "Model",
        "metadata": {"name": "m"},
        "spec": {"source": {"path": "/m.gguf"}},
    },
    *(
        {"apiVersion": "blazar.dev/v1alpha1", "kind": "Lane", "metadata": {"name": lane},
         "spec": {"model": "m", "replicas": 2}}
        for lane in ("a", "b")
    ),
]  # fmt: skip

Body = Callable[[control_pb2_grpc.ControlStub], Coroutine[Any, Any, None]]


def run(body: Body, *, log_dir: Path, samples: list[Sample]) -> None:
    async def main() -> None:
        store = MemoryStore()
        plane = await server.start(
            store=store, address="127.0.0.1:0", log_dir=log_dir, engines=lambda: samples
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                stub = control_pb2_grpc.ControlStub(channel)
                await stub.Apply(control_pb2.ApplyRequest(objects_json=map(json.dumps, DOCS)))
                await body(stub)
        finally:
            await plane.stop(grace=0)

    asyncio.run(main())


async def read_logs(stub: control_pb2_grpc.ControlStub, lane: str, replica: int = 0) -> bytes:
    call = stub.Logs(control_pb2.LogsRequest(lane=lane, replica=replica))
    return b"".join([chunk.data async for chunk in call])


def test_logs_send_the_replicas_file(tmp_path: Path) -> None:
    (tmp_path / "a-1.log").write_bytes(b"x" * 200_000 + b"\n")  # several chunks

    async def body(stub: control_pb2_grpc.ControlStub) -> None:
        assert await read_logs(stub, "a", 1) == b"x" * 200_000 + b"\n"

    run(body, log_dir=tmp_path, samples=[])


def test_logs_begin_with_the_last_lines_asked(tmp_path: Path) -> None:
    (tmp_path / "a-1.log").write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))

    async def body(stub: control_pb2_grpc.ControlStub) -> None:
        async def tail(lines: int) -> bytes:
            call = stub.Logs(control_pb2.LogsRequest(lane="a", replica=1, tail_lines=lines))
            return b"".join([chunk.data async for chunk in call])

        assert await tail(2) == b"line 998\nline 999\n"
        assert await tail(0) == b""
        assert (await tail(5000)).count(b"\n") == 1000
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tail(-1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tail_lines must be 0 or more" in (info.value.details() or "")

    run(body, log_dir=tmp_path, samples=[])


@pytest.mark.parametrize(
    ("lane", "replica", "code", "words"),
    [
        ("a", 0, grpc.StatusCode.NOT_FOUND, "no log of replica 0 (replicas with logs: 1)"),
        ("b", 0, grpc.StatusCode.NOT_FOUND, "(replicas with logs: none yet)"),
        ("nope", 0, grpc.StatusCode.NOT_FOUND, 'Lane "nope" not found'),
        ("../secret", 0, grpc.StatusCode.NOT_FOUND, "not found"),
        ("*", 1, grpc.StatusCode.NOT_FOUND, "not found"),
        ("a", -1, grpc.StatusCode.INVALID_ARGUMENT, "replica must be 0 or more"),
    ],
)
def test_logs_refuse_what_is_not_a_replica_log(
    tmp_path: Path, lane: str, replica: int, code: grpc.StatusCode, words: str
) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a-1.log").write_bytes(b"a's\n")
    (tmp_path / "secret-0.log").write_bytes(b"outside the log directory\n")

    async def body(stub: control_pb2_grpc.ControlStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await read_logs(stub, lane, replica)
        assert info.value.code() == code
        assert words in (info.value.details() or "")

    run(body, log_dir=tmp_path / "logs", samples=[])


def test_logs_of_an_upstream_lane_say_it_runs_no_engine(tmp_path: Path) -> None:
    """It said "replicas with logs: none yet", as if an engine's output were to come."""
    upstream = {
        "apiVersion": "blazar.dev/v1alpha1", "kind": "Lane", "metadata": {"name": "u"},
        "spec": {"engine": "upstream", "upstream": {"url": "http://u:1/v1", "model": "g"}},
    }  # fmt: skip

    async def main() -> None:
        plane = await server.start(store=MemoryStore(), address="127.0.0.1:0", log_dir=tmp_path)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                stub = control_pb2_grpc.ControlStub(channel)
                await stub.Apply(control_pb2.ApplyRequest(objects_json=[json.dumps(upstream)]))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await read_logs(stub, "u")
        finally:
            await plane.stop(grace=0)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "runs no engine (engine: upstream)" in (info.value.details() or "")

    asyncio.run(main())


def test_top_adds_up_each_lanes_replicas(tmp_path: Path) -> None:
    samples = [
        Sample(lane="a", replica=0, busy=1, free=3, cached_tokens=0, kv_bytes=0,
               memory_bytes=100),
        Sample(lane="a", replica=1, busy=2, free=2, cached_tokens=0, kv_bytes=0,
               memory_bytes=150),
    ]  # fmt: skip

    async def body(stub: control_pb2_grpc.ControlStub) -> None:
        top = await stub.Top(control_pb2.TopRequest())
        rows = {r.lane: r for r in top.lanes}
        assert list(rows) == ["a", "b"]
        a, b = rows["a"], rows["b"]
        assert (a.replicas_reporting, a.slots_busy, a.slots_total, a.memory_bytes) == (
            2, 3, 8, 250
        )  # fmt: skip
        # No dispatcher yet (nothing served): no queue, no throughput; b reported nothing.
        assert (a.queued, a.running, a.tokens_per_second) == (0, 0, 0.0)
        assert (b.replicas_reporting, b.slots_total, b.memory_bytes) == (0, 0, 0)

    run(body, log_dir=tmp_path, samples=samples)


def test_top_shows_an_upstream_lanes_concurrency_as_its_slots(tmp_path: Path) -> None:
    """It reported 0 replicas and no slots while `get` said 1/1 Ready (found with a
    llama-server upstream): its upstream is its one replica, maxConcurrency its slots."""
    upstream = {
        "apiVersion": "blazar.dev/v1alpha1", "kind": "Lane", "metadata": {"name": "u"},
        "spec": {"engine": "upstream",
                 "upstream": {"url": "http://u:1/v1", "model": "g", "maxConcurrency": 8}},
    }  # fmt: skip

    async def main() -> None:
        store = MemoryStore()
        plane = await server.start(
            store=store, address="127.0.0.1:0", log_dir=tmp_path, engines=lambda: []
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                stub = control_pb2_grpc.ControlStub(channel)
                await stub.Apply(control_pb2.ApplyRequest(objects_json=[json.dumps(upstream)]))
                store.update_status(Kind.LANE, "u", LaneStatus(replicas=1, ready_replicas=1))
                [row] = (await stub.Top(control_pb2.TopRequest())).lanes
        finally:
            await plane.stop(grace=0)
        assert (row.replicas_reporting, row.slots_busy, row.slots_total) == (1, 0, 8)
        table = printers.top_table([printers.LaneLoad(
            lane=row.lane, replicas_reporting=1, slots_busy=0, slots_total=8, queued=0,
            running=0, tokens_per_second=0.0, memory_bytes=0,
        )]).splitlines()  # fmt: skip
        assert table[1].split() == ["u", "1", "0/8", "0", "0", "0.0", "-"]

    asyncio.run(main())


def test_a_stopping_daemon_ends_open_watches_and_followed_logs(tmp_path: Path) -> None:
    """An open `blazar get lanes -w` (or `logs -f`) held the daemon's stop for the gRPC
    server's whole 5 s grace, then ended with gRPC's bare "Cancelling all calls", which
    the CLI showed as "cannot reach the Blazar daemon"."""
    (tmp_path / "a-0.log").write_bytes(b"ready\n")

    async def main() -> None:
        plane = await server.start(store=MemoryStore(), address="127.0.0.1:0", log_dir=tmp_path)
        stopped = False
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                stub = control_pb2_grpc.ControlStub(channel)
                await stub.Apply(control_pb2.ApplyRequest(objects_json=map(json.dumps, DOCS)))
                watch = stub.Watch(control_pb2.WatchRequest(kind="Lane"))
                logs = stub.Logs(control_pb2.LogsRequest(lane="a", replica=0, follow=True))
                assert (await watch.read()).type == "ADDED"
                assert (await logs.read()).data == b"ready\n"
                began = time.monotonic()
                await plane.stop(grace=5)
                stopped = True
                assert time.monotonic() - began < 2.5
                for call in (watch, logs):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        while await call.read() is not grpc.aio.EOF:
                            pass
                    assert not status.lost_peer(info.value)  # the daemon's own answer
                    remote = status.from_rpc_error(info.value)
                    assert isinstance(remote, errors.Unavailable)
                    assert "daemon is stopping" in remote.message
        finally:
            if not stopped:
                await plane.stop(grace=0)

    asyncio.run(main())
