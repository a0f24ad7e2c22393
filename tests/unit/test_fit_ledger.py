"""The fit ledger in the Lane reconciler, against a fake process table and a host whose
available memory the test sets: which replicas start, what status and events say."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog

from blazar.api import conditions
from blazar.api.kinds import Kind, Lane
from blazar.api.replicas import ReplicaState
from blazar.controller import fit, lane_plan, ledger
from blazar.controller.hostmemory import Resident
from blazar.controller.lane import LaneReconciler
from blazar.store.memory import MemoryStore
from tests import launches
from tests.unit import helpers
from tests.unit.helpers import Clock
from tests.unit.test_controller import FakeProcesses, apply
from tests.unit.test_fit import GEMMA

GIB = 1024**3
MODEL = """
apiVersion: blazar.dev/v1alpha1
kind: Model
metadata: {name: m}
spec: {source: {path: /models/m.gguf}}
"""


def lane(name: str = "l", *, replicas: int = 1, slots: int = 2, context: int = 2048) -> str:
    return f"""
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {{name: {name}}}
spec: {{model: m, replicas: {replicas}, slots: {slots}, contextPerSlot: {context}, threads: 2}}
"""


@dataclass
class FakeMemory:
    """A host with `free` bytes available and the given resident memory per pid."""

    free: int | None
    residents: dict[int, Resident] = field(default_factory=dict)
    memory_total: int | None = None

    def available(self) -> int | None:
        return self.free

    def total(self) -> int | None:
        return self.memory_total

    def resident(self, pid: int) -> Resident | None:
        return self.residents.get(pid)


@dataclass
class World:
    clock: Clock
    store: MemoryStore
    procs: FakeProcesses
    memory: FakeMemory
    reconciler: LaneReconciler

    def reconcile(self, name: str = "l") -> float | None:
        return asyncio.run(self.reconciler.reconcile(name)).requeue_after

    def lane(self, name: str = "l") -> Lane:
        obj = self.store.get(Kind.LANE, name)
        assert isinstance(obj, Lane)
        return obj

    def schedulable(self, name: str = "l") -> tuple[str, str, str]:
        c = conditions.get_condition(self.lane(name).status.conditions, "Schedulable")
        assert c is not None
        return c.status.value, c.reason, c.message

    def events(self, reason: str) -> list[str]:
        return [e.message for e in self.store.events() if e.reason == reason]


def world(free: int | None) -> World:
    clock = Clock()
    store = MemoryStore(clock=clock)
    procs = FakeProcesses(clock)
    memory = FakeMemory(free)
    apply(store, MODEL)
    helpers.mark_model_ready(store, "m", path="/models/m.gguf", now=clock.now, parameters=GEMMA)
    reconciler = LaneReconciler(store=store, processes=procs, clock=clock, memory=memory)
    return World(clock, store, procs, memory, reconciler)


def need(slots: int = 2, context: int = 2048) -> int:
    shape = fit.ModelShape.of_parameters(GEMMA, size_bytes=0)
    assert shape is not None
    return fit.estimate(launches.spec(slots=slots, context_per_slot=context), shape).total


def test_a_lane_that_does_not_fit_starts_nothing_and_says_why() -> None:
    w = world(free=GIB)
    apply(w.store, lane(slots=64, context=2**20))
    assert w.reconcile() == ledger.RETRY_S
    assert w.procs.started == []
    status, reason, message = w.schedulable()
    assert (status, reason) == ("False", "InsufficientMemory")
    wanted = need(64, 2**20)
    assert message.startswith(
        f"Replica 0 needs {fit.human(wanted)} ({wanted} bytes) but 1.0 GiB ({GIB} bytes) is free"
    )
    memory = w.lane().status.memory
    assert memory is not None
    assert (memory.estimate_bytes, memory.free_bytes, memory.available_bytes) == (wanted, GIB, GIB)
    assert memory.kv_bytes == 18 * 64 * 2**20 * 1024
    ready = conditions.get_condition(w.lane().status.conditions, "Ready")
    assert ready is not None and ready.reason == "InsufficientMemory"
    assert w.events("InsufficientMemory") == [message]
    # Looked at again: still no process, and no second event for the same shortfall.
    assert w.reconcile() == ledger.RETRY_S
    assert w.procs.started == [] and len(w.events("InsufficientMemory")) == 1


def test_a_lane_that_does_not_fit_says_why_in_the_daemons_log_once() -> None:
    # The event and condition were there; the daemon's log said nothing at all.
    w = world(free=GIB)
    apply(w.store, lane(slots=64, context=2**20))
    with structlog.testing.capture_logs() as logged:
        w.reconcile()
        w.reconcile()
    warnings = [e for e in logged if e["log_level"] == "warning"]
    assert [(e["event"], e["lane"], e["reason"]) for e in warnings] == [
        ("lane.warning", "l", "InsufficientMemory")
    ]
    assert warnings[0]["message"] == w.schedulable()[2]


def test_lowering_the_ask_starts_it() -> None:
    w = world(free=GIB)
    apply(w.store, lane(slots=64, context=2**20))
    w.reconcile()
    apply(w.store, lane(slots=2, context=2048))
    assert w.reconcile() is None
    assert [(name, i) for name, i, _ in w.procs.started] == [("l", 0)]
    status, reason, message = w.schedulable()
    assert (status, reason) == ("True", "MemoryFits")
    assert message == fit.fits_message(need(), free=GIB - need())
    assert w.events("MemoryFits") == [message]


def test_memory_freed_elsewhere_starts_it_at_the_next_look() -> None:
    w = world(free=need() - 1)
    apply(w.store, lane())
    assert w.reconcile() == ledger.RETRY_S
    assert w.procs.started == []
    w.memory.free = need()
    assert w.reconcile() is None
    assert len(w.procs.started) == 1
    assert w.schedulable()[:2] == ("True", "MemoryFits")


def test_replicas_start_in_order_while_they_fit() -> None:
    w = world(free=2 * need() + need() // 2)
    apply(w.store, lane(replicas=3))
    w.reconcile()
    assert [i for _, i, _ in w.procs.started] == [0, 1]
    status, reason, message = w.schedulable()
    assert (status, reason) == ("False", "InsufficientMemory")
    assert message.startswith(f"Replica 2 needs {fit.human(need())}")
    memory = w.lane().status.memory
    assert memory is not None and memory.free_bytes == need() // 2


def test_running_replicas_hold_their_estimate_until_resident() -> None:
    w = world(free=need() + need() // 2)
    apply(w.store, lane("a"))
    apply(w.store, lane("b"))
    w.reconcile("a")
    (pid,) = [r.pid for r in w.procs.observe("a")]
    assert pid is not None
    # Starting, nothing resident yet: a's whole estimate is spoken for, b does not fit.
    w.reconcile("b")
    assert w.schedulable("b")[:2] == ("False", "InsufficientMemory")
    # Resident and mostly anonymous: MemAvailable (the same figure here, as if it had
    # not moved) would already leave that out, so only the mapped part is still held.
    w.memory.residents[pid] = Resident(total=need(), anonymous=need() - 250 * 1024**2)
    w.reconcile("b")
    assert w.schedulable("b")[:2] == ("True", "MemoryFits")
    assert [name for name, _, _ in w.procs.started] == ["a", "b"]


def test_a_restarted_replica_is_not_counted_twice() -> None:
    w = world(free=need())
    apply(w.store, lane())
    w.reconcile()
    w.procs.set_state("l", 0, ReplicaState.FAILED)
    w.clock.tick(60)
    w.reconcile()
    assert [i for _, i, _ in w.procs.started] == [0, 0]
    assert w.schedulable()[:2] == ("True", "MemoryFits")


def test_a_stopped_replica_frees_its_share() -> None:
    w = world(free=need())
    apply(w.store, lane("a"))
    w.reconcile("a")
    apply(w.store, lane("b"))
    w.reconcile("b")
    assert w.schedulable("b")[:2] == ("False", "InsufficientMemory")
    apply(w.store, lane("a", replicas=0))
    w.reconcile("a")
    assert w.procs.observe("a") == []
    w.reconcile("b")
    assert [name for name, _, _ in w.procs.started] == ["a", "b"]


def test_a_model_without_the_figures_starts_unchecked() -> None:
    w = world(free=0)
    helpers.mark_model_ready(w.store, "m", path="/models/m.gguf", now=w.clock.now)
    apply(w.store, lane())
    w.reconcile()
    assert len(w.procs.started) == 1
    assert w.schedulable()[:2] == ("True", "NotEstimated")
    assert w.lane().status.memory is None


def test_a_start_allowed_to_one_lane_is_counted_before_its_process_exists() -> None:
    """Two Lanes reconciled at once: the second is decided while the first is still
    draining a replica before it spawns the one it was allowed."""
    w = world(free=need())
    apply(w.store, lane("a"))
    apply(w.store, lane("b"))
    starts = ledger.Ledger(processes=w.procs, memory=w.memory)
    shape = fit.ModelShape.of_parameters(GEMMA, size_bytes=0)
    assert shape is not None
    launch = launches.spec(slots=2, context_per_slot=2048)
    est = fit.estimate(launch, shape)
    plan = lane_plan.LanePlan([lane_plan.Start(0, launch, restart=False)])
    assert starts.place("a", plan, est).placement.fits
    # a has no process yet: b still does not fit.
    assert not starts.place("b", plan, est).placement.fits
    asyncio.run(w.procs.start("a", 0, launch))
    starts.started("a", 0)
    assert not starts.place("b", plan, est).placement.fits  # now as a running replica
    starts.forget("a", 0)
    asyncio.run(w.procs.stop("a", 0))
    assert starts.place("b", plan, est).placement.fits


def test_a_verdict_that_holds_leaves_the_status_as_it_was() -> None:
    """Free memory wobbles between looks; a status rewritten with each figure would wake
    the Lane's reconciler at once (a status change is a store event), and a Lane
    waiting for memory would spin instead of looking every few seconds."""
    w = world(free=GIB)
    apply(w.store, lane(slots=64, context=2**20))
    w.reconcile()
    version = w.lane().metadata.resource_version
    message = w.schedulable()[2]
    w.memory.free = GIB - 12345
    assert w.reconcile() == ledger.RETRY_S
    assert w.lane().metadata.resource_version == version
    assert w.schedulable()[2] == message
    # A new verdict (another estimate) is told with the figures of its own pass.
    apply(w.store, lane(slots=64, context=2**19))
    w.reconcile()
    memory = w.lane().status.memory
    assert memory is not None and memory.free_bytes == GIB - 12345
    assert w.schedulable()[2] != message


def test_a_running_lane_keeps_its_status_while_memory_moves() -> None:
    w = world(free=4 * GIB)
    apply(w.store, lane())
    w.reconcile()
    w.procs.set_state("l", 0, ReplicaState.READY)
    w.reconcile()
    version = w.lane().metadata.resource_version
    for free in (3 * GIB, 5 * GIB, GIB // 2):
        w.memory.free = free
        w.reconcile()
    assert w.lane().metadata.resource_version == version
    assert w.schedulable()[:2] == ("True", "MemoryFits")


def test_a_host_whose_memory_cannot_be_read_starts_replicas_unchecked() -> None:
    w = world(free=None)
    apply(w.store, lane(slots=64, context=2**20))
    assert w.reconcile() is None
    assert len(w.procs.started) == 1
    assert w.schedulable()[:2] == ("True", "MemoryUnknown")


def test_a_lane_larger_than_the_host_says_it_can_never_fit_and_looks_rarely() -> None:
    w = world(free=GIB)
    w.memory.memory_total = 2 * GIB
    apply(w.store, lane(slots=64, context=2**20))
    assert w.reconcile() == ledger.NEVER_RETRY_S
    message = w.schedulable()[2]
    assert "more than the host's 2.0 GiB in all, so it can never fit as it is" in message
    # Within the host's total, though not free now: it waits for memory to free.
    apply(w.store, lane(slots=2, context=2048))
    w.memory.free = need() - 1
    assert w.reconcile() == ledger.RETRY_S
    assert "starts by itself once it fits" in w.schedulable()[2]
