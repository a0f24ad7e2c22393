"""The engine supervisor starting replicas it cannot start as asked, driven by the Lane
reconciler: the replica is never left stuck at Starting, and the Lane says why.

The worker is a stand-in for `python -m blazar.engine`: a script that records its
command line and sleeps, so these tests spawn real processes but load no model.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import structlog

from blazar.api import conditions, kinds, manifests
from blazar.api.kinds import Kind, Lane
from blazar.api.meta import ConditionStatus
from blazar.api.replicas import EngineLaunch, LaunchSpec, ReplicaObservation, ReplicaState
from blazar.controller.lane import LaneReconciler
from blazar.engine import __main__ as engine_main
from blazar.enginehost import cores, forensics, rundir, supervisor
from blazar.store.memory import MemoryStore
from tests import launches
from tests.unit import helpers
from tests.unit.helpers import Clock

FAKE_WORKER = f"""#!{sys.executable}
import os, signal, sys, json, time

with open(sys.argv[sys.argv.index("--launch") + 1]) as f:
    launch = json.load(f)

def save_and_exit(*_):
    # As the engine does on a graceful stop: save the slots, making the directory.
    if launch["kv_dir"] is not None:
        os.makedirs(launch["kv_dir"], exist_ok=True)
        with open(os.path.join(launch["kv_dir"], "slot-0.kv"), "w") as f:
            f.write("saved")
    sys.exit(0)

signal.signal(signal.SIGTERM, save_and_exit)
here = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(here, "argv.%d" % os.getpid())
with open(path + ".tmp", "w") as f:
    json.dump({{"argv": sys.argv[1:], "launch": launch}}, f)
