"""Run a real `blazar serve` in a subprocess and drive it with the real CLI."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from blazar._proto.v1 import control_pb2
from blazar.api import kinds
from blazar.cli.client import ControlClient

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
# Packaged models are assembled once into this cache for every test daemon, not into
# the user's own (~/.cache/blazar/models).
MODEL_CACHE = REPO / ".cache" / "blazar-models"
# Where the tests' GGUF files are (the bundled model assembled by `model_path`, drafts
# made beside it): a model root of every test daemon, with the daemon's own home.
TEST_MODELS = Path(os.environ.get("BLAZAR_TEST_CACHE", REPO / ".cache" / "models"))
# The Lane of the daemon the tool-calling and Responses modules share (`tools_daemon`).
TOOLS_LANE = "tools"
TOOLS_CONTEXT_PER_SLOT = 4096
# Its slots: the tests that repeat a call many times (20 of 20 valid) send that many at once.
TOOLS_SLOTS = 4


def concurrently(attempt: Callable[[int], T], count: int, *, at_once: int) -> list[T]:
    """`attempt(i)` for every i below `count`, `at_once` of them at a time on threads
    (each an independent request: the engine batches them); the results in order of i,
    and the first failure raised as it was."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=at_once) as pool:
        return list(pool.map(attempt, range(count)))


