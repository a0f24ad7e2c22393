"""Engine benchmark: Blazar against llama-cpp-python's own server and llama.cpp's C++
llama-server, same model, same host.

The servers run the bundled Gemma 3 270M GGUF on the same number of CPU threads and are
driven through their OpenAI-compatible HTTP APIs with the same streamed `/v1/completions`
requests (greedy, fixed seed), so Blazar is measured end to end: HTTP shim, gRPC data
plane, engine worker. Only one server has requests at a time: for scenarios 1 to 3
(llama-cpp-python's server) and 7 to 9 (llama-server) both are up and take turns,
repeat by repeat. Scenarios 4 to 6 compare Blazar with itself (warm against cold
prefix, speculation on against off, restored KV against cold), because the peer has no
equivalent feature.

    python bench/engine.py                   # every scenario, full sizes
    python bench/engine.py --quick           # small sizes: a smoke test, not a result
    python bench/engine.py --scenarios 1,2,3 --json out.json

Every server process this script starts is stopped before it exits, including on error
or Ctrl-C. A scenario whose server fails is reported as ERROR and the rest still run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import llama_server  # noqa: E402  (bench/, beside this script)
import load  # noqa: E402
import servers  # noqa: E402

# Short, varied openings for a base model: each invites a long continuation.
PROMPTS = [
    "Once upon a time, in a small fishing village on the edge of a cold northern sea, there",
    "The history of the printing press begins in the fifteenth century, when",
    "Here is a detailed guide to growing tomatoes in a small backyard garden. First,",
    "The old lighthouse keeper climbed the spiral stairs for the last time and",
    "Photosynthesis is the process by which green plants turn sunlight into food. It",
    "Dear diary, today was the strangest day of my life. It started when",
    "The city of Venice was built on more than a hundred small islands, and",
    "In the year 2150, the first colony ship finally reached the distant planet. The crew",
]

STORY_PROMPT = (
    "Write a long story about a young girl who finds a map in her grandmother's attic.\n\n"
    "Story:\nThe attic smelled of dust and old paper. Mara pushed open the heavy trunk and"
)

COPY_SOURCE = (
    "The river rises in the hills above the town and runs for forty miles to the sea. "
    "In spring the water is high and brown, and the farmers along its banks watch the "
    "sky with care, because a week of rain can flood the lower fields in a single night. "
    "In summer the river is slow and clear, and children swim in the deep pools below the "
    "old stone bridge while their parents sit in the shade of the willows. In autumn the "
    "leaves turn red and gold and drift on the surface like small boats, and the fishermen "
    "come out early in the morning to catch trout before the light grows strong. In winter "
    "the edges of the river freeze, the mill wheel stops turning, and the whole valley is "
    "quiet except for the sound of water moving under the ice. People who grow up beside "
    "the river say that they can tell the season with their eyes closed, just by listening "
    "to it, and many of them come back to live there when they are old."
)
COPY_PROMPT = "Rewrite the following text exactly:\n\n" + COPY_SOURCE + "\n\nRewritten text:\n\n"

# Vocabulary for deterministic filler documents (long prompts for scenarios 4 and 6).
_SUBJECTS = ["the engineer", "a farmer", "the council", "our neighbour", "the old captain",
             "a young student", "the committee", "the baker", "my sister", "the mayor"]  # fmt: skip
_VERBS = ["repaired", "inspected", "described", "painted", "measured", "discussed",
          "carried", "ignored", "designed", "photographed"]  # fmt: skip
_OBJECTS = ["the wooden bridge", "a broken clock", "the northern wall", "three red boats",
            "the village well", "an empty barn", "the copper roof", "a stack of letters",
            "the station garden", "two iron gates"]  # fmt: skip
_TAILS = ["before the storm arrived", "during the long winter", "after the market closed",
          "without asking anyone", "with great patience", "late on a Tuesday",
          "while the children watched", "for the third time that year",
          "near the edge of the forest", "as the bells began to ring"]  # fmt: skip


# ---------------------------------------------------------------- tokens and prompts


def filler_document(tokenizer: load.Tokenizer, *, seed: int, tokens: int) -> str:
    """Deterministic plain-English filler of `tokens` tokens.

    Different seeds share no prefix beyond the first word, so two documents of the same
    length are equally cold for a prefix cache.
    """
    rng = random.Random(seed)
    sentences: list[str] = [f"Record {seed}."]
    # Sentences are ~10 tokens; count only every 20 to keep this fast.
    for _ in range(10_000):
        for _ in range(20):
            sentence = (
                f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                f"{rng.choice(_TAILS)}."
            )
            sentences.append(sentence[0].upper() + sentence[1:])
        if tokenizer.count(" ".join(sentences)) >= tokens:
            break
    return tokenizer.truncate(" ".join(sentences), tokens)


def salted(prompt: str, tag: str) -> str:
    """A unique first line, so no request can reuse a previous request's prefix."""
    return f"Document {tag}.\n{prompt}"


# ---------------------------------------------------------------- results


