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
estimates it, with a prompt no longer than the gate's `most_prompt_tokens` (a longer
one is told by the daemon that no wait helps, not the probe's retry hint). The daemon
lists no gate while API keys are in force.

A filling gate (`after_requests`) is open, and closes once that many more requests of
the sizes it names (max_tokens, and prompt tokens as admission estimates them) reach
its Lane than its message's gates include; then, if it names a least prompt, only for
requests with at least that prompt. Under a burst, requests the shim has
sent on are still in gRPC flight, or not yet taken in by the Lane's admission task,
when the daemon computes the next message; so the shim tags each one
(`blazar.api.gate_tags`) and keeps those the gates do not include yet. Each message
says, per Lane, the highest tag that Lane's admission had taken in when its gates were
computed (`seen`): the requests tagged above it count toward the new gate, with those
sent after it. A request stops counting when a message includes it, when its call
ends (`settled`: whatever admission did with it, the gates that follow know), or after
UNSEEN_FACTOR refresh intervals (one the daemon refused before admission, for a bad
key say, is never taken in). Each of these can only count too few, which sends a
request on to the daemon to decide; counting too many would refuse a request that
admission takes.

Every generation is checked in one place, `inference.InferenceClient`'s `chat` and
`complete`, which also tag what they send on. A refusal made here counts where the
daemon's would (`blazar.rpc.refusals`), once.
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

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, gate_tags
from blazar.rpc import refusals

_log = structlog.get_logger("blazar.shim.gates")

# A stream that has said nothing for this many times its refresh interval is stale.
STALE_FACTOR = 3.0
# Between attempts to (re)open the stream.
RETRY_S = 1.0
# A request sent on counts toward a filling gate for at most this many refresh
# intervals (UNSEEN_S before the first message) unless the gates include it sooner.
UNSEEN_FACTOR = 2.0
UNSEEN_S = 1.0

Generation: TypeAlias = inference_pb2.ChatRequest | inference_pb2.CompleteRequest


class Call(Protocol):
    """A WatchAdmission call (grpc.aio's, or a test's)."""

    def __aiter__(self) -> AsyncIterator[inference_pb2.AdmissionGates]: ...

    def cancel(self) -> bool: ...


# Opens the stream for a watcher id.
Watch: TypeAlias = Callable[[str], Call]


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
    # Closed only after this many requests (0: now) of max_tokens of at least
    # `after_max_tokens` and, where not 0, at most `after_most_max_tokens`, with
    # `after_least_prompt_tokens` to `after_most_prompt_tokens` prompt tokens as
    # admission estimates them; and then for requests of at least
    # `after_least_prompt_tokens` only.
    after_requests: int = 0
    after_max_tokens: int = 0
    after_most_max_tokens: int = 0
    after_least_prompt_tokens: int = 0
    after_most_prompt_tokens: int = 0
    # SLO_UNATTAINABLE: the longest prompt the refusal holds for (None: any). A longer
    # one goes on to the daemon, which tells it that no wait helps.
    most_prompt_tokens: int | None = None


@dataclass(frozen=True)
class _Forwarded:
    """A request sent on to the daemon that the gates heard last do not include."""

    model: str
    slo: str
    # 0: none set.
    max_tokens: int
    prompt_chars: int
    # On the shim's clock.
    sent_at: float


@dataclass
class _Sent:
    """The requests on their way to one Lane that its filling gate does not include
    (`after_requests`)."""

    count: int = 0
    # The least and the most max_tokens among them (0: one had none set; the most is
    # then unbounded), and the least and the most prompt tokens as admission
    # estimates them.
    least_max_tokens: int = 0
    most_max_tokens: float = 0
    least_prompt_tokens: float = math.inf
    most_prompt_tokens: int = 0
    # The policies they ran under, as the gates name them ("?" + name for others).
    policies: set[str] = field(default_factory=set)


