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
mixed in too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import structlog

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, gate_tags
from blazar.dataplane import admission, metrics, preempting, recording, routing, runs, throughput
from blazar.dataplane.measurements import LaneMeasurements
from blazar.dataplane.parking import Parker

log = structlog.get_logger(__name__)

# The watchers of admission gates whose tags a Lane remembers (`LaneDispatcher.seen`):
# the ones heard from last. A watcher forgotten (this many others tagged requests to
# the Lane after its own) hears no `seen` for the Lane, and counts the requests it sent
# there as still on their way until their calls end or they are old (`blazar.shim.gates`).
MAX_WATCHERS = 8


@dataclass(eq=False)
class _Pending:
    ticket: admission.Ticket
    request_id: str
    prompt_chars: int
    # A Spill: admission handed the request back, to offer to the spillover Lane.
    started: asyncio.Future[runs.Run | admission.Spill]
    predicted_ttft_s: float | None = None
    # Its Lane names a spillover Lane that exists (`admission.LaneQueue.arrive`).
    spill: bool = False
    # Admission has it wait for a busy slot (`admission.Admit.waits`).
    waits: bool = False
    # Its place in the order tickets came to this queue (an arrival, or a start that
    # failed and came back): a ticket that starts before one that came earlier is work
    # that the earlier one's forecast did not see.
    seq: int = 0
    # The tag its gate watcher sent it with (`gate_tags`), if any.
    tag: gate_tags.Tag | None = None


@dataclass(frozen=True)
class _Arrive:
    pending: _Pending


@dataclass(frozen=True)
class _Retry:
    run: runs.Run
    pending: _Pending


@dataclass(frozen=True)
class _Cancel:
    ticket_id: str


@dataclass(frozen=True)
class _End:
    run: runs.Run
    final: inference_pb2.Final | None


@dataclass(frozen=True)
class _Table:
    route: routing.Route | None


_Event: TypeAlias = (
    _Arrive
    | _Retry
    | _Cancel
    | _End
    | _Table
    | preempting.ParkDone
    | preempting.ParkAgain
    | preempting.Resumed
)