@dataclass
class Row:
    scenario: str
    title: str
    unit: str
    baseline_label: str
    target_op: str  # ">=" or "<="
    target: float
    baseline: float | None = None
    blazar: float | None = None
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # Blazar / peer for each repeat, the two measured back to back (scenarios 1 and 2):
    # the spread that the ratio of medians hides when the host's speed drifts.
    per_repeat: list[float] = field(default_factory=list)
    # "ratio": the target bounds blazar / baseline; "difference": it bounds
    # blazar - baseline, in the row's unit (the ratio is printed too).
    compare: str = "ratio"

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.blazar is None or self.baseline == 0:
            return None
        return self.blazar / self.baseline

    @property
    def difference(self) -> float | None:
        if self.baseline is None or self.blazar is None:
            return None
        return self.blazar - self.baseline

    @property
    def verdict(self) -> str:
        value = self.difference if self.compare == "difference" else self.ratio
        if value is None or value != value:  # None or NaN
            return "ERROR"
        ok = value >= self.target if self.target_op == ">=" else value <= self.target
        return "PASS" if ok else "FAIL"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = self.ratio
        out["difference"] = self.difference
        out["verdict"] = self.verdict
        return out


def guarded(rows: list[Row], what: str, fn: Callable[[], Any]) -> Any:
    """Run fn; on failure record the error on every row not yet holding one."""
    try:
        return fn()
    except Exception as exc:
        message = f"{what}: {type(exc).__name__}: {exc}"
        servers.log(message)
        for row in rows:
            row.error = (row.error + "; " if row.error else "") + message.splitlines()[0][:300]
        return None


def stream_summary(s: load.Stream) -> dict[str, Any]:
    return {
        "ttft_s": round(s.ttft, 4) if s.first is not None else None,
        "tokens": s.tokens,
        "token_source": s.token_source,
        "usage_tokens": s.usage_tokens,
        "prompt_tokens": s.prompt_tokens,
        "chunks": s.chunks,
        "finish_reason": s.finish_reason,
        "cached_tokens": s.cached_tokens,
        "wall_s": round(s.end - s.start, 4),
        "timings": s.timings,
    }


# ---------------------------------------------------------------- scenarios 1-3


@dataclass
class Throughput:
    """One server's measurements for scenarios 1-3, gathered repeat by repeat."""

    aggregates: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    singles: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(
        default_factory=lambda: {"concurrent_runs": [], "single_runs": []}
    )

    def values(self, scenario: int) -> list[float]:
        return {1: self.aggregates, 2: self.singles, 3: self.ttfts}[scenario]

    def value(self, scenario: int) -> float:
        values = self.values(scenario)
        return statistics.median(values) if values else float("nan")


def concurrent_run(
    base_url: str,
    rep: int,
    into: Throughput,
    *,
    who: str,
    config: servers.Config,
    tokenizer: load.Tokenizer,
) -> None:
    """One run of `concurrency` simultaneous streams (scenarios 1 and 3)."""
    prompts = [salted(PROMPTS[i % len(PROMPTS)], f"c{rep}-{i}") for i in range(config.concurrency)]
    streams, wall = load.run(
        load.concurrent(base_url, prompts, max_tokens=config.sizes.max_tokens, tokenizer=tokenizer)
    )
    total = sum(x.tokens for x in streams)
    into.aggregates.append(total / wall)
    into.ttfts.extend(x.ttft for x in streams)
    into.details["concurrent_runs"].append(
        {"wall_s": round(wall, 3), "tokens": total, "streams": [stream_summary(x) for x in streams]}
    )
    servers.log(f"{who}: {config.concurrency} streams, {total} tokens in {wall:.2f}s")


def single_run(
    base_url: str,
    rep: int,
    into: Throughput,
    *,
    who: str,
    config: servers.Config,
    tokenizer: load.Tokenizer,
) -> None:
    """One stream alone (scenario 2)."""
    prompt = salted(PROMPTS[rep % len(PROMPTS)], f"single-{rep}")
    x = load.run(
        load.one(base_url, prompt, max_tokens=config.sizes.max_tokens, tokenizer=tokenizer)
    )
    into.singles.append(x.decode_rate)
    into.texts.append(x.text)
    into.details["single_runs"].append(stream_summary(x) | {"decode_tps": round(x.decode_rate, 2)})
    servers.log(f"{who}: one stream, {x.tokens} tokens at {x.decode_rate:.1f} tok/s")