os.rename(path + ".tmp", path)
time.sleep(60)
"""


def manifest(*, persist: bool = False, replicas: int = 1) -> str:
    model_spec = {"source": {"path": "/models/m.gguf"}}
    lane_spec = {"model": "m", "replicas": replicas, "slots": 1, "threads": 1}
    if persist:
        lane_spec["kvCache"] = {"persist": True}
    return "\n---\n".join(
        json.dumps({"apiVersion": "blazar.dev/v1alpha1", "kind": k, "metadata": m, "spec": s})
        for k, m, s in (("Model", {"name": "m"}, model_spec), ("Lane", {"name": "l"}, lane_spec))
    )


@dataclass
class Fixture:
    clock: Clock
    store: MemoryStore
    supervisor: supervisor.Supervisor
    reconciler: LaneReconciler
    bin_dir: Path

    def replica(self) -> ReplicaObservation:
        (obs,) = self.supervisor.observe("l")
        return obs

    def events(self) -> list[tuple[str, str, str]]:
        return [(e.type, e.reason, e.message) for e in self.store.events(kind="Lane", name="l")]

    def launch(self, pid: int) -> dict[str, Any]:
        return recorded_launch(self.bin_dir, pid)


def recorded(bin_dir: Path, pid: int) -> dict[str, Any]:
    """What the fake worker with this pid recorded: its arguments and launch document."""
    path = bin_dir / f"argv.{pid}"
    poll(path.exists, what="the worker to record its command line")
    found: dict[str, Any] = json.loads(path.read_text())
    return found


def recorded_argv(bin_dir: Path, pid: int) -> list[str]:
    """The arguments the fake worker with this pid was started with."""
    args: list[str] = recorded(bin_dir, pid)["argv"]
    return args


def recorded_launch(bin_dir: Path, pid: int) -> dict[str, Any]:
    """The launch document the fake worker with this pid read, as JSON."""
    launch: dict[str, Any] = recorded(bin_dir, pid)["launch"]
    return launch


def poll(condition: Callable[[], bool], *, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def fake_worker(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    worker = bin_dir / "python"
    worker.write_text(FAKE_WORKER)
    worker.chmod(0o755)
    return worker


def bare_supervisor(
    tmp_path: Path, **launch: Any
) -> tuple[supervisor.Supervisor, LaunchSpec, Path]:
    """A supervisor of fake workers with no controller, a one-slot launch for it (with
    `launch`'s fields), and the fake worker's path."""
    worker = fake_worker(tmp_path)
    sup = supervisor.Supervisor(
        home=tmp_path / "home", on_change=lambda _: None, python=str(worker)
    )
    spec = launches.spec("/models/m.gguf", slots=1, context_per_slot=512, threads=1, **launch)
    return sup, spec, worker


@asynccontextmanager
async def lane(tmp_path: Path, text: str, *, python: str | None = None) -> AsyncIterator[Fixture]:
    """Lane "l" applied and reconciled once, its Model ready; replicas stopped at the end."""
    worker = fake_worker(tmp_path)
    # From the real time: the supervisor stamps exits with it, and backoff counts from there.
    clock = Clock(datetime.now(UTC))
    store = MemoryStore(clock=clock)
    docs = manifests.parse_documents(text, source="test")
    store.apply_all(manifests.validate_objects(docs, exists=lambda k, n: False))
    helpers.mark_model_ready(store, "m", path="/models/m.gguf", now=clock.now)
    sup = supervisor.Supervisor(
        home=tmp_path / "home", on_change=lambda _: None, python=python or str(worker)
    )
    reconciler = LaneReconciler(store=store, processes=sup, clock=clock)
    try:
        await reconciler.reconcile("l")
        yield Fixture(
            clock=clock, store=store, supervisor=sup, reconciler=reconciler, bin_dir=worker.parent
        )
    finally:
        await sup.stop_all(grace=1.0)
        remove_run_dir(sup)


def remove_run_dir(sup: supervisor.Supervisor) -> None:
    """tmp_path is too long for sockets, so the run directory is a /tmp/blazar-* of its own."""
    sup.run_dir.rmdir()  # fails if stopping left anything behind


def test_kv_directory_that_cannot_be_created_starts_the_replica_cold(tmp_path: Path) -> None:
    async def run() -> tuple[ReplicaObservation, dict[str, Any], list[tuple[str, str, str]]]:
        kv_lane = tmp_path / "home" / "kv" / "l"
        kv_lane.parent.mkdir(parents=True)
        kv_lane.write_text("a regular file where the lane's directory should be")
        async with lane(tmp_path, manifest(persist=True)) as f:
            obs = f.replica()
            assert obs.pid is not None
            return obs, f.launch(obs.pid), f.events()

    obs, launch, events = asyncio.run(run())
    assert obs.state == ReplicaState.STARTING
    assert launch["spec"]["kv_persist"] is True
    assert launch["kv_dir"] is None
    kv_dir = tmp_path / "home" / "kv" / "l" / "0"
    warnings = [e for e in events if e[0] == "Warning"]
    assert len(warnings) == 1
    _, reason, message = warnings[0]
    assert reason == "KVPersistenceDisabled"
    assert message.startswith(
        f"Replica 0 starts without KV cache persistence: cannot create {kv_dir}: "
    )
    assert "Not a directory" in message


def test_kv_directory_is_passed_when_it_can_be_created(tmp_path: Path) -> None:
    async def run() -> dict[str, Any]:
        async with lane(tmp_path, manifest(persist=True)) as f:
            pid = f.replica().pid
            assert pid is not None
            return f.launch(pid)

    launch = asyncio.run(run())
    kv_dir = tmp_path / "home" / "kv" / "l" / "0"
    assert launch["kv_dir"] == str(kv_dir)
    assert kv_dir.is_dir()


def kv_dirs(tmp_path: Path) -> list[str]:
    """What is left under the lane's KV directory: replica numbers and saved files."""
    lane_dir = tmp_path / "home" / "kv" / "l"
    return sorted(str(p.relative_to(lane_dir)) for p in lane_dir.rglob("*"))


def test_scaling_down_keeps_the_kv_caches(tmp_path: Path) -> None:
    """As a StatefulSet keeps its volumes: `replicas: 0` pauses a Lane, and scaling back
    up must find what each replica saved as it stopped."""

    def scale(f: Fixture, replicas: int) -> None:
        f.store.apply_all(
            manifests.validate_objects(
                manifests.parse_documents(manifest(persist=True, replicas=replicas), source="test"),
                exists=lambda k, n: True,
            )
        )

    async def run() -> list[str]:
        async with lane(tmp_path, manifest(persist=True, replicas=2)) as f:
            for obs in f.supervisor.observe("l"):
                assert obs.pid is not None
                f.launch(obs.pid)  # running, its signal handler in place
            scale(f, 0)
            await f.reconciler.reconcile("l")
            assert f.supervisor.observe("l") == []
            return kv_dirs(tmp_path)

    assert asyncio.run(run()) == ["0", "0/slot-0.kv", "1", "1/slot-0.kv"]


def test_a_delete_left_unfinished_is_finished_at_the_next_start(tmp_path: Path) -> None:
    """The daemon stopped right after `blazar delete lane old`: no stored object names
    "old" any more, yet its saved caches must go before a new Lane "old" restores them."""
    from blazar.controller import manager

    stray = tmp_path / "home" / "kv" / "old" / "0"
    stray.mkdir(parents=True)
    (stray / "slot-0.kv").write_text("saved")
    clock = Clock(datetime.now(UTC))
    store = MemoryStore(clock=clock)
    sup = supervisor.Supervisor(
        home=tmp_path / "home", on_change=lambda _: None, python=str(fake_worker(tmp_path))
    )

    async def run() -> None:
        mgr = manager.Manager(
            store=store,
            reconcilers=[LaneReconciler(store=store, processes=sup, clock=clock)],
            leftovers=lambda: [(Kind.LANE, name) for name in sup.kv_lanes()],
        )
        await mgr.start()
        try:
            for _ in range(500):
                if not stray.parent.exists():
                    break
                await asyncio.sleep(0.01)
        finally:
            await mgr.stop()

    asyncio.run(run())
    remove_run_dir(sup)
    assert sup.kv_lanes() == []
    assert (tmp_path / "home" / "kv").is_dir()


def test_deleting_a_lane_removes_its_kv_caches_after_its_replicas_saved(
    tmp_path: Path,
) -> None:
    async def run() -> list[tuple[str, str, str]]:
        async with lane(tmp_path, manifest(persist=True, replicas=2)) as f:
            for obs in f.supervisor.observe("l"):
                assert obs.pid is not None
                f.launch(obs.pid)
            f.store.delete(Kind.LANE, "l")
            await f.reconciler.reconcile("l")
            assert f.supervisor.observe("l") == []
            return f.events()

    events = asyncio.run(run())
    # Removed after the replicas stopped: the caches they saved on the way out went too.
    assert not (tmp_path / "home" / "kv" / "l").exists()
    assert (tmp_path / "home" / "kv").is_dir()
    assert [e[1] for e in events if e[1] == "KVCacheRemoved"] == ["KVCacheRemoved"] * 2


def test_kv_caches_of_a_running_replica_are_never_removed(tmp_path: Path) -> None:
    sup, launch, _ = bare_supervisor(tmp_path, kv_persist=True)
    stray = tmp_path / "home" / "kv" / "l" / "7"  # no replica of that number
    stray.mkdir(parents=True)

    async def run() -> tuple[list[int], list[str]]:
        try:
            await sup.start("l", 1, launch)
            removed = await sup.discard_kv("l")  # as if the lane were gone
            return removed, kv_dirs(tmp_path)
        finally:
            await sup.stop_all(grace=1.0)

    removed, left = asyncio.run(run())
    assert (removed, left) == ([7], ["1"])
    remove_run_dir(sup)


LONG_TEMPLATE = (
    "{# " + "x" * 200 * 1024 + " #}\r\n{% for m in messages %}{{ m.content }}{% endfor %}"
)


@pytest.mark.parametrize(
    "template", ["chatml", "gemma", "{{ messages[0].content }}", LONG_TEMPLATE]
)
def test_the_launch_document_reaches_the_worker_whatever_its_length(
    tmp_path: Path, template: str
) -> None:
    """The worker's whole configuration is one file, readable by its owner only, so a
    chat template of any length goes through (one argument is capped at 128 KiB)."""
    # Straight to the supervisor: how long a template a manifest may hold is not its concern.
    sup, launch, worker = bare_supervisor(tmp_path, chat_template=template)

    async def run() -> tuple[ReplicaObservation, list[str], EngineLaunch, int]:
        try:
            assert await sup.start("l", 0, launch) == []
            (obs,) = sup.observe("l")
            assert obs.pid is not None, obs
            argv = recorded_argv(worker.parent, obs.pid)
            # What the worker makes of it, while the file is there.
            mode = Path(argv[3]).stat().st_mode & 0o777
            return obs, argv, engine_main.parse_args(argv[2:]), mode
        finally:
            await sup.stop_all(grace=1.0)

    obs, argv, parsed, mode = asyncio.run(run())
    assert obs.state == ReplicaState.STARTING
    assert argv[:3] == ["-m", "blazar.engine", "--launch"]
    assert mode == 0o600
    assert parsed.spec == launch
    assert parsed.spec.chat_template == template
    assert parsed.socket == obs.socket
    assert parsed.parent_pid == os.getpid()
    remove_run_dir(sup)  # stop() removed the launch document and the socket


def test_a_stop_in_a_home_turned_read_only_still_stops_the_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files a replica leaves (its socket, its launch document) are cleaned up
    when they can be; one that cannot be removed does not fail the stop."""
    sup, launch, _ = bare_supervisor(tmp_path)

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    async def run() -> int:
        assert await sup.start("l", 0, launch) == []
        (obs,) = sup.observe("l")
        assert obs.pid is not None
        monkeypatch.setattr(Path, "unlink", read_only)
        await sup.stop_all(grace=1.0)
        monkeypatch.undo()
        return obs.pid

    pid = asyncio.run(run())
    assert sup.observe("l") == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    left = sorted(p.name for p in sup.run_dir.iterdir())
    assert left == ["l-0.launch.json", "l-0.sock"] or left == ["l-0.launch.json"], left
    for path in sup.run_dir.iterdir():
        path.unlink()
    remove_run_dir(sup)


def test_a_home_removed_under_the_daemon_is_made_again_for_the_next_start(
    tmp_path: Path,
) -> None:
    sup, launch, _ = bare_supervisor(tmp_path)
    shutil.rmtree(sup.home)
    sup.run_dir.rmdir()

    async def run() -> ReplicaObservation:
        try:
            assert await sup.start("l", 0, launch) == []
            (obs,) = sup.observe("l")
            return obs
        finally:
            await sup.stop_all(grace=1.0)

    obs = asyncio.run(run())
    assert obs.pid is not None and obs.state == ReplicaState.STARTING, obs
    assert (sup.log_dir / "l-0.log").is_file()
    for directory in (sup.home, sup.log_dir, sup.run_dir):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    remove_run_dir(sup)


def test_a_worker_that_cannot_be_spawned_fails_like_a_crash(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-python")

    async def run() -> tuple[ReplicaObservation, list[tuple[str, str, str]], Lane]:
        async with lane(tmp_path, manifest(), python=missing) as f:
            first = f.replica()
            f.clock.now += timedelta(seconds=1.1)  # past the crash backoff: try again
            await f.reconciler.reconcile("l")
            lane_obj = f.store.get(Kind.LANE, "l")
            assert isinstance(lane_obj, Lane)
            assert (first.state, first.pid) == (f.replica().state, f.replica().pid)
            return f.replica(), f.events(), lane_obj

    obs, events, lane_obj = asyncio.run(run())
    assert (obs.state, obs.pid, obs.restarts) == (ReplicaState.FAILED, None, 1)
    assert obs.message.startswith("cannot start the engine process: [Errno 2] No such file")
    failed = ("Warning", "ReplicaStartFailed", f"Replica 0: {obs.message}.")
    # Each failure says when the next try comes: at once, then after the back-off.
    assert [e for e in events if e[0] == "Warning"] == [
        (*failed[:2], failed[2] + " It is restarted at once."),
        ("Warning", "BackOff", "Restarting crashed replica 0 at once."),
        (*failed[:2], failed[2] + " It is restarted in 1 s, after its crash back-off."),
    ]
    degraded = conditions.get_condition(lane_obj.status.conditions, "Degraded")
    assert degraded is not None and degraded.status == ConditionStatus.TRUE
    (status,) = lane_obj.status.replica_statuses
    assert (status.state, status.message) == ("Failed", obs.message)


def log_line(event: str, level: str = "info", **fields: object) -> str:
    return json.dumps({**fields, "event": event, "level": level, "pid": 7})


@pytest.mark.parametrize(
    ("tail", "code", "expected"),
    [
        # The worker's own error record, not the "stopped" line that follows it.
        (
            "\n".join(
                [
                    log_line("loading"),
                    log_line("chat_template_invalid", "error", error="unexpected '}'"),
                    log_line("stopped", exit_code=1),
                ]
            ),
            1,
            "chat_template_invalid: unexpected '}'",
        ),
        # A logged exception: its traceback's last line.
        (
            log_line(
                "load_failed",
                "error",
                exception='Traceback (most recent call last):\n  File "x"\nValueError: bad gguf',
            ),
            1,
            "load_failed: ValueError: bad gguf",
        ),
        # Killed: the signal, not the last request it logged (a review saw that).
        (log_line("request_done", prompt_tokens=404), -9, "killed by SIGKILL"),
        # The latest explanation wins: an error it survived does not explain the end.
        (
            "\n".join(
                [
                    log_line("kv_restore_failed", "error", error="slot-0.kv truncated"),
                    log_line("ready"),
                    "Traceback (most recent call last):",
                    "RuntimeError: llama_decode returned -3",
                ]
            ),
            1,
            "RuntimeError: llama_decode returned -3",
        ),
        # llama.cpp aborts on a failed assertion: the signal and the assertion.
        (
            "ggml.c:1234: GGML_ASSERT(n_tokens <= n_batch) failed\n",
            -6,
            "killed by SIGABRT: ggml.c:1234: GGML_ASSERT(n_tokens <= n_batch) failed",
        ),
        # A native crash: the fault handler's dump, with the crashing thread's
        # innermost Python call (the other threads' stacks and the module list after
        # it explain nothing).
        (
            "\n".join(
                [
                    log_line("ready"),
                    "Fatal Python error: Segmentation fault",
                    "",
                    "Thread 0x00007f0000000001 (most recent call first):",
                    '  File "/usr/lib/python3.11/threading.py", line 320 in wait',
                    "",
                    "Current thread 0x00007f0000000002 (most recent call first):",
                    '  File "/repo/blazar/engine/llama.py", line 88 in decode',
                    '  File "/repo/blazar/engine/loop.py", line 301 in step',
                    "",
                    "Extension modules: numpy.core._multiarray_umath, grpc._cython (total: 2)",
                ]
            ),
            -11,
            "killed by SIGSEGV: Fatal Python error: Segmentation fault in decode "
            "(engine/llama.py:88)",
        ),
        # Nothing structured: a traceback's last line, then the last line.
        (
            "Traceback (most recent call last):\n  File 'x'\nOSError: [Errno 12]\n",
            1,
            "OSError: [Errno 12]",
        ),
        ("something odd\n", 2, "something odd"),
        ("", 3, ""),
    ],
)
def test_exit_reason(tail: str, code: int, expected: str) -> None:
    assert forensics.exit_reason(tail, code) == expected


def test_a_worker_shares_the_cores_with_libgomps_own_spin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines keep libgomp's default spin (the daemon adds no GOMP_ setting) and
    share the cores through the user's table, named in the launch document."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    sup, launch, worker = bare_supervisor(tmp_path)

    async def run() -> tuple[dict[str, str], dict[str, Any]]:
        try:
            await sup.start("l", 0, launch)
            (obs,) = sup.observe("l")
            assert obs.pid is not None
            document = recorded_launch(worker.parent, obs.pid)  # the worker is up
            raw = Path(f"/proc/{obs.pid}/environ").read_bytes()
            env = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
            return env, document
        finally:
            await sup.stop_all(grace=1.0)

    env, document = asyncio.run(run())
    assert not {k for k in env if k.startswith(("GOMP_", "OMP_"))}
    assert document["cpu_share"] == str(sup.cpu_share)
    assert document["host_cpus"] == cores.count()  # the cores the table shares
    assert sup.cpu_share == rundir.cpu_share_path(rundir.runtime_root())
    remove_run_dir(sup)


# A worker that answers Health as a ready engine does, and nothing else.
SERVING_WORKER = f"""#!{sys.executable}
STEP_AGE_MS = 0.0
import json, sys, time
from concurrent import futures
import grpc
from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc

class Engine(engine_pb2_grpc.EngineServicer):
    def Health(self, request, context):
        return engine_pb2.HealthResponse(
            state=engine_pb2.ENGINE_STATE_READY, step_age_ms=STEP_AGE_MS
        )

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
engine_pb2_grpc.add_EngineServicer_to_server(Engine(), server)
with open(sys.argv[sys.argv.index("--launch") + 1]) as f:
    server.add_insecure_port("unix:" + json.load(f)["socket"])
server.start()
time.sleep(120)
"""


async def until(condition: Callable[[], bool], *, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("hangs", [True, False])
def test_a_ready_replica_that_stops_answering_is_killed_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hangs: bool
) -> None:
    """A liveness probe: a worker that stops answering Health (here: SIGSTOP, as a
    deadlock would) is killed and fails like a crash, so the Lane restarts it; one that
    keeps answering is left alone, and a stop is not taken for a hang."""
    monkeypatch.setattr(supervisor, "LIVENESS_PERIOD_S", 0.1)
    monkeypatch.setattr(supervisor, "LIVENESS_TIMEOUT_S", 0.3)
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER)

    async def run() -> ReplicaObservation:
        await sup.start("l", 0, spec)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.READY, what="ready")
        (ready,) = sup.observe("l")
        assert ready.pid is not None
        if hangs:
            os.kill(ready.pid, signal.SIGSTOP)
            await until(lambda: sup.observe("l")[0].state == ReplicaState.FAILED, what="failed")
        else:
            await asyncio.sleep(2.0)  # about 20 probes
        (obs,) = sup.observe("l")
        await sup.stop_all(grace=1.0)
        return obs

    obs = asyncio.run(run())
    remove_run_dir(sup)
    if hangs:
        assert obs.exit_code == -signal.SIGKILL
        assert obs.message.startswith("stopped answering its health checks (3 in a row")
    else:
        assert (obs.state, obs.exit_code, obs.message) == (ReplicaState.READY, None, "")


def test_a_lanes_health_settings_decide_its_checks(tmp_path: Path) -> None:
    """`Lane.spec.health` acts: a replica must be Ready within startupSeconds (one that
    loads forever fails then, saying which setting), and a Ready one is killed after
    failureThreshold misses of timeoutSeconds each, read at each check (told after it
    was Ready)."""
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER.replace("ENGINE_STATE_READY", "ENGINE_STATE_STARTING"))
    fast = kinds.Health(startup_seconds=1, period_seconds=1, timeout_seconds=1, failure_threshold=1)
    # `check` says whether what a Lane was told changed (its crashed replicas then
    # restart without their back-off): not the first time, nor on a forget.
    told = [sup.check("x", h) for h in (kinds.Health(), fast, fast, None, fast)]
    assert told == [False, True, False, False, False]

    async def loading() -> ReplicaObservation:
        sup.check("l", fast)
        await sup.start("l", 0, spec)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.FAILED, what="failed")
        (obs,) = sup.observe("l")
        await sup.stop_all(grace=1.0)
        return obs

    started = time.monotonic()
    obs = asyncio.run(loading())
    assert time.monotonic() - started < 8
    assert obs.message == "not ready within 1s (the Lane's health.startupSeconds)"

    worker.write_text(SERVING_WORKER)

    async def hung() -> ReplicaObservation:
        sup.check("l", None)
        await sup.start("l", 0, spec)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.READY, what="ready")
        sup.check("l", fast)
        (ready,) = sup.observe("l")
        assert ready.pid is not None
        os.kill(ready.pid, signal.SIGSTOP)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.FAILED, what="failed")
        (obs,) = sup.observe("l")
        await sup.stop_all(grace=1.0)
        return obs

    obs = asyncio.run(hung())
    remove_run_dir(sup)
    assert obs.exit_code == -signal.SIGKILL
    assert obs.message.startswith("stopped answering its health checks (1 in a row, 1s each)")


def test_a_replica_that_misses_a_health_check_says_so_until_it_answers_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From its first missed health check (SIGSTOP) a Ready replica shows its misses in
    a row, and the Lane is told (routing takes it out); a probe that passes again
    (SIGCONT) clears them, and it is told again. It stays Ready and is not killed
    before `LIVENESS_FAILURES` misses."""
    monkeypatch.setattr(supervisor, "LIVENESS_PERIOD_S", 0.1)
    monkeypatch.setattr(supervisor, "LIVENESS_TIMEOUT_S", 0.3)
    monkeypatch.setattr(supervisor, "LIVENESS_FAILURES", 100)
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER)
    told: list[int] = []
    sup.on_change = lambda _: told.append(sup.observe("l")[0].missed_probes)

    async def run() -> tuple[ReplicaObservation, ReplicaObservation]:
        await sup.start("l", 0, spec)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.READY, what="ready")
        (ready,) = sup.observe("l")
        assert ready.pid is not None and ready.missed_probes == 0
        os.kill(ready.pid, signal.SIGSTOP)
        try:
            await until(lambda: sup.observe("l")[0].missed_probes >= 1, what="a missed probe")
            (silent,) = sup.observe("l")
        finally:
            os.kill(ready.pid, signal.SIGCONT)
            if sup.observe("l")[0].missed_probes == 0:
                await sup.stop_all(grace=1.0)  # failing: no worker left behind
        await until(lambda: sup.observe("l")[0].missed_probes == 0, what="a probe passed")
        (back,) = sup.observe("l")
        await sup.stop_all(grace=1.0)
        return silent, back

    silent, back = asyncio.run(run())
    remove_run_dir(sup)
    assert (silent.state, back.state) == (ReplicaState.READY, ReplicaState.READY)
    assert silent.pid == back.pid and back.exit_code is None
    assert told[told.index(1) :][-1] == 0 and 1 in told


