"""The Lane reconciler: runs `replicas` engine workers for a Lane and reports on them.

Reads the Lane, its Model and what the supervisor observes, asks `lane_plan` what to
do, does it through `Processes`, records an event per action and per replica
transition, and writes status. A deleted Lane has all its replicas stopped.

A Lane sleeps (zero replicas, `Available=False` reason `Sleeping`) after
idle.sleepAfter, when a request's keep_alive says so, or when the memory budget put it
to sleep to make room for a Lane a request waits for; `sleeper` decides, with
`residency`. The next request wakes it. `preload: true` keeps it awake through all.

An upstream Lane (`engine: upstream`) runs no process: its upstream is probed and its
status and events are `upstream_plan`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Protocol

import structlog

from blazar.api import conditions, errors
from blazar.api.kinds import (
    Kind,
    Lane,
    LaneStatus,
    Model,
    ModelDraft,
    NgramDraft,
    SpecPair,
    Upstream,
    references,
)
from blazar.api.meta import ConditionStatus
from blazar.api.replicas import LaunchSpec, ReplicaObservation, ReplicaState, SpeculationLaunch
from blazar.controller import fit, lane_plan, ledger, residency, sleeper, upstream_plan
from blazar.controller.hostmemory import HostMemory
from blazar.controller.processes import Processes
from blazar.controller.reconciler import STORE_RETRY_S, Result, TemporaryError
from blazar.enginehost import cores
from blazar.enginehost.activity import Activity
from blazar.enginehost.upstream import Probe, UpstreamPool
from blazar.store.base import Store

log = structlog.get_logger(__name__)

# How soon a Lane whose ready Model's file is gone looks again (`_file_gone`): the Model
# reconciler says why within its own poll, or the file is back.
MODEL_FILE_RECHECK_S = 2.0


def model_readiness(
    lane: Lane, model: Model | None, draft: Model | None = None, *, pair: SpecPair | None = None
) -> lane_plan.ModelReadiness:
    """Whether the Lane's model can be served; `pair` is its SpecPair and `draft` that
    pair's draft Model.

    A SpecPair made for another Model is not served: its draft was chosen for that
    target (a draft model must share the target's vocabulary, or the engine refuses
    it at every start), so nothing starts until the Lane or the pair is fixed. Nor is
    a `contextPerSlot` beyond the context the model was trained on (its GGUF header
    says it; a file that does not is not checked).
    """
    if lane.spec.engine != "llama-cpp":
        # An upstream Lane whose spec lacks its upstream (stored by an earlier version).
        return lane_plan.ModelReadiness(
            False, "UpstreamMissing", "engine upstream needs spec.upstream; apply it again."
        )
    if model is None:
        return lane_plan.ModelReadiness(
            False, "ModelNotFound", f'Model "{lane.spec.model}" does not exist.'
        )
    if pair is not None and pair.spec.target != lane.spec.model:
        return lane_plan.ModelReadiness(
            False,
            "SpecPairTargetMismatch",
            f'SpecPair "{pair.metadata.name}" is for Model "{pair.spec.target}", '
            f'not for this Lane\'s model "{lane.spec.model}".',
        )
    cond = conditions.get_condition(model.status.conditions, "ModelReady")
    pending = lane_plan.ModelReadiness(
        False, "ModelPending", f'Model "{model.metadata.name}" is not resolved yet.'
    )
    if cond is None:
        return pending
    # A status from an older generation (its path above all) describes a spec that is
    # gone: an engine started from it would run the old file, or crash on a removed
    # one, and be replaced once the Model controller catches up.
    for role, m in (("Model", model), ("Draft model", draft)):
        if m is not None and not m.status_current:
            return lane_plan.ModelReadiness(
                False,
                "ModelPending",
                f'{role} "{m.metadata.name}" changed (generation '
                f"{m.metadata.generation or 0}) and is not resolved again yet.",
            )
    if not conditions.is_true(model.status.conditions, "ModelReady"):
        # The Model's own reason (FileNotFound, InvalidGGUF, ...): a failed Model has no
        # path, and "not resolved yet" would hide why.
        return lane_plan.ModelReadiness(False, cond.reason, cond.message)
    if not model.status.path:
        return pending
    trained = model.status.context_length
    if trained and lane.spec.context_per_slot > trained:
        # llama.cpp would start it with a warning nobody reads, and the model's answers
        # past its trained length are noise: nothing starts, what runs keeps serving.
        return lane_plan.ModelReadiness(
            False,
            "ContextBeyondTraining",
            f"contextPerSlot {lane.spec.context_per_slot} is more than the {trained} "
            f'tokens Model "{model.metadata.name}" was trained on; set it to {trained} '
            "or less.",
        )
    return lane_plan.ModelReadiness(True, "ModelReady", f"Serving {model.status.path}.")


def speculation_launch(
    pair: SpecPair | None, draft: Model | None, target: Model | None
) -> SpeculationLaunch | None:
    """The SpecPair as the engine runs it; None when it is missing, its draft model is
    not ready, or the draft's vocabulary is not the `target` Model's (the Lane then
    serves without speculation)."""
    if pair is None:
        return None
    if isinstance(pair.spec.draft, NgramDraft):
        return SpeculationLaunch.of_pair(pair.spec)
    if draft is None or not draft.status.path or not draft.status_current:
        return None
    if not conditions.is_true(draft.status.conditions, "ModelReady"):
        return None
    if vocabularies_differ(draft, target):
        return None
    return SpeculationLaunch.of_pair(
        pair.spec, draft_model_path=draft.status.path, draft_model_mtime_ns=draft.status.mtime_ns
    )


def vocabularies_differ(draft: Model, target: Model | None) -> tuple[str, str] | None:
    """The vocabulary sizes of a draft Model and its target, as their GGUF headers
    give them, when both are known and differ: the engine refuses such a draft at
    every start (it drafts token ids the target reads as its own), so a replica
    started with it would only crash-loop. None otherwise."""
    if target is None:
        return None
    ours = draft.status.parameters.get("vocab_size")
    theirs = target.status.parameters.get("vocab_size")
    if ours is None or theirs is None or ours == theirs:
        return None
    return ours, theirs


def speculation_gap(
    lane: Lane, pair: SpecPair | None, draft: Model | None, target: Model | None
) -> str | None:
    """Why a Lane that asks for speculation runs without it; None when it does not ask
    or gets it."""
    name = lane.spec.speculation
    if name is None:
        return None
    if pair is None:
        return f'SpecPair "{name}" does not exist'
    if speculation_launch(pair, draft, target) is not None:
        return None
    assert isinstance(pair.spec.draft, ModelDraft)  # an n-gram pair always launches
    described = f'the draft Model "{pair.spec.draft.model}" of SpecPair "{name}"'
    sizes = None if draft is None else vocabularies_differ(draft, target)
    if sizes is not None:
        return (
            f"{described} has a vocabulary of {sizes[0]} tokens, its target "
            f'"{lane.spec.model}" one of {sizes[1]}: a draft must share the target\'s vocabulary'
        )
    state = "does not exist" if draft is None else "is not ready"
    return f"{described} {state}"


def model_shape(model: Model | None) -> fit.ModelShape | None:
    """The figures of a resolved Model's GGUF the fit ledger needs; None without them."""
    if model is None or not model.status.path:
        return None
    return fit.ModelShape.of_parameters(
        model.status.parameters, size_bytes=model.status.size_bytes or 0
    )