def scenarios_1_to_3(
    config: servers.Config, tokenizer: load.Tokenizer, which: set[int]
) -> list[Row]:
    """Both servers are up at once and take turns, repeat by repeat.

    The machine's speed drifts by tens of percent within minutes on shared hosts; one
    server measured minutes after the other would carry that drift into the ratio.
    Only one server has requests at any time (the other idles), and the order
    alternates between repeats.
    """
    rows = {
        1: Row("1", f"aggregate decode tok/s, {config.concurrency} streams", "tok/s",
               "peer", ">=", 3.0),
        2: Row("2", "one-stream decode tok/s", "tok/s", "peer", ">=", 1.5),
        3: Row("3", f"p50 TTFT, {config.concurrency} streams", "s", "peer", "<=", 0.1),
    }  # fmt: skip
    selected = [rows[n] for n in sorted(which)]
    lane = servers.LaneDef(
        "bench", speculation="bench-ngram" if config.blazar_speculation else None
    )
    contenders: dict[str, servers.Peer | servers.Blazar] = {
        "peer": servers.Peer(config),
        "blazar": servers.Blazar(config, [lane], spec_pairs=config.blazar_speculation),
    }
    results: dict[str, Throughput] = {}
    with contextlib.ExitStack() as stack:

        def start(server: servers.Peer | servers.Blazar) -> str:
            url: str = stack.enter_context(servers.serving(server)).base_url
            load.run(load.one(url, "Hello", max_tokens=4, tokenizer=tokenizer))  # warm-up
            return url

        urls: dict[str, str] = {}
        for name, server in contenders.items():
            url = guarded(selected, name, functools.partial(start, server))
            if url is not None:
                urls[name], results[name] = url, Throughput()
        kinds = ([concurrent_run] if which & {1, 3} else []) + ([single_run] if 2 in which else [])
        for rep in range(config.sizes.repeats):
            order = list(urls) if rep % 2 == 0 else list(reversed(urls))
            for kind in kinds:
                for name in order:
                    step = functools.partial(
                        kind, urls[name], rep, results[name],
                        who=name, config=config, tokenizer=tokenizer,
                    )  # fmt: skip
                    guarded(selected, name, step)
    for n in sorted(which):
        row = rows[n]
        if "peer" in results:
            row.baseline = results["peer"].value(n)
        if "blazar" in results:
            row.blazar = results["blazar"].value(n)
    if "peer" in results and "blazar" in results:
        peer, blazar = results["peer"], results["blazar"]
        for n in which & {1, 2}:
            if len(peer.values(n)) != len(blazar.values(n)):
                continue  # a failed repeat would pair the wrong runs
            pairs = zip(peer.values(n), blazar.values(n), strict=True)
            rows[n].per_repeat = [b / p for p, b in pairs if p]
            if n == 2:
                rows[2].details["same_output_as_peer"] = [
                    a == b for a, b in zip(peer.texts, blazar.texts, strict=True)
                ]
    for name, result in results.items():
        for n in which:
            rows[n].details[name] = result.details if n != 2 else result.details["single_runs"]
    return selected


# ---------------------------------------------------------------- scenario 4


QUESTION = "\n\nQuestion: {q}\nAnswer:"
QUESTIONS = [
    "Who repaired the wooden bridge?",
    "What happened during the long winter?",
    "Which people are mentioned most often?",
    "Summarise the record in one sentence.",
]


def ttft_of(
    base_url: str, prompt: str, config: servers.Config, tokenizer: load.Tokenizer
) -> load.Stream:
    return load.run(
        load.one(base_url, prompt, max_tokens=config.sizes.ttft_max_tokens, tokenizer=tokenizer)
    )


def scenario_4(config: servers.Config, tokenizer: load.Tokenizer) -> list[Row]:
    n = config.sizes.long_prompt_tokens
    row = Row("4", f"TTFT, shared ~{n}-token prefix (warm/cold)", "s", "Blazar cold", "<=", 0.15)

    def measure() -> None:
        with servers.serving(servers.Blazar(config, [servers.LaneDef("bench")])) as srv:
            load.run(load.one(srv.base_url, "Hello", max_tokens=4, tokenizer=tokenizer))
            warm: list[load.Stream] = []
            cold: list[load.Stream] = []
            for rep in range(config.sizes.repeats):
                shared = filler_document(tokenizer, seed=100 + rep, tokens=n)
                other = filler_document(tokenizer, seed=200 + rep, tokens=n)
                first = shared + QUESTION.format(q=QUESTIONS[0])
                cold.append(ttft_of(srv.base_url, first, config, tokenizer))  # primes the cache
                second = shared + QUESTION.format(q=QUESTIONS[1])
                warm.append(ttft_of(srv.base_url, second, config, tokenizer))
                fresh = other + QUESTION.format(q=QUESTIONS[1])
                cold.append(ttft_of(srv.base_url, fresh, config, tokenizer))
                servers.log(f"scenario 4: warm {warm[-1].ttft:.3f}s, cold {cold[-1].ttft:.3f}s")
            row.baseline = statistics.median(x.ttft for x in cold)
            row.blazar = statistics.median(x.ttft for x in warm)
            row.details = {
                "prompt_tokens": {
                    "warm": tokenizer.count(second),
                    "cold": [tokenizer.count(first), tokenizer.count(fresh)],
                },
                "warm": [stream_summary(x) for x in warm],
                "cold": [stream_summary(x) for x in cold],
            }

    guarded([row], "blazar", measure)
    return [row]


# ---------------------------------------------------------------- scenario 5


