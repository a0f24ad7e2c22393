"""Where the time of a streamed request goes: py-spy on the daemon and the engine.

Starts `blazar serve` with one plain Lane (no speculation, 8 slots, 2 threads), then for
one stream and for eight concurrent streams of greedy `/v1/completions`:

- samples the daemon (HTTP shim + data plane, one process) and the engine worker with
  `py-spy record` (native frames included) while the load runs, and prints each
  process's samples by where they land: llama.cpp's decode, sampling, gRPC, protobuf,
  the event loops, SSE/JSON encoding, logging, idle;
- prints the first-token path of the one-stream requests as the layers measure it:
  the engine's queue and prefill (`timings` of the response), and what the client
  saw on top of it.

    python bench/profile.py                 # both loads, 128 tokens per stream
    python bench/profile.py --seconds 20 --raw out/   # keep py-spy's collapsed stacks

Needs `py-spy` (the `bench` extra) and permission to ptrace the processes (root, or
`kernel.yama.ptrace_scope=0`). The figures are shares of samples, so they hold on a
busy machine too; the absolute rates do not.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import load  # noqa: E402
import servers  # noqa: E402

# Installed beside this interpreter (the bench extra), else on PATH.
PY_SPY = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
PROMPT = "Once upon a time, in a small fishing village on the edge of a cold northern sea, there"

# Where a sample lands, by the first rule whose pattern matches its stack (leaf first).
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("llama decode (native)", re.compile(r"llama_decode|ggml_|llama_context::decode")),
    ("sampling", re.compile(r"sampling\.py|llama_sampler|argmax")),
    ("logprobs / text", re.compile(r"generation\.py|text\.py|logprobs\.py|token_to_piece")),
    ("loop scheduling", re.compile(r"engine/(loop|seats|assembly)\.py|batching\.py|speculat")),
    ("protobuf", re.compile(r"protobuf|_message|upb_|MergeFrom|SerializeToString")),
    ("SSE / JSON", re.compile(r"json|streaming\.py|_sse|convert\.py")),
    ("logging", re.compile(r"structlog|logging")),
    ("gRPC", re.compile(r"grpc|cygrpc|_channel|aio/_call")),
    ("HTTP server", re.compile(r"uvicorn|h11|httptools|starlette")),
    ("asyncio", re.compile(r"asyncio|selectors|base_events")),
    ("threads waiting", re.compile(r"threading\.py.*wait|queue\.py.*get|_wait_for_tstate_lock")),
]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def categorize(stack: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(stack):
            return name
    return "other"


def summarize(raw: Path) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Total samples, samples per category, samples per leaf function (from py-spy's
    collapsed `raw` format: `frame;frame;... count`)."""
    total = 0
    by_category: collections.Counter[str] = collections.Counter()
    by_leaf: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        # Categorize by the deepest frame that says something (leaf first).
        by_category[categorize(";".join(reversed(frames)))] += n
        by_leaf[frames[-1]] += n
    return total, by_category, by_leaf


