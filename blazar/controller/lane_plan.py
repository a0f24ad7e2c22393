"""Pure decisions for a Lane: which replicas to start or stop, and what status to show.

No IO, no clock, no logging: everything comes in as arguments (`now` included), so the
state machine is tested with tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from blazar.api import conditions
from blazar.api.kinds import LaneStatus, ReplicaStatus
from blazar.api.meta import Condition, ConditionStatus
from blazar.api.replicas import LaunchSpec, ReplicaObservation, ReplicaState

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0


def crash_backoff(restarts: int) -> float:
    """Delay before restarting a replica that has already been restarted `restarts` times."""
    return float(min(BACKOFF_BASE_S * (2 ** min(restarts, 16)), BACKOFF_MAX_S))


@dataclass(frozen=True)
class Start:
    index: int
    launch: LaunchSpec
    restart: bool


@dataclass(frozen=True)
class Stop:
    index: int
    reason: str


Action = Start | Stop


@dataclass(frozen=True)
class LanePlan:
    actions: list[Action] = field(default_factory=list)
    requeue_after: float | None = None


def plan_replicas(
    *,
    desired: int,
    launch: LaunchSpec | None,
    observed: Sequence[ReplicaObservation],
    now: datetime,
) -> LanePlan:
    """Converge the replica set to `desired` copies of `launch`.

    `launch is None` means the model is not ready: nothing new starts, running
    replicas are left alone. A failed replica is restarted once its backoff has passed;
    a replica of an older revision is replaced (stopped now, started next pass).
    """
    by_index = {obs.index: obs for obs in observed}
    waits: list[float] = []
    actions: list[Action] = [Stop(o.index, "ScaledDown") for o in observed if o.index >= desired]
    if launch is None:
        return LanePlan(actions)
    for index in range(desired):
        replica = by_index.get(index)
        if replica is None:
            actions.append(Start(index, launch, restart=False))
        elif replica.state == ReplicaState.FAILED:
            exited_at = replica.exited_at or now
            wait = crash_backoff(replica.restarts) - (now - exited_at).total_seconds()
            if wait <= 0:
                actions.append(Start(index, launch, restart=True))
            else:
                waits.append(wait)
        elif replica.revision != launch.revision and replica.state in (
            ReplicaState.STARTING,
            ReplicaState.READY,
        ):
            actions.append(Stop(index, "SpecChanged"))
    return LanePlan(actions, requeue_after=min(waits) if waits else None)


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
            message=obs.message,
        )
        for obs in sorted(observed, key=lambda o: o.index)
    ]


@dataclass(frozen=True)
class ModelReadiness:
    ready: bool
    reason: str
    message: str


def lane_status(
    *,
    previous: LaneStatus,
    generation: int,
    desired: int,
    model: ModelReadiness,
    observed: Sequence[ReplicaObservation],
    now: datetime,
) -> LaneStatus:
    """The Lane's status after this pass, conditions carried over from `previous`."""
    current = [o for o in observed if o.index < desired]
    ready = sum(1 for o in current if o.state == ReplicaState.READY)
    crashing = [o for o in current if o.restarts > 0 and o.state != ReplicaState.READY]
    crashing += [o for o in current if o.state == ReplicaState.FAILED and o not in crashing]

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
    put(
        "Available",
        ready >= 1,
        "MinimumReplicasAvailable" if ready >= 1 else "NoReplicaReady",
        f"{ready} of {desired} replicas are serving.",
    )
    progressing = ready != desired or len(observed) != desired
    put(
        "Progressing",
        progressing,
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
    else:
        put("Degraded", False, "ReplicasHealthy", "No replica is crash-looping.")
    all_ready = model.ready and ready == desired and not crashing
    if not model.ready:
        reason, message = "ModelNotReady", model.message
    elif all_ready:
        reason = "ScaledToZero" if desired == 0 else "AllReplicasReady"
        message = f"{ready} of {desired} replicas are ready."
    else:
        reason, message = "ReplicasNotReady", f"{ready} of {desired} replicas are ready."
    put("Ready", all_ready, reason, message)
    return LaneStatus(
        observed_generation=generation,
        conditions=conds,
        replicas=len(current),
        ready_replicas=ready,
        replica_statuses=replica_statuses(observed),
    )