def scenario_5(config: servers.Config, tokenizer: load.Tokenizer) -> list[Row]:
    copy_row = Row("5a", "n-gram speculation, copy-heavy decode tok/s", "tok/s",
                   "Blazar no spec", ">=", 1.5)  # fmt: skip
    prose_row = Row("5b", "n-gram speculation, open prose decode tok/s", "tok/s",
                    "Blazar no spec", ">=", 0.95)  # fmt: skip
    lanes = [servers.LaneDef("bench"), servers.LaneDef("bench-spec", speculation="bench-ngram")]

    def measure() -> None:
        with servers.serving(servers.Blazar(config, lanes, spec_pairs=True)) as srv:
            for lane in ("bench", "bench-spec"):
                load.run(
                    load.one(srv.base_url, "Hello", max_tokens=4, tokenizer=tokenizer, model=lane)
                )
            for row, prompt in ((copy_row, COPY_PROMPT), (prose_row, STORY_PROMPT)):
                rates: dict[str, list[float]] = {"bench": [], "bench-spec": []}
                runs: dict[str, list[dict[str, Any]]] = {"bench": [], "bench-spec": []}
                texts: dict[str, list[str]] = {"bench": [], "bench-spec": []}
                for rep in range(config.sizes.repeats):
                    for lane in ("bench", "bench-spec"):  # interleaved against drift
                        x = load.run(
                            load.one(
                                srv.base_url,
                                salted(prompt, f"spec-{row.scenario}-{rep}"),
                                max_tokens=config.sizes.spec_max_tokens,
                                tokenizer=tokenizer,
                                model=lane,
                            )
                        )
                        rates[lane].append(x.decode_rate)
                        texts[lane].append(x.text)
                        runs[lane].append(
                            stream_summary(x) | {"decode_tps": round(x.decode_rate, 2)}
                        )
                        servers.log(f"scenario {row.scenario} {lane}: {x.decode_rate:.1f} tok/s")
                row.baseline = statistics.median(rates["bench"])
                row.blazar = statistics.median(rates["bench-spec"])
                # Greedy speculation changes the output only through llama.cpp's batch
                # noise; a mismatch means the two rates decoded different texts, so say so.
                same = [a == b for a, b in zip(texts["bench"], texts["bench-spec"], strict=True)]
                row.details = {"runs": runs, "same_output_as_no_spec": same}
                if not all(same):
                    servers.log(f"scenario {row.scenario}: speculation changed the greedy output")

    guarded([copy_row, prose_row], "blazar", measure)
    return [copy_row, prose_row]


# ---------------------------------------------------------------- scenario 6


def scenario_6(config: servers.Config, tokenizer: load.Tokenizer) -> list[Row]:
    n = config.sizes.long_prompt_tokens
    row = Row("6", f"TTFT after restart, persisted ~{n}-token prompt", "s",
              "Blazar cold", "<=", 0.3)  # fmt: skip
    k = config.sizes.repeats
    persisted = [
        filler_document(tokenizer, seed=300 + i, tokens=n) + QUESTION.format(q=QUESTIONS[2])
        for i in range(k)
    ]
    fresh = [
        filler_document(tokenizer, seed=400 + i, tokens=n) + QUESTION.format(q=QUESTIONS[2])
        for i in range(k)
    ]

    def measure() -> None:
        with servers.serving(
            servers.Blazar(config, [servers.LaneDef("bench", persist=True)])
        ) as srv:
            load.run(load.one(srv.base_url, "Hello", max_tokens=4, tokenizer=tokenizer))
            before = [ttft_of(srv.base_url, p, config, tokenizer) for p in persisted]
            restart_s = srv.restart()
            servers.log(f"scenario 6: restarted in {restart_s:.1f}s")
            # Warm first: a cold prompt sent earlier could be placed in a persisted slot.
            # No warm-up request either, for the same reason, so the first warm request
            # also pays any first-decode cost: this biases against Blazar.
            warm = [ttft_of(srv.base_url, p, config, tokenizer) for p in persisted]
            cold = [ttft_of(srv.base_url, p, config, tokenizer) for p in fresh]
            for w, c in zip(warm, cold, strict=True):
                servers.log(f"scenario 6: restored {w.ttft:.3f}s, cold {c.ttft:.3f}s")
            row.baseline = statistics.median(x.ttft for x in cold)
            row.blazar = statistics.median(x.ttft for x in warm)
            row.details = {
                "prompt_tokens": [tokenizer.count(p) for p in persisted + fresh],
                "restart_s": round(restart_s, 2),
                "before_restart": [stream_summary(x) for x in before],
                "warm": [stream_summary(x) for x in warm],
                "cold": [stream_summary(x) for x in cold],
            }

    guarded([row], "blazar", measure)
    return [row]


# ---------------------------------------------------------------- scenarios 7-9: llama-server

CPP = "llama-server"
PLAIN, SPEC = "bench", "bench-spec"  # Blazar's Lanes: plain decoding, the default SpecPair

# Scenario 9's prompt on its own: open prose whose greedy continuation the n-gram
# drafter finds little to copy from (its drafted and accepted tokens are in the JSON).
UNCOPYABLE = PROMPTS[2]


