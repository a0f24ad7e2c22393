"""Prometheus metrics of the data plane, observed once per request from its final chunk,
and of each Lane's admission queue (by SLOPolicy: `builtin:fifo` for a Lane without one).

They live in prometheus-client's default registry of the daemon process; the HTTP
shim, which runs in the same process, serves them at GET /metrics. The counts of
requests, rejections and queue waits are `blazar.rpc.refusals`' (the shim counts its
own refusals there too).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.api.kinds import Lane
from blazar.api.replicas import ReplicaState

# Counted by the HTTP shim too, for the refusals it answers from admission gates.
from blazar.rpc.refusals import QUEUE_WAIT as QUEUE_WAIT
from blazar.rpc.refusals import REJECTIONS as REJECTIONS
from blazar.rpc.refusals import REQUESTS as REQUESTS

IN_FLIGHT = Gauge(
    "blazar_requests_in_flight",
    "Generation requests sent to a lane's engines and not finished: waiting for a slot "
    'or generating (less blazar_engine_slots{state="busy"}: those waiting).',
    ["lane"],
)
# The outcome of a request whose caller left before it finished.
CANCELLED = "cancelled"
# The outcome of one whose gRPC deadline passed first (`status.cut_by_deadline`), as of
# one admission refused for it.
DEADLINE_EXCEEDED = errors.DeadlineExceeded.reason
PROMPT_TOKENS = Counter("blazar_prompt_tokens_total", "Prompt tokens received.", ["lane"])
CACHED_TOKENS = Counter(
    "blazar_cached_prompt_tokens_total", "Prompt tokens served from the KV cache.", ["lane"]
)
COMPLETION_TOKENS = Counter(
    "blazar_completion_tokens_total",
    "Tokens generated, those of streams that ended early (the caller left, the engine "
    "was lost) included.",
    ["lane"],
)
DRAFTED_TOKENS = Counter(
    "blazar_speculative_drafted_tokens_total", "Speculative draft tokens proposed.", ["lane"]
)
ACCEPTED_TOKENS = Counter(
    "blazar_speculative_accepted_tokens_total", "Speculative draft tokens accepted.", ["lane"]
)
EMBEDDINGS = Counter(
    "blazar_embedding_requests_total",
    "Embedding requests by lane and outcome (ok, cancelled, or the error reason).",
    ["lane", "outcome"],
)
EMBEDDED_TOKENS = Counter(
    "blazar_embedded_tokens_total", "Tokens of the inputs embedded.", ["lane"]
)
TTFT = Histogram(
    "blazar_time_to_first_token_seconds",
    "From arrival at the data plane to the first token, admission's queue included.",
    ["lane", "policy"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
QUEUE_DEPTH = Gauge(
    "blazar_queue_depth",
    "Requests waiting in a lane's admission queue for a slot, by SLOPolicy.",
    ["lane", "policy"],
)
SPILLOVERS = Counter(
    "blazar_spillovers_total",
    "Requests predicted to miss their TTFT target on a lane that ran on its spillover "
    "lane instead (`to`).",
    ["lane", "to"],
)
PREEMPTIONS = Counter(
    "blazar_preemptions_total",
    "Generations parked for more urgent work, by the parked request's SLOPolicy.",
    ["lane", "policy"],
)
PARKED_BYTES = Gauge(
    "blazar_parked_bytes",
    "Host memory holding the KV caches of a lane's parked generations.",
    ["lane"],
)
FIRST_TOKENS = Counter(
    "blazar_slo_first_tokens_total",
    "First tokens under an SLOPolicy with a ttftTargetMs, by whether they met it (met=true).",
    ["lane", "policy", "met"],
)
ATTAINMENT = Gauge(
    "blazar_slo_attainment_ratio",
    "Share of first tokens that met their SLOPolicy's ttftTargetMs, since the daemon started.",
    ["lane", "policy"],
)
TENANT_REQUESTS = Counter(
    "blazar_tenant_requests_total",
    "Requests a tenant (an auth file's) sent to a model and that passed its rate limits.",
    ["tenant"],
)
TENANT_REFUSALS = Counter(
    "blazar_tenant_refusals_total",
    "Requests refused, by tenant and reason (UNAUTHENTICATED, MODEL_NOT_PERMITTED, "
    "SLO_POLICY_NOT_PERMITTED, ADMIN_REQUIRED, RATE_LIMITED, or admission's); tenant "
    "`unknown` before a key is read.",
    ["tenant", "reason"],
)
TENANT_TOKENS = Counter(
    "blazar_tenant_tokens_total",
    "Tokens a tenant's requests used: prompt (embedded inputs included) and completion.",
    ["tenant", "kind"],
)
DECODE_RATE = Histogram(
    "blazar_decode_tokens_per_second",
    "Per-request decode speed.",
    ["lane"],
    buckets=(5, 10, 20, 40, 60, 80, 100, 150, 200, 400),
)


def observe_final(lane: str, final: inference_pb2.Final, *, policy: str) -> None:
    REQUESTS.labels(lane, "ok").inc()
    PROMPT_TOKENS.labels(lane).inc(final.usage.prompt_tokens)
    CACHED_TOKENS.labels(lane).inc(final.usage.cached_tokens)
    COMPLETION_TOKENS.labels(lane).inc(final.usage.completion_tokens)
    DRAFTED_TOKENS.labels(lane).inc(final.routing.drafted_tokens)
    ACCEPTED_TOKENS.labels(lane).inc(final.routing.accepted_tokens)
    TTFT.labels(lane, policy).observe(final.timings.ttft_ms / 1000.0)
    if final.timings.decode_tokens_per_second > 0:
        DECODE_RATE.labels(lane).observe(final.timings.decode_tokens_per_second)


def observe_failure(lane: str, reason: str, *, tokens: int = 0) -> None:
    """A request that ended without its Final, after `tokens` were generated for it (a
    stream its caller left or its engine lost midway): generated all the same."""
    REQUESTS.labels(lane, reason.lower()).inc()
    COMPLETION_TOKENS.labels(lane).inc(tokens)


def observe_embedding(lane: str, tokens: int) -> None:
    EMBEDDINGS.labels(lane, "ok").inc()
    EMBEDDED_TOKENS.labels(lane).inc(tokens)


def observe_embedding_failure(lane: str, reason: str) -> None:
    EMBEDDINGS.labels(lane, reason.lower()).inc()


def observe_tenant_refusal(tenant: str, reason: str) -> None:
    TENANT_REFUSALS.labels(tenant, reason).inc()


def observe_tenant_tokens(tenant: str, *, prompt: int, output: int) -> None:
    TENANT_TOKENS.labels(tenant, "prompt").inc(prompt)
    TENANT_TOKENS.labels(tenant, "completion").inc(output)


# What the controller writes of each Lane's replicas, so that a crash loop or a Lane
# with nothing serving can be alerted on: without these, /metrics said nothing of an
# engine killed, hung or failing to start.
LANE_REPLICAS = Gauge(
    "blazar_lane_replicas",
    "A Lane's engine replicas by state (starting, ready, draining, stopping, failed), "
    "as its status says; every state is written, 0 when none is in it.",
    ["lane", "state"],
)
REPLICA_RESTARTS = Gauge(
    "blazar_replica_restarts",
    "Times a Lane's replica was restarted after its engine exited or stopped answering "
    "(its status' restarts; it goes back to 0 when the replica is replaced by a rollout).",
    ["lane", "replica"],
)
# The label sets last written, so that a Lane or replica gone loses its series.
_lanes_shown: set[str] = set()
_replicas_shown: set[tuple[str, str]] = set()


def observe_lanes(lanes: Iterable[Lane]) -> None:
    """Set the replica gauges from every stored Lane's status; drop those of the
    Lanes and replicas no longer there."""
    global _lanes_shown, _replicas_shown
    lanes_now: set[str] = set()
    replicas_now: set[tuple[str, str]] = set()
    for lane in lanes:
        name = lane.metadata.name
        lanes_now.add(name)
        states = [r.state for r in lane.status.replica_statuses]
        for state in ReplicaState:
            LANE_REPLICAS.labels(name, state.value.lower()).set(states.count(state.value))
        for replica in lane.status.replica_statuses:
            key = (name, str(replica.index))
            replicas_now.add(key)
            REPLICA_RESTARTS.labels(*key).set(replica.restarts)
    for gone in _lanes_shown - lanes_now:
        for state in ReplicaState:
            LANE_REPLICAS.remove(gone, state.value.lower())
    for key in _replicas_shown - replicas_now:
        REPLICA_RESTARTS.remove(*key)
    _lanes_shown, _replicas_shown = lanes_now, replicas_now
