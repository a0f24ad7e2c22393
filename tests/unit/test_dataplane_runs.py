"""The view admission decides against, built from what runs where (`dataplane.runs`)."""

from __future__ import annotations

import dataclasses

from blazar.dataplane import admission, routing, runs
from blazar.dataplane.measurements import LaneMeasurements
from tests.dispatching import one_slot_route

BATCH = admission.Policy(name="batch", priority=0, max_queue_depth=8)
URGENT = admission.Policy(name="urgent", priority=100, ttft_target_s=2.0, max_queue_depth=8)


def two_replicas() -> routing.Route:
    route = one_slot_route()
    second = routing.Replica("l", 1, "unix:///elsewhere", pid=2)
    return dataclasses.replace(route, replicas=(*route.replicas, second), slots=2)


def run(
    id: str, replica: routing.Replica, *, policy: admission.Policy = BATCH, generated: int = 0
) -> runs.Run:
    ticket = admission.Ticket(id, policy, 0.0, prompt_tokens=10, max_tokens=100)
    return runs.Run(ticket, id, replica, 40, generated=generated, first_token_at=1.0)


def test_each_run_holds_a_slot_on_its_own_replica() -> None:
    route = two_replicas()
    lane = runs.LaneRuns()
    lane.running["a"] = run("a", route.replicas[0], generated=30)
    lane.running["b"] = run("b", route.replicas[1])
    view = lane.view(route, LaneMeasurements(), now=2.0)
    assert [[r.id for r in replica.running] for replica in view.replicas] == [["a"], ["b"]]
    (a,) = view.replicas[0].running
    # Tokens left: its max_tokens (nothing measured yet) less what it generated.
    assert (a.tokens_left, a.kv_tokens, a.parkable) == (70, 40, True)


def test_a_replica_of_an_earlier_slots_shows_its_own_during_a_rollout() -> None:
    """The Lane went from 1 slot to 2: the old replica's one slot is busy, so admission
    has a waiting ticket wait for the new replica (or that slot) rather than send it to
    an engine with no slot for it, which would hold it blind until its drain."""
    route = two_replicas()
    old = dataclasses.replace(route.replicas[0], slots=1)
    new = dataclasses.replace(route.replicas[1], slots=2)
    route = dataclasses.replace(route, replicas=(old, new))
    lane = runs.LaneRuns()
    lane.running["a"] = run("a", old, generated=30)
    view = lane.view(route, LaneMeasurements(), now=2.0)
    assert [r.slots for r in view.replicas] == [1, 2]
    queue = admission.LaneQueue()
    ticket = admission.Ticket("b", BATCH, 2.0, prompt_tokens=10, max_tokens=100)
    assert isinstance(queue.arrive(ticket, now=2.0, view=view), admission.Admit)
    assert [d.replica for d in queue.dispatch(now=2.0, view=view)] == [1]


def test_a_replica_of_an_earlier_context_shows_its_own_during_a_rollout() -> None:
    """The Lane went from 512 tokens a slot to 2048 and its new replica is starting:
    the old one is idle, but a ticket of 725 tokens waits for the new one rather than
    start where its engine would refuse it; a short one starts there."""
    route = one_slot_route()
    old = dataclasses.replace(route.replicas[0], context_per_slot=512)
    route = dataclasses.replace(route, replicas=(old,), context_length=2048, starting=True)
    view = runs.LaneRuns().view(route, LaneMeasurements(), now=2.0)
    assert ([r.context_per_slot for r in view.replicas], view.starting_context) == ([512], 2048)
    queue = admission.LaneQueue()
    long = admission.Ticket("a", BATCH, 2.0, 709, 16, context_tokens=725)
    short = admission.Ticket("b", BATCH, 2.0, 100, 16, context_tokens=116)
    for ticket in (long, short):
        assert isinstance(queue.arrive(ticket, now=2.0, view=view), admission.Admit)
    assert [(d.ticket.id, d.replica) for d in queue.dispatch(now=2.0, view=view)] == [("b", 0)]


def test_a_replica_left_out_is_not_in_the_view_until_the_route_forgets_it() -> None:
    route = two_replicas()
    lane = runs.LaneRuns()
    lane.exclude(route.replicas[1], now=0.0)
    assert lane.readmission_at() == runs.EXCLUDED_S
    assert [r.index for r in lane.view(route, LaneMeasurements(), now=0.0).replicas] == [0]
    assert lane.replica(route, 1) is None
    # The replica restarted as another process: the new one serves.
    restarted = dataclasses.replace(route.replicas[1], pid=3)
    route = dataclasses.replace(route, replicas=(route.replicas[0], restarted))
    lane.forget_gone(route)
    assert lane.replica(route, 1) is restarted
    assert lane.readmission_at() is None


def test_a_replica_left_out_comes_back_when_its_time_out_passes() -> None:
    """The same process, still in the route (it answers its health checks): it refused
    for a cause that passed, and is asked again."""
    route = two_replicas()
    lane = runs.LaneRuns()
    lane.exclude(route.replicas[1], now=10.0)
    lane.readmit(10.0 + runs.EXCLUDED_S / 2)
    assert lane.replica(route, 1) is None
    lane.readmit(10.0 + runs.EXCLUDED_S)
    assert lane.replica(route, 1) is route.replicas[1]
    assert lane.readmission_at() is None


def test_a_run_being_parked_shows_as_the_ticket_that_takes_its_slot() -> None:
    route = one_slot_route()
    lane = runs.LaneRuns(kv_bytes_per_token=100)
    victim = run("victim", route.replicas[0], generated=20)
    lane.running["victim"] = victim
    urgent = admission.Ticket("urgent", URGENT, 0.0, prompt_tokens=5, max_tokens=50)
    preempt = admission.Preempt(urgent, "victim", 0, prefill_s=0.5, start_s=0.25)
    lane.parking["victim"] = runs.Parking(preempt, victim, asked_at=10.0)
    (replica,) = lane.view(route, LaneMeasurements(), now=10.5).replicas
    (holder,) = replica.running
    assert (holder.id, holder.priority, holder.tokens_left) == ("urgent", 100, 50)
    # Its prompt holds the prefill line until its first token is due (10.75).
    assert holder.prefill_left_s == 0.25
    # The victim's cache counts as parked already: 30 tokens at 100 bytes.
    assert replica.parked_bytes == 3000


def test_a_parked_run_holds_memory_and_no_slot() -> None:
    route = one_slot_route()
    lane = runs.LaneRuns()
    lane.parked["p"] = run("p", route.replicas[0])
    lane.parked_bytes["p"] = 4096
    (replica,) = lane.view(route, LaneMeasurements(), now=0.0).replicas
    assert (replica.running, replica.parked_bytes) == ((), 4096)
    assert lane.busy() and lane.parked_total() == 4096


def test_a_run_whose_park_was_refused_is_no_victim_until_it_generates_more() -> None:
    route = one_slot_route()
    lane = runs.LaneRuns(refused_parks={"a": 5})
    lane.running["a"] = run("a", route.replicas[0], generated=5)
    assert not lane.view(route, LaneMeasurements(), now=0.0).replicas[0].running[0].parkable
    lane.running["a"].generated = 6
    assert lane.view(route, LaneMeasurements(), now=0.0).replicas[0].running[0].parkable


def test_no_route_no_replicas() -> None:
    assert runs.LaneRuns().view(None, LaneMeasurements(), now=0.0) == admission.LaneView()
