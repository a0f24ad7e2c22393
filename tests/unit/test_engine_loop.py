"""The decode loop's bookkeeping against a fake runtime: a scripted "model" whose next
token is a function of the sequence's cached tokens, and a KV cache that refuses any
decode whose position does not follow what the sequence holds."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from blazar.api import errors, replicas
from blazar.engine import jobs, llama, logprobs, loop, sampling, speculation, speculator
from tests import launches

EOS = 0
N_VOCAB = 32
Entry = tuple[int, int, int, bool]


def cycle(tokens: Sequence[int]) -> int:
    """The fake model: 1, 2, ..., 10, 1, 2, ... after whatever came last."""
    return tokens[-1] % 10 + 1


class FakeVocab:
    n_tokens = N_VOCAB
    handle = None

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def piece(self, token: int, *, special: bool = False) -> bytes:
        return f"w{token} ".encode()


class FakeRuntime:
    """What `loop.DecodeLoop` calls of `llama.Runtime`, over per-sequence token lists."""

    def __init__(self, spec: replicas.LaunchSpec, model: Callable[[Sequence[int]], int]) -> None:
        self.spec = spec
        self.next_token = model
        self.vocab = FakeVocab()
        self.n_vocab = N_VOCAB
        self.n_batch = llama.N_BATCH
        self.n_outputs = llama.output_rows(spec)
        self.context_per_slot = spec.context_per_slot
        self.n_swa = 0
        self.kv_bytes = 0
        self.kv: dict[int, list[int]] = {s: [] for s in range(spec.slots)}
        # Per batch entry of the last decode: the sequence up to it, when it has logits.
        self.rows: list[list[int] | None] = []
        self.steps = 0
        # Called from the decode thread before each decode, with the step's number.
        self.before_decode: Callable[[int], None] = lambda step: None

    def decode(self, entries: Sequence[Entry]) -> None:
        self.steps += 1
        self.before_decode(self.steps)
        entries = list(entries)
        assert 0 < len(entries) <= self.n_batch
        assert sum(e[3] for e in entries) <= self.n_outputs
        self.rows = []
        for token, pos, seq, logits in entries:
            assert pos == len(self.kv[seq]) < self.context_per_slot, (seq, pos)
            self.kv[seq].append(token)
            self.rows.append(list(self.kv[seq]) if logits else None)

    def sample(self, sampler: Any, index: int) -> int:
        row = self.rows[index]
        assert row is not None
        return self.next_token(row)

    def logits(self, index: int, count: int = 1) -> np.ndarray[Any, Any]:
        out = np.zeros((count, N_VOCAB), dtype=np.float32)
        for i in range(count):
            row = self.rows[index + i]
            assert row is not None
            out[i, self.next_token(row)] = 5.0
        return out

    def truncate(self, seq: int, keep: int) -> bool:
        del self.kv[seq][keep:]
        return True

    def clear(self, seq: int) -> None:
        self.kv[seq].clear()

    def pos_min(self, seq: int) -> int:
        return 0 if self.kv[seq] else -1

    # A sequence's state: its tokens, as bytes (what llama.cpp copies is opaque too).
    def seq_state_size(self, seq: int) -> int:
        return 4 * len(self.kv[seq]) + 4

    def seq_state(self, seq: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
        state = np.array([len(self.kv[seq]), *self.kv[seq]], dtype=np.int32).view(np.uint8)
        assert state.nbytes == size
        return state

    def set_seq_state(self, seq: int, state: np.ndarray[Any, np.dtype[np.uint8]]) -> bool:
        count, *tokens = state.view(np.int32).tolist()
        assert count == len(tokens)
        self.kv[seq] = tokens
        return True

    def close(self) -> None:
        pass


@contextlib.contextmanager
def running(
    monkeypatch: pytest.MonkeyPatch,
    *,
    slots: int = 1,
    context: int = 256,
    model: Callable[[Sequence[int]], int] = cycle,
    drafter: speculation.DraftModel | None = None,
    min_acceptance_rate: float = 0.0,
    **spec: Any,
) -> Iterator[tuple[loop.DecodeLoop, FakeRuntime]]:
    """A decode loop on a fake runtime; with `drafter`, it speculates (up to 4 tokens,
    paused below `min_acceptance_rate`); `spec`: other launch settings."""
    launch = None
    if drafter is not None:
        launch = launches.ngram(
            max_draft_tokens=4, disable_above_batch=8, min_acceptance_rate=min_acceptance_rate
        )
        policy = speculation.SpeculationPolicy.from_launch(launch)
        monkeypatch.setattr(
            speculator.Speculator,
            "load",
            lambda _launch, _rt, **_: speculator.Speculator("fake", policy, drafter),
        )
    launch_spec = launches.spec(
        slots=slots, context_per_slot=context, threads=1, speculation=launch, **spec
    )
    runtime = FakeRuntime(launch_spec, model)
    monkeypatch.setattr(llama.Runtime, "load", lambda _spec: runtime)
    loaded = threading.Event()
    decode = loop.DecodeLoop(launches.engine(launch_spec), on_loaded=lambda _error: loaded.set())
    decode.start()
    try:
        assert loaded.wait(10), "the fake runtime did not load"
        yield decode, runtime
    finally:
        decode.stop()
        decode.join(10)
        assert not decode._thread.is_alive()


class Events:
    """A job's deliver callback: everything it was told, and when it ended."""

    def __init__(self) -> None:
        self.events: list[jobs.Event] = []
        self.ended = threading.Event()

    def __call__(self, event: jobs.Event) -> None:
        self.events.append(event)
        if isinstance(event, jobs.Finished | jobs.Failed):
            self.ended.set()

    @property
    def last(self) -> jobs.Event:
        return self.events[-1]