@dataclass
class Contender:
    """One server of scenarios 7-9: where to send requests, and under which model name."""

    name: str
    url: str
    model: str


@dataclass(frozen=True)
class Requests:
    """What every request of scenarios 7-9 shares: the sizes, the tokenizer, the EOG ban."""

    config: servers.Config
    tokenizer: load.Tokenizer
    extra: dict[str, Any]


def scenarios_vs_cpp(
    config: servers.Config, tokenizer: load.Tokenizer, which: set[int]
) -> tuple[list[Row], dict[str, Any]]:
    """Blazar against llama.cpp's C++ llama-server, both up at once and taking turns.

    Every stream is greedy and banned from ending early (a logit bias on every
    end-of-generation token, the same field for both), so each generates exactly
    `max_tokens`; the token counts the servers report are checked and kept per row.
    Blazar runs two Lanes in one daemon: `bench` decodes plainly (scenarios 7 and 8),
    `bench-spec` has the default fleet's n-gram SpecPair (scenario 9). Only one server
    has requests at any time, and the order rotates from turn to turn.
    """
    rows: dict[str, Row] = {}
    if 7 in which:
        for n in config.cpp_streams:
            rows[f"7@{n}"] = Row(
                f"7@{n}", f"plain decode, aggregate tok/s, {n} stream{'s' if n > 1 else ''}",
                "tok/s", CPP, ">=", 1.0,
            )  # fmt: skip
    if 8 in which:
        rows["8"] = Row(
            "8", "p50 TTFT, one short-prompt stream (Blazar - llama-server)", "s", CPP,
            "<=", 0.005, compare="difference",
        )  # fmt: skip
    if 9 in which:
        rows["9"] = Row(
            "9", f"one stream, default SpecPair, median of {len(PROMPTS)} prompts", "tok/s",
            CPP, ">=", 1.3,
        )  # fmt: skip
        rows["9p"] = Row(
            "9p", "one stream, default SpecPair, uncopyable prose prompt", "tok/s", CPP,
            ">=", 1.0,
        )  # fmt: skip
        rows["9q"] = Row(
            "9q", "same prompt, SpecPair on / off (Blazar plain)", "tok/s",
            "Blazar plain", ">=", 1.0,
        )  # fmt: skip
    selected = list(rows.values())
    info: dict[str, Any] = {}
    binary = guarded(selected, "building llama-server", llama_server.ensure)
    if binary is None:
        return selected, info
    info["build"] = llama_server.build_record(binary)
    info["system_info"] = llama_server.system_info(binary)
    info["llama_cpp_python_system_info"] = llama_cpp_system_info()
    if info["system_info"] != info["llama_cpp_python_system_info"]:
        servers.log(
            "llama-server and llama-cpp-python were built with different CPU features:\n"
            f"  llama-server:     {info['system_info']}\n"
            f"  llama-cpp-python: {info['llama_cpp_python_system_info']}"
        )
    lanes = [servers.LaneDef(PLAIN)]
    if 9 in which:
        lanes.append(servers.LaneDef(SPEC, speculation="bench-ngram"))
    cpp_server = servers.LlamaServer(config, binary)
    blazar_server = servers.Blazar(config, lanes, spec_pairs=9 in which)
    extra = load.no_end_of_generation(tokenizer)
    info["logit_bias"] = extra["logit_bias"]
    info["environment"] = {k: v for k, v in os.environ.items() if k.startswith(("GOMP_", "OMP_"))}
    with contextlib.ExitStack() as stack:

        def start(server: servers.LlamaServer | servers.Blazar, models: list[str]) -> str:
            url: str = stack.enter_context(servers.serving(server)).base_url
            for model in models:  # warm-up
                load.run(
                    load.one(
                        url, "Hello", max_tokens=4, tokenizer=tokenizer, model=model, extra=extra
                    )
                )
            return url

        cpp_url = guarded(selected, CPP, functools.partial(start, cpp_server, [load.MODEL_ALIAS]))
        info["argv"] = cpp_server.command
        blazar_url = guarded(
            selected, "blazar", functools.partial(start, blazar_server, [x.name for x in lanes])
        )
        if cpp_url is None or blazar_url is None:
            return selected, info
        cpp = Contender(CPP, cpp_url, load.MODEL_ALIAS)
        plain = Contender("blazar", blazar_url, PLAIN)
        spec = Contender("blazar-spec", blazar_url, SPEC)
        requests = Requests(config, tokenizer, extra)
        if 7 in which:
            for n in config.cpp_streams:
                row = rows[f"7@{n}"]
                step = functools.partial(plain_decode, row, n, cpp, plain, requests)
                guarded([row], f"scenario 7, {n} streams", step)
        if 8 in which:
            step = functools.partial(first_token, rows["8"], cpp, plain, requests)
            guarded([rows["8"]], "scenario 8", step)
        if 9 in which:
            nine = (rows["9"], rows["9p"], rows["9q"])
            step = functools.partial(speculative_one_stream, nine, cpp, spec, plain, requests)
            guarded(list(nine), "scenario 9", step)
    return selected, info


