"""A real engine worker process for tests: spawn it on a short socket path, wait for
READY by its Health RPC, drive it, and kill whatever is left."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc
from blazar._proto.v1 import inference_pb2
from blazar.api.replicas import EngineLaunch
from blazar.enginehost import rundir
from tests import launches

REPO = Path(__file__).resolve().parents[2]
CONTEXT_PER_SLOT = 1024
SLOTS = 2
READY_DEADLINE_S = 60.0
# As the supervisor sets it: what a SIGTERM gives in-flight requests.
DRAIN_GRACE_S = 10.0


@functools.cache
def make_draft_tool() -> ModuleType:
    """tools/make_draft.py, loaded once per test session.

    Once per session because its measurements install a llama.cpp log callback held
    by a module global: a second load let the first module, and with it the callback,
    be collected while llama.cpp still called it (a segfault in the next model load).
    """
    spec = importlib.util.spec_from_file_location("make_draft", REPO / "tools" / "make_draft.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_draft"] = module
    spec.loader.exec_module(module)
    return module


def poll(condition: Callable[[], Any], *, deadline_s: float = 15.0, what: str = "condition") -> Any:
    """Return condition()'s first truthy value; fail after the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.02)


def pid_gone(pid: int) -> bool:
    """True once pid has exited (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    socket: str
    log: Path
    channel: grpc.Channel
    stub: engine_pb2_grpc.EngineStub

    def health(self) -> engine_pb2.HealthResponse | None:
        try:
            h: engine_pb2.HealthResponse = self.stub.Health(engine_pb2.HealthRequest(), timeout=2.0)
        except grpc.RpcError:
            return None
        return h

    def wait_ready(self) -> engine_pb2.HealthResponse:
        def ready() -> engine_pb2.HealthResponse | None:
            if self.proc.poll() is not None:
                pytest.fail(f"worker exited with {self.proc.returncode}:\n{self.log.read_text()}")
            h = self.health()
            return h if h is not None and h.state == engine_pb2.ENGINE_STATE_READY else None

        return poll(ready, deadline_s=READY_DEADLINE_S, what="READY")  # type: ignore[no-any-return]

    def generate(self, **kwargs: Any) -> tuple[list[inference_pb2.Delta], inference_pb2.Final]:
        """Run one Generate; all deltas and the final part."""
        deltas: list[inference_pb2.Delta] = []
        finals: list[inference_pb2.Final] = []
        for chunk in self.stub.Generate(engine_pb2.GenerateRequest(**kwargs), timeout=60):
            (deltas if chunk.HasField("delta") else finals).append(
                chunk.delta if chunk.HasField("delta") else chunk.final
            )
        assert len(finals) == 1
        return deltas, finals[0]

    def text(self, **kwargs: Any) -> str:
        deltas, _ = self.generate(**kwargs)
        return "".join(d.text for d in deltas)


def launch(
    model_path: Path,
    socket: str,
    *,
    kv_dir: Path | None = None,
    parent_pid: int | None = None,
    drain_grace_seconds: float = DRAIN_GRACE_S,
    cpu_share: Path | None = None,
    **spec: Any,
) -> EngineLaunch:
    """A worker's launch document: `SLOTS` slots of `CONTEXT_PER_SLOT` on two threads,
    unless `spec` says otherwise (any `LaunchSpec` field). Its engine shares the cores
    with the user's other engines as a daemon's do (the host's table, unless
    `cpu_share` names another): with the suite on two workers, an engine a test starts
    itself and one a daemon started meanwhile would otherwise spin against each other
    at every barrier (`blazar.engine.cpushare`)."""
    if cpu_share is None:
        cpu_share = rundir.cpu_share_path(rundir.runtime_root())
    fields: dict[str, Any] = {"slots": SLOTS, "context_per_slot": CONTEXT_PER_SLOT} | spec
    return EngineLaunch(
        spec=launches.spec(model_path, kv_persist=kv_dir is not None, **fields),
        socket=socket,
        drain_grace_seconds=drain_grace_seconds,
        kv_dir=str(kv_dir) if kv_dir is not None else None,
        parent_pid=parent_pid,
        log_json=True,
        cpu_share=str(cpu_share),
    )


def worker_args(launch_file: Path | str) -> list[str]:
    return [sys.executable, "-m", "blazar.engine", "--launch", str(launch_file)]


class Spawner:
    """Starts workers on short socket paths; `close` kills whatever is left."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.workers: list[Worker] = []
        self.dirs: list[str] = []

    def __call__(self, **settings: Any) -> Worker:
        """A worker launched with `launch`'s defaults and these settings."""
        d = tempfile.mkdtemp(prefix="bz-", dir="/tmp")  # AF_UNIX paths max ~107 bytes
        self.dirs.append(d)
        socket = os.path.join(d, "engine.sock")
        launch_file = Path(d, "launch.json")
        launch_file.write_bytes(launch(self.model_path, socket, **settings).to_json())
        log = Path(d, "worker.log")
        with log.open("wb") as out:
            proc = subprocess.Popen(
                worker_args(launch_file),
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        channel = grpc.insecure_channel(f"unix:{socket}")
        w = Worker(proc, socket, log, channel, engine_pb2_grpc.EngineStub(channel))
        self.workers.append(w)
        return w

    def close(self) -> None:
        for w in self.workers:
            w.channel.close()
            if w.proc.poll() is None:
                os.killpg(w.proc.pid, signal.SIGKILL)
            w.proc.wait(timeout=10)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def greedy(max_tokens: int, **sampling: Any) -> inference_pb2.Sampling:
    return inference_pb2.Sampling(temperature=0.0, max_tokens=max_tokens, **sampling)


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value