def job(prompt: list[int], *, max_tokens: int, name: str = "r") -> tuple[jobs.Job, Events]:
    events = Events()
    params = sampling.SamplingParams(temperature=0.0)
    return jobs.Job(
        request_id=name, prompt=prompt, params=params, max_tokens=max_tokens, deliver=events
    ), events


def test_a_job_cancelled_while_waiting_for_a_slot_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain cancels queued jobs too; each must end (CANCELLED, which the service
    turns into a retryable UNAVAILABLE) rather than be dropped without a word, which
    left its stream open until the server was torn down."""
    with running(monkeypatch, slots=1) as (decode, runtime):
        busy, busy_events = job([1, 2, 3], max_tokens=200, name="busy")
        queued, queued_events = job([4, 5, 6], max_tokens=4, name="queued")

        def cancel_at(step: int) -> None:
            if step == 3:
                queued.cancel()
            if step == 6:
                busy.cancel()

        runtime.before_decode = cancel_at
        decode.submit(busy)
        decode.submit(queued)
        assert busy_events.ended.wait(10)
        assert queued_events.ended.wait(10), "the cancelled queued job never ended"
    assert isinstance(queued_events.last, jobs.Finished)
    assert queued_events.last.reason is jobs.FinishReason.CANCELLED
    assert queued_events.last.completion_tokens == 0
    assert queued_events.events == [queued_events.last]


def test_jobs_still_queued_when_the_loop_stops_end_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Queued jobs end as the running ones do when the loop stops: CANCELLED, which
    the service answers with a retryable UNAVAILABLE (not an internal error)."""
    started, stopping = threading.Event(), threading.Event()

    def hold(step: int) -> None:
        if step == 2:
            started.set()
            assert stopping.wait(10)

    with running(monkeypatch, slots=1) as (decode, runtime):
        runtime.before_decode = hold
        busy, busy_events = job([1, 2, 3], max_tokens=200, name="busy")
        queued, queued_events = job([4, 5, 6], max_tokens=4, name="queued")
        decode.submit(busy)
        decode.submit(queued)
        assert started.wait(10)
        decode.stop()
        stopping.set()
    for events in (busy_events, queued_events):
        assert events.ended.is_set()
        assert isinstance(events.last, jobs.Finished), events.last
        assert events.last.reason is jobs.FinishReason.CANCELLED
    assert queued_events.events == [queued_events.last]


