"""Admission as tables: tickets + a view of the Lane's engines + now -> decisions."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from blazar.api import errors
from blazar.api.kinds import SLOPolicySpec
from blazar.dataplane import admission
from blazar.dataplane.admission import (
    FIFO_POLICY,
    Admit,
    Dispatch,
    LaneQueue,
    LaneView,
    Policy,
    Preempt,
    Reason,
    Refuse,
    ReplicaView,
    Resume,
    Running,
    Ticket,
    TokenRate,
)

# Priorities and targets as in manifests/policies.yaml, bounds made small for tables.
INTERACTIVE = Policy(
    name="interactive", priority=100, ttft_target_s=2.0, max_queue_depth=2, reject_early=True
)
PATIENT = replace(INTERACTIVE, name="patient", reject_early=False)
BATCH = Policy(name="batch", priority=0, max_queue_depth=2, max_queue_wait_s=5.0)


def ticket(
    id: str,
    policy: Policy = FIFO_POLICY,
    *,
    arrived: float = 0.0,
    prompt: int = 500,
    max_tokens: int = 50,
    prefer: int | None = None,
    waited: float = 0.0,
) -> Ticket:
    return Ticket(id, policy, arrived, prompt, max_tokens, prefer=prefer, waited_s=waited)


def run(id: str, *, priority: int = 0, left: int = 100, kv: int = 100) -> Running:
    return Running(id, priority, tokens_left=left, kv_tokens=kv)


def replica(
    *running: Running,
    index: int = 0,
    slots: int = 1,
    prefill: float | None = 1000.0,
    step: float | None = 0.02,
    growth: float = 0.0,
    per_step: float = 1.0,
    kv_bytes: int = 10,
    parked: int = 0,
    parked_max: int = 0,
) -> ReplicaView:
    return ReplicaView(
        index=index,
        slots=slots,
        running=running,
        prefill_tokens_per_s=prefill,
        step_s=step,
        step_growth_s=growth,
        tokens_per_step=per_step,
        kv_bytes_per_token=kv_bytes,
        parked_bytes=parked,
        parked_bytes_max=parked_max,
    )


def lane(*replicas: ReplicaView, completion: float | None = None) -> LaneView:
    return LaneView(replicas=replicas, completion_tokens=completion)


IDLE = lane(replica())
BUSY = lane(replica(run("r")))  # its slot frees in 100 x 0.02 = 2 s
NOBODY = lane()


# A batch request with 1000 tokens left (20 s) and 100 tokens of KV (1000 bytes).
LONG = run("long", left=1000, kv=100)


def parking(
    *running: Running, index: int = 0, slots: int = 1, parked: int = 0, bound: int = 1000
) -> ReplicaView:
    """A replica that may park `bound` bytes; a slot for each running request."""
    slots = max(slots, len(running))
    return replica(*running, index=index, slots=slots, parked=parked, parked_max=bound)


def queue_of(*tickets: Ticket, now: float = 0.0, view: LaneView = BUSY) -> LaneQueue:
    queue = LaneQueue()
    for t in tickets:
        assert isinstance(queue.arrive(t, now=now, view=view), Admit), t.id
    return queue


# --- policies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            SLOPolicySpec(
                priority=100, ttft_target_ms=2000, tpot_target_ms=100, max_queue_depth=32
            ),
            Policy("p", 100, 2.0, 0.1, 32, None, reject_early=True),
        ),
        (
            SLOPolicySpec(max_queue_depth=1024, max_queue_wait_ms=600000, on_overload="queue"),
            Policy("p", 0, None, None, 1024, 600.0, reject_early=False),
        ),
        (SLOPolicySpec(), Policy("p", 0, None, None, 64, None, reject_early=True)),
        (
            SLOPolicySpec(max_slots_per_replica=4),
            Policy("p", 0, None, None, 64, None, reject_early=True, max_slots_per_replica=4),
        ),
    ],
)
def test_policy_of_spec(spec: SLOPolicySpec, expected: Policy) -> None:
    assert Policy.of("p", spec) == expected


def test_the_builtin_policy_is_todays_fifo() -> None:
    """One tier, no target, no wait bound, never refused early; its name is no valid
    resource name, so no SLOPolicy shares its queue."""
    assert (
        Policy(name="builtin:fifo", priority=0, max_queue_depth=admission.FIFO_MAX_QUEUE_DEPTH)
        == FIFO_POLICY
    )
    assert not FIFO_POLICY.reject_early
    assert ticket("a").deadline == float("inf")


# --- order -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tickets", "order"),
    [
        # Higher priority first, whatever the arrival.
        ([ticket("lo", BATCH), ticket("hi", INTERACTIVE, arrived=1)], ["hi", "lo"]),
        # Inside one priority, earliest deadline first: 1 + 0.5 before 0 + 2.
        (
            [
                ticket("late", INTERACTIVE),
                ticket("soon", replace(INTERACTIVE, name="tight", ttft_target_s=0.5), arrived=1),
            ],
            ["soon", "late"],
        ),
        # Same policy: deadlines follow arrival.
        ([ticket("b", INTERACTIVE, arrived=1), ticket("a", INTERACTIVE)], ["a", "b"]),
        # No target: arrival order, then id.
        ([ticket("c", arrived=2), ticket("b", arrived=1), ticket("a", arrived=1)], ["a", "b", "c"]),
        # A target sorts before no target in the same priority.
        (
            [
                ticket("none", replace(BATCH, name="none")),
                ticket("t", replace(BATCH, ttft_target_s=9), arrived=5),
            ],
            ["t", "none"],
        ),
        # Priority beats deadline.
        (
            [ticket("urgent-lo", replace(BATCH, ttft_target_s=0.1)), ticket("hi", INTERACTIVE)],
            ["hi", "urgent-lo"],
        ),
    ],
)
def test_order(tickets: list[Ticket], order: list[str]) -> None:
    queue = queue_of(*tickets, view=lane(replica(run("r", left=0))))
    assert [t.id for t in queue.tickets()] == order


def test_dispatch_follows_the_order() -> None:
    view = lane(replica(run("r", left=0)))
    queue = queue_of(
        ticket("c", arrived=2), ticket("lo", BATCH), ticket("hi", INTERACTIVE), view=view
    )
    free = lane(replica(slots=3))
    assert [d.ticket.id for d in queue.dispatch(now=0, view=free)] == ["hi", "lo", "c"]


# --- dispatch ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "tickets", "starts"),
    [
        # One idle slot: the first in order starts, the other waits.
        (IDLE, [ticket("a"), ticket("b", arrived=1)], [("a", 0)]),
        # No idle slot: nothing starts.
        (BUSY, [ticket("a")], []),
        # A slot whose request is about to end is not idle yet.
        (lane(replica(run("r", left=0))), [ticket("a")], []),
        # The least loaded replica first, then the lowest index.
        (
            lane(replica(run("r"), index=0, slots=3), replica(index=1, slots=3)),
            [ticket("a"), ticket("b", arrived=1), ticket("c", arrived=2)],
            [("a", 1), ("b", 0), ("c", 1)],
        ),
        # A session's replica wins while it has an idle slot...
        (
            lane(replica(run("r"), index=0, slots=2), replica(index=1, slots=2)),
            [ticket("a", prefer=0)],
            [("a", 0)],
        ),
        # ... and not once it has none.
        (
            lane(replica(run("r"), index=0), replica(index=1)),
            [ticket("a", prefer=0)],
            [("a", 1)],
        ),
        # Unmeasured rates count as instant, yet one slot still takes one ticket.
        (lane(replica(prefill=None, step=None)), [ticket("a"), ticket("b", arrived=1)], [("a", 0)]),
        # No replica: nothing starts.
        (NOBODY, [ticket("a")], []),
    ],
)
def test_dispatch_onto_idle_slots(
    view: LaneView, tickets: list[Ticket], starts: list[tuple[str, int]]
) -> None:
    queue = queue_of(*tickets, view=view)
    assert [(d.ticket.id, d.replica) for d in queue.dispatch(now=0, view=view)] == starts
    assert len(queue) == len(tickets) - len(starts)


def test_a_dispatched_ticket_carries_its_wait() -> None:
    queue = queue_of(ticket("a", arrived=1.0, waited=0.5))
    [start] = queue.dispatch(now=4.0, view=IDLE)
    assert start == Dispatch(ticket("a", arrived=1.0, waited=3.5), 0, resume=False)


def test_a_parked_generation_resumes_only_on_its_replica() -> None:
    queue = LaneQueue()
    parked = ticket("p", BATCH, waited=1.0)
    queue.requeue(parked, now=10.0, resume=Resume(replica=1, tokens_left=20))
    assert "p" in queue
    two = lane(replica(index=0), replica(run("r"), index=1))
    assert queue.dispatch(now=11.0, view=two) == []
    freed = lane(replica(index=0), replica(index=1))
    assert queue.dispatch(now=12.0, view=freed) == [
        Dispatch(replace(parked, waited_s=3.0), 1, resume=True)
    ]


def test_a_ticket_whose_start_failed_goes_back_in_its_place() -> None:
    queue = queue_of(ticket("b", arrived=1))
    [start] = queue_of(ticket("a")).dispatch(now=2, view=IDLE)
    queue.requeue(start.ticket, now=3)
    assert [t.id for t in queue.tickets()] == ["a", "b"]
    assert queue.dispatch(now=3, view=IDLE)[0].ticket.waited_s == 2


def test_a_ticket_is_admitted_once() -> None:
    queue = queue_of(ticket("a"))
    with pytest.raises(ValueError, match="already waiting"):
        queue.arrive(ticket("a"), now=0, view=BUSY)
    with pytest.raises(ValueError, match="already waiting"):
        queue.requeue(ticket("a"), now=0)


# --- prediction --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "ahead", "ttft"),
    [
        # Idle slot: 500 prompt tokens at 1000/s.
        (IDLE, [], 0.5),
        # Busy slot: 100 tokens left x 0.02 s, then the prefill.
        (BUSY, [], 2.5),
        # Speculation accepting one draft a step halves the decode time.
        (lane(replica(run("r"), per_step=2.0)), [], 1.5),
        # A ticket ahead holds the idle slot for its prefill (1 s) and 50 tokens (1 s).
        (IDLE, [ticket("x", prompt=1000)], 2.5),
        # ... only 10 tokens when the Lane's completions measure 10.
        (lane(replica(), completion=9.2), [ticket("x", prompt=1000)], 1.7),
        # ... all 50 when its policy's requests run to their budget, whatever the Lane's.
        (
            replace(lane(replica(), completion=9.2), completion_share={FIFO_POLICY.name: 1.0}),
            [ticket("x", prompt=1000)],
            2.5,
        ),
        # Two replicas: the slot that frees first (replica 1 at 1 s) and its prefill rate.
        (
            lane(replica(run("r")), replica(run("s", left=50), index=1, prefill=500.0)),
            [],
            2.0,
        ),
        # Steps grow by 0.01 s per extra sequence: with 2 slots, the running request and
        # the tickets decode two at a time, 0.03 s a step: its slot frees at 3 s (the
        # ticket ahead, 200 tokens, holds the other until 6 s).
        (
            lane(replica(run("r"), slots=2, growth=0.01)),
            [ticket("x", prompt=0, max_tokens=200)],
            3.5,
        ),
        # One slot: the batch stays one, growth or not.
        (lane(replica(run("r"), growth=0.01)), [], 2.5),
        # Unmeasured rates count as instant.
        (lane(replica(run("r"), prefill=None, step=None)), [], 0.0),
        # No replica: nothing to predict from.
        (NOBODY, [], None),
    ],
)
def test_predicted_time_to_first_token(
    view: LaneView, ahead: list[Ticket], ttft: float | None
) -> None:
    queue = queue_of(*ahead, view=view)
    admitted = queue.arrive(ticket("t", arrived=9.0), now=9.0, view=view)
    assert isinstance(admitted, Admit)
    assert admitted.predicted_ttft_s == (None if ttft is None else pytest.approx(ttft))
    # Time already waited counts: asked again 1.5 s later, the engines where they were.
    later = queue.predict_ttft("t", now=10.5, view=view)
    assert later == (None if ttft is None else pytest.approx(ttft + 1.5))


def test_a_parked_generation_has_no_ttft_to_predict() -> None:
    queue = LaneQueue()
    queue.requeue(ticket("p"), now=0, resume=Resume(0, 5))
    assert queue.predict_ttft("p", now=0, view=BUSY) is None
    with pytest.raises(KeyError):
        queue.predict_ttft("nope", now=0, view=BUSY)


# --- depth bound -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("waiting", "arriving", "view", "refused"),
    [
        # Two batch tickets wait: a third is refused...
        ([ticket("a", BATCH), ticket("b", BATCH)], ticket("c", BATCH), BUSY, True),
        # ... one of another policy is not (the bound is per policy)...
        ([ticket("a", BATCH), ticket("b", BATCH)], ticket("c"), BUSY, False),
        # ... nor one that starts at once on an idle slot.
        (
            [ticket("a", BATCH, arrived=5), ticket("b", BATCH, arrived=5)],
            ticket("c", INTERACTIVE),
            lane(replica(slots=2)),
            False,
        ),
        # Nor does one that would start by parking a lower-priority request: it waits
        # until that happens (a and b meet their target waiting for the slot that frees
        # at 0.5 s; c, behind them, would park `long`).
        (
            [ticket("a", PATIENT, prompt=100), ticket("b", PATIENT, prompt=100)],
            ticket("c", PATIENT, prompt=100),
            lane(parking(run("hi", priority=100, left=25), LONG)),
            True,
        ),
        # Depth 0: only a ticket that starts at once gets in.
        ([], ticket("c", replace(BATCH, max_queue_depth=0)), BUSY, True),
        ([], ticket("c", replace(BATCH, max_queue_depth=0)), IDLE, False),
    ],
)
def test_depth_bound(
    waiting: list[Ticket], arriving: Ticket, view: LaneView, refused: bool
) -> None:
    queue = queue_of(*waiting, view=BUSY)
    decision = queue.arrive(arriving, now=0, view=view)
    assert isinstance(decision, Refuse) == refused
    if isinstance(decision, Refuse):
        assert decision.reason == Reason.QUEUE_FULL
        assert arriving.id not in queue


def test_a_parked_generation_counts_against_its_policys_depth() -> None:
    queue = queue_of(ticket("a", BATCH))
    queue.requeue(ticket("p", BATCH), now=0, resume=Resume(0, 10))
    assert queue.depth("batch") == 2
    assert isinstance(queue.arrive(ticket("c", BATCH), now=0, view=BUSY), Refuse)


# --- wait bound --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "view", "expired", "started"),
    [
        # BATCH waits at most 5 s.
        (4.9, BUSY, [], []),
        (5.0, BUSY, ["a"], []),
        # At its bound a ticket may still start, but not wait on...
        (5.0, IDLE, [], ["a"]),
        # ... and past it, it does not start late.
        (5.1, IDLE, ["a"], []),
    ],
)
def test_wait_bound(now: float, view: LaneView, expired: list[str], started: list[str]) -> None:
    queue = queue_of(ticket("a", BATCH))
    assert queue.next_expiry() == 5.0
    refused = queue.expire(now=now, view=view)
    assert [(r.ticket.id, r.reason) for r in refused] == [
        (i, Reason.QUEUE_TIMEOUT) for i in expired
    ]
    assert [d.ticket.id for d in queue.dispatch(now=now, view=view)] == started


def test_a_parked_generation_outlives_its_wait_bound() -> None:
    """Waited 3 s of its 5 before it started; parked at 10, it is still there long after
    its bound, never refused (its stream is open), and resumes when a slot frees, its
    queue time all its waits."""
    queue = LaneQueue()
    queue.requeue(ticket("p", BATCH, waited=3.0), now=10.0, resume=Resume(0, 10))
    assert queue.next_expiry() is None
    assert queue.expire(now=100.0, view=BUSY) == []
    [resumed] = queue.dispatch(now=100.0, view=IDLE)
    assert (resumed.ticket.id, resumed.resume, resumed.ticket.waited_s) == ("p", True, 93.0)


def test_no_wait_at_all() -> None:
    """maxQueueWaitMs: 0 takes a ticket that starts at once and refuses any other."""
    now_or_never = replace(BATCH, max_queue_wait_s=0.0)
    queue = LaneQueue()
    refused = queue.arrive(ticket("a", now_or_never), now=0, view=BUSY)
    assert isinstance(refused, Refuse)
    assert refused.reason == Reason.QUEUE_TIMEOUT
    assert isinstance(queue.arrive(ticket("b", now_or_never), now=0, view=IDLE), Admit)
    assert [d.ticket.id for d in queue.dispatch(now=0, view=IDLE)] == ["b"]


def test_next_expiry() -> None:
    assert LaneQueue().next_expiry() is None
    assert queue_of(ticket("a")).next_expiry() is None
    # INTERACTIVE is refused at its deadline (arrival + 2 s), BATCH at its bound (5 s).
    queue = queue_of(
        ticket("b", BATCH, arrived=1), ticket("i", INTERACTIVE, arrived=0.5), view=IDLE
    )
    assert queue.next_expiry() == 2.5


def test_recheck_while_urgent_work_waits_where_it_may_park() -> None:
    """The forecast is read again a decode step on while a ticket with a deadline waits
    and a replica runs work it may park: its pace moves between events."""
    # A batch run that frees its slot in 1 s, parkable: the urgent ticket waits for it.
    short = run("b", left=50)
    may_park = lane(parking(short))
    queue = queue_of(ticket("u", INTERACTIVE, prompt=10), view=may_park)
    assert queue.recheck_at(now=0.5, view=may_park) == pytest.approx(0.5 + 0.02)
    # Bounded: a step of 1 ms is read every 20 ms; none measured, every 250 ms.
    fast = lane(replace(parking(short), step_s=0.001))
    assert queue.recheck_at(now=0.5, view=fast) == pytest.approx(0.52)
    unmeasured = lane(replace(parking(short), step_s=None))
    assert queue.recheck_at(now=0.5, view=unmeasured) == pytest.approx(0.75)
    # And spaced by what a reading costs: one that took 10 ms is read again no sooner
    # than 50 ms after it began (a fifth of the Lane's loop at most), past the step.
    assert queue.recheck_at(now=0.5, view=may_park, decide_s=0.01) == pytest.approx(0.55)
    assert queue.recheck_at(now=0.5, view=may_park, decide_s=0.001) == pytest.approx(0.52)
    # Nothing to park there (no parking, or work of the same priority), or past its
    # deadline (expire takes it out): no reason to read the forecast without an event.
    assert queue.recheck_at(now=0.5, view=lane(replica(short))) is None
    urgent_run = run("x", priority=INTERACTIVE.priority, left=50)
    assert queue.recheck_at(now=0.5, view=lane(parking(urgent_run))) is None
    assert queue.recheck_at(now=2.0, view=may_park) is None
    # A ticket without a target waits for any slot; a parked generation resumes on its
    # own replica: neither preempts.
    calm = queue_of(ticket("b2", BATCH), view=may_park)
    calm.requeue(ticket("p", INTERACTIVE), now=0.0, resume=Resume(0, 10))
    assert calm.recheck_at(now=0.5, view=may_park) is None


# --- early reject ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "view", "decision"),
    [
        # Slot frees at 2 s, prefill 0.5 s: 2.5 s misses the 2 s target. Refused, and a
        # request like it meets the target once the queue drained by 0.5 s.
        (
            INTERACTIVE,
            BUSY,
            Refuse(ticket("t", INTERACTIVE), Reason.SLO_UNATTAINABLE, 0.5, predicted_ttft_s=2.5),
        ),
        # The same under onOverload: queue waits (for the busy slot).
        (PATIENT, BUSY, Admit(2.5, waits=True)),
        # 1.96 s and two steps exactly meet it.
        (INTERACTIVE, lane(replica(run("r", left=73))), Admit(1.96, waits=True)),
        # 2 s after a wait may come `WAIT_STEPS` steps (0.04 s) past it: refused now,
        # not after the wait, predicted as late as that.
        (
            INTERACTIVE,
            lane(replica(run("r", left=75))),
            Refuse(
                ticket("t", INTERACTIVE),
                Reason.SLO_UNATTAINABLE,
                admission.RETRY_AFTER_MIN_S,
                predicted_ttft_s=2.04,
            ),
        ),
        # Its own prefill (2.5 s) misses the target on an idle slot: it starts at once
        # all the same (refusing sheds no load, and a retry would fare no better).
        (INTERACTIVE, lane(replica(prefill=200.0)), Admit(2.5)),
        # ... and on a busy one it is refused. Only the shared rate is measured, which
        # overstates a prompt alone: retry once the work ahead has drained.
        (
            INTERACTIVE,
            lane(replica(run("r", left=1), prefill=200.0)),
            Refuse(
                ticket("t", INTERACTIVE),
                Reason.SLO_UNATTAINABLE,
                0.02 + 2.5 - 2.0,
                predicted_ttft_s=2.5 + 0.02,
            ),
        ),
        # Alone it prefills at 100 tokens/s (5 s, over 1.5 times the target): no wait
        # makes it meet the target, so no retry hint, and how long its prompt takes.
        (
            INTERACTIVE,
            lane(replace(replica(run("r", left=1), prefill=50.0), lone_prefill_tokens_per_s=100.0)),
            Refuse(
                ticket("t", INTERACTIVE),
                Reason.SLO_UNATTAINABLE,
                None,
                predicted_ttft_s=10.0 + 0.02,
                prefill_s=5.0,
            ),
        ),
        # Alone 2.5 s, within the measurement's noise of the target: the usual hint.
        (
            INTERACTIVE,
            lane(replace(replica(run("r", left=1), prefill=50.0), lone_prefill_tokens_per_s=200.0)),
            Refuse(
                ticket("t", INTERACTIVE),
                Reason.SLO_UNATTAINABLE,
                0.02 + 10.0 - 2.0,
                predicted_ttft_s=10.0 + 0.02,
            ),
        ),
        # Slow beside other work, quick alone: it meets the target once the work drains.
        (
            INTERACTIVE,
            lane(
                replace(replica(run("r", left=1), prefill=50.0), lone_prefill_tokens_per_s=1000.0)
            ),
            Refuse(
                ticket("t", INTERACTIVE),
                Reason.SLO_UNATTAINABLE,
                0.02 + 10.0 - 2.0,
                predicted_ttft_s=10.0 + 0.02,
            ),
        ),
        # Two replicas: quick alone on one of them is enough for a retry hint.
        (
            INTERACTIVE,
            lane(
                replace(replica(run("r", left=1), prefill=50.0), lone_prefill_tokens_per_s=100.0),
                replace(
                    replica(run("s", left=1), index=1, prefill=50.0),
                    lone_prefill_tokens_per_s=1000.0,
                ),
            ),
            Refuse(
                ticket("t", INTERACTIVE),
                Reason.SLO_UNATTAINABLE,
                0.02 + 10.0 - 2.0,
                predicted_ttft_s=10.0 + 0.02,
            ),
        ),
        # No replica: no prediction, no early refusal.
        (INTERACTIVE, NOBODY, Admit(None)),
    ],
)
def test_early_reject(policy: Policy, view: LaneView, decision: Admit | Refuse) -> None:
    queue = LaneQueue()
    assert queue.arrive(ticket("t", policy), now=0, view=view) == decision
    assert ("t" in queue) == isinstance(decision, Admit)


@pytest.mark.parametrize(
    ("rates", "hinted"),
    [
        # 2 s target: a prompt alone over 3 s is told that no wait helps.
        ((100.0,), 300),
        # Quick alone on one replica is enough for a hint (the refusal's `best`).
        ((100.0, 1000.0), 3000),
        # A replica not measured alone: no bound (the refusal hints, as the gate's).
        ((100.0, None), None),
    ],
)
def test_the_longest_prompt_a_refusal_hints_a_retry_to(
    rates: tuple[float | None, ...], hinted: int | None
) -> None:
    """`hinted_prompt_tokens` is where `refusal` stops giving a retry hint: the gates
    answer only prompts up to it with the probe's refusal."""
    view = lane(
        *(
            replace(
                replica(run(f"r{i}", left=1), index=i, prefill=50.0), lone_prefill_tokens_per_s=r
            )
            for i, r in enumerate(rates)
        )
    )
    assert admission.hinted_prompt_tokens(view, INTERACTIVE) == hinted
    assert admission.hinted_prompt_tokens(view, BATCH) is None  # no target
    if hinted is None:
        return
    for prompt, hint in ((hinted, True), (hinted + 1, False)):
        decision = LaneQueue().arrive(ticket("t", INTERACTIVE, prompt=prompt), now=0, view=view)
        assert isinstance(decision, Refuse) and decision.reason == Reason.SLO_UNATTAINABLE
        assert (decision.retry_after_s is not None) == hint, prompt


