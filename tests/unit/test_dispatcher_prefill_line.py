"""Simultaneous starts on one replica as the Lane's dispatcher carries them out: each
run knows the wait behind other prompts that admission's forecast gave it, holds the
replica's prefill line in the view until its first token, and measures the start
overhead net of that wait."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import structlog

from blazar._proto.v1 import inference_pb2
from blazar.dataplane import admission, routing
from blazar.dataplane.dispatcher import LaneDispatcher
from blazar.dataplane.parking import Parked
from blazar.dataplane.runs import Run
from tests.dispatching import one_slot_route

POLICY = admission.Policy(name="chat", priority=0, max_queue_depth=8)
# One request measured: a 100-token prompt prefilled in 0.1 s (1,000 tokens a second).
MEASURED = inference_pb2.Final(
    usage=inference_pb2.Usage(prompt_tokens=100, completion_tokens=11),
    timings=inference_pb2.Timings(prefill_ms=100.0, decode_ms=1000.0),
)


class NoParker:
    """Nothing here parks."""

    async def park(self, replica: routing.Replica, request_id: str) -> Parked | None:
        return None

    async def resume(self, replica: routing.Replica, request_id: str) -> bool:
        return False


def measured(now: list[float]) -> LaneDispatcher:
    """A Lane of one replica with 6 slots on the clock `now[0]`, one request measured."""
    dispatcher = LaneDispatcher(
        replace(one_slot_route(), slots=6), parker=NoParker(), clock=lambda: now[0]
    )
    dispatcher.measurements.record(0, MEASURED, prompt_chars=400)
    return dispatcher


def idle_view(dispatcher: LaneDispatcher) -> admission.ReplicaView:
    """What the dispatcher's measurements make of its replica with nothing running."""
    return dispatcher.measurements.replica_view(0, slots=6, running=())


def test_simultaneous_starts_queue_on_the_prefill_line_and_overhead_nets_it_out() -> None:
    now = [50.0]
    runs: list[Run] = []
    views: list[tuple[float, ...]] = []

    async def body() -> LaneDispatcher:
        dispatcher = measured(now)
        try:
            for name in "abc":
                t = admission.Ticket(name, POLICY, now[0], prompt_tokens=100, max_tokens=10)
                run = await dispatcher.admit(t, request_id=name, prompt_chars=400)
                assert isinstance(run, Run)
                runs.append(run)
            views.append(tuple(r.prefill_left_s for r in dispatcher._view().replicas[0].running))
            now[0] += 0.05
            views.append(tuple(r.prefill_left_s for r in dispatcher._view().replicas[0].running))
            # c's first token: 20 ms later than its 0.2 s wait and 0.1 s prefill.
            with structlog.testing.capture_logs() as logged:
                dispatcher.first_token(runs[2], 0.32)
            (record,) = [r for r in logged if r["event"] == "admission.first_token"]
            assert (record["predicted_s"], record["measured_s"]) == pytest.approx((0.3, 0.32))
            assert (record["line_wait_s"], record["alone"]) == (pytest.approx(0.2), False)
            views.append(tuple(r.prefill_left_s for r in dispatcher._view().replicas[0].running))
        finally:
            await dispatcher.close()
        return dispatcher

    dispatcher = asyncio.run(body())
    assert [r.predicted_ttft_s for r in runs] == pytest.approx([0.1, 0.2, 0.3])
    assert [r.queue_s for r in runs] == pytest.approx([0.0, 0.1, 0.2])
    # The first started on an idle replica: its prompt is forecast alone.
    assert [r.alone for r in runs] == [True, False, False]
    assert views[0] == pytest.approx((0.1, 0.2, 0.3))
    assert views[1] == pytest.approx((0.05, 0.15, 0.25))
    assert views[2] == pytest.approx((0.05, 0.15, 0.0))
    # The hop, template and tokenizer only: not the two prompts prefilled before c's.
    view = idle_view(dispatcher)
    assert view.start_overhead_s == pytest.approx(0.02)
    # c's was the replica's first first token: nothing queued behind another yet.
    assert view.line_share == 1.0


def test_a_prompt_queued_behind_another_measures_the_share_of_its_prefill_the_line_held() -> None:
    """a and b start together (0.1 s of prefill each, as forecast); b's first token
    comes 0.06 s after a's: the engine overlapped them, and the line held b for 0.6 of
    its prefill. d starts after b's first token: it queued behind nothing."""
    now = [50.0]

    async def body() -> LaneDispatcher:
        dispatcher = measured(now)

        async def start(name: str) -> Run:
            t = admission.Ticket(name, POLICY, now[0], prompt_tokens=100, max_tokens=10)
            run = await dispatcher.admit(t, request_id=name, prompt_chars=400)
            assert isinstance(run, Run)
            return run

        try:
            a, b = await start("a"), await start("b")
            assert (a.prefill_s, b.prefill_s) == pytest.approx((0.1, 0.1))
            dispatcher.first_token(a, 0.1)
            dispatcher.first_token(b, 0.16)
            now[0] += 0.5
            d = await start("d")
            dispatcher.first_token(d, 0.1)
        finally:
            await dispatcher.close()
        return dispatcher

    dispatcher = asyncio.run(body())
    view = idle_view(dispatcher)
    assert view.line_share == pytest.approx(0.6)