POISON = 20


def poisoned(tokens: Sequence[int]) -> int:
    """`cycle`, except that sampling fails for a sequence whose prompt starts with POISON
    (as a request's sampler can: a grammar its logit bias leaves no token for)."""
    if tokens[0] == POISON:
        raise RuntimeError("this request's sampler failed")
    return cycle(tokens)


def test_a_failing_sampler_fails_only_its_own_request(monkeypatch: pytest.MonkeyPatch) -> None:
    with running(monkeypatch, slots=2, model=poisoned) as (decode, runtime):
        healthy, healthy_events = job([1, 2, 3], max_tokens=6, name="healthy")
        bad, bad_events = job([POISON, 2, 3], max_tokens=6, name="bad")
        decode.submit(healthy)
        decode.submit(bad)
        assert healthy_events.ended.wait(10) and bad_events.ended.wait(10)
        assert isinstance(bad_events.last, jobs.Failed)
        assert "sampler failed" in bad_events.last.message
        assert isinstance(healthy_events.last, jobs.Finished), healthy_events.last
        assert healthy_events.last.reason is jobs.FinishReason.LENGTH
        text = "".join(e.text for e in healthy_events.events if isinstance(e, jobs.TextDelta))
        assert text == "w4 w5 w6 w7 w8 w9 "
        # The failed request's slot is free and empty; the loop goes on.
        after, after_events = job([5, 6], max_tokens=2, name="after")
        decode.submit(after)
        assert after_events.ended.wait(10)
        assert isinstance(after_events.last, jobs.Finished)
        for slot in decode.slots:
            assert runtime.kv[slot.index] == slot.tokens