def test_a_silent_replica_is_stopped_without_waiting_out_a_drain_it_cannot_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout or delete of a replica that went silent (SIGSTOP: it missed a health
    check) sends it no Drain, whose deadline (grace + 7 s) it would wait out: SIGTERM,
    the grace and the cancel allowance, then SIGKILL."""
    monkeypatch.setattr(supervisor, "LIVENESS_PERIOD_S", 0.1)
    monkeypatch.setattr(supervisor, "LIVENESS_TIMEOUT_S", 0.3)
    monkeypatch.setattr(supervisor, "LIVENESS_FAILURES", 100)
    monkeypatch.setattr(supervisor, "DRAIN_CANCEL_ALLOWANCE_S", 0.5)
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER)

    async def run() -> float:
        await sup.start("l", 0, spec)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.READY, what="ready")
        (ready,) = sup.observe("l")
        assert ready.pid is not None
        os.kill(ready.pid, signal.SIGSTOP)
        try:
            await until(lambda: sup.observe("l")[0].missed_probes >= 1, what="a missed probe")
        finally:
            started = time.monotonic()
            await sup.stop("l", 0, grace=2.0)
        return time.monotonic() - started

    took = asyncio.run(run())
    remove_run_dir(sup)
    # The grace and the allowance (2.5 s), not the Drain's deadline before them (4.5 s).
    assert 2.4 < took < 3.8, took


def test_a_replica_that_never_serves_its_health_checks_is_killed_before_the_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped right after its spawn, before its socket is up: killed after
    SOCKET_TIMEOUT_S, not at READY_TIMEOUT_S."""
    monkeypatch.setattr(supervisor, "SOCKET_TIMEOUT_S", 1.0)
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER)

    async def run() -> ReplicaObservation:
        await sup.start("l", 0, spec)
        (starting,) = sup.observe("l")
        assert starting.pid is not None
        os.kill(starting.pid, signal.SIGSTOP)
        try:
            await until(
                lambda: sup.observe("l")[0].state == ReplicaState.FAILED, what="failed", timeout=8
            )
            (obs,) = sup.observe("l")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(starting.pid, signal.SIGCONT)
            await sup.stop_all(grace=0.5)
        return obs

    obs = asyncio.run(run())
    remove_run_dir(sup)
    assert obs.exit_code == -signal.SIGKILL
    assert obs.message == "did not serve its health checks within 1s"