def test_a_replica_process_gone_from_the_route_leaves_no_line_behind() -> None:
    """Each restart of an engine (a crash, a rollout) is a new process on the line: the
    last first token of one that left the route is forgotten, so a daemon that outlives
    many restarts holds one line per replica serving, not one per process it ever had."""
    now = [50.0]

    async def body() -> int:
        route = replace(one_slot_route(), slots=6)
        dispatcher = LaneDispatcher(route, parker=NoParker(), clock=lambda: now[0])
        try:
            for pid in range(1, 6):  # the replica restarted: a new process each time
                (old,) = route.replicas
                route = replace(route, replicas=(replace(old, pid=pid),))
                dispatcher.update(route)
                t = admission.Ticket(f"r{pid}", POLICY, now[0], prompt_tokens=10, max_tokens=1)
                run = await dispatcher.admit(t, request_id=f"r{pid}", prompt_chars=40)
                assert isinstance(run, Run)
                dispatcher.first_token(run, 0.1)
                dispatcher.end(run, MEASURED)
                now[0] += 1.0
            dispatcher.update(route)
            await dispatcher.admit(
                admission.Ticket("last", POLICY, now[0], prompt_tokens=10, max_tokens=1),
                request_id="last",
                prompt_chars=40,
            )
            return len(dispatcher._line_last)
        finally:
            await dispatcher.close()

    assert asyncio.run(body()) == 1


@pytest.mark.parametrize(
    ("cached_guess", "reused", "first_token_s"),
    [
        # Guessed cold, its engine reused 90 of 100 tokens: 10 tokens (0.01 s) of
        # prefill, its first token 0.02 s after that.
        (0, 90, 0.03),
        # Guessed 90 cached, its engine's slot held none: 0.1 s of prefill, 0.02 s more.
        (90, 0, 0.12),
    ],
)
def test_the_start_overhead_nets_out_the_prefill_its_engine_did(
    cached_guess: int, reused: int, first_token_s: float
) -> None:
    """The overhead a first token measures is against the tokens its engine said it
    prefilled (its initial metadata), not the prefix index's guess: a wrong guess would
    otherwise move every later forecast of the Lane by the miss."""
    now = [50.0]

    async def body() -> LaneDispatcher:
        dispatcher = measured(now)
        try:
            t = admission.Ticket(
                "a", POLICY, now[0], prompt_tokens=100, max_tokens=10, prefer=0,
                cached_tokens=cached_guess,
            )  # fmt: skip
            run = await dispatcher.admit(t, request_id="a", prompt_chars=400)
            assert isinstance(run, Run)
            run.prompt_tokens, run.prefix_reused = 100, reused
            dispatcher.first_token(run, first_token_s)
        finally:
            await dispatcher.close()
        return dispatcher

    dispatcher = asyncio.run(body())
    view = idle_view(dispatcher)
    assert view.lone_start_overhead_s == pytest.approx(0.02)


def test_a_first_token_before_any_prefill_was_measured_counts_no_overhead() -> None:
    """A new Lane's (or a restarted daemon's) first request knows no prefill rate: its
    whole prefill was counted as start overhead (4.4 s seen live), and every forecast
    after it added that to each start, refusing what would have met its target. It
    counts none; the next first token, once a prefill is measured, counts its own."""
    now = [50.0]

    async def body() -> LaneDispatcher:
        dispatcher = LaneDispatcher(
            replace(one_slot_route(), slots=6), parker=NoParker(), clock=lambda: now[0]
        )
        try:
            t = admission.Ticket("a", POLICY, now[0], prompt_tokens=100, max_tokens=10)
            run = await dispatcher.admit(t, request_id="a", prompt_chars=400)
            assert isinstance(run, Run)
            dispatcher.first_token(run, 4.4)
            view = idle_view(dispatcher)
            assert view.lone_start_overhead_s is None and view.start_overhead_s == 0.0
            dispatcher.end(run, MEASURED)
            now[0] += 10.0
            t = admission.Ticket("b", POLICY, now[0], prompt_tokens=100, max_tokens=10)
            run = await dispatcher.admit(t, request_id="b", prompt_chars=400)
            assert isinstance(run, Run)
            dispatcher.first_token(run, 0.13)  # 0.1 s of prefill, as measured
        finally:
            await dispatcher.close()
        return dispatcher

    dispatcher = asyncio.run(body())
    assert idle_view(dispatcher).lone_start_overhead_s == pytest.approx(0.03)
