"""Admission gates: which (Lane, SLOPolicy) pairs refuse every fresh request now, as
`WatchAdmission` streams them (see inference.proto).

After every decision of a Lane's admission task (`dispatcher.LaneDispatcher`), and at
least every `REFRESH_S`, the Lane's gates are asked again of its queue
(`admission.LaneQueue.gate`: would the smallest request be refused?), for its own
policy and for every policy its requests have named, each as the store holds it now.
Only a Lane that admission would reach with a request is gated: one with a ready
replica (a sleeping Lane wakes instead) and of local engines (an upstream Lane refuses
some requests before admission). The closed gates go to every watcher when they
change, and at least every `REFRESH_S` (a heartbeat: a watcher that hears nothing for
longer knows its copy is stale). With API keys in force no gate is listed: a key's
tenant, rate limit and fair share decide before admission, and a caller without a key
is due a 401, not a 429.

Each watcher gets its own copy of the gates, with `seen`: per Lane listed, the highest
tag of its requests (`blazar.api.gate_tags`) the Lane's admission had taken in when that
Lane's gates were computed, read from the same state at the same moment
(`LaneDispatcher.seen`). A watcher also hears a message when only its `seen` changed: a
request it sent arrived and left the gates as they were (it was refused, say), and the
watcher, which counts it as in flight until told, would count it once too often.

The publisher is one object on the data plane's event loop: `mark` (from the
dispatchers) schedules one flush for the Lanes that changed, however many events
came at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.dataplane import admission, routing

# The longest a watcher hears nothing while the stream is healthy.
REFRESH_S = 0.5


@dataclass(frozen=True)
class LaneGates:
    """What one Lane's admission task answers for its gates (`LaneDispatcher.gates`)."""

    # By policy name, the refusal of the smallest request; or refused once enough
    # requests of the sizes it says have arrived (`admission.LaneQueue.filling`); None:
    # open.
    refusals: Mapping[str, admission.Refuse | admission.Filling | None]
    chars_per_token: float
    # Requests generating on the Lane now: with none, nothing drains while nothing
    # happens, and a filling gate holds until the next message.
    running: int = 0
    # By gate watcher, the highest tag n that arrived (`LaneDispatcher.seen`), as of
    # these refusals.
    seen: Mapping[str, int] = field(default_factory=dict)
    # By policy name, the longest prompt a SLO_UNATTAINABLE refusal still hints a retry
    # to (`admission.hinted_prompt_tokens`); a policy not here has no bound.
    hinted_prompts: Mapping[str, int] = field(default_factory=dict)


# What the publisher asks of a Lane's admission task: its gates for these policies
# (None when the Lane has no admission task).
GateSource = Callable[[str, list[admission.Policy], bool], LaneGates | None]


def gate_message(
    route: routing.Route,
    policy: admission.Policy,
    refusal: admission.Refuse,
    *,
    lane_policy: bool,
    names: Iterable[str],
    chars_per_token: float,
    after: admission.Filling | None = None,
    drains: bool = True,
    hinted_prompt: int | None = None,
) -> inference_pb2.AdmissionGate:
    """One closed gate as WatchAdmission lists it: the refusal a request gets; `after`:
    closed only after the requests it counts; `hinted_prompt`: for SLO_UNATTAINABLE,
    the longest prompt the refusal holds for (a longer one is told that no wait helps,
    which only the Lane can say). `drains`: work
    runs on the Lane, so an SLO refusal holds only while the work ahead drains by what
    the probe misses its target by; a filling gate on a Lane where nothing runs holds
    until the next message (its refusal is of the requests that will fill it, and
    nothing moves until they come or something else happens)."""
    err: errors.BlazarError = refusal.error(route.lane)
    gate = inference_pb2.AdmissionGate(
        lane=route.lane,
        models=sorted(names),
        policy=policy.name,
        lane_policy=lane_policy,
        reason=err.reason,
        message=err.message,
        metadata=err.metadata,
        chars_per_token=chars_per_token,
        context_tokens=route.context_length,
    )
    if after is not None:
        gate.after_requests = after.requests
        gate.after_max_tokens = after.max_tokens
        gate.after_most_max_tokens = after.most_max_tokens
        gate.after_least_prompt_tokens = after.least_prompt_tokens
        gate.after_most_prompt_tokens = after.most_prompt_tokens
    if refusal.reason == admission.Reason.SLO_UNATTAINABLE and hinted_prompt is not None:
        gate.most_prompt_tokens = hinted_prompt
    if refusal.reason == admission.Reason.SLO_UNATTAINABLE and (drains or after is None):
        # It holds while the work ahead drains by what the probe misses its target by.
        target = policy.ttft_target_s or 0.0
        predicted = refusal.predicted_ttft_s or 0.0
        gate.closed_for_ms = max(0, math.floor((predicted - target) * 1000))
    return gate


