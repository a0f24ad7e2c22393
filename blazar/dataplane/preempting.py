"""Preemption on one Lane: its dispatcher's park and resume steps.

`Preempting` is mixed into `dispatcher.LaneDispatcher`: its methods run on the
dispatcher's task and read and write the dispatcher's state (the attributes declared
below) as the dispatcher's own methods do; the split is only of the text.

A `Preempt` goes through one `parking.Parker` (the engine's Park and Resume), called
beside the queue: while the engine parks, the queue goes on deciding with the urgent
ticket in the victim's slot, and the park's answer comes back as an event (`ParkDone`;
a refused park leaves the victim running, and no victim again until it has generated
more). A parked victim's relay keeps its engine stream, which simply pauses; its run
leaves the running set for the parked one, and its ticket waits again pinned to its
replica (`admission.Resume`) until a `Dispatch(resume=True)` has the engine resume it.
Each replica's parked bytes are what its Park answers said, its bound the Lane's
`kvCache.maxParkedMiB` (0: admission never parks there), and the KV bytes a token
costs are learned from those answers too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import structlog

from blazar.dataplane import admission, metrics, routing, runs
from blazar.dataplane.measurements import LaneMeasurements
from blazar.dataplane.parking import Parked, Parker

log = structlog.get_logger(__name__)

# Times the engine is asked to park a victim that has no first token yet: dispatched a
# moment before, it may not be seated (`Preempting._park_again`), and it is asked
# again a decode step later (this long before any step is measured).
PARK_TRIES = 3
PARK_AGAIN_S = 0.05


@dataclass(frozen=True)
class ParkDone:
    parking: runs.Parking
    # None: the engine did not park it (it ended meanwhile, or cannot).
    parked: Parked | None


@dataclass(frozen=True)
class ParkAgain:
    """A step has passed since the engine refused to park a victim it had not seated."""

    parking: runs.Parking


@dataclass(frozen=True)
class Resumed:
    """The engine answered a Resume of `run` (resumed, or lost it)."""

    run: runs.Run


class Preempting:
    """The park and resume steps of a Lane's dispatcher (see the module docstring)."""

    lane: str
    measurements: LaneMeasurements
    _route: routing.Route | None
    _parker: Parker
    _queue: admission.LaneQueue
    _runs: runs.LaneRuns
    _clock: Callable[[], float]

    # What the dispatcher provides.

    def _tell(self, event: ParkDone | ParkAgain | Resumed) -> None:
        """Put an engine call's answer on the dispatcher's event queue."""
        raise NotImplementedError

    def _call(self, call: Coroutine[Any, Any, None], *, name: str) -> None:
        raise NotImplementedError

    def _start(self, decision: admission.Dispatch, now: float, *, preempting: bool = False) -> None:
        raise NotImplementedError

    def _caller_waits(self, parking: runs.Parking) -> bool:
        raise NotImplementedError

    # The steps.

    def _preempt(self, preempt: admission.Preempt, now: float) -> bool:
        """Ask the victim's engine to park it for the ticket (False: it cannot be asked;
        the ticket waits on). The park runs beside the queue, which goes on deciding
        meanwhile with the ticket in the victim's slot (`_view`); `_park_done` carries
        out the answer."""
        victim = self._runs.running.get(preempt.victim)
        replica = self._runs.replica(self._route, preempt.replica)
        if victim is None or replica is None or preempt.victim in self._runs.parking:
            self._queue.requeue(preempt.ticket, now=now)
            return False
        batch = sum(run.replica.index == preempt.replica for run in self._runs.running.values())
        step_s = self.measurements.step_s(
            preempt.replica,
            batch=max(1, batch),
            draft_batch_max=self._route.draft_batch_max if self._route else None,
        )
        parking = runs.Parking(
            preempt, victim, asked_at=now, step_s=step_s, generated_when_asked=victim.generated
        )
        self._runs.parking[preempt.victim] = parking
        self._ask_park(parking, replica)
        return True

    def _ask_park(self, parking: runs.Parking, replica: routing.Replica) -> None:
        victim = parking.victim

        async def park() -> None:
            parked = await self._parker.park(replica, victim.request_id)
            self._tell(ParkDone(parking, parked))

        self._call(park(), name=f"park:{victim.request_id}")

    def _park_again(self, parking: runs.Parking) -> bool:
        """Ask the engine again, a step later, to park a victim it refused that had no
        token yet when asked (False: it is not asked again). Such a run was dispatched a
        moment ago, and its engine seats new work between two steps and parks only what
        is seated; meanwhile its slot stays the ticket's, as while any park is asked. A
        token that came since says the engine has seated it: the next ask parks it."""
        victim, preempt = parking.victim, parking.preempt
        if (
            parking.tries >= PARK_TRIES
            or parking.generated_when_asked > 0
            or victim.ticket.id not in self._runs.running
            or not self._caller_waits(parking)
            or self._runs.replica(self._route, preempt.replica) is None
        ):
            return False
        again = replace(parking, tries=parking.tries + 1)
        self._runs.parking[preempt.victim] = again

        async def later() -> None:
            await asyncio.sleep(parking.step_s or PARK_AGAIN_S)
            self._tell(ParkAgain(again))

        self._call(later(), name=f"park-again:{victim.request_id}")
        return True

    def _ask_again(self, parking: runs.Parking, now: float) -> None:
        """A step after the engine refused: ask it again, if the ticket still waits for
        the park. Its caller may have left meanwhile (the victim then keeps its slot,
        not parked for nothing) or the replica (the ticket waits again)."""
        preempt = parking.preempt
        if self._runs.parking.get(preempt.victim) is not parking:
            return  # the victim ended meanwhile (`_End` requeued the ticket)
        replica = self._runs.replica(self._route, preempt.replica)
        if replica is None or not self._caller_waits(parking):
            del self._runs.parking[preempt.victim]
            self._requeue_urgent(parking, now)
            return
        parking = replace(parking, generated_when_asked=parking.victim.generated)
        self._runs.parking[preempt.victim] = parking
        self._ask_park(parking, replica)

    def _park_done(self, done: ParkDone, now: float) -> None:
        """The engine answered a park: the victim waits parked and the ticket starts in
        its slot, or (not parked) the ticket waits again; a victim that ended meanwhile
        left its slot idle for it all the same."""
        parking = done.parking
        preempt, victim = parking.preempt, parking.victim
        if self._runs.parking.pop(preempt.victim, None) is None:
            return  # the victim ended meanwhile (`_End` requeued the ticket)
        if done.parked is None:
            if self._park_again(parking):
                return
            self._runs.refused_parks[preempt.victim] = victim.generated
            self._requeue_urgent(parking, now)
            return
        # The park is a figure of its own; the urgent request's start (and so its first
        # token's start overhead) is counted from now, when its slot is free.
        bound = None if parking.step_s is None else done.parked.copy_s + parking.step_s
        self.measurements.record_park(
            preempt.replica, seconds=now - parking.asked_at, bound_s=bound
        )
        ticket = victim.ticket
        self._runs.running.pop(ticket.id, None)
        self._runs.parked[ticket.id] = victim
        victim.parked_at = now
        if victim.first_token_at is None:
            victim.wait_forecast_s = None  # its first token will count the park too
        self._runs.parked_bytes[ticket.id] = done.parked.parked_bytes
        if done.parked.parked_bytes and done.parked.tokens:
            self._runs.kv_bytes_per_token = -(-done.parked.parked_bytes // done.parked.tokens)
        expected = self.measurements.output_tokens(ticket.max_tokens, policy=ticket.policy.name)
        left = max(0, expected - victim.generated)
        self._queue.requeue(ticket, now=now, resume=admission.Resume(preempt.replica, left))
        metrics.PREEMPTIONS.labels(self.lane, ticket.policy.name).inc()
        log.info(
            "admission.preempted",
            request_id=victim.request_id,
            lane=self.lane,
            replica=preempt.replica,
            parked_bytes=done.parked.parked_bytes,
            park_ms=round((now - parking.asked_at) * 1000, 1),
            copy_ms=round(done.parked.copy_s * 1000, 1),
            for_policy=preempt.ticket.policy.name,
            # The factor the decision to park read the forecast's wait by.
            lateness=round(self.measurements.lateness, 3),
        )
        start = admission.Dispatch(
            preempt.ticket,
            preempt.replica,
            queue_s=preempt.queue_s,
            prefill_s=preempt.prefill_s,
        )
        self._start(start, now, preempting=True)

    def _requeue_urgent(self, parking: runs.Parking, now: float) -> None:
        """The ticket a park was for waits again, unless its caller has left."""
        if self._caller_waits(parking):
            self._queue.requeue(parking.preempt.ticket, now=now)

    def _resume(self, decision: admission.Dispatch) -> None:
        """Have the engine resume a parked generation in the slot admission gave it;
        its relay's stream goes on by itself. The call runs beside the queue: it waits
        for the engine to free that slot, which must not hold up the Lane."""
        run = self._runs.parked.pop(decision.ticket.id, None)
        if run is None:
            return  # it ended while parked
        self._runs.running[decision.ticket.id] = run
        self._runs.parked_bytes.pop(decision.ticket.id, None)
        if run.parked_at is not None:
            if run.first_token_at is not None:
                run.parked_s += self._clock() - max(run.parked_at, run.first_token_at)
            run.parked_at = None

        run.resuming = True

        async def resume() -> None:
            try:
                resumed = await self._parker.resume(run.replica, run.request_id)
                if not resumed and not run.ended:
                    # The engine lost it (restarted, or drained and resumed it itself):
                    # its stream ends one way or the other, and `end` takes the run out.
                    # Not when its caller left while the Resume was on its way: the
                    # engine dropped it on the cancel, and nothing was lost.
                    log.warning("admission.resume_lost", request_id=run.request_id, lane=self.lane)
            finally:
                self._tell(Resumed(run))

        self._call(resume(), name=f"resume:{run.request_id}")
