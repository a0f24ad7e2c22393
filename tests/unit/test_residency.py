"""Residency under a memory budget (issue 20): the pure eviction decision, keep_alive in
the sleep decision and the activity ledger, and the Lane reconciler putting idle Lanes
to sleep for a wanted one, against fake processes and a host whose memory the test sets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta

import grpc
import pytest

from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import conditions
from blazar.api.kinds import Kind, Lane, LaneStatus, parse_size
from blazar.api.replicas import ReplicaState
from blazar.controller import fit, lane_plan, ledger, residency
from blazar.controller.lane import LaneReconciler
from blazar.controller.lane_plan import RELEASED, SLEEPING, Sleep, sleep_decision
from blazar.controller.residency import Candidate, Eviction
from blazar.dataplane import routing, server
from blazar.enginehost.activity import Activity, Keep, sleeps_in
from blazar.store.memory import MemoryStore
from tests import launches
from tests.unit import helpers
from tests.unit.helpers import T0, Clock
from tests.unit.test_controller import FakeProcesses, apply
from tests.unit.test_fit import GEMMA
from tests.unit.test_fit_ledger import MODEL, FakeMemory

GIB = 1024**3


def cand(lane: str, *, held: int = 100, since: float | None = 0.0, idle: float = 0.0,
         in_flight: int = 0, wanted: bool = False, preload: bool = False) -> Candidate:  # fmt: skip
    return Candidate(
        lane=lane,
        held_bytes=held,
        resident_since=None if since is None else T0 + timedelta(seconds=since),
        idle_s=idle,
        in_flight=in_flight,
        wanted=wanted,
        preload=preload,
    )


@pytest.mark.parametrize(
    ("shortfall", "candidates", "expected"),
    [
        # Nothing short: nothing to do.
        (0, [cand("a")], Eviction()),
        # The least recently used (longest idle) goes first...
        (100, [cand("a", idle=5), cand("b", idle=50)], Eviction(victims=("b",))),
        # ... and as many as the shortfall takes.
        (150, [cand("a", idle=5), cand("b", idle=50)], Eviction(victims=("b", "a"))),
        # Never one with a request in flight, one a request waits for, or a preload one.
        (100, [cand("a", in_flight=1, idle=99), cand("b", idle=1)], Eviction(victims=("b",))),
        (100, [cand("a", wanted=True, idle=99), cand("b", idle=1)], Eviction(victims=("b",))),
        (100, [cand("a", preload=True, idle=99), cand("b", idle=1)], Eviction(victims=("b",))),
        (100, [cand("a", in_flight=1), cand("b", preload=True)], Eviction()),
        # Resident less than the minimum (30 s at now=40: since 20): not yet; look again
        # when its residency ends.
        (100, [cand("a", since=20)], Eviction(recheck_after=10.0)),
        # What can go now does not cover it: none goes (a sleep that frees too little
        # only costs a reload); look again when the earliest young one may go.
        (150, [cand("a", since=0), cand("b", since=25), cand("c", since=15)],
         Eviction(recheck_after=5.0)),
        # More than everything eligible frees: nothing, and no time to look again at.
        (500, [cand("a"), cand("b", in_flight=1, held=900)], Eviction()),
        # A Lane holding nothing frees nothing.
        (100, [cand("a", held=0)], Eviction()),
        # An unknown start counts as resident long enough.
        (100, [cand("a", since=None)], Eviction(victims=("a",))),
        # Ties in idleness: by name, so the decision is the same every pass.
        (100, [cand("b"), cand("a")], Eviction(victims=("a",))),
    ],
)  # fmt: skip
def test_choose(shortfall: int, candidates: list[Candidate], expected: Eviction) -> None:
    got = residency.choose(
        shortfall=shortfall, candidates=candidates, now=T0 + timedelta(seconds=40),
        min_residency_s=30.0,
    )  # fmt: skip
    assert got == expected


@pytest.mark.parametrize(
    ("sleep_after", "idle", "keep", "expected"),
    [
        # A positive keep extends idle.sleepAfter...
        (5.0, 10.0, Keep(remaining_s=20.0), Sleep(asleep=False, recheck_after=20.0)),
        # ... and never shortens it.
        (60.0, 10.0, Keep(remaining_s=5.0), Sleep(asleep=False, recheck_after=50.0)),
        # Without idle.sleepAfter a positive keep does not make the Lane sleep.
        (None, 1e6, Keep(remaining_s=0.0), Sleep()),
        # Zero: it sleeps as soon as idle, with or without idle.sleepAfter.
        (None, 0.0, Keep(release=True), Sleep(asleep=True, message=RELEASED)),
        (600.0, 0.0, Keep(release=True), Sleep(asleep=True, message=RELEASED)),
        # Negative: kept awake past idle.sleepAfter.
        (5.0, 1e6, Keep(forever=True), Sleep()),
        # Nothing said: idle.sleepAfter alone.
        (5.0, 5.0, Keep(), Sleep(asleep=True, message=SLEEPING)),
    ],
)
def test_keep_alive_in_the_sleep_decision(
    sleep_after: float | None, idle: float, keep: Keep, expected: Sleep
) -> None:
    got = sleep_decision(
        sleep_after_s=sleep_after, idle_s=idle, in_flight=0, wanted=False,
        keep_s=keep.remaining_s, keep_forever=keep.forever, release=keep.release,
    )  # fmt: skip
    assert got == expected
    # Busy or wanted always wins.
    busy = sleep_decision(
        sleep_after_s=sleep_after, idle_s=idle, in_flight=1, wanted=False,
        keep_s=keep.remaining_s, keep_forever=keep.forever, release=keep.release,
    )  # fmt: skip
    assert busy == Sleep(asleep=False)


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_activity_keeps_what_requests_ask() -> None:
    ticks = Ticks()
    activity = Activity(clock=ticks)
    changed: list[str] = []
    activity.on_change(changed.append)
    activity.begin("l")
    activity.end("l", keep_alive_s=60)
    assert activity.keep("l") == Keep(remaining_s=60.0)
    # A shorter keep later never shortens the longer one.
    ticks.now = 10.0
    activity.begin("l")
    activity.end("l", keep_alive_s=5)
    assert activity.keep("l") == Keep(remaining_s=50.0)
    # No keep_alive said: what was kept holds.
    activity.begin("l")
    activity.end("l")
    assert activity.keep("l") == Keep(remaining_s=50.0)
    # Negative: forever, until a later request says otherwise.
    activity.begin("l")
    activity.end("l", keep_alive_s=-1)
    assert activity.keep("l").forever
    # Zero: release; the next request's start takes it back.
    activity.begin("l")
    activity.end("l", keep_alive_s=0)
    assert activity.keep("l") == Keep(release=True)
    activity.begin("l")
    assert activity.keep("l") == Keep()
    activity.end("l")
    # An unload while idle releases and wakes the controller.
    changed.clear()
    activity.release("l")
    assert activity.keep("l").release and changed == ["l"]
    assert activity.keep("other") == Keep()


def test_sizes() -> None:
    assert parse_size("512Mi") == 512 * 1024**2
    assert parse_size("8Gi") == 8 * GIB
    assert parse_size("1000") == 1000
    assert parse_size("2Ki") == 2048
    for bad in ("8GB", "-1", "1.5Gi", "", "Gi"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def lane_yaml(name: str, *, extra: str = "") -> str:
    return f"""
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {{name: {name}}}
spec: {{model: m, replicas: 1, slots: 1, contextPerSlot: 512, threads: 2{extra}}}
"""


def need() -> int:
    shape = fit.ModelShape.of_parameters(GEMMA, size_bytes=0)
    assert shape is not None
    return fit.estimate(launches.spec(slots=1, context_per_slot=512), shape).total


@dataclass
class Budgeted:
    clock: Clock
    ticks: Ticks
    store: MemoryStore
    procs: FakeProcesses
    activity: Activity
    reconciler: LaneReconciler
    notified: list[str]

    def reconcile(self, name: str) -> float | None:
        return asyncio.run(self.reconciler.reconcile(name)).requeue_after

    def lane(self, name: str) -> Lane:
        obj = self.store.get(Kind.LANE, name)
        assert isinstance(obj, Lane)
        return obj

    def cond(self, name: str, type_: str) -> tuple[str, str, str]:
        c = conditions.get_condition(self.lane(name).status.conditions, type_)
        assert c is not None
        return c.status.value, c.reason, c.message

    def running(self) -> set[str]:
        return {lane for lane in self.procs.lanes() if self.procs.observe(lane)}

    def ready(self, name: str) -> None:
        self.procs.set_state(name, 0, ReplicaState.READY)

    def events(self, name: str, reason: str) -> list[str]:
        return [e.message for e in self.store.events(kind="Lane", name=name) if e.reason == reason]

    def later(self, seconds: float) -> None:
        self.clock.tick(seconds)
        self.ticks.now += seconds


def budgeted(budget: int, *lanes: str, min_residency_s: float = 30.0) -> Budgeted:
    clock, ticks = Clock(), Ticks()
    store = MemoryStore(clock=clock)
    procs = FakeProcesses(clock)
    activity = Activity(clock=ticks)
    notified: list[str] = []
    apply(store, MODEL)
    helpers.mark_model_ready(store, "m", path="/models/m.gguf", now=clock.now, parameters=GEMMA)
    for text in lanes:
        apply(store, text)
    reconciler = LaneReconciler(
        store=store, processes=procs, clock=clock, activity=activity,
        memory=FakeMemory(64 * GIB), budget=budget, min_residency_s=min_residency_s,
        notify=notified.append,
    )  # fmt: skip
    return Budgeted(clock, ticks, store, procs, activity, reconciler, notified)


def test_a_lane_over_the_whole_budget_says_so_and_looks_again_rarely() -> None:
    w = budgeted(need() - 1, lane_yaml("a"))
    assert w.reconcile("a") == ledger.NEVER_RETRY_S
    assert w.running() == set()
    status, reason, message = w.cond("a", "Schedulable")
    assert (status, reason) == ("False", "ExceedsMemoryBudget")
    assert f"({need()} bytes)" in message and f"({need() - 1} bytes" in message
    assert "--memory-budget" in message
    memory = w.lane("a").status.memory
    assert memory is not None and memory.budget_bytes == need() - 1
    assert len(w.events("a", "ExceedsMemoryBudget")) == 1
    # Even a request waiting for it evicts nothing: no eviction can make it fit.
    w.activity.begin("a")
    w.activity.want("a")
    assert w.reconcile("a") == ledger.NEVER_RETRY_S
    assert len(w.events("a", "ExceedsMemoryBudget")) == 1


def test_the_budget_holds_one_lane_and_a_request_swaps_them() -> None:
    w = budgeted(need() * 3 // 2, lane_yaml("a"), lane_yaml("b"))
    w.reconcile("a")
    w.ready("a")
    # b does not fit beside a: it waits for memory, and its route wakes on a request.
    assert w.reconcile("b") == ledger.RETRY_S
    assert w.running() == {"a"}
    assert w.cond("b", "Schedulable")[:2] == ("False", "InsufficientMemory")
    assert "of the memory budget" in w.cond("b", "Schedulable")[2]
    assert routing.build_table([w.lane("b")]).routes[0].wakes
    # On demand, as a sleeping Lane is: /readyz does not wait for it (found on a
    # daemon: a fleet under a budget that holds one of its Lanes was never ready).
    assert routing.build_table([w.lane("b")]).routes[0].sleeping
    # A request waits for b while a is younger than the minimum residency: nothing is
    # evicted; b looks again when a's residency ends.
    w.later(10)
    w.activity.begin("b")
    w.activity.want("b")
    assert w.reconcile("b") == ledger.RETRY_S  # memory may free meanwhile
    w.later(18)
    assert w.reconcile("b") == pytest.approx(2.0)
    assert w.running() == {"a"} and w.events("a", "Evicted") == []
    # A request in flight on a: never stopped, even past its residency.
    w.later(7)
    w.activity.begin("a")
    w.reconcile("b")
    assert w.running() == {"a"} and w.events("a", "Evicted") == []
    # Its end wakes a's reconcile, which asks the waiting b to look again.
    w.activity.end("a")
    w.notified.clear()
    w.reconcile("a")
    assert w.notified == ["b"]
    # Now a is idle and resident long enough: b evicts it (a is asked to reconcile).
    w.reconcile("b")
    assert w.events("a", "Evicted") and '"b"' in w.events("a", "Evicted")[0]
    assert "a" in w.notified
    w.reconcile("a")
    assert w.running() == set()
    assert w.lane("a").status.sleeping
    assert w.cond("a", "Available")[:2] == ("False", "Sleeping")
    assert "memory budget" in w.cond("a", "Available")[2]
    assert w.events("a", "Sleeping")
    # a's stop frees the memory: b is asked again, and starts.
    assert "b" in w.notified
    w.reconcile("b")
    assert w.running() == {"b"}
    w.ready("b")
    w.activity.end("b")
    w.reconcile("b")
    assert w.cond("b", "Schedulable")[:2] == ("True", "MemoryFits")
    # A Lane put to sleep by the budget routes as a sleeping one: its request wakes it.
    assert routing.build_table([w.lane("a")]).routes[0].wakes
    w.later(31)
    w.activity.begin("a")
    w.activity.want("a")
    w.reconcile("a")  # wakes, and evicts b (idle, resident 31 s)
    assert w.events("a", "Waking")
    assert w.events("b", "Evicted")
    w.reconcile("b")
    w.reconcile("a")
    assert w.running() == {"a"}


def test_preload_lanes_are_never_evicted() -> None:
    w = budgeted(need() * 3 // 2, lane_yaml("a", extra=", preload: true"), lane_yaml("b"))
    w.reconcile("a")
    w.ready("a")
    w.later(3600)
    w.activity.begin("b")
    w.activity.want("b")
    assert w.reconcile("b") == ledger.RETRY_S
    assert w.running() == {"a"} and w.events("a", "Evicted") == []
    # keep_alive 0 on a preload Lane: it stays.
    w.activity.begin("a")
    w.activity.end("a", keep_alive_s=0)
    w.reconcile("a")
    assert w.running() == {"a"}


def test_keep_alive_0_sleeps_a_lane_without_idle_and_its_next_request_wakes_it() -> None:
    w = budgeted(64 * GIB, lane_yaml("a"))
    w.reconcile("a")
    w.ready("a")
    w.activity.begin("a")
    w.activity.end("a", keep_alive_s=0)
    w.reconcile("a")
    assert w.running() == set()
    assert w.cond("a", "Available") == ("False", "Sleeping", RELEASED)
    assert routing.build_table([w.lane("a")]).routes[0].wakes
    w.activity.begin("a")
    w.activity.want("a")
    w.reconcile("a")
    assert w.running() == {"a"}
    # While it starts, it still routes as waking (requests wait rather than fail).
    assert w.lane("a").status.sleeping
    w.ready("a")
    w.reconcile("a")
    assert not w.lane("a").status.sleeping


def test_preload_with_sleep_after_is_refused_at_apply() -> None:
    store = MemoryStore(clock=Clock())
    apply(store, MODEL)
    with pytest.raises(Exception, match="preload: true keeps the Lane resident"):
        apply(store, lane_yaml("a", extra=", preload: true, idle: {sleepAfter: 5s}"))
    assert store.get(Kind.LANE, "a") is None


def test_a_paused_lane_does_not_stay_sleeping() -> None:
    """`status.sleeping` carries over while a Lane wakes (desired > 0, nothing serving
    yet), not once it is paused with replicas: 0."""
    ready = lane_plan.ModelReadiness(True, "ModelReady", "ok")
    asleep = LaneStatus(sleeping=True)

    def sleeping(desired: int) -> bool:
        return lane_plan.lane_status(
            previous=asleep, generation=1, desired=desired, model=ready, observed=[], now=T0
        ).sleeping

    assert sleeping(1)
    assert not sleeping(0)


def test_requests_for_a_lane_that_can_never_fit_are_refused_not_queued() -> None:
    w = budgeted(need() - 1, lane_yaml("a"))
    w.reconcile("a")
    route = routing.build_table([w.lane("a")]).routes[0]
    assert not route.wakes
    refused = routing.unservable(route)
    assert refused is not None and "ExceedsMemoryBudget" not in refused.message
    assert "can start none as it is" in refused.message and "--memory-budget" in refused.message


def test_a_lane_that_fits_only_where_preload_lanes_are_is_refused_not_queued() -> None:
    """Found on a daemon: with a preload Lane holding the budget, a request for the
    other Lane waited for memory that no eviction could free, without end (no policy
    bound) and without a word. It is refused at once now, saying why, until the
    preload Lane lets go."""
    w = budgeted(need() * 3 // 2, lane_yaml("a", extra=", preload: true"), lane_yaml("b"))
    w.reconcile("a")
    w.ready("a")
    # Looked at again as often as a Lane waiting for memory: the fleet may change.
    assert w.reconcile("b") == ledger.RETRY_S
    status, reason, message = w.cond("b", "Schedulable")
    assert (status, reason) == ("False", "HeldByPreloadLanes")
    assert "preload: true hold" in message and f"({need() * 3 // 2} bytes)" in message
    route = routing.build_table([w.lane("b")]).routes[0]
    assert not route.wakes and not route.sleeping  # not on demand: /readyz says so
    refused = routing.unservable(route)
    assert refused is not None and "preload: true" in refused.message
    # Asleep before (the budget put it to sleep when a was not preload): still not on
    # demand, since no request can start it (/readyz names it).
    asleep = w.lane("b").status.model_copy(update={"sleeping": True})
    w.store.update_status(Kind.LANE, "b", asleep)
    assert not routing.build_table([w.lane("b")]).routes[0].sleeping
    # A request for it evicts nothing and does not wait for memory.
    w.activity.begin("b")
    w.activity.want("b")
    w.reconcile("b")
    assert w.running() == {"a"} and w.events("a", "Evicted") == []
    w.activity.end("b")
    # With preload off, a is swappable again: b waits for memory, and a request wakes it.
    apply(w.store, lane_yaml("a"))
    w.reconcile("b")
    assert w.cond("b", "Schedulable")[:2] == ("False", "InsufficientMemory")
    assert routing.build_table([w.lane("b")]).routes[0].wakes


def test_a_lane_that_fits_once_an_idle_lane_sleeps_still_waits_beside_a_preload_one() -> None:
    w = budgeted(
        need() * 5 // 2, lane_yaml("a", extra=", preload: true"), lane_yaml("c"), lane_yaml("b")
    )
    for name in ("a", "c"):
        w.reconcile(name)
        w.ready(name)
    w.reconcile("b")
    assert w.cond("b", "Schedulable")[:2] == ("False", "InsufficientMemory")
    assert routing.build_table([w.lane("b")]).routes[0].wakes


@pytest.mark.parametrize("sleep_after", [None, 0.0, 5.0, 60.0])
@pytest.mark.parametrize("idle", [0.0, 4.0, 10.0, 100.0])
@pytest.mark.parametrize(
    "keep",
    [Keep(), Keep(remaining_s=20.0), Keep(remaining_s=200.0), Keep(forever=True),
     Keep(release=True)],
)  # fmt: skip
def test_sleeps_in_agrees_with_the_sleep_decision(
    sleep_after: float | None, idle: float, keep: Keep
) -> None:
    """What /api/ps says (`activity.sleeps_in`) is when the controller's decision puts
    the Lane to sleep: asleep now at 0, else after the wait it looks again at."""
    said = sleeps_in(sleep_after_s=sleep_after, idle_s=idle, in_flight=0, keep=keep)
    decided = sleep_decision(
        sleep_after_s=sleep_after, idle_s=idle, in_flight=0, wanted=False,
        keep_s=keep.remaining_s, keep_forever=keep.forever, release=keep.release,
    )  # fmt: skip
    if decided.asleep:
        assert said == 0.0
    elif decided.recheck_after is None:
        assert said is None
    else:
        assert said == pytest.approx(decided.recheck_after)
    # A request in flight counts as ending now: no sooner than that.
    busy = sleeps_in(sleep_after_s=sleep_after, idle_s=idle, in_flight=1, keep=keep)
    if said is not None:
        assert busy is not None and busy >= said


def test_a_second_pass_before_the_victim_stops_evicts_no_more() -> None:
    # Found on a daemon: a budget of two Lanes, a request for a third evicted both
    # others, each `Evicted` event saying 60 MiB free: the waiting Lane's next pass
    # (its requeue, or another Lane's notify) came before the first victim had stopped,
    # so its memory was not yet free and a second victim was chosen for the same need.
    w = budgeted(need() * 5 // 2, lane_yaml("a"), lane_yaml("b"), lane_yaml("c"))
    for name in ("a", "b"):
        w.reconcile(name)
        w.ready(name)
    w.later(31)
    w.activity.begin("c")
    w.activity.want("c")
    w.reconcile("c")
    assert [bool(w.events(n, "Evicted")) for n in ("a", "b")].count(True) == 1
    w.reconcile("c")  # again, before the victim's own pass stops it
    assert [bool(w.events(n, "Evicted")) for n in ("a", "b")].count(True) == 1
    for name in ("a", "b"):
        w.reconcile(name)
    w.reconcile("c")
    assert w.running() == {"c", "a"} or w.running() == {"c", "b"}


def a_asleep_for_b() -> Budgeted:
    """A budget that holds one of Lanes a and b: a served, then a request for b put
    it to sleep (a has stopped), and b has not started yet."""
    w = budgeted(need() * 3 // 2, lane_yaml("a"), lane_yaml("b"))
    w.reconcile("a")
    w.ready("a")
    w.later(31)
    w.activity.begin("b")
    w.activity.want("b")
    w.reconcile("b")  # evicts a
    w.reconcile("a")  # a stops
    return w


def test_a_lane_put_to_sleep_for_another_does_not_take_its_memory_back_first() -> None:
    """Lanes waiting for memory start in the order their requests came, as Ollama
    serves pending loads: a, put to sleep for b, gets a request of its own before b's
    replica started; a waits for b to start rather than take back the memory it freed
    (b would then wait out a's whole minimum residency again)."""
    w = a_asleep_for_b()
    assert w.running() == set() and w.events("a", "Evicted")
    w.activity.begin("a")
    w.activity.want("a")
    assert w.reconcile("a") == ledger.RETRY_S
    assert w.running() == set()
    assert '"b"' in w.cond("a", "Available")[2] and "came first" in w.cond("a", "Available")[2]
    w.notified.clear()
    w.reconcile("b")
    assert w.running() == {"b"}
    # b's start asks a to look again: a now waits for memory as any Lane does.
    assert "a" in w.notified
    w.ready("b")
    w.reconcile("a")
    assert w.running() == {"b"}
    assert w.cond("a", "Schedulable")[:2] == ("False", "InsufficientMemory")


def test_a_lane_behind_another_whose_request_left_goes_next() -> None:
    """The Lane a was put to sleep for has no request waiting any more (its caller
    left before it started): a's own request is the first in line, and starts it."""
    w = a_asleep_for_b()
    w.activity.begin("a")
    w.activity.want("a")
    w.reconcile("a")
    assert w.running() == set()
    w.activity.end("b")  # b's caller left, before b's pass
    w.reconcile("a")
    assert w.running() == {"a"}


def test_ollamas_load_idiom_on_a_lane_that_cannot_start_is_refused_not_loaded() -> None:
    """Found on a daemon: `/api/generate` with an empty prompt (the KeepAlive RPC) for a
    Lane over the whole budget answered `done_reason: "load"` while its chats got 503:
    the load said done for an engine that can never start. So did one scaled to 0."""
    w = budgeted(
        need() - 1, lane_yaml("a"), lane_yaml("paused").replace("replicas: 1", "replicas: 0")
    )
    w.reconcile("a")
    w.reconcile("paused")

    code, details = asyncio.run(wake_call(w.store, "a"))
    assert code == grpc.StatusCode.UNAVAILABLE and "can start none as it is" in details
    code, details = asyncio.run(wake_call(w.store, "paused"))
    assert code == grpc.StatusCode.UNAVAILABLE and "scaled to zero" in details


async def wake_call(
    store: MemoryStore, model: str, method: str = "KeepAlive"
) -> tuple[grpc.StatusCode, str]:
    """A KeepAlive (load) or Embed of `model` on a data plane over `store`: its code and
    details (a 10 s deadline: a call that would wait for a wake does not hang the test)."""
    running = await server.start(store=store, address="127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            try:
                if method == "KeepAlive":
                    request = inference_pb2.KeepAliveRequest(model=model, keep_alive_s=300)
                    await stub.KeepAlive(request, timeout=10)
                else:
                    await stub.Embed(
                        inference_pb2.EmbedRequest(model=model, inputs=["Hi"]), timeout=10
                    )
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details() or ""
            return grpc.StatusCode.OK, ""
    finally:
        await running.stop(grace=0)


def test_a_waking_call_for_a_sleeping_lane_whose_model_is_gone_is_refused_at_once() -> None:
    """Found on a daemon: the load idiom for a Lane with idle.sleepAfter whose Model's
    file was removed waited the whole 120 s wake bound for a 503 "did not wake", while
    its chats were refused at once saying the Model is not ready. So did embeddings."""
    w = budgeted(64 * GIB, lane_yaml("a", extra=", idle: {sleepAfter: 5s}"))
    w.store.delete(Kind.MODEL, "m")
    w.reconcile("a")
    route = routing.build_table([w.lane("a")]).routes[0]
    # It would sleep and wake, but starts nothing until its Model is back: no wake.
    assert route.sleep_after_s is not None and not route.wakes
    for method in ("KeepAlive", "Embed"):
        code, details = asyncio.run(wake_call(w.store, "a", method))
        assert code == grpc.StatusCode.UNAVAILABLE, (method, code, details)
        assert "until its Model is ready" in details
