"""Admission and the caller's own deadline (a gRPC deadline, `Ticket.caller_deadline`),
as tables: a request that would wait past it is refused at arrival; one whose deadline
passes while it waits leaves then; no work is parked for one that cannot end by it."""

from __future__ import annotations

import math

import pytest

from blazar.api import errors
from blazar.dataplane.admission import (
    FIFO_POLICY,
    Admit,
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
)

# Priority 100 with a 2 s target, queued rather than refused for it (onOverload: queue).
URGENT = Policy(name="urgent", priority=100, ttft_target_s=2.0)


def ticket(
    id: str,
    policy: Policy = FIFO_POLICY,
    *,
    arrived: float = 0.0,
    prompt: int = 500,
    max_tokens: int = 50,
    deadline: float = math.inf,
) -> Ticket:
    """`deadline`: seconds after its arrival that its caller waits (inf: no deadline)."""
    return Ticket(id, policy, arrived, prompt, max_tokens, caller_deadline=arrived + deadline)


def replica(*running: Running, slots: int = 1, parked_max: int = 0) -> ReplicaView:
    """Prefill 1000 tokens/s, a decode step 0.02 s."""
    return ReplicaView(
        index=0,
        slots=max(slots, len(running)),
        running=running,
        prefill_tokens_per_s=1000.0,
        step_s=0.02,
        kv_bytes_per_token=10,
        parked_bytes_max=parked_max,
    )


IDLE = LaneView(replicas=(replica(),))
# Its slot frees in 100 x 0.02 = 2 s: a 500-token prompt's first token at 2.5 s.
BUSY = LaneView(replicas=(replica(Running("r", 0, tokens_left=100, kv_tokens=100)),))
# A batch generation with 1000 tokens left (20 s) that an urgent request may park.
PARKABLE = LaneView(
    replicas=(replica(Running("long", 0, tokens_left=1000, kv_tokens=100), parked_max=10_000),)
)
NOBODY = LaneView()


@pytest.mark.parametrize(
    ("view", "deadline", "admitted"),
    [
        # The first token would come at 2.5 s.
        (BUSY, 2.0, False),
        (BUSY, 2.5, True),
        (BUSY, 3.0, True),
        # An idle slot starts it at once, at its best, whatever its prefill is predicted
        # to take: refusing would shed no load (as for a TTFT target).
        (IDLE, 0.1, True),
        # Nothing to forecast from: it waits, until its deadline.
        (NOBODY, 0.1, True),
        # No deadline.
        (BUSY, math.inf, True),
    ],
)
def test_arrival_refuses_a_first_token_predicted_past_the_callers_deadline(
    view: LaneView, deadline: float, admitted: bool
) -> None:
    queue = LaneQueue()
    decision = queue.arrive(ticket("t", deadline=deadline), now=0.0, view=view)
    assert ("t" in queue) == admitted
    if admitted:
        assert isinstance(decision, Admit)
        return
    assert isinstance(decision, Refuse)
    assert decision.reason == Reason.DEADLINE_EXCEEDED
    assert decision.predicted_ttft_s == pytest.approx(2.5)
    err = decision.error("solo")
    assert isinstance(err, errors.DeadlineExceeded) and err.code == "DEADLINE_EXCEEDED"
    assert "would come after 2.50 s" in err.message and "deadline of 2.00 s" in err.message
    assert err.metadata["predicted_ttft_ms"] == "2500"
    assert err.metadata["deadline_ms"] == "2000"


def test_a_deadline_already_passed_is_refused_even_on_an_idle_slot() -> None:
    """gRPC's time_remaining() of 0: the caller is gone, nothing starts for it."""
    queue = LaneQueue()
    decision = queue.arrive(ticket("t", arrived=1.0, deadline=0.0), now=1.0, view=IDLE)
    assert isinstance(decision, Refuse) and decision.reason == Reason.DEADLINE_EXCEEDED
    assert "t" not in queue
    assert queue.dispatch(now=1.0, view=IDLE) == []


