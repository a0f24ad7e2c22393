"""Reconcilers driven against a MemoryStore and a fake process table: apply objects,
reconcile, then assert the resulting replicas, statuses and events (state, not calls)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import gguf
import numpy
import pytest
import structlog

from blazar.api import conditions, errors, manifests
from blazar.api.kinds import Health, Kind, Lane, Model, ModelStatus
from blazar.api.meta import Condition, ConditionStatus
from blazar.api.replicas import LaunchSpec, ReplicaObservation, ReplicaState
from blazar.controller import lane as lane_module
from blazar.controller import manager, modelfile
from blazar.controller.lane import LaneReconciler
from blazar.controller.model import ModelReconciler
from blazar.controller.reconciler import TemporaryError
from blazar.store.memory import MemoryStore
from tests.unit import helpers
from tests.unit.helpers import Clock


@dataclass
class FakeProcesses:
    """The supervisor's contract, with replicas moved between states by the test."""

    clock: Clock
    replicas: dict[tuple[str, int], ReplicaObservation] = field(default_factory=dict)
    next_pid: int = 1000
    # Every start, in order: what each replica was launched with.
    started: list[tuple[str, int, LaunchSpec]] = field(default_factory=list)
    # Each Lane's health checks as last told.
    health: dict[str, Health] = field(default_factory=dict)

    def check(self, lane: str, health: Health | None) -> bool:
        before = self.health.pop(lane, None)
        if health is not None:
            self.health[lane] = health
        return before is not None and health is not None and before != health

    def observe(self, lane: str) -> list[ReplicaObservation]:
        return [r for (name, _), r in sorted(self.replicas.items()) if name == lane]

    def lanes(self) -> set[str]:
        return {lane for lane, _ in self.replicas}

    async def start(self, lane: str, index: int, launch: LaunchSpec) -> list[Any]:
        old = self.replicas.get((lane, index))
        self.next_pid += 1
        self.started.append((lane, index, launch))
        self.replicas[(lane, index)] = ReplicaObservation(
            lane=lane, index=index, state=ReplicaState.STARTING, revision=launch.revision,
            socket=f"/run/{lane}-{index}.sock", pid=self.next_pid,
            restarts=old.restarts + 1 if old else 0,
        )  # fmt: skip
        return []

    async def stop(self, lane: str, index: int) -> None:
        self.replicas.pop((lane, index), None)

    async def discard_kv(self, lane: str) -> list[int]:
        return []  # no caches here: the supervisor's tests cover them

    def kv_lanes(self) -> list[str]:
        return []

    def set_state(self, lane: str, index: int, state: ReplicaState) -> None:
        obs = self.replicas[(lane, index)]
        exited = self.clock.now if state == ReplicaState.FAILED else None
        code = -9 if state == ReplicaState.FAILED else None
        self.replicas[(lane, index)] = replace(obs, state=state, exited_at=exited, exit_code=code)


def apply(store: MemoryStore, text: str) -> None:
    docs = manifests.parse_documents(text, source="test")
    store.apply_all(
        manifests.validate_objects(docs, exists=lambda k, n: store.get(k, n) is not None)
    )


MODEL = """
apiVersion: blazar.dev/v1alpha1
kind: Model
metadata: {name: m}
spec: {source: {path: /models/m.gguf}}
"""
LANE = """
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: l}
spec: {model: m, replicas: 2, slots: 2, threads: 2}
"""


def ready_model(store: MemoryStore, clock: Clock) -> None:
    apply(store, MODEL)
    helpers.mark_model_ready(store, "m", path="/models/m.gguf", now=clock.now)


def cond(store: MemoryStore, type_: str) -> tuple[str, str]:
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, Lane)
    c = conditions.get_condition(lane.status.conditions, type_)
    assert c is not None
    return c.status.value, c.reason


