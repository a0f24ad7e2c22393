"""Preemption in the decode loop (`parking`), against the fake runtime of
test_engine_loop: a "model" whose next token follows from the last one, and a KV cache
that refuses any decode whose position does not follow what the sequence holds. A lost
or repeated token shows in the text, a wrong cache in the KV assertion."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from blazar.api import errors
from blazar.engine import generation, jobs, loop, parking, sampling, speculation
from tests.unit.test_engine_loop import Events, FakeRuntime, cycle, job, running


class Reply:
    """An order's reply callback: the outcome, once the decode thread answered."""

    def __init__(self) -> None:
        self.outcome: Any = None
        self.done = threading.Event()

    def __call__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.done.set()

    def wait(self) -> Any:
        assert self.done.wait(10), "the order was never answered"
        return self.outcome


def text(events: Events) -> str:
    return "".join(e.text for e in events.events if isinstance(e, jobs.TextDelta))


def counted(first: int, n: int) -> str:
    """The fake model's text for n tokens after a sequence ending in `first` - 1."""
    return "".join(f"w{(first - 1 + i) % 10 + 1} " for i in range(n))


def park(decode: loop.DecodeLoop, request_id: str) -> Reply:
    reply = Reply()
    decode.order(parking.Park(request_id, reply))
    return reply


def resume(decode: loop.DecodeLoop, request_id: str) -> Reply:
    reply = Reply()
    decode.order(parking.Resume(request_id, reply))
    return reply


def park_at(decode: loop.DecodeLoop, runtime: FakeRuntime, request_id: str, step: int) -> Reply:
    """Order a park from inside decode step `step` (it happens after that step)."""
    reply = Reply()

    def order(n: int) -> None:
        if n == step:
            decode.order(parking.Park(request_id, reply))

    runtime.before_decode = order
    return reply


def park_serve_resume(
    decode: loop.DecodeLoop,
    runtime: FakeRuntime,
    *,
    max_tokens: int,
    step: int,
    parked: Callable[[], None] = lambda: None,
) -> Events:
    """The long request (prompt [1, 2, 3]) parked after decode step `step` (then
    `parked()`), an urgent one served to its end in the slot it left, then the long one
    resumed and run to its end; the long one's events."""
    long, long_events = job([1, 2, 3], max_tokens=max_tokens, name="long")
    reply = park_at(decode, runtime, "long", step=step)
    decode.submit(long)
    assert isinstance(reply.wait(), parking.ParkResult)
    parked()
    urgent, urgent_events = job([5, 6], max_tokens=4, name="urgent")
    decode.submit(urgent)
    assert urgent_events.ended.wait(10)
    assert isinstance(resume(decode, "long").wait(), parking.ResumeResult)
    assert long_events.ended.wait(10)
    return long_events


@pytest.mark.parametrize("max_parked_mib", [64, 0], ids=["kv-restored", "prefilled-again"])
def test_a_parked_generation_goes_on_where_it_stopped(
    monkeypatch: pytest.MonkeyPatch, max_parked_mib: int
) -> None:
    """One slot: the long request is parked mid-stream, a short one runs in the slot it
    left (and leaves its own tokens in that cache), then the long one resumes there:
    the same tokens as without the pause, its cache exactly its own tokens again, and
    nothing left parked. Past the bound (0 MiB) it is prefilled again instead."""
    with running(monkeypatch, slots=1, max_parked_mib=max_parked_mib) as (decode, runtime):
        long, long_events = job([1, 2, 3], max_tokens=30, name="long")
        parked = park_at(decode, runtime, "long", step=6)
        decode.submit(long)
        result = parked.wait()
        assert isinstance(result, parking.ParkResult), result
        assert not long_events.ended.is_set()
        # Prompt and 5 decoded tokens in the cache; the 7th token sampled, pending.
        assert (result.slot, result.tokens) == (0, 8)
        assert decode.parked == 1 and not decode.slots[0].busy
        if max_parked_mib:
            assert result.parked_bytes == decode.parked_bytes > 0
        else:
            assert result.parked_bytes == decode.parked_bytes == 0
        told = text(long_events)

        urgent, urgent_events = job([5, 6], max_tokens=4, name="urgent")
        decode.submit(urgent)
        assert urgent_events.ended.wait(10)
        assert text(urgent_events) == counted(7, 4)
        assert text(long_events) == told, "a parked stream must not move"

        resumed = resume(decode, "long").wait()
        assert isinstance(resumed, parking.ResumeResult), resumed
        assert resumed.slot == 0 and resumed.parked_ms > 0
        if max_parked_mib:
            assert (resumed.restored_bytes, resumed.refill_tokens) == (result.parked_bytes, 0)
        else:
            # The urgent request's cache shares nothing with it: all 8 again.
            assert (resumed.restored_bytes, resumed.refill_tokens) == (0, 8)
        assert long_events.ended.wait(10)
    finished = long_events.last
    assert isinstance(finished, jobs.Finished)
    assert finished.reason is jobs.FinishReason.LENGTH
    assert finished.completion_tokens == 30
    assert text(long_events) == counted(4, 30)
    assert finished.parked_ms >= resumed.parked_ms > 0
    # All but the last token (sampled, never decoded) follow the prompt in the cache.
    assert runtime.kv[0] == [1, 2, 3] + [(3 + i) % 10 + 1 for i in range(29)]
    assert decode.parked == 0 and decode.parked_bytes == 0


