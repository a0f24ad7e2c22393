"""Overload: SLO admission on the default fleet against the same bursts under FIFO.

Starts `blazar serve` on the repository's own manifests (`manifests/`: the `gemma3` Lane
with 6 slots and the n-gram SpecPair, the `interactive` and `batch` SLOPolicies, batch
work holding at most 4 slots by its maxSlotsPerReplica) plus
one more policy, `fifo` (no targets, no early refusal, a deep queue: what a plain server
does). Every request names its policy with `x-blazar-slo`; each burst runs twice in the
same run, once under the fleet's policies and once with every request under `fifo`:

- flood: 48 interactive requests (64 tokens each) at once. Admitted requests' p99 time to
  first token against the policy's ttftTargetMs; refusals are 429 with Retry-After, and
  come within 20 ms (p99: from the same flood again, 48 requests written at once on
  connections opened before, timed from each one's write, `raw_burst`; the figure from
  httpx opening 48 new connections at once, whose set-up and scheduling from one event
  loop take 25-30 ms here, is shown beside it); goodput
  (requests whose first token met the target, per second of the burst) at least 1.5x
  FIFO's.
- mixed: 16 batch requests of 256 tokens fill the slots batch work may hold (4), then 6
  interactive ones: every interactive first token within target, every batch request
  complete (256 tokens, finish "length"), batch throughput at most 15% below the same
  batch alone.
- long prefill: while 3 interactive streams decode, a 1,500-token prompt arrives: the
  streams' p99 time between tokens within tpotTargetMs, the prompt's first token at
  most 1.5x what it takes alone.
- prediction: for admitted requests, the median of |predicted - measured| / measured
  time to first token (the prediction comes back in `x-blazar-predicted-ttft-ms`).

Generation is pinned so that every stream runs to its max_tokens: end-of-generation
tokens are banned (logit bias), greedy. Refusals, timings and token counts are what the
client saw.

    python bench/overload.py [--json out.json] [--only flood,mixed,prefill]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load
import servers

REPO = Path(__file__).resolve().parent.parent
LANE = "gemma3"
FIFO = "fifo"
# The interactive flood again, written at once on open connections (`raw_burst`).
WARM = "warm"
FIFO_POLICY = {
    "apiVersion": "blazar.dev/v1alpha1",
    "kind": "SLOPolicy",
    "metadata": {"name": FIFO},
    "spec": {"priority": 0, "maxQueueDepth": 4096, "onOverload": "queue"},
}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def fleet_policies() -> dict[str, dict[str, Any]]:
    """The SLOPolicies of the default fleet, by name (their spec)."""
    docs = yaml.safe_load_all((REPO / "manifests" / "policies.yaml").read_text())
    return {d["metadata"]["name"]: d["spec"] for d in docs if d and d["kind"] == "SLOPolicy"}


def fleet_slots() -> int:
    """The slots of the default fleet's Lane."""
    docs = yaml.safe_load_all((REPO / "manifests" / "lanes.yaml").read_text())
    return next(int(d["spec"]["slots"]) for d in docs if d and d["metadata"]["name"] == LANE)


class DefaultFleet(servers.Blazar):
    """`blazar serve` watching a copy of manifests/ and the FIFO policy."""

    def manifests(self) -> list[dict[str, Any]]:
        docs: list[dict[str, Any]] = []
        for path in sorted((REPO / "manifests").glob("*.yaml")):
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
        return [*docs, FIFO_POLICY]


# ---------------------------------------------------------------- one request


@dataclass
class Result:
    policy: str
    status: int = 0
    start: float = 0.0
    # When the response (or its refusal) arrived, and each text chunk.
    answered: float = 0.0
    # When each text chunk arrived, and its text (a chunk may carry several tokens).
    token_times: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    end: float = 0.0
    retry_after: str | None = None
    predicted_ttft_ms: float | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    def read(self, chunk: dict[str, Any]) -> None:
        """One streamed chunk, as it arrives: its text (timed now), finish reason and
        usage, or the error it carries."""
        if "error" in chunk:
            self.error = json.dumps(chunk["error"])[:300]
            return
        now = time.perf_counter()
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                self.token_times.append(now)
                self.texts.append(choice["text"])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.completion_tokens = chunk["usage"].get("completion_tokens")