def test_a_waiting_ticket_leaves_at_its_callers_deadline() -> None:
    """No replica serves (none to forecast from): it waits, `next_expiry` is its
    deadline, and there it is refused, no sooner, even with an idle slot by then."""
    queue = LaneQueue()
    assert isinstance(queue.arrive(ticket("t", deadline=3.0), now=0.0, view=NOBODY), Admit)
    other = ticket("other", arrived=0.5)
    assert isinstance(queue.arrive(other, now=0.5, view=NOBODY), Admit)
    assert queue.next_expiry() == 3.0
    assert queue.expire(now=2.999, view=NOBODY) == []
    assert "t" in queue
    (refused,) = queue.expire(now=3.0, view=NOBODY)
    assert (refused.ticket.id, refused.reason) == ("t", Reason.DEADLINE_EXCEEDED)
    assert refused.predicted_ttft_s is None and refused.waited_s == pytest.approx(3.0)
    err = refused.error("solo")
    assert isinstance(err, errors.DeadlineExceeded)
    assert "passed while the request waited 3.00 s" in err.message
    assert err.metadata["waited_ms"] == "3000"
    assert "t" not in queue and "other" in queue
    assert queue.next_expiry() is None
    # What it would have started in goes to the next.
    assert [d.ticket.id for d in queue.dispatch(now=3.0, view=IDLE)] == ["other"]


def test_a_ticket_past_its_deadline_never_starts_on_a_slot_that_frees() -> None:
    queue = LaneQueue()
    assert isinstance(queue.arrive(ticket("t", deadline=1.0), now=0.0, view=NOBODY), Admit)
    assert queue.dispatch(now=1.0, view=IDLE) == []
    assert [r.reason for r in queue.expire(now=1.0, view=IDLE)] == [Reason.DEADLINE_EXCEEDED]


@pytest.mark.parametrize(
    ("deadline", "parks"),
    [
        # Parked: first token at 0.02 + 0.5 s, its 50 tokens 1 s later: 1.52 s.
        (math.inf, True),
        (1.6, True),
        # Its first token would come in time, but not its end: nothing is parked for it,
        # and waiting (20 s) would take it past its deadline: refused at once.
        (1.4, False),
    ],
)
def test_no_work_is_parked_for_a_request_that_cannot_end_by_its_deadline(
    deadline: float, parks: bool
) -> None:
    queue = LaneQueue()
    urgent = ticket("u", URGENT, deadline=deadline)
    decision = queue.arrive(urgent, now=0.0, view=PARKABLE)
    preempt = queue.preemption(now=0.0, view=PARKABLE)
    if parks:
        assert isinstance(decision, Admit)
        assert preempt == Preempt(urgent, victim="long", replica=0)
    else:
        assert preempt is None
        assert isinstance(decision, Refuse) and decision.reason == Reason.DEADLINE_EXCEEDED
        assert decision.predicted_ttft_s == pytest.approx(20.5)


def test_a_parked_generation_is_not_taken_out_for_its_callers_deadline() -> None:
    """It has started: its caller leaving ends its stream, which takes it out."""
    queue = LaneQueue()
    parked = ticket("p", deadline=1.0)
    queue.requeue(parked, now=0.0, resume=Resume(0, 10))
    assert queue.next_expiry() is None
    assert queue.expire(now=5.0, view=BUSY) == []
    assert "p" in queue


def test_a_deadline_orders_nothing() -> None:
    """Unlike a TTFT target's deadline, the caller's only bounds the wait."""
    queue = LaneQueue()
    for t in (ticket("a", deadline=100.0), ticket("b", arrived=0.1, deadline=50.0)):
        assert isinstance(queue.arrive(t, now=t.arrived, view=NOBODY), Admit)
    assert [t.id for t in queue.tickets()] == ["a", "b"]