@pytest.mark.parametrize("max_parked_mib", [64, 0], ids=["kv-restored", "prefilled-again"])
def test_a_generation_parked_during_its_prompt_finishes_it(
    monkeypatch: pytest.MonkeyPatch, max_parked_mib: int
) -> None:
    """A 1,200-token prompt takes three steps of 512; parked after the first, it goes
    on with its prompt when resumed (from its restored cache, or prefilling again
    whatever the slot no longer holds), and writes what it would have."""
    prompt = [(i % 9) + 1 for i in range(1200)]
    with running(monkeypatch, slots=1, context=2048, max_parked_mib=max_parked_mib) as (
        decode,
        runtime,
    ):
        long, long_events = job(prompt, max_tokens=5, name="long")
        parked = park_at(decode, runtime, "long", step=1)
        decode.submit(long)
        result = parked.wait()
        assert isinstance(result, parking.ParkResult) and result.tokens == 512
        resumed = resume(decode, "long").wait()
        assert isinstance(resumed, parking.ResumeResult)
        # Nothing to prefill again: restored, or still in the slot, which keeps them.
        assert resumed.refill_tokens == 0
        assert (resumed.restored_bytes > 0) is (max_parked_mib > 0)
        assert long_events.ended.wait(10)
    assert text(long_events) == counted(prompt[-1] + 1, 5)
    assert runtime.kv[0] == prompt + [(prompt[-1] + i) % 10 + 1 for i in range(4)]


def test_cancelling_a_parked_generation_frees_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    with running(monkeypatch, slots=1) as (decode, runtime):
        long, long_events = job([1, 2, 3], max_tokens=100, name="long")
        parked = park_at(decode, runtime, "long", step=3)
        decode.submit(long)
        assert parked.wait().parked_bytes > 0
        # Nothing runs: the loop sleeps until the cancel wakes it.
        decode.cancel(long)
        assert long_events.ended.wait(10)
        assert decode.parked == 0 and decode.parked_bytes == 0
        assert isinstance(resume(decode, "long").wait(), errors.RequestNotFound)
    finished = long_events.last
    assert isinstance(finished, jobs.Finished)
    assert finished.reason is jobs.FinishReason.CANCELLED
    assert (finished.slot, finished.completion_tokens) == (-1, 3)


def test_orders_the_request_state_does_not_allow_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with running(monkeypatch, slots=1, context=8192) as (decode, runtime):
        busy, busy_events = job([1, 2, 3], max_tokens=8000, name="busy")
        parked = park_at(decode, runtime, "busy", step=3)
        decode.submit(busy)
        assert isinstance(parked.wait(), parking.ParkResult)
        # Steps of 1 ms: busy runs for seconds once resumed.
        runtime.before_decode = lambda _step: time.sleep(0.001)

        def state(outcome: Any) -> str:
            assert isinstance(outcome, errors.RequestStateConflict), outcome
            return outcome.metadata["state"]

        assert isinstance(park(decode, "nobody").wait(), errors.RequestNotFound)
        assert isinstance(resume(decode, "nobody").wait(), errors.RequestNotFound)
        assert state(park(decode, "busy").wait()) == "parked"
        resumed = resume(decode, "busy")
        assert isinstance(resumed.wait(), parking.ResumeResult)
        assert state(resume(decode, "busy").wait()) == "running"
        busy.cancel()
        assert busy_events.ended.wait(10)