@pytest.mark.parametrize("hangs", [True, False])
def test_a_replica_that_goes_silent_while_starting_is_killed_before_the_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hangs: bool
) -> None:
    """A worker answers STARTING while its model loads: one that goes silent then
    (SIGSTOP, a deadlock) is killed after STARTUP_SILENCE_S, not at READY_TIMEOUT_S
    (180 s, which requests for the Lane waited out); one that keeps answering STARTING
    is left to load."""
    monkeypatch.setattr(supervisor, "STARTUP_SILENCE_S", 1.0)
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER.replace("ENGINE_STATE_READY", "ENGINE_STATE_STARTING"))

    async def run() -> ReplicaObservation:
        await sup.start("l", 0, spec)
        (starting,) = sup.observe("l")
        assert starting.pid is not None
        try:
            await until(Path(starting.socket).exists, what="the worker's socket")
            if not hangs:
                await asyncio.sleep(2.5)
            else:
                os.kill(starting.pid, signal.SIGSTOP)
                await until(
                    lambda: sup.observe("l")[0].state == ReplicaState.FAILED,
                    what="failed",
                    timeout=8.0,
                )
            (obs,) = sup.observe("l")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(starting.pid, signal.SIGCONT)
            await sup.stop_all(grace=0.5)
        return obs

    obs = asyncio.run(run())
    remove_run_dir(sup)
    if hangs:
        assert obs.exit_code == -signal.SIGKILL
        assert obs.message == "stopped answering its health checks while starting (none for 1s)"
    else:
        assert (obs.state, obs.message) == (ReplicaState.STARTING, "")


