"""When a Lane sleeps, for the Lane reconciler: idle.sleepAfter, requests' keep_alive,
and the memory budget's evictions (`residency`).

`decide` is the Lane's sleep for this pass (`lane_plan.sleep_decision` on the data
plane's `Activity`, or asleep because the budget put it to sleep for another Lane);
`make_room` puts idle Lanes to sleep for a Lane a request waits for that does not fit
(`residency.choose`), with an `Evicted` event on each and a pass of each asked for;
`passed` asks the Lanes waiting for memory to look again when a pass may have freed
some. `preload: true` keeps a Lane awake through all of these.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import structlog

from blazar.api.kinds import Kind, Lane
from blazar.api.replicas import ReplicaObservation
from blazar.controller import fit, lane_plan, ledger, residency
from blazar.controller.ledger import Ledger
from blazar.controller.processes import Processes
from blazar.enginehost.activity import Activity
from blazar.store.base import Store

log = structlog.get_logger(__name__)


class Sleeper:
    def __init__(
        self,
        *,
        store: Store,
        processes: Processes,
        clock: Callable[[], datetime],
        activity: Activity | None,
        ledger: Ledger | None,
        min_residency_s: float = residency.DEFAULT_MIN_RESIDENCY_S,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        """`activity` None: no Lane ever sleeps; `ledger` None (no fit ledger): none is
        put to sleep for memory. `notify(lane)` asks for another pass of a Lane."""
        self._store = store
        self._processes = processes
        self._clock = clock
        self._activity = activity
        self._ledger = ledger
        self._notify = notify
        self._residency = residency.Residency(min_residency_s=min_residency_s)

    def decide(self, lane: Lane) -> lane_plan.Sleep:
        """Whether the Lane sleeps this pass, why, and when to look again."""
        name = lane.metadata.name
        # A Lane scaled to zero is paused, not asleep: no request wakes it (the data
        # plane refuses them), and its status says ScaledToZero.
        if self._activity is None or lane.spec.preload or lane.spec.replicas == 0:
            return lane_plan.Sleep()
        in_flight, wanted = self._activity.in_flight(name), self._activity.wanted(name)
        if wanted and (first := self._first_in_line(name)) is not None:
            return lane_plan.Sleep(
                asleep=True,
                recheck_after=ledger.RETRY_S,
                message=(
                    f"A request waits for the Lane, but the memory budget put it to sleep "
                    f'for Lane "{first}", whose request came first and which has not '
                    "started yet: it starts once that one has."
                ),
            )
        if wanted:
            self._residency.woken(name)
        evicted_for = self._residency.evicted_for(name)
        if evicted_for is not None and in_flight:
            # Used again before it could sleep: no longer the one to go. The Lane it
            # was to make room for looks again once this request ends (`passed`).
            self._residency.woken(name)
        elif evicted_for is not None:
            return lane_plan.Sleep(
                asleep=True,
                message=(
                    "The memory budget put the Lane to sleep to make room for Lane "
                    f'"{evicted_for}": no replica runs; the next request wakes it.'
                ),
            )
        keep = self._activity.keep(name)
        idle = lane.spec.idle
        return lane_plan.sleep_decision(
            sleep_after_s=idle.sleep_after_s if idle is not None else None,
            idle_s=self._activity.idle_s(name, age_s=self._age_s(lane)),
            in_flight=in_flight,
            wanted=wanted,
            keep_s=keep.remaining_s,
            keep_forever=keep.forever,
            release=keep.release,
        )

    def _age_s(self, lane: Lane) -> float | None:
        """Seconds since the Lane was created (None: not known)."""
        created = lane.metadata.creation_timestamp
        return None if created is None else (self._clock() - created).total_seconds()

    def _first_in_line(self, name: str) -> str | None:
        """The Lane that Lane `name` (stopped) was put to sleep for, while that one still
        waits for memory and has not started: Lanes waiting for memory start in the
        order their requests came, as Ollama serves pending loads, so `name`'s own
        request does not take back the memory it freed for the other."""
        first = self._residency.evicted_for(name)
        if (
            first is None
            or self._activity is None
            or self._residency.resident_since(name) is not None
            or self._residency.resident_since(first) is not None
        ):
            return None
        return first if self._residency.waits(first) and self._activity.wanted(first) else None

    def _next_in_line(self, name: str) -> None:
        """Lane `name` started, or no longer waits: ask the Lanes put to sleep for it
        whose requests wait behind it to look again."""
        if self._notify is None or self._activity is None:
            return
        for other in self._residency.evicted_for_lane(name):
            if self._activity.wanted(other):
                self._notify(other)

    def make_room(self, name: str, shortfall: fit.Fit | None) -> float | None:
        """When a request waits for Lane `name` and its replica does not fit
        (`shortfall`), put the least recently used idle Lanes to sleep until it does;
        the seconds until the decision should be made again, when none can go yet."""
        activity, ledger = self._activity, self._ledger
        waiting = (
            shortfall is not None
            and not shortfall.blocked
            and activity is not None
            and activity.wanted(name)
        )
        if self._residency.wait(name, waiting) and not waiting:
            self._next_in_line(name)
        if not waiting or activity is None or ledger is None or shortfall is None:
            return None
        candidates = []
        # Lanes already put to sleep for this one whose replicas have not stopped yet:
        # their memory is on its way, so a pass before their own one (this Lane's
        # requeue, another Lane's notify) must not choose more victims for it.
        freeing = 0
        for other in sorted(self._processes.lanes() - {name}):
            stored = self._store.get(Kind.LANE, other)
            evicted_for = self._residency.evicted_for(other)
            if evicted_for == name:
                freeing += ledger.charged(other)
            if not isinstance(stored, Lane) or evicted_for is not None:
                continue  # deleted (stopping anyway), or already on its way to sleep
            candidates.append(
                residency.Candidate(
                    lane=other,
                    held_bytes=ledger.charged(other),
                    resident_since=self._residency.resident_since(other),
                    idle_s=activity.idle_s(other, age_s=self._age_s(stored)),
                    in_flight=activity.in_flight(other),
                    wanted=activity.wanted(other),
                    preload=stored.spec.preload,
                )
            )
        eviction = residency.choose(
            shortfall=shortfall.need - shortfall.free - freeing,
            candidates=candidates,
            now=self._clock(),
            min_residency_s=self._residency.min_residency_s,
        )
        for victim in eviction.victims:
            self._residency.evict(victim, for_lane=name)
            freed = fit.human(ledger.charged(victim))
            log.info("lane.evict", lane=victim, for_lane=name)
            self._store.record_event(
                kind=Kind.LANE.value,
                name=victim,
                type="Normal",
                reason="Evicted",
                message=(
                    f'Put to sleep to make room for Lane "{name}", which a request waits '
                    f'for: it frees {freed}; Lane "{name}" needs {fit.human(shortfall.need)} '
                    f"and {fit.human(max(0, shortfall.free))} is free."
                ),
            )
            if self._notify is not None:
                self._notify(victim)
        return eviction.recheck_after

    def started(self, name: str) -> None:
        """A replica of the Lane is starting: it is resident from now (if it was not)."""
        self._residency.resident(name, self._clock())
        self._next_in_line(name)

    def passed(
        self, name: str, plan: lane_plan.LanePlan, observed: list[ReplicaObservation]
    ) -> None:
        """After a pass of Lane `name` that acted on `plan` and left `observed`: ask the
        Lanes waiting for memory to look again when it stopped a replica, or found the
        Lane idle (a request's end may have made it one to put to sleep)."""
        if not any(o.pid is not None for o in observed):
            self._residency.gone(name)
        waiting = self._residency.waiting()
        if self._notify is None or name in waiting:
            return
        stopped = any(isinstance(a, lane_plan.Stop) for a in plan.actions)
        idle = self._activity is not None and self._activity.in_flight(name) == 0
        if stopped or idle:
            for lane in waiting:
                self._notify(lane)

    def forget(self, name: str) -> None:
        """The Lane is deleted."""
        self._residency.forget(name)