def llama_cpp_system_info() -> str:
    """llama-cpp-python's build, as llama.cpp describes it (CPU features compiled in)."""
    import llama_cpp

    return str(llama_cpp.llama_print_system_info().decode()).rstrip()


def token_check(runs: dict[str, list[load.Stream]], max_tokens: int) -> dict[str, Any]:
    """Per server: how many streams reported exactly `max_tokens` and ended by length."""
    out: dict[str, Any] = {}
    for name, streams in runs.items():
        counts: dict[str, int] = {}
        for x in streams:
            counts[str(x.usage_tokens)] = counts.get(str(x.usage_tokens), 0) + 1
        out[name] = {
            "streams": len(streams),
            "as_asked": sum(
                x.usage_tokens == max_tokens and x.finish_reason == "length" for x in streams
            ),
            "usage_completion_tokens": counts,
            "prompt_tokens": sorted({x.prompt_tokens for x in streams if x.prompt_tokens}),
        }
    return {"max_tokens": max_tokens, "servers": out}


def turns(k: int, contenders: list[Contender]) -> list[Contender]:
    """The contenders in turn order for turn `k`: rotated, so none always goes first."""
    k %= len(contenders)
    return contenders[k:] + contenders[:k]


def plain_decode(row: Row, n: int, cpp: Contender, blazar: Contender, requests: Requests) -> None:
    """Scenario 7: n streams at once; all tokens / wall time from first send to last end."""
    config, tokenizer, extra = requests.config, requests.tokenizer, requests.extra
    max_tokens = config.sizes.max_tokens
    rates: dict[str, list[float]] = {cpp.name: [], blazar.name: []}
    walls: dict[str, list[float]] = {cpp.name: [], blazar.name: []}
    runs: dict[str, list[load.Stream]] = {cpp.name: [], blazar.name: []}
    for rep in range(config.sizes.repeats):
        prompts = [salted(PROMPTS[i % len(PROMPTS)], f"p{n}-{rep}-{i}") for i in range(n)]
        for c in turns(rep, [cpp, blazar]):
            streams, wall = load.run(
                load.concurrent(
                    c.url, prompts, max_tokens=max_tokens, tokenizer=tokenizer,
                    model=c.model, extra=extra,
                )
            )  # fmt: skip
            total = sum(x.tokens for x in streams)
            rates[c.name].append(total / wall)
            walls[c.name].append(round(wall, 3))
            runs[c.name].extend(streams)
            servers.log(f"scenario 7, {c.name}: {n} streams, {total} tokens in {wall:.2f}s")
    row.baseline = statistics.median(rates[cpp.name])
    row.blazar = statistics.median(rates[blazar.name])
    pairs = zip(rates[cpp.name], rates[blazar.name], strict=True)
    row.per_repeat = [b / p for p, b in pairs if p]
    row.details = {
        "streams": n,
        "aggregate_tps": rates,
        "wall_s": walls,
        "tokens": token_check(runs, max_tokens),
        "runs": {name: [stream_summary(x) for x in xs] for name, xs in runs.items()},
    }


def first_token(row: Row, cpp: Contender, blazar: Contender, requests: Requests) -> None:
    """Scenario 8: one short prompt at a time, the servers alternating; p50 of the TTFT."""
    config, tokenizer, extra = requests.config, requests.tokenizer, requests.extra
    max_tokens = config.sizes.ttft_max_tokens
    runs: dict[str, list[load.Stream]] = {cpp.name: [], blazar.name: []}
    for i in range(config.sizes.ttft_samples):
        prompt = salted(PROMPTS[i % len(PROMPTS)], f"t{i}")
        for c in turns(i, [cpp, blazar]):
            x = load.run(
                load.one(
                    c.url, prompt, max_tokens=max_tokens, tokenizer=tokenizer,
                    model=c.model, extra=extra,
                )
            )  # fmt: skip
            runs[c.name].append(x)
    ttfts = {name: [x.ttft for x in xs] for name, xs in runs.items()}
    row.baseline = statistics.median(ttfts[cpp.name])
    row.blazar = statistics.median(ttfts[blazar.name])
    row.details = {
        "samples": config.sizes.ttft_samples,
        "ttft_ms": {name: [round(t * 1000, 1) for t in ts] for name, ts in ttfts.items()},
        "tokens": token_check(runs, max_tokens),
    }
    servers.log(
        f"scenario 8: p50 TTFT {cpp.name} {row.baseline * 1000:.1f} ms, "
        f"{blazar.name} {row.blazar * 1000:.1f} ms"
    )


