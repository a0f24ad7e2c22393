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
from dataclasses import dataclass
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


class AdmissionGates:
    """The closed gates the daemon lists, by (model name, policy name); policy "" for
    requests that name none (their Lane's policy)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._gates: dict[tuple[str, str], _Gate] = {}
        # When the last message came, and how long one may be awaited.
        self._heard_at = -math.inf
        self._stale_s = 0.0

    def apply(self, message: inference_pb2.AdmissionGates) -> None:
        """A message of the stream: the whole set of closed gates, as of now."""
        now = self._clock()
        gates: dict[tuple[str, str], _Gate] = {}
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
            )
            for model in gate.models:
                if gate.lane_policy:
                    gates[(model, "")] = found
                # A name with a colon (`builtin:fifo`) is no SLOPolicy a request can name.
                if ":" not in gate.policy:
                    gates[(model, gate.policy)] = found
        self._gates = gates
        self._heard_at = now
        self._stale_s = STALE_FACTOR * message.refresh_ms / 1000

    def listed(self) -> list[tuple[str, str]]:
        """The (model name, policy name) pairs closed as last heard, policy "" for the
        requests that name none; whether they hold now is `refusal`'s to say."""
        return sorted(self._gates)

    def lost(self) -> None:
        """The stream is down: no gate holds until it is back."""
        self._gates = {}
        self._heard_at = -math.inf

    def refusal(self, request: Generation, *, via: str = "") -> errors.BlazarError | None:
        """The daemon's refusal of `request` if a closed gate says it would refuse it
        now, counted as the daemon counts its own; None: ask the daemon."""
        if not self._gates or request.session or via:
            return None
        now = self._clock()
        if now - self._heard_at > self._stale_s:
            return None
        gate = self._gates.get((request.model, request.slo))
        if gate is None or now >= gate.closed_until:
            return None
        if gate.reason == errors.SloUnattainable.reason and not _fits(request, gate):
            return None
        refusals.count(gate.lane, gate.policy, gate.reason)
        return gate.error

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