@pytest.mark.parametrize(
    ("prefer", "cached", "decision"),
    [
        # 2,000 prompt tokens at 1,000 a second after a slot that frees at 0.5 s: 2.5 s,
        # past the 2 s target.
        (0, 0, Refuse(ticket("t", INTERACTIVE), Reason.SLO_UNATTAINABLE, 0.5, predicted_ttft_s=2.5)),
        # The replica's cache holds 1,900 of them: 0.1 s of prefill, its first token at
        # 0.6 s (the ticket waits for that slot).
        (0, 1900, Admit(0.6, waits=True)),
        # A cache of another replica than the one it prefers (and so takes) saves nothing.
        (1, 1900, Refuse(ticket("t", INTERACTIVE), Reason.SLO_UNATTAINABLE, 0.5, predicted_ttft_s=2.5)),
        # A cache that holds the whole prompt still leaves one token to prefill.
        (0, 5000, Admit(0.501, waits=True)),
    ],
)  # fmt: skip
def test_the_forecast_prefills_only_what_the_preferred_replicas_cache_lacks(
    prefer: int, cached: int, decision: Admit | Refuse
) -> None:
    """A follow-up in a long conversation is as fast as its new part on the replica
    that holds the rest: not refused early for a prefill it will not do."""
    view = lane(replica(run("r", left=25)))
    arriving = replace(ticket("t", INTERACTIVE, prompt=2000, prefer=prefer), cached_tokens=cached)
    got = LaneQueue().arrive(arriving, now=0, view=view)
    if isinstance(got, Refuse) and isinstance(decision, Refuse):
        assert (got.reason, got.predicted_ttft_s) == (decision.reason, decision.predicted_ttft_s)
    else:
        assert isinstance(got, Admit) and isinstance(decision, Admit)
        assert got.predicted_ttft_s == pytest.approx(decision.predicted_ttft_s)
        assert got.waits == decision.waits