def test_a_replica_whose_decode_pass_never_ends_is_killed_though_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Health is answered off the decode thread: a decode wedged inside llama.cpp still
    answers, and only its step age gives it away."""
    monkeypatch.setattr(supervisor, "LIVENESS_PERIOD_S", 0.1)
    monkeypatch.setattr(supervisor, "LIVENESS_MAX_STEP_S", 1.0)
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER.replace("STEP_AGE_MS = 0.0", "STEP_AGE_MS = 5000.0"))

    async def run() -> ReplicaObservation:
        await sup.start("l", 0, spec)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.FAILED, what="failed")
        (obs,) = sup.observe("l")
        await sup.stop_all(grace=1.0)
        return obs

    obs = asyncio.run(run())
    remove_run_dir(sup)
    assert obs.exit_code == -signal.SIGKILL
    assert obs.message.startswith("its decode loop was stuck in one pass for 5s")


def test_a_restarted_replica_keeps_why_its_last_run_exited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first crash is restarted at once, so its Failed message would be gone by the
    next look: the replacement carries it (`exit_reason`, as `exit_code`) while it runs."""
    monkeypatch.setattr(supervisor, "LIVENESS_PERIOD_S", 0.1)
    monkeypatch.setattr(supervisor, "LIVENESS_MAX_STEP_S", 1.0)
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER.replace("STEP_AGE_MS = 0.0", "STEP_AGE_MS = 5000.0"))

    async def run() -> tuple[ReplicaObservation, ReplicaObservation]:
        await sup.start("l", 0, spec)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.FAILED, what="failed")
        (failed,) = sup.observe("l")
        await sup.start("l", 0, spec)
        (restarted,) = sup.observe("l")
        await sup.stop_all(grace=1.0)
        return failed, restarted

    failed, restarted = asyncio.run(run())
    remove_run_dir(sup)
    assert failed.exit_reason == failed.message
    assert failed.message.startswith("its decode loop was stuck in one pass for 5s")
    assert restarted.state == ReplicaState.STARTING and restarted.restarts == 1
    assert (restarted.exit_code, restarted.exit_reason) == (-signal.SIGKILL, failed.message)
    assert restarted.message == ""


