"""Time from `blazar serve` starting on a fresh BLAZAR_HOME to its first chat answer.

    .venv/bin/python bench/first_answer.py                 # 5 runs, the machine's model cache
    .venv/bin/python bench/first_answer.py --cold-cache    # each run with an empty model cache
    .venv/bin/python bench/first_answer.py --runs 10 --json out.json
    .venv/bin/python bench/first_answer.py --checkout /tmp/old   # a worktree of another commit

Each run starts `blazar serve --watch manifests` (the default fleet, as `make up`) on
a new temporary home and free ports, and from the moment it spawns the process sends
a streamed `POST /v1/chat/completions` with `max_tokens: 1` every 50 ms (a refused
connection or a 503 is tried again) until one answers with a token. Then it stops the
daemon and reads the daemon's and the engine's JSON logs for where the time went:

    daemon up        process start -> the fleet applied (Python, imports, store)
    model            the Model's inspection: link or assemble, sha256, GGUF header
    spawn            -> the engine process spawned (Lane reconcile)
    engine imports   -> the engine logs `starting` (Python, llama_cpp, gRPC server up)
    engine load      -> the engine logs `ready` (model load, context, warm-up, template)
    to answer        -> the first token back through the shim (Health poll, routing,
                        the request's own prefill and one decode step)

The target (issue 16) is the first answer within 5 s. The exit status is 0 when every
run answered, 1 otherwise; every daemon the script starts is stopped before it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 5.0
POLL_S = 0.05
TIMEOUT_S = 120.0
STAGES = ["daemon up", "model", "spawn", "engine imports", "engine load", "to answer"]
BODY = json.dumps(
    {
        "model": "gemma3",
        "stream": True,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "Hello"}],
    }
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answered(port: int) -> bool:
    """One streamed chat request; True when it came back with a token."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/chat/completions", BODY, {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
    except (ConnectionError, http.client.HTTPException, TimeoutError, OSError):
        return False
    return response.status == 200 and b'"content"' in data


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time a live process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(log_path: Path) -> int | None:
    spawned = first(records(log_path), "replica.spawned")
    return int(spawned["pid"]) if spawned and "pid" in spawned else None


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                stamp = record.get("timestamp")
                if stamp:
                    record["t"] = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
                    found.append(record)
    return found


def first(found: list[dict[str, Any]], event: str) -> dict[str, Any] | None:
    return next((r for r in found if r.get("event") == event), None)


def run_once(root: Path, *, cache: Path, checkout: Path) -> dict[str, Any]:
    home = root / "home"
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ, BLAZAR_MODEL_CACHE=str(cache))
    if checkout != REPO:
        env["PYTHONPATH"] = str(checkout)  # ahead of this checkout's editable install
    argv = [
        sys.executable, "-m", "blazar.cli", "serve", "--home", str(home),
        "--watch", str(checkout / "manifests"),
        "--http", f"127.0.0.1:{http_port}", "--grpc", f"127.0.0.1:{grpc_port}",
    ]  # fmt: skip
    log_path = root / "daemon.log"
    with log_path.open("wb") as log:
        started = time.time()
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=checkout)
    answer = None
    cpu: dict[str, float | None] = {}
    try:
        while time.time() - started < TIMEOUT_S and proc.poll() is None:
            if answered(http_port):
                answer = time.time() - started
                pid = engine_pid(log_path)
                cpu = {
                    "daemon": cpu_seconds(proc.pid),
                    "engine": cpu_seconds(pid) if pid else None,
                }
                break
            time.sleep(POLL_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    daemon = records(log_path)
    engine = records(home / "logs" / "gemma3-0.log")
    marks = {
        "daemon up": first(daemon, "gitops.applied"),
        "model": first(daemon, "model.inspected"),
        "spawn": first(daemon, "replica.spawned"),
        "engine imports": first(engine, "starting"),
        "engine load": first(engine, "ready"),
    }
    # A stage whose mark is missing (a commit before the mark was logged) is counted
    # in the next one.
    stages: dict[str, float | None] = {}
    previous = started
    for name in STAGES[:-1]:
        mark = marks[name]
        stages[name] = mark["t"] - previous if mark else None
        previous = mark["t"] if mark else previous
    stages["to answer"] = answer - (previous - started) if answer else None
    inspected = marks["model"] or {}
    return {
        "answer_s": answer,
        "stages_s": stages,
        "model_inspect_s": inspected.get("seconds"),
        "files_hashed": inspected.get("files_hashed"),
        "files_assembled": inspected.get("files_assembled"),
        "shim_serving_s": (d["t"] - started) if (d := first(daemon, "daemon.serving")) else None,
        # CPU seconds used by the first answer (this script's requests included): on an
        # idle machine the wall time would come close to the longer path through them.
        "cpu_s": cpu,
    }


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--cold-cache",
        action="store_true",
        help="each run with an empty model cache (the first start on a machine)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    p.add_argument(
        "--checkout",
        type=Path,
        default=REPO,
        help="run the Blazar of another checkout (a git worktree of an older commit, say) "
        "with this one's .venv",
    )
    args = p.parse_args()

    machine_cache = Path(
        os.environ.get("BLAZAR_MODEL_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blazar" / "models"
    )
    checkout = args.checkout.resolve()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=checkout
    ).stdout.strip()
    print(f"commit {commit}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"model cache: {'empty, per run' if args.cold_cache else machine_cache}")
    results = []
    for i in range(args.runs):
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="bz-fa-", dir="/tmp") as tmp:
            root = Path(tmp)
            cache = root / "cache" if args.cold_cache else machine_cache
            result = run_once(root, cache=cache, checkout=checkout)
            shutil.rmtree(root / "home", ignore_errors=True)
        result["load_before"] = load
        results.append(result)
        stages = result["stages_s"]
        print(
            f"run {i + 1}: first answer {fmt(result['answer_s'])} s (load {load:.1f}; "
            + ", ".join(f"{name} {fmt(stages[name])}" for name in STAGES)
            + f"; hashed {result['files_hashed']}, assembled {result['files_assembled']}"
            + f"; CPU s daemon {fmt(result['cpu_s'].get('daemon'))}"
            + f", engine {fmt(result['cpu_s'].get('engine'))})",
            flush=True,
        )
    answers = [r["answer_s"] for r in results if r["answer_s"] is not None]
    print()
    print("| stage | median s | min | max |")
    print("|---|---|---|---|")
    for name in STAGES:
        values = [r["stages_s"][name] for r in results if r["stages_s"][name] is not None]
        if values:
            low, mid, high = min(values), statistics.median(values), max(values)
            print(f"| {name} | {mid:.2f} | {low:.2f} | {high:.2f} |")
    for who in ("daemon", "engine"):
        values = [r["cpu_s"][who] for r in results if r["cpu_s"].get(who) is not None]
        if values:
            low, mid, high = min(values), statistics.median(values), max(values)
            print(f"| CPU s, {who} process | {mid:.2f} | {low:.2f} | {high:.2f} |")
    if answers:
        median = statistics.median(answers)
        print(f"| **first answer** | **{median:.2f}** | {min(answers):.2f} | {max(answers):.2f} |")
        print(f"\nfirst answer, median of {len(answers)}: {median:.2f} s (target {TARGET_S:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"commit": commit, "runs": results}, indent=2))
    return 0 if len(answers) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