def test_a_waiting_job_cannot_be_parked(monkeypatch: pytest.MonkeyPatch) -> None:
    with running(monkeypatch, slots=1) as (decode, runtime):
        busy, busy_events = job([1, 2, 3], max_tokens=100, name="busy")
        waiting, waiting_events = job([4, 5], max_tokens=3, name="waiting")
        refused = Reply()

        def order(n: int) -> None:
            if n == 3:
                decode.order(parking.Park("waiting", refused))

        runtime.before_decode = order
        decode.submit(busy)
        decode.submit(waiting)
        outcome = refused.wait()
        assert isinstance(outcome, errors.RequestStateConflict)
        assert outcome.metadata["state"] == "waiting"
        busy.cancel()
        assert busy_events.ended.wait(10) and waiting_events.ended.wait(10)


def parked_behind_a_holder(decode: Any, runtime: Any, then: str) -> tuple[Any, ...]:
    """In one slot: `first` (20 tokens) parked at its second step, then a long `holder`
    and a 3-token job named `then` waiting for the slot. Their job and events."""
    first, first_events = job([1, 2, 3], max_tokens=20, name="first")
    parked = park_at(decode, runtime, "first", step=2)
    decode.submit(first)
    assert isinstance(parked.wait(), parking.ParkResult)
    holder, holder_events = job([7], max_tokens=200, name="holder")
    other, other_events = job([4, 5], max_tokens=3, name=then)
    decode.submit(holder)
    decode.submit(other)
    return holder, holder_events, first_events, other_events


def test_a_resume_goes_before_waiting_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The data plane resumes a parked generation when a slot frees; jobs that waited
    in the engine meanwhile come after it."""
    with running(monkeypatch, slots=1) as (decode, runtime):
        holder, holder_events, first_events, later_events = parked_behind_a_holder(
            decode, runtime, "later"
        )
        resumed = resume(decode, "first")
        decode.cancel(holder)
        assert resumed.wait().slot == 0
        assert first_events.ended.wait(10) and later_events.ended.wait(10)
        assert holder_events.ended.is_set()
    assert text(first_events) == counted(4, 20)
    # One slot, and `later` ran in it last: after `first` (had it gone first, `first`'s
    # restored cache would be what the slot holds now).
    assert runtime.kv[0][:2] == [4, 5]


def test_a_drain_resumes_what_is_parked(monkeypatch: pytest.MonkeyPatch) -> None:
    with running(monkeypatch, slots=1) as (decode, runtime):
        long, long_events = job([1, 2, 3], max_tokens=12, name="long")
        parked = park_at(decode, runtime, "long", step=4)
        decode.submit(long)
        assert isinstance(parked.wait(), parking.ParkResult)
        decode.order(parking.ResumeAll())
        assert long_events.ended.wait(10)
        assert decode.parked == 0
    assert text(long_events) == counted(4, 12)


def test_a_drain_resumes_parked_work_after_the_jobs_waiting_for_a_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The data plane parks a generation to start urgent work in its slot; a drain that
    comes while that work still waits in the engine resumes the parked one after it, not
    in the slot the park freed for it (the urgent work would wait for the very
    generation parked for it, and be cut off at the drain's grace)."""
    with running(monkeypatch, slots=1) as (decode, runtime):
        holder, holder_events, first_events, urgent_events = parked_behind_a_holder(
            decode, runtime, "urgent"
        )
        decode.order(parking.ResumeAll())
        decode.cancel(holder)
        assert first_events.ended.wait(10) and urgent_events.ended.wait(10)
        assert holder_events.ended.is_set()
    assert text(first_events) == counted(4, 20)
    # One slot, and `first` ran in it last: after `urgent`.
    assert runtime.kv[0][:3] == [1, 2, 3]