def test_a_killed_replicas_log_lines_say_why_and_not_the_reconcile_that_started_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found on a daemon: `replica.exited` said only `code: -9`, the why was in the
    event alone, and it carried the reconcile_id of the pass that had spawned the
    replica minutes before."""
    monkeypatch.setattr(supervisor, "LIVENESS_PERIOD_S", 0.1)
    monkeypatch.setattr(supervisor, "LIVENESS_TIMEOUT_S", 0.3)
    sup, spec, worker = bare_supervisor(tmp_path)
    worker.write_text(SERVING_WORKER)

    async def run() -> int:
        with structlog.contextvars.bound_contextvars(reconcile_id="r-start"):
            await sup.start("l", 0, spec)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.READY, what="ready")
        pid = sup.observe("l")[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        await until(lambda: sup.observe("l")[0].state == ReplicaState.FAILED, what="failed")
        await sup.stop_all(grace=1.0)
        return pid

    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as logged:
        pid = asyncio.run(run())
    remove_run_dir(sup)
    lines = {e["event"]: e for e in logged if e["event"].startswith("replica.")}
    unresponsive, exited = lines["replica.unresponsive"], lines["replica.exited"]
    assert (exited["pid"], exited["code"]) == (pid, -signal.SIGKILL)
    assert exited["reason"].startswith("stopped answering its health checks (3 in a row")
    assert exited["reason"].endswith(" and was killed")
    assert (unresponsive["pid"], unresponsive["reason"]) == (pid, exited["reason"])
    assert "reconcile_id" not in exited and "reconcile_id" not in unresponsive
    assert lines["replica.spawned"]["reconcile_id"] == "r-start"


STUBBORN_WORKER = f"""#!{sys.executable}
import signal, time

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as an engine still saving or draining
time.sleep(60)
"""


def test_hurry_cuts_a_stop_short_rather_than_wait_out_its_grace(tmp_path: Path) -> None:
    """A second SIGTERM or Ctrl-C of `serve` hurries the stop: a worker that would keep
    its whole grace is killed at once, and one started after the hurry is not waited on."""
    sup, launch, worker = bare_supervisor(tmp_path)
    worker.write_text(STUBBORN_WORKER)

    async def run() -> tuple[list[int], float]:
        assert await sup.start("l", 0, launch) == []
        stopping = asyncio.create_task(sup.stop_all(grace=30.0))
        await asyncio.sleep(0.3)
        begun = time.monotonic()
        sup.hurry()
        await asyncio.wait_for(stopping, 5.0)
        pids = [obs.pid for obs in sup.observe("l") if obs.pid is not None]
        assert await sup.start("l", 1, launch) == []
        (obs,) = sup.observe("l")
        assert obs.pid is not None
        await asyncio.wait_for(sup.stop_all(grace=30.0), 5.0)
        return [*pids, obs.pid], time.monotonic() - begun

    pids, took = asyncio.run(run())
    assert took < 5.0
    assert sup.observe("l") == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    remove_run_dir(sup)
