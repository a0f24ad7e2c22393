"""The fit ledger: which replicas the host's memory holds, and whether the next fits.

The one owner of what each running replica was estimated to need (recorded when the
Lane reconciler is allowed to start it). `place` reads the host's available memory
and the running replicas' resident memory (`hostmemory`), asks `fit.decide` for each
replica a plan would start, and drops the starts that do not fit. A start is counted
the moment it is allowed (pending until the supervisor has the process), so two Lanes
reconciled at once never both claim the same free memory, even while one of them
drains a replica before it starts the next.

With a memory budget (`serve --memory-budget`) a replica fits only within the budget
less what running replicas are charged (each the larger of its estimate and its
resident memory) as well as in the host's free memory. A replica that needs more than
the whole budget is `ExceedsMemoryBudget`, looked at again as rarely as one that needs
more than the host has.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from blazar.api.kinds import LaneMemory
from blazar.api.replicas import ReplicaState
from blazar.controller import fit, lane_plan
from blazar.controller.hostmemory import HostMemory
from blazar.controller.processes import Processes

# How soon a Lane that does not fit looks again: memory frees without any object
# changing (another program exits), so nothing else would wake it.
RETRY_S = 5.0
# ... and one that needs more than the host has in all: only a change to its spec (which
# wakes it at once) can help, so it looks again rarely.
NEVER_RETRY_S = 300.0


@dataclass(frozen=True)
class Placed:
    """A plan with the starts that fit, and the Lane's `Schedulable` word."""

    plan: lane_plan.LanePlan
    placement: lane_plan.Placement
    # The fit that failed, when one did.
    shortfall: fit.Fit | None = None


class Ledger:
    def __init__(
        self, *, processes: Processes, memory: HostMemory, budget: int | None = None
    ) -> None:
        """`budget`: bytes every replica together may hold (None: what the host has)."""
        self._processes = processes
        self._memory = memory
        self._budget = budget
        self._estimates: dict[tuple[str, int], int] = {}
        # Allowed to start, not yet observed as a process.
        self._pending: set[tuple[str, int]] = set()

    @property
    def budgeted(self) -> bool:
        """Whether a memory budget caps the replicas (`serve --memory-budget`)."""
        return self._budget is not None

    def place(
        self,
        lane: str,
        plan: lane_plan.LanePlan,
        estimate: fit.Estimate,
        *,
        preload: Collection[str] = (),
    ) -> Placed:
        """`plan` without the starts that do not fit, each allowed start counted at once.
        `preload`: the Lanes with `preload: true`, whose replicas nothing evicts.

        Stops stay: they only free memory. Once one start does not fit, none after it
        runs either, so replicas start in index order as memory frees.
        """
        # A Lane is never reconciled twice at once: what it left pending before is
        # started by now, or was not (an error), and is decided again here.
        self._pending = {key for key in self._pending if key[0] != lane}
        starts = {a.index for a in plan.actions if isinstance(a, lane_plan.Start)}
        available = self._memory.available()
        if available is None:
            return Placed(
                plan,
                lane_plan.Placement(
                    True,
                    "MemoryUnknown",
                    "The host's available memory cannot be read (/proc/meminfo); "
                    "replicas start unchecked.",
                ),
            )
        holding = self._holding(replacing={(lane, i) for i in starts})
        held = [h for _, h in holding]
        pinned = sum(h.charged for key, h in holding if key[0] in preload and key[0] != lane)
        total = self._memory.total()
        need = estimate.total
        actions: list[lane_plan.Action] = []
        shortfall: fit.Fit | None = None
        for action in plan.actions:
            if isinstance(action, lane_plan.Start):
                if shortfall is not None:
                    continue
                decision = fit.decide(
                    need,
                    available=available,
                    held=held,
                    total=total,
                    budget=self._budget,
                    pinned=pinned,
                )
                if not decision.fits:
                    shortfall = decision
                    continue
                held.append(fit.Held(estimate=need))
                self._estimates[(lane, action.index)] = need
                self._pending.add((lane, action.index))
            actions.append(action)
        free = fit.decide(0, available=available, held=held, budget=self._budget).free
        waiting = None
        if shortfall is not None:
            waiting = min(starts - {a.index for a in actions if isinstance(a, lane_plan.Start)})
        memory = LaneMemory(
            waiting_replica=waiting,
            estimate_bytes=need,
            weights_bytes=estimate.weights,
            kv_bytes=estimate.kv,
            compute_bytes=estimate.compute,
            draft_bytes=estimate.draft,
            runtime_bytes=estimate.runtime,
            free_bytes=shortfall.free if shortfall is not None else free,
            available_bytes=available,
            budget_bytes=self._budget,
            never_fits=shortfall is not None and shortfall.blocked,
        )
        if shortfall is not None:
            assert waiting is not None
            placement = lane_plan.Placement(
                False,
                fit.shortfall_reason(shortfall),
                fit.shortfall_message(shortfall, index=waiting),
                memory,
            )
            retry = NEVER_RETRY_S if shortfall.never else RETRY_S
            waits = [w for w in (plan.requeue_after, retry) if w is not None]
            return Placed(lane_plan.LanePlan(actions, min(waits)), placement, shortfall)
        placement = lane_plan.Placement(
            True, "MemoryFits", fit.fits_message(need, free=free), memory
        )
        return Placed(replace(plan, actions=actions), placement)

    def started(self, lane: str, index: int) -> None:
        """The supervisor holds the replica's process: it is observed from now on."""
        self._pending.discard((lane, index))

    def forget(self, lane: str, index: int) -> None:
        """A replica is stopped: it holds nothing any more."""
        self._estimates.pop((lane, index), None)
        self._pending.discard((lane, index))

    def charged(self, lane: str) -> int:
        """Bytes the Lane's running replicas are charged (what putting it to sleep frees)."""
        return sum(h.charged for key, h in self._holding(replacing=set()) if key[0] == lane)

    def _held(self, *, replacing: set[tuple[str, int]]) -> list[fit.Held]:
        return [held for _, held in self._holding(replacing=replacing)]

    def _holding(
        self, *, replacing: set[tuple[str, int]]
    ) -> list[tuple[tuple[str, int], fit.Held]]:
        """Every replica of every Lane that has a process or is about to, except those
        about to be replaced (a failed replica restarted holds nothing until then)."""
        held: list[tuple[tuple[str, int], fit.Held]] = []
        running: set[tuple[str, int]] = set()
        for lane in sorted(self._processes.lanes()):
            for obs in self._processes.observe(lane):
                key = (lane, obs.index)
                if key in replacing or obs.pid is None or obs.state == ReplicaState.FAILED:
                    continue  # no process: its memory is back in MemAvailable
                running.add(key)
                resident = self._memory.resident(obs.pid)
                if resident is None:  # unreadable: held at its estimate
                    held.append((key, fit.Held(self._estimates.get(key, 0))))
                    continue
                estimate = self._estimates.get(key, resident.total)
                held.append((key, fit.Held(estimate, resident.total, resident.anonymous)))
        # Allowed to start by another Lane's pass that has not spawned it yet (or is
        # replacing a failed process with it): held at its estimate.
        for key in sorted(self._pending - running - replacing):
            held.append((key, fit.Held(self._estimates.get(key, 0))))
        for key in set(self._estimates) - running - self._pending:
            del self._estimates[key]
        return held
