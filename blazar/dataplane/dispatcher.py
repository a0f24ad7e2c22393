"""The admission task of each Lane: requests wait here for a slot, not in the engines.

`Dispatchers` keeps one `LaneDispatcher` per Lane of the route table. A dispatcher is
one asyncio task, the only owner of its Lane's `admission.LaneQueue` and of what runs
where; relays (`blazar.dataplane.inference`) talk to it through its event queue. On
every event (an arrival, a run that ends, a cancel, a start that failed, a new route
table), at the queue's `next_expiry()` and at its `recheck_at(...)` (a decode step,
while urgent work waits where it may park other work), it drives admission as that
module says:
`dispatch`, then `preemption` until None, then `expire`, each against a view that
holds the decisions already carried out.

A request's side, in the relay:

1. `admit(...)` returns once admission starts the request on a replica (a `runs.Run`), or
   raises what admission refused it with (`errors.Overloaded`, carrying
   `retry_after_ms`; `errors.DeadlineExceeded` for its caller's gRPC deadline,
   `Ticket.caller_deadline`), `errors.ModelNotFound` when its Lane is deleted while it waits
   (NOT_FOUND: retrying cannot help), or `errors.Unavailable` when its Lane is scaled
   to zero meanwhile. A caller that leaves while waiting (its coroutine cancelled)
   takes its ticket out of the queue at once.
   With `spill` (the Lane's spillover Lane exists), it returns admission's `Spill`
   instead when the request is predicted to miss its target here: nothing is queued,
   and the relay offers the ticket to the spillover Lane's `admit` (`spilled_from`
   set; a refusal there is not counted there) and, refused there too, carries out
   `Spill.local`: `refused(...)` counts this Lane's refusal, or it arrives here again
   without `spill` to wait.
2. The relay streams from `run.replica`, counting the tokens it relays on
   `run.generated` (the one field a relay writes; the forecast reads it).
3. `end(run, final)` when the stream ends in any way; a Final's usage and timings
   become the Lane's measurements.
   `retry(run)` instead when the replica refused the request before its first chunk
   (its process died, or it is draining): nothing was generated, so the ticket goes
   back to the queue with its place and its wait so far, and the replica is left out
   of the view until the route table shows it as another process (restarted). So a
   request that had not started when its replica died waits, within its policy's
   bounds, for the restarted replica or another one; only generations already under
   way end with an error (UNAVAILABLE, retryable).

The view (`admission.LaneView`) is `runs.LaneRuns.view`: the route's replicas, the
runs dispatched and not ended, and the rates of `measurements.LaneMeasurements`, with the
forecast's own lateness: how much later than predicted at arrival the first tokens of
requests that admission had wait for a busy slot came (`_start` says which requests
count).

Gate watchers (`gates.GatePublisher`): a request tagged by a watcher
(`blazar.api.gate_tags`) is noted on arrival, in the same step as admission's decision
about it, so that `seen` and `gates` always answer from the same state: the watcher
counts toward a filling gate only the requests `seen` does not include.

Preemption (`Preempt`, parking a running generation for urgent work, and its
`Dispatch(resume=True)`) is carried out by the steps of `preempting.Preempting`, mixed
into `LaneDispatcher`. What it records of its requests (each policy's figures, its
refusals, queue waits and gauges, first tokens' measurements) is `recording.Recording`'s,
mixed in too. The task itself (its events, `_serve` and the steps that carry out
admission's decisions) is `deciding.Deciding`'s, which both are mixed into.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, gate_tags
from blazar.dataplane import admission, deciding, recording, routing, runs, throughput
from blazar.dataplane.measurements import LaneMeasurements
from blazar.dataplane.parking import Parker

# The watchers of admission gates whose tags a Lane remembers (`LaneDispatcher.seen`):
# the ones heard from last. A watcher forgotten (this many others tagged requests to
# the Lane after its own) hears no `seen` for the Lane, and counts the requests it sent
# there as still on their way until their calls end or they are old (`blazar.shim.gates`).
MAX_WATCHERS = 8


class LaneDispatcher(deciding.Deciding):
    """One Lane's admission queue and the task that owns it (see the module docstring)."""

    def __init__(
        self,
        route: routing.Route,
        *,
        parker: Parker,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_decided: Callable[[str], None] | None = None,
    ) -> None:
        """`on_decided(lane)` after every round of decisions (`gates.GatePublisher`);
        `wall_clock` reads the epoch seconds a crash back-off ends at (`restart_at`)."""
        self.lane = route.lane
        self._on_decided = on_decided
        self.measurements = LaneMeasurements()
        self.throughput = throughput.Throughput()
        # Per policy name; read by the Control API (`blazar get slopolicies`).
        self.figures: dict[str, recording.PolicyFigures] = {}
        self._route: routing.Route | None = route
        self._parker = parker
        self._clock = clock
        self._wall_clock = wall_clock
        self._queue = admission.LaneQueue()
        self._pending: dict[str, deciding.Pending] = {}
        # The server is shutting down (`refuse_waiting`): nothing more is admitted.
        self._closing = False
        # What runs where, is parked or being parked (`runs`).
        self._runs = runs.LaneRuns()
        self._policies: dict[str, admission.Policy] = {}
        self._events: asyncio.Queue[deciding.Event] = asyncio.Queue()
        # Park and Resume calls running beside the queue.
        self._calls: set[asyncio.Task[None]] = set()
        # By policy, the max_tokens its gate last closed after (`gates`: where the
        # search for the next answer starts).
        self._filling_hints: dict[str, int] = {}
        # By policy, the prompt tokens and max_tokens of its latest fresh request (what
        # its gate fills with, `gates`).
        self._latest: dict[str, tuple[int, int]] = {}
        # The last `deciding.Pending.seq` given, and the highest of the tickets started so far.
        self._seq = 0
        self._started_seq = 0
        # By gate watcher, the highest tag n of the requests that arrived (`seen`); the
        # watcher heard from last, last.
        self._seen: dict[str, int] = {}
        # By replica (as a process), the latest first token that came there.
        self._line_last: dict[runs.Identity, float] = {}
        # When to decide again though no event comes (`LaneQueue.recheck_at`).
        self._recheck_at: float | None = None
        self._task = asyncio.get_running_loop().create_task(
            self._serve(), name=f"admission:{self.lane}"
        )

    # --- the relay's side ----------------------------------------------------------

    async def admit(
        self,
        ticket: admission.Ticket,
        *,
        request_id: str,
        prompt_chars: int,
        spill: bool = False,
        tag: gate_tags.Tag | None = None,
    ) -> runs.Run | admission.Spill:
        """Queue the ticket and wait for its start (see the module docstring). With
        `spill` (the Lane's spillover Lane exists), a `Spill` when admission predicts it
        misses its target here: the ticket is not queued, and the caller offers it to
        the spillover Lane (`admission.Spill`). `tag`: the one its caller, a gate
        watcher, sent it with (`seen`)."""
        self._check_open()
        pending = self._pending_of(ticket, request_id=request_id, prompt_chars=prompt_chars)
        pending.spill = spill
        pending.tag = tag
        self._events.put_nowait(deciding.Arrive(pending))
        return await self._wait(pending)

    async def retry(self, run: runs.Run) -> runs.Run:
        """The replica refused `run` before its first chunk: wait for another start."""
        self._check_open()
        pending = self._pending_of(
            run.ticket, request_id=run.request_id, prompt_chars=run.prompt_chars
        )
        self._events.put_nowait(deciding.Retry(run, pending))
        started = await self._wait(pending)
        assert isinstance(started, runs.Run)  # a requeued ticket never arrives again
        return started

    def refused(self, refusal: admission.Refuse, *, request_id: str) -> None:
        """Count a refusal that the caller gets from this Lane though admission handed
        the ticket back (`Spill`): the spillover Lane refused it too."""
        self._count_refusal(refusal, request_id=request_id)

    def end(self, run: runs.Run, final: inference_pb2.Final | None) -> None:
        """The run's stream ended: with its Final when it finished."""
        run.ended = True
        self._events.put_nowait(deciding.End(run, final))

    def _check_open(self) -> None:
        if self._closing:
            raise _shutting_down()
        if self._task.done():
            raise errors.Unavailable(
                f"Lane '{self.lane}' is gone or the server is shutting down.",
                metadata={"lane": self.lane},
            )

    def _pending_of(
        self, ticket: admission.Ticket, *, request_id: str, prompt_chars: int
    ) -> deciding.Pending:
        loop = asyncio.get_running_loop()
        started: asyncio.Future[runs.Run | admission.Spill] = loop.create_future()
        return deciding.Pending(ticket, request_id, prompt_chars, started)

    async def _wait(self, pending: deciding.Pending) -> runs.Run | admission.Spill:
        try:
            return await asyncio.shield(pending.started)
        except asyncio.CancelledError:
            # The caller left. Started meanwhile: the run is the caller's to end.
            if pending.started.done() and not pending.started.cancelled():
                if pending.started.exception() is None:
                    started = pending.started.result()
                    if isinstance(started, runs.Run):
                        self.end(started, None)
            else:
                pending.started.cancel()
                self._events.put_nowait(deciding.Cancel(pending.ticket.id))
            raise

    # --- the table's side ----------------------------------------------------------

    def update(self, route: routing.Route | None) -> None:
        """The Lane's new route (None: the Lane is gone, and so is this dispatcher)."""
        self._events.put_nowait(deciding.Table(route))

    def refuse_waiting(self) -> None:
        """The server is shutting down: every request still waiting for a start is
        refused now (UNAVAILABLE, saying to retry), and so is every one that arrives from
        now on, rather than held through the engines' drain and then cut off by the
        gRPC server's stop. What runs already runs on, to its end or its engine's."""
        self._closing = True
        for ticket_id, pending in list(self._pending.items()):
            if not pending.started.done():
                pending.started.set_exception(_shutting_down())
                self._events.put_nowait(deciding.Cancel(ticket_id))

    async def close(self) -> None:
        self._task.cancel()
        for task in list(self._calls):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for pending in self._pending.values():
            if not pending.started.done():
                pending.started.set_exception(_shutting_down())

    def queued(self) -> dict[str, int]:
        """Tickets waiting, by policy name."""
        depth: dict[str, int] = {}
        for ticket in self._queue.tickets():
            depth[ticket.policy.name] = depth.get(ticket.policy.name, 0) + 1
        return depth

    def oldest_wait_s(self) -> dict[str, float]:
        """Seconds the longest-waiting ticket of each policy has waited."""
        now = self._clock()
        oldest: dict[str, float] = {}
        for ticket in self._queue.tickets():
            waited = now - ticket.arrived
            oldest[ticket.policy.name] = max(oldest.get(ticket.policy.name, 0.0), waited)
        return oldest

    def running(self) -> int:
        return len(self._runs.running)

    def parked(self) -> tuple[int, int]:
        """Generations parked on the Lane's replicas, and the host memory they hold
        there (bytes, as their Park answers said)."""
        return len(self._runs.parked), sum(self._runs.parked_bytes.values())

    def busy(self) -> bool:
        """Whether anything runs, waits, is parked or being parked on the Lane: its
        forecast then changes as time passes, with no event to say so."""
        return bool(self._pending) or self._runs.busy()

    def named(self) -> list[str]:
        """The names of the policies this Lane's requests have run under."""
        return list(self._policies)

    def seen(self) -> dict[str, int]:
        """By gate watcher (of the MAX_WATCHERS heard from last), the highest n of the
        tags on the requests that arrived here: in the queue's state, and so in the
        `gates` it answers, whatever became of them (queued, started, refused, handed
        back to spill over, or gone before the queue saw them)."""
        return dict(self._seen)

    def gates(
        self, policies: Iterable[admission.Policy], *, spill: bool
    ) -> dict[str, admission.Refuse | admission.Filling | None]:
        """By policy name, what admission would answer the smallest request of that
        policy now (`admission.LaneQueue.gate`): its refusal; or, open for now, after
        how many requests of what sizes it refuses it (`admission.LaneQueue.filling`,
        for requests like the policy's latest); or None."""
        now = self._clock()
        view = self._view()
        context = self._route.context_length if self._route is not None else 0
        found: dict[str, admission.Refuse | admission.Filling | None] = {}
        for policy in policies:
            closed = self._queue.gate(policy, now=now, view=view, spill=spill)
            if closed is None and context > 0:
                filling = self._queue.filling(
                    policy,
                    now=now,
                    view=view,
                    max_tokens=context,
                    spill=spill,
                    hint=self._filling_hints.get(policy.name),
                    latest=self._latest.get(policy.name),
                )
                if filling is not None and not filling.most_max_tokens:
                    self._filling_hints[policy.name] = filling.max_tokens
                found[policy.name] = filling
            else:
                found[policy.name] = closed
        return found

    def hinted_prompts(self, policies: Iterable[admission.Policy]) -> dict[str, int]:
        """By policy name, the longest prompt a SLO_UNATTAINABLE refusal hints a retry
        to now (`admission.hinted_prompt_tokens`), for the policies with such a bound."""
        view = self._view()
        found = {p.name: admission.hinted_prompt_tokens(view, p) for p in policies}
        return {name: tokens for name, tokens in found.items() if tokens is not None}

    def tokens_per_second(self) -> float:
        """Tokens generated per second by requests that finished lately (`throughput`)."""
        return self.throughput.rate(self._clock())

    def _see(self, tag: gate_tags.Tag) -> None:
        """Note a tagged arrival; the watcher heard from least lately is forgotten past
        MAX_WATCHERS."""
        highest = max(self._seen.pop(tag.watcher, 0), tag.n)
        self._seen[tag.watcher] = highest
        while len(self._seen) > MAX_WATCHERS:
            del self._seen[next(iter(self._seen))]

    def _view(self) -> admission.LaneView:
        return self._runs.view(self._route, self.measurements, now=self._clock())


