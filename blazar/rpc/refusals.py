"""Admission's refusals as /metrics counts them, wherever they are decided: by the data
plane's admission, or by the HTTP shim from a closed admission gate (the same refusal,
answered without a round trip; `blazar.shim.gates`). Both run in the daemon's process
and count here, each refusal once.

The counters live in prometheus-client's default registry (`blazar.dataplane.metrics`
holds the rest); `gated` keeps the shim's refusals by policy for what
`blazar get slopolicies` shows beside the data plane's own.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "blazar_requests_total",
    "Generation requests by lane and outcome (ok, cancelled, or the error reason).",
    ["lane", "outcome"],
)
QUEUE_WAIT = Histogram(
    "blazar_queue_wait_seconds",
    "Time a request waited in its lane's admission queue, until it started or was refused "
    "(once a request: not again when a failed start brings it back).",
    ["lane", "policy"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
REJECTIONS = Counter(
    "blazar_admission_rejections_total",
    "Requests refused by admission, by reason: QUEUE_FULL, QUEUE_TIMEOUT, SLO_UNATTAINABLE, "
    "DEADLINE_EXCEEDED, REPLICA_FAILED (a bound missed waiting for another replica after "
    "its replica failed).",
    ["lane", "policy", "reason"],
)

# The shim's refusals from gates, by (lane, policy, reason).
_gated: Tally[tuple[str, str, str]] = Tally()


def count(lane: str, policy: str, reason: str) -> None:
    """A refusal at arrival that the shim answered from a closed gate: counted as the
    data plane counts its own (rejection, a zero wait, the request's outcome)."""
    REJECTIONS.labels(lane, policy, reason).inc()
    QUEUE_WAIT.labels(lane, policy).observe(0.0)
    REQUESTS.labels(lane, reason.lower()).inc()
    _gated[(lane, policy, reason)] += 1


def gated(policy: str) -> dict[str, int]:
    """By reason, the refusals of `policy`'s requests the shim answered, over every Lane."""
    by_reason: dict[str, int] = {}
    for (_, name, reason), n in _gated.items():
        if name == policy:
            by_reason[reason] = by_reason.get(reason, 0) + n
    return by_reason