def test_stopping_ends_parked_generations_and_answers_their_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started = threading.Event()
    hold = threading.Event()
    with running(monkeypatch, slots=1) as (decode, runtime):
        long, long_events = job([1, 2, 3], max_tokens=200, name="long")
        other, other_events = job([4], max_tokens=200, name="other")
        parked = park_at(decode, runtime, "long", step=2)
        decode.submit(long)
        assert isinstance(parked.wait(), parking.ParkResult)

        def block(n: int) -> None:
            started.set()
            assert hold.wait(10)

        runtime.before_decode = block
        decode.submit(other)
        assert started.wait(10)
        # Waits for the slot `other` holds, until the loop stops.
        waiting_resume = resume(decode, "long")
        decode.stop()
        hold.set()
    assert isinstance(waiting_resume.wait(), errors.Unavailable)
    for events in (long_events, other_events):
        assert isinstance(events.last, jobs.Finished)
        assert events.last.reason is jobs.FinishReason.CANCELLED
    assert decode.parked == 0 and decode.parked_bytes == 0


def test_time_parked_is_counted_apart_from_prefill_and_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """parked_ms is the time out of a slot; prefill_ms and decode_ms leave it out,
    ttft_ms does not (the caller waited)."""
    now = [100.0]
    monkeypatch.setattr(generation.time, "perf_counter", lambda: now[0])
    events = Events()
    task = jobs.Job(
        request_id="r",
        prompt=[1, 2],
        params=sampling.SamplingParams(temperature=0.0),
        max_tokens=10,
        deliver=events,
        arrived=99.0,
    )
    gen = generation.Generation(job=task, sampler=None, started=100.0)
    now[0] = 101.0
    gen.pause()  # parked during the prompt for 2 s
    now[0] = 103.0
    gen.unpause()
    gen.prefilled, gen.prefill_done, gen.first_token = 2, 104.0, 104.0
    now[0] = 105.0
    gen.pause()  # and while decoding for 4 s
    now[0] = 109.0
    assert gen.unpause() == 4.0
    gen.last_token = 110.0
    gen.completion = 3
    (finished,) = gen.conclusion(jobs.FinishReason.LENGTH, slot=0)
    assert isinstance(finished, jobs.Finished)
    assert finished.parked_ms == 6000.0
    assert finished.prefill_ms == 2000.0  # 4 s from start to prefilled, 2 of them parked
    assert finished.decode_ms == 2000.0  # 6 s from first to last token, 4 parked
    assert finished.ttft_ms == 5000.0


def test_time_parked_before_and_after_its_prompts_first_step_leaves_both_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parked while it waited behind other prompts, then while its own prompt was
    prefilled: prefill_wait_ms and prefill_ms each leave out their part."""
    now = [100.0]
    monkeypatch.setattr(generation.time, "perf_counter", lambda: now[0])
    task = jobs.Job(
        request_id="r",
        prompt=[1, 2],
        params=sampling.SamplingParams(temperature=0.0),
        max_tokens=10,
        deliver=Events(),
        arrived=99.0,
    )
    gen = generation.Generation(job=task, sampler=None, started=100.0)
    now[0] = 101.0
    gen.pause()  # parked for 1 s while it waited
    now[0] = 102.0
    gen.unpause()
    gen.prompt_step(103.0, sequences=1)  # its prompt's first step: 3 s after its start, 1 parked
    gen.prompt_step(104.0, sequences=3)  # later chunks move neither start nor wait
    now[0] = 105.0
    gen.pause()  # parked for 2 s during its prefill
    now[0] = 107.0
    gen.unpause()
    gen.prefilled, gen.prefill_done, gen.first_token = 2, 110.0, 110.0
    gen.last_token, gen.completion = 110.0, 1
    (finished,) = gen.conclusion(jobs.FinishReason.LENGTH, slot=0)
    assert isinstance(finished, jobs.Finished)
    assert finished.prefill_wait_ms == 3000.0 - 1000.0
    assert finished.prefill_ms == 7000.0 - 2000.0  # 103 to 110, 2 s parked
    assert finished.parked_ms == 3000.0
    assert finished.ttft_ms == 11000.0
    # Its two prompt steps held 1 and 3 sequences.
    assert finished.prefill_batch == 2.0


class ChainDrafter:
    """Drafts the fake model's own continuation (always accepted), and checks that it
    is asked only about whole sequences: a prompt ([1, 2, 3] or [5, 6]) and what
    followed it. A
    generation still prefilling its tokens again after a resume must not draft (its
    slot does not hold them yet); a failed check turns speculation off for good,
    which the test sees in the loop's stats."""

    def propose(self, requests: Sequence[speculation.DraftRequest]) -> dict[int, tuple[int, ...]]:
        out = {}
        for r in requests:
            tokens = list(r.tokens)
            prompt = 3 if tokens[:3] == [1, 2, 3] else 2
            assert tokens[:prompt] in ([1, 2, 3], [5, 6]), tokens
            assert all(cycle(tokens[:i]) == tokens[i] for i in range(prompt, len(tokens)))
            for _ in range(r.max_tokens):
                tokens.append(cycle(tokens))
            out[r.seq] = tuple(tokens[len(r.tokens) :])
        return out

    def release(self, seq: int) -> None:
        pass