class Dispatchers:
    """One `LaneDispatcher` per Lane of the route table, kept in step with it.

    Created on the data plane's event loop; `update` may be called from any thread
    (store writes notify their subscribers on the writer's thread)."""

    def __init__(self, *, parker: Parker, on_decided: Callable[[str], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._parker = parker
        self._on_decided = on_decided
        self._lanes: dict[str, LaneDispatcher] = {}
        self._closed = False

    def of(self, lane: str) -> LaneDispatcher | None:
        return self._lanes.get(lane)

    def all(self) -> list[LaneDispatcher]:
        return list(self._lanes.values())

    def update(self, table: routing.RouteTable) -> None:
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            self._update(table)
        else:
            self._loop.call_soon_threadsafe(self._update, table)

    def _update(self, table: routing.RouteTable) -> None:
        if self._closed:
            return
        routes = {route.lane: route for route in table.routes}
        for lane in list(self._lanes):
            if lane not in routes:
                self._lanes.pop(lane).update(None)
        for lane, route in routes.items():
            found = self._lanes.get(lane)
            if found is None:
                self._lanes[lane] = LaneDispatcher(
                    route, parker=self._parker, on_decided=self._on_decided
                )
            else:
                found.update(route)

    def refuse_waiting(self) -> None:
        """Every Lane's `LaneDispatcher.refuse_waiting`: the server is shutting down."""
        for dispatcher in self._lanes.values():
            dispatcher.refuse_waiting()

    async def close(self) -> None:
        self._closed = True
        for dispatcher in self._lanes.values():
            await dispatcher.close()
        self._lanes.clear()


def _shutting_down() -> errors.Unavailable:
    return errors.Unavailable("The server is shutting down; retry.")