def speculative_one_stream(
    rows: tuple[Row, Row, Row],
    cpp: Contender,
    spec: Contender,
    plain: Contender,
    requests: Requests,
) -> None:
    """Scenario 9: one stream per prompt, the three contenders taking turns.

    Each prompt's rate is the median over repeats; the line is the median over the
    prompts, for Blazar's speculating Lane and for llama-server. The uncopyable prompt
    is also reported alone, against llama-server and against Blazar's plain Lane.
    """
    row, prose_row, spec_row = rows
    config, tokenizer, extra = requests.config, requests.tokenizer, requests.extra
    max_tokens = config.sizes.max_tokens
    contenders = [cpp, spec, plain]
    rates: dict[str, dict[str, list[float]]] = {
        c.name: {p: [] for p in PROMPTS} for c in contenders
    }
    runs: dict[str, list[load.Stream]] = {c.name: [] for c in contenders}
    drafts: dict[str, dict[str, list[int]]] = {p: {"drafted": [], "accepted": []} for p in PROMPTS}
    for rep in range(config.sizes.repeats):
        for k, prompt in enumerate(PROMPTS):
            for c in turns(rep + k, contenders):
                x = load.run(
                    load.one(
                        c.url, salted(prompt, f"s{rep}-{k}"), max_tokens=max_tokens,
                        tokenizer=tokenizer, model=c.model, extra=extra,
                    )
                )  # fmt: skip
                rates[c.name][prompt].append(x.decode_rate)
                runs[c.name].append(x)
                if c is spec:
                    timings = x.timings or {}
                    drafts[prompt]["drafted"].append(int(timings.get("draft_n", 0)))
                    drafts[prompt]["accepted"].append(int(timings.get("draft_n_accepted", 0)))
            servers.log(
                f"scenario 9, prompt {k}: "
                + ", ".join(f"{c.name} {rates[c.name][prompt][-1]:.1f}" for c in contenders)
                + " tok/s"
            )
    medians = {
        c.name: {p: statistics.median(rs) for p, rs in rates[c.name].items()} for c in contenders
    }
    row.baseline = statistics.median(medians[cpp.name].values())
    row.blazar = statistics.median(medians[spec.name].values())
    row.per_repeat = [medians[spec.name][p] / medians[cpp.name][p] for p in PROMPTS]
    per_prompt = {
        p: {name: round(m[p], 2) for name, m in medians.items()} | drafts[p] for p in PROMPTS
    }
    row.details = {
        "prompts": PROMPTS,
        "per_prompt": per_prompt,
        "tokens": token_check(runs, max_tokens),
        "runs": {name: [stream_summary(x) for x in xs] for name, xs in runs.items()},
    }
    prose_row.baseline = medians[cpp.name][UNCOPYABLE]
    prose_row.blazar = medians[spec.name][UNCOPYABLE]
    spec_row.baseline = medians[plain.name][UNCOPYABLE]
    spec_row.blazar = medians[spec.name][UNCOPYABLE]
    prose_row.details = {"prompt": UNCOPYABLE} | per_prompt[UNCOPYABLE]
    spec_row.details = dict(prose_row.details)


# ---------------------------------------------------------------- report


def fmt(value: float | None, unit: str) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    if unit == "s":
        return f"{value * 1000:.0f} ms"
    return f"{value:.1f} {unit}"


def compared(r: Row) -> str:
    """The ratio column: blazar / baseline, and the difference where that is the target."""
    ratio = "-" if r.ratio is None else f"{r.ratio:.3f}x"
    d = r.difference
    if r.compare != "difference" or d is None or d != d:
        return ratio
    if r.unit == "s":
        return f"{d * 1000:+.1f} ms ({ratio})"
    return f"{d:+.1f} {r.unit} ({ratio})"


def target_text(r: Row) -> str:
    if r.compare == "difference":
        value = f"{r.target * 1000:+g} ms" if r.unit == "s" else f"{r.target:+g} {r.unit}"
        return f"{r.target_op} {value}"
    return f"{r.target_op} {r.target}x"


def token_line(r: Row) -> str:
    check = r.details["tokens"]
    parts = []
    for name, c in check["servers"].items():
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(c["usage_completion_tokens"].items()))
        flag = "" if c["as_asked"] == c["streams"] else " NOT ALL AS ASKED"
        parts.append(
            f"{name} {c['as_asked']}/{c['streams']} streams with {check['max_tokens']} "
            f"({counts}){flag}, prompt tokens {c['prompt_tokens'] or '-'}"
        )
    return f"  {r.scenario}: " + "; ".join(parts)