def test_an_admitted_ticket_pushed_past_its_deadline_is_refused_not_started_late() -> None:
    """Admitted with 2 s to spare; then more urgent work arrives ahead of it."""
    queue = queue_of(ticket("t", INTERACTIVE), ticket("q", PATIENT, arrived=0.01), view=IDLE)
    urgent = replace(PATIENT, name="urgent", priority=200, max_queue_depth=9)
    for i in range(3):
        queue.arrive(ticket(f"u{i}", urgent, prompt=1000), now=0.2, view=IDLE)
    refused = queue.expire(now=0.2, view=IDLE)
    assert [(r.ticket.id, r.reason) for r in refused] == [("t", Reason.SLO_UNATTAINABLE)]
    # u0 starts now; u1 and u2 follow, 2 s apiece; t would have started after them.
    assert refused[0].predicted_ttft_s == pytest.approx(0.2 + 6.0 + 0.5)
    assert refused[0].retry_after_s == pytest.approx(6.5 - 2.0)
    # Under onOverload: queue, it waits.
    assert "q" in queue


def test_a_ticket_still_waiting_at_its_deadline_is_refused_even_with_no_replica() -> None:
    queue = queue_of(ticket("t", INTERACTIVE), view=NOBODY)
    assert queue.expire(now=1.9, view=NOBODY) == []
    [refused] = queue.expire(now=2.0, view=NOBODY)
    assert refused == Refuse(
        ticket("t", INTERACTIVE),
        Reason.SLO_UNATTAINABLE,
        admission.RETRY_AFTER_UNKNOWN_S,
        waited_s=2.0,
        predicted_ttft_s=2.0,
    )


def test_a_refused_ticket_leaves_room_for_those_behind_it() -> None:
    """t cannot make it; p behind it (same priority, later deadline) takes the slot."""
    tight = replace(INTERACTIVE, name="tight", ttft_target_s=0.3)
    queue = queue_of(ticket("p", PATIENT), view=IDLE)
    queue.arrive(ticket("t", tight, prompt=100), now=0, view=IDLE)
    assert [t.id for t in queue.tickets()] == ["t", "p"]
    assert queue.predict_ttft("p", now=0.5, view=IDLE) == pytest.approx(1.0)
    # t never starts: past its deadline, dispatch leaves it to expire.
    assert [d.ticket.id for d in queue.dispatch(now=0.5, view=IDLE)] == ["p"]
    assert [r.ticket.id for r in queue.expire(now=0.5, view=IDLE)] == ["t"]


# --- spillover ---------------------------------------------------------------------


def spilled(t: Ticket) -> Ticket:
    return replace(t, spilled_from="local")


@pytest.mark.parametrize(
    ("arriving", "view", "spill", "decision"),
    [
        # Its target met here: it stays, spillover or not.
        (ticket("t", INTERACTIVE), IDLE, True, Admit(0.5)),
        (
            ticket("t", INTERACTIVE),
            lane(replica(run("r", left=73))),
            True,
            Admit(1.96, waits=True),
        ),
        # Missed here (2.5 s against 2 s): offered to the spillover Lane, with the
        # refusal that stands if that Lane refuses it too.
        (
            ticket("t", INTERACTIVE),
            BUSY,
            True,
            admission.Spill(
                ticket("t", INTERACTIVE),
                Refuse(
                    ticket("t", INTERACTIVE),
                    Reason.SLO_UNATTAINABLE,
                    0.5,
                    predicted_ttft_s=2.5,
                ),
            ),
        ),
        # Under onOverload: queue, the same miss would wait past its deadline: offered,
        # with the admission that stands.
        (
            ticket("t", PATIENT),
            BUSY,
            True,
            admission.Spill(ticket("t", PATIENT), Admit(2.5, waits=True)),
        ),
        # Its own prefill misses the target on an idle slot: it starts here at once.
        (ticket("t", INTERACTIVE), lane(replica(prefill=200.0)), True, Admit(2.5)),
        # No replica here: nothing predicts a miss; it waits (the Lane wakes, say).
        (ticket("t", INTERACTIVE), NOBODY, True, Admit(None)),
        # No target: nothing to miss.
        (ticket("t", BATCH), BUSY, True, Admit(2.5, waits=True)),
        # No spillover Lane (none named, or it does not exist): the local decision.
        (
            ticket("t", INTERACTIVE),
            BUSY,
            False,
            Refuse(ticket("t", INTERACTIVE), Reason.SLO_UNATTAINABLE, 0.5, predicted_ttft_s=2.5),
        ),
        (ticket("t", PATIENT), BUSY, False, Admit(2.5, waits=True)),
        # On the spillover Lane: admitted when it meets its target there...
        (spilled(ticket("t", INTERACTIVE)), IDLE, False, Admit(0.5)),
        # ... refused when it would miss it, whatever onOverload says, and never
        # spilled again (one hop, whatever the manifests say).
        (
            spilled(ticket("t", INTERACTIVE)),
            BUSY,
            True,
            Refuse(
                spilled(ticket("t", INTERACTIVE)),
                Reason.SLO_UNATTAINABLE,
                0.5,
                predicted_ttft_s=2.5,
            ),
        ),
        (
            spilled(ticket("t", PATIENT)),
            BUSY,
            True,
            Refuse(
                spilled(ticket("t", PATIENT)), Reason.SLO_UNATTAINABLE, 0.5, predicted_ttft_s=2.5
            ),
        ),
        # ... and refused when nothing there forecasts that it meets it.
        (
            spilled(ticket("t", PATIENT)),
            NOBODY,
            False,
            Refuse(
                spilled(ticket("t", PATIENT)),
                Reason.SLO_UNATTAINABLE,
                admission.RETRY_AFTER_UNKNOWN_S,
                predicted_ttft_s=0.0,
            ),
        ),
    ],
)
def test_spill_verdict(
    arriving: Ticket, view: LaneView, spill: bool, decision: Admit | Refuse | admission.Spill
) -> None:
    queue = LaneQueue()
    assert queue.arrive(arriving, now=0, view=view, spill=spill) == decision
    # Only an admission waits here; a spilled ticket is the caller's to offer.
    assert ("t" in queue) == isinstance(decision, Admit)


def test_a_ticket_that_can_preempt_in_time_stays_local() -> None:
    """Parking the batch generation lets it meet its target here: no spill."""
    view = lane(parking(LONG))
    urgent = ticket("u", INTERACTIVE, prompt=100)
    queue = LaneQueue()
    assert queue.arrive(urgent, now=0, view=view, spill=True) == Admit(pytest.approx(0.02 + 0.1))
    assert queue.preemption(now=0, view=view) == Preempt(urgent, victim="long", replica=0)


def test_a_full_queue_that_would_miss_spills_with_its_refusal() -> None:
    """Its policy's queue is full and it would miss: offered elsewhere; QUEUE_FULL stands."""
    queue = queue_of(ticket("a", PATIENT), ticket("b", PATIENT), view=BUSY)
    decision = queue.arrive(ticket("c", PATIENT), now=0, view=BUSY, spill=True)
    assert isinstance(decision, admission.Spill)
    assert isinstance(decision.local, Refuse) and decision.local.reason == Reason.QUEUE_FULL
    assert "c" not in queue


# --- cancellation ------------------------------------------------------------------


def test_a_cancelled_ticket_frees_its_place_and_never_starts() -> None:
    queue = queue_of(ticket("a", BATCH), ticket("b", BATCH, arrived=1))
    assert isinstance(queue.arrive(ticket("c", BATCH, arrived=2), now=2, view=BUSY), Refuse)
    assert queue.cancel("a")
    assert not queue.cancel("a")
    assert not queue.cancel("never-seen")
    assert isinstance(queue.arrive(ticket("c", BATCH, arrived=2), now=2, view=BUSY), Admit)
    assert [d.ticket.id for d in queue.dispatch(now=3, view=lane(replica(slots=3)))] == ["b", "c"]
    assert queue.expire(now=99, view=BUSY) == []


def test_a_cancelled_ticket_no_longer_delays_those_behind_it() -> None:
    queue = queue_of(ticket("a", prompt=1000), ticket("b", arrived=1), view=IDLE)
    assert queue.predict_ttft("b", now=1, view=BUSY) == pytest.approx(2 + 2 + 0.5)
    queue.cancel("a")
    assert queue.predict_ttft("b", now=1, view=BUSY) == pytest.approx(2 + 0.5)