def lane_world() -> tuple[Clock, MemoryStore, FakeProcesses, LaneReconciler]:
    """A clock, an in-memory store, fake processes and the Lane reconciler over them."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    procs = FakeProcesses(clock)
    return clock, store, procs, LaneReconciler(store=store, processes=procs, clock=clock)


def reasons(store: MemoryStore) -> list[str]:
    return [e.reason for e in store.events(kind="Lane", name="l")]


def test_lane_lifecycle_start_ready_crash_restart_delete() -> None:
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE)

    asyncio.run(rec.reconcile("l"))
    assert [r.state for r in procs.observe("l")] == [ReplicaState.STARTING] * 2
    assert cond(store, "Ready") == ("False", "ReplicasNotReady")
    assert cond(store, "Progressing") == ("True", "ReplicasUpdating")

    procs.set_state("l", 0, ReplicaState.READY)
    procs.set_state("l", 1, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "Ready") == ("True", "AllReplicasReady")
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, Lane) and lane.status.ready_replicas == 2
    assert lane.status.observed_generation == 1

    # A crash: restarted at once.
    procs.set_state("l", 1, ReplicaState.FAILED)
    asyncio.run(rec.reconcile("l"))
    restarted = procs.observe("l")[1]
    assert restarted.state == ReplicaState.STARTING and restarted.restarts == 1
    assert cond(store, "Degraded") == ("True", "CrashLoopBackOff")

    # It crashes again: now it backs off.
    procs.set_state("l", 1, ReplicaState.FAILED)
    result = asyncio.run(rec.reconcile("l"))
    assert result.requeue_after == pytest.approx(1.0)
    assert procs.observe("l")[1].state == ReplicaState.FAILED  # still backing off

    clock.now += timedelta(seconds=1.1)
    asyncio.run(rec.reconcile("l"))
    restarted = procs.observe("l")[1]
    assert restarted.state == ReplicaState.STARTING and restarted.restarts == 2
    procs.set_state("l", 1, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "Ready") == ("True", "AllReplicasReady")
    assert cond(store, "Degraded") == ("False", "ReplicasHealthy")
    assert reasons(store) == [
        "ReplicaStarting", "ReplicaStarting", "ReplicaReady", "ReplicaReady",
        "ReplicaCrashed", "BackOff", "ReplicaCrashed", "BackOff", "ReplicaReady",
    ]  # fmt: skip
    # Each crash says when its restart comes, while the back-off runs.
    crashes = [
        e.message for e in store.events(kind="Lane", name="l") if e.reason == "ReplicaCrashed"
    ]
    assert crashes[0].endswith(" It is restarted at once."), crashes
    assert crashes[1].endswith(" It is restarted in 1 s, after its crash back-off."), crashes

    store.delete(Kind.LANE, "l")
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []


def test_lane_waits_for_its_model() -> None:
    clock, store, procs, rec = lane_world()
    apply(store, MODEL)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []
    assert cond(store, "ModelReady") == ("False", "ModelPending")
    ready_model(store, clock)
    asyncio.run(rec.reconcile("l"))
    assert len(procs.observe("l")) == 2


def test_lane_waits_for_a_model_status_from_an_older_generation() -> None:
    # The Model was edited (here: while the daemon was down) and its controller has not
    # resolved the edit yet: its status still names the old file.
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, MODEL.replace("/models/m.gguf", "/models/new.gguf"))
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []
    assert cond(store, "ModelReady") == ("False", "ModelPending")
    assert cond(store, "Ready") == ("False", "ModelNotReady")
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, Lane)
    ready = conditions.get_condition(lane.status.conditions, "ModelReady")
    assert ready is not None and "generation 2" in ready.message

    helpers.mark_model_ready(store, "m", path="/models/new.gguf", now=clock.now)
    asyncio.run(rec.reconcile("l"))
    assert [(i, launch.model_path) for _, i, launch in procs.started] == [
        (0, "/models/new.gguf"),
        (1, "/models/new.gguf"),
    ]


def test_running_lane_keeps_serving_until_an_edited_model_is_resolved() -> None:
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    serving = procs.observe("l")
    apply(store, MODEL.replace("/models/m.gguf", "/models/new.gguf"))
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == serving  # neither replaced by nor restarted on the old file
    assert cond(store, "ModelReady") == ("False", "ModelPending")

    helpers.mark_model_ready(store, "m", path="/models/new.gguf", now=clock.now)
    asyncio.run(rec.reconcile("l"))  # stops the old revision
    asyncio.run(rec.reconcile("l"))  # starts the new one
    assert [launch.model_path for _, _, launch in procs.started[2:]] == ["/models/new.gguf"] * 2
    assert len(procs.observe("l")) == 2


def test_manager_starts_a_lane_only_on_its_model_edited_while_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's start-up: the stored Model was resolved at generation 1, its spec
    is now at generation 2. The Lane waits, and the Model's new status wakes it."""
    old, new = tiny_gguf(tmp_path / "old.gguf"), tiny_gguf(tmp_path / "new.gguf")
    clock = Clock()
    store = MemoryStore(clock=clock)
    procs = FakeProcesses(clock)
    models = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    apply(store, MODEL.replace("/models/m.gguf", str(old)))
    asyncio.run(models.reconcile("m"))
    apply(store, MODEL.replace("/models/m.gguf", str(new)))
    apply(store, LANE)
    # The new file is read only once the Lane has had a pass on the stale status.
    gate = threading.Event()
    read_gguf = modelfile.read_gguf

    def gated_read(path: Path) -> modelfile.GGUFInfo:
        if not gate.wait(timeout=10):
            raise AssertionError("the Lane was never reconciled")
        return read_gguf(path)

    monkeypatch.setattr(modelfile, "read_gguf", gated_read)

    async def run() -> None:
        mgr = manager.Manager(
            store=store,
            reconcilers=[models, LaneReconciler(store=store, processes=procs, clock=clock)],
        )
        await mgr.start()
        try:
            await until(lambda: lane_condition(store, "ModelReady") is not None)
            gate.set()
            await until(lambda: len(procs.observe("l")) == 2)
        finally:
            gate.set()
            await mgr.stop()

    asyncio.run(run())
    assert {launch.model_path for _, _, launch in procs.started} == {str(new)}
    assert len(procs.started) == 2


DRAFTED = """
apiVersion: blazar.dev/v1alpha1
kind: Model
metadata: {name: d}
spec: {source: {path: /models/d.gguf}}
---
apiVersion: blazar.dev/v1alpha1
kind: SpecPair
metadata: {name: sp}
spec: {target: m, draft: {kind: model, model: d}}
"""


SPECULATING_LANE = LANE.replace("threads: 2", "threads: 2, speculation: sp")


def drafted_world() -> tuple[Clock, MemoryStore, FakeProcesses, LaneReconciler]:
    """`lane_world` with Model "m" ready and SpecPair "sp" drafting with Model "d", ready."""
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, DRAFTED)
    helpers.mark_model_ready(store, "d", path="/models/d.gguf", now=clock.now)
    return clock, store, procs, rec


def test_lane_waits_for_a_draft_model_status_from_an_older_generation() -> None:
    clock, store, procs, rec = drafted_world()
    apply(store, DRAFTED.replace("/models/d.gguf", "/models/d2.gguf"))
    apply(store, SPECULATING_LANE)
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []
    assert cond(store, "ModelReady") == ("False", "ModelPending")
    ready = lane_condition(store, "ModelReady")
    assert ready is not None and ready.message.startswith('Draft model "d" changed')

    helpers.mark_model_ready(store, "d", path="/models/d2.gguf", now=clock.now)
    asyncio.run(rec.reconcile("l"))
    drafts = [launch.speculation for _, _, launch in procs.started]
    assert [s.draft_model_path if s else None for s in drafts] == ["/models/d2.gguf"] * 2


def test_a_lane_shows_why_its_model_failed() -> None:
    clock, store, procs, rec = lane_world()
    apply(store, MODEL)
    missing = conditions.set_condition(
        [], type="ModelReady", status=ConditionStatus.FALSE, reason="FileNotFound",
        message="No file at /models/m.gguf.", observed_generation=1, now=clock.now,
    )  # fmt: skip
    store.update_status(Kind.MODEL, "m", ModelStatus(observed_generation=1, conditions=missing))
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []
    assert cond(store, "ModelReady") == ("False", "FileNotFound")
    ready = lane_condition(store, "Ready")
    assert ready is not None and ready.message == "No file at /models/m.gguf."
    # A failure recorded for an older generation of the Model is no answer yet.
    apply(store, MODEL.replace("/models/m.gguf", "/models/m2.gguf"))
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "ModelReady") == ("False", "ModelPending")


