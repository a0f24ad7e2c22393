"""idle.sleepAfter: the pure decision, and the Lane reconciler acting on it (replicas
stopped and started again, status and events), with the data plane's activity ledger
driven by hand and processes faked at the supervisor's contract."""

from __future__ import annotations

import asyncio

import pytest

from blazar.api import conditions
from blazar.api.kinds import Kind, Lane
from blazar.api.replicas import ReplicaState
from blazar.controller.lane import LaneReconciler
from blazar.controller.lane_plan import Sleep, sleep_decision
from blazar.enginehost.activity import Activity
from blazar.store.memory import MemoryStore
from tests.unit.helpers import Clock
from tests.unit.test_controller import FakeProcesses, apply, ready_model


@pytest.mark.parametrize(
    ("sleep_after", "idle", "in_flight", "wanted", "expected"),
    [
        (None, 1e9, 0, False, Sleep()),  # not configured: never
        (5.0, 2.0, 0, False, Sleep(asleep=False, recheck_after=3.0)),
        (5.0, 5.0, 0, False, Sleep(asleep=True)),
        (5.0, 60.0, 1, False, Sleep(asleep=False)),  # a request in flight
        (5.0, 60.0, 0, True, Sleep(asleep=False)),  # one waits for it: wake
        (0.0, 0.0, 0, False, Sleep(asleep=True)),  # sleeps as soon as idle
    ],
)
def test_sleep_decision(
    sleep_after: float | None, idle: float, in_flight: int, wanted: bool, expected: Sleep
) -> None:
    got = sleep_decision(sleep_after_s=sleep_after, idle_s=idle, in_flight=in_flight, wanted=wanted)
    assert got == expected


SLEEPY = """
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: l}
spec: {model: m, replicas: 1, slots: 2, threads: 2, idle: {sleepAfter: 5s}}
"""


def status(store: MemoryStore) -> tuple[bool, str, str]:
    """Lane "l": whether it sleeps, and its Available and Ready reasons."""
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, Lane)
    available = conditions.get_condition(lane.status.conditions, "Available")
    ready = conditions.get_condition(lane.status.conditions, "Ready")
    assert available is not None and ready is not None
    return lane.status.sleeping, available.reason, ready.reason


class Ticks:
    """The activity ledger's monotonic clock; with `wall`, the store's and the
    reconciler's clock moves with it (a Lane's age is read from that one)."""

    def __init__(self, wall: Clock | None = None) -> None:
        self._now = 0.0
        self._wall = wall

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        if self._wall is not None:
            self._wall.tick(value - self._now)
        self._now = value

    def __call__(self) -> float:
        return self._now


def sleepy() -> tuple[MemoryStore, FakeProcesses, Activity, LaneReconciler, Ticks]:
    """Lane "l" (SLEEPY) applied beside a ready Model, with its reconciler, faked
    processes and an activity ledger on a clock the test moves (`Ticks.now`)."""
    clock = Clock()
    ticks = Ticks(clock)
    store = MemoryStore(clock=clock)
    procs = FakeProcesses(clock)
    activity = Activity(clock=ticks)
    rec = LaneReconciler(store=store, processes=procs, clock=clock, activity=activity)
    ready_model(store, clock)
    apply(store, SLEEPY)
    return store, procs, activity, rec, ticks