@pytest.mark.parametrize("max_parked_mib", [64, 0], ids=["kv-restored", "prefilled-again"])
def test_parking_a_speculating_generation(
    monkeypatch: pytest.MonkeyPatch, max_parked_mib: int
) -> None:
    with running(monkeypatch, slots=1, drafter=ChainDrafter(), max_parked_mib=max_parked_mib) as (
        decode,
        runtime,
    ):
        long_events = park_serve_resume(decode, runtime, max_tokens=40, step=3)
        assert decode.speculation_stats.failure == ""
    finished = long_events.last
    assert isinstance(finished, jobs.Finished) and finished.drafted_tokens > 0
    assert text(long_events) == counted(4, 40)
    assert runtime.kv[0] == [1, 2, 3] + [(3 + i) % 10 + 1 for i in range(39)]


class WrongDrafter:
    """Drafts tokens the fake model never emits (0 is no word of it), and records how
    many each request asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, requests: Sequence[speculation.DraftRequest]) -> dict[int, tuple[int, ...]]:
        self.asked += [r.max_tokens for r in requests]
        return {r.seq: (0,) * r.max_tokens for r in requests}

    def release(self, seq: int) -> None:
        pass


def test_a_parked_generation_keeps_its_drafting_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafting paused for its poor acceptance stays paused across a park and resume
    (it probes 3 tokens at most now and then, never 4 again), and the request counts once
    as one speculation was switched off for, when it ends."""
    drafter = WrongDrafter()
    with running(monkeypatch, slots=1, drafter=drafter, min_acceptance_rate=0.5) as (
        decode,
        runtime,
    ):
        # Asked for 4 a step (a step verifies 3 of them) until, with none held, its
        # warm-up ended and drafting paused; then nothing, or probes of 3.
        before: list[int] = []
        long_events = park_serve_resume(
            decode, runtime, max_tokens=60, step=12, parked=lambda: before.extend(drafter.asked)
        )
        stats = decode.speculation_stats
    full = before.count(4)
    assert 0 < full < 12 and before[:full] == [4] * full, before
    assert text(long_events) == counted(4, 60)
    # Probes only (fewer near its budget's end), as before the park.
    assert max(drafter.asked[full:], default=0) <= 3, (drafter.asked, before)
    assert stats.disabled_requests == 1