def table(rows: list[Row]) -> str:
    head = ["#", "scenario", "baseline", "peer/base", "blazar", "ratio", "target", "result"]
    body = [
        [
            r.scenario,
            r.title,
            r.baseline_label,
            fmt(r.baseline, r.unit),
            fmt(r.blazar, r.unit),
            compared(r),
            target_text(r),
            r.verdict,
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    spreads = [
        f"  {r.scenario}{' (per prompt)' if r.scenario == '9' else ''}: "
        + ", ".join(f"{x:.2f}x" for x in r.per_repeat)
        for r in rows
        if r.per_repeat
    ]
    if spreads:
        lines += ["", "per repeat (Blazar / peer, measured back to back):", *spreads]
    checks = [token_line(r) for r in rows if "tokens" in r.details]
    if checks:
        lines += ["", "tokens per stream (usage.completion_tokens, finish_reason length):"]
        lines += checks
    errors = [f"  {r.scenario}: {r.error}" for r in rows if r.error]
    if errors:
        lines += ["", "errors:", *errors]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="1,2,3,4,5,6,7,8,9", help="comma-separated, e.g. 1,2,3")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    p.add_argument("--json", type=Path, default=None, help="write results to this file")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled one)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for both servers")
    p.add_argument("--concurrency", type=int, default=8, help="streams in scenarios 1 and 3")
    p.add_argument(
        "--cpp-streams",
        default="1,8,32,64",
        help="scenario 7: the numbers of simultaneous streams, comma-separated",
    )
    p.add_argument(
        "--peer-flash-attn",
        choices=["on", "off"],
        default="on",
        help="the peer's --flash_attn; Blazar leaves llama.cpp's 'auto', which is on for CPU",
    )
    p.add_argument(
        "--blazar-speculation",
        choices=["on", "off"],
        default="on",
        help="scenarios 1-3: Blazar's lane has the default fleet's n-gram SpecPair (on) or "
        "decodes one token per step (off)",
    )
    args = p.parse_args(argv)
    try:
        args.which = {int(x) for x in args.scenarios.split(",") if x.strip()}
    except ValueError:
        p.error("--scenarios takes numbers 1 to 9, comma-separated")
    if not args.which or not args.which <= set(range(1, 10)):
        p.error("--scenarios takes numbers 1 to 9, comma-separated")
    try:
        args.cpp_streams = tuple(int(x) for x in args.cpp_streams.split(",") if x.strip())
    except ValueError:
        p.error("--cpp-streams takes positive numbers, comma-separated")
    if not args.cpp_streams or min(args.cpp_streams) < 1:
        p.error("--cpp-streams takes positive numbers, comma-separated")
    return args


def _terminate(signum: int, _frame: Any) -> None:
    # Turn SIGTERM into an exception so every `finally` stops its servers.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    workdir = Path(tempfile.mkdtemp(prefix="blazar-bench-"))
    model = args.model.resolve() if args.model else servers.bundled_model()
    config = servers.Config(
        model_path=model,
        threads=args.threads,
        concurrency=args.concurrency,
        slots=max(8, args.concurrency),
        context_per_slot=2048,
        sizes=servers.QUICK if args.quick else servers.FULL,
        peer_flash_attn=args.peer_flash_attn == "on",
        workdir=workdir,
        blazar_speculation=args.blazar_speculation == "on",
        cpp_streams=args.cpp_streams,
    )
    servers.log(
        f"model {model}, {config.threads} threads, sizes {config.sizes}, work dir {workdir}"
    )
    tokenizer = load.Tokenizer(model)
    rows: list[Row] = []
    cpp_info: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        if args.which & {1, 2, 3}:
            rows += scenarios_1_to_3(config, tokenizer, args.which & {1, 2, 3})
        if 4 in args.which:
            rows += scenario_4(config, tokenizer)
        if 5 in args.which:
            rows += scenario_5(config, tokenizer)
        if 6 in args.which:
            rows += scenario_6(config, tokenizer)
        if args.which & {7, 8, 9}:
            cpp_rows, cpp_info = scenarios_vs_cpp(config, tokenizer, args.which & {7, 8, 9})
            rows += cpp_rows
    finally:
        logs = sorted(workdir.glob("*.log"))
        if rows and any(r.error for r in rows) and logs:
            servers.log(f"server logs kept: {', '.join(str(x) for x in logs)}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.perf_counter() - started
    peers = ["llama-cpp-python's server"] if args.which & {1, 2, 3} else []
    peers += ["llama.cpp's llama-server"] if args.which & {7, 8, 9} else []
    print()
    print(
        f"Blazar vs {' and '.join(peers) or 'itself'}"
        f"{' (QUICK: smoke sizes, not a result)' if args.quick else ''}"
    )
    print(f"model {model.name}, {config.threads} threads, {elapsed:.0f}s")
    if cpp_info.get("argv"):
        env = " ".join(f"{k}={v}" for k, v in sorted(cpp_info["environment"].items()))
        print(f"llama-server: {env + ' ' if env else ''}{shlex.join(cpp_info['argv'])}")
        same = cpp_info["system_info"] == cpp_info["llama_cpp_python_system_info"]
        print(f"  {'same CPU features as' if same else 'OTHER CPU FEATURES THAN'} llama-cpp-python")
    print(table(rows))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "quick": args.quick,
                    "model": str(model),
                    "threads": config.threads,
                    "concurrency": config.concurrency,
                    "sizes": asdict(config.sizes),
                    "elapsed_s": round(elapsed, 1),
                    "llama_server": cpp_info or None,
                    "results": [r.to_json() for r in rows],
                },
                indent=2,
            )
        )
    # Missed targets are results, not failures; only a scenario that could not run is.
    return 1 if any(r.verdict == "ERROR" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