def test_a_lane_without_its_spec_pair_or_draft_says_so_at_each_start() -> None:
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, DRAFTED)
    draft = store.get(Kind.MODEL, "d")
    assert draft is not None
    # Its file is gone: resolved, not ready.
    missing = conditions.set_condition(
        [], type="ModelReady", status=ConditionStatus.FALSE, reason="FileNotFound",
        message="no file", observed_generation=draft.metadata.generation or 0, now=clock.now,
    )  # fmt: skip
    store.update_status(
        Kind.MODEL,
        "d",
        ModelStatus(observed_generation=draft.metadata.generation or 0, conditions=missing),
    )
    apply(store, SPECULATING_LANE)
    asyncio.run(rec.reconcile("l"))
    assert [launch.speculation for _, _, launch in procs.started] == [None, None]
    warnings = [e for e in store.events(kind="Lane", name="l") if e.type == "Warning"]
    assert [(e.reason, e.message) for e in warnings] == [
        (
            "SpeculationUnavailable",
            f'Replica {i} runs without speculation: the draft Model "d" of SpecPair "sp" '
            "is not ready.",
        )
        for i in (0, 1)
    ]
    store.delete(Kind.SPEC_PAIR, "sp")
    procs.started.clear()
    for index in (0, 1):
        procs.set_state("l", index, ReplicaState.FAILED)
    clock.tick(5)
    asyncio.run(rec.reconcile("l"))
    assert len(procs.started) == 2
    warnings = [e for e in store.events(kind="Lane", name="l") if e.type == "Warning"]
    assert [e.message for e in warnings if e.reason == "SpeculationUnavailable"][-2:] == [
        f'Replica {i} runs without speculation: SpecPair "sp" does not exist.' for i in (0, 1)
    ]


def test_a_draft_of_another_vocabulary_is_not_launched() -> None:
    # The engine refuses such a draft at every start: launched with it, the Lane's
    # replicas crash-looped and it served nothing.
    clock, store, procs, rec = lane_world()
    apply(store, MODEL)
    helpers.mark_model_ready(
        store, "m", path="/models/m.gguf", now=clock.now, parameters={"vocab_size": "262144"}
    )
    apply(store, DRAFTED)
    helpers.mark_model_ready(
        store, "d", path="/models/d.gguf", now=clock.now, parameters={"vocab_size": "50257"}
    )
    apply(store, SPECULATING_LANE)
    asyncio.run(rec.reconcile("l"))
    assert [launch.speculation for _, _, launch in procs.started] == [None, None]
    warnings = [e for e in store.events(kind="Lane", name="l") if e.type == "Warning"]
    assert (warnings[0].reason, warnings[0].message) == (
        "SpeculationUnavailable",
        'Replica 0 runs without speculation: the draft Model "d" of SpecPair "sp" has a '
        'vocabulary of 50257 tokens, its target "m" one of 262144: a draft must share the '
        "target's vocabulary.",
    )


POLICY = """
apiVersion: blazar.dev/v1alpha1
kind: SLOPolicy
metadata: {name: p}
spec: {priority: 100, ttftTargetMs: 2000, maxQueueDepth: 4, onOverload: reject}
"""


def test_a_lane_whose_slo_policy_is_deleted_says_so() -> None:
    """Deleting the SLOPolicy a running Lane names leaves its requests first come first
    served (no priority, target or queue bound); the Lane kept every condition True and
    wrote no event, though DESIGN §3 asks references that disappear to show as
    conditions. Now `ResolvedRefs` is False (one Warning), and True once it is back."""
    clock, store, _procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, POLICY)
    apply(store, LANE.replace("threads: 2", "threads: 2, sloPolicy: p"))
    asyncio.run(rec.reconcile("l"))
    assert lane_condition(store, "ResolvedRefs") is None
    store.delete(Kind.SLO_POLICY, "p")
    asyncio.run(rec.reconcile("l"))
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "ResolvedRefs") == ("False", "RefNotFound")
    gone = lane_condition(store, "ResolvedRefs")
    assert gone is not None and gone.message.startswith('SLOPolicy "p" not found.')
    assert reasons(store).count("RefNotFound") == 1
    apply(store, POLICY)
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "ResolvedRefs") == ("True", "AllRefsResolved")


def test_a_lane_with_its_spec_pair_ready_starts_without_warnings() -> None:
    _, store, procs, rec = drafted_world()
    apply(store, SPECULATING_LANE)
    asyncio.run(rec.reconcile("l"))
    assert len(procs.started) == 2
    assert [e.type for e in store.events(kind="Lane", name="l")] == ["Normal", "Normal"]


def test_a_context_beyond_the_models_training_starts_nothing_and_stops_nothing() -> None:
    # llama.cpp would run it, past the trained length the answers are noise: the Lane
    # says so, and a spec change to it leaves the replicas of the old spec serving.
    clock, store, procs, rec = lane_world()
    apply(store, MODEL)
    helpers.mark_model_ready(store, "m", path="/models/m.gguf", now=clock.now, context_length=4096)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    for index in (0, 1):
        procs.set_state("l", index, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    serving = procs.observe("l")
    assert cond(store, "Ready") == ("True", "AllReplicasReady")

    apply(store, LANE.replace("threads: 2}", "threads: 2, contextPerSlot: 8192}"))
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == serving
    assert cond(store, "ModelReady") == ("False", "ContextBeyondTraining")
    assert cond(store, "Available") == ("True", "MinimumReplicasAvailable")
    ready = lane_condition(store, "ModelReady")
    assert ready is not None
    assert ready.message == (
        'contextPerSlot 8192 is more than the 4096 tokens Model "m" was trained on; '
        "set it to 4096 or less."
    )
    asyncio.run(rec.reconcile("l"))
    assert reasons(store).count("ContextBeyondTraining") == 1  # once, as it turned False

    apply(store, LANE.replace("threads: 2}", "threads: 2, contextPerSlot: 4096}"))
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "ModelReady") == ("True", "ModelReady")
    assert [launch.context_per_slot for _, _, launch in procs.started][-1] == 4096


def test_a_lanes_model_deleted_or_being_resolved_warns_only_of_what_needs_acting_on() -> None:
    # As a deleted SLOPolicy or SpecPair does (RefNotFound): `blazar events` says why.
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    apply(store, MODEL.replace("/m.gguf", "/m2.gguf"))  # being resolved again: no warning
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "ModelReady") == ("False", "ModelPending")
    store.delete(Kind.MODEL, "m")
    for _ in range(2):
        asyncio.run(rec.reconcile("l"))
    warned = [
        (e.type, e.reason) for e in store.events(kind="Lane", name="l") if e.type == "Warning"
    ]
    assert warned == [("Warning", "ModelNotFound")]
    assert len(procs.observe("l")) == 2  # what was started keeps running


def test_a_model_whose_header_has_no_trained_context_is_not_checked() -> None:
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE.replace("threads: 2}", "threads: 2, contextPerSlot: 65536}"))
    asyncio.run(rec.reconcile("l"))
    assert len(procs.observe("l")) == 2


