"""Fair share between tenants inside one priority tier (`admission`, issue 19): weighted
start-time fair queuing, as tables of queue states and starts."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from blazar.dataplane.admission import (
    FIFO_POLICY,
    LaneQueue,
    LaneView,
    Policy,
    ReplicaView,
    Resume,
    Running,
    Ticket,
)

HIGH = Policy(name="high", priority=10)
DEADLINE = Policy(name="deadline", priority=0, ttft_target_s=1.0)
WEIGHTS = {"a": 2.0, "b": 1.0, "c": 1.0}


def ticket(id: str, tenant: str, *, policy: Policy = FIFO_POLICY, arrived: float = 0.0) -> Ticket:
    return Ticket(id, policy, arrived, 10, 10, tenant=tenant, weight=WEIGHTS.get(tenant, 1.0))


def view(*running: Running, slots: int = 1) -> LaneView:
    return LaneView(replicas=(ReplicaView(index=0, slots=slots, running=running),))


BUSY = view(Running("x", 0, tokens_left=10, kv_tokens=10))


def queue_of(*tickets: Ticket) -> LaneQueue:
    queue = LaneQueue()
    for t in tickets:
        queue.arrive(t, now=0.0, view=BUSY)
    return queue


def order(queue: LaneQueue) -> list[str]:
    return [t.id for t in queue.tickets()]


def start_next(queue: LaneQueue) -> str:
    """Start the first ticket on the one idle slot, as the data plane would."""
    [started] = queue.dispatch(now=0.0, view=view())
    return started.ticket.id


@pytest.mark.parametrize(
    ("tickets", "expected"),
    [
        # One tenant: arrival order, as without tenants.
        ([ticket("a1", "a", arrived=0), ticket("a2", "a", arrived=1)], ["a1", "a2"]),
        # Equal weights alternate, whoever sent more first.
        (
            [ticket(f"b{i}", "b", arrived=i) for i in range(3)]
            + [ticket("c0", "c", arrived=5), ticket("c1", "c", arrived=6)],
            ["b0", "c0", "b1", "c1", "b2"],
        ),
        # Weight 2 against 1: two for one (ties go to the earlier arrival).
        (
            [ticket(f"b{i}", "b", arrived=i) for i in range(3)]
            + [ticket(f"a{i}", "a", arrived=10 + i) for i in range(4)],
            ["b0", "a0", "a1", "b1", "a2", "a3", "b2"],
        ),
        # Priority first: fair share orders inside a tier only.
        (
            [ticket("b0", "b"), ticket("b1", "b", policy=HIGH), ticket("a0", "a")],
            ["b1", "a0", "b0"],
        ),
        # Inside one tenant, earliest deadline first.
        (
            [ticket("late", "a", arrived=0), ticket("soon", "a", policy=DEADLINE, arrived=1)],
            ["soon", "late"],
        ),
    ],
)
def test_order_by_virtual_start(tickets: list[Ticket], expected: list[str]) -> None:
    assert order(queue_of(*tickets)) == expected


def test_a_tenant_that_was_served_waits_its_turn_and_an_idle_one_saves_no_credit() -> None:
    queue = queue_of(*(ticket(f"b{i}", "b", arrived=i) for i in range(4)))
    assert [start_next(queue) for _ in range(3)] == ["b0", "b1", "b2"]
    # c arrives now: it starts at the clock, not from zero, so it gets one turn before
    # b's next, not three.
    for i in range(3):
        queue.arrive(ticket(f"c{i}", "c", arrived=10 + i), now=10.0, view=BUSY)
    assert order(queue) == ["c0", "b3", "c1", "c2"]


def test_a_requeued_ticket_comes_first_in_its_tier_and_is_not_charged_again() -> None:
    queue = queue_of(ticket("a0", "a"), ticket("b0", "b", arrived=1), ticket("b1", "b", arrived=2))
    assert start_next(queue) == "a0"
    parked = ticket("a0", "a")
    queue.requeue(parked, now=1.0, resume=Resume(replica=0, tokens_left=5))
    assert order(queue) == ["a0", "b0", "b1"]
    [resumed] = queue.dispatch(now=1.0, view=view())
    assert resumed.resume and resumed.ticket.id == "a0"
    # a0 counted once: a's next fresh ticket starts at 0.5, between b0 (0) and b1 (1).
    queue.arrive(ticket("a1", "a", arrived=3), now=3.0, view=BUSY)
    assert order(queue) == ["b0", "a1", "b1"]


@pytest.mark.parametrize("weights", [(2.0, 1.0), (3.0, 1.0), (1.0, 1.0), (1.5, 0.5)])
def test_weights_give_proportional_service_under_saturation(weights: tuple[float, float]) -> None:
    """Both tenants keep the queue full; the one slot serves each in proportion to its
    weight, within 10% over any run of 60 starts (acceptance 5, at the queue)."""
    queue = LaneQueue()
    names = ("heavy", "light")
    served: Counter[str] = Counter()
    seq = 0

    def top_up(now: float) -> None:
        nonlocal seq
        for name, weight in zip(names, weights, strict=True):
            while sum(1 for t in queue.tickets() if t.tenant == name) < 5:
                seq += 1
                t = Ticket(f"{name}{seq}", FIFO_POLICY, now, 10, 10, tenant=name, weight=weight)
                queue.arrive(t, now=now, view=BUSY)

    for step in range(600):
        top_up(float(step))
        [started] = queue.dispatch(now=float(step), view=view())
        served[started.ticket.tenant] += 1
        if step % 60 == 59:
            ratio = served["heavy"] / served["light"]
            assert ratio == pytest.approx(weights[0] / weights[1], rel=0.1), (step, served)


def test_state_is_forgotten_for_tenants_the_clock_passed() -> None:
    queue = queue_of(ticket("b0", "b"), ticket("c0", "c", arrived=1))
    start_next(queue)
    start_next(queue)
    for i in range(50):
        queue.arrive(ticket(f"a{i}", "a", arrived=2 + i), now=2.0, view=BUSY)
        start_next(queue)
    assert len(queue._finish) <= 1  # only the tenant served last can be ahead of the clock


def test_tickets_without_a_tenant_share_one() -> None:
    queue = queue_of(*(replace(ticket(f"t{i}", "", arrived=i)) for i in range(3)))
    assert order(queue) == ["t0", "t1", "t2"]
