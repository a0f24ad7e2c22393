"""Owns the engine worker processes of this daemon: spawn, watch, stop.

One asyncio task per replica follows it through its lifecycle:

    Starting --health READY--> Ready --process exits, or stops answering--> Failed
        \\--exits or not ready in time--> Failed

and calls `on_change(lane)` on every transition so the Lane is reconciled. `stop()`
(which the Lane's reconcile calls and awaits, so it calls no `on_change`; a plan that
stops a replica asks for its own next pass) is the teardown: Drain RPC (finish
in-flight work up to the grace period; not to a replica that missed its last health
check, which would not answer it), SIGTERM, wait, then SIGKILL of the whole process
group. Workers also die on their own when the
daemon dies (parent-death signal), so a `kill -9` of the daemon leaves no orphans.

A Ready replica's Health is polled as a liveness probe, as its Lane's `health` says
(`kinds.Health`, read at each check): one that misses `failureThreshold` checks in a
row (stopped, deadlocked, wedged inside llama.cpp) is killed and fails like a crash,
so the Lane restarts it instead of routing requests to it forever. From its first
miss until a check passes it shows its misses in a row (`missed_probes`), which takes
it out of routing, as a failed readiness probe takes a Pod out of its Service. A
replica being stopped is not probed.

Each worker is started as `python -m blazar.engine --launch FILE`, where FILE is its
launch document (`replicas.EngineLaunch`, JSON) written into the run directory: the
Lane's `LaunchSpec` and where the process lives. The supervisor talks to it through
one `client.EngineClient` per replica (readiness, liveness, drain).

A replica whose process cannot be started at all (the OS refuses the spawn) goes to
Failed at once, as if it had crashed. A KV cache directory that cannot be created
only costs that optimisation: the replica starts cold and `start()` returns a
warning. `discard_kv()` removes a deleted Lane's caches, never those of a replica
still held here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import structlog

from blazar._proto.engine.v1 import engine_pb2
from blazar.api import kinds
from blazar.api.replicas import EngineLaunch, LaunchSpec, ReplicaObservation, ReplicaState
from blazar.enginehost import cores, forensics, logfiles, rundir
from blazar.enginehost.client import EngineClient

log = structlog.get_logger(__name__)

# A Lane's `health` (`kinds.Health`) says how its replicas are checked; these are its
# defaults, in the seconds the checks wait, for a Lane the supervisor has been told
# nothing of (`check`). Each run reads its Lane's at each check (`_checks`).
_DEFAULT_HEALTH = kinds.Health()
READY_TIMEOUT_S = float(_DEFAULT_HEALTH.startup_seconds)
HEALTH_POLL_S = 0.1
STOP_GRACE_S = 10.0
# The liveness probe of a Ready replica, as a kubelet's: 3 misses in a row (its default)
# fail it. Every 5 s rather than 10, to catch a hang sooner, and a 5 s timeout rather
# than 1, since the Health RPC shares two busy cores with the decode loop. A hung
# worker misses its first check 5-10 s after it stops (and takes no new requests from
# then on: `_until_unresponsive`) and is killed 25-30 s after it stops. (The
# HealthMonitor also calls Health every 5 s, for the gauges; the two are kept apart so
# that metrics never decide a replica's life.)
LIVENESS_PERIOD_S = float(_DEFAULT_HEALTH.period_seconds)
LIVENESS_TIMEOUT_S = float(_DEFAULT_HEALTH.timeout_seconds)
LIVENESS_FAILURES = _DEFAULT_HEALTH.failure_threshold
# A starting worker answers Health (STARTING) from its first second, while its model
# loads on another thread: one silent this long (the liveness probe's misses) is
# stopped or deadlocked, and is killed then rather than at its startup timeout.
STARTUP_SILENCE_S = LIVENESS_TIMEOUT_S * LIVENESS_FAILURES
# Its socket comes up about 1 s after its spawn (imports); one that has none this long
# after (stopped or stuck before it serves) is killed then too. Twice the silence, as a
# cold start imports from a cold page cache.
SOCKET_TIMEOUT_S = 2 * STARTUP_SILENCE_S
# Health is answered off the decode thread, so a decode wedged inside llama.cpp still
# answers; its `step_age_ms` gives it away. No pass of the loop takes this long on any
# model Blazar runs on a CPU (a 512-token prompt chunk of an 8B model on two cores takes
# under a minute), so one past it counts as a missed probe.
LIVENESS_MAX_STEP_S = 300.0
# What a Drain RPC may take past its grace: the engine then cancels what is left and
# waits up to `service.CANCEL_WAIT_SECONDS` (5 s) for it to end (not imported here: the
# service module loads llama.cpp, which the daemon does not need).
DRAIN_CANCEL_ALLOWANCE_S = 7.0


@dataclass(frozen=True)
class StartWarning:
    """Something that went wrong starting a replica without keeping it from running."""

    reason: str
    message: str


@dataclass(frozen=True)
class _Checks:
    """How one replica is checked, in seconds: its Lane's `Health`, or the defaults."""

    startup_s: float
    period_s: float
    timeout_s: float
    failures: int
    # Silent this long while starting: stopped or deadlocked. No socket this long
    # after its spawn: stuck before it serves.
    startup_silence_s: float
    socket_timeout_s: float

    @classmethod
    def of(cls, health: kinds.Health | None) -> _Checks:
        if health is None:
            return cls(
                READY_TIMEOUT_S,
                LIVENESS_PERIOD_S,
                LIVENESS_TIMEOUT_S,
                LIVENESS_FAILURES,
                STARTUP_SILENCE_S,
                SOCKET_TIMEOUT_S,
            )
        silence = float(health.timeout_seconds * health.failure_threshold)
        return cls(
            float(health.startup_seconds),
            float(health.period_seconds),
            float(health.timeout_seconds),
            health.failure_threshold,
            silence,
            2 * silence,
        )