class FailingDrafter:
    """Proposes the fake model's own continuation (every draft is accepted) until
    `fail_at`-th call, which raises, as a draft model's failed decode would."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls = 0

    def propose(self, requests: Sequence[speculation.DraftRequest]) -> dict[int, tuple[int, ...]]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the draft model's decode failed")
        out = {}
        for r in requests:
            tokens = list(r.tokens)
            for _ in range(r.max_tokens):
                tokens.append(cycle(tokens))
            out[r.seq] = tuple(tokens[len(r.tokens) :])
        return out

    def release(self, seq: int) -> None:
        pass


def test_a_failing_drafter_turns_speculation_off_and_requests_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    drafter = FailingDrafter(fail_at=3)
    with running(monkeypatch, slots=2, drafter=drafter) as (decode, _runtime):
        first, first_events = job([1, 2, 3], max_tokens=24, name="first")
        decode.submit(first)
        assert first_events.ended.wait(10)
        # Health tells: the kind, the counts up to the failure, and why it stopped.
        stats = decode.speculation_stats
        assert (stats.kind, stats.drafted) == ("fake", first_events.last.drafted_tokens)
        assert stats.failure == "the fake drafter failed: the draft model's decode failed"
        second, second_events = job([5, 6], max_tokens=6, name="second")
        decode.submit(second)
        assert second_events.ended.wait(10)
    assert drafter.calls == 3
    # It drafted before the drafter failed: its final says so (Routing.speculation).
    assert isinstance(first_events.last, jobs.Finished)
    assert first_events.last.drafted_tokens > 0
    assert first_events.last.speculation == "fake"
    for events, expected in ((first_events, 24), (second_events, 6)):
        assert isinstance(events.last, jobs.Finished), events.last
        assert events.last.reason is jobs.FinishReason.LENGTH
        assert events.last.completion_tokens == expected
    text = "".join(e.text for e in first_events.events if isinstance(e, jobs.TextDelta))
    expected = [3]
    while len(expected) <= 24:
        expected.append(cycle(expected))
    assert text.split() == [f"w{t}" for t in expected[1:]]


def contradictory(tokens: Sequence[int]) -> int:
    """`cycle`, except that a request whose prompt starts with POISON turns out to ask
    the impossible (as a grammar its logit bias leaves no token for does)."""
    if tokens[0] == POISON:
        raise errors.InvalidRequest("no token is left", metadata={errors.FIELD_KEY: "x"})
    return cycle(tokens)


def test_a_request_found_impossible_while_sampling_fails_as_invalid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with running(monkeypatch, slots=1, model=contradictory) as (decode, _runtime):
        bad, bad_events = job([POISON, 2, 3], max_tokens=6, name="bad")
        decode.submit(bad)
        assert bad_events.ended.wait(10)
    assert bad_events.last == jobs.Failed(
        "no token is left", invalid_request=True, metadata=((errors.FIELD_KEY, "x"),)
    )


def test_text_deltas_join_in_order() -> None:
    a = jobs.TextDelta("Hel", 1, (logprobs.TokenLogprob(1, -0.5),))
    b = jobs.TextDelta("lo", 2, ())
    joined = jobs.TextDelta.joined(a, b)
    assert (joined.text, joined.tokens, joined.logprobs) == ("Hello", 3, a.logprobs)


def test_a_finished_request_reports_the_batch_it_decoded_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alone it decodes one sequence a step; beside another for every step, two."""
    with running(monkeypatch, slots=2) as (decode, _runtime):
        alone, alone_events = job([1, 2, 3], max_tokens=6, name="alone")
        decode.submit(alone)
        assert alone_events.ended.wait(10)
        finished = alone_events.last
        assert isinstance(finished, jobs.Finished)
        assert finished.decode_batch == pytest.approx(1.0)
        assert finished.prefill_batch == 1.0  # its prompt's step held it alone

        pair = [job([4, 5, 6], max_tokens=6, name=f"pair{i}") for i in range(2)]
        for j, _ in pair:
            decode.submit(j)
        for _, events in pair:
            assert events.ended.wait(10)
        batches = [e.last.decode_batch for _, e in pair if isinstance(e.last, jobs.Finished)]
        assert len(batches) == 2
        # Both prompts may not start in the same step; each decoded beside the other
        # for most of its steps.
        assert all(1.0 < b <= 2.0 for b in batches)


def test_a_prompt_prefilled_beside_a_decoding_stream_reports_that_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt that comes while another request decodes is prefilled in a step that
    also decodes that request's row: two sequences, where alone it had one."""
    with running(monkeypatch, slots=2) as (decode, runtime):
        busy, busy_events = job([1, 2, 3], max_tokens=40, name="busy")
        late, late_events = job([4, 5, 6], max_tokens=4, name="late")

        def submit_at(step: int) -> None:
            if step == 3:
                decode.submit(late)

        runtime.before_decode = submit_at
        decode.submit(busy)
        assert late_events.ended.wait(10)
        assert busy_events.ended.wait(10)
        finished, first = late_events.last, busy_events.last
        assert isinstance(finished, jobs.Finished) and isinstance(first, jobs.Finished)
        assert finished.prefill_batch == 2.0
        assert first.prefill_batch == 1.0


def test_a_pass_that_does_not_end_shows_in_its_step_age(monkeypatch: pytest.MonkeyPatch) -> None:
    """Health reads the age of the decode thread's current pass: a decode wedged inside
    llama.cpp still answers Health, and this is what gives it away."""
    with running(monkeypatch, slots=1) as (decode, runtime):
        assert decode.step_age_s == 0.0  # waiting for work
        release = threading.Event()
        stuck = threading.Event()

        def wedge(step: int) -> None:
            if step == 2:
                stuck.set()
                release.wait(10)

        runtime.before_decode = wedge
        j, events = job([1, 2, 3], max_tokens=4)
        decode.submit(j)
        assert stuck.wait(10)
        time.sleep(0.3)
        assert decode.step_age_s >= 0.3
        release.set()
        assert events.ended.wait(10)
        deadline = time.monotonic() + 5
        while decode.step_age_s != 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.step_age_s == 0.0


