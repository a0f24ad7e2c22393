"""Pure decisions for a Lane: which replicas to start or stop, and what status to show.

No IO, no clock, no logging: everything comes in as arguments (`now` included), so the
state machine is tested with tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from blazar.api import conditions
from blazar.api.kinds import LaneMemory, LaneStatus, ReplicaStatus
from blazar.api.meta import Condition, ConditionStatus
from blazar.api.replicas import LaunchSpec, ReplicaObservation, ReplicaState

SLEEPING = "No request for idle.sleepAfter: no replica runs; the next request wakes it."
RELEASED = (
    "A request's keep_alive ended the Lane's residency: no replica runs; the next request wakes it."
)

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0
# A replica that ran this long before it crashed restarts at once again, as the kubelet
# resets a container's back-off after 10 minutes of running: a rare crash weeks after
# the last one should not keep the replica down for the maximum.
BACKOFF_RESET_S = 600.0


def crash_backoff(restarts: int) -> float:
    """Delay before restarting a replica that has already been restarted `restarts` times:
    none the first time, then from the base delay, doubling up to the maximum. A one-off
    crash costs only the restart's load (about 1.5 s for the bundled model), during
    which requests wait for the Starting replica (`routing.waits`); while a failed one
    waits out a delay, new requests are refused ("retry shortly")."""
    if restarts <= 0:
        return 0.0
    return float(min(BACKOFF_BASE_S * (2 ** min(restarts - 1, 16)), BACKOFF_MAX_S))


@dataclass(frozen=True)
class Start:
    index: int
    launch: LaunchSpec
    restart: bool
    # The back-off a restart waited out (`crash_backoff`): 0 for a first crash.
    backoff_s: float = 0.0


@dataclass(frozen=True)
class Stop:
    index: int
    reason: str


Action = Start | Stop


@dataclass(frozen=True)
class LanePlan:
    actions: list[Action] = field(default_factory=list)
    requeue_after: float | None = None
    # Look again as soon as this pass's actions are done: a Stop in them frees an index
    # that the next pass starts at the new revision (the stop is over when the pass
    # is; nothing else would wake the Lane then).
    again: bool = False


@dataclass(frozen=True)
class Sleep:
    """Whether a Lane with idle.sleepAfter sleeps now, and when to look again."""

    asleep: bool = False
    # Seconds until it would fall asleep if nothing comes (None: nothing to wait for).
    recheck_after: float | None = None
    # Why it sleeps, for its Available condition.
    message: str = SLEEPING


def sleep_decision(
    *,
    sleep_after_s: float | None,
    idle_s: float,
    in_flight: int,
    wanted: bool,
    keep_s: float = 0.0,
    keep_forever: bool = False,
    release: bool = False,
) -> Sleep:
    """A Lane sleeps once no request has been in flight for `sleep_after_s` seconds
    (`idle_s`: since the last one ended); a request in flight or waiting for it (the
    data plane `wanted` it) keeps it awake or wakes it.

    Requests' keep_alive (Ollama's, `Activity.keep`) bends that: `keep_forever` (a
    negative one, the last said) keeps it awake; `release` (a zero one) puts it to
    sleep as soon as it is idle, with or without idle.sleepAfter; `keep_s` (what is left
    of the longest positive one) keeps it awake at least that long, never shorter than
    idle.sleepAfter would, and does not make a Lane without idle.sleepAfter sleep."""
    if in_flight > 0 or wanted:
        # Busy: the end of its last request wakes the controller (and so this count).
        return Sleep(asleep=False)
    if keep_forever:
        return Sleep()
    if release:
        return Sleep(asleep=True, message=RELEASED)
    if sleep_after_s is None:
        return Sleep()
    wait = max(sleep_after_s - idle_s, keep_s)
    if wait <= 0:
        return Sleep(asleep=True)
    return Sleep(asleep=False, recheck_after=wait)


def plan_replicas(
    *,
    desired: int,
    launch: LaunchSpec | None,
    observed: Sequence[ReplicaObservation],
    now: datetime,
    restart_now: bool = False,
) -> LanePlan:
    """Converge the replica set to `desired` copies of `launch`, never stopping a ready
    replica while that would leave fewer than `desired` ready.

    A spec change is a rolling update with one surge replica and none unavailable (a
    Deployment's maxSurge 1, maxUnavailable 0): while a ready replica runs an older
    revision, one replica of the new revision runs at index `desired`. A ready replica
    of an older revision is stopped once the ready count stays at `desired` or more
    without it; its index then starts again at the new revision. The surge stops once
    every index below `desired` is ready at the new revision. A surge of an older
    revision (the spec changed again mid-rollout) is replaced the same way. A replica
    that serves nothing yet (starting) is replaced at once.

    `launch is None` means the model is not ready: nothing new starts, running
    replicas are left alone, and replicas at `desired` or above stop only as the ready
    count allows (a surge may be all that serves while the Model is being resolved). A
    failed replica, the surge included, is restarted once its backoff has passed, or at
    once with `restart_now` (its Lane's health checks changed: the crash may have been
    theirs, as a Deployment's new template starts new pods without a back-off). If
    the new revision never becomes ready, the old replicas keep serving, as a stuck
    Deployment rollout keeps its old pods.
    """
    actions: list[Action] = []
    waits: list[float] = []
    again = False
    serving = sum(1 for o in observed if o.state == ReplicaState.READY)

    def stop(replica: ReplicaObservation, reason: str) -> bool:
        nonlocal serving
        if replica.state == ReplicaState.READY:
            if serving - 1 < desired:
                return False  # still needed: a later pass stops it
            serving -= 1
        actions.append(Stop(replica.index, reason))
        return True

    if launch is None:
        for extra in sorted(observed, key=lambda o: -o.index):
            if extra.index >= desired:
                stop(extra, "ScaledDown")
        return LanePlan(actions)
    by_index = {obs.index: obs for obs in observed}
    new = launch.revision
    settled = all(
        (o := by_index.get(i)) is not None and o.state == ReplicaState.READY and o.revision == new
        for i in range(desired)
    )
    rolling = any(
        o.index < desired and o.state == ReplicaState.READY and o.revision != new for o in observed
    )
    for extra in sorted(observed, key=lambda o: -o.index):
        if extra.index > desired:
            stop(extra, "ScaledDown")
    surge = by_index.get(desired)
    surge_free = surge is None
    if surge is not None:
        if settled or surge.state not in _KEPT_SURGE:
            surge_free = stop(surge, "ScaledDown")
        elif surge.revision != new:
            surge_free = stop(surge, "SpecChanged")
        elif surge.state == ReplicaState.FAILED:
            _restart_after_backoff(surge, launch, now, actions, waits, at_once=restart_now)
    if rolling and surge_free:
        if surge is None:
            actions.append(Start(desired, launch, restart=False))
        else:
            again = True  # its index is being stopped this pass
    for index in range(desired):
        replica = by_index.get(index)
        if replica is None:
            actions.append(Start(index, launch, restart=False))
        elif replica.state == ReplicaState.FAILED:
            _restart_after_backoff(replica, launch, now, actions, waits, at_once=restart_now)
        elif (
            replica.revision != new
            and replica.state in _KEPT_SURGE
            and stop(replica, "SpecChanged")
        ):
            # Look again once the stop is done, to start the index at the new revision.
            again = True
    return LanePlan(actions, requeue_after=min(waits) if waits else None, again=again)


# A replica is kept while it is on its way to serving, serving, or failed (and restarted).
_KEPT_SURGE = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED)


def _backoff_of(replica: ReplicaObservation, exited_at: datetime) -> float:
    """`crash_backoff` for a failed replica: none after BACKOFF_RESET_S of running."""
    ran = (exited_at - replica.started_at).total_seconds() if replica.started_at else 0.0
    return crash_backoff(0 if ran >= BACKOFF_RESET_S else replica.restarts)


def restart_due(replica: ReplicaObservation) -> datetime | None:
    """When a failed replica's crash back-off ends and it is restarted; None for one that
    has not failed (or whose exit time is unknown). Shown in its status (`restartAt`),
    from which a request refused meanwhile learns how long to wait."""
    if replica.state != ReplicaState.FAILED or replica.exited_at is None:
        return None
    return replica.exited_at + timedelta(seconds=_backoff_of(replica, replica.exited_at))


def restart_note(replica: ReplicaObservation, *, model: ModelReadiness | None = None) -> str:
    """What a failed replica's crash event adds: when it is restarted, so that the event
    list says so during the back-off and not only once the restart happens. With its
    Lane's Model not ready nothing starts (`plan_replicas` with no launch), whatever
    the back-off says, so the note says what the restart waits for instead."""
    if model is not None and not model.ready:
        return f" It is restarted once its Model is ready ({model.reason})."
    due = restart_due(replica)
    if due is None or replica.exited_at is None:
        return ""
    wait = (due - replica.exited_at).total_seconds()
    if wait <= 0:
        return " It is restarted at once."
    return f" It is restarted in {wait:g} s, after its crash back-off."


def _restart_after_backoff(
    replica: ReplicaObservation,
    launch: LaunchSpec,
    now: datetime,
    actions: list[Action],
    waits: list[float],
    *,
    at_once: bool = False,
) -> None:
    exited_at = replica.exited_at or now
    backoff = _backoff_of(replica, exited_at)
    wait = backoff - (now - exited_at).total_seconds()
    if at_once and wait > 0:
        actions.append(Start(replica.index, launch, restart=True, backoff_s=0.0))
    elif wait <= 0:
        actions.append(Start(replica.index, launch, restart=True, backoff_s=backoff))
    else:
        waits.append(wait)


def restart_message(start: Start) -> str:
    """The BackOff event's message: whether the restart waited, and how long (the
    schedule in docs/lanes.md: at once the first time, then 1 s doubling to 60 s)."""
    if start.backoff_s <= 0:
        return f"Restarting crashed replica {start.index} at once."
    return f"Restarting crashed replica {start.index} after a {start.backoff_s:g} s back-off."


def stopping(
    observed: Sequence[ReplicaObservation], actions: Sequence[Action]
) -> list[ReplicaObservation]:
    """`observed` as it is once `actions` begin: a serving replica they stop is
    Draining (it takes no new request, and a Pod that terminates is not ready), so the
    status written before a stop neither counts it ready nor routes to it while it
    finishes its requests."""
    stops = {action.index for action in actions if isinstance(action, Stop)}
    return [
        replace(o, state=ReplicaState.DRAINING)
        if o.index in stops and o.state == ReplicaState.READY
        else o
        for o in observed
    ]


def _answering(obs: ReplicaObservation) -> bool:
    """Ready and answering its health checks: what the Lane counts as ready and
    serving. One that missed its last check takes no requests until it answers
    (`ReplicaObservation.missed_probes`), so it is not counted, as a Pod that fails its
    readiness probe is not."""
    return obs.state == ReplicaState.READY and not obs.missed_probes


def replica_statuses(observed: Sequence[ReplicaObservation]) -> list[ReplicaStatus]:
    return [
        ReplicaStatus(
            index=obs.index,
            pid=obs.pid,
            state=obs.state.value,
            socket=obs.socket,
            restarts=obs.restarts,
            started_at=obs.started_at,
            last_exit_code=obs.exit_code,
            last_exit_reason=obs.exit_reason,
            restart_at=restart_due(obs),
            message=obs.message,
            slots=obs.slots,
            context_per_slot=obs.context_per_slot,
            missed_probes=obs.missed_probes,
        )
        for obs in sorted(observed, key=lambda o: o.index)
    ]


@dataclass(frozen=True)
class ModelReadiness:
    ready: bool
    reason: str
    message: str


def model_warning(previous: LaneStatus, status: LaneStatus) -> Condition | None:
    """The Lane's `ModelReady` when it has just turned False for a reason its operator
    must act on (its Model deleted or failed, a SpecPair of another model, a context
    beyond training), for a Warning event; None otherwise. `ModelPending` (the Model
    being resolved again after an edit) passes by itself and warns of nothing."""
    now = conditions.get_condition(status.conditions, "ModelReady")
    if now is None or now.status != ConditionStatus.FALSE or now.reason == "ModelPending":
        return None
    before = conditions.get_condition(previous.conditions, "ModelReady")
    if before is not None and (before.status, before.reason, before.message) == (
        now.status,
        now.reason,
        now.message,
    ):
        return None
    return now


@dataclass(frozen=True)
class Placement:
    """The fit ledger's word on the Lane's next replica (`Schedulable`)."""

    fits: bool
    reason: str
    message: str
    memory: LaneMemory | None = None


def _settled(placement: Placement | None, previous: LaneStatus) -> Placement | None:
    """The placement as the previous status told it, when it is the same verdict.

    The free memory in a placement's figures and message moves with every wobble of
    the host's; writing it each pass would change the status, and each status change
    wakes the Lane's reconciler again: a Lane waiting for memory would spin instead of
    looking every few seconds. So the figures are those of the pass that reached the
    verdict (fits or not, for which replica, at which estimate).
    """
    before = conditions.get_condition(previous.conditions, "Schedulable")
    kept = previous.memory
    if placement is None or placement.memory is None or before is None or kept is None:
        return placement
    same = (
        before.status == (ConditionStatus.TRUE if placement.fits else ConditionStatus.FALSE)
        and before.reason == placement.reason
        and kept.estimate_bytes == placement.memory.estimate_bytes
        and kept.waiting_replica == placement.memory.waiting_replica
        and kept.budget_bytes == placement.memory.budget_bytes
        and kept.never_fits == placement.memory.never_fits
    )
    return Placement(placement.fits, placement.reason, before.message, kept) if same else placement


# The Ready reason while a rolling update replaces replicas.
ROLLING_UPDATE = "RollingUpdate"


def lane_status(
    *,
    previous: LaneStatus,
    generation: int,
    desired: int,
    model: ModelReadiness,
    observed: Sequence[ReplicaObservation],
    now: datetime,
    revision: str | None = None,
    sleeping: bool = False,
    placement: Placement | None = None,
    sleep_message: str = SLEEPING,
) -> LaneStatus:
    """The Lane's status after this pass, conditions carried over from `previous`.
    `sleeping`: idle.sleepAfter, a keep_alive or the memory budget has the Lane at zero
    replicas (`desired` is 0), for the reason `sleep_message` says. `status.sleeping`
    stays true while a Lane that slept wakes, until a replica serves: requests for it
    wait (and wake it) rather than being refused.

    `revision` is the spec's (None while the model is not ready): a replica of another
    revision means a rolling update is under way, and so does the surge beyond
    `desired` while one was (its last pass, once every replica below runs the new
    spec). A replica beyond `desired` of the spec's own revision otherwise is being
    scaled down (`ScalingDown`): nothing is replaced.
    `placement` is the fit ledger's (None while the model is not ready: `Schedulable`
    and the memory figures stay as they were).
    """
    current = [o for o in observed if o.index < desired]
    ready = sum(1 for o in current if _answering(o))
    # The surge counts: a rollout whose new replica keeps crashing is degraded.
    crashing = [o for o in observed if o.restarts > 0 and o.state != ReplicaState.READY]
    crashing += [o for o in observed if o.state == ReplicaState.FAILED and o not in crashing]
    beyond = [o for o in observed if o.index >= desired]
    replaced = revision is not None and any(o.revision != revision for o in observed)
    previous_ready = conditions.get_condition(previous.conditions, "Ready")
    was_rolling = previous_ready is not None and previous_ready.reason == ROLLING_UPDATE
    rolling = replaced or (bool(beyond) and (revision is None or was_rolling))
    scaling_down = bool(beyond) and not rolling

    conds: list[Condition] = list(previous.conditions)

    def put(type_: str, ok: bool, reason: str, message: str) -> None:
        nonlocal conds
        conds = conditions.set_condition(
            conds,
            type=type_,
            status=ConditionStatus.TRUE if ok else ConditionStatus.FALSE,
            reason=reason,
            message=message,
            observed_generation=generation,
            now=now,
        )

    put("ModelReady", model.ready, model.reason, model.message)
    placement = _settled(placement, previous)
    if placement is not None:
        put("Schedulable", placement.fits, placement.reason, placement.message)
    unplaced = placement is not None and not placement.fits
    # A surge replica (index `desired`, during a rolling update) serves too.
    serving = sum(1 for o in observed if _answering(o))
    if sleeping and serving == 0:
        put("Available", False, "Sleeping", sleep_message)
    elif desired == 0 and serving == 0:
        # As a Deployment of 0 replicas: nothing is missing (Ready says ScaledToZero).
        put("Available", True, "ScaledToZero", "0 replicas desired: the Lane is paused.")
    else:
        put(
            "Available",
            serving >= 1,
            "MinimumReplicasAvailable" if serving >= 1 else "NoReplicaReady",
            f"{serving} replica(s) serving, {desired} desired.",
        )
    # As a Deployment's: True while replicas are started, replaced or stopped, and
    # still True once they match the spec (reason ReplicasConverged, Kubernetes'
    # NewReplicaSetAvailable). False would say the rollout is stuck, which a converged
    # Lane is not; a crash-looping one says so in Degraded. A replica of an older
    # spec is still to be replaced, also while its successor cannot be placed.
    progressing = replaced or ready != desired or len(observed) != desired
    put(
        "Progressing",
        True,
        "ReplicasUpdating" if progressing else "ReplicasConverged",
        f"{ready} of {desired} replicas ready, {len(observed)} running or failed.",
    )
    if crashing:
        worst = max(crashing, key=lambda o: o.restarts)
        code = "" if worst.exit_code is None else f" (exit code {worst.exit_code})"
        put(
            "Degraded",
            True,
            "CrashLoopBackOff",
            f"Replica {worst.index} crashed{code} and has been restarted {worst.restarts} time(s).",
        )
    elif rolling and unplaced:
        # The rollout cannot go on: its next replica of the new spec does not fit, and
        # the old ones keep serving until it does (a Deployment's stuck rollout).
        assert placement is not None
        put(
            "Degraded",
            True,
            placement.reason,
            "The rolling update cannot start a replica of the new spec, so the old "
            f"replicas keep serving: {placement.message}",
        )
    else:
        put("Degraded", False, "ReplicasHealthy", "No replica is crash-looping.")
    all_ready = model.ready and ready == desired and not crashing and not rolling and not beyond
    if not model.ready:
        reason, message = "ModelNotReady", model.message
    elif unplaced and not all_ready:
        assert placement is not None
        reason, message = placement.reason, placement.message
    elif rolling and not crashing:
        reason = ROLLING_UPDATE
        message = (
            f"Replacing replicas: {serving} serving, {len(observed)} running, {desired} desired."
        )
    elif scaling_down and not crashing:
        reason = "ScalingDown"
        message = (
            f"Stopping {len(beyond)} replica(s) beyond the {desired} desired: {serving} serving."
        )
    elif all_ready and sleeping:
        reason, message = "Sleeping", sleep_message
    elif all_ready:
        reason = "ScaledToZero" if desired == 0 else "AllReplicasReady"
        message = f"{ready} of {desired} replicas are ready."
    elif rolling and any(o.revision == revision for o in crashing):
        # "N of N replicas are ready" beside Ready False would read as a contradiction
        # when it is the new spec's replica that fails and the old ones that serve.
        reason = "ReplicasNotReady"
        message = (
            f"The rolling update is stuck: a replica of the new spec keeps crashing (see "
            f"Degraded), and {serving} replica(s) of the previous spec keep serving."
        )
    else:
        reason, message = "ReplicasNotReady", f"{ready} of {desired} replicas are ready."
    put("Ready", all_ready, reason, message)
    return LaneStatus(
        observed_generation=generation,
        conditions=conds,
        replicas=len(current),
        ready_replicas=serving,
        replica_statuses=replica_statuses(observed),
        sleeping=(sleeping or (previous.sleeping and desired > 0)) and serving == 0,
        memory=placement.memory if placement is not None else previous.memory,
    )