def test_a_lane_does_not_start_with_a_spec_pair_made_for_another_model() -> None:
    # The pair's draft was chosen for its target (a draft model must share its
    # vocabulary): on another model the engine would refuse it at every start.
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, MODEL.replace("name: m", "name: other"))
    helpers.mark_model_ready(store, "other", path="/models/other.gguf", now=clock.now)
    apply(store, DRAFTED.replace("target: m", "target: other"))
    helpers.mark_model_ready(store, "d", path="/models/d.gguf", now=clock.now)
    apply(store, SPECULATING_LANE)
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l") == []
    assert cond(store, "ModelReady") == ("False", "SpecPairTargetMismatch")
    ready = lane_condition(store, "ModelReady")
    assert ready is not None
    assert ready.message == 'SpecPair "sp" is for Model "other", not for this Lane\'s model "m".'

    apply(store, DRAFTED)
    asyncio.run(rec.reconcile("l"))
    drafts = [launch.speculation for _, _, launch in procs.started]
    assert [s.draft_model_path if s else None for s in drafts] == ["/models/d.gguf"] * 2
    assert cond(store, "ModelReady") == ("True", "ModelReady")


def test_a_model_change_wakes_the_lanes_that_serve_or_draft_from_it() -> None:
    store = MemoryStore(clock=Clock())
    apply(store, MODEL)
    apply(store, DRAFTED)
    apply(store, SPECULATING_LANE)
    apply(store, LANE.replace("name: l", "name: other"))
    refs = manager.References.of_store(store)
    assert sorted(refs.dependents(Kind.MODEL, "m")) == [
        (Kind.LANE, "l"),
        (Kind.LANE, "other"),
        (Kind.MODEL, "m"),
    ]
    assert refs.dependents(Kind.MODEL, "d") == [(Kind.MODEL, "d"), (Kind.LANE, "l")]


def test_the_references_follow_lanes_and_spec_pairs_as_they_change() -> None:
    store = MemoryStore(clock=Clock())
    refs = manager.References.of_store(store)
    store.subscribe(refs.changed)
    apply(store, MODEL)
    apply(store, DRAFTED)
    apply(store, SPECULATING_LANE)
    assert refs.dependents(Kind.MODEL, "d") == [(Kind.MODEL, "d"), (Kind.LANE, "l")]
    # The SpecPair drafts from another Model: the Lane names that one now.
    apply(store, MODEL.replace("name: m", "name: e"))
    apply(store, DRAFTED.replace("model: d}", "model: e}"))
    assert refs.dependents(Kind.MODEL, "d") == [(Kind.MODEL, "d")]
    assert refs.dependents(Kind.MODEL, "e") == [(Kind.MODEL, "e"), (Kind.LANE, "l")]
    # The Lane stops speculating, then goes.
    apply(store, LANE)
    assert refs.dependents(Kind.SPEC_PAIR, "sp") == [(Kind.SPEC_PAIR, "sp")]
    assert refs.dependents(Kind.MODEL, "m") == [(Kind.MODEL, "m"), (Kind.LANE, "l")]
    store.delete(Kind.LANE, "l")
    assert refs.dependents(Kind.MODEL, "m") == [(Kind.MODEL, "m")]


def lane_condition(store: MemoryStore, type_: str) -> Condition | None:
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, Lane)
    return conditions.get_condition(lane.status.conditions, type_)


async def until(predicate: Callable[[], bool], *, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


def test_spec_change_replaces_replicas() -> None:
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    before = {r.pid for r in procs.observe("l")}
    apply(store, LANE.replace("slots: 2", "slots: 4"))
    stopping = asyncio.run(rec.reconcile("l"))  # stops the old revision
    # The stops are over when the pass is: it looks again at once, not after a timer.
    assert stopping.requeue_after == 0.0
    asyncio.run(rec.reconcile("l"))  # starts the new one
    after = procs.observe("l")
    assert len(after) == 2 and not before & {r.pid for r in after}
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, Lane) and lane.status.observed_generation == 2


def test_a_health_change_is_told_to_the_supervisor_and_replaces_no_replica() -> None:
    """How replicas are checked is the daemon's business, not the engine's: a change
    reaches the supervisor (which reads it at each check) and restarts nothing; a
    deleted Lane's settings are forgotten."""
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    assert procs.health["l"] == Health()
    before = {r.pid for r in procs.observe("l")}
    apply(store, LANE.replace("threads: 2}", "threads: 2, health: {startupSeconds: 900}}"))
    asyncio.run(rec.reconcile("l"))
    asyncio.run(rec.reconcile("l"))
    assert procs.health["l"] == Health(startup_seconds=900)
    assert {r.pid for r in procs.observe("l")} == before
    store.delete(Kind.LANE, "l")
    asyncio.run(rec.reconcile("l"))
    assert "l" not in procs.health


def test_a_health_change_restarts_a_crashed_replica_without_its_back_off() -> None:
    """A replica that crash-loops on a startupSeconds too short for its model: the fix
    applies at once, not after the back-off the bad setting earned."""
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE.replace("replicas: 2", "replicas: 1"))
    asyncio.run(rec.reconcile("l"))
    for _ in range(2):  # the first restart is at once; the second crash backs off
        procs.set_state("l", 0, ReplicaState.FAILED)
        asyncio.run(rec.reconcile("l"))
    assert procs.observe("l")[0].state == ReplicaState.FAILED
    apply(store, LANE.replace("replicas: 2", "replicas: 1").replace(
        "threads: 2}", "threads: 2, health: {startupSeconds: 900}}"
    ))  # fmt: skip
    asyncio.run(rec.reconcile("l"))
    restarted = procs.observe("l")[0]
    assert restarted.state == ReplicaState.STARTING and restarted.restarts == 2
    assert [e.message for e in store.events(kind="Lane", name="l")][-1] == (
        "Restarting crashed replica 0 at once."
    )


def test_a_model_file_replaced_under_its_path_replaces_the_replicas() -> None:
    """A review replaced a Model's GGUF under the same path: the Model's status took
    the new file within seconds, and the Lane's replicas served the old weights on."""
    clock, store, procs, rec = lane_world()
    apply(store, MODEL)
    helpers.mark_model_ready(store, "m", path="/models/m.gguf", now=clock.now, mtime_ns=1)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    before = {r.pid for r in procs.observe("l")}
    helpers.mark_model_ready(store, "m", path="/models/m.gguf", now=clock.now, mtime_ns=2)
    asyncio.run(rec.reconcile("l"))  # stops the old revision
    asyncio.run(rec.reconcile("l"))  # starts the new one
    after = procs.observe("l")
    assert len(after) == 2 and not before & {r.pid for r in after}
    assert [launch.model_mtime_ns for _, _, launch in procs.started][-1] == 2