# --- preemption --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "urgent", "preempt"),
    [
        # Would wait 20 s for a 2 s target: park the batch request.
        (lane(parking(LONG)), ticket("u", INTERACTIVE), ("long", 0)),
        # onOverload: queue preempts as well: the target is what counts.
        (lane(parking(LONG)), ticket("u", PATIENT), ("long", 0)),
        # The victim must have strictly lower priority.
        (lane(parking(replace(LONG, priority=100))), ticket("u", PATIENT), None),
        # Would meet its target anyway (the slot frees in 1 s).
        (lane(parking(replace(LONG, tokens_left=50))), ticket("u", INTERACTIVE), None),
        # No target, nothing to miss.
        (lane(parking(LONG)), ticket("u", replace(BATCH, priority=50)), None),
        # Parked bytes would pass the bound (900 + 1000 > 1000)...
        (lane(parking(LONG, parked=900)), ticket("u", PATIENT), None),
        # ... or the engine cannot park at all.
        (lane(parking(LONG, bound=0)), ticket("u", PATIENT), None),
        # Exactly at the bound is fine (100 + 1000 = 1100).
        (lane(parking(LONG, parked=100, bound=1100)), ticket("u", PATIENT), ("long", 0)),
        # Parking would not save it: its prefill alone (2.5 s) misses.
        (lane(parking(LONG)), ticket("u", PATIENT, prompt=2500), None),
        # The cheapest victim: fewest KV tokens...
        (
            lane(parking(LONG, run("small", left=1000, kv=20))),
            ticket("u", PATIENT),
            ("small", 0),
        ),
        # ... then the lowest priority...
        (
            lane(parking(replace(LONG, priority=5), replace(LONG, id="lower", priority=1))),
            ticket("u", PATIENT),
            ("lower", 0),
        ),
        # ... across replicas, where the bound allows.
        (
            lane(parking(LONG, bound=500), parking(replace(LONG, id="other"), index=1)),
            ticket("u", PATIENT),
            ("other", 1),
        ),
        # An idle slot: no preemption needed.
        (lane(parking(LONG), replica(index=1)), ticket("u", PATIENT), None),
        # Its engine refused to park it (not seated yet): no victim for now.
        (lane(parking(replace(LONG, parkable=False))), ticket("u", PATIENT), None),
    ],
)
def test_preemption_choice(view: LaneView, urgent: Ticket, preempt: tuple[str, int] | None) -> None:
    queue = LaneQueue()
    decision = queue.arrive(urgent, now=0, view=view)
    assert isinstance(decision, Admit)
    got = queue.preemption(now=0, view=view)
    if preempt is None:
        assert got is None
        assert urgent.id in queue
    else:
        assert got == Preempt(urgent, victim=preempt[0], replica=preempt[1])
        # The park (none measured), the step the engine goes on with before the
        # request reaches it (0.02 s), then its prefill.
        assert decision.predicted_ttft_s == pytest.approx(0.02 + 0.5)
        # The ticket leaves the queue: it starts in the victim's slot.
        assert urgent.id not in queue


def test_a_parked_victim_waits_at_its_priority_and_resumes_where_its_kv_is() -> None:
    view = lane(parking(LONG))
    queue = queue_of(ticket("b", BATCH, arrived=0.5), view=view)
    queue.arrive(ticket("u", INTERACTIVE, arrived=1), now=1, view=view)
    preempt = queue.preemption(now=1, view=view)
    assert preempt is not None
    assert queue.preemption(now=1, view=view) is None
    # The data plane parks `long` and requeues its ticket (it had waited 0.1 s).
    queue.requeue(ticket("long", BATCH, waited=0.1), now=1, resume=Resume(0, 990))
    assert [t.id for t in queue.tickets()] == ["long", "b"]
    # u runs; once its slot is idle, long resumes before b, which waited less.
    after = lane(parking())
    assert queue.dispatch(now=3, view=after) == [
        Dispatch(ticket("long", BATCH, waited=2.1), 0, resume=True)
    ]


def test_the_forecast_counts_the_victim_when_predicting_lower_priorities() -> None:
    """b waits behind long: parked for u, long resumes first (20 s), then b."""
    view = lane(parking(LONG))
    queue = queue_of(ticket("b", BATCH, arrived=0.5, max_tokens=10), view=view)
    queue.arrive(ticket("u", INTERACTIVE, prompt=100, max_tokens=10), now=0.5, view=view)
    # u: a step after the park (0.02 s), 0.1 s prefill + 0.2 s decode; then long's 1000
    # tokens (20 s); then b's prefill.
    assert queue.predict_ttft("b", now=0.5, view=view) == pytest.approx(0.02 + 0.3 + 20 + 0.5)


# --- caps (maxSlotsPerReplica) -----------------------------------------------------


# Batch work that may hold 2 slots of a replica; the others stay free for the rest.
CAPPED = replace(BATCH, name="capped", max_slots_per_replica=2, max_queue_depth=8)
ONE = replace(CAPPED, name="one", max_slots_per_replica=1)


def held(id: str, policy: Policy = CAPPED, *, left: int = 100, kv: int = 100) -> Running:
    """A running request of `policy`, as the data plane describes it."""
    return Running(
        id,
        policy.priority,
        tokens_left=left,
        kv_tokens=kv,
        policy=policy.name,
        max_slots_per_replica=policy.max_slots_per_replica,
    )


@pytest.mark.parametrize(
    ("view", "tickets", "starts"),
    [
        # Two of three slots held by the policy: the idle one is not for its tickets.
        (lane(replica(held("a"), held("b"), slots=3)), [ticket("c", CAPPED)], []),
        # One held: one more starts, the next waits though a slot is idle.
        (
            lane(replica(held("a"), slots=4)),
            [ticket("c", CAPPED), ticket("d", CAPPED, arrived=1)],
            [("c", 0)],
        ),
        # From an empty replica: the cap, and no more.
        (
            lane(replica(slots=4)),
            [ticket(f"c{i}", CAPPED, arrived=i) for i in range(3)],
            [("c0", 0), ("c1", 0)],
        ),
        # A capped ticket at its cap waits; an uncapped one behind it takes the slot.
        (
            lane(replica(held("a"), held("b"), slots=3)),
            [ticket("c", CAPPED), ticket("f", arrived=1)],
            [("f", 0)],
        ),
        # Other policies' running requests do not count against it.
        (
            lane(replica(held("a", ONE), run("x"), slots=3)),
            [ticket("c", CAPPED), ticket("d", CAPPED, arrived=1)],
            [("c", 0)],
        ),
        # The cap is per replica: at it on replica 0, the tickets go to replica 1, up
        # to the cap there, whatever the session prefers.
        (
            lane(replica(held("a"), held("b"), slots=3), replica(index=1, slots=3)),
            [ticket(f"c{i}", CAPPED, arrived=i, prefer=0) for i in range(3)],
            [("c0", 1), ("c1", 1)],
        ),
        # A cap at or above the replica's slots changes nothing there.
        (
            lane(replica(slots=2)),
            [ticket(f"c{i}", replace(CAPPED, max_slots_per_replica=s), arrived=i) for i, s in
             enumerate([2, 5])],
            [("c0", 0), ("c1", 0)],
        ),
    ],
)  # fmt: skip
def test_a_capped_policy_starts_no_ticket_past_its_cap(
    view: LaneView, tickets: list[Ticket], starts: list[tuple[str, int]]
) -> None:
    queue = queue_of(*tickets, view=BUSY)
    started = queue.dispatch(now=0, view=view)
    assert [(d.ticket.id, d.replica) for d in started] == starts
    # Asked again once they run, nothing more starts.
    now_running = LaneView(
        replicas=tuple(
            replace(
                r,
                running=r.running
                + tuple(
                    held(d.ticket.id, d.ticket.policy) for d in started if d.replica == r.index
                ),
            )
            for r in view.replicas
        )
    )
    assert queue.dispatch(now=0, view=now_running) == []


@pytest.mark.parametrize(("cap", "ttft"), [(1, 2.0 + 0.5), (None, 0.5 + 0.5)])
def test_a_capped_ticket_is_predicted_to_wait_for_its_own_policys_slot(
    cap: int | None, ttft: float
) -> None:
    """Its policy's request frees its slot at 2 s, another policy's at 0.5 s: at its cap
    the ticket waits for the first (then 0.5 s of prefill); uncapped, for the second.
    An uncapped ticket behind it takes the slot that frees first all the same."""
    policy = replace(ONE, max_slots_per_replica=cap)
    view = lane(replica(held("b", policy), run("i", priority=100, left=25), slots=2))
    queue = LaneQueue()
    assert queue.arrive(ticket("c", policy), now=0, view=view) == Admit(ttft, waits=True)
    behind = queue.arrive(ticket("f", arrived=0.1), now=0.1, view=view)
    assert isinstance(behind, Admit)
    assert behind.predicted_ttft_s == pytest.approx(0.5 + 0.5 if cap else 2.0 + 0.5)


@pytest.mark.parametrize("cap", [1, None])
def test_a_capped_ticket_at_its_cap_is_refused_early_or_spilled_though_a_slot_is_idle(
    cap: int | None,
) -> None:
    """Its policy's one slot frees at 20 s, past its 2 s target: the idle slot is not
    its to take, so it is predicted to miss, and refused or spilled; uncapped, it
    starts at once."""
    policy = replace(INTERACTIVE, name="capped-interactive", max_slots_per_replica=cap)
    view = lane(replica(held("i", policy, left=1000), slots=2))
    decision = LaneQueue().arrive(ticket("t", policy), now=0, view=view)
    if cap is None:
        assert decision == Admit(0.5)
    else:
        assert isinstance(decision, Refuse) and decision.reason == Reason.SLO_UNATTAINABLE
        assert decision.predicted_ttft_s == pytest.approx(20.5)
    # A Lane with a spillover Lane offers it there instead; uncapped, it stays.
    spilled = LaneQueue().arrive(ticket("t", policy), now=0, view=view, spill=True)
    if cap is None:
        assert spilled == Admit(0.5)
    else:
        assert spilled == admission.Spill(ticket("t", policy), decision)


def test_a_parked_generation_resumes_under_its_policys_cap() -> None:
    """A parked generation holds no claim while parked: it waits its turn, first in its
    priority, and resumes as any ticket of its policy would: at the cap on its replica
    only in a slot its policy frees there, below the cap in any slot there. Resumed,
    it counts: a fresh ticket of its policy waits."""
    queue = queue_of(ticket("c", ONE), view=BUSY)
    queue.requeue(ticket("p", ONE, arrived=-1, waited=1.0), now=0, resume=Resume(0, 20))
    assert [t.id for t in queue.tickets()] == ["p", "c"]
    # b of its policy runs on its replica: at the cap, p waits, idle slot or not.
    at_cap = lane(replica(held("b", ONE), slots=3), replica(index=1, slots=3))
    assert [(d.ticket.id, d.replica) for d in queue.dispatch(now=1, view=at_cap)] == [("c", 1)]
    # b ended: p resumes on its replica, before c would have, and holds the cap there.
    queue = queue_of(ticket("c", ONE), view=BUSY)
    queue.requeue(ticket("p", ONE, arrived=-1, waited=1.0), now=0, resume=Resume(0, 20))
    freed = lane(replica(run("x", priority=100), slots=3))
    assert [(d.ticket.id, d.replica, d.resume) for d in queue.dispatch(now=2, view=freed)] == [
        ("p", 0, True)
    ]
    assert queue.dispatch(now=2, view=lane(replica(held("p", ONE), run("x"), slots=3))) == []


