"""Continuous batching, prefix reuse, logprobs and KV persistence of a real worker."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.engine import batching
from tests.integration import pinning
from tests.integration.engine_harness import (
    READY_DEADLINE_S,
    Spawner,
    Worker,
    greedy,
    poll,
)

pytestmark = pytest.mark.slow

SLOTS = 4
CONTEXT = 2048
# One thread: on this shared 2-core machine two llama.cpp threads spin on each other's
# barriers whenever another process holds a core, and steps get several times slower.
SETTINGS = {"slots": SLOTS, "context_per_slot": CONTEXT, "threads": 1}

# Prompts whose greedy continuations are mostly far from any tie (measured: counting
# leads by >= 2.7 nats at each of its first 24 tokens), so that the small numeric
# differences batching causes rarely change them; tests compare streams only up to
# a near-tie (`pinning.common_greedy_prefix`) and force the text where they need it.
COUNTING = "1, 2, 3, 4, 5, 6, 7,"
PROMPTS = [
    COUNTING,
    "Monday, Tuesday, Wednesday,",
    "January, February, March,",
    "a, b, c, d, e, f,",
]
TEXTS = [
    "The river flows through the old town and under seven stone bridges.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "She opened the window, and the cold morning air filled the room.",
    "def add(a, b):\n    return a + b\n",
]
# About 1,000 tokens shared by two prompts (the window of Gemma 3's SWA layers is 512).
SHARED = " ".join(
    f"Section {i}: the committee reviewed item {i * 7 % 13} and approved budget line {i}."
    for i in range(60)
)


@pytest.fixture(scope="module")
def batch_worker(model_path: Path) -> Iterator[Worker]:
    spawner = Spawner(model_path)
    w = spawner(**SETTINGS)
    w.wait_ready()
    yield w
    spawner.close()


@dataclass
class Stream:
    """One Generate call consumed on its own thread, with each delta's arrival time."""

    deltas: list[tuple[float, inference_pb2.Delta]] = field(default_factory=list)
    final: inference_pb2.Final | None = None
    error: grpc.RpcError | None = None

    @property
    def text(self) -> str:
        return "".join(d.text for _, d in self.deltas)

    def consume(self, call: Any) -> None:
        """Read a Generate call to its end, keeping its deltas, final part or error."""
        try:
            for chunk in call:
                if chunk.HasField("delta"):
                    self.deltas.append((time.monotonic(), chunk.delta))
                else:
                    self.final = chunk.final
        except grpc.RpcError as exc:
            self.error = exc

    def time_of_token(self, n: int) -> float:
        """When the stream had received at least n tokens."""
        seen = 0
        for at, d in self.deltas:
            seen += d.tokens
            if seen >= n:
                return at
        raise AssertionError(f"only {seen} tokens arrived")