def test_an_idle_lane_sleeps_and_a_request_wakes_it() -> None:
    store, procs, activity, rec, ticks = sleepy()

    # Fresh: awake, one replica; asked to look again when it would fall asleep.
    assert asyncio.run(rec.reconcile("l")).requeue_after == pytest.approx(5.0)
    assert len(procs.observe("l")) == 1
    procs.set_state("l", 0, ReplicaState.READY)
    # A request in flight keeps it awake past sleepAfter.
    activity.begin("l")
    ticks.now = 30.0
    asyncio.run(rec.reconcile("l"))
    assert len(procs.observe("l")) == 1
    activity.end("l")
    ticks.now = 34.0
    assert asyncio.run(rec.reconcile("l")).requeue_after == pytest.approx(1.0)
    ticks.now = 35.0
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []
    assert status(store) == (True, "Sleeping", "Sleeping")
    assert "Sleeping" in [e.reason for e in store.events(kind="Lane", name="l")]
    # A request waits for it: the data plane wants it, the controller starts it.
    woken: list[str] = []
    activity.on_change(woken.append)
    activity.begin("l")
    activity.want("l")
    assert woken == ["l", "l"]
    asyncio.run(rec.reconcile("l"))
    assert len(procs.observe("l")) == 1
    assert "Waking" in [e.reason for e in store.events(kind="Lane", name="l")]
    procs.set_state("l", 0, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    assert status(store) == (False, "MinimumReplicasAvailable", "AllReplicasReady")


def test_a_lane_applied_while_the_daemon_runs_is_idle_only_since_its_creation() -> None:
    """Idleness was counted from the daemon's start, so a Lane with `sleepAfter: 5s`
    applied 10 minutes into the daemon's life (or deleted and applied again under its
    name) was asleep at once, "No request for idle.sleepAfter", never having run,
    where the same Lane at the daemon's start runs its replicas for 5 s first."""
    clock = Clock()
    ticks = Ticks(clock)
    store = MemoryStore(clock=clock)
    procs = FakeProcesses(clock)
    activity = Activity(clock=ticks)
    rec = LaneReconciler(store=store, processes=procs, clock=clock, activity=activity)
    ready_model(store, clock)
    ticks.now = 600.0
    apply(store, SLEEPY)
    assert asyncio.run(rec.reconcile("l")).requeue_after == pytest.approx(5.0)
    assert len(procs.observe("l")) == 1
    procs.set_state("l", 0, ReplicaState.READY)
    ticks.now = 605.0
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []
    assert status(store)[:2] == (True, "Sleeping")
    # Deleted and applied again: a new Lane, awake for its own sleepAfter.
    store.delete(Kind.LANE, "l")
    asyncio.run(rec.reconcile("l"))
    ticks.now = 700.0
    apply(store, SLEEPY)
    assert asyncio.run(rec.reconcile("l")).requeue_after == pytest.approx(5.0)
    assert len(procs.observe("l")) == 1


def test_idle_counts_from_the_lanes_creation_when_that_is_later() -> None:
    ticks = Ticks()
    activity = Activity(clock=ticks)
    ticks.now = 600.0
    assert activity.idle_s("l") == 600.0
    assert activity.idle_s("l", age_s=3.0) == 3.0
    assert activity.idle_s("l", age_s=-1.0) == 0.0  # a clock set back: not negative
    activity.begin("l")
    activity.end("l")
    ticks.now = 610.0
    assert activity.idle_s("l", age_s=100.0) == 10.0


def test_a_request_that_arrives_as_the_lane_falls_asleep_wakes_it() -> None:
    """The request is routed to the replica being stopped (the routing table still
    lists it), which hands it back to the queue: no `want`, only its `begin`. It waited
    90 s in a review, with the Lane asleep, until its caller gave up."""
    _store, procs, activity, rec, ticks = sleepy()
    asyncio.run(rec.reconcile("l"))
    procs.set_state("l", 0, ReplicaState.READY)
    ticks.now = 5.0
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []  # told to sleep
    woken: list[str] = []
    activity.on_change(woken.append)
    activity.begin("l")
    assert woken == ["l"]  # the controller looks again
    asyncio.run(rec.reconcile("l"))
    assert len(procs.observe("l")) == 1


def test_a_lane_without_idle_never_sleeps() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    procs = FakeProcesses(clock)
    ticks = Ticks()
    rec = LaneReconciler(store=store, processes=procs, clock=clock, activity=Activity(clock=ticks))
    ready_model(store, clock)
    apply(store, SLEEPY.replace(", idle: {sleepAfter: 5s}", ""))
    assert asyncio.run(rec.reconcile("l")).requeue_after is None
    ticks.now = 1e6
    asyncio.run(rec.reconcile("l"))
    assert len(procs.observe("l")) == 1


def test_a_sleeping_lane_scaled_to_zero_is_paused_not_asleep() -> None:
    """Scaled to `replicas: 0` while asleep, a Lane says ScaledToZero, as any Lane of
    zero replicas does (not Sleeping, which says a request wakes it), and it neither
    says it wakes nor starts a replica when a request is wanted."""
    store, procs, activity, rec, ticks = sleepy()
    asyncio.run(rec.reconcile("l"))
    procs.set_state("l", 0, ReplicaState.READY)
    ticks.now = 10.0
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []
    apply(store, SLEEPY.replace("replicas: 1", "replicas: 0"))
    activity.want("l")
    asyncio.run(rec.reconcile("l"))
    assert status(store) == (False, "ScaledToZero", "ScaledToZero")
    assert procs.observe("l") == []
    assert "Waking" not in [e.reason for e in store.events(kind="Lane", name="l")]