def test_no_replica_starts_on_a_ready_models_file_that_is_gone() -> None:
    """Found on a daemon restarted after a Lane's model file was removed: the stored
    status still said ModelReady, a replica started on the file before the Model was
    looked at again, crashed ("failed to open GGUF file"), and left the Lane Degraded
    with CrashLoopBackOff. Nothing starts while the file is gone; a replica that runs
    keeps serving (its engine holds the file); once the file is back, one starts."""
    clock, store, procs, _ = lane_world()
    present = {"/models/m.gguf": False}
    rec = LaneReconciler(store=store, processes=procs, clock=clock, file_exists=present.get)
    apply(store, MODEL)
    helpers.mark_model_ready(store, "m", path="/models/m.gguf", now=clock.now)
    apply(store, LANE)
    result = asyncio.run(rec.reconcile("l"))
    assert procs.started == []
    assert cond(store, "ModelReady") == ("False", "ModelPending")
    assert result.requeue_after == lane_module.MODEL_FILE_RECHECK_S
    present["/models/m.gguf"] = True
    asyncio.run(rec.reconcile("l"))
    assert len(procs.observe("l")) == 2  # the Lane's replicas
    for index in (0, 1):
        procs.set_state("l", index, ReplicaState.READY)
    present["/models/m.gguf"] = False  # removed under the running replicas
    asyncio.run(rec.reconcile("l"))
    assert [r.state for r in procs.observe("l")] == [ReplicaState.READY] * 2
    assert len(procs.started) == 2