def test_a_parked_generation_at_its_cap_resumes_when_its_policy_frees_a_slot() -> None:
    """Parked on replica 0 where its policy holds its cap: the forecast has it resume in
    that policy's slot (at 2 s), not the other policy's (0.2 s); the ticket behind it
    of its policy follows in the next one its policy frees (0.5 s decode later)."""
    queue = LaneQueue()
    queue.requeue(ticket("p", ONE), now=0, resume=Resume(0, 25))
    queue.arrive(ticket("c", ONE, max_tokens=10), now=0, view=BUSY)
    view = lane(replica(held("b", ONE), run("x", priority=100, left=10), slots=2))
    # p: 2 s; then 25 tokens (0.5 s); then c's prefill (0.5 s).
    assert queue.predict_ttft("c", now=0, view=view) == pytest.approx(2.0 + 0.5 + 0.5)


@pytest.mark.parametrize(
    ("view", "urgent", "preempt"),
    [
        # Preemption is unchanged: the urgent request parks a capped batch request.
        (lane(parking(held("long", left=1000))), ticket("u", PATIENT), ("long", 0)),
        # Uncapped, the urgent request beside its own policy's long one parks long...
        (
            lane(parking(held("mine", PATIENT, left=1000), LONG)),
            ticket("u", PATIENT),
            ("long", 0),
        ),
        # ... at its cap of 1 it parks nothing to pass it: it waits for its own slot.
        (
            lane(parking(held("mine", replace(PATIENT, max_slots_per_replica=1), left=1000), LONG)),
            ticket("u", replace(PATIENT, max_slots_per_replica=1)),
            None,
        ),
        # ... below its cap on another replica, it parks work there.
        (
            lane(
                parking(held("mine", replace(PATIENT, max_slots_per_replica=1), left=1000), LONG),
                parking(replace(LONG, id="other"), index=1),
            ),
            ticket("u", replace(PATIENT, max_slots_per_replica=1)),
            ("other", 1),
        ),
    ],
)
def test_preemption_under_caps(
    view: LaneView, urgent: Ticket, preempt: tuple[str, int] | None
) -> None:
    queue = LaneQueue()
    assert isinstance(queue.arrive(urgent, now=0, view=view), Admit)
    got = queue.preemption(now=0, view=view)
    assert got == (None if preempt is None else Preempt(urgent, *preempt))


def test_a_capped_ticket_parks_nothing_for_a_slot_its_policy_holds_until_later() -> None:
    """`top`, ahead in order, will take the slot of `mine` when it ends (20 s): from
    then, u's policy holds no slot there. Now it holds its cap, so u parks nothing."""
    capped = replace(PATIENT, max_slots_per_replica=1)
    view = lane(parking(held("mine", capped, left=1000), LONG))
    top = replace(BATCH, name="top", priority=200, max_queue_wait_s=None)
    queue = queue_of(ticket("top", top), view=view)
    assert isinstance(queue.arrive(ticket("u", capped), now=0, view=view), Admit)
    assert queue.preemption(now=0, view=view) is None


@pytest.mark.parametrize(("cap", "ttft"), [(1, 20.32 + 0.5), (None, 20.0 + 0.5)])
def test_a_victim_resuming_in_the_forecast_counts_against_its_cap(
    cap: int | None, ttft: float
) -> None:
    """u parks long, of b's policy; long resumes in u's slot (free at 0.32 s: a step
    after the park, then u's 0.3 s) until 20.32 s. Capped at 1, b waits for that slot;
    uncapped, it takes x's at 20 s."""
    policy = replace(ONE, max_slots_per_replica=cap)
    view = lane(parking(held("long", policy, left=1000), run("x", priority=100, left=1000)))
    queue = queue_of(ticket("b", policy, max_tokens=10), view=view)
    queue.arrive(ticket("u", INTERACTIVE, prompt=100, max_tokens=10), now=0, view=view)
    assert queue.predict_ttft("b", now=0, view=view) == pytest.approx(ttft)
    preempt = queue.preemption(now=0, view=view)
    assert preempt is not None and preempt.victim == "long"


# --- retry-after -------------------------------------------------------------------


def queue_full_retry(tokens_left: int) -> float:
    view = lane(replica(run("r", left=tokens_left)))
    unbounded = replace(BATCH, max_queue_wait_s=None)
    queue = queue_of(ticket("a", unbounded), ticket("b", unbounded), view=view)
    refused = queue.arrive(ticket("c", unbounded), now=0, view=view)
    assert isinstance(refused, Refuse)
    return refused.retry_after_s


def unattainable_retry(tokens_left: int) -> float:
    view = lane(replica(run("r", left=tokens_left)))
    refused = LaneQueue().arrive(ticket("c", INTERACTIVE), now=0, view=view)
    assert isinstance(refused, Refuse)
    return refused.retry_after_s


@pytest.mark.parametrize("retry", [queue_full_retry, unattainable_retry])
def test_retry_after_grows_with_load_within_its_bounds(retry: Callable[[int], float]) -> None:
    loads = [80, 90, 100, 200, 400, 1000, 10_000]
    retries = [retry(left) for left in loads]
    assert retries == sorted(retries)
    assert retries[0] < retries[-1]
    assert min(retries) >= admission.RETRY_AFTER_MIN_S
    assert retries[-1] == admission.RETRY_AFTER_MAX_S


@pytest.mark.parametrize(
    ("waiting", "now", "view", "retry"),
    [
        # The head of BATCH starts when the slot frees (2 s); other policies do not count.
        ([ticket("a", BATCH), ticket("b", BATCH), ticket("x")], 0.0, BUSY, 2.0),
        # ... or earlier, when a BATCH ticket reaches its wait bound (at 5 s).
        ([ticket("a", BATCH), ticket("b", BATCH)], 4.0, lane(replica(run("r", left=500))), 1.0),
        # A BATCH ticket already due to be refused frees its place at once.
        (
            [ticket("a", BATCH), ticket("b", BATCH, arrived=1)],
            5.5,
            BUSY,
            admission.RETRY_AFTER_MIN_S,
        ),
        # No replica: nothing to forecast but the bound (5 s).
        ([ticket("a", BATCH), ticket("b", BATCH)], 0.0, NOBODY, 5.0),
        # Nothing at all to go by.
        (
            [
                ticket("a", replace(BATCH, max_queue_wait_s=None)),
                ticket("b", replace(BATCH, max_queue_wait_s=None)),
            ],
            0.0,
            NOBODY,
            admission.RETRY_AFTER_UNKNOWN_S,
        ),
    ],
)
def test_queue_full_retry_after(
    waiting: list[Ticket], now: float, view: LaneView, retry: float
) -> None:
    queue = queue_of(*waiting, view=BUSY)
    refused = queue.arrive(ticket("c", waiting[0].policy, arrived=now), now=now, view=view)
    assert isinstance(refused, Refuse)
    assert refused.reason == Reason.QUEUE_FULL
    assert refused.retry_after_s == pytest.approx(retry)


def test_queue_timeout_retry_after_is_when_its_turn_would_have_come() -> None:
    queue = queue_of(ticket("a", BATCH), view=BUSY)
    [refused] = queue.expire(now=5.0, view=lane(replica(run("r", left=400))))
    assert refused.retry_after_s == pytest.approx(8.0)
    queue = queue_of(ticket("a", BATCH), view=NOBODY)
    [refused] = queue.expire(now=5.0, view=NOBODY)
    assert refused.retry_after_s == admission.RETRY_AFTER_UNKNOWN_S


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("refusal", "cls", "metadata"),
    [
        (
            Refuse(ticket("t", BATCH), Reason.QUEUE_FULL, 2.0),
            errors.QueueFull,
            {"max_queue_depth": "2", "retry_after_ms": "2000"},
        ),
        (
            Refuse(ticket("t", BATCH), Reason.QUEUE_TIMEOUT, 0.1, waited_s=5.0),
            errors.QueueTimeout,
            {"waited_ms": "5000", "max_queue_wait_ms": "5000", "retry_after_ms": "100"},
        ),
        (
            Refuse(ticket("t", INTERACTIVE), Reason.SLO_UNATTAINABLE, 0.5, predicted_ttft_s=2.5),
            errors.SloUnattainable,
            {"predicted_ttft_ms": "2500", "ttft_target_ms": "2000", "retry_after_ms": "500"},
        ),
        # Its own prefill misses the target: no retry hint, and how long the prompt takes.
        (
            Refuse(
                ticket("t", INTERACTIVE),
                Reason.SLO_UNATTAINABLE,
                None,
                predicted_ttft_s=6.0,
                prefill_s=5.0,
            ),
            errors.SloUnattainable,
            {
                "predicted_ttft_ms": "6000",
                "ttft_target_ms": "2000",
                "prefill_ms": "5000",
                "retryable": "false",
            },
        ),
    ],
)
def test_a_refusal_is_the_error_its_caller_gets(
    refusal: Refuse, cls: type[errors.Overloaded], metadata: dict[str, str]
) -> None:
    err = refusal.error("gemma")
    assert type(err) is cls
    assert err.reason == refusal.reason
    assert err.metadata == {"lane": "gemma", "policy": refusal.ticket.policy.name, **metadata}


def test_a_prompt_too_long_for_its_target_is_told_what_to_do() -> None:
    refusal = Refuse(
        ticket("t", INTERACTIVE), Reason.SLO_UNATTAINABLE, None, predicted_ttft_s=6.0, prefill_s=5.0
    )
    message = refusal.error("gemma").message
    assert "5.00 s" in message and "2.00 s" in message
    assert "Retry" not in message
    assert "shorter prompt" in message and "onOverload: queue" in message


# --- invariants under random traffic -----------------------------------------------


@dataclass
class Engines:
    """What the data plane knows of a Lane of two replicas that can park, moved by hand."""

    slots: int = 2
    # How late waits have measured against the forecast.
    lateness: float = 1.0
    running: dict[str, tuple[int, Running]] = field(default_factory=dict)
    # Parked generations: replica and what they hold.
    parked: dict[str, tuple[int, Running]] = field(default_factory=dict)

    def view(self) -> LaneView:
        def on(index: int, requests: dict[str, tuple[int, Running]]) -> list[Running]:
            return [r for i, r in requests.values() if i == index]

        view = lane(
            *(
                replica(
                    *on(index, self.running),
                    index=index,
                    slots=self.slots,
                    prefill=2000.0,
                    step=0.01,
                    kv_bytes=1,
                    parked=sum(r.kv_tokens for r in on(index, self.parked)),
                    parked_max=3000,
                )
                for index in (0, 1)
            )
        )
        return replace(view, lateness=self.lateness)

    def holding(self, index: int, policy: str) -> int:
        return sum(1 for i, r in self.running.values() if i == index and r.policy == policy)

    def free(self, index: int) -> bool:
        return sum(1 for i, _ in self.running.values() if i == index) < self.slots

    def could_start(self, t: Ticket) -> bool:
        """Whether a replica it may use has a slot free that its policy's cap allows."""
        cap = t.policy.max_slots_per_replica
        where = [self.parked[t.id][0]] if t.id in self.parked else [0, 1]
        return any(
            self.free(index) and (cap is None or self.holding(index, t.policy.name) < cap)
            for index in where
        )

    def start(self, t: Ticket, index: int) -> None:
        assert sum(1 for i, _ in self.running.values() if i == index) < self.slots
        cap = t.policy.max_slots_per_replica
        assert cap is None or self.holding(index, t.policy.name) < cap, t
        _, parked = self.parked.pop(t.id, (index, None))
        self.running[t.id] = (
            index,
            parked
            or Running(
                t.id,
                t.policy.priority,
                t.max_tokens,
                kv_tokens=t.prompt_tokens,
                policy=t.policy.name,
                max_slots_per_replica=cap,
            ),
        )

    def step(self, rng: random.Random) -> None:
        for rid, (index, r) in list(self.running.items()):
            made = rng.randint(0, 8)
            if made >= r.tokens_left:
                del self.running[rid]
            else:
                later = replace(r, tokens_left=r.tokens_left - made, kv_tokens=r.kv_tokens + made)
                self.running[rid] = (index, later)


