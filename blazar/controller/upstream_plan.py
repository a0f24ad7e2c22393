"""Pure decisions for an upstream Lane (`engine: upstream`): its status from a probe.

No IO, no clock, no logging. An upstream Lane runs no process: its one replica
(index 0) is the upstream server, `Ready` while the server answers its probe (a GET of
`/models` under its base URL) and `Failed` while it does not; the data plane routes
to a replica only while it is Ready, so a Lane whose upstream stops answering refuses
its requests with UNAVAILABLE until a probe passes again.

- The probe runs every PROBE_PERIOD_S while the upstream answers. After failures it
  backs off, doubling from the period up to MAX_PROBE_INTERVAL_S, so that an upstream
  that is down is not hammered and one that comes back is seen within that bound.
- Conditions: `Available` and `Ready` True (`UpstreamAnswering`) or False
  (`UpstreamUnavailable`) with the probe's words in the message; `Degraded` True
  (`ProbeFailing`) while probes fail; `ResolvedRefs`, which the reconciler writes
  when the Lane's SLOPolicy is deleted, is kept. The conditions of a local Lane's life
  (`ModelReady`, `Schedulable`, `Progressing`) are dropped: they describe nothing here.
- An event when the answer changes: `UpstreamAvailable` (Normal) or
  `UpstreamUnavailable` (Warning).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from blazar.api import conditions
from blazar.api.kinds import LaneStatus, ReplicaStatus
from blazar.api.meta import ConditionStatus
from blazar.api.replicas import ReplicaState

PROBE_PERIOD_S = 5.0
MAX_PROBE_INTERVAL_S = 10.0

# ResolvedRefs is the Lane reconciler's (a deleted SLOPolicy), kept across probes.
_KEPT = ("Available", "Ready", "Degraded", "ResolvedRefs")


@dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str


def next_probe_s(failures: int) -> float:
    """Seconds until the next probe after `failures` probes in a row failed."""
    if failures <= 0:
        return PROBE_PERIOD_S
    return float(min(MAX_PROBE_INTERVAL_S, PROBE_PERIOD_S * 2 ** (failures - 1)))


def upstream_status(
    *, previous: LaneStatus, generation: int, url: str, ok: bool, message: str, now: datetime
) -> LaneStatus:
    """The Lane's status after a probe of `url` that passed (`ok`) or not, saying
    `message`."""
    conds = [c for c in previous.conditions if c.type in _KEPT]
    true, false = ConditionStatus.TRUE, ConditionStatus.FALSE
    reason = "UpstreamAnswering" if ok else "UpstreamUnavailable"
    for type_ in ("Available", "Ready"):
        conds = conditions.set_condition(
            conds,
            type=type_,
            status=true if ok else false,
            reason=reason,
            message=message,
            observed_generation=generation,
            now=now,
        )
    conds = conditions.set_condition(
        conds,
        type="Degraded",
        status=false if ok else true,
        reason="ProbeSucceeded" if ok else "ProbeFailing",
        message="The upstream answers its probe." if ok else message,
        observed_generation=generation,
        now=now,
    )
    before = previous.replica_statuses[0] if previous.replica_statuses else None
    started = before.started_at if before is not None and before.started_at else now
    replica = ReplicaStatus(
        index=0,
        state=(ReplicaState.READY if ok else ReplicaState.FAILED).value,
        socket=url,
        started_at=started,
        message=message,
    )
    return LaneStatus(
        observed_generation=generation,
        conditions=conds,
        replicas=1,
        ready_replicas=1 if ok else 0,
        replica_statuses=[replica],
    )


def transition(previous: LaneStatus, *, ok: bool, message: str) -> Event | None:
    """The event for this probe's answer: one when Available changes (or is first
    known), none while it holds."""
    before = conditions.get_condition(previous.conditions, "Available")
    was = before is not None and before.status == ConditionStatus.TRUE
    known = before is not None and before.reason in ("UpstreamAnswering", "UpstreamUnavailable")
    if known and was == ok:
        return None
    if ok:
        return Event("Normal", "UpstreamAvailable", message)
    return Event("Warning", "UpstreamUnavailable", message)