def test_prefilling_again_counts_as_parked_not_as_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the bound the tokens are prefilled again after the resume: that time is
    what the preemption cost, so it counts in parked_ms, and decode_ms (and the decode
    rate from it) stays a decode figure. The refill step is made to take 500 ms, each
    of the 22 decode steps after it 10 ms."""
    with running(monkeypatch, slots=1, max_parked_mib=0) as (decode, runtime):
        long, long_events = job([1, 2, 3], max_tokens=30, name="long")
        parked = park_at(decode, runtime, "long", step=6)
        decode.submit(long)
        assert isinstance(parked.wait(), parking.ParkResult)
        urgent, urgent_events = job([5, 6], max_tokens=4, name="urgent")
        decode.submit(urgent)
        assert urgent_events.ended.wait(10)
        refills: list[int] = []

        def slow_refill(step: int) -> None:
            time.sleep(0.01 if refills else 0.5)
            refills.append(step)

        runtime.before_decode = slow_refill
        resumed = resume(decode, "long").wait()
        assert isinstance(resumed, parking.ResumeResult) and resumed.refill_tokens == 8
        assert long_events.ended.wait(10)
    finished = long_events.last
    assert isinstance(finished, jobs.Finished)
    # Either way round, the other figure would take 500 ms or 220 ms more.
    assert 500.0 <= finished.parked_ms < 700.0
    assert 220.0 <= finished.decode_ms < 450.0
    assert text(long_events) == counted(4, 30)


def test_a_resume_that_fails_before_it_restores_leaves_nothing_parked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Clearing the free slot for a resume fails (before the bank gave the generation
    back): the request is told once that it failed, the Resume is answered with the
    error, and nothing stays parked to be resumed again by the next pass (its sampler
    already freed, its caller already told)."""
    with running(monkeypatch, slots=1) as (decode, runtime):
        long, long_events = job([1, 2, 3], max_tokens=100, name="long")
        parked = park_at(decode, runtime, "long", step=3)
        decode.submit(long)
        assert parked.wait().parked_bytes > 0
        # The slot the long one left now holds another request's cache, which the
        # resume clears (a saved state replaces the whole sequence).
        urgent, urgent_events = job([5, 6], max_tokens=4, name="urgent")
        decode.submit(urgent)
        assert urgent_events.ended.wait(10)
        clear = runtime.clear
        failures = iter([RuntimeError("clear failed")])

        def failing_clear(seq: int) -> None:
            if (exc := next(failures, None)) is not None:
                raise exc
            clear(seq)

        monkeypatch.setattr(runtime, "clear", failing_clear)
        answer = resume(decode, "long").wait()
        assert isinstance(answer, errors.BlazarError) and "clear failed" in answer.message
        assert long_events.ended.wait(10)
        after, after_events = job([7, 8], max_tokens=3, name="after")
        decode.submit(after)
        assert after_events.ended.wait(10)
        assert decode.parked == 0 and decode.parked_bytes == 0
    assert [type(e) for e in long_events.events if not isinstance(e, jobs.TextDelta)] == [
        jobs.Failed
    ]
    assert isinstance(long_events.last, jobs.Failed)
    assert text(after_events) == counted(9, 3)


@pytest.mark.parametrize("order", ["park", "resume"])
def test_a_park_or_resume_is_no_pass_between_decodes_for_the_pacer(
    monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """A park copies a cache out, a resume copies it back in, in the pass before the
    next decode of the streams that go on: a one-off (here 0.3 s) that the pacer must
    not learn as the pass between two decodes (`pacing.PrefillPacer.between`), or
    every prompt chunk after it shrinks for it."""
    with running(monkeypatch, slots=2, max_parked_mib=64) as (decode, runtime):
        samples: list[float] = []
        real_between = decode._pacer.between

        def between(seconds: float) -> None:
            samples.append(seconds)
            real_between(seconds)

        monkeypatch.setattr(decode._pacer, "between", between)
        real_state, real_set_state = runtime.seq_state, runtime.set_seq_state

        def slow_state(seq: int, size: int) -> Any:
            if order == "park":
                time.sleep(0.3)
            return real_state(seq, size)

        def slow_set_state(seq: int, state: Any) -> bool:
            if order == "resume":
                time.sleep(0.3)
            return real_set_state(seq, state)

        monkeypatch.setattr(runtime, "seq_state", slow_state)
        monkeypatch.setattr(runtime, "set_seq_state", slow_set_state)
        other, other_events = job([5, 6], max_tokens=60, name="other")
        long, long_events = job([1, 2, 3], max_tokens=60, name="long")
        parked = park_at(decode, runtime, "long", step=4)
        park_order = runtime.before_decode

        def slow_decode(step: int) -> None:
            park_order(step)
            time.sleep(0.005)  # `other` still decodes when the resume comes

        runtime.before_decode = slow_decode
        decode.submit(other)
        decode.submit(long)
        assert isinstance(parked.wait(), parking.ParkResult)
        assert isinstance(resume(decode, "long").wait(), parking.ResumeResult)
        assert not other_events.ended.is_set()
        assert other_events.ended.wait(10) and long_events.ended.wait(10)
    assert samples and max(samples) < 0.1, samples