def test_a_prompt_that_waits_behind_another_reports_the_wait_apart_from_its_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts are prefilled one after another: a prompt that starts while another's
    chunks fill the step waits for them. Its prefill_ms counts from the first step that
    carries its own prompt, and the wait before it is prefill_wait_ms. On a clock that
    moves one second per decode step: "long" (two full chunks) starts alone; "short"
    (100 tokens: not short enough to go first, `api.prefill`) starts during its first
    step, gets no room in its second, and goes in the third."""
    clock = [100.0]  # perf_counter: 0.0 means "not yet" to a generation
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    short: list[Events] = []
    with running(monkeypatch, slots=2, context=4 * llama.N_BATCH) as (decode, runtime):

        def step(number: int) -> None:
            clock[0] += 1.0
            if number == 1:
                j, events = job([3] * 100, max_tokens=2, name="short")
                short.append(events)
                decode.submit(j)

        runtime.before_decode = step
        long, long_events = job([1] * (2 * llama.N_BATCH), max_tokens=3, name="long")
        decode.submit(long)
        assert long_events.ended.wait(10)
        assert short and short[0].ended.wait(10)
    first, second = long_events.last, short[0].last
    assert isinstance(first, jobs.Finished) and isinstance(second, jobs.Finished)
    # started at 100, steps 1 and 2 (from 100 and 101) carry its prompt, first token
    # at 102
    assert (first.prefill_wait_ms, first.prefill_ms) == (0.0, 2000.0)
    # started at 101 (after step 1), step 3 (from 102) carries its prompt, first token
    # at 103
    assert (second.prefill_wait_ms, second.prefill_ms) == (1000.0, 1000.0)
    assert second.ttft_ms == 2000.0


def long_then_short(
    decode: loop.DecodeLoop,
    runtime: FakeRuntime,
    *,
    busy_tokens: int,
    steps: tuple[int, int],
    tokens: int,
    tpot_target_s: float | None = None,
) -> tuple[dict[str, Events], list[str]]:
    """A stream "busy" decoding, then at `steps` a 600-token prompt "long" and a 3-token
    one "short" (each generating `tokens`): their events once all have ended, and
    their names in the order they ended (the last after the last step)."""
    busy, busy_events = job([1, 2, 3], max_tokens=busy_tokens, name="busy")
    busy.tpot_target_s = tpot_target_s
    long, long_events = job([4 + k % 6 for k in range(600)], max_tokens=tokens, name="long")
    short, short_events = job([5, 6, 7], max_tokens=tokens, name="short")
    events = {"busy": busy_events, "long": long_events, "short": short_events}
    ended: list[str] = []

    def submit_at(step: int) -> None:
        if step == steps[0]:
            decode.submit(long)
        if step == steps[1]:
            decode.submit(short)
        ended.extend(n for n, e in events.items() if e.ended.is_set() and n not in ended)

    runtime.before_decode = submit_at
    decode.submit(busy)
    for e in events.values():
        assert e.ended.wait(10)
    return events, ended


def priced(runtime: FakeRuntime) -> None:
    """Decodes take time as llama.cpp's do here: 4 ms a logits row, 0.1 ms a token."""
    fake_decode = runtime.decode

    def slow_decode(entries: Sequence[Entry]) -> None:
        rows = sum(e[3] for e in entries)
        time.sleep(0.004 * rows + 0.0001 * len(entries))
        fake_decode(entries)

    runtime.decode = slow_decode  # type: ignore[method-assign]