class AdmissionGates:
    """The closed gates the daemon lists, by (model name, policy name); policy "" for
    requests that name none (their Lane's policy). `watcher`: this shim's id on the
    stream and in its requests' tags (`blazar.api.gate_tags`)."""

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, watcher: str | None = None
    ) -> None:
        self._clock = clock
        self.watcher = watcher or gate_tags.new_watcher()
        self._gates: dict[tuple[str, str], _Gate] = {}
        # The Lane of each model name the gates list, and the Lanes with a gate filling.
        self._lanes: dict[str, str] = {}
        self._filling: set[str] = set()
        # The requests sent on that the gates do not include yet, by tag n (so in the
        # order sent); and, per Lane with a gate filling, what they add up to.
        self._n = 0
        self._unseen: dict[int, _Forwarded] = {}
        self._sent: dict[str, _Sent] = {}
        # When the last message came, how long one may be awaited, and how long a
        # request sent on counts at most.
        self._heard_at = -math.inf
        self._stale_s = 0.0
        self._unseen_s = UNSEEN_S

    def apply(self, message: inference_pb2.AdmissionGates) -> None:
        """A message of the stream: the whole set of closed gates, as of now, and the
        requests of this watcher they include (`seen`)."""
        now = self._clock()
        gates: dict[tuple[str, str], _Gate] = {}
        lanes: dict[str, str] = {}
        filling: set[str] = set()
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
                after_most_max_tokens=gate.after_most_max_tokens,
                after_least_prompt_tokens=gate.after_least_prompt_tokens,
                after_most_prompt_tokens=gate.after_most_prompt_tokens,
                most_prompt_tokens=(
                    gate.most_prompt_tokens if gate.HasField("most_prompt_tokens") else None
                ),
            )
            if gate.after_requests:
                filling.add(gate.lane)
            for model in gate.models:
                lanes[model] = gate.lane
                if gate.lane_policy:
                    gates[(model, "")] = found
                # A name with a colon (`builtin:fifo`) is no SLOPolicy a request can name.
                if ":" not in gate.policy:
                    gates[(model, gate.policy)] = found
        self._gates = gates
        self._lanes = lanes
        self._filling = filling
        self._heard_at = now
        self._stale_s = STALE_FACTOR * message.refresh_ms / 1000
        self._unseen_s = UNSEEN_FACTOR * message.refresh_ms / 1000 or UNSEEN_S
        seen = message.seen
        for n, sent in list(self._unseen.items()):
            lane = lanes.get(sent.model)
            if lane is not None and n <= seen.get(lane, 0):
                del self._unseen[n]
        self._forget_old(now)
        self._recount()

    def listed(self) -> list[tuple[str, str]]:
        """The (model name, policy name) pairs closed as last heard, policy "" for the
        requests that name none; whether they hold now is `admit`'s to say."""
        return sorted(self._gates)

    def lost(self) -> None:
        """The stream is down: no gate holds until it is back."""
        self._gates = {}
        self._lanes = {}
        self._filling = set()
        self._sent = {}
        self._heard_at = -math.inf

    def admit(self, request: Generation, *, via: str = "") -> errors.BlazarError | gate_tags.Tag:
        """The daemon's refusal of `request` if a closed gate says it would refuse it
        now, counted as the daemon counts its own; else the tag it goes on to the daemon
        with, counted toward its Lane's filling gate until the gates include it (or
        `settled`)."""
        now = self._clock()
        self._forget_old(now)
        refused = self._refusal(request, via=via, now=now)
        if refused is not None:
            return refused
        max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 0
        sent = _Forwarded(
            request.model, request.slo, max_tokens, _prompt_chars(request), sent_at=now
        )
        self._n += 1
        self._unseen[self._n] = sent
        self._count(sent)
        return gate_tags.Tag(self.watcher, self._n)

    def settled(self, tag: gate_tags.Tag) -> None:
        """The call `tag` went with has ended: whether or not admission took it in, it
        holds no slot the gates heard do not know of (counting it no more can only let
        a request through to the daemon, which decides)."""
        sent = self._unseen.pop(tag.n, None) if tag.watcher == self.watcher else None
        if sent is not None and self._lanes.get(sent.model) in self._filling:
            self._recount()

    def _refusal(self, request: Generation, *, via: str, now: float) -> errors.BlazarError | None:
        if not self._gates:
            return None
        if now - self._heard_at > self._stale_s:
            return None
        gate = self._gates.get((request.model, request.slo))
        if gate is None or not self._refuses(gate, request, via=via, now=now):
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
        if (
            gate.most_prompt_tokens is not None
            and _prompt_tokens(_prompt_chars(request), gate) > gate.most_prompt_tokens
        ):
            return False
        if not gate.after_requests:
            return True
        least_prompt = gate.after_least_prompt_tokens
        if least_prompt and _prompt_tokens(_prompt_chars(request), gate) < least_prompt:
            return False
        sent = self._sent.get(gate.lane)
        return (
            sent is not None
            and sent.count >= gate.after_requests
            and sent.least_max_tokens >= gate.after_max_tokens
            and sent.least_prompt_tokens >= least_prompt
            and (
                not gate.after_most_max_tokens or sent.most_max_tokens <= gate.after_most_max_tokens
            )
            and (
                not gate.after_most_prompt_tokens
                or sent.most_prompt_tokens <= gate.after_most_prompt_tokens
            )
            and sent.policies == {gate.policy}
        )

    def _forget_old(self, now: float) -> None:
        """Requests sent on longer ago than `_unseen_s` count no more: one that the
        daemon refused before admission (an unknown key, say) is never taken in."""
        old = []
        for n, sent in self._unseen.items():  # in the order sent
            if now - sent.sent_at <= self._unseen_s:
                break
            old.append(n)
        for n in old:
            del self._unseen[n]
        if old:
            self._recount()

    def _recount(self) -> None:
        self._sent = {}
        for sent in self._unseen.values():
            self._count(sent)

    def _count(self, sent: _Forwarded) -> None:
        """Count `sent` against its Lane's filling gate, if one is filling."""
        lane = self._lanes.get(sent.model)
        if lane is None or lane not in self._filling:
            return
        gate = self._gates.get((sent.model, sent.slo))
        found = self._sent.get(lane)
        if found is None:
            found = self._sent[lane] = _Sent(least_max_tokens=sent.max_tokens)
        found.count += 1
        found.least_max_tokens = min(found.least_max_tokens, sent.max_tokens)
        found.most_max_tokens = max(found.most_max_tokens, sent.max_tokens or math.inf)
        if gate is not None:
            tokens = _prompt_tokens(sent.prompt_chars, gate)
            found.least_prompt_tokens = min(found.least_prompt_tokens, tokens)
            found.most_prompt_tokens = max(found.most_prompt_tokens, tokens)
        found.policies.add(gate.policy if gate is not None else "?" + sent.slo)

    async def follow(self, watch: Watch) -> None:
        """Keep the gates up to date from `watch(self.watcher)` (a WatchAdmission call)
        until cancelled, opening it again whenever it ends or fails."""
        while True:
            call = watch(self.watcher)
            try:
                async for message in call:
                    self.apply(message)
            except grpc.RpcError as exc:
                _log.debug("gates.lost", code=exc.code().name)
            finally:
                self.lost()
                call.cancel()
            await asyncio.sleep(RETRY_S)


def _prompt_chars(request: Generation) -> int:
    """The prompt's characters as admission counts them."""
    if isinstance(request, inference_pb2.CompleteRequest):
        return len(request.prompt)
    return sum(len(message.content) for message in request.messages)


def _prompt_tokens(chars: int, gate: _Gate) -> int:
    """A prompt's tokens as admission estimates them from its characters."""
    ratio = gate.chars_per_token
    return max(1, math.ceil(chars / ratio)) if ratio > 0 else chars


def _fits(request: Generation, gate: _Gate) -> bool:
    """Whether admission would count the request as fitting its Lane's context (else it
    lets it wait, and the engine refuses it as too long)."""
    prompt_tokens = _prompt_tokens(_prompt_chars(request), gate)
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