def test_a_spec_change_of_ready_replicas_rolls_with_a_surge() -> None:
    """Ready replicas are replaced one at a time behind a surge replica (index 2), so
    the Lane serves from two ready replicas at every step and routes to the surge."""
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    for index in (0, 1):
        procs.set_state("l", index, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    old = {r.index: r.pid for r in procs.observe("l")}
    apply(store, LANE.replace("slots: 2", "slots: 4"))

    def ready_count() -> int:
        return sum(1 for r in procs.observe("l") if r.state == ReplicaState.READY)

    for _ in range(8):
        asyncio.run(rec.reconcile("l"))
        assert ready_count() >= 2
        for r in procs.observe("l"):
            if r.state == ReplicaState.STARTING:
                procs.set_state("l", r.index, ReplicaState.READY)
        lane = store.get(Kind.LANE, "l")
        assert isinstance(lane, Lane)
        serving = {r.index for r in lane.status.replica_statuses if r.state == "Ready"}
        if 2 in serving:
            assert cond(store, "Available") == ("True", "MinimumReplicasAvailable")
    after = procs.observe("l")
    assert [r.index for r in after] == [0, 1]
    assert not set(old.values()) & {r.pid for r in after}
    assert [i for _, i, _ in procs.started] == [0, 1, 2, 0, 1]
    assert cond(store, "Ready") == ("True", "AllReplicasReady")
    assert reasons(store).count("ReplicaStopped") == 3  # 0, 1 and the surge


def tiny_gguf(path: Path) -> Path:
    """A GGUF with one small F32 tensor (one without any is a vocabulary-only file,
    which a Model refuses)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_block_count(2)
    writer.add_tensor("w", numpy.ones((4, 8), dtype=numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def model_status(store: MemoryStore) -> Model:
    model = store.get(Kind.MODEL, "m")
    assert isinstance(model, Model)
    return model


@pytest.mark.parametrize("checksum", ["right", "wrong", "none"])
def test_model_reconciler_verifies_and_reads_header(tmp_path: Path, checksum: str) -> None:
    path = tiny_gguf(tmp_path / "m.gguf")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    sha = {"right": digest, "wrong": "0" * 64, "none": None}[checksum]
    clock = Clock()
    store = MemoryStore(clock=clock)
    spec = f"{{source: {{path: {path}}}" + (f", sha256: '{sha}'}}" if sha else "}")
    apply(store, MODEL.replace("{source: {path: /models/m.gguf}}", spec))
    asyncio.run(ModelReconciler(store=store, models_dir=tmp_path, clock=clock).reconcile("m"))
    model = model_status(store)
    ready = conditions.get_condition(model.status.conditions, "ModelReady")
    assert ready is not None
    if checksum == "wrong":
        assert (ready.status.value, ready.reason) == ("False", "ChecksumMismatch")
        assert digest in ready.message
        assert [e.reason for e in store.events(kind="Model")] == ["ChecksumMismatch"]
    else:
        assert (ready.status.value, ready.reason) == ("True", "Verified" if sha else "Resolved")
        assert model.status.architecture == "llama"
        assert model.status.context_length == 4096
        assert model.status.parameters["block_count"] == "2"
        assert model.status.sha256 == sha


def test_a_model_ready_on_another_file_says_so_once(tmp_path: Path) -> None:
    first, second = tiny_gguf(tmp_path / "a.gguf"), tiny_gguf(tmp_path / "b.gguf")
    clock = Clock()
    store = MemoryStore(clock=clock)
    rec = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    apply(store, MODEL.replace("/models/m.gguf", str(first)))
    asyncio.run(rec.reconcile("m"))
    asyncio.run(rec.reconcile("m"))  # the same file, looked at again: nothing new
    apply(store, MODEL.replace("/models/m.gguf", str(second)))
    asyncio.run(rec.reconcile("m"))
    asyncio.run(rec.reconcile("m"))
    events = [(e.reason, e.message) for e in store.events(kind="Model")]
    assert [reason for reason, _ in events] == ["ModelReady", "ModelReady"]
    assert str(first) in events[0][1] and str(second) in events[1][1]


def test_model_reconciler_polls_a_missing_file(tmp_path: Path) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    apply(store, MODEL.replace("/models/m.gguf", str(tmp_path / "later.gguf")))
    rec = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    result = asyncio.run(rec.reconcile("m"))
    assert result.requeue_after is not None
    ready = conditions.get_condition(model_status(store).status.conditions, "ModelReady")
    assert ready is not None and ready.reason == "FileNotFound"
    tiny_gguf(tmp_path / "later.gguf")
    asyncio.run(rec.reconcile("m"))
    assert conditions.is_true(model_status(store).status.conditions, "ModelReady")


@pytest.mark.parametrize(
    ("content", "reason"),
    [("half", "InvalidGGUF"), ("empty", "NotGGUF"), ("other", "ChecksumMismatch")],
)
def test_model_reconciler_looks_again_at_a_refused_file_once_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str, reason: str
) -> None:
    """A file caught while `cp new.gguf m.gguf` writes over the served one (empty, or
    cut short) or one with the wrong checksum is refused, and then replaced: the Model
    turns ready again within a poll, with no edit of its spec. A refused file is not
    parsed again while it stays as it is."""
    path = tmp_path / "m.gguf"
    good = tiny_gguf(tmp_path / "good.gguf").read_bytes()
    path.write_bytes({"half": good[: len(good) // 2], "empty": b"", "other": good + b"\0"}[content])
    clock = Clock()
    store = MemoryStore(clock=clock)
    sha = f", sha256: '{hashlib.sha256(good).hexdigest()}'" if content == "other" else ""
    spec = f"{{source: {{path: {path}}}{sha}}}"
    apply(store, MODEL.replace("{source: {path: /models/m.gguf}}", spec))
    rec = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    result = asyncio.run(rec.reconcile("m"))
    ready = conditions.get_condition(model_status(store).status.conditions, "ModelReady")
    assert ready is not None and ready.status == ConditionStatus.FALSE
    assert ready.reason == reason
    assert result.requeue_after is not None
    reads: list[Path] = []
    read_gguf = modelfile.read_gguf

    def counted_read(path: Path) -> modelfile.GGUFInfo:
        reads.append(path)
        return read_gguf(path)

    monkeypatch.setattr(modelfile, "read_gguf", counted_read)
    assert asyncio.run(rec.reconcile("m")).requeue_after is not None
    assert reads == []  # unchanged: not parsed (nor hashed) again
    assert [e.reason for e in store.events(kind="Model")] == [reason]
    replacement = tmp_path / "m.tmp"
    replacement.write_bytes(good)
    os.utime(replacement, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    replacement.replace(path)
    asyncio.run(rec.reconcile("m"))
    assert conditions.is_true(model_status(store).status.conditions, "ModelReady")


def test_model_reconciler_reinspects_only_when_the_file_or_spec_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf(tmp_path / "m.gguf")
    clock = Clock()
    store = MemoryStore(clock=clock)
    apply(store, MODEL.replace("/models/m.gguf", str(path)))
    rec = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    asyncio.run(rec.reconcile("m"))
    assert conditions.is_true(model_status(store).status.conditions, "ModelReady")

    def unreadable(_: Path) -> None:
        raise modelfile.SourceError("InvalidGGUF", "cannot read")

    monkeypatch.setattr(modelfile, "read_gguf", unreadable)
    asyncio.run(rec.reconcile("m"))  # same generation, same file: not read again
    assert conditions.is_true(model_status(store).status.conditions, "ModelReady")
    # Nor by a restarted controller: what it needs to know is in the stored status.
    restarted = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    asyncio.run(restarted.reconcile("m"))
    assert conditions.is_true(model_status(store).status.conditions, "ModelReady")

    os.utime(path, ns=(1, 1))  # the file changed on disk: inspected again
    asyncio.run(rec.reconcile("m"))
    ready = conditions.get_condition(model_status(store).status.conditions, "ModelReady")
    assert ready is not None and ready.reason == "InvalidGGUF"


def test_model_reconciler_reinspects_another_file_of_the_same_size_and_time(
    tmp_path: Path,
) -> None:
    """A copy renamed over the served file with its size and modification time (`cp -p`,
    `rsync -a`, `touch -r`) is another file: hashed again, and refused when its sha256
    is not the spec's. It stayed `Verified` on the old file's digest, for good."""
    path = tiny_gguf(tmp_path / "m.gguf")
    good = path.read_bytes()
    clock = Clock()
    store = MemoryStore(clock=clock)
    spec = f"{{source: {{path: {path}}}, sha256: '{hashlib.sha256(good).hexdigest()}'}}"
    apply(store, MODEL.replace("{source: {path: /models/m.gguf}}", spec))
    rec = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    asyncio.run(rec.reconcile("m"))
    assert conditions.is_true(model_status(store).status.conditions, "ModelReady")
    other = tmp_path / "m.tmp"
    other.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit: the same size
    before = path.stat()
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    other.replace(path)
    for reconciler in (rec, ModelReconciler(store=store, models_dir=tmp_path, clock=clock)):
        asyncio.run(reconciler.reconcile("m"))  # the running controller, a restarted one
        ready = conditions.get_condition(model_status(store).status.conditions, "ModelReady")
        assert ready is not None and ready.reason == "ChecksumMismatch"


def test_model_reconciler_reinspects_a_status_without_the_fit_figures(tmp_path: Path) -> None:
    """A Model resolved by a daemon that did not keep `repacked_bytes` is read once
    more, so that the fit ledger has its figures without the file changing."""
    path = tiny_gguf(tmp_path / "m.gguf")
    clock = Clock()
    store = MemoryStore(clock=clock)
    apply(store, MODEL.replace("/models/m.gguf", str(path)))
    rec = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    asyncio.run(rec.reconcile("m"))
    status = model_status(store).status
    assert status.parameters["repacked_bytes"] == "0"  # an F32 tensor: nothing repacked
    old = status.model_copy(
        update={"parameters": {k: v for k, v in status.parameters.items() if k != "repacked_bytes"}}
    )
    store.update_status(Kind.MODEL, "m", old)
    asyncio.run(rec.reconcile("m"))
    assert model_status(store).status.parameters["repacked_bytes"] == "0"


def test_describe_of_a_lane_created_again_while_its_old_replicas_stop_shows_its_own() -> None:
    """A Lane deleted and applied again at once: the reconciler is still stopping the
    deleted Lane's replicas (each drains for up to its grace) when the new one is
    created, so those stops are recorded after the new Lane's creation. They are the
    deleted Lane's (its uid), and the new Lane's page leaves them out; `events --for`
    lists them all."""
    from blazar.cli import observe, printers
    from blazar.dataplane import control

    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    procs.set_state("l", 0, ReplicaState.READY)
    procs.set_state("l", 1, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    first = store.get(Kind.LANE, "l")
    assert first is not None

    stop = procs.stop

    async def stop_while_applied_again(lane: str, index: int) -> None:
        if store.get(Kind.LANE, "l") is None:  # `blazar apply -f` during the drain
            clock.tick(0.5)
            apply(store, LANE)
            clock.tick(0.5)
        await stop(lane, index)

    procs.stop = stop_while_applied_again  # type: ignore[method-assign]
    store.delete(Kind.LANE, "l")
    asyncio.run(rec.reconcile("l"))
    asyncio.run(rec.reconcile("l"))
    second = store.get(Kind.LANE, "l")
    assert second is not None and second.metadata.uid != first.metadata.uid

    every = [observe.event_json(control._event(e)) for e in store.events(kind="Lane", name="l")]
    assert [e["reason"] for e in every].count("ReplicaStopped") == 2
    obj: printers.ObjectJson = json.loads(json.dumps(manifests.to_dict(second)))
    page = printers.describe(obj, every, now=clock.now).splitlines()
    shown = [line.split()[2] for line in page[page.index("Events:") + 2 :]]
    assert shown == ["ReplicaStarting", "ReplicaStarting"]


def test_model_reconciler_notices_a_ready_models_file_removed(tmp_path: Path) -> None:
    """Found on a daemon: a Model's file removed after apply left the Model Ready (it was
    looked at again only by the 5-minute resync), so its sleeping Lane, woken by a
    request, crash-looped on "could not load model" and the request waited out its
    queue bound for a 429 "retry in 1 s". A ready Model's file is checked again soon."""
    path = tiny_gguf(tmp_path / "m.gguf")
    clock = Clock()
    store = MemoryStore(clock=clock)
    apply(store, MODEL.replace("/models/m.gguf", str(path)))
    rec = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    first = asyncio.run(rec.reconcile("m"))
    assert conditions.is_true(model_status(store).status.conditions, "ModelReady")
    again = asyncio.run(rec.reconcile("m"))  # unchanged: nothing read, but looked at again
    for result in (first, again):
        assert result.requeue_after is not None and result.requeue_after <= 10.0
    path.unlink()
    asyncio.run(rec.reconcile("m"))
    ready = conditions.get_condition(model_status(store).status.conditions, "ModelReady")
    assert ready is not None and (ready.status.value, ready.reason) == ("False", "FileNotFound")