@dataclass
class _Replica:
    lane: str
    index: int
    launch: LaunchSpec
    socket: Path
    state: ReplicaState = ReplicaState.STARTING
    process: asyncio.subprocess.Process | None = None
    # The worker's Engine service, from its spawn until it is stopped or fails.
    client: EngineClient | None = None
    task: asyncio.Task[None] | None = None
    restarts: int = 0
    started_at: datetime | None = None
    exited_at: datetime | None = None
    exit_code: int | None = None
    # Why the last run exited (its Failed message), kept as `exit_code` is.
    exit_reason: str = ""
    message: str = ""
    stopping: bool = False
    # Where this run's output starts in the replica's log (the file is appended to).
    log_offset: int = 0
    # Liveness probes missed in a row by this run (`ReplicaObservation.missed_probes`).
    missed_probes: int = 0

    def observation(self) -> ReplicaObservation:
        return ReplicaObservation(
            lane=self.lane,
            index=self.index,
            state=self.state,
            revision=self.launch.revision,
            socket=str(self.socket),
            pid=self.process.pid if self.process else None,
            restarts=self.restarts,
            started_at=self.started_at,
            exited_at=self.exited_at,
            exit_code=self.exit_code,
            exit_reason=self.exit_reason,
            message=self.message,
            slots=self.launch.slots,
            context_per_slot=self.launch.context_per_slot,
            missed_probes=self.missed_probes,
        )