POLICIES = [
    replace(INTERACTIVE, ttft_target_s=0.5, max_queue_depth=3, max_queue_wait_s=2.0),
    replace(
        PATIENT,
        name="mid",
        priority=50,
        ttft_target_s=1.0,
        max_queue_depth=4,
        max_slots_per_replica=1,
    ),
    replace(BATCH, max_queue_depth=5, max_queue_wait_s=3.0, max_slots_per_replica=1),
    replace(FIFO_POLICY, max_queue_depth=4),
]


def same_without_shortcuts(
    queue: LaneQueue, monkeypatch: pytest.MonkeyPatch, *, now: float, view: LaneView
) -> None:
    """`dispatch`, `preemption` and `expire` decide as they do when they forecast every
    time: where `forecast.may_start`, `may_preempt` and `may_refuse` let them skip the
    forecast, it would have decided nothing. And the gates, the predictions and the
    idle slots, forecast only up to the tickets they ask about (`forecast`'s `until`),
    answer what a forecast of every ticket answers."""

    def asked(q: LaneQueue) -> list[object]:
        out: list[object] = []
        for policy in POLICIES:
            out.append(q.gate(policy, now=now, view=view))
            out.append(q.idle_for(policy, now=now, view=view))
        out.extend(q.predict_ttft(t.id, now=now, view=view) for t in q.tickets())
        return out

    def deciding(name: str) -> Callable[[LaneQueue], object]:
        return lambda q: getattr(q, name)(now=now, view=view)

    full_forecast = admission.queue.forecast
    for run in (deciding("dispatch"), deciding("preemption"), deciding("expire"), asked):
        fast = run(copy.deepcopy(queue))
        with monkeypatch.context() as m:
            for shortcut in ("may_start", "may_preempt", "may_refuse"):
                m.setattr(admission.queue, shortcut, lambda *_, **__: True)
            m.setattr(
                admission.queue,
                "forecast",
                lambda waiting, *, now, view, until=None: full_forecast(
                    waiting, now=now, view=view
                ),
            )
            full = run(copy.deepcopy(queue))
        assert fast == full