def launch_spec(
    lane: Lane, model: Model, *, default_threads: int, speculation: SpeculationLaunch | None = None
) -> LaunchSpec:
    assert model.status.path is not None
    return LaunchSpec.of_lane(
        lane.spec,
        model_path=model.status.path,
        default_threads=default_threads,
        chat_template=model.spec.chat_template,
        speculation=speculation,
        model_mtime_ns=model.status.mtime_ns,
    )


class Probes(Protocol):
    """The clients upstream Lanes are probed through (`UpstreamPool`)."""

    async def probe(self, spec: Upstream) -> Probe: ...

    async def retain(self, specs: Iterable[Upstream]) -> None: ...


class LaneReconciler:
    kind = Kind.LANE

    def __init__(
        self,
        *,
        store: Store,
        processes: Processes,
        clock: Callable[[], datetime],
        default_threads: int | None = None,
        activity: Activity | None = None,
        memory: HostMemory | None = None,
        budget: int | None = None,
        min_residency_s: float = residency.DEFAULT_MIN_RESIDENCY_S,
        notify: Callable[[str], None] | None = None,
        probes: Probes | None = None,
        file_exists: Callable[[str], bool] | None = None,
    ) -> None:
        """`activity`: what the data plane's callers are doing, for idle.sleepAfter,
        keep_alive and residency (None: no Lane ever sleeps). `memory` is what the fit
        ledger reads; None starts replicas unchecked. `budget`: bytes all replicas
        together may hold (None: what the host has). `notify(lane)` asks for another
        pass of a Lane (the budget put it to sleep, or memory freed for it). `probes`
        asks upstream Lanes' servers whether they answer (None: an `UpstreamPool` of
        its own); the clients of specs no Lane has any more are retired.
        `file_exists(path)` tells whether a ready Model's file is still there before a
        replica starts on it (None: not looked at)."""
        self._file_exists = file_exists
        self._probes: Probes = probes if probes is not None else UpstreamPool()
        # The upstream each upstream Lane was last probed at, by Lane: the specs whose
        # probe clients are kept.
        self._probed: dict[str, Upstream] = {}
        # Upstream Lanes' probes failed in a row, by Lane: their back-off.
        self._failures: dict[str, int] = {}
        # The uid of the Lane each name was last reconciled as, for its events: a Lane
        # deleted and created again may be applied while the old one's replicas stop,
        # and those stops are the old Lane's.
        self._uids: dict[str, str] = {}
        self._store = store
        self._processes = processes
        self._clock = clock
        self._default_threads = default_threads or cores.count()
        self._activity = activity
        self._ledger = (
            None
            if memory is None
            else ledger.Ledger(processes=processes, memory=memory, budget=budget)
        )
        self._sleeper = sleeper.Sleeper(
            store=store,
            processes=processes,
            clock=clock,
            activity=activity,
            ledger=self._ledger,
            min_residency_s=min_residency_s,
            notify=notify,
        )

    async def reconcile(self, name: str) -> Result:
        lane = self._store.get(Kind.LANE, name)
        if lane is None:
            self._sleeper.forget(name)
            self._processes.check(name, None)
            await self._stop_all(name)
            # After the stops: each replica saves its caches as it stops gracefully.
            await self._discard_kv(name)
            self._failures.pop(name, None)
            await self._probing(name, None)
            self._uids.pop(name, None)
            return Result()
        assert isinstance(lane, Lane)
        self._uids[name] = lane.metadata.uid or ""
        if lane.spec.engine == "upstream" and lane.spec.upstream is not None:
            return await self._reconcile_upstream(lane)
        self._failures.pop(name, None)
        await self._probing(name, None)
        health_changed = self._processes.check(name, lane.spec.health)
        model = self._store.get(Kind.MODEL, lane.spec.model)
        assert model is None or isinstance(model, Model)
        pair, draft = self._speculation(lane)
        readiness = model_readiness(lane, model, draft, pair=pair)
        gone = self._file_gone(model) if readiness.ready else None
        if gone is not None:
            readiness = gone
        launch = None
        if readiness.ready and model is not None:
            launch = launch_spec(
                lane,
                model,
                default_threads=self._default_threads,
                speculation=speculation_launch(pair, draft, model),
            )
        observed = self._processes.observe(name)
        sleep = self._sleeper.decide(lane)
        desired = 0 if sleep.asleep else lane.spec.replicas
        plan = lane_plan.plan_replicas(
            desired=desired,
            launch=launch,
            observed=observed,
            now=self._clock(),
            restart_now=health_changed,
        )
        placement = None
        room: float | None = None
        if launch is not None:
            plan, placement, shortfall = self._place(name, lane, plan, launch, model, draft)
            room = self._sleeper.make_room(name, shortfall)
        status = lane.status
        revision = launch.revision if launch is not None else None
        available = conditions.get_condition(status.conditions, "Available")
        was_asleep = available is not None and available.reason == "Sleeping"
        if sleep.asleep and not was_asleep:
            self._event(name, "Normal", "Sleeping", sleep.message)
        elif not sleep.asleep and was_asleep and desired > 0:
            self._event(name, "Normal", "Waking", "A request waits: starting replicas.")
        actions = plan.actions
        unwritten: errors.Unavailable | None = None
        if actions:
            # What is serving now goes out before acting: a stop drains for up to its
            # grace period, and the data plane routes by this status, so a surge
            # replica that just became ready must be routable before the old one goes.
            try:
                status = self._write_status(
                    name,
                    lane,
                    readiness,
                    status,
                    lane_plan.stopping(observed, actions),
                    revision,
                    placement,
                    sleep=sleep,
                )
            except errors.Unavailable as err:
                # The store cannot take it now: replicas still start (a crashed one is
                # restarted), but none is stopped while the data plane may still route
                # to it by the status it last read; the stops come once it is written.
                unwritten = err
                actions = [a for a in actions if isinstance(a, lane_plan.Start)]
        gap = speculation_gap(lane, pair, draft, model)
        for action in actions:
            await self._act(name, action)
            if gap is not None and isinstance(action, lane_plan.Start):
                # As DESIGN §3 asks of references that disappear: said, not silent.
                self._event(
                    name,
                    "Warning",
                    "SpeculationUnavailable",
                    f"Replica {action.index} runs without speculation: {gap}.",
                )
        observed = self._processes.observe(name)
        try:
            self._write_status(
                name, lane, readiness, status, observed, revision, placement, sleep=sleep
            )
        except errors.Unavailable as err:
            unwritten = err
        self._sleeper.passed(name, plan, observed)
        recheck = MODEL_FILE_RECHECK_S if gone is not None else None
        later = [
            t for t in (plan.requeue_after, sleep.recheck_after, room, recheck) if t is not None
        ]
        if plan.again and any(isinstance(a, lane_plan.Stop) for a in actions):
            later.append(0.0)  # the stops are done: what they freed starts now
        if unwritten is not None:
            raise TemporaryError(
                f"The Lane's status was not written ({unwritten})",
                delay=min([*later, STORE_RETRY_S]),
            )
        return Result(requeue_after=min(later, default=None))

    def _file_gone(self, model: Model | None) -> lane_plan.ModelReadiness | None:
        """Not ready when the file a ready Model's status names is gone: the status is
        from before (a restarted daemon's, read before the Model was looked at again;
        or within the Model's 10 s poll), and a replica started on it only crashed and
        left the Lane Degraded for a crash that was no engine's fault."""
        if self._file_exists is None or model is None or not model.status.path:
            return None
        if self._file_exists(model.status.path):
            return None
        return lane_plan.ModelReadiness(
            False,
            "ModelPending",
            f'Model "{model.metadata.name}"\'s file {model.status.path} is gone since it '
            "was read; it is looked at again.",
        )

    async def _probing(self, name: str, spec: Upstream | None) -> None:
        """Lane `name` is probed at `spec` now (None: it is no upstream Lane, or gone):
        when that changes, the probe clients of specs no Lane is probed at any more are
        retired (a url edited, a Lane deleted), so none holds its connections forever."""
        if self._probed.get(name) == spec:
            return
        if spec is None:
            del self._probed[name]
        else:
            self._probed[name] = spec
        await self._probes.retain(self._probed.values())

    async def _reconcile_upstream(self, lane: Lane) -> Result:
        """No process: probe the upstream, write what it answered (`upstream_plan`),
        and look again after the probe period, or the back-off while it fails."""
        name, spec = lane.metadata.name, lane.spec.upstream
        assert spec is not None
        # Engines of the Lane's life before it became an upstream Lane.
        for obs in self._processes.observe(name):
            await self._act(name, lane_plan.Stop(obs.index, "EngineUpstream"))
        await self._probing(name, spec)
        probe = await self._probes.probe(spec)
        failures = 0 if probe.ok else self._failures.get(name, 0) + 1
        self._failures[name] = failures
        event = upstream_plan.transition(lane.status, ok=probe.ok, message=probe.message)
        status = upstream_plan.upstream_status(
            previous=lane.status,
            generation=lane.metadata.generation or 0,
            url=spec.url,
            ok=probe.ok,
            message=probe.message,
            now=self._clock(),
        )
        # Its SLOPolicy is as much a reference as a local Lane's: one deleted says so.
        status = self._resolved_refs(name, lane, lane.status, status)
        if status != lane.status:
            self._store.update_status(Kind.LANE, name, status)
        if event is not None:
            log.info("upstream.probe", lane=name, ok=probe.ok, message=probe.message)
            self._event(name, event.type, event.reason, event.message)
        return Result(requeue_after=upstream_plan.next_probe_s(failures))

    def _preloaded(self, name: str) -> list[str]:
        """The Lanes other than `name` with processes and `preload: true`, whose memory
        the budget never frees (only Lanes with processes hold any: no full listing,
        which costs a parse of every stored object per pass)."""
        if self._ledger is None or not self._ledger.budgeted:
            return []
        found = []
        for other in sorted(self._processes.lanes() - {name}):
            lane = self._store.get(Kind.LANE, other)
            if isinstance(lane, Lane) and lane.spec.preload:
                found.append(other)
        return found

    def _place(
        self,
        name: str,
        lane: Lane,
        plan: lane_plan.LanePlan,
        launch: LaunchSpec,
        model: Model | None,
        draft: Model | None,
    ) -> tuple[lane_plan.LanePlan, lane_plan.Placement | None, fit.Fit | None]:
        """The plan with only the starts the host's memory holds (the fit ledger), the
        Lane's `Schedulable` word, and the fit that failed; an event when the word
        changes."""
        if self._ledger is None:
            return plan, None, None
        shape = model_shape(model)
        if shape is None:
            placement = lane_plan.Placement(
                True,
                "NotEstimated",
                "The model's GGUF header lacks the figures of a memory estimate; "
                "replicas start unchecked.",
            )
            return plan, placement, None
        draft_shape = None
        if launch.speculation is not None and launch.speculation.draft_model_path:
            draft_shape = model_shape(draft)
        estimate = fit.estimate(launch, shape, draft=draft_shape)
        placed = self._ledger.place(name, plan, estimate, preload=self._preloaded(name))
        before = conditions.get_condition(lane.status.conditions, "Schedulable")
        was = (before.status.value, before.reason) if before is not None else None
        now = (placed.placement.fits, placed.placement.reason)
        if not placed.placement.fits and was != ("False", placed.placement.reason):
            self._event(name, "Warning", placed.placement.reason, placed.placement.message)
        elif now == (True, "MemoryFits") and was is not None and was[0] == "False":
            self._event(name, "Normal", "MemoryFits", placed.placement.message)
        return placed.plan, placed.placement, placed.shortfall

    def _write_status(
        self,
        name: str,
        lane: Lane,
        readiness: lane_plan.ModelReadiness,
        previous: LaneStatus,
        observed: list[ReplicaObservation],
        revision: str | None,
        placement: lane_plan.Placement | None,
        *,
        sleep: lane_plan.Sleep,
    ) -> LaneStatus:
        status = lane_plan.lane_status(
            previous=previous,
            generation=lane.metadata.generation or 0,
            desired=0 if sleep.asleep else lane.spec.replicas,
            model=readiness,
            observed=observed,
            now=self._clock(),
            revision=revision,
            sleeping=sleep.asleep,
            placement=placement,
            sleep_message=sleep.message,
        )
        status = self._resolved_refs(name, lane, previous, status)
        if (unready := lane_plan.model_warning(previous, status)) is not None:
            self._event(name, "Warning", unready.reason, unready.message)
        self._record_transitions(name, previous, observed, model=readiness)
        self._store.update_status(Kind.LANE, name, status)
        return status

    def _resolved_refs(
        self, name: str, lane: Lane, previous: LaneStatus, status: LaneStatus
    ) -> LaneStatus:
        """As DESIGN §3 asks of references that disappear after apply: said, not silent.
        A Lane whose SLOPolicy or SpecPair is gone keeps serving (its requests first
        come first served, without priority, target or queue bound; its engines without
        speculation), and says so in `ResolvedRefs` (False, `RefNotFound`) and a Warning
        event. The condition is written once a reference has been missing, and True
        again when it is back."""
        missing = [
            (kind, ref)
            for _, kind, ref in references(lane)
            if kind in (Kind.SLO_POLICY, Kind.SPEC_PAIR) and self._store.get(kind, ref) is None
        ]
        before = conditions.get_condition(previous.conditions, "ResolvedRefs")
        if not missing and before is None:
            return status
        if missing:
            message = ", ".join(f'{kind.value} "{ref}"' for kind, ref in missing) + " not found."
            if any(kind == Kind.SLO_POLICY for kind, _ in missing):
                message += (
                    " Its requests are admitted first come first served meanwhile"
                    " (no priority, TTFT target or queue bound)."
                )
        else:
            message = "Every reference exists."
        if missing and (
            before is None or (before.status, before.message) != (ConditionStatus.FALSE, message)
        ):
            self._event(name, "Warning", "RefNotFound", message)
        return status.model_copy(
            update={
                "conditions": conditions.set_condition(
                    status.conditions,
                    type="ResolvedRefs",
                    status=ConditionStatus.FALSE if missing else ConditionStatus.TRUE,
                    reason="RefNotFound" if missing else "AllRefsResolved",
                    message=message,
                    observed_generation=lane.metadata.generation or 0,
                    now=self._clock(),
                )
            }
        )

    def _speculation(self, lane: Lane) -> tuple[SpecPair | None, Model | None]:
        """The Lane's SpecPair and its draft Model, each None when absent."""
        if lane.spec.speculation is None:
            return None, None
        pair = self._store.get(Kind.SPEC_PAIR, lane.spec.speculation)
        if not isinstance(pair, SpecPair):
            return None, None
        draft = None
        if isinstance(pair.spec.draft, ModelDraft):
            found = self._store.get(Kind.MODEL, pair.spec.draft.model)
            draft = found if isinstance(found, Model) else None
        return pair, draft

    async def _act(self, name: str, action: lane_plan.Action) -> None:
        if isinstance(action, lane_plan.Start):
            if action.restart:
                self._event(name, "Warning", "BackOff", lane_plan.restart_message(action))
            else:
                self._event(name, "Normal", "ReplicaStarting", f"Starting replica {action.index}.")
            log.info("replica.start", lane=name, index=action.index, restart=action.restart)
            self._sleeper.started(name)
            warnings = await self._processes.start(name, action.index, action.launch)
            if self._ledger is not None:
                self._ledger.started(name, action.index)
            for warning in warnings:
                self._event(name, "Warning", warning.reason, warning.message)
        else:
            log.info("replica.stop", lane=name, index=action.index, reason=action.reason)
            await self._processes.stop(name, action.index)
            if self._ledger is not None:
                self._ledger.forget(name, action.index)
            self._event(
                name,
                "Normal",
                "ReplicaStopped",
                f"Stopped replica {action.index} ({action.reason}).",
            )

    async def _stop_all(self, name: str) -> None:
        for obs in self._processes.observe(name):
            await self._act(name, lane_plan.Stop(obs.index, "LaneDeleted"))

    async def _discard_kv(self, name: str) -> None:
        """Remove the KV caches of a deleted Lane, so that no later Lane of that name
        restores them. A scale-down keeps them, as a StatefulSet keeps its volumes:
        `replicas: 0` pauses a Lane, and scaling back up finds the caches."""
        for index in await self._processes.discard_kv(name):
            log.info("replica.kv_removed", lane=name, index=index)
            self._event(
                name, "Normal", "KVCacheRemoved", f"Removed the saved KV cache of replica {index}."
            )

    def _record_transitions(
        self,
        name: str,
        previous: LaneStatus,
        observed: list[ReplicaObservation],
        *,
        model: lane_plan.ModelReadiness,
    ) -> None:
        # Restarts are in the key because a replica that failed to spawn has no pid, so
        # each failed attempt would otherwise look like the one before.
        before = {r.index: (r.state, r.pid, r.restarts) for r in previous.replica_statuses}
        missed_before = {(r.index, r.pid): r.missed_probes for r in previous.replica_statuses}
        for obs in observed:
            if (
                obs.state == ReplicaState.READY
                and obs.missed_probes
                and not missed_before.get((obs.index, obs.pid))
            ):
                # As the kubelet's Unhealthy event for a failed probe.
                self._event(
                    name,
                    "Warning",
                    "Unhealthy",
                    f"Replica {obs.index} (pid {obs.pid}) missed a health check: no "
                    "requests go to it until it answers again, and those it holds without "
                    "a first token go back to the queue.",
                )
            if before.get(obs.index) == (obs.state.value, obs.pid, obs.restarts):
                continue
            if obs.state == ReplicaState.READY:
                self._event(
                    name, "Normal", "ReplicaReady", f"Replica {obs.index} (pid {obs.pid}) is ready."
                )
            elif obs.state == ReplicaState.FAILED and obs.pid is None:
                self._event(
                    name,
                    "Warning",
                    "ReplicaStartFailed",
                    f"Replica {obs.index}: {obs.message or 'its process could not be started'}."
                    + lane_plan.restart_note(obs, model=model),
                )
            elif obs.state == ReplicaState.FAILED:
                self._event(
                    name,
                    "Warning",
                    "ReplicaCrashed",
                    f"Replica {obs.index} (pid {obs.pid}) exited with code {obs.exit_code}: "
                    f"{obs.message or 'no message'}." + lane_plan.restart_note(obs, model=model),
                )

    def _event(self, name: str, type_: str, reason: str, message: str) -> None:
        """An event on the Lane; a Warning one is the daemon's log line too, as
        Kubernetes' event recorder logs what it records: a Lane that cannot start
        (its Model, its memory) or runs short of its spec says why where an operator
        tails the log, not only in `describe`. Each is recorded once per change, so
        the line is too."""
        if type_ == "Warning":
            log.warning("lane.warning", lane=name, reason=reason, message=message)
        self._store.record_event(
            kind=Kind.LANE.value,
            name=name,
            type=type_,
            reason=reason,
            message=message,
            uid=self._uids.get(name, ""),
        )