@dataclass
class Supervisor:
    home: Path
    on_change: Callable[[str], None]
    python: str = sys.executable
    log_json: bool = True
    _replicas: dict[tuple[str, int], _Replica] = field(default_factory=dict)
    # Each Lane's health checks as last told (`check`); the defaults for the others.
    _health: dict[str, kinds.Health] = field(default_factory=dict)
    # Set by `hurry`: stops no longer drain or wait out a grace.
    _hurried: bool = False

    def __post_init__(self) -> None:
        # Private directories, checked (`rundir`): a long home's sockets and the
        # CPU-share table live outside the home, in the user's runtime directory.
        runtime = rundir.runtime_root()
        self.run_dir = rundir.socket_dir(self.home, root=runtime)
        self.cpu_share = rundir.cpu_share_path(runtime)
        self.log_dir = self.home / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def _directories(self) -> None:
        """Make again the home's directories a worker needs, should they have gone
        while the daemon ran (the home removed under it): each spawn would otherwise
        fail on a missing directory until the daemon restarts. Made 0700 and checked
        as at the start; OSError when one cannot be made or used."""
        for directory in (self.home, self.log_dir, self.run_dir):
            if directory.is_dir():
                continue
            with contextlib.suppress(FileExistsError):
                directory.mkdir(mode=0o700, parents=True)
            log.warning("replica.directory_recreated", directory=str(directory))
        why = rundir.problem(os.lstat(self.run_dir), uid=os.getuid())
        if why is not None:
            raise OSError(f"cannot use {self.run_dir} for engine sockets: {why}")

    # -- Processes protocol -------------------------------------------------------

    def check(self, lane: str, health: kinds.Health | None) -> bool:
        before = self._health.pop(lane, None)
        if health is not None:
            self._health[lane] = health
        return before is not None and health is not None and before != health

    def _checks(self, lane: str) -> _Checks:
        return _Checks.of(self._health.get(lane))

    def observe(self, lane: str) -> list[ReplicaObservation]:
        return [r.observation() for (name, _), r in sorted(self._replicas.items()) if name == lane]

    def lanes(self) -> set[str]:
        return {lane for lane, _ in self._replicas}

    async def start(self, lane: str, index: int, launch: LaunchSpec) -> list[StartWarning]:
        key = (lane, index)
        old = self._replicas.get(key)
        if old is not None and old.state != ReplicaState.FAILED:
            return []  # already running: starting is idempotent
        replica = _Replica(
            lane=lane,
            index=index,
            launch=launch,
            socket=self.run_dir / f"{lane}-{index}.sock",
            restarts=(old.restarts + 1) if old else 0,
            # The last run's exit stays on show while its replacement runs (as a Pod's
            # lastState): `describe` answers "why did it restart?".
            exit_code=old.exit_code if old else None,
            exit_reason=old.exit_reason if old else "",
        )
        self._replicas[key] = replica
        warnings: list[StartWarning] = []
        try:
            await self._spawn(replica, warnings)
        except OSError as exc:
            # Nothing runs, so nothing would ever move the replica on from Starting.
            replica.exited_at, replica.exit_code = datetime.now(UTC), None
            self._set(replica, ReplicaState.FAILED, f"cannot start the engine process: {exc}")
            log.warning("replica.spawn_failed", lane=lane, index=index, error=str(exc))
            return warnings
        # A context of its own: the reconcile that started it is long over when its
        # exit is logged, and its reconcile_id on that line would name the wrong pass.
        replica.task = asyncio.create_task(
            self._follow(replica), name=f"replica {lane}/{index}", context=contextvars.Context()
        )
        return warnings

    async def stop(self, lane: str, index: int, *, grace: float = STOP_GRACE_S) -> None:
        replica = self._replicas.get((lane, index))
        if replica is None:
            return
        replica.stopping = True
        proc = replica.process
        if proc is not None and proc.returncode is None:
            if not self._hurried:
                replica.state = ReplicaState.DRAINING
                # A silent replica (it missed its last health check) would not answer a
                # Drain either: waiting out the call's deadline would only delay the
                # rollout or delete. Should it answer again, SIGTERM has it drain itself,
                # which takes up to its grace and the cancel after it.
                silent = replica.missed_probes > 0
                if not silent:
                    await self._drain(replica, grace)
                replica.state = ReplicaState.STOPPING
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(
                        proc.wait(), timeout=grace + (DRAIN_CANCEL_ALLOWANCE_S if silent else 0.0)
                    )
                except TimeoutError:
                    log.warning("replica.kill", lane=lane, index=index, pid=proc.pid)
            self._kill_group(proc)
            await proc.wait()
        if replica.task is not None:
            replica.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replica.task
        self._replicas.pop((lane, index), None)
        await self._close_client(replica)
        for path in (replica.socket, self._launch_path(replica)):
            # Gone, or a home turned read-only: a leftover is replaced at the next start.
            with contextlib.suppress(OSError):
                path.unlink()

    def hurry(self) -> None:
        """Stop now rather than gracefully (a second SIGTERM or Ctrl-C of `serve`):
        SIGKILL the group of every replica, which ends a stop waiting on its drain or
        grace at once, and make every later stop skip both. Streams still running end
        with the engine's stop error; caches are not saved."""
        self._hurried = True
        for replica in self._replicas.values():
            # Being stopped, not failed: nothing restarts it before `stop_all` comes.
            replica.stopping = True
            if replica.process is not None and replica.process.returncode is None:
                self._kill_group(replica.process)

    def kv_lanes(self) -> list[str]:
        try:
            return sorted(p.name for p in self._kv_root().iterdir() if p.is_dir())
        except FileNotFoundError:
            return []

    async def discard_kv(self, lane: str) -> list[int]:
        lane_dir = self._kv_lane_dir(lane)
        try:
            found = [int(p.name) for p in lane_dir.iterdir() if p.name.isdecimal()]
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("replica.kv_discard_failed", lane=lane, error=str(exc))
            return []
        # A replica held here may run, and a failed one restarts from its caches; both
        # save into the directory on a graceful stop, so theirs is never removed.
        gone = sorted(i for i in found if (lane, i) not in self._replicas)
        removed = []
        for index in gone:
            try:
                await asyncio.to_thread(shutil.rmtree, lane_dir / str(index))
            except OSError as exc:  # left for the next pass
                log.warning("replica.kv_discard_failed", lane=lane, index=index, error=str(exc))
            else:
                removed.append(index)
        if lane not in self.lanes():
            with contextlib.suppress(OSError):
                lane_dir.rmdir()  # only if nothing else is left in it
        return removed

    async def stop_all(self, *, grace: float = STOP_GRACE_S) -> None:
        await asyncio.gather(
            *(self.stop(lane, index, grace=grace) for lane, index in list(self._replicas))
        )

    # -- internals ------------------------------------------------------------------

    def _launch(self, replica: _Replica, *, kv_dir: Path | None) -> EngineLaunch:
        return EngineLaunch(
            spec=replica.launch,
            socket=str(replica.socket),
            drain_grace_seconds=STOP_GRACE_S,
            kv_dir=str(kv_dir) if kv_dir is not None else None,
            parent_pid=os.getpid(),
            log_json=self.log_json,
            cpu_share=str(self.cpu_share),
            host_cpus=cores.count(),
        )

    def _kv_dir(self, replica: _Replica, warnings: list[StartWarning]) -> Path | None:
        """The replica's KV cache directory, created; None (and a warning) when it cannot be."""
        if not replica.launch.kv_persist:
            return None
        kv_dir = self._kv_lane_dir(replica.lane) / str(replica.index)
        try:
            kv_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning(
                "replica.kv_persist_off",
                lane=replica.lane,
                index=replica.index,
                directory=str(kv_dir),
                error=str(exc),
            )
            warnings.append(
                StartWarning(
                    "KVPersistenceDisabled",
                    f"Replica {replica.index} starts without KV cache persistence: "
                    f"cannot create {kv_dir}: {exc}.",
                )
            )
            return None
        return kv_dir

    def _kv_root(self) -> Path:
        return self.home / "kv"

    def _kv_lane_dir(self, lane: str) -> Path:
        return self._kv_root() / lane

    def _log_path(self, replica: _Replica) -> Path:
        """The replica's log: every run of it appends to the same file (`logfiles`)."""
        return logfiles.path(self.log_dir, replica.lane, replica.index)

    def rotate_logs(self) -> None:
        """Rotate every replica's log that has grown past its cap (`logfiles`)."""
        for replica in list(self._replicas.values()):
            try:
                if logfiles.rotate_if_full(self._log_path(replica)):
                    replica.log_offset = 0  # this run's earlier output is in `.1`
            except OSError as exc:
                log.warning(
                    "replica.log_rotate_failed",
                    lane=replica.lane,
                    index=replica.index,
                    error=str(exc),
                )

    def _launch_path(self, replica: _Replica) -> Path:
        return self.run_dir / f"{replica.lane}-{replica.index}.launch.json"

    def _write_launch(self, replica: _Replica, launch: EngineLaunch) -> Path:
        """Write the launch document where only this user can read it (it names the
        model and may hold a chat template), replacing any earlier run's."""
        path = self._launch_path(replica)
        tmp = path.with_name(path.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(launch.to_json())
        tmp.replace(path)
        return path

    async def _spawn(self, replica: _Replica, warnings: list[StartWarning]) -> None:
        """Start the worker process; OSError when the OS refuses to."""
        self._directories()
        with contextlib.suppress(FileNotFoundError):
            replica.socket.unlink()
        launch = self._write_launch(
            replica, self._launch(replica, kv_dir=self._kv_dir(replica, warnings))
        )
        argv = [self.python, "-m", "blazar.engine", "--launch", str(launch)]
        with contextlib.suppress(OSError):  # a crash loop must not grow the file past its cap
            logfiles.rotate_if_full(self._log_path(replica))
        with self._log_path(replica).open("ab") as log_file:
            replica.log_offset = log_file.tell()
            replica.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,  # own process group, so stop() can kill it whole
            )
        replica.started_at = datetime.now(UTC)
        replica.client = EngineClient(str(replica.socket))
        log.info("replica.spawned", lane=replica.lane, index=replica.index, pid=replica.process.pid)

    def _set(self, replica: _Replica, state: ReplicaState, message: str = "") -> None:
        replica.state = state
        replica.message = message
        self.on_change(replica.lane)

    async def _follow(self, replica: _Replica) -> None:
        proc = replica.process
        assert proc is not None
        exited = asyncio.create_task(proc.wait())
        ready = asyncio.create_task(self._wait_ready(replica))
        done, _ = await asyncio.wait({exited, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready in done and ready.result() is None:
            self._set(replica, ReplicaState.READY)
            alive = asyncio.create_task(self._until_unresponsive(replica))
            watched: set[asyncio.Task[Any]] = {exited, alive}
            try:
                ended, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            finally:
                alive.cancel()  # a stop cancels this task: the probe goes with it
            if alive in ended and (why := alive.result()) is not None:
                self._kill_group(proc)
                replica.message = f"{why} and was killed"
                log.warning(
                    "replica.unresponsive",
                    lane=replica.lane,
                    index=replica.index,
                    pid=proc.pid,
                    reason=replica.message,
                )
        elif exited not in done:
            self._kill_group(proc)
            replica.message = ready.result() or "not ready in time"
        else:
            ready.cancel()
        code = await exited
        if replica.stopping:
            return
        await self._close_client(replica)
        self._kill_group(proc)  # stragglers of the group, if any
        replica.exit_code = code
        replica.exited_at = datetime.now(UTC)
        replica.exit_reason = replica.message or forensics.exit_reason(
            self._log_tail(replica), code
        )
        self._set(replica, ReplicaState.FAILED, replica.exit_reason)
        log.warning(
            "replica.exited",
            lane=replica.lane,
            index=replica.index,
            pid=proc.pid,
            code=code,
            reason=replica.exit_reason,
        )

    async def _wait_ready(self, replica: _Replica) -> str | None:
        """None once the worker reports READY; else why it is not: not READY within
        its Lane's `startupSeconds` (`_Checks`); no socket within its socket timeout of
        its spawn; or, once its socket is up (its Health answers STARTING at once, off
        the thread that loads the model), no answer at all for its startup silence
        (stopped or deadlocked while starting: the liveness probe's misses, not the
        whole start timeout)."""
        client = replica.client
        assert client is not None
        loop = asyncio.get_running_loop()
        spawned = loop.time()
        answered: float | None = None  # when it last answered (or its socket came up)
        while loop.time() - spawned < (checks := self._checks(replica.lane)).startup_s:
            if answered is None and loop.time() - spawned >= checks.socket_timeout_s:
                return f"did not serve its health checks within {checks.socket_timeout_s:.0f}s"
            if replica.socket.exists():
                answered = answered or loop.time()
                try:
                    health = await client.health(timeout=2.0)
                except grpc.aio.AioRpcError:
                    if loop.time() - answered >= checks.startup_silence_s:
                        return (
                            f"stopped answering its health checks while starting "
                            f"(none for {checks.startup_silence_s:.0f}s)"
                        )
                else:
                    answered = loop.time()
                    if health.state == engine_pb2.ENGINE_STATE_READY:
                        return None
            await asyncio.sleep(HEALTH_POLL_S)
        return f"not ready within {checks.startup_s:.0f}s (the Lane's health.startupSeconds)"

    async def _until_unresponsive(self, replica: _Replica) -> str | None:
        """Probe a Ready replica's Health, as its Lane's `health` says (read at each check),
        until it misses its failure threshold in a row
        (what it did, for its message) or is being stopped (None, whatever it answers
        then). A miss: no answer in time, or a decode pass older than
        `LIVENESS_MAX_STEP_S`. Each change of the count of misses in a row is told
        (`on_change`): from the first miss until a probe passes, the replica takes no
        new requests, and those it holds without a first token go back to the queue."""
        client = replica.client
        assert client is not None
        while not replica.stopping:
            await asyncio.sleep(self._checks(replica.lane).period_s)
            checks = self._checks(replica.lane)
            try:
                health = await client.health(timeout=checks.timeout_s)
            except grpc.aio.AioRpcError:
                why = (
                    f"stopped answering its health checks ({checks.failures} in a row, "
                    f"{checks.timeout_s:g}s each)"
                )
            else:
                if health.step_age_ms <= LIVENESS_MAX_STEP_S * 1000.0:
                    self._missed(replica, 0)
                    continue
                why = (
                    f"its decode loop was stuck in one pass for {health.step_age_ms / 1000:.0f}s "
                    f"(over {LIVENESS_MAX_STEP_S:.0f}s, {checks.failures} checks in a row)"
                )
            missed = replica.missed_probes + 1
            if missed >= checks.failures and not replica.stopping:
                return why
            if not replica.stopping:
                self._missed(replica, missed)
        return None

    def _missed(self, replica: _Replica, count: int) -> None:
        """Set the replica's probes missed in a row, telling a change."""
        if replica.missed_probes == count:
            return
        replica.missed_probes = count
        pid = replica.process.pid if replica.process else None
        if count:
            log.warning(
                "replica.probe_missed",
                lane=replica.lane,
                index=replica.index,
                pid=pid,
                missed=count,
            )
        else:
            log.info("replica.probe_passed", lane=replica.lane, index=replica.index, pid=pid)
        self.on_change(replica.lane)

    async def _drain(self, replica: _Replica, grace: float) -> None:
        client = replica.client
        if replica.state == ReplicaState.STARTING or client is None or not replica.socket.exists():
            return
        try:
            # After the grace the engine cancels what is left, which takes a step.
            await client.drain(grace=grace, timeout=grace + DRAIN_CANCEL_ALLOWANCE_S)
        except grpc.aio.AioRpcError as err:
            log.info(
                "replica.drain_failed",
                lane=replica.lane,
                index=replica.index,
                error=err.code().name,
            )

    @staticmethod
    async def _close_client(replica: _Replica) -> None:
        client, replica.client = replica.client, None
        if client is not None:
            await client.close()

    @staticmethod
    def _kill_group(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _log_tail(self, replica: _Replica) -> str:
        """The end of what this run of the replica logged (earlier runs excluded)."""
        try:
            with self._log_path(replica).open("rb") as f:
                end = f.seek(0, os.SEEK_END)
                f.seek(max(replica.log_offset, end - forensics.LOG_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError:
            return ""