def ready(store: MemoryStore, name: str) -> bool:
    lane = store.get(Kind.LANE, name)
    assert isinstance(lane, Lane)
    found = conditions.get_condition(lane.status.conditions, "Ready")
    return found is not None and found.status == ConditionStatus.TRUE


class StatusLessStore(MemoryStore):
    """A store that cannot take status writes while `full` (a full disk, a status file
    that cannot be written), as the SQLite store says so: Unavailable."""

    full = False

    def update_status(self, kind: Kind, name: str, status: Any) -> Any:
        if self.full:
            raise errors.Unavailable("cannot write the store state.db: database or disk is full")
        return super().update_status(kind, name, status)


def status_less_world() -> tuple[Clock, StatusLessStore, FakeProcesses, LaneReconciler]:
    clock = Clock()
    store = StatusLessStore(clock=clock)
    procs = FakeProcesses(clock)
    return clock, store, procs, LaneReconciler(store=store, processes=procs, clock=clock)


def test_a_status_the_store_cannot_take_still_restarts_a_crashed_replica() -> None:
    """The write is retried soon, and the replica the Lane lost comes back meanwhile
    rather than wait for the disk."""
    clock, store, procs, rec = status_less_world()
    ready_model(store, clock)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    for index in (0, 1):
        procs.set_state("l", index, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    store.full = True
    procs.set_state("l", 1, ReplicaState.FAILED)
    with pytest.raises(TemporaryError, match="database or disk is full") as retry:
        asyncio.run(rec.reconcile("l"))
    assert retry.value.delay <= lane_module.STORE_RETRY_S
    assert [(r.index, r.state, r.restarts) for r in procs.observe("l")] == [
        (0, ReplicaState.READY, 0), (1, ReplicaState.STARTING, 1),
    ]  # fmt: skip
    store.full = False
    procs.set_state("l", 1, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "Ready") == ("True", "AllReplicasReady")


def test_a_status_the_store_cannot_take_stops_no_replica_the_data_plane_routes_to() -> None:
    """A rollout's surge replica is ready, but the status that makes it routable is not
    written: the old replica keeps serving until it is."""
    clock, store, procs, rec = status_less_world()
    ready_model(store, clock)
    apply(store, LANE.replace("replicas: 2", "replicas: 1"))
    asyncio.run(rec.reconcile("l"))
    procs.set_state("l", 0, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    apply(store, LANE.replace("replicas: 2", "replicas: 1").replace("slots: 2", "slots: 4"))
    asyncio.run(rec.reconcile("l"))  # the surge replica starts
    procs.set_state("l", 1, ReplicaState.READY)
    store.full = True
    for _ in range(3):
        with pytest.raises(TemporaryError) as retry:
            asyncio.run(rec.reconcile("l"))
        # No stop ran, so nothing is looked at again at once: the write is retried soon.
        assert retry.value.delay == lane_module.STORE_RETRY_S
    assert [r.index for r in procs.observe("l")] == [0, 1]
    store.full = False
    for _ in range(4):
        asyncio.run(rec.reconcile("l"))
        for r in procs.observe("l"):
            if r.state == ReplicaState.STARTING:
                procs.set_state("l", r.index, ReplicaState.READY)
    assert [r.index for r in procs.observe("l")] == [0]
    assert cond(store, "Ready") == ("True", "AllReplicasReady")


def test_a_lane_whose_status_cannot_be_written_holds_back_no_other_lane() -> None:
    """Through the manager: the failing Lane is retried, the other converges."""
    clock = Clock()

    class OneLaneFull(MemoryStore):
        def update_status(self, kind: Kind, name: str, status: Any) -> Any:
            if name == "l":
                raise errors.Unavailable("cannot write the store state.db: disk I/O error")
            return super().update_status(kind, name, status)

    store = OneLaneFull(clock=clock)
    procs = FakeProcesses(clock)
    ready_model(store, clock)
    apply(store, LANE)
    apply(store, LANE.replace("{name: l}", "{name: other}"))

    async def run() -> None:
        mgr = manager.Manager(
            store=store, reconcilers=[LaneReconciler(store=store, processes=procs, clock=clock)]
        )
        await mgr.start()
        try:
            await until(lambda: len(procs.observe("other")) == 2 and len(procs.observe("l")) == 2)
            for name in ("l", "other"):
                for index in (0, 1):
                    procs.set_state(name, index, ReplicaState.READY)
            mgr.enqueue(Kind.LANE, "other")
            await until(lambda: ready(store, "other"))
        finally:
            await mgr.stop()

    asyncio.run(run())
    assert [r.state for r in procs.observe("l")] == [ReplicaState.READY] * 2


@dataclass
class DrainWatchingProcesses(FakeProcesses):
    """Records what the stored status says of the Lane while each stop drains."""

    store: MemoryStore | None = None
    seen: list[tuple[int, int, list[tuple[int, str]], str]] = field(default_factory=list)

    async def stop(self, lane: str, index: int) -> None:
        assert self.store is not None
        stored = self.store.get(Kind.LANE, lane)
        assert isinstance(stored, Lane)
        ready = conditions.get_condition(stored.status.conditions, "Ready")
        assert ready is not None
        self.seen.append(
            (
                index,
                stored.status.ready_replicas,
                [(r.index, r.state) for r in stored.status.replica_statuses],
                ready.reason,
            )
        )
        await super().stop(lane, index)


@pytest.mark.parametrize(
    ("change", "seen"),
    [
        # The only replica of the old spec drains behind the ready surge: one serves.
        (("slots: 2", "slots: 4"), (0, 1, [(0, "Draining"), (1, "Ready")], "RollingUpdate")),
        # Scaled to zero: nothing serves while it drains, and the Lane says why.
        (("replicas: 1", "replicas: 0"), (0, 0, [(0, "Draining")], "ScalingDown")),
    ],
    ids=["rollout", "scale-to-zero"],
)
def test_a_replica_draining_is_neither_counted_ready_nor_shown_ready(
    change: tuple[str, str], seen: tuple[int, int, list[tuple[int, str]], str]
) -> None:
    """`get lanes` read 2/1 during a one-replica rollout and 1/0 while scaling to zero:
    the status written before a stop still called the draining replica Ready."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    procs = DrainWatchingProcesses(clock, store=store)
    rec = LaneReconciler(store=store, processes=procs, clock=clock)
    ready_model(store, clock)
    one = LANE.replace("replicas: 2", "replicas: 1")
    apply(store, one)
    asyncio.run(rec.reconcile("l"))
    procs.set_state("l", 0, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    apply(store, one.replace(*change))
    for _ in range(2):
        asyncio.run(rec.reconcile("l"))
        for r in procs.observe("l"):
            if r.state == ReplicaState.STARTING:
                procs.set_state("l", r.index, ReplicaState.READY)
    assert procs.seen[0] == seen


def test_a_model_and_its_lane_that_turn_unready_say_why_in_the_daemons_log_once(
    tmp_path: Path,
) -> None:
    """Found on a daemon: a Model's file removed under a running Lane turned both
    unready with Warning events, and the daemon's log said nothing."""
    path = tiny_gguf(tmp_path / "m.gguf")
    clock, store, _procs, lanes = lane_world()
    models = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    apply(store, MODEL.replace("/models/m.gguf", str(path)))
    asyncio.run(models.reconcile("m"))
    apply(store, LANE)
    asyncio.run(lanes.reconcile("l"))
    path.unlink()
    with structlog.testing.capture_logs() as logged:
        for _ in range(2):
            asyncio.run(models.reconcile("m"))
            asyncio.run(lanes.reconcile("l"))
    warnings = [
        (e["event"], e.get("model") or e.get("lane"), e["reason"], e["message"])
        for e in logged
        if e["log_level"] == "warning"
    ]
    missing = f"No file at {path}."
    assert warnings == [
        ("model.not_ready", "m", "FileNotFound", missing),
        ("lane.warning", "l", "FileNotFound", missing),
    ]
    assert next(e for e in logged if e["event"] == "model.not_ready")["retry_in_s"] == 10.0


def test_a_crash_while_the_model_is_not_ready_says_the_restart_waits_for_it() -> None:
    """Found on a daemon: a Model's file removed under a running Lane, then its engine
    killed: the event said "It is restarted at once." and nothing restarted, as no
    replica starts while its Model is not ready."""
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE)
    asyncio.run(rec.reconcile("l"))
    for index in (0, 1):
        procs.set_state("l", index, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    missing = conditions.set_condition(
        [], type="ModelReady", status=ConditionStatus.FALSE, reason="FileNotFound",
        message="No file at /models/m.gguf.", observed_generation=1, now=clock.now,
    )  # fmt: skip
    store.update_status(Kind.MODEL, "m", ModelStatus(observed_generation=1, conditions=missing))
    asyncio.run(rec.reconcile("l"))
    procs.set_state("l", 1, ReplicaState.FAILED)
    asyncio.run(rec.reconcile("l"))
    assert procs.observe("l")[1].state == ReplicaState.FAILED  # not restarted
    crashes = [e.message for e in store.events(kind="Lane") if e.reason == "ReplicaCrashed"]
    assert crashes == [
        "Replica 1 (pid 1002) exited with code -9: no message."
        " It is restarted once its Model is ready (FileNotFound)."
    ]


def test_a_model_whose_status_the_store_cannot_take_is_retried_within_seconds(
    tmp_path: Path,
) -> None:
    """Found by a review: a Model (or SLOPolicy) whose status write failed took the
    generic back-off, which grows to a minute, so after a full disk was freed its Lanes
    waited up to a minute more for it. A store refusal is retried every few seconds at
    most, as a warning without a traceback."""
    path = tiny_gguf(tmp_path / "m.gguf")
    clock = Clock()
    store = StatusLessStore(clock=clock)
    apply(store, MODEL.replace("/models/m.gguf", str(path)))
    rec = ModelReconciler(store=store, models_dir=tmp_path, clock=clock)
    key = (Kind.MODEL, "m")

    async def main() -> list[dict[str, Any]]:
        controller = manager.Manager(store=store, reconcilers=[rec])
        store.full = True
        with structlog.testing.capture_logs() as logs:
            for _ in range(12):
                await controller._reconcile(key)
        controller.queue.shut_down()
        return logs

    logs = [line for line in asyncio.run(main()) if line["event"].startswith("reconcile.")]
    assert [line["event"] for line in logs] == ["reconcile.retry"] * 12
    assert max(line["delay"] for line in logs) <= manager.STORE_RETRY_S


def test_a_replica_that_missed_a_health_check_is_not_counted_ready() -> None:
    """Found by a review: with its only engine stopped (SIGSTOP), `get lanes` read 1/1
    and Ready True while routing sent it nothing; it reads 0/1 until it answers."""
    clock, store, procs, rec = lane_world()
    ready_model(store, clock)
    apply(store, LANE.replace("replicas: 2", "replicas: 1"))
    asyncio.run(rec.reconcile("l"))
    procs.set_state("l", 0, ReplicaState.READY)
    asyncio.run(rec.reconcile("l"))
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, Lane) and lane.status.ready_replicas == 1 and ready(store, "l")
    procs.replicas[("l", 0)] = replace(procs.replicas[("l", 0)], missed_probes=1)
    asyncio.run(rec.reconcile("l"))
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, Lane) and lane.status.ready_replicas == 0 and not ready(store, "l")
    assert lane.status.replica_statuses[0].missed_probes == 1
    available = conditions.get_condition(lane.status.conditions, "Available")
    assert available is not None and available.reason == "NoReplicaReady"
    assert procs.observe("l")[0].state == ReplicaState.READY  # nothing stopped or started
    procs.replicas[("l", 0)] = replace(procs.replicas[("l", 0)], missed_probes=0)
    asyncio.run(rec.reconcile("l"))
    assert ready(store, "l")