@pytest.mark.parametrize(("prompt", "yields"), [(3, True), (400, False)])
def test_drafts_that_leave_a_short_waiting_prompt_no_room_yield_to_it(
    monkeypatch: pytest.MonkeyPatch, prompt: int, yields: bool
) -> None:
    """A stream with a 20 ms time-per-token target drafts 4 tokens a step, all
    accepted, and each logits row costs 4 ms: its steps take the whole target. A short
    prompt that arrives meanwhile is not held back until the stream ends (the pacer
    leaves it no room beside the drafts): the drafts yield, the step decodes the
    stream's one token beside the whole prompt, and the prompt's request is done while
    the stream still runs. A long one (400 tokens, past what `assembly.YIELD_STEPS` steps
    without drafts take) waits for steps whose drafts leave it room: here, the
    stream's end."""
    drafter = FailingDrafter(fail_at=0)
    with running(monkeypatch, slots=2, context=512, drafter=drafter) as (decode, runtime):
        busy, busy_events = job([1, 2, 3], max_tokens=120, name="busy")
        busy.tpot_target_s = 0.020
        late, late_events = job([4 + k % 6 for k in range(prompt)], max_tokens=4, name="late")

        def submit_at(step: int) -> None:
            if step == 6:
                decode.submit(late)

        priced(runtime)
        runtime.before_decode = submit_at
        decode.submit(busy)
        assert late_events.ended.wait(10)
        assert busy_events.ended.is_set() is not yields
        assert busy_events.ended.wait(10)
    finished = busy_events.last
    assert isinstance(finished, jobs.Finished) and isinstance(late_events.last, jobs.Finished)
    # The stream drafted before and after the steps it gave up.
    assert finished.completion_tokens == 120 and finished.drafted_tokens > 60


def test_drafts_yield_to_the_short_prompt_not_to_a_long_one_waiting_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Drafts give way to a short prompt only: a long one (600 tokens) that waits
    beside it, and came first, does not take the room they give up. It took it, being
    the older: the drafts then gave way for every chunk of the long prompt, so the
    stream decoded a token a step for its whole prefill, and the short prompt came in
    last. The short prompt's request ends while the stream runs; the long one still
    waits for the stream's end, as it does alone."""
    drafter = FailingDrafter(fail_at=0)
    with running(monkeypatch, slots=3, context=1024, drafter=drafter) as (decode, runtime):
        priced(runtime)
        events, ended = long_then_short(
            decode, runtime, busy_tokens=120, tpot_target_s=0.020, steps=(6, 8), tokens=4
        )
    assert ended[:2] == ["short", "busy"]
    finished = events["busy"].last
    assert isinstance(finished, jobs.Finished)
    assert finished.completion_tokens == 120 and finished.drafted_tokens > 60


def test_a_short_prompt_is_prefilled_before_an_older_long_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beside a decoding stream a step takes at most `loop.PREFILL_BESIDE_DECODE`
    prompt tokens: a 600-token prompt needs five such steps. A 3-token prompt that
    comes after it does not wait for all five (`api.prefill`): its request is done
    before the long prompt's first token."""
    with running(monkeypatch, slots=3, context=1024) as (decode, runtime):
        events, ended = long_then_short(decode, runtime, busy_tokens=60, steps=(3, 5), tokens=2)
    assert ended[0] == "short"
    assert all(isinstance(e.last, jobs.Finished) for e in events.values())