@pytest.mark.parametrize("lateness", [1.0, 2.0])
@pytest.mark.parametrize("seed", range(6))
def test_invariants_under_random_traffic(
    seed: int, lateness: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arrivals, cancels, dispatches, expiries and preemptions in random order: no ticket
    starts twice, late, or after it was refused or cancelled; no replica runs more than
    its slots or parks past its bound; fresh tickets never pass their depth bound; and
    starts follow the order, a ticket of a capped policy left behind only when its cap
    keeps it from every free slot; no policy holds more slots of a replica than its
    cap. The same when waits measure late (parking more). Every decision is the one a
    forecast of every ticket makes (`same_without_shortcuts`)."""
    rng = random.Random(seed)
    queue = LaneQueue()
    engines = Engines(lateness=lateness)
    tickets: dict[str, Ticket] = {}
    started: set[str] = set()
    gone: set[str] = set()  # refused or cancelled
    now = 0.0
    counts = {
        "started": 0,
        "refused": 0,
        "cancelled": 0,
        "preempted": 0,
        "resumed": 0,
        "capped": 0,
    }

    def never_late(t: Ticket, *, resume: bool) -> None:
        """A fresh ticket starts within its bounds; a parked one has none."""
        bound = t.policy.max_queue_wait_s
        assert resume or bound is None or t.waited_s <= bound, t
        assert resume or not t.policy.reject_early or now < t.deadline, t

    def dispatch() -> None:
        place = {t.id: i for i, t in enumerate(queue.tickets())}
        starts = queue.dispatch(now=now, view=engines.view())
        places = [place[d.ticket.id] for d in starts if not d.resume]
        assert places == sorted(places)
        due = {r.ticket.id for r in copy.deepcopy(queue).expire(now=now, view=engines.view())}
        ahead = [
            left
            for left in queue.tickets()
            if places and place[left.id] < places[-1] and left.id not in engines.parked
        ]
        for d in starts:
            assert d.ticket.id not in gone
            assert (d.ticket.id in started) == d.resume, d.ticket.id
            assert d.resume == (d.ticket.id in engines.parked)
            never_late(d.ticket, resume=d.resume)
            tickets[d.ticket.id] = d.ticket
            started.add(d.ticket.id)
            engines.start(d.ticket, d.replica)
            counts["resumed" if d.resume else "started"] += 1
        # A fresh ticket left waiting ahead of one that started is due to be refused,
        # or its policy's cap keeps it from every slot left free.
        for left in ahead:
            if left.policy.max_slots_per_replica is None:
                assert left.id in due, left.id
            else:
                assert left.id in due or not engines.could_start(left), left.id
                counts["capped"] += left.id not in due

    for step in range(600):
        now += rng.choice([0.0, 0.01, 0.05, 0.2])
        engines.step(rng)
        if step % 4 == 0:
            same_without_shortcuts(queue, monkeypatch, now=now, view=engines.view())
        op = rng.random()
        if op < 0.4:
            policy = rng.choice(POLICIES)
            # Urgent work is short; the rest holds slots longer.
            longest = 60 if policy.priority else 400
            t = ticket(
                f"t{step}",
                policy,
                arrived=now,
                prompt=rng.randint(10, 1500),
                max_tokens=rng.randint(1, longest),
                prefer=rng.choice([None, 0, 1]),
            )
            tickets[t.id] = t
            if isinstance(queue.arrive(t, now=now, view=engines.view()), Refuse):
                assert t.id not in queue
                gone.add(t.id)
                counts["refused"] += 1
            dispatch()
        elif op < 0.5 and len(queue):
            left = rng.choice(queue.tickets())
            assert queue.cancel(left.id)
            engines.parked.pop(left.id, None)
            gone.add(left.id)
            counts["cancelled"] += 1
        elif op < 0.7:
            dispatch()
        elif op < 0.85:
            for refused in queue.expire(now=now, view=engines.view()):
                assert refused.ticket.id not in gone
                assert refused.ticket.id not in started  # a parked one is never refused
                engines.parked.pop(refused.ticket.id, None)
                gone.add(refused.ticket.id)
                counts["refused"] += 1
        else:
            preempt = queue.preemption(now=now, view=engines.view())
            if preempt is not None:
                index, victim = engines.running.pop(preempt.victim)
                assert index == preempt.replica
                assert victim.priority < preempt.ticket.policy.priority
                bound = engines.view().replicas[index]
                assert bound.parked_bytes + victim.kv_tokens <= bound.parked_bytes_max
                engines.parked[victim.id] = (index, victim)
                queue.requeue(tickets[victim.id], now=now, resume=Resume(index, victim.tokens_left))
                assert preempt.ticket.id not in started | gone
                never_late(preempt.ticket, resume=False)
                tickets[preempt.ticket.id] = preempt.ticket
                started.add(preempt.ticket.id)
                engines.start(preempt.ticket, index)
                counts["preempted"] += 1
        for policy in POLICIES:
            fresh = [t for t in queue.tickets() if t.policy == policy and t.id not in started]
            assert len(fresh) <= policy.max_queue_depth
        assert not {t.id for t in queue.tickets()} & gone
    # The traffic exercised every path.
    assert all(counts.values()), counts


def test_a_preempting_start_waits_for_the_measured_park() -> None:
    """The engine parks between two steps and goes on with the next (0.02 s) before the
    urgent request reaches it: the request starts that much later."""
    slow = lane(replace(parking(LONG), park_s=1.0))
    queue = LaneQueue()
    decision = queue.arrive(ticket("u", PATIENT), now=0, view=slow)
    assert decision == Admit(pytest.approx(1.0 + 0.02 + 0.5))
    assert queue.preemption(now=0, view=slow) == Preempt(ticket("u", PATIENT), "long", 0)
    # A park so slow that the prefill after it misses: parking would not save it.
    slower = lane(replace(parking(LONG), park_s=1.49))
    queue = LaneQueue()
    assert isinstance(queue.arrive(ticket("u", PATIENT), now=0, view=slower), Admit)
    assert queue.preemption(now=0, view=slower) is None


# The slot frees in 1 s (50 tokens at 0.02 s); 0.5 s of prefill: a first token at 1.5 s
# by waiting, against a 2 s target.
ON_TIME = replace(LONG, tokens_left=50)


@pytest.mark.parametrize(
    ("lateness", "decision", "preempt"),
    [
        # The forecast as it is: waiting meets the target; nothing is parked.
        (1.0, Admit(1.5, waits=True), None),
        # Waits measured 30% late: 1.95 s still meets it.
        (1.3, Admit(1.5, waits=True), None),
        # 40% late: 2.1 s may miss it. Parking the batch generation (free: no park time
        # measured) starts it a step later (0.02 s), its first token after its prefill.
        (1.4, Admit(0.52), Preempt(ticket("u", INTERACTIVE), "long", 0)),
        (3.0, Admit(0.52), Preempt(ticket("u", INTERACTIVE), "long", 0)),
    ],
)
def test_a_forecast_wait_scaled_by_its_measured_lateness_decides_preemption(
    lateness: float, decision: Admit, preempt: Preempt | None
) -> None:
    view = replace(lane(parking(ON_TIME)), lateness=lateness)
    queue = LaneQueue()
    assert queue.arrive(ticket("u", INTERACTIVE), now=0, view=view) == decision
    assert queue.preemption(now=0, view=view) == preempt
    # A ticket that has waited a while: 1 s left of its 2 s, its slot frees in 0.44 s
    # and its prefill takes 0.5 s (a first token 0.06 s before the deadline, more than
    # `WAIT_STEPS` steps). Scaled, the forecast may miss; it parks.
    queue = queue_of(ticket("w", INTERACTIVE), view=lane(parking(ON_TIME)))
    later = replace(lane(parking(replace(LONG, tokens_left=22))), lateness=lateness)
    waited = queue.preemption(now=1.0, view=later)
    assert (waited is not None) == (lateness > 1.0)


@pytest.mark.parametrize(("tokens_left", "parks"), [(22, False), (24, True)])
def test_a_wait_due_within_two_steps_of_its_deadline_parks_work(
    tokens_left: int, parks: bool
) -> None:
    """The engine moves in whole steps (0.02 s here), and a wait meets two step ends
    (its slot frees, its prompt's last chunk runs): a first token forecast within two
    steps of the deadline may miss it, with waits measured on time (lateness 1). The
    slot frees in 0.44 s or 0.48 s, the prefill takes 0.5 s, 1 s is left."""
    queue = queue_of(ticket("w", INTERACTIVE), view=lane(parking(ON_TIME)))
    later = lane(parking(replace(LONG, tokens_left=tokens_left)))
    assert (queue.preemption(now=1.0, view=later) is not None) == parks


@pytest.mark.parametrize(("park_s", "parks"), [(0.9, True), (1.0, False)])
def test_a_scaled_forecast_parks_work_only_to_start_sooner(park_s: float, parks: bool) -> None:
    """Waiting gives a first token at 1.5 s, which may be 2.1 s. Parking first takes
    `park_s`, then the 0.5 s prefill: 1.4 s is sooner, and parks; 1.5 s gains nothing
    (though it meets the deadline), and the batch generation runs on."""
    view = replace(lane(replace(parking(ON_TIME), park_s=park_s)), lateness=1.4)
    queue = LaneQueue()
    queue.arrive(ticket("u", INTERACTIVE), now=0, view=view)
    assert (queue.preemption(now=0, view=view) is not None) == parks


@pytest.mark.parametrize("lateness", [1.0, 1.4, 3.0])
def test_refusals_and_predictions_read_the_forecast_unscaled(lateness: float) -> None:
    """However late waits have measured, a ticket is refused (or spilled) only when the
    forecast itself says it misses, with the same prediction and retry-after; one it
    says meets the target waits when nothing can be parked for it."""
    # Nothing to park (the running request has the same priority): 1.5 s by waiting.
    same = replace(ON_TIME, priority=INTERACTIVE.priority)
    view = replace(lane(parking(same)), lateness=lateness)
    queue = LaneQueue()
    assert queue.arrive(ticket("t", INTERACTIVE), now=0, view=view) == Admit(1.5, waits=True)
    assert queue.expire(now=0, view=view) == []
    assert queue.predict_ttft("t", now=0, view=view) == pytest.approx(1.5)
    # A second on, as forecast: its slot frees in 0.5 s, its first token at 2 s.
    later = replace(lane(parking(replace(same, tokens_left=25))), lateness=lateness)
    assert queue.expire(now=1.0, view=later) == []
    # With a spillover Lane it stays here, the forecast meeting its target.
    spilling = LaneQueue()
    assert spilling.arrive(ticket("t", INTERACTIVE), now=0, view=view, spill=True) == Admit(
        1.5, waits=True
    )
    # The forecast misses (2.5 s): refused as without a measured lateness.
    busy = replace(BUSY, lateness=lateness)
    assert LaneQueue().arrive(ticket("t", INTERACTIVE), now=0, view=busy) == Refuse(
        ticket("t", INTERACTIVE), Reason.SLO_UNATTAINABLE, 0.5, predicted_ttft_s=2.5
    )


@pytest.mark.parametrize("lateness", [0.9, 0.0, -1.0, math.inf, math.nan])
def test_a_lateness_below_one_or_not_finite_is_refused(lateness: float) -> None:
    with pytest.raises(ValueError, match="lateness must be a finite factor >= 1"):
        LaneView(lateness=lateness)


@pytest.mark.parametrize(
    ("turn", "lateness", "parked", "waiting_ttft"),
    [
        # 1.6 s turns: after three parks, waiting for an interactive slot meets the
        # target (1.6 s + 0.1 s prefill, for the third in line 0.2 s more), so the
        # fourth batch generation runs on.
        (80, 1.0, ["b0", "b1", "b2"], 1.7),
        # ... unless waits have measured 25% later than forecast: 1.7 s may then be
        # 2.1 s, and the fourth parks the last batch generation. The two left wait for
        # an interactive turn (there is nothing of lower priority left to park), and are
        # not refused: the forecast says they meet the target.
        (80, 1.25, ["b0", "b1", "b2", "b3"], 1.7),
        # 2 s turns: waiting misses, so every batch generation is parked before any
        # interactive request waits; the two left then miss whatever happens.
        (100, 1.0, ["b0", "b1", "b2", "b3"], 2.1),
    ],
)
def test_a_burst_of_urgent_requests_parks_lower_priority_work_while_waiting_misses(
    turn: int, lateness: float, parked: list[str], waiting_ttft: float
) -> None:
    """Four batch generations hold the four slots; six interactive requests arrive at
    once (the mixed burst of bench/overload.py). An interactive request parks a batch
    generation when waiting for any slot may miss its target, and only then."""
    urgent = replace(INTERACTIVE, max_queue_depth=32)
    batch = [run(f"b{i}", left=1000, kv=100 + i) for i in range(4)]
    view = replace(lane(parking(*batch, bound=10_000)), lateness=lateness)
    queue = LaneQueue()
    tickets = [ticket(f"i{i}", urgent, prompt=100, max_tokens=turn) for i in range(6)]
    refused = {t.id for t in tickets if isinstance(queue.arrive(t, now=0, view=view), Refuse)}
    victims = []
    running = list(batch)
    started = []
    while (preempt := queue.preemption(now=0, view=view)) is not None:
        victims.append(preempt.victim)
        started.append(preempt.ticket.id)
        # The data plane parks the victim and starts the urgent request in its slot.
        held = next(r for r in running if r.id == preempt.victim)
        running[running.index(held)] = run(preempt.ticket.id, priority=100, left=turn, kv=100)
        queue.requeue(ticket(held.id, BATCH), now=0, resume=Resume(0, held.tokens_left))
        view = replace(
            lane(parking(*running, bound=10_000, parked=1000 * len(victims))), lateness=lateness
        )
    assert sorted(victims) == parked
    refused |= {r.ticket.id for r in queue.expire(now=0, view=view)}
    left = {t.id for t in tickets} - set(started)
    assert refused == (set() if waiting_ttft <= 2.0 else left)
    # Those that wait start as interactive turns end, all at 1.6 s (2 s): the replica
    # prefills their prompts one after another, 0.1 s each.
    predicted = sorted(queue.predict_ttft(t, now=0, view=view) or 0.0 for t in left - refused)
    assert predicted == pytest.approx([waiting_ttft + 0.1 * k for k in range(len(predicted))])


def test_a_running_request_frees_its_slot_at_its_own_policys_rate() -> None:
    """The replica's figures say 7 tokens a step at 0.02 s (batch jobs copying their
    prompt); the chat turn holding the slot measured 0.05 s a token: its 50 tokens take
    2.5 s, and a ticket behind it is predicted accordingly."""
    fast = lane(replica(run("chat", priority=100, left=50), per_step=7.0))
    own = lane(
        replica(replace(run("chat", priority=100, left=50), rate=TokenRate(0.05)), per_step=7.0)
    )
    queue = LaneQueue()
    queue.arrive(ticket("b", BATCH, prompt=100), now=0, view=fast)
    assert queue.predict_ttft("b", now=0, view=fast) == pytest.approx(50 * 0.02 / 7 + 0.1)
    assert queue.predict_ttft("b", now=0, view=own) == pytest.approx(50 * 0.05 + 0.1)
    # A waiting ticket's own service counts at its policy's rate too: b starts when the
    # chat turn ends (2.5 s from now), prefills 0.1 s and decodes its 50 tokens at
    # 0.01 s each (0.5 s); c starts then, and its first token follows its own prefill.
    view = replace(own, rates={"batch": TokenRate(0.01)})
    queue.arrive(ticket("c", BATCH, arrived=0.5, prompt=100), now=0.5, view=view)
    assert queue.predict_ttft("c", now=0.5, view=view) == pytest.approx(2.5 + 0.6 + 0.1)


@pytest.mark.parametrize(("draft_batch_max", "preempts"), [(None, False), (2, False), (1, True)])
def test_a_batch_too_large_to_draft_decodes_a_token_a_step(
    draft_batch_max: int | None, preempts: bool
) -> None:
    """Two batch jobs hold both slots; they measured 0.01 s a token while drafting
    (7 tokens a step at 0.07 s), so their 100 tokens end in 1 s and an interactive turn
    behind them meets its 2 s target waiting. Once it waits, the batch the replica
    will run is 2 (its slots): where the SpecPair drafts only up to 1 sequence, a step
    yields one token, the jobs end in 100 x 0.07 = 7 s, and the turn preempts one."""
    jobs = [replace(run(f"b{k}", left=100), rate=TokenRate(0.01), policy="batch") for k in range(2)]
    view = lane(
        replace(
            parking(*jobs, bound=10_000),
            step_s=0.07,
            tokens_per_step=7.0,
            draft_batch_max=draft_batch_max,
        )
    )
    queue = LaneQueue()
    decision = queue.arrive(ticket("chat", INTERACTIVE, prompt=100), now=0, view=view)
    # Preempting, it starts in its victim's slot a step (0.07 s) from now: then its
    # prompt's 0.1 s.
    assert decision == (
        Admit(pytest.approx(0.07 + 0.1)) if preempts else Admit(pytest.approx(1.1), True)
    )
    preempt = queue.preemption(now=0, view=view)
    assert (preempt is not None) == preempts


@pytest.mark.parametrize(("measured_at", "preempts"), [(None, False), (2.0, False), (1.0, True)])
def test_a_policys_rate_is_scaled_to_the_batch_it_will_run_at(
    measured_at: float | None, preempts: bool
) -> None:
    """Two batch jobs hold both slots and measured 0.01 s a token drafting: their 100
    tokens end in 1 s, and an interactive turn behind them meets its 2 s target waiting.
    Measured at a batch of 1, though, and drafting steps take 40 ms alone and 100 ms at
    two (draft rows in each): at 2 they end in 2.5 s, and the turn preempts one. At
    a batch not known (a rate read off runs in flight), as measured."""
    rate = TokenRate(0.01, batch=measured_at)
    jobs = [replace(run(f"b{k}", left=100), rate=rate, policy="batch") for k in range(2)]
    view = lane(
        replace(
            parking(*jobs, bound=10_000),
            draft_step_s=0.04,
            draft_step_growth_s=0.06,
            tokens_per_step=4.0,
            draft_batch_max=2,
        )
    )
    queue = LaneQueue()
    decision = queue.arrive(ticket("chat", INTERACTIVE, prompt=100), now=0, view=view)
    # Preempting: a drafting step at two (0.1 s), then its prompt's 0.1 s.
    assert decision == (
        Admit(pytest.approx(0.1 + 0.1)) if preempts else Admit(pytest.approx(1.1), True)
    )
    assert (queue.preemption(now=0, view=view) is not None) == preempts


def test_a_policy_at_its_cap_adds_nothing_to_the_batch() -> None:
    """A batch job capped at one slot a replica runs drafting (0.01 s a token, the
    SpecPair drafts up to 1 sequence); another waits for that slot, the other stays
    free: the replica runs one sequence meanwhile, so the job ends in 1 s and the
    next one's first token comes 0.1 s later, not at the undrafted 7.1 s."""
    capped = replace(BATCH, max_slots_per_replica=1)
    job = replace(
        run("b0", left=100), rate=TokenRate(0.01), policy="batch", max_slots_per_replica=1
    )
    view = lane(replace(replica(job, slots=2), step_s=0.07, tokens_per_step=7.0, draft_batch_max=1))
    decision = LaneQueue().arrive(ticket("b1", capped, prompt=100), now=0, view=view)
    assert decision == Admit(pytest.approx(1.1), True)


# --- the prefill line ----------------------------------------------------------------


def prefilling(id: str, left_s: float, *, left: int = 100) -> Running:
    """A run started whose first token is due in `left_s`."""
    return replace(run(id, left=left), prefill_left_s=left_s)


@pytest.mark.parametrize(("overhead", "share"), [(0.0, 1.0), (0.05, 1.0), (0.0, 0.5)])
def test_simultaneous_starts_on_one_replica_come_one_prefill_apart(
    overhead: float, share: float
) -> None:
    """Six requests arrive at once for six idle slots: the engine prefills their
    prompts one after another, so the k-th first token comes after the k - 1 before
    it, each 0.1 s of prompt plus the start overhead; or, where the engine was measured
    to overlap them (`line_share`), that share of it apart."""
    view = lane(replace(replica(slots=6), start_overhead_s=overhead, line_share=share))
    queue = LaneQueue()
    each = 0.1 + overhead
    tickets = [ticket(f"t{k}", prompt=100) for k in range(6)]
    predicted = [queue.arrive(t, now=0, view=view) for t in tickets]
    assert predicted == [Admit(pytest.approx(each + each * share * k)) for k in range(6)]
    started = queue.dispatch(now=0, view=view)
    assert [(d.ticket.id, d.replica) for d in started] == [(t.id, 0) for t in tickets]
    assert [d.queue_s for d in started] == pytest.approx([each * share * k for k in range(6)])
    assert [d.prefill_s for d in started] == pytest.approx([each] * 6)


def test_the_first_start_on_an_idle_replica_is_forecast_as_a_prompt_alone() -> None:
    """A prompt alone on an idle replica was measured at 0.04 s, one beside others at
    0.1 s: of three tickets arriving at once the first (alone) has its first token at
    0.04 s, and the two behind it, whose steps they share, take 0.1 s each after it on
    the prefill line. A replica that runs anything has no prompt alone."""
    lone = replace(replica(slots=3), lone_prefill_tokens_per_s=2500.0)
    queue = LaneQueue()
    tickets = [ticket(f"t{k}", prompt=100) for k in range(3)]
    predicted = [queue.arrive(t, now=0, view=lane(lone)) for t in tickets]
    assert predicted == [Admit(pytest.approx(s)) for s in (0.04, 0.14, 0.24)]
    started = queue.dispatch(now=0, view=lane(lone))
    assert [(d.alone, d.prefill_s) for d in started] == [
        (True, pytest.approx(0.04)),
        (False, pytest.approx(0.1)),
        (False, pytest.approx(0.1)),
    ]
    busy = replace(lone, running=(run("r"),))
    decision = LaneQueue().arrive(ticket("t", prompt=100), now=0, view=lane(busy))
    assert decision == Admit(pytest.approx(0.1))


@pytest.mark.parametrize(
    ("running", "ttft"),
    [
        # Its first token has come: the line is free.
        (prefilling("p", 0.0), 0.1),
        # Its first token is due in 0.3 s: the new prompt is prefilled after it.
        (prefilling("p", 0.3), 0.4),
    ],
)
def test_a_run_still_prefilling_delays_a_new_start(running: Running, ttft: float) -> None:
    view = lane(replica(running, slots=2))
    assert LaneQueue().arrive(ticket("t", prompt=100), now=0, view=view) == Admit(
        pytest.approx(ttft)
    )


@pytest.mark.parametrize(
    ("running_kv", "prompt", "ttft"),
    [
        # A long prompt due in 2 s: a short one (`api.prefill`) goes before it.
        (600, 10, 0.01),
        # ... a long one after it.
        (600, 100, 2.1),
        # A short one due in 2 s: a short one waits for it, as any does.
        (10, 10, 2.01),
        (10, 100, 2.1),
    ],
)
def test_a_short_prompt_waits_only_behind_short_ones(
    running_kv: int, prompt: int, ttft: float
) -> None:
    """The engine prefills prompts of at most 64 tokens before longer ones (`api.prefill`):
    so does the forecast's prefill line."""
    running = replace(prefilling("p", 2.0), kv_tokens=running_kv)
    view = lane(replica(running, slots=3))
    queue = LaneQueue()
    assert queue.arrive(ticket("t", prompt=prompt), now=0, view=view) == Admit(pytest.approx(ttft))


def test_a_run_still_prefilling_frees_its_slot_after_its_first_token_and_decode() -> None:
    """0.3 s to its first token, then 100 tokens at 0.02 s: the ticket behind it
    starts at 2.3 s and its prompt takes 0.1 s."""
    view = lane(replica(prefilling("p", 0.3)))
    decision = LaneQueue().arrive(ticket("t", prompt=100), now=0, view=view)
    assert decision == Admit(pytest.approx(2.4), waits=True)


def test_two_replicas_queue_their_prefills_independently() -> None:
    """Starts alternate between the replicas (the least loaded first); each replica's
    line holds only its own prompts, and a run prefilling on one (due in 0.05 s)
    delays only that one's."""
    view = lane(
        replica(prefilling("p", 0.05), index=0, slots=3),
        replica(run("q"), index=1, slots=3),
    )
    queue = LaneQueue()
    tickets = [ticket(f"t{k}", prompt=100) for k in range(4)]
    predicted = [queue.arrive(t, now=0, view=view) for t in tickets]
    started = queue.dispatch(now=0, view=view)
    assert [d.replica for d in started] == [0, 1, 0, 1]
    assert predicted == [Admit(pytest.approx(s)) for s in (0.15, 0.1, 0.25, 0.2)]
    assert [d.queue_s for d in started] == pytest.approx([0.05, 0.0, 0.15, 0.1])


def test_a_resume_neither_waits_in_the_line_nor_holds_it() -> None:
    """A parked generation resumes with its KV: no prompt to prefill, so a fresh start
    beside it has its first token after its own prefill only."""
    view = lane(replica(slots=2))
    queue = LaneQueue()
    queue.requeue(ticket("parked"), now=0, resume=Resume(0, tokens_left=50))
    assert queue.arrive(ticket("t", prompt=100), now=0, view=view) == Admit(pytest.approx(0.1))
    resumed, fresh = queue.dispatch(now=0, view=view)
    assert (resumed.resume, resumed.queue_s, resumed.prefill_s) == (True, 0.0, 0.0)
    assert (fresh.ticket.id, fresh.queue_s) == ("t", 0.0)


@pytest.mark.parametrize(("due", "preempts"), [(0.5, True), (1.6, False)])
def test_a_preempting_start_waits_in_the_prefill_line_too(due: float, preempts: bool) -> None:
    """An urgent run prefills in the other slot, its first token due in `due`; the
    urgent ticket's 0.5 s prompt comes after it even in a parked batch run's slot: at
    1.0 s it meets its 2 s target by parking; at 2.1 s it would not, and parking
    would not save it."""
    urgent = replace(prefilling("urgent", due), priority=100)
    view = lane(parking(LONG, urgent))
    queue = LaneQueue()
    decision = queue.arrive(ticket("u", PATIENT), now=0, view=view)
    assert isinstance(decision, Admit)
    preempt = queue.preemption(now=0, view=view)
    if preempts:
        assert decision.predicted_ttft_s == pytest.approx(due + 0.5)
        assert preempt == Preempt(ticket("u", PATIENT), "long", 0)
        # It starts a step (0.02 s) after the park, and waits in the line from there.
        assert (preempt.queue_s, preempt.prefill_s) == pytest.approx((due - 0.02, 0.5))
    else:
        assert preempt is None


@pytest.mark.parametrize(("prompt", "admitted"), [(400, True), (600, False)])
def test_a_preempting_start_has_the_margin_of_the_replica_it_starts_on(
    prompt: int, admitted: bool
) -> None:
    """The slot that frees first is on a fast replica (0.01 s steps, busy for 10 s with
    work it may not park); the batch run it parks is on a slow one (0.5 s steps). The
    ticket starts there a step after the park (0.5 s), its first token after its
    prefill: it may come `WAIT_STEPS` of that replica's steps (1 s) late, not two of
    the other's (0.02 s). A first token at 0.9 s meets the 2 s target by more; at
    1.1 s it is refused at arrival."""
    view = lane(
        replica(run("hi", priority=100, left=1000, kv=10), index=0, step=0.01),
        replica(run("lo", left=100, kv=10), index=1, step=0.5, parked_max=3000),
    )
    decision = LaneQueue().arrive(ticket("t", INTERACTIVE, prompt=prompt), now=0, view=view)
    assert isinstance(decision, Admit) == admitted, decision


# A rollout of contextPerSlot: replica 0 an old engine of 512 tokens a slot.
OLD = replace(replica(index=0), context_per_slot=512)


@pytest.mark.parametrize(
    ("replicas", "starting", "needs", "fitting"),
    [
        # The Lane's context went 512 -> 2048: a request of 725 tokens goes to the new
        # replica only, and waits for it while it starts, rather than meet the old
        # engine's refusal; a short one goes anywhere.
        ((OLD, replace(replica(index=1), context_per_slot=2048)), None, 725, {1}),
        ((OLD,), 2048, 725, set()),
        ((OLD,), 2048, 500, None),
        ((OLD, replace(replica(index=1), context_per_slot=2048)), None, 100, None),
        # No replica, ready or starting, holds it: it goes where it would, and that
        # engine's count (not the estimate) answers.
        ((OLD,), None, 725, None),
        ((OLD,), 600, 725, None),
        # Lowered 2048 -> 512: the old replica serves what only it holds while it
        # serves (after that an engine of the new size refuses it).
        ((replace(OLD, context_per_slot=2048), replace(OLD, index=1)), None, 725, {0}),
        # Not said (an upstream's, a status from before it was recorded): any.
        ((replica(index=0), OLD), None, 725, {0}),
        # A ticket that says nothing needs nothing.
        ((OLD,), 2048, 0, None),
    ],
)
def test_a_ticket_starts_only_where_its_context_fits(
    replicas: tuple[ReplicaView, ...],
    starting: int | None,
    needs: int,
    fitting: set[int] | None,
) -> None:
    view = LaneView(replicas=replicas, starting_context=starting)
    t = replace(ticket("t", prompt=needs - 16, max_tokens=16), context_tokens=needs)
    assert view.fitting(t) == (None if fitting is None else frozenset(fitting))
    queue = queue_of(t, view=view)
    started = [d.replica for d in queue.dispatch(now=0.0, view=view)]
    assert started == ([] if fitting == set() else [min(fitting or {0})])


def test_a_ticket_waits_for_a_replica_its_context_fits_not_the_old_one() -> None:
    """The old replica (512 a slot) is idle, the new one (2048) busy: a request of 725
    tokens waits for the new one's slot; one of 300 starts on the old one now."""
    new = replace(replica(run("r"), index=1), context_per_slot=2048)
    view = LaneView(replicas=(OLD, new))
    long = replace(ticket("long", prompt=709, max_tokens=16), context_tokens=725)
    short = replace(ticket("short", prompt=284, max_tokens=16, arrived=0.1), context_tokens=300)
    queue = queue_of(long, short, view=view)
    assert [(d.ticket.id, d.replica) for d in queue.dispatch(now=0.2, view=view)] == [("short", 0)]
    freed = LaneView(replicas=(OLD, replace(new, running=())))
    assert [(d.ticket.id, d.replica) for d in queue.dispatch(now=3.0, view=freed)] == [("long", 1)]


def test_an_urgent_ticket_parks_work_only_where_its_context_fits() -> None:
    """Both replicas run batch work it may park; the old one's is the cheaper victim,
    but its slots hold 512 tokens, not the 725 the urgent ticket needs."""
    old = replace(parking(run("cheap", kv=10)), context_per_slot=512)
    new = replace(parking(run("dear", kv=90), index=1), context_per_slot=2048)
    view = LaneView(replicas=(old, new))
    urgent = replace(ticket("u", INTERACTIVE, prompt=709, max_tokens=16), context_tokens=725)
    queue = queue_of(urgent, view=view)
    preempt = queue.preemption(now=0.0, view=view)
    assert preempt is not None and (preempt.victim, preempt.replica) == ("dear", 1)


@pytest.mark.parametrize(
    ("restarted", "reason", "expected"),
    [
        (False, Reason.SLO_UNATTAINABLE, errors.SloUnattainable),
        (False, Reason.QUEUE_TIMEOUT, errors.QueueTimeout),
        # Handed back by a replica that failed before its first token: the bound passed
        # while a replica was lost, not under load. A 503 with the same retry hint.
        (True, Reason.SLO_UNATTAINABLE, errors.ReplicaFailed),
        (True, Reason.QUEUE_TIMEOUT, errors.ReplicaFailed),
        # Its caller's own deadline is its caller's, whatever held it up.
        (True, Reason.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    ],
)
def test_a_bound_missed_after_a_failed_replica_is_unavailable_not_overload(
    restarted: bool, reason: Reason, expected: type[errors.BlazarError]
) -> None:
    policy = replace(INTERACTIVE, max_queue_wait_s=5.0)
    t = replace(ticket("t", policy), restarted=restarted, caller_deadline=10.0)
    refusal = Refuse(t, reason, 1.5, predicted_ttft_s=20.0)
    err = refusal.error("l")
    assert type(err) is expected
    # Counted as the caller is told: a failure never reads as load on /metrics.
    assert refusal.counted_reason == err.reason
    if expected is errors.ReplicaFailed:
        assert (err.code, err.reason) == ("UNAVAILABLE", "REPLICA_FAILED")
        assert err.metadata[errors.RETRY_AFTER_KEY] == "1500"
        assert "failed before its first token" in str(err)