def run_concurrently(w: Worker, requests: list[dict[str, Any]]) -> list[Stream]:
    """Start every call first, then drain them in parallel threads."""
    calls = [w.stub.Generate(engine_pb2.GenerateRequest(**r), timeout=90) for r in requests]
    streams = [Stream() for _ in calls]
    threads = [
        threading.Thread(target=stream.consume, args=(call,))
        for call, stream in zip(calls, streams, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(s.error is None and s.final is not None for s in streams), [s.error for s in streams]
    return streams


def prompt_logprobs(final: inference_pb2.Final) -> list[float]:
    return [lp.logprob for lp in final.prompt_logprobs]


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


# --- continuous batching ----------------------------------------------------------------


def test_concurrent_streams_progress_together(
    batch_worker: Worker, no_eog: dict[int, float]
) -> None:
    n = 16
    streams = run_concurrently(
        batch_worker, [{"prompt": p, "sampling": greedy(n, logit_bias=no_eog)} for p in PROMPTS]
    )
    assert [s.final.usage.completion_tokens for s in streams if s.final] == [n] * len(PROMPTS)
    assert sorted(s.final.routing.slot for s in streams if s.final) == list(range(SLOTS))
    # Interleaved, not one after another: every stream has its first token before any
    # stream is halfway through.
    last_first = max(s.time_of_token(1) for s in streams)
    first_half = min(s.time_of_token(n // 2) for s in streams)
    assert last_first < first_half


def test_batched_logprobs_match_one_at_a_time(batch_worker: Worker) -> None:
    def request(text: str) -> dict[str, Any]:
        return {"prompt": text, "sampling": greedy(1, prompt_logprobs=True)}

    alone = [batch_worker.generate(**request(t))[1] for t in TEXTS]
    batched = [s.final for s in run_concurrently(batch_worker, [request(t) for t in TEXTS])]
    diffs = []
    for a, b in zip(alone, batched, strict=True):
        assert b is not None
        # Teacher forcing: one entry per prompt token after the first, none from a cache.
        assert len(a.prompt_logprobs) == a.usage.prompt_tokens - 1
        assert a.usage.cached_tokens == 0 and b.usage.cached_tokens == 0
        assert [lp.id for lp in a.prompt_logprobs] == [lp.id for lp in b.prompt_logprobs]
        diffs.append(mean_abs_diff(prompt_logprobs(a), prompt_logprobs(b)))
    assert max(diffs) <= 0.15, diffs


def test_batched_rounds_agree_up_to_near_ties(
    batch_worker: Worker, no_eog: dict[int, float], model_path: Path
) -> None:
    """Four greedy streams side by side, three times: the first round leaves each
    prompt cached in its own slot, the others reuse it. Each stream repeats its
    output but for what a near-tie may turn (the rounds need not batch alike: requests
    arrive when they arrive, and a cached prefix is decoded in other batches). A
    stream that reads a wrong cache, or another slot's tokens, parts far from a tie.

    Each prompt is at least 13 tokens, so that what it keeps of its slot (all but its
    last token) is at least what it throws away there (the 9 tokens it decoded): the
    slot matches it (`batching.choose_slot`, llama.cpp's rule). A 7-token prompt does
    not match its own slot, and took whichever slot arrival order and recency gave it
    (a run of the whole suite on a fresh clone failed so)."""
    sampling = greedy(10, logit_bias=no_eog, logprobs=True, top_logprobs=5)
    prompts = [
        COUNTING,
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday,",
        "January, February, March, April, May, June, July,",
        PROMPTS[3],
    ]
    requests = [{"prompt": p, "sampling": sampling} for p in prompts]
    rounds = [run_concurrently(batch_worker, requests) for _ in range(3)]
    eog = pinning.end_of_generation(model_path)
    for streams in rounds:
        assert all(s.final and s.final.usage.completion_tokens == 10 for s in streams)
    assert all(s.final and s.final.usage.cached_tokens > 0 for s in rounds[-1])
    for later in rounds[1:]:
        for a, b in zip(rounds[0], later, strict=True):
            reference = [lp for _, d in a.deltas for lp in d.logprobs]
            pinning.common_greedy_prefix(
                reference, [lp.id for _, d in b.deltas for lp in d.logprobs], banned=eog
            )


def forced(text: str) -> inference_pb2.Constraint:
    return inference_pb2.Constraint(grammar=pinning.exactly(text))


def test_stop_strings_and_max_tokens_hold_under_batching(
    batch_worker: Worker, no_eog: dict[int, float]
) -> None:
    # The texts are forced (the model's own greedy ones here), and end-of-generation
    # banned, so the stops and budgets are what ends each stream on every CPU.
    requests = [
        {
            "prompt": COUNTING,
            "sampling": greedy(30, stop=["11"]),
            "constraint": forced(" 8, 9, 10, 11, 12, 13, 14, 15"),
        },
        {
            "prompt": PROMPTS[1],
            "sampling": greedy(30, stop=["Friday"]),
            "constraint": forced(" Thursday, Friday, Saturday, Sunday"),
        },
        {"prompt": PROMPTS[2], "sampling": greedy(5, logit_bias=no_eog)},
        {"prompt": PROMPTS[3], "sampling": greedy(9, logit_bias=no_eog)},
    ]
    counting, days, months, letters = run_concurrently(batch_worker, requests)
    assert counting.text == " 8, 9, 10, "
    assert days.text == " Thursday, "
    for s in (counting, days):
        assert s.final is not None
        assert s.final.finish_reason == inference_pb2.FINISH_REASON_STOP
    for s, n in ((months, 5), (letters, 9)):
        assert s.final is not None
        assert s.final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert s.final.usage.completion_tokens == n


def test_cancelling_one_stream_frees_its_slot_while_others_run(
    batch_worker: Worker, no_eog: dict[int, float]
) -> None:
    n = 32
    # No max_tokens and no end-of-generation: the victim would run until its slot's
    # context is full.
    victim = batch_worker.stub.Generate(
        engine_pb2.GenerateRequest(
            prompt=PROMPTS[3], sampling=inference_pb2.Sampling(temperature=0.0, logit_bias=no_eog)
        ),
        timeout=60,
    )
    others: list[Stream] = []
    runner = threading.Thread(
        target=lambda: others.extend(
            run_concurrently(
                batch_worker,
                [{"prompt": p, "sampling": greedy(n, logit_bias=no_eog)} for p in PROMPTS[:2]],
            )
        )
    )
    assert next(victim).HasField("delta")
    runner.start()
    try:

        def three_busy() -> bool:
            h = batch_worker.health()
            return h is not None and sum(s.busy for s in h.slots) == 3

        poll(three_busy, what="three busy slots")
        victim.cancel()

        def two_busy() -> bool:
            h = batch_worker.health()
            return h is not None and sum(s.busy for s in h.slots) == 2

        poll(two_busy, what="the cancelled stream's slot to be freed")
    finally:
        runner.join(timeout=120)
    assert [s.final.usage.completion_tokens for s in others if s.final] == [n, n]


# --- prefix reuse -----------------------------------------------------------------------


def test_prefix_reuse(
    batch_worker: Worker,
    tokenize: Callable[[str], list[int]],
    no_eog: dict[int, float],
    model_path: Path,
) -> None:
    first = SHARED + " Summary of section 3:"
    second = SHARED + " Which budget line did the committee approve last?"
    shared = batching.common_prefix(tokenize(first), tokenize(second))
    assert shared > 900
    sampling = greedy(6, logprobs=True, top_logprobs=5, logit_bias=no_eog)
    # A cold run of the second prompt: nothing of it is in any slot yet ...
    cold_deltas, cold = batch_worker.generate(prompt=second, sampling=sampling)
    assert cold.usage.cached_tokens == 0
    # ... the first prompt then finds their common prefix in its slot and prefills the
    # rest (its own last part replacing the second's) ...
    _, first_run = batch_worker.generate(prompt=first, sampling=greedy(2))
    assert first_run.usage.cached_tokens == shared
    assert first_run.routing.slot == cold.routing.slot
    # ... and so does the second prompt again, warm.
    warm_deltas, warm = batch_worker.generate(prompt=second, sampling=sampling)
    assert warm.usage.cached_tokens == shared
    assert warm.routing.prefix_tokens_reused == shared
    assert warm.routing.slot == cold.routing.slot
    # The engine says it with its first chunk too (initial metadata), for callers that
    # tell it before the answer ends (the HTTP shim's x-blazar-prefix-reused).
    again = batch_worker.stub.Generate(
        engine_pb2.GenerateRequest(prompt=second, sampling=greedy(1)), timeout=60
    )
    last = list(again)[-1].final
    announced = dict(again.initial_metadata())["blazar-prefix-reused"]
    assert int(announced) == last.routing.prefix_tokens_reused >= shared
    assert warm.timings.prefill_ms < 0.3 * cold.timings.prefill_ms, (
        warm.timings.prefill_ms,
        cold.timings.prefill_ms,
    )
    # Keeping 1,000 tokens across a 512-token sliding window gives the distribution a
    # cold prefill gives.
    cold_lps = [lp for d in cold_deltas for lp in d.logprobs]
    warm_lps = [lp for d in warm_deltas for lp in d.logprobs]
    assert len(cold_lps) == len(warm_lps) == 6
    top_cold = {t.id: t.logprob for t in cold_lps[0].top}
    top_warm = {t.id: t.logprob for t in warm_lps[0].top}
    both = sorted(set(top_cold) & set(top_warm))
    assert len(both) >= 4
    assert mean_abs_diff([top_cold[t] for t in both], [top_warm[t] for t in both]) <= 0.15
    # The streams may part only at a near-tie, and agree in logprob until then.
    agreeing = pinning.common_greedy_prefix(
        cold_lps, [lp.id for lp in warm_lps], banned=pinning.end_of_generation(model_path)
    )
    for c, w in zip(cold_lps[:agreeing], warm_lps, strict=False):
        assert abs(c.logprob - w.logprob) <= 0.3


def test_a_short_prompt_leaves_a_long_cache_alone(spawn: Spawner) -> None:
    """A prompt that shares only BOS with a slot takes the empty one: a review found
    "Hi" wiping a 1,400-token cache while a slot stood empty."""
    w = spawn(slots=2, context_per_slot=CONTEXT, threads=1)
    w.wait_ready()
    long_prompt = " ".join(
        f"Entry {i}: the archive lists box {i * 5 % 17} on shelf {i}." for i in range(85)
    )
    _, cold = w.generate(prompt=long_prompt, sampling=greedy(2))
    assert 1200 < cold.usage.prompt_tokens < CONTEXT - 16
    _, short = w.generate(prompt="Hi", sampling=greedy(2))
    assert short.routing.slot != cold.routing.slot
    _, again = w.generate(prompt=long_prompt, sampling=greedy(2))
    assert again.routing.slot == cold.routing.slot
    assert again.usage.cached_tokens == cold.usage.prompt_tokens - 1


def test_logprobs_are_a_distribution(batch_worker: Worker) -> None:
    # Plain greedy (no bias: the entries are of the argmax path), so the model may stop
    # by itself on some CPU; its end-of-generation token has no entry (nor text).
    deltas, final = batch_worker.generate(
        prompt=COUNTING, sampling=greedy(4, logprobs=True, top_logprobs=3)
    )
    lps = [lp for d in deltas for lp in d.logprobs]
    by_itself = final.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert final.usage.completion_tokens == (len(lps) + 1 if by_itself else 4)
    assert sum(d.tokens for d in deltas) == len(lps)
    for lp in lps:
        assert lp.logprob <= 0 and len(lp.top) == 3
        # Greedy picks the most likely token.
        assert lp.top[0].id == lp.id and lp.top[0].logprob == pytest.approx(lp.logprob)
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert lp.bytes.decode() == lp.token
    # No logprobs unless asked.
    deltas, final = batch_worker.generate(prompt=COUNTING, sampling=greedy(2))
    assert not any(d.logprobs for d in deltas) and not final.prompt_logprobs


@pytest.mark.parametrize("stop", [" 9", "9,", ", 1"])
def test_logprobs_cover_the_returned_text_only(batch_worker: Worker, stop: str) -> None:
    # " 8, 9, 10, ...", forced (the model's own greedy text): each stop string spans
    # tokens here (" ", "8", ",", " ", "9", ...), and the assertions hold for any split.
    deltas, final = batch_worker.generate(
        prompt=COUNTING,
        sampling=greedy(12, logprobs=True, stop=[stop]),
        constraint=forced(" 8, 9, 10, 11, 12, 13"),
    )
    assert final.finish_reason == inference_pb2.FINISH_REASON_STOP
    text = "".join(d.text for d in deltas)
    pieces = [lp.bytes for d in deltas for lp in d.logprobs]
    assert text and stop not in text
    # Every returned character is covered, and the last entry's token produced some.
    assert b"".join(pieces).decode().startswith(text)
    assert len(b"".join(pieces[:-1]).decode()) < len(text)


def test_end_of_turn_has_no_logprobs_entry(batch_worker: Worker) -> None:
    (end_of_turn,) = batch_worker.stub.Tokenize(
        inference_pb2.TokenizeRequest(text="<end_of_turn>", parse_special=True), timeout=10
    ).tokens
    deltas, final = batch_worker.generate(
        prompt=COUNTING,
        sampling=greedy(4, logprobs=True, logit_bias={end_of_turn: 100.0}),
    )
    assert final.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert final.usage.completion_tokens == 1
    assert not any(d.text or d.logprobs for d in deltas)


def test_health_reports_kv_and_cached_tokens(batch_worker: Worker) -> None:
    h = batch_worker.wait_ready()
    assert h.context_per_slot == CONTEXT
    assert h.kv_bytes > 0
    assert h.memory_bytes > h.kv_bytes // 4
    assert len(h.slots) == SLOTS and not any(s.busy for s in h.slots)
    # Earlier tests left their prompts cached.
    assert any(s.cached_tokens > 900 for s in h.slots)


# --- KV persistence ---------------------------------------------------------------------


def log_events(w: Worker, event: str) -> list[dict[str, Any]]:
    found = []
    for line in w.log.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


def stop(w: Worker) -> None:
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(timeout=READY_DEADLINE_S) == 0


def test_kv_persists_across_a_graceful_restart(
    spawn: Spawner, tmp_path: Path, no_eog: dict[int, float]
) -> None:
    kv = tmp_path / "kv"
    # Longer than the 512-token sliding window, whose cache is saved only in part.
    prompt = SHARED[: len(SHARED) // 2] + " And then"
    first = spawn(**SETTINGS, kv_dir=kv)
    first.wait_ready()
    # Several generated tokens: the slot is saved cut back to its prompt, or a repeat
    # of the prompt could not reuse the window-limited state after the restart.
    _, cold = first.generate(prompt=prompt, sampling=greedy(8, logit_bias=no_eog))
    assert (cold.usage.cached_tokens, cold.usage.completion_tokens) == (0, 8)
    stop(first)
    assert (kv / f"slot-{cold.routing.slot}.kv").stat().st_size > 0
    # A file for another slot that belongs to something else is skipped, not fatal.
    (kv / "slot-3.kv").write_bytes(b"not a llama state")
    (kv / "slot-3.json").write_text(json.dumps({"model_hash": "other", "tokens": 3}))

    second = spawn(**SETTINGS, kv_dir=kv)
    h = second.wait_ready()
    assert h.slots[cold.routing.slot].cached_tokens == cold.usage.prompt_tokens
    assert log_events(second, "kv_restored")
    assert [e["slot"] for e in log_events(second, "kv_restore_skipped")] == [3]
    _, warm = second.generate(prompt=prompt, sampling=greedy(2))
    assert warm.usage.cached_tokens == warm.usage.prompt_tokens - 1
    assert warm.timings.prefill_ms < 0.3 * cold.timings.prefill_ms
    stop(second)

    # Another cache type is another identity: the state is ignored, the worker serves.
    third = spawn(**SETTINGS, kv_dir=kv, type_k="q8_0", type_v="q8_0")
    third.wait_ready()
    assert log_events(third, "kv_restore_skipped")
    assert not any(s.cached_tokens for s in third.wait_ready().slots)
    _, fresh = third.generate(prompt=COUNTING, sampling=greedy(2, logit_bias=no_eog))
    assert fresh.usage.completion_tokens == 2
    stop(third)

    # Fewer slots: each saved state is skipped as a mismatch, and the files of slots
    # the worker no longer has are removed too.
    saved = {p.name for p in kv.glob("slot-*")}
    assert f"slot-{fresh.routing.slot}.kv" in saved
    (kv / "slot-3.kv").write_bytes(b"left from four slots")
    (kv / "slot-3.json").write_text("{}")
    fourth = spawn(**SETTINGS | {"slots": 2}, kv_dir=kv, type_k="q8_0", type_v="q8_0")
    fourth.wait_ready()
    skipped = log_events(fourth, "kv_restore_skipped")
    assert {e["slot"] for e in skipped} == {fresh.routing.slot, 3}
    assert all(e["reason"] == "mismatch" and e["fields"] == ["slots"] for e in skipped)
    assert not any(p.name.startswith("slot-3") for p in kv.iterdir())
    stop(fourth)


def test_drain_cancels_what_outlives_its_grace_and_the_stop_saves(
    spawn: Spawner, tmp_path: Path, no_eog: dict[int, float]
) -> None:
    """A request still running when the drain's grace ends is cancelled with UNAVAILABLE,
    so a SIGTERM that follows stops at once and saves the slots: the supervisor's
    order (Drain, then SIGTERM with its own grace)."""
    kv = tmp_path / "kv"
    w = spawn(**SETTINGS, kv_dir=kv)
    w.wait_ready()
    call = w.stub.Generate(
        engine_pb2.GenerateRequest(
            prompt=COUNTING, sampling=greedy(CONTEXT // 2, logit_bias=no_eog)
        ),
        timeout=90,
    )
    stream = Stream()
    reader = threading.Thread(target=stream.consume, args=(call,))
    reader.start()
    poll(lambda: stream.deltas, what="the first token")
    drained = w.stub.Drain(engine_pb2.DrainRequest(grace_seconds=0.5), timeout=20)
    reader.join(timeout=20)
    assert drained.abandoned == 1
    assert stream.final is None and stream.error is not None
    assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "stopped before this request finished" in (stream.error.details() or "")
    started = time.monotonic()
    stop(w)
    assert time.monotonic() - started < 5
    assert log_events(w, "kv_saved")
    assert any(path.stat().st_size > 0 for path in kv.glob("slot-*.kv"))