@contextlib.contextmanager
def sampling(pid: int, out: Path, *, seconds: float, rate: int) -> Iterator[None]:
    """py-spy record on pid for at most `seconds` (stopped early when the block ends)."""
    proc = subprocess.Popen(
        [PY_SPY, "record", "--pid", str(pid), "--rate", str(rate), "--duration",
         str(int(seconds)), "--format", "raw", "--output", str(out), "--gil",
         "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(1.0)  # attached before the load starts
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not out.exists():
            print(f"py-spy on {pid} wrote nothing: {err.decode(errors='replace')[-500:]}")


async def completion(client: httpx.AsyncClient, base: str, *, tokens: int) -> dict[str, object]:
    """One streamed greedy completion; the client's TTFT and the server's timings."""
    body = {
        "model": load.MODEL_ALIAS, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first = None
    timings: dict[str, float] = {}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if first is None and any(c.get("text") for c in chunk.get("choices") or []):
                first = time.perf_counter()
            timings = chunk.get("timings") or timings
    return {"ttft_ms": ((first or start) - start) * 1000, "timings": timings}


async def drive(base: str, *, streams: int, rounds: int, tokens: int) -> list[dict[str, object]]:
    async with load.http_client() as client:
        results: list[dict[str, object]] = []
        for _ in range(rounds):
            results += await asyncio.gather(
                *(completion(client, base, tokens=tokens) for _ in range(streams))
            )
        return results


def report(name: str, raw: Path, *, top: int) -> None:
    total, by_category, by_leaf = summarize(raw)
    print(f"  {name}: {total} samples holding the GIL")
    for category, n in by_category.most_common():
        print(f"    {100 * n / max(total, 1):5.1f}%  {category}")
    print("    top frames:")
    for leaf, n in by_leaf.most_common(top):
        print(f"    {100 * n / max(total, 1):5.1f}%  {leaf[:110]}")


async def first_tokens(grpc_target: str, base: str, *, repeats: int) -> None:
    """The one-stream first-token path, layer by layer: what the engine, the data plane,
    a gRPC client and an HTTP client each measured for the same short prompt."""
    import grpc

    from blazar._proto.v1 import inference_pb2, inference_pb2_grpc

    rows: list[tuple[float, float, float, float, float]] = []
    async with grpc.aio.insecure_channel(grpc_target) as channel, load.http_client() as client:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for _ in range(repeats):
            request = inference_pb2.CompleteRequest(
                model=load.MODEL_ALIAS,
                prompt=PROMPT,
                sampling=inference_pb2.Sampling(temperature=0.0, max_tokens=2),
            )
            start = time.perf_counter()
            first = None
            final = None
            async for chunk in stub.Complete(request):
                if chunk.HasField("delta") and first is None:
                    first = time.perf_counter()
                if chunk.HasField("final"):
                    final = chunk.final
            assert final is not None and first is not None
            grpc_ms = (first - start) * 1000
            http = await completion(client, base, tokens=2)
            t = final.timings
            rows.append((t.queue_ms, t.prefill_ms, t.ttft_ms, grpc_ms, float(str(http["ttft_ms"]))))
    med = [statistics.median(r[i] for r in rows) for i in range(5)]
    print(f"\n#### first token, one short prompt ({len(rows)} repeats, medians)")
    print(f"  engine: prepare + wait for a slot {med[0]:.1f} ms", end="")
    print(f", prefill and first sample {med[1]:.1f} ms")
    print(f"  data plane: arrival to first delta {med[2]:.1f} ms")
    print(f"  gRPC client (Complete): {med[3]:.1f} ms")
    print(f"  HTTP client (/v1/completions, stream): {med[4]:.1f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="rounds of each load")
    p.add_argument("--seconds", type=float, default=120, help="longest sampling window")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--ttft-repeats", type=int, default=15)
    p.add_argument("--raw", type=Path, default=None, help="keep the collapsed stacks here")
    p.add_argument("--model", type=Path, default=None)
    a = p.parse_args()
    if shutil.which(PY_SPY) is None:
        print("py-spy is not installed: pip install py-spy (the bench extra has it)")
        return 2
    model = a.model or servers.bundled_model()
    workdir = Path(tempfile.mkdtemp(prefix="bz-profile-"))
    raw_dir = a.raw or workdir
    raw_dir.mkdir(parents=True, exist_ok=True)
    config = servers.Config(
        model_path=model, threads=2, concurrency=8, slots=8, context_per_slot=2048,
        sizes=servers.FULL, peer_flash_attn=False, workdir=workdir, blazar_speculation=False,
    )  # fmt: skip
    blazar = servers.Blazar(config, [servers.LaneDef("bench")])
    try:
        with servers.serving(blazar) as server:
            assert server.daemon is not None and server.daemon.process is not None
            pids = {"daemon (shim + data plane)": server.daemon.process.pid}
            (pids["engine worker"],) = server.engine_pids
            base = server.base_url
            asyncio.run(drive(base, streams=1, rounds=1, tokens=8))  # warm
            asyncio.run(first_tokens(server.daemon.grpc, base, repeats=a.ttft_repeats))
            for streams in (1, 8):
                outs = {
                    name: raw_dir / f"{streams}-streams-{pid}.txt" for name, pid in pids.items()
                }
                cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
                with contextlib.ExitStack() as stack:
                    for name, out in outs.items():
                        stack.enter_context(
                            sampling(pids[name], out, seconds=a.seconds, rate=a.rate)
                        )
                    t0 = time.perf_counter()
                    results = asyncio.run(
                        drive(base, streams=streams, rounds=a.rounds, tokens=a.tokens)
                    )
                    wall = time.perf_counter() - t0
                cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
                tokens = sum(int(r["timings"].get("predicted_n", 0)) for r in results)  # type: ignore[union-attr]
                # The engine's own decode rate per request: compare it with a run without
                # py-spy attached (see docs/BENCHMARKS.md, "Profile of the engine path").
                rates = sorted(float(r["timings"].get("predicted_per_second", 0)) for r in results)  # type: ignore[union-attr]
                median = rates[len(rates) // 2]
                print(f"  engine-measured decode tok/s per stream, median {median:.1f}")
                print(
                    f"\n#### {streams} stream(s): {tokens / wall:.1f} tok/s aggregate, "
                    f"{tokens} tokens in {wall:.1f} s"
                )
                for name in pids:
                    print(
                        f"  {name}: {1000 * cpu[name] / tokens:.2f} CPU ms per token "
                        f"({100 * cpu[name] / wall:.0f}% of one core)"
                    )
                for name in pids:
                    report(name, outs[name], top=a.top)
    finally:
        if a.raw is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