def test_a_generation_moves_to_gather_the_busy_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four generations on slots 0-3, and the one on slot 1 ends early: the others
    would decode on 0, 2 and 3, two forward passes a step, until they end. One moves,
    cache and all, into slot 1 (`batching.compaction`), and every text is what it would
    have been where it was."""
    with running(monkeypatch, slots=4) as (decode, runtime):
        steps: list[list[int]] = []
        decode_entries = runtime.decode

        def record(entries: Sequence[Entry]) -> None:
            entries = list(entries)
            steps.append(sorted({seq for _, _, seq, _ in entries}))
            decode_entries(entries)

        runtime.decode = record  # type: ignore[method-assign]
        started = [
            job([10 * i + 1], max_tokens=4 if i == 1 else 40, name=f"r{i}") for i in range(4)
        ]
        for submitted, _ in started:
            decode.submit(submitted)
        for _, events in started:
            assert events.ended.wait(10)
    for i, (_, events) in enumerate(started):
        finished = events.last
        assert isinstance(finished, jobs.Finished), finished
        text = "".join(e.text for e in events.events if isinstance(e, jobs.TextDelta))
        expected = [(10 * i + 1 + k) % 10 + 1 for k in range(finished.completion_tokens)]
        assert text == "".join(f"w{t} " for t in expected)
        assert finished.completion_tokens == (4 if i == 1 else 40)
    # Once slot 1 was free, the three went on as one run of slots: one pass a step.
    assert [1, 2, 3] in steps or [0, 1, 2] in steps
    assert steps.count([0, 2, 3]) <= 1


@pytest.mark.parametrize("close_fails", [False, True], ids=["closed", "close-failed-too"])
def test_a_pass_that_fails_outside_its_step_ends_the_work_and_says_so(
    monkeypatch: pytest.MonkeyPatch, close_fails: bool
) -> None:
    """A pass raises before its step (here reading a free slot for a waiting job): the
    thread ends, so the job it held is ended (CANCELLED, a retryable error for its
    caller) and `on_failed` hears of it, for the worker to exit and be restarted; before,
    the thread died quietly and every later request waited on it for ever. So it does
    when freeing the runtime after it fails as well (the same broken state), or the
    thread would die in `_close` and the worker keep taking work nothing decodes."""
    launch_spec = launches.spec(slots=1, context_per_slot=256, threads=1)
    runtime = FakeRuntime(launch_spec, cycle)
    monkeypatch.setattr(llama.Runtime, "load", lambda _spec: runtime)

    def broken(seq: int) -> int:
        raise RuntimeError("pos_min failed")

    def close_broken() -> None:
        raise RuntimeError("close failed")

    monkeypatch.setattr(runtime, "pos_min", broken)
    if close_fails:
        monkeypatch.setattr(runtime, "close", close_broken)
        # The thread's own exception (from close) is expected: not reported as a leak.
        monkeypatch.setattr(threading, "excepthook", lambda _args: None)
    failed: list[BaseException] = []
    told = threading.Event()

    def on_failed(exc: BaseException) -> None:
        failed.append(exc)
        told.set()

    decode = loop.DecodeLoop(
        launches.engine(launch_spec), on_loaded=lambda _error: None, on_failed=on_failed
    )
    decode.start()
    try:
        first, first_events = job([1, 2, 3], max_tokens=5, name="first")
        decode.submit(first)
        assert told.wait(10), "the loop's failure was never reported"
        assert first_events.ended.wait(10)
    finally:
        decode.stop()
        assert decode.join(10)
    assert [str(e) for e in failed] == ["pos_min failed"]
    finished = first_events.last
    assert isinstance(finished, jobs.Finished)
    assert finished.reason is jobs.FinishReason.CANCELLED


def test_the_pacer_measures_the_pass_between_decodes_not_the_wait_for_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between two decodes of a stream, the loop reads the rows back, sends and
    assembles: the pacer learns that time (`pacing.PrefillPacer.between`), here a
    send that takes 10 ms. A loop that waited for work (0.5 s) does not count the wait
    as a pass."""
    real_after = loop.emission.after

    def slow_after(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.01)
        return real_after(*args, **kwargs)

    monkeypatch.setattr(loop.emission, "after", slow_after)
    with running(monkeypatch, slots=1) as (decode, _runtime):
        first, first_events = job([1, 2, 3], max_tokens=8, name="first")
        decode.submit(first)
        assert first_events.ended.wait(10)
        time.sleep(0.5)
        second, second_events = job([4, 5, 6], max_tokens=8, name="second")
        decode.submit(second)
        assert second_events.ended.wait(10)
        between = decode._pacer._between_s
    assert 0.01 <= between < 0.1