def wait_for(
    predicate: Callable[[], T | None], *, timeout: float, what: str, step: float = 0.1
) -> T:
    """Poll predicate until it returns something truthy; fail with `what` on timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); treat it as dead.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False  # reaped between the two reads (ESRCH from /proc on some kernels)
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def short_home() -> Path:
    """A BLAZAR_HOME short enough for AF_UNIX socket paths."""
    return Path(tempfile.mkdtemp(prefix="bz-", dir="/tmp"))


@dataclass
class Daemon:
    home: Path
    watch: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    grpc: str = ""
    http: str = ""
    # The Control socket (`unix:PATH`), the CLI's way in without a key.
    control: str = ""
    # More `serve` flags (--auth-file, --allow-origin, ...).
    serve_args: list[str] = field(default_factory=list)
    # Added to the daemon's environment (BLAZAR_MODEL_CACHE defaults to MODEL_CACHE).
    environ: dict[str, str] = field(default_factory=dict)
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.home / "daemon.log"

    def start(self, *, timeout: float = 60.0) -> Daemon:
        info = self.home / "daemon.json"
        with contextlib.suppress(FileNotFoundError):
            info.unlink()
        argv = [
            sys.executable, "-m", "blazar.cli", "serve",
            "--home", str(self.home), "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
        ]  # fmt: skip
        if self.watch is not None:
            argv += ["--watch", str(self.watch)]
        argv += self.serve_args
        log = self.log_path.open("ab")
        roots = os.pathsep.join([str(TEST_MODELS), str(self.home)])
        env = {
            "BLAZAR_MODEL_CACHE": str(MODEL_CACHE),
            "BLAZAR_MODEL_ROOTS": roots,
            **os.environ,
            **self.environ,
        }
        self.process = subprocess.Popen(argv, stdout=log, stderr=log, cwd=REPO, env=env)
        log.close()

        def ready() -> dict[str, Any] | None:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"daemon exited early:\n{self.log()}")
            if not info.exists():
                return None
            data: dict[str, Any] = json.loads(info.read_text())
            return data

        data = wait_for(ready, timeout=timeout, what="daemon.json")
        self.grpc, self.http, self.control = data["grpc"], data["http"], data["control"]
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def events(self, name: str, *, since: int = 0) -> list[dict[str, Any]]:
        """The JSON log records of event `name` from byte `since` of the home's daemon
        log on (every start on this home appends to it)."""
        with self.log_path.open("rb") as f:
            f.seek(since)
            lines = [line for line in f.read().splitlines() if line[:1] == b"{"]
        return [r for r in map(json.loads, lines) if r.get("event") == name]

    def replica_story(self, lane: str, *, since: int = 0) -> str:
        """What happened to a Lane's engines, for a failing assertion's message: the
        daemon's `replica.*` records for it from byte `since` of its log, and the end
        of each engine's own log (why an engine exited is in one or the other)."""
        with self.log_path.open("rb") as f:
            f.seek(since)
            lines = [line for line in f.read().splitlines() if line[:1] == b"{"]
        records = [
            r
            for r in map(json.loads, lines)
            if str(r.get("event", "")).startswith("replica.") and r.get("lane") == lane
        ]
        story = [json.dumps(r, sort_keys=True) for r in records]
        for path in sorted((self.home / "logs").glob(f"{lane}-*.log")):
            tail = path.read_text(errors="replace").splitlines()[-25:]
            story += [f"--- {path.name} (last {len(tail)} lines)", *tail]
        return "\n".join(story)

    def cli(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "blazar.cli", "--server", self.control, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )

    def get(self, kind: str, name: str) -> dict[str, Any]:
        """The object as `blazar get KIND NAME -o json` prints it, read over the same
        Control socket in this process: the polls of `wait_condition` and `pids` run
        every 0.2 s, and a CLI process costs about 0.3 s of CPU to start (its imports),
        taken from the engines the tests wait for. The CLI's own output is tested by
        the tests that run it (`cli`)."""
        with ControlClient(self.control) as control:
            got = control.get(
                control_pb2.GetRequest(kind=kinds.resolve_kind(kind).value, name=name)
            )
        result: dict[str, Any] = json.loads(got.object_json)
        return result

    def condition(self, kind: str, name: str, type_: str) -> dict[str, Any] | None:
        for cond in self.get(kind, name).get("status", {}).get("conditions", []):
            if cond["type"] == type_:
                return dict(cond)
        return None

    def wait_condition(
        self, kind: str, name: str, type_: str, status: str = "True", *, timeout: float = 120.0
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            cond = self.condition(kind, name, type_)
            return cond if cond and cond["status"] == status else None

        return wait_for(check, timeout=timeout, what=f"{kind}/{name} {type_}={status}", step=0.2)

    def pids(self, lane: str) -> list[int]:
        replicas = self.get("lane", lane).get("status", {}).get("replicaStatuses", [])
        return [int(r["pid"]) for r in replicas if r.get("pid")]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def local_fleet(home: Path, model_path: Path, *, lane: str, spec: str) -> Path:
    """A fleet directory for `--watch` under home: Model "local" on model_path and one
    Lane named `lane` whose spec (flow YAML, without braces) is `spec`."""
    fleet = home / "fleet"
    fleet.mkdir()
    (fleet / "fleet.yaml").write_text(
        "apiVersion: blazar.dev/v1alpha1\n"
        "kind: Model\n"
        "metadata: {name: local}\n"
        f"spec: {{source: {{path: {json.dumps(str(model_path))}}}}}\n"
        "---\n"
        "apiVersion: blazar.dev/v1alpha1\n"
        "kind: Lane\n"
        f"metadata: {{name: {lane}}}\n"
        f"spec: {{model: local, {spec}}}\n"
    )
    return fleet


@contextlib.contextmanager
def running(home: Path, watch: Path | None = None) -> Iterator[Daemon]:
    daemon = Daemon(home=home, watch=watch).start()
    try:
        yield daemon
    finally:
        daemon.stop()


@contextlib.contextmanager
def default_fleet(
    *, lane: str = "gemma3", timeout: float = 240, serve_args: list[str] | None = None
) -> Iterator[Daemon]:
    """A daemon serving the default fleet (manifests/), watched, on free ports, with its
    own home, once its Lane is Ready; stopped and removed afterwards."""
    home = short_home()
    fleet = home / "fleet"
    shutil.copytree(REPO / "manifests", fleet)
    daemon = Daemon(home=home, watch=fleet, serve_args=list(serve_args or ())).start()
    try:
        daemon.wait_condition("lane", lane, "Ready", timeout=timeout)
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(home, ignore_errors=True)
