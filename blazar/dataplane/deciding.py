"""The task of one Lane's admission: the events it takes, and the decisions it
carries out (see `dispatcher`, whose module docstring tells the whole of it).

`Deciding` is mixed into `dispatcher.LaneDispatcher`: its methods run on the
dispatcher's task and read and write the dispatcher's state (the attributes declared
below) as the dispatcher's own methods do; the split is only of the text. The relay's
side (`admit`, `retry`, `end`) puts these events on the queue; `_serve` takes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import structlog

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, gate_tags
from blazar.dataplane import admission, metrics, preempting, recording, routing, runs, throughput

# The dispatcher's logger: these lines were its own before the split.
log = structlog.get_logger("blazar.dataplane.dispatcher")


@dataclass(eq=False)
class Pending:
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
class Arrive:
    pending: Pending


@dataclass(frozen=True)
class Retry:
    run: runs.Run
    pending: Pending


@dataclass(frozen=True)
class Cancel:
    ticket_id: str


@dataclass(frozen=True)
class End:
    run: runs.Run
    final: inference_pb2.Final | None


@dataclass(frozen=True)
class Table:
    route: routing.Route | None


Event: TypeAlias = (
    Arrive
    | Retry
    | Cancel
    | End
    | Table
    | preempting.ParkDone
    | preempting.ParkAgain
    | preempting.Resumed
)


class Deciding(recording.Recording, preempting.Preempting):
    """The task of a Lane's dispatcher (see the module docstring)."""

    lane: str
    throughput: throughput.Throughput
    _route: routing.Route | None
    _on_decided: Callable[[str], None] | None
    _queue: admission.LaneQueue
    _pending: dict[str, Pending]
    _events: asyncio.Queue[Event]
    _calls: set[asyncio.Task[None]]
    _latest: dict[str, tuple[int, int]]
    _seq: int
    _started_seq: int
    _recheck_at: float | None
    _wall_clock: Callable[[], float]

    # What the dispatcher provides.

    def _see(self, tag: gate_tags.Tag) -> None:
        raise NotImplementedError

    # The task.

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
            event: Event | None = None
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
                if self._route is not None and (
                    stranded := routing.unservable(self._route)
                    or routing.backing_off(self._route, self._wall_clock())
                ):
                    # No replica left, and none starts until the Model is back (or its
                    # crash back-off ends): whatever waits (or came back from a replica
                    # that died) would wait for nothing, or through a crash loop.
                    self._fail_all(stranded)
                self._decide()
                if self._on_decided is not None:
                    self._on_decided(self.lane)
            except Exception:
                # A bug here must not leave every waiting caller hanging: they get an
                # error, and the Lane keeps admitting.
                log.exception("admission.failed", lane=self.lane)
                self._fail_all(errors.BlazarError("Admission failed on this Lane; retry."))

    def _handle(self, event: Event) -> bool:
        """Apply one event; True when the Lane is gone."""
        now = self._clock()
        if isinstance(event, Arrive):
            self._arrive(event.pending, now)
        elif isinstance(event, Retry):
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
        elif isinstance(event, Cancel):
            # Out of the queue, or (its caller left while a park was asked for it) out
            # of the tickets that parks wait for: the park's answer starts nothing.
            pending = self._pending.get(event.ticket_id)
            if self._queue.cancel(event.ticket_id) or (
                pending is not None and pending.started.done()
            ):
                self._pending.pop(event.ticket_id, None)
        elif isinstance(event, End):
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

    def _arrive(self, pending: Pending, now: float) -> None:
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

    def _waited_on_forecast(self, pending: Pending) -> bool:
        """Whether the ticket waits as admission forecast it at its arrival: for a busy
        slot, and with no ticket that came to the queue after it started yet (work its
        forecast could not see)."""
        return pending.waits and self._started_seq <= pending.seq

    def _late(self, pending: Pending, refusal: admission.Refuse, now: float) -> None:
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

    def _refuse(self, pending: Pending, refusal: admission.Refuse) -> None:
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