class GatePublisher:
    """The closed gates of every Lane, and the watchers they go to (module docstring)."""

    def __init__(
        self,
        *,
        table: Callable[[], routing.RouteTable],
        policies: Callable[[], Mapping[str, admission.Policy]],
        lane_policy: Callable[[routing.Route], admission.Policy],
        named: Callable[[str], Iterable[str]],
        source: GateSource,
        enabled: Callable[[], bool],
        busy: Callable[[str], bool] = lambda lane: True,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = REFRESH_S,
    ) -> None:
        """`table`: the route table now; `policies`: the stored SLOPolicies by name;
        `lane_policy`: the policy a Lane's requests naming none run under; `named`:
        the policies a Lane's requests have named; `source`: a Lane's gates;
        `enabled`: False while API keys are in force; `busy`: whether a Lane has work
        running, waiting or parked (its gates change as time passes)."""
        self._table = table
        self._policies = policies
        self._lane_policy = lane_policy
        self._named = named
        self._source = source
        self._enabled = enabled
        self._busy = busy
        self._clock = clock
        self._refresh_s = refresh_s
        self._loop = asyncio.get_running_loop()
        self._gates: dict[str, list[inference_pb2.AdmissionGate]] = {}
        # By Lane with gates, what its watchers' tags had reached when they were computed.
        self._seen: dict[str, Mapping[str, int]] = {}
        self._dirty: set[str] = set()
        # By Lane, what its gates were last computed from beside its admission's state:
        # its route, and whether keys are in force and which policies are stored.
        self._inputs: dict[str, tuple[routing.Route, bool, Mapping[str, admission.Policy]]] = {}
        self._scheduled = False
        self._message = inference_pb2.AdmissionGates(refresh_ms=round(refresh_s * 1000))
        self._sent_at = -math.inf
        self._watchers: set[_Watcher] = set()
        self._ticker = self._loop.create_task(self._tick(), name="admission-gates")

    def mark(self, lane: str) -> None:
        """The Lane's admission decided something: flush its gates soon (once for every
        Lane marked before the flush runs)."""
        self._dirty.add(lane)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def snapshot(self, watcher: str = "") -> inference_pb2.AdmissionGates:
        """The gates now, as `watcher` (an id, or "" for none) hears them."""
        return self._copy(self._seen_by(watcher))

    async def watch(self, watcher: str = "") -> AsyncIterator[inference_pb2.AdmissionGates]:
        """The gates now, then each change (and a heartbeat) until the caller leaves;
        with `seen` for `watcher`'s tags (none for "")."""
        seen = self._seen_by(watcher)
        stream = _Watcher(watcher, self._copy(seen), seen)
        self._watchers.add(stream)
        try:
            while True:
                yield await stream.next()
        finally:
            self._watchers.discard(stream)

    async def close(self) -> None:
        self._ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._ticker

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s / 2)
            self._dirty.update(self.stale())
            self._flush()

    def stale(self) -> set[str]:
        """The Lanes whose gates may have changed with no decision of their admission to
        say so: those with work (time passes: it drains, waits grow), those whose route,
        keys or stored policies changed, and those listed that left the table. An idle
        Lane's gates depend on nothing else (its measurements change as requests end,
        each a decision), and are not asked again."""
        enabled, policies = self._enabled(), dict(self._policies())
        routes = {route.lane: route for route in self._table().routes}
        stale = {lane for lane in self._gates if lane not in routes}
        for lane, route in routes.items():
            if self._busy(lane) or self._inputs.get(lane) != (route, enabled, policies):
                stale.add(lane)
        for lane in set(self._inputs) - set(routes):
            del self._inputs[lane]
        return stale

    def _flush(self) -> None:
        self._scheduled = False
        dirty, self._dirty = self._dirty, set()
        table = self._table()
        routes = {route.lane: route for route in table.routes}
        enabled = self._enabled()
        policies = dict(self._policies()) if dirty else {}
        for lane in dirty:
            route = routes.get(lane)
            if route is not None:
                self._inputs[lane] = (route, enabled, policies)
            gates, seen = (
                self._lane(route, table, policies) if enabled and route is not None else ([], {})
            )
            if gates:
                self._gates[lane] = gates
                self._seen[lane] = seen
            else:
                self._gates.pop(lane, None)
                self._seen.pop(lane, None)
        closed = [gate for lane in sorted(self._gates) for gate in self._gates[lane]]
        now = self._clock()
        changed = list(self._message.closed) != closed
        due = changed or now - self._sent_at >= self._refresh_s
        if due:
            self._message = inference_pb2.AdmissionGates(
                closed=closed, refresh_ms=round(self._refresh_s * 1000)
            )
            self._sent_at = now
        for watcher in self._watchers:
            seen = self._seen_by(watcher.id)
            if due or seen != watcher.seen:
                watcher.put(self._copy(seen), seen)

    def _seen_by(self, watcher: str) -> dict[str, int]:
        """By Lane with gates, the highest tag of `watcher` as of those gates."""
        if not watcher:
            return {}
        return {lane: seen[watcher] for lane, seen in self._seen.items() if watcher in seen}

    def _copy(self, seen: Mapping[str, int]) -> inference_pb2.AdmissionGates:
        """The shared message, with one watcher's `seen`."""
        if not seen:
            return self._message
        message = inference_pb2.AdmissionGates()
        message.CopyFrom(self._message)
        message.seen.update(seen)
        return message

    def _lane(
        self,
        route: routing.Route,
        table: routing.RouteTable,
        stored: Mapping[str, admission.Policy],
    ) -> tuple[list[inference_pb2.AdmissionGate], Mapping[str, int]]:
        """The Lane's closed gates, and its watchers' tags as of them; `stored`: the
        SLOPolicies the store holds, read once per flush."""
        # No replica (asleep: a request wakes it), an upstream (refusing before
        # admission), or scaled to zero while a replica drains (the Lane refuses
        # every request as that, 503, not as the drain's overload).
        if not route.replicas or route.upstream is not None or route.desired == 0:
            return [], {}
        own = self._lane_policy(route)
        policies = {own.name: own}
        for name in self._named(route.lane):
            if name in stored:
                policies.setdefault(name, stored[name])
        spill = route.spillover is not None
        found = self._source(route.lane, list(policies.values()), spill)
        if found is None:
            return [], {}
        names = [name for name, to in table.by_name.items() if to.lane == route.lane]
        gates = []
        for name, policy in sorted(policies.items()):
            answer = found.refusals.get(name)
            if answer is None:
                continue
            after = answer if isinstance(answer, admission.Filling) else None
            refusal = answer.refusal if isinstance(answer, admission.Filling) else answer
            gates.append(
                gate_message(
                    route,
                    policy,
                    refusal,
                    lane_policy=name == own.name,
                    names=names,
                    chars_per_token=found.chars_per_token,
                    after=after,
                    drains=found.running > 0,
                    hinted_prompt=found.hinted_prompts.get(name),
                )
            )
        return gates, found.seen


class _Watcher:
    """One WatchAdmission stream: only the latest message matters."""

    def __init__(
        self, watcher: str, first: inference_pb2.AdmissionGates, seen: Mapping[str, int]
    ) -> None:
        self.id = watcher
        # The `seen` of the latest message put.
        self.seen = seen
        self._latest: inference_pb2.AdmissionGates | None = first
        self._ready = asyncio.Event()
        self._ready.set()

    def put(self, message: inference_pb2.AdmissionGates, seen: Mapping[str, int]) -> None:
        self._latest = message
        self.seen = seen
        self._ready.set()

    async def next(self) -> inference_pb2.AdmissionGates:
        await self._ready.wait()
        self._ready.clear()
        message = self._latest
        assert message is not None
        return message