async def request(
    client: httpx.AsyncClient, base: str, *, policy: str, prompt: str, max_tokens: int,
    extra: dict[str, Any],
) -> Result:  # fmt: skip
    body = {
        "model": LANE, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, **extra,
    }  # fmt: skip
    out = Result(policy=policy, start=time.perf_counter())
    headers = {"x-blazar-slo": policy}
    try:
        async with client.stream(
            "POST", f"{base}/v1/completions", json=body, headers=headers
        ) as resp:
            out.answered = time.perf_counter()
            out.status = resp.status_code
            out.retry_after = resp.headers.get("retry-after")
            predicted = resp.headers.get("x-blazar-predicted-ttft-ms")
            out.predicted_ttft_ms = float(predicted) if predicted else None
            if resp.status_code != 200:
                out.error = (await resp.aread()).decode(errors="replace")[:300]
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                out.read(json.loads(line[5:]))
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.end = time.perf_counter()
    return out


async def raw_burst(
    base: str, specs: list[tuple[str, str, int]], extra: dict[str, Any]
) -> list[Result]:
    """(policy, prompt, max_tokens) per request, all sent at once over connections
    opened before (each used once for `GET /healthz`): plain sockets, every request
    written in one pass of the event loop, so that they reach the server as close
    together as the host allows and each one's time starts at its own write. What a
    pooled HTTP client cannot show: httpx, given 48 open connections, hands the
    requests to the server 5-10 ms apart (its pool's own scheduling), and its figures
    are its own."""
    url = urlparse(base)
    assert url.hostname is not None and url.port is not None
    conns = await asyncio.gather(*(asyncio.open_connection(url.hostname, url.port) for _ in specs))
    for _, writer in conns:
        writer.write(f"GET /healthz HTTP/1.1\r\nhost: {url.netloc}\r\n\r\n".encode())
    for reader, _ in conns:
        status, headers = await _head(reader)
        assert status == 200, status
        await reader.readexactly(int(headers["content-length"]))
    results = [Result(policy=policy) for policy, _, _ in specs]
    payloads = []
    for policy, prompt, max_tokens in specs:
        body = json.dumps({
            "model": LANE, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra,
        }).encode()  # fmt: skip
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {url.netloc}\r\n"
            f"content-type: application/json\r\nx-blazar-slo: {policy}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        payloads.append(head.encode() + body)
    for (_, writer), payload, out in zip(conns, payloads, results, strict=True):
        out.start = time.perf_counter()
        writer.write(payload)

    async def answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, out: Result
    ) -> Result:
        out.status, headers = await _head(reader)
        out.answered = time.perf_counter()
        out.retry_after = headers.get("retry-after")
        predicted = headers.get("x-blazar-predicted-ttft-ms")
        out.predicted_ttft_ms = float(predicted) if predicted else None
        if out.status != 200:
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            out.error = body.decode(errors="replace")[:300]
        else:
            async for event in _sse_events(reader):
                if event == "[DONE]":
                    break
                out.read(json.loads(event))
        out.end = time.perf_counter()
        writer.close()
        return out

    return list(
        await asyncio.gather(*(answer(r, w, o) for (r, w), o in zip(conns, results, strict=True)))
    )


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """An HTTP/1.1 response's status and headers (names lower-cased)."""
    status = int((await reader.readline()).split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _sse_events(reader: asyncio.StreamReader) -> AsyncIterator[str]:
    """The `data:` payloads of a chunked SSE body, in order."""
    buffer = b""
    while size := int((await reader.readline()).strip() or b"0", 16):
        buffer += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data:"):
                    yield line[5:].strip()


def salted(tag: str, prompt: str = PROMPT) -> str:
    return f"Request {tag}.\n{prompt}"


async def burst(
    base: str, specs: list[tuple[float, str, str, int]], extra: dict[str, Any]
) -> list[Result]:
    """(delay_s, policy, prompt, max_tokens) per request, all from one client."""
    async with load.http_client() as client:

        async def delayed(delay: float, policy: str, prompt: str, tokens: int) -> Result:
            await asyncio.sleep(delay)
            return await request(
                client, base, policy=policy, prompt=prompt, max_tokens=tokens, extra=extra
            )

        return list(await asyncio.gather(*(delayed(*s) for s in specs)))


# ---------------------------------------------------------------- figures


def p(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank), or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Line:
    name: str
    figure: float | None
    fifo: float | None
    target: str
    ok: bool | None
    unit: str = ""
    note: str = ""


def fmt(x: float | None, unit: str) -> str:
    return "-" if x is None else f"{x:.1f}{unit}" if unit else f"{x:.2f}"


def flood(
    base: str, policies: dict[str, Any], extra: dict[str, Any], seen: list[Result]
) -> list[Line]:
    target_s = policies["interactive"]["ttftTargetMs"] / 1000
    runs: dict[str, list[Result]] = {}
    walls: dict[str, float] = {}
    for policy in ("interactive", FIFO, WARM):
        t0 = time.perf_counter()
        if policy == WARM:
            # The interactive flood again, written at once over open connections: the
            # server's time to refuse, without the client's.
            raw = [("interactive", salted(f"flood-warm-{i}"), 64) for i in range(48)]
            runs[policy] = load.run(raw_burst(base, raw, extra))
        else:
            specs = [(0.0, policy, salted(f"flood-{policy}-{i}"), 64) for i in range(48)]
            runs[policy] = load.run(burst(base, specs, extra))
        walls[policy] = time.perf_counter() - t0
        servers.log(
            f"flood under {policy}: "
            + ", ".join(f"{s}: {sum(r.status == s for r in runs[policy])}" for s in (200, 429))
            + f" in {walls[policy]:.1f}s"
        )

    def goodput(policy: str) -> float:
        met = [r for r in runs[policy] if r.ttft is not None and r.ttft <= target_s]
        return len(met) / walls[policy]

    slo = runs["interactive"]
    seen += slo + runs[WARM]
    admitted = [r.ttft for r in slo if r.status == 200 and r.ttft is not None]
    fifo_ttft = [r.ttft for r in runs[FIFO] if r.ttft is not None]
    refused = [r for r in slo if r.status == 429]
    refusal_ms = [(r.answered - r.start) * 1000 for r in refused]
    warm_ms = [(r.answered - r.start) * 1000 for r in runs[WARM] if r.status == 429]
    servers.log(f"flood: refusal ms {sorted(round(x) for x in refusal_ms)}")
    servers.log(f"flood, open connections: refusal ms {sorted(round(x) for x in warm_ms)}")
    servers.log(f"flood: refusals {sorted({r.error[:90] for r in refused})}")
    p99 = p(admitted, 0.99)
    refusal_p99 = p(refusal_ms, 0.99)
    warm_p99 = p(warm_ms, 0.99)
    ratio = goodput("interactive") / goodput(FIFO) if goodput(FIFO) else None
    return [
        Line("flood: admitted / refused (429)", float(len(admitted)), float(len(fifo_ttft)),
             "-", None, note=f"{len(refused)} refused"),
        Line("flood: p99 TTFT of admitted (s)", p99, p(fifo_ttft, 0.99), f"<= {target_s:g} s",
             p99 is not None and p99 <= target_s),
        Line("flood: every refusal has Retry-After", float(all(r.retry_after for r in refused)),
             None, "1", bool(refused) and all(r.retry_after for r in refused)),
        Line("flood: p99 time to refusal (ms)", warm_p99, None, "<= 20 ms",
             warm_p99 is not None and warm_p99 <= 20,
             note=f"{len(warm_ms)} refused, written at once on open connections"),
        Line("flood: the same, httpx on new connections (ms)", refusal_p99, None, "-", None,
             note="with the client's connection set-up and scheduling"),
        Line("flood: goodput (met target / s)", goodput("interactive"), goodput(FIFO),
             ">= 1.5x FIFO", ratio is not None and ratio >= 1.5,
             note=f"{ratio:.2f}x" if ratio else ""),
    ]  # fmt: skip


def mixed(
    base: str, policies: dict[str, Any], extra: dict[str, Any], seen: list[Result]
) -> list[Line]:
    target_s = policies["interactive"]["ttftTargetMs"] / 1000

    def batch_specs(policy: str, tag: str) -> list[tuple[float, str, str, int]]:
        return [(0.0, policy, salted(f"{tag}-batch-{i}"), 256) for i in range(16)]

    def rate(results: list[Result]) -> float:
        done = [r for r in results if r.completion_tokens]
        span = max(r.end for r in results) - min(r.start for r in results)
        return sum(r.completion_tokens or 0 for r in done) / span

    alone = load.run(burst(base, batch_specs("batch", "alone"), extra))
    alone_rate = rate(alone)
    servers.log(f"mixed: batch alone {alone_rate:.1f} tok/s")
    out: dict[str, tuple[list[Result], list[Result]]] = {}
    for batch_policy, urgent_policy in (("batch", "interactive"), (FIFO, FIFO)):
        urgent_specs = [
            (1.0, urgent_policy, salted(f"mixed-{urgent_policy}-{i}"), 64) for i in range(6)
        ]
        specs = batch_specs(batch_policy, f"mixed-{batch_policy}") + urgent_specs
        results = load.run(burst(base, specs, extra))
        out[batch_policy] = (results[:16], results[16:])
        for r in results[16:]:
            if r.error:
                servers.log(f"mixed: refused {r.status} {r.error}")
        servers.log(
            f"mixed under {batch_policy}/{urgent_policy}: urgent TTFT "
            + ", ".join(f"{r.ttft:.2f}" if r.ttft else r.error[:40] or str(r.status)
                        for r in results[16:])
        )  # fmt: skip
    batch, urgent = out["batch"]
    seen += batch + urgent
    fifo_batch, fifo_urgent = out[FIFO]
    worst = max((r.ttft or math.inf for r in urgent), default=None)
    fifo_worst = max((r.ttft or math.inf for r in fifo_urgent), default=None)
    complete = sum(r.completion_tokens == 256 and r.finish_reason == "length" for r in batch)
    drop = 1 - rate(batch) / alone_rate
    return [
        Line("mixed: slowest interactive TTFT (s)", worst, fifo_worst, f"<= {target_s:g} s",
             worst is not None and worst <= target_s),
        Line("mixed: batch requests complete", float(complete), float(
            sum(r.completion_tokens == 256 for r in fifo_batch)), "16", complete == 16),
        Line("mixed: batch throughput vs alone", rate(batch) / alone_rate,
             rate(fifo_batch) / alone_rate, ">= 0.85", drop <= 0.15,
             note=f"alone {alone_rate:.1f} tok/s"),
    ]  # fmt: skip


def long_prefill(
    base: str, policies: dict[str, Any], extra: dict[str, Any], tokenizer: load.Tokenizer
) -> list[Line]:
    tpot_s = policies["interactive"]["tpotTargetMs"] / 1000
    story = tokenizer.truncate(" ".join(["The lighthouse stood on the cliff."] * 400), 1500)

    def alone(policy: str, tag: str) -> float | None:
        (r,) = load.run(burst(base, [(0.0, policy, salted(tag, story), 16)], extra))
        return r.ttft

    lines: dict[str, tuple[float | None, float | None, float | None]] = {}
    # The streams decode under the policy with the tpotTargetMs; the long prompt is
    # batch work (under `interactive`, a prompt whose prefill alone takes longer than
    # the 2 s target is refused, as it should be).
    for streams_policy, long_policy in (("interactive", "batch"), (FIFO, FIFO)):
        base_ttft = alone(long_policy, f"alone-{long_policy}")
        specs = [(0.0, streams_policy, salted(f"stream-{long_policy}-{i}"), 192) for i in range(3)]
        specs.append((2.0, long_policy, salted(f"long-{long_policy}", story), 16))
        results = load.run(burst(base, specs, extra))
        streams, long_run = results[:3], results[3]
        # Time per token while the long prompt was being prefilled (its send to its
        # first token): each chunk's gap over the tokens it carries.
        window_end = long_run.token_times[0] if long_run.token_times else long_run.end
        gaps = [
            (b - a) / max(1, tokenizer.count(text))
            for r in streams
            for a, b, text in zip(r.token_times, r.token_times[1:], r.texts[1:], strict=False)
            if b >= long_run.start and a <= window_end
        ]
        lines[long_policy] = (p(gaps, 0.99), long_run.ttft, base_ttft)
        servers.log(
            f"long prefill, streams {streams_policy}, prompt {long_policy}: p99 time per "
            f"token {lines[long_policy][0]}, TTFT {long_run.ttft} (alone {base_ttft}) "
            f"{long_run.error[:80]}; {len(gaps)} gaps, p50/p90/p95 "
            f"{[round(x, 3) for x in (p(gaps, 0.5), p(gaps, 0.9), p(gaps, 0.95)) if x]}, "
            f"slowest {sorted(round(g, 3) for g in gaps)[-5:]}"
        )
    gap, ttft, alone_ttft = lines["batch"]
    fifo_gap, fifo_ttft, fifo_alone = lines[FIFO]
    slow = ttft / alone_ttft if ttft and alone_ttft else None
    fifo_slow = fifo_ttft / fifo_alone if fifo_ttft and fifo_alone else None
    return [
        Line("long prefill: streams' p99 s/token", gap, fifo_gap, f"<= {tpot_s:g} s",
             gap is not None and gap <= tpot_s),
        Line("long prefill: TTFT vs alone", slow, fifo_slow, "<= 1.5x",
             slow is not None and slow <= 1.5),
    ]  # fmt: skip


def prediction(results: list[Result]) -> Line:
    errors = [
        abs(r.predicted_ttft_ms / 1000 - r.ttft) / r.ttft
        for r in results
        if r.status == 200 and r.ttft and r.predicted_ttft_ms is not None
    ]
    median = statistics.median(errors) if errors else None
    pairs = [
        (round(r.predicted_ttft_ms / 1000, 2), round(r.ttft, 2))
        for r in results
        if r.status == 200 and r.ttft and r.predicted_ttft_ms is not None
    ]
    servers.log(f"prediction: (predicted, measured) s {pairs}")
    return Line("prediction: median |error| of TTFT", median, None, "<= 0.25",
                median is not None and median <= 0.25, note=f"{len(errors)} admitted")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", default="flood,mixed,prefill")
    a = ap.parse_args()
    only = set(a.only.split(","))
    model = servers.bundled_model()
    tokenizer = load.Tokenizer(model)
    extra = load.no_end_of_generation(tokenizer)
    policies = fleet_policies()
    workdir = Path(tempfile.mkdtemp(prefix="bz-overload-"))
    config = servers.Config(
        model_path=model, threads=2, concurrency=8, slots=fleet_slots(), context_per_slot=2048,
        sizes=servers.FULL, peer_flash_attn=False, workdir=workdir,
    )  # fmt: skip
    lines: list[Line] = []
    try:
        with servers.serving(DefaultFleet(config, [servers.LaneDef(LANE)])) as server:
            url = server.base_url
            # Warm-up: one request alone, then as many as the Lane has slots, so that
            # the forecast has measured decode steps at both ends of the batch (what
            # a Lane that has served any concurrent traffic knows).
            load.run(burst(url, [(0.0, FIFO, salted("warm"), 16)], extra))
            warm = [(0.0, FIFO, salted(f"warm-{i}"), 16) for i in range(config.slots)]
            load.run(burst(url, warm, extra))
            seen: list[Result] = []
            if "flood" in only:
                lines += flood(url, policies, extra, seen)
            if "mixed" in only:
                lines += mixed(url, policies, extra, seen)
            if "prefill" in only:
                lines += long_prefill(url, policies, extra, tokenizer)
            if seen:
                lines.append(prediction(seen))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{'line':44} {'SLO':>10} {'FIFO':>10}  {'target':14} result")
    for line in lines:
        verdict = "-" if line.ok is None else "PASS" if line.ok else "FAIL"
        print(
            f"{line.name:44} {fmt(line.figure, line.unit):>10} {fmt(line.fifo, line.unit):>10}"
            f"  {line.target:14} {verdict} {line.note}"
        )
    if a.json:
        a.json.write_text(json.dumps([asdict(x) for x in lines], indent=2))
    return 0 if all(x.ok is not False for x in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
