"""One `python -m blazar.engine` worker for the engine-only benchmarks.

    with engine_worker.running(model, slots=8) as socket:
        asyncio.run(measure(socket))   # call `ready(stub)` first

The worker is terminated when the block ends, also on error.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from blazar.api.kinds import LaneSpec  # noqa: E402
from blazar.api.replicas import EngineLaunch, LaunchSpec  # noqa: E402


def launch_spec(model: Path, *, slots: int, context_per_slot: int, threads: int) -> LaunchSpec:
    """A plain Lane's launch: f16 KV cache, no persistence, no speculation."""
    lane = LaneSpec(model="m", slots=slots, contextPerSlot=context_per_slot, threads=threads)
    return LaunchSpec.of_lane(lane, model_path=str(model), default_threads=threads)


@contextlib.contextmanager
def running(
    model: Path, *, slots: int, context_per_slot: int = 2048, threads: int = 2
) -> Iterator[str]:
    """Start a worker on a fresh socket; yields the socket path."""
    socket = str(Path(tempfile.mkdtemp(prefix="bz-", dir="/tmp")) / "engine.sock")
    launch = EngineLaunch(
        spec=launch_spec(model, slots=slots, context_per_slot=context_per_slot, threads=threads),
        socket=socket,
        drain_grace_seconds=10.0,
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "blazar.engine", "--launch", "-"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert worker.stdin is not None
    worker.stdin.write(launch.to_json())
    worker.stdin.close()
    try:
        yield socket
    finally:
        worker.terminate()
        worker.wait(timeout=30)


async def ready(stub: engine_pb2_grpc.EngineStub, *, timeout_s: float = 120.0) -> None:
    """Wait until the worker's Health says READY."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            health = await stub.Health(engine_pb2.HealthRequest(), timeout=2)
            if health.state == engine_pb2.ENGINE_STATE_READY:
                return
        except grpc.aio.AioRpcError:
            pass  # the socket is not there yet
        if time.monotonic() > deadline:
            raise TimeoutError("worker not ready")
        await asyncio.sleep(0.1)