class LaneDispatcher(recording.Recording, preempting.Preempting):
    """One Lane's admission queue and the task that owns it (see the module docstring)."""

    def __init__(
        self,
        route: routing.Route,
        *,
        parker: Parker,
        clock: Callable[[], float] = time.monotonic,
        on_decided: Callable[[str], None] | None = None,
    ) -> None:
        """`on_decided(lane)` after every round of decisions (`gates.GatePublisher`)."""
        self.lane = route.lane
        self._on_decided = on_decided
        self.measurements = LaneMeasurements()
        self.throughput = throughput.Throughput()
        # Per policy name; read by the Control API (`blazar get slopolicies`).
        self.figures: dict[str, recording.PolicyFigures] = {}
        self._route: routing.Route | None = route
        self._parker = parker
        self._clock = clock
        self._queue = admission.LaneQueue()
        self._pending: dict[str, _Pending] = {}
        # The server is shutting down (`refuse_waiting`): nothing more is admitted.
        self._closing = False
        # What runs where, is parked or being parked (`runs`).
        self._runs = runs.LaneRuns()
        self._policies: dict[str, admission.Policy] = {}
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        # Park and Resume calls running beside the queue.
        self._calls: set[asyncio.Task[None]] = set()
        # By policy, the max_tokens its gate last closed after (`gates`: where the
        # search for the next answer starts).
        self._filling_hints: dict[str, int] = {}
        # By policy, the prompt tokens and max_tokens of its latest fresh request (what
        # its gate fills with, `gates`).
        self._latest: dict[str, tuple[int, int]] = {}
        # The last `_Pending.seq` given, and the highest of the tickets started so far.
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
        self._events.put_nowait(_Arrive(pending))
        return await self._wait(pending)

    async def retry(self, run: runs.Run) -> runs.Run:
        """The replica refused `run` before its first chunk: wait for another start."""
        self._check_open()
        pending = self._pending_of(
            run.ticket, request_id=run.request_id, prompt_chars=run.prompt_chars
        )
        self._events.put_nowait(_Retry(run, pending))
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
        self._events.put_nowait(_End(run, final))

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
    ) -> _Pending:
        loop = asyncio.get_running_loop()
        started: asyncio.Future[runs.Run | admission.Spill] = loop.create_future()
        return _Pending(ticket, request_id, prompt_chars, started)

    async def _wait(self, pending: _Pending) -> runs.Run | admission.Spill:
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
                self._events.put_nowait(_Cancel(pending.ticket.id))
            raise

    # --- the table's side ----------------------------------------------------------

    def update(self, route: routing.Route | None) -> None:
        """The Lane's new route (None: the Lane is gone, and so is this dispatcher)."""
        self._events.put_nowait(_Table(route))

    def refuse_waiting(self) -> None:
        """The server is shutting down: every request still waiting for a start is
        refused now (UNAVAILABLE, saying to retry), and so is every one that arrives from
        now on, rather than held through the engines' drain and then cut off by the
        gRPC server's stop. What runs already runs on, to its end or its engine's."""
        self._closing = True
        for ticket_id, pending in list(self._pending.items()):
            if not pending.started.done():
                pending.started.set_exception(_shutting_down())
                self._events.put_nowait(_Cancel(ticket_id))

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

    def tokens_per_second(self) -> float:
        """Tokens generated per second by requests that finished lately (`throughput`)."""
        return self.throughput.rate(self._clock())

    # --- the task ------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            times = [
                t
                for t in (
                    self._queue.next_expiry(),
                    self._recheck_at,
                    self._runs.readmission_at(),
                )
                if t is not None
            ]
            expiry = min(times, default=None)
            event: _Event | None = None
            try:
                if expiry is None:
                    event = await self._events.get()
                else:
                    # Just past the expiry: admission refuses a ticket past its bound.
                    timeout = max(0.0, expiry - self._clock()) + 0.001
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a
                    # cancel that comes as the queue hands over an event, and `close`
                    # then waited for a task that went on serving.
                    async with asyncio.timeout(timeout):
                        event = await self._events.get()
            except TimeoutError:
                pass
            try:
                gone = False
                while event is not None:
                    gone = self._handle(event) or gone
                    event = self._events.get_nowait() if not self._events.empty() else None
                if gone:
                    self._leave_all()
                    return
                if self._route is not None and (stranded := routing.unservable(self._route)):
                    # No replica left, and none starts until the Model is back: whatever
                    # waits (or came back from a replica that died) would wait for nothing.
                    self._fail_all(stranded)
                self._decide()
                if self._on_decided is not None:
                    self._on_decided(self.lane)
            except Exception:
                # A bug here must not leave every waiting caller hanging: they get an
                # error, and the Lane keeps admitting.
                log.exception("admission.failed", lane=self.lane)
                self._fail_all(errors.BlazarError("Admission failed on this Lane; retry."))

    def _handle(self, event: _Event) -> bool:
        """Apply one event; True when the Lane is gone."""
        now = self._clock()
        if isinstance(event, _Arrive):
            self._arrive(event.pending, now)
        elif isinstance(event, _Retry):
            self._runs.running.pop(event.run.ticket.id, None)
            self._runs.exclude(event.run.replica, now=now)
            self._seq += 1
            event.pending.seq = self._seq
            self._pending[event.pending.ticket.id] = event.pending
            self._queue.requeue(replace(event.run.ticket, restarted=True), now=now)
            log.info(
                "admission.requeued",
                request_id=event.run.request_id,
                lane=self.lane,
                replica=event.run.replica.index,
            )
        elif isinstance(event, _Cancel):
            # Out of the queue, or (its caller left while a park was asked for it) out
            # of the tickets that parks wait for: the park's answer starts nothing.
            pending = self._pending.get(event.ticket_id)
            if self._queue.cancel(event.ticket_id) or (
                pending is not None and pending.started.done()
            ):
                self._pending.pop(event.ticket_id, None)
        elif isinstance(event, _End):
            ticket_id = event.run.ticket.id
            self._runs.refused_parks.pop(ticket_id, None)
            parking = self._runs.parking.pop(ticket_id, None)
            if parking is not None:
                # Ended while its engine was asked to park it: its slot is idle now, for
                # the ticket that was to start there (the park's answer is ignored).
                self._requeue_urgent(parking, now)
            if ticket_id in self._runs.parked:
                # Ended while parked (its caller left): out of the queue, memory freed.
                self._runs.parked.pop(ticket_id)
                self._runs.parked_bytes.pop(ticket_id, None)
                self._queue.cancel(ticket_id)
            run = self._runs.running.pop(ticket_id, None)
            if event.final is not None:
                self.throughput.record(now, event.final.usage.completion_tokens)
            if run is not None and event.final is not None:
                self.measurements.record(
                    run.replica.index,
                    event.final,
                    prompt_chars=run.prompt_chars,
                    policy=run.ticket.policy.name,
                    max_tokens=run.ticket.max_tokens,
                    draft_batch_max=self._route.draft_batch_max if self._route else None,
                )
        elif isinstance(event, preempting.ParkDone):
            self._park_done(event, now)
        elif isinstance(event, preempting.ParkAgain):
            self._ask_again(event.parking, now)
        elif isinstance(event, preempting.Resumed):
            event.run.resuming = False
        else:
            return self._new_route(event.route)
        return False

    def _arrive(self, pending: _Pending, now: float) -> None:
        if pending.tag is not None:
            self._see(pending.tag)
        if pending.started.done():  # cancelled before the task saw it
            return
        ticket = pending.ticket
        if self._route is not None and self._route.desired == 0:
            # Scaled to zero while a replica still drains (listed Ready until it has
            # stopped): a draining engine takes no new work, so the request would wait
            # for nothing, as the ones waiting when it was scaled down were told.
            pending.started.set_exception(routing.scaled_to_zero(self._route))
            return
        self._policies[ticket.policy.name] = ticket.policy
        if ticket.spilled_from is None:
            self._latest[ticket.policy.name] = (ticket.prompt_tokens, ticket.max_tokens)
        self._seq += 1
        pending.seq = self._seq
        decision = self._queue.arrive(ticket, now=now, view=self._view(), spill=pending.spill)
        if isinstance(decision, admission.Spill):
            pending.started.set_result(decision)
            return
        if isinstance(decision, admission.Refuse) and ticket.spilled_from is not None:
            # Not this Lane's refusal to count: its caller gets the decision of the Lane
            # it spilled from, counted there.
            log.info(
                "admission.spill_refused",
                request_id=pending.request_id,
                lane=self.lane,
                spilled_from=ticket.spilled_from,
                predicted_ttft_s=runs.rounded(decision.predicted_ttft_s),
            )
            pending.started.set_exception(decision.error(self.lane))
            return
        if isinstance(decision, admission.Refuse):
            self._refuse(pending, decision)
            return
        pending.predicted_ttft_s = decision.predicted_ttft_s
        pending.waits = decision.waits
        self._pending[ticket.id] = pending

    def _see(self, tag: gate_tags.Tag) -> None:
        """Note a tagged arrival; the watcher heard from least lately is forgotten past
        MAX_WATCHERS."""
        highest = max(self._seen.pop(tag.watcher, 0), tag.n)
        self._seen[tag.watcher] = highest
        while len(self._seen) > MAX_WATCHERS:
            del self._seen[next(iter(self._seen))]

    def _new_route(self, route: routing.Route | None) -> bool:
        if route is None:
            self._route = None
            return True
        self._route = route
        self._runs.forget_gone(route)
        for run in self._runs.stranded(route):
            log.info(
                "admission.withdrawn",
                request_id=run.request_id,
                lane=self.lane,
                replica=run.replica.index,
            )
            run.withdraw()
        # A process that left the route never has a first token again: without this, a
        # daemon would keep one entry per engine restart (crash, rollout) for good.
        serving = {runs.identity(r) for r in route.replicas}
        self._line_last = {k: v for k, v in self._line_last.items() if k in serving}
        if route.desired == 0:
            err = errors.Unavailable(
                f"Lane '{self.lane}' was scaled to zero (replicas: 0) while the request "
                "waited; scale it up to serve it.",
                metadata={"lane": self.lane},
            )
            self._fail_all(err)
        return False

    def _leave_all(self) -> None:
        # Not UNAVAILABLE: a retry would find no such model either, so say so for good.
        err = errors.ModelNotFound(
            f"Lane '{self.lane}' was deleted while the request waited: the model "
            f"'{self.lane}' no longer exists.",
            metadata={"lane": self.lane, "model": self.lane},
        )
        self._fail_all(err)
        # The Lane's gauges go with it (its counters stay, as counters do).
        for name in self._policies:
            for gauge in (metrics.QUEUE_DEPTH, metrics.ATTAINMENT):
                with contextlib.suppress(KeyError):
                    gauge.remove(self.lane, name)
        with contextlib.suppress(KeyError):
            metrics.PARKED_BYTES.remove(self.lane)

    def _decide(self) -> None:
        now = self._clock()
        self._runs.readmit(now)
        # What deciding costs, in real time whatever the Lane's clock: the rechecks
        # are spaced by it (`LaneQueue.recheck_at`).
        started = time.perf_counter()
        for decision in self._queue.dispatch(now=now, view=self._view()):
            if decision.resume:
                self._resume(decision)
            else:
                self._start(decision, now)
        while (preempt := self._queue.preemption(now=now, view=self._view())) is not None:
            if not self._preempt(preempt, now):
                break  # asked again, admission would name the same victim
        # Refusals take out waiting tickets only (and a late one moves the lateness,
        # which `recheck_at` does not read): the same view serves both.
        view = self._view()
        for refusal in self._queue.expire(now=now, view=view):
            pending = self._pending.pop(refusal.ticket.id, None)
            if pending is not None:
                self._late(pending, refusal, now)
                self._refuse(pending, refusal)
        self._recheck_at = self._queue.recheck_at(
            now=now, view=view, decide_s=time.perf_counter() - started
        )
        self._gauge()

    def _waited_on_forecast(self, pending: _Pending) -> bool:
        """Whether the ticket waits as admission forecast it at its arrival: for a busy
        slot, and with no ticket that came to the queue after it started yet (work its
        forecast could not see)."""
        return pending.waits and self._started_seq <= pending.seq

    def _late(self, pending: _Pending, refusal: admission.Refuse, now: float) -> None:
        """A ticket that admission had wait for a busy slot, refused now as predicted to
        miss its target: the forecast it waited on came late, by at least what the
        forecast says now (its first token would come then, or later) over what it
        said at its arrival. Counted as a wait measured, as a first token after a wait
        is (`_start`): the lateness read from the waits that ended well only would
        leave out the latest ones. Not when later work overtook it."""
        if (
            refusal.reason != admission.Reason.SLO_UNATTAINABLE
            or not self._waited_on_forecast(pending)
            or pending.predicted_ttft_s is None
        ):
            return
        at_least = max(now - refusal.ticket.arrived, refusal.predicted_ttft_s or 0.0)
        self.measurements.record_wait(predicted_s=pending.predicted_ttft_s, measured_s=at_least)

    def _start(self, decision: admission.Dispatch, now: float, *, preempting: bool = False) -> None:
        """Start a fresh ticket (`preempting`: in the slot of a generation parked for it).

        Its first token tests the forecast of a wait, and measures its lateness, when
        admission had it wait for a busy slot at its arrival, it starts in a slot that
        freed (not by parking work: what it waited for then was a park), and nothing that
        came to the queue after it started before it (work its forecast could not see)."""
        ticket = decision.ticket
        pending = self._pending.pop(ticket.id, None)
        replica = self._runs.replica(self._route, decision.replica)
        if pending is None or pending.started.done():
            return
        if replica is None:  # cannot happen: the view is made of the serving replicas
            self._pending[ticket.id] = pending
            self._queue.requeue(ticket, now=now)
            return
        tests_forecast = not preempting and self._waited_on_forecast(pending)
        self._started_seq = max(self._started_seq, pending.seq)
        self._observe_wait(ticket)
        run = runs.Run(
            ticket,
            pending.request_id,
            replica,
            pending.prompt_chars,
            predicted_ttft_s=pending.predicted_ttft_s,
            started_at=now,
            expected_prefill_s=self.measurements.expected_prefill_s(
                replica.index, ticket.fresh_tokens(replica.index), alone=decision.alone
            ),
            wait_forecast_s=pending.predicted_ttft_s if tests_forecast else None,
            queue_s=decision.queue_s,
            prefill_s=decision.prefill_s,
            alone=decision.alone,
        )
        self._runs.running[ticket.id] = run
        pending.started.set_result(run)

    def _caller_waits(self, parking: runs.Parking) -> bool:
        """Whether the caller of the ticket a park is asked for still waits for it."""
        pending = self._pending.get(parking.preempt.ticket.id)
        return pending is not None and not pending.started.done()

    def _tell(self, event: preempting.ParkDone | preempting.ParkAgain | preempting.Resumed) -> None:
        self._events.put_nowait(event)

    def _call(self, call: Coroutine[Any, Any, None], *, name: str) -> None:
        """Run an engine call beside the queue (kept until done, cancelled on close)."""
        task = asyncio.get_running_loop().create_task(call, name=name)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def _refuse(self, pending: _Pending, refusal: admission.Refuse) -> None:
        self._count_refusal(refusal, request_id=pending.request_id)
        if not pending.started.done():
            pending.started.set_exception(refusal.error(self.lane))

    def _fail_all(self, err: errors.BlazarError) -> None:
        """Every waiting ticket, and every ticket waiting for a park, fails with `err`."""
        for ticket in self._queue.tickets():
            self._queue.cancel(ticket.id)
            self._fail(ticket.id, err)
        for parking in self._runs.parking.values():
            self._fail(parking.preempt.ticket.id, err)

    def _fail(self, ticket_id: str, err: errors.BlazarError) -> None:
        pending = self._pending.pop(ticket_id, None)
        if pending is not None and not pending.started.done():
            pending.started.set_exception(err)

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
