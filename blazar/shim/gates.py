"""The daemon's closed admission gates, as the shim follows them (`WatchAdmission`),
and the refusals the shim answers from them without a round trip.

A flood of requests that admission will refuse anyway costs the daemon's one event
loop a gRPC call each (the shim's call, the data plane's handler, admission, the
abort and its error details, the shim's reading of it); here such a request is
refused after its dialect has validated it (a malformed request still gets its 400)
and before any call, with the status, message and Retry-After the daemon would give.

The gates are soft state. They hold only while the stream is up and fresh (a message
at least every `refresh_ms` x `STALE_FACTOR`), and a gate with `closed_for_ms` only for
that long; otherwise every request goes to the daemon, as without them. A gate
applies only to the requests `inference.proto` says it does (`AdmissionGate`): with
no session, through no other daemon, naming the policy it is for (or none, for the
Lane's own), and for SLO_UNATTAINABLE fitting the Lane's context as admission
estimates it. The daemon lists no gate while API keys are in force.

A refusal made here counts where the daemon's would (`blazar.rpc.refusals`), once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import grpc
import structlog
from starlette.requests import Request

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.rpc import refusals

_log = structlog.get_logger("blazar.shim.gates")

# A stream that has said nothing for this many times its refresh interval is stale.
STALE_FACTOR = 3.0
# Between attempts to (re)open the stream.
RETRY_S = 1.0

Generation: TypeAlias = inference_pb2.ChatRequest | inference_pb2.CompleteRequest


class Call(Protocol):
    """A WatchAdmission call (grpc.aio's, or a test's)."""

    def __aiter__(self) -> AsyncIterator[inference_pb2.AdmissionGates]: ...

    def cancel(self) -> bool: ...


Watch: TypeAlias = Callable[[], Call]


@dataclass(frozen=True)
class _Gate:
    lane: str
    policy: str
    reason: str
    error: errors.BlazarError
    # On the shim's clock; math.inf: until the next message.
    closed_until: float
    chars_per_token: float
    context_tokens: int
    # Closed only after this many requests of at least `after_max_tokens` (0: now).
    after_requests: int = 0
    after_max_tokens: int = 0


@dataclass
class _Sent:
    """The requests sent on to one Lane since the last message (`after_requests`)."""

    count: int = 0
    # The least max_tokens among them (0: one had none set).
    least_max_tokens: int = 0
    # The policies they ran under, as the gates name them ("?" + name for others).
    policies: set[str] = field(default_factory=set)


class AdmissionGates:
    """The closed gates the daemon lists, by (model name, policy name); policy "" for
    requests that name none (their Lane's policy)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._gates: dict[tuple[str, str], _Gate] = {}
        # The Lane of each model name that has a gate filling, and what was sent there.
        self._filling: dict[str, str] = {}
        self._sent: dict[str, _Sent] = {}
        # When the last message came, and how long one may be awaited.
        self._heard_at = -math.inf
        self._stale_s = 0.0

    def apply(self, message: inference_pb2.AdmissionGates) -> None:
        """A message of the stream: the whole set of closed gates, as of now."""
        now = self._clock()
        gates: dict[tuple[str, str], _Gate] = {}
        filling: dict[str, str] = {}
        for gate in message.closed:
            until = now + gate.closed_for_ms / 1000 if gate.HasField("closed_for_ms") else math.inf
            found = _Gate(
                lane=gate.lane,
                policy=gate.policy,
                reason=gate.reason,
                error=errors.from_reason(
                    gate.reason, gate.message, dict(gate.metadata), code="RESOURCE_EXHAUSTED"
                ),
                closed_until=until,
                chars_per_token=gate.chars_per_token,
                context_tokens=gate.context_tokens,
                after_requests=gate.after_requests,
                after_max_tokens=gate.after_max_tokens,
            )
            for model in gate.models:
                if gate.after_requests:
                    filling[model] = gate.lane
                if gate.lane_policy:
                    gates[(model, "")] = found
                # A name with a colon (`builtin:fifo`) is no SLOPolicy a request can name.
                if ":" not in gate.policy:
                    gates[(model, gate.policy)] = found
        self._gates = gates
        self._filling = filling
        self._sent = {}
        self._heard_at = now
        self._stale_s = STALE_FACTOR * message.refresh_ms / 1000

    def listed(self) -> list[tuple[str, str]]:
        """The (model name, policy name) pairs closed as last heard, policy "" for the
        requests that name none; whether they hold now is `refusal`'s to say."""
        return sorted(self._gates)

    def lost(self) -> None:
        """The stream is down: no gate holds until it is back."""
        self._gates = {}
        self._filling = {}
        self._sent = {}
        self._heard_at = -math.inf

    def refusal(self, request: Generation, *, via: str = "") -> errors.BlazarError | None:
        """The daemon's refusal of `request` if a closed gate says it would refuse it
        now, counted as the daemon counts its own; None: ask the daemon."""
        if not self._gates:
            return None
        now = self._clock()
        if now - self._heard_at > self._stale_s:
            return None
        gate = self._gates.get((request.model, request.slo))
        if gate is None or not self._refuses(gate, request, via=via, now=now):
            self._sending(request, gate)
            return None
        refusals.count(gate.lane, gate.policy, gate.reason)
        # On the request's one summary line (`context.RequestIdMiddleware`): who refused.
        structlog.contextvars.bind_contextvars(
            refused_by="gate", lane=gate.lane, policy=gate.policy, reason=gate.reason
        )
        return gate.error

    def _refuses(self, gate: _Gate, request: Generation, *, via: str, now: float) -> bool:
        if request.session or via or now >= gate.closed_until:
            return False
        if gate.reason == errors.SloUnattainable.reason and not _fits(request, gate):
            return False
        if not gate.after_requests:
            return True
        sent = self._sent.get(gate.lane)
        return (
            sent is not None
            and sent.count >= gate.after_requests
            and sent.least_max_tokens >= gate.after_max_tokens
            and sent.policies == {gate.policy}
        )

    def _sending(self, request: Generation, gate: _Gate | None) -> None:
        """`request` goes on to the daemon: count it against its Lane's filling gates."""
        lane = self._filling.get(request.model)
        if lane is None:
            return
        sent = self._sent.get(lane)
        max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 0
        if sent is None:
            sent = self._sent[lane] = _Sent(least_max_tokens=max_tokens)
        sent.count += 1
        sent.least_max_tokens = min(sent.least_max_tokens, max_tokens)
        sent.policies.add(gate.policy if gate is not None else "?" + request.slo)

    async def follow(self, watch: Watch) -> None:
        """Keep the gates up to date from `watch()` (a WatchAdmission call) until
        cancelled, opening it again whenever it ends or fails."""
        while True:
            call = watch()
            try:
                async for message in call:
                    self.apply(message)
            except grpc.RpcError as exc:
                _log.debug("gates.lost", code=exc.code().name)
            finally:
                self.lost()
                call.cancel()
            await asyncio.sleep(RETRY_S)


def refusal(request: Request, generation: Generation, *, via: str) -> errors.BlazarError | None:
    """The refusal the app's gates answer for `generation` (None: ask the daemon); the
    app has no gates outside its lifespan (a test's)."""
    found: AdmissionGates | None = getattr(request.app.state, "gates", None)
    return None if found is None else found.refusal(generation, via=via)


def _fits(request: Generation, gate: _Gate) -> bool:
    """Whether admission would count the request as fitting its Lane's context (else it
    lets it wait, and the engine refuses it as too long)."""
    if isinstance(request, inference_pb2.CompleteRequest):
        chars = len(request.prompt)
    else:
        chars = sum(len(message.content) for message in request.messages)
    ratio = gate.chars_per_token
    prompt_tokens = max(1, math.ceil(chars / ratio)) if ratio > 0 else chars
    return prompt_tokens + (request.sampling.max_tokens or 1) <= gate.context_tokens


@contextlib.asynccontextmanager
async def following(gates: AdmissionGates, watch: Watch) -> AsyncIterator[None]:
    """`gates.follow(watch)` as a task for the duration of the block."""
    task = asyncio.get_running_loop().create_task(gates.follow(watch), name="shim-gates")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
