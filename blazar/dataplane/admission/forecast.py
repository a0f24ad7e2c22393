"""The forecast: one simulation of a Lane's slots from `now`, in ticket order, that
every admission decision reads (see the package docstring)."""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from blazar.api import prefill as prefill_order
from blazar.dataplane.admission.terms import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    RETRY_AFTER_UNKNOWN_S,
    Key,
    LaneView,
    Policy,
    Reason,
    Refuse,
    ReplicaView,
    Resume,
    Running,
    Ticket,
    TokenRate,
)

# Decode steps a wait's first token may come later than forecast beside its lateness:
# the engine moves in whole steps, and a wait meets two of their ends, that of the
# step in which the slot it waits for frees and that of the step in which its prompt's
# last chunk runs, where the forecast's times are continuous.
WAIT_STEPS = 2

# How many times its target a prompt's own quickest prefill must take for a refusal to
# say that no wait helps. The figure is a moving average of runs that vary by a third
# on a loaded host: a prompt nearer its target may meet it on a good run, so it gets
# the usual hint, and on a drained Lane it starts at once (a free slot is never
# refused on a prediction).
NO_WAIT_HELPS_FACTOR = 1.5


@dataclass(frozen=True)
class Waiting:
    ticket: Ticket
    # When this stint of waiting began (its arrival, or when it was requeued).
    since: float
    resume: Resume | None = None
    # Started before (requeued): its tenant's share was charged then.
    charged: bool = False

    def waited(self, now: float) -> float:
        return self.ticket.waited_s + max(0.0, now - self.since)

    def timed_out(self, now: float, *, starts_now: bool) -> bool:
        """At its bound a fresh ticket may still start, but not wait on. A parked
        generation has no bound: it has started (its stream is open, and nothing it was
        sent is taken back), so it waits to resume until its caller leaves."""
        bound = self.ticket.policy.max_queue_wait_s
        if bound is None or self.resume is not None:
            return False
        waited = self.waited(now)
        return waited > bound or (waited >= bound and not starts_now)


@dataclass(frozen=True)
class Fate:
    """What the forecast says of one waiting ticket. For a refused one, where it would
    have gone: it takes no slot in the forecast."""

    # Seconds from now until it starts; None when no replica it may use serves.
    start_s: float | None = None
    # Seconds from its arrival to its first token; None for a parked generation.
    ttft_s: float | None = None
    # Seconds its prefill waits, once started, behind the prompts started before it on
    # its replica (the replica's prefill line), then the seconds of its own prefill.
    queue_s: float = 0.0
    prefill_s: float = 0.0
    # Its prefill is that of a prompt alone on its replica (it starts now on an idle
    # one, the first there in this forecast).
    alone: bool = False
    replica: int | None = None
    # Starts now on an idle slot: `dispatch` starts it (unless refused).
    idle: bool = False
    # Starts now in this request's slot once it is parked: `preemption` says so (unless
    # refused).
    victim: Running | None = None
    refuse: Reason | None = None
    # How much later than `first_token_s` its first token may come: `WAIT_STEPS`
    # decode steps at its replica's batch when it starts in a busy slot (it waits, or
    # starts once a victim is parked); 0 on an idle slot, and for a parked generation.
    margin_s: float = 0.0
    # Seconds its prompt's prefill takes at its quickest: alone, on the replica it may
    # use that does it soonest (`ReplicaView.lone_prefill_s`); None for a parked
    # generation, and until every such replica has measured a prefill alone.
    best_prefill_s: float | None = None

    @property
    def starts_now(self) -> bool:
        return self.idle or self.victim is not None

    @property
    def first_token_s(self) -> float | None:
        """Seconds from now until its first token; None when it has no start."""
        if self.start_s is None:
            return None
        return self.start_s + self.queue_s + self.prefill_s


def refusal(entry: Waiting, fate: Fate, now: float, *, margin: bool = False) -> Refuse:
    """The refusal of `entry` that `fate.refuse` says; `margin`: of a fresh ticket whose
    first token may come past its deadline (`misses_target`), predicted that late."""
    ticket = entry.ticket
    if fate.refuse == Reason.DEADLINE_EXCEEDED:
        # Its caller's deadline passed (no prediction to tell), or the forecast puts its
        # first token after it. No retry hint: the caller chose the deadline.
        passed = now >= ticket.caller_deadline
        return Refuse(
            ticket,
            Reason.DEADLINE_EXCEEDED,
            clamp(fate.start_s),
            waited_s=entry.waited(now),
            predicted_ttft_s=None if passed else fate.ttft_s,
        )
    if fate.refuse == Reason.QUEUE_TIMEOUT:
        return Refuse(
            ticket,
            Reason.QUEUE_TIMEOUT,
            clamp(fate.start_s),
            waited_s=entry.waited(now),
        )
    # SLO_UNATTAINABLE: a request like it meets the target once the work ahead has
    # drained by the amount it misses by; never, if its own prefill misses it even at
    # its quickest (alone on a quiet replica, which a drained Lane gives it): then no
    # hint. Only that measured figure, clearly past the target (`NO_WAIT_HELPS_FACTOR`),
    # says "never": a prompt whose prefill misses the target only beside other work,
    # only by `margin`, or only by the measurement's noise may meet it once the work
    # drains, and is told when that is.
    target = ticket.policy.ttft_target_s or 0.0
    retry: float | None = None
    predicted = fate.ttft_s
    if fate.first_token_s is not None:
        late = fate.margin_s if margin else 0.0
        retry = fate.first_token_s + late - target
        predicted = None if fate.ttft_s is None else fate.ttft_s + late
    else:
        predicted = max(0.0, now - ticket.arrived)
    best = fate.best_prefill_s
    if best is not None and best > target * NO_WAIT_HELPS_FACTOR and not ticket.restarted:
        return Refuse(
            ticket,
            Reason.SLO_UNATTAINABLE,
            None,
            waited_s=entry.waited(now),
            predicted_ttft_s=predicted,
            prefill_s=best,
        )
    return Refuse(
        ticket,
        Reason.SLO_UNATTAINABLE,
        clamp(retry),
        waited_s=entry.waited(now),
        predicted_ttft_s=predicted,
    )


def hinted_prompt_tokens(view: LaneView, policy: Policy) -> int | None:
    """The longest prompt (its tokens, none cached) whose SLO_UNATTAINABLE refusal
    under `policy` still carries a retry hint on `view`'s replicas: a longer one's own
    quickest prefill takes over `NO_WAIT_HELPS_FACTOR` times the target on every one,
    so `refusal` tells it that no wait helps. None when no bound is known (no target,
    no replica, or one whose prefill alone is not measured yet: `refusal` then hints)."""
    target = policy.ttft_target_s
    if target is None or not view.replicas:
        return None
    limit = target * NO_WAIT_HELPS_FACTOR
    longest = 0
    for replica in view.replicas:
        rate = replica.lone_prefill_tokens_per_s
        if rate is None:
            return None
        longest = max(longest, math.floor((limit - replica.lone_prefill_fixed_s) * rate))
    return longest


def key_of(ticket: Ticket, virtual_start: float) -> Key:
    return (-ticket.policy.priority, virtual_start, ticket.deadline, ticket.arrived, ticket.id)


def clamp(seconds: float | None) -> float:
    if seconds is None:
        return RETRY_AFTER_UNKNOWN_S
    return min(max(seconds, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)


def rejects_late(entry: Waiting) -> bool:
    """Refused when predicted to miss its deadline: a fresh ticket under onOverload:
    reject with a TTFT target. A parked generation has started: nothing refuses it
    (`Waiting.timed_out`)."""
    return (
        entry.resume is None
        and entry.ticket.policy.reject_early
        and entry.ticket.deadline < math.inf
    )


def misses_target(entry: Waiting, fate: Fate, now: float, *, margin: bool = False) -> bool:
    """Whether the forecast says a fresh ticket misses its TTFT target, whatever its
    policy's onOverload (spillover asks under both). Not one that takes an idle slot
    before its deadline (it starts at once, at its best), nor one nothing forecasts
    (no replica serves). The unscaled forecast, as for refusals: a spilled ticket
    leaves this Lane, which takes more than a guess (see `_fate`). With `margin`, a
    first token up to `fate.margin_s` later misses it too (see `LaneQueue.arrive`)."""
    ticket = entry.ticket
    if entry.resume is not None or ticket.deadline == math.inf:
        return False
    if fate.refuse == Reason.SLO_UNATTAINABLE or now >= ticket.deadline:
        return True
    if fate.idle or fate.first_token_s is None:
        return False
    late = fate.margin_s if margin else 0.0
    return now + fate.first_token_s + late > ticket.deadline


# Whether a forecast can decide anything: each of `LaneQueue.dispatch`, `preemption` and
# `expire` forecasts every waiting ticket (tens of milliseconds behind a thousand), and
# the Lane's loop decides on every event. Each answers for what `_fate` does: False only
# where no fate can be of that kind, whatever the forecast says.


def may_start(view: LaneView) -> bool:
    """Whether a waiting ticket may start now: only an idle slot starts one (`Fate.idle`),
    and a replica has one while fewer requests run there than it has slots."""
    return any(len(replica.running) < replica.slots for replica in view.replicas)


def may_preempt(entry: Waiting, view: LaneView, *, now: float) -> bool:
    """Whether `entry` may park work (`Fate.victim`): it is fresh, its deadline is ahead
    (nothing else may miss one), so is its caller's, and a replica runs work it may park."""
    ticket = entry.ticket
    if entry.resume is not None or not now <= ticket.deadline < math.inf:
        return False
    if now >= ticket.caller_deadline:
        return False
    return any(replica.parks_for(ticket.policy.priority) for replica in view.replicas)


def may_refuse(entry: Waiting, now: float) -> bool:
    """Whether the forecast may refuse `entry` (`Fate.refuse`): it is refused when
    predicted late (`rejects_late`), it has waited its bound (`Waiting.timed_out`), or
    it is fresh and its caller's deadline has passed."""
    if entry.resume is not None:
        return False
    bound = entry.ticket.policy.max_queue_wait_s
    return (
        rejects_late(entry)
        or (bound is not None and entry.waited(now) >= bound)
        or now >= entry.ticket.caller_deadline
    )


def past_caller_deadline(entry: Waiting, fate: Fate, now: float) -> Refuse | None:
    """The DEADLINE_EXCEEDED refusal of a fresh ticket that would wait (for a busy slot,
    or a park) and whose first token the forecast puts after its caller's deadline: the
    caller would be gone before it, and the wait would hold its place and maybe park
    work for nothing. None otherwise; also for one that takes an idle slot (it starts
    at once, at its best, as `_fate` says of targets) and one nothing forecasts (no
    replica serves: it waits until its deadline). The unscaled forecast, as for every
    refusal."""
    ticket = entry.ticket
    if entry.resume is not None or fate.idle or fate.first_token_s is None:
        return None
    if now + fate.first_token_s <= ticket.caller_deadline:
        return None
    return refusal(entry, replace(fate, refuse=Reason.DEADLINE_EXCEEDED), now)


@dataclass
class _Slot:
    replica: ReplicaView
    position: int
    # Seconds from now until it is free for the next ticket.
    free_at: float
    # Free now and not yet taken in this forecast.
    idle: bool
    # The running request holding it, until the forecast gives the slot to a ticket:
    # one that a more urgent ticket may park.
    holder: Running | None
    # The policy whose request holds it (running, or given it by the forecast), counted
    # against that policy's maxSlotsPerReplica; None while idle.
    policy: str | None = None


@dataclass(frozen=True)
class _Victim:
    """A generation the forecast parked: it waits, pinned, at its priority."""

    running: Running
    replica: int

    @property
    def key(self) -> Key:
        # First inside its priority: it started before anything still waiting there.
        return (-self.running.priority, -math.inf, -math.inf, -math.inf, self.running.id)


def _batch(replica: ReplicaView, waiting: Sequence[Ticket]) -> int:
    """The sequences `replica` will decode together while the queue drains: what runs
    there and what waits, each policy's at most its maxSlotsPerReplica, at most its
    slots (and at least 1)."""
    count: Counter[str] = Counter()
    caps: dict[str, int | None] = {}
    for run in replica.running:
        count[run.policy] += 1
        caps.setdefault(run.policy, run.max_slots_per_replica)
    for ticket in waiting:
        count[ticket.policy.name] += 1
        caps[ticket.policy.name] = ticket.policy.max_slots_per_replica
    total = sum(n if (cap := caps[p]) is None else min(n, cap) for p, n in count.items())
    return max(1, min(replica.slots, total))


def _prefilling(replica: ReplicaView) -> list[tuple[float, float, bool]]:
    """The prefill line of `replica` as its runs hold it now: they prefill one after
    another, so it is busy until the last one's first token, and for a short prompt
    (`api.prefill`) until the last short one's."""
    line = []
    for short in (False, True):
        runs = (r for r in replica.running if prefill_order.short(r.kv_tokens) == short)
        if (left := max((r.prefill_left_s for r in runs), default=0.0)) > 0:
            line.append((0.0, left, short))
    return sorted(line)


class _Simulation:
    """The Lane's slots as the forecast hands them out."""

    def __init__(self, view: LaneView, now: float, *, waiting: Sequence[Ticket]) -> None:
        self.now = now
        self.lateness = view.lateness
        self.fitting = view.fitting
        self.output_tokens = view.output_tokens
        self.rates = view.rates
        self.replicas = view.replicas
        self.slots: list[_Slot] = []
        self.load: dict[int, int] = {}
        self.parked: dict[int, int] = {}
        self.batch: dict[int, int] = {}
        # Slots each policy holds on each replica, by (replica index, policy name): as
        # the forecast hands them out (`held`: a slot counts for the policy that took it
        # last, until another takes it), and now (`holding`: running now, started now
        # on an idle slot or a victim's, less the victims parked now). A start now is
        # capped by what runs now, not by slots the forecast hands out later.
        self.held: Counter[tuple[int, str]] = Counter()
        self.holding: Counter[tuple[int, str]] = Counter()
        # By replica index, its prefill line: when (seconds from now) the prompts
        # given to it are prefilled, (start, first token, short) each, in time order;
        # a short prompt (`api.prefill`) waits only behind short ones.
        self.line: dict[int, list[tuple[float, float, bool]]] = {}
        # By replica index, whether nothing runs there and the forecast has given it
        # nothing yet: a prompt started there now has its steps to itself.
        self.quiet: dict[int, bool] = {}
        for replica in view.replicas:
            self.quiet[replica.index] = not replica.running
            self.load[replica.index] = len(replica.running)
            self.parked[replica.index] = replica.parked_bytes
            self.batch[replica.index] = _batch(replica, waiting)
            self.line[replica.index] = _prefilling(replica)
            for position, run in enumerate(replica.running):
                decode = self.decode_s(replica, run.tokens_left, run.rate)
                free_at = run.prefill_left_s + decode
                self.slots.append(
                    _Slot(replica, position, free_at, idle=False, holder=run, policy=run.policy)
                )
                self.held[(replica.index, run.policy)] += 1
                self.holding[(replica.index, run.policy)] += 1
            for position in range(len(replica.running), replica.slots):
                self.slots.append(_Slot(replica, position, 0.0, idle=True, holder=None))

    def best_prefill_s(self, ticket: Ticket, within: Collection[int] | None) -> float | None:
        """`Fate.best_prefill_s` of a fresh `ticket` that may start on the replicas
        `within` (None: any)."""
        best: float | None = None
        for replica in self.replicas:
            if within is not None and replica.index not in within:
                continue
            lone = replica.lone_prefill_s(ticket.fresh_tokens(replica.index))
            if lone is None:
                return None
            best = lone if best is None else min(best, lone)
        return best

    def preempting_start_s(self, replica: ReplicaView) -> float:
        """When a request that parks a generation on `replica` starts, from now: once
        the park is done (`park_s`, measured), and a decode step later, since the engine
        parks between two steps and goes on with the next before the request reaches
        it."""
        return replica.park_s + self.steps_s(replica, 1)

    def steps_s(self, replica: ReplicaView, steps: int) -> float:
        """`steps` decode steps on `replica` at the batch it will run while this queue
        drains (none before a step was measured)."""
        return steps * (replica.step_of(self.batch[replica.index]) or 0.0)

    def decode_s(self, replica: ReplicaView, tokens: int, rate: TokenRate | None = None) -> float:
        """Decode time on `replica` at the batch it will run while this queue drains,
        at `rate` when the request's policy has measured one."""
        return replica.decode_s(tokens, batch=self.batch[replica.index], rate=rate)

    def line_wait_s(
        self, replica: ReplicaView, start_s: float, prefill_s: float, *, short: bool = False
    ) -> float:
        """How long a prompt started on `replica` at `start_s`, taking `prefill_s`,
        waits for the other prompts on its prefill line: the engine prefills them one
        after another, a `short` one only after short ones (`api.prefill`). The line
        holds the last `hold_s` of its prefill; that hold goes in the first gap that
        holds it whole, from where it would begin unhindered (the forecast hands out
        slots in ticket order, not in time order, so a ticket later in the order may
        start before prompts given to the line already)."""
        hold = self.hold_s(replica, prefill_s)
        at = start_s + prefill_s - hold
        for begin, end, is_short in self.line[replica.index]:
            if end <= at or (short and not is_short):
                continue
            if begin >= at + hold:
                break
            at = end
        return at + hold - (start_s + prefill_s)

    def prefill_and_wait_s(
        self, replica: ReplicaView, ticket: Ticket, start_s: float, *, alone: bool = False
    ) -> tuple[float, float]:
        """A start of `ticket` on `replica` at `start_s`: its prefill, of the tokens that
        replica's cache lacks (`Ticket.fresh_tokens`), and its wait on the replica's
        prefill line (`line_wait_s`, as short as those tokens are)."""
        fresh = ticket.fresh_tokens(replica.index)
        prefill = replica.prefill_s(fresh, alone=alone)
        wait = self.line_wait_s(replica, start_s, prefill, short=prefill_order.short(fresh))
        return prefill, wait

    @staticmethod
    def hold_s(replica: ReplicaView, prefill_s: float) -> float:
        """The part of a prefill of `prefill_s` that the replica's line holds alone."""
        return prefill_s * min(max(replica.line_share, 0.0), 1.0)

    def prefill(
        self, replica: ReplicaView, *, prefill_s: float, first_token_s: float, short: bool
    ) -> None:
        """A prompt on `replica` whose prefill takes `prefill_s` holds its prefill line
        for the last `hold_s` of it, up to its first token."""
        hold = self.hold_s(replica, prefill_s)
        if hold > 0:
            bisect.insort(self.line[replica.index], (first_token_s - hold, first_token_s, short))

    def allows(self, slot: _Slot, *, policy: str, cap: int | None) -> bool:
        """Whether a request of `policy`, capped at `cap` slots a replica, may take
        `slot`: on a replica where the policy holds fewer than `cap`, any slot; at its
        cap, only one the policy holds there itself (when that request ends), as if no
        other slot were free there. An idle slot starts it now: what counts then is
        what the policy holds now. A policy at its cap holds at least one slot there
        (cap >= 1), so a ticket pinned to a replica always has one to wait for."""
        if cap is None or slot.policy == policy:
            return True
        if slot.idle:
            return self.holding[(slot.replica.index, policy)] < cap
        return self.held[(slot.replica.index, policy)] < cap

    def slot_for(
        self,
        *,
        pinned: int | None,
        prefer: int | None,
        policy: str,
        cap: int | None,
        within: Collection[int] | None = None,
    ) -> _Slot | None:
        """The slot that frees first among those a request of `policy` may take
        (`allows`) on the replicas `within` (None: any; `LaneView.fitting`): an idle
        one, then on `prefer`, then on the least loaded replica, then the lowest index.
        None when no slot may take it."""

        def rank(slot: _Slot) -> tuple[float, bool, bool, int, int, int]:
            index = slot.replica.index
            return (
                slot.free_at,
                not slot.idle,
                index != prefer,
                self.load[index],
                index,
                slot.position,
            )

        candidates = [
            s
            for s in self.slots
            if (pinned is None or s.replica.index == pinned)
            and (within is None or s.replica.index in within)
            and self.allows(s, policy=policy, cap=cap)
        ]
        return min(candidates, key=rank, default=None)

    def victim_for(
        self, ticket: Ticket, *, waiting_s: float, within: Collection[int] | None = None
    ) -> _Slot | None:
        """The slot of the running request of lower priority cheapest to park, among
        those whose parking fits the replica's bound and lets `ticket` meet its deadline,
        with its first token sooner than the `waiting_s` that waiting gives it, and its
        expected output (`LaneView.output_tokens`) done by its caller's deadline: work
        is not parked for a request whose caller will be gone before it ends. Not on
        a replica where the ticket's policy holds its maxSlotsPerReplica already:
        parking work there would take it past its cap. Only on the replicas `within`
        (None: any), those whose context holds it."""
        options = []
        policy = ticket.policy
        for slot in self.slots:
            run, replica = slot.holder, slot.replica
            if run is None or not replica.may_park(run, priority=policy.priority):
                continue
            if within is not None and replica.index not in within:
                continue
            cap = policy.max_slots_per_replica
            if cap is not None and self.holding[(replica.index, policy.name)] >= cap:
                continue
            cost = run.kv_tokens * replica.kv_bytes_per_token
            fits = self.parked[replica.index] + cost <= replica.parked_bytes_max
            start = self.preempting_start_s(replica)
            prefill, wait = self.prefill_and_wait_s(replica, ticket, start)
            first_token = start + wait + prefill
            meets = self.now + first_token <= ticket.deadline and first_token < waiting_s
            if meets and ticket.caller_deadline < math.inf:
                decode = self.decode_s(
                    replica, self.output_tokens(ticket), self.rates.get(policy.name)
                )
                meets = self.now + first_token + decode <= ticket.caller_deadline
            if fits and meets:
                options.append(((run.kv_tokens, run.priority, replica.index, run.id), slot))
        if not options:
            return None
        return min(options, key=lambda option: option[0])[1]

    def take(
        self, slot: _Slot, *, start_s: float, service_s: float, policy: str, now: bool
    ) -> None:
        """A request of `policy` holds `slot` from `start_s` for `service_s`; the
        slot's previous policy holds one slot fewer there from then on. `now`: it
        starts now (an idle slot, or a victim's, which is parked now)."""
        index = slot.replica.index
        self.quiet[index] = False
        if slot.idle:
            self.load[index] += 1
        if slot.policy is not None:
            self.held[(index, slot.policy)] -= 1
        self.held[(index, policy)] += 1
        if now:
            self.holding[(index, policy)] += 1
            if slot.holder is not None:
                self.holding[(index, slot.holder.policy)] -= 1
        slot.policy = policy
        slot.free_at = start_s + service_s
        slot.idle = False
        slot.holder = None

    def park(self, slot: _Slot) -> _Victim:
        assert slot.holder is not None
        replica = slot.replica
        self.parked[replica.index] += slot.holder.kv_tokens * replica.kv_bytes_per_token
        return _Victim(slot.holder, replica.index)


def _fate(entry: Waiting, sim: _Simulation, now: float) -> tuple[Fate, _Slot | None]:
    """Where the forecast puts one waiting ticket, and the slot it takes (its `victim`'s
    when it preempts); `refuse` set when it is to be taken out instead.

    Two readings of one forecast. Preemption reads it as late as first tokens after a
    wait have measured (its wait and prefill times `sim.lateness`, and `WAIT_STEPS`
    decode steps later still): a ticket that may
    miss its deadline by waiting parks lower-priority work, which costs the victim a
    pause and no token, and waiting on a forecast that runs early costs the ticket its
    target. Refusal and the prediction read it unscaled: a refusal is final for the
    caller, so it is made only on the forecast's own best estimate, never on a
    pessimistic one, and the prediction callers see stays that estimate."""
    ticket = entry.ticket
    pinned = entry.resume.replica if entry.resume else None
    # A parked generation resumes where its cache is; a fresh ticket only where its
    # context fits (a `contextPerSlot` rollout's old replica may hold less).
    within = None if entry.resume else sim.fitting(ticket)
    slot = sim.slot_for(
        pinned=pinned,
        prefer=ticket.prefer,
        policy=ticket.policy.name,
        cap=ticket.policy.max_slots_per_replica,
        within=within,
    )
    victim: Running | None = None
    fate = Fate()
    if slot is not None:
        start = slot.free_at
        # A resume has no prompt to prefill: it neither waits in the line nor holds it.
        queue, prefill = 0.0, 0.0
        alone = slot.idle and sim.quiet[slot.replica.index] and entry.resume is None
        if entry.resume is None:
            prefill, queue = sim.prefill_and_wait_s(slot.replica, ticket, start, alone=alone)
        margin = 0.0 if slot.idle or entry.resume else sim.steps_s(slot.replica, WAIT_STEPS)
        may_miss = now + (start + queue + prefill) * sim.lateness + margin > ticket.deadline
        if may_miss and not slot.idle and entry.resume is None:
            parked = sim.victim_for(ticket, waiting_s=start + queue + prefill, within=within)
            if parked is not None:
                slot, victim = parked, parked.holder
                start = sim.preempting_start_s(parked.replica)
                margin = sim.steps_s(slot.replica, WAIT_STEPS)
                prefill, queue = sim.prefill_and_wait_s(slot.replica, ticket, start)
        first_token = start + queue + prefill
        fate = Fate(
            start_s=start,
            ttft_s=None if entry.resume else max(0.0, now - ticket.arrived) + first_token,
            queue_s=queue,
            prefill_s=prefill,
            alone=alone,
            replica=slot.replica.index,
            idle=slot.idle,
            victim=victim,
            margin_s=margin,
            best_prefill_s=None if entry.resume else sim.best_prefill_s(ticket, within),
        )
    if entry.resume is None and now >= ticket.caller_deadline:
        # Its caller is gone, or leaving now: it starts nowhere, idle slot or not. (A
        # parked generation's caller ends its stream as it leaves, which takes it out.)
        return replace(fate, refuse=Reason.DEADLINE_EXCEEDED), None
    if entry.timed_out(now, starts_now=fate.starts_now):
        return replace(fate, refuse=Reason.QUEUE_TIMEOUT), None
    # A ticket that takes an idle slot starts now, at its best: refusing it on a
    # prediction would shed no load, a retry would fare no better, and only runs correct
    # the figures the forecast reads (inflated by one slow request, they would otherwise
    # refuse every request of the policy on an idle Lane, for ever). One already past
    # its deadline has missed it, idle slot or not.
    if rejects_late(entry) and (
        now >= ticket.deadline
        or (
            not fate.idle
            and fate.first_token_s is not None
            and now + fate.first_token_s > ticket.deadline
        )
    ):
        return replace(fate, refuse=Reason.SLO_UNATTAINABLE), None
    return fate, slot


def forecast(
    waiting: list[tuple[Key, Waiting]],
    *,
    now: float,
    view: LaneView,
    until: Collection[str] | None = None,
) -> dict[str, Fate]:
    """Every waiting ticket's fate, simulated in order (see the module docstring). With
    `until` (ticket ids), only up to the last of those in order: a ticket's fate depends
    on nothing after it, and a probe or an arrival of high priority is forecast in the
    few steps ahead of it, not behind every batch job waiting after it."""
    sim = _Simulation(view, now, waiting=[entry.ticket for _, entry in waiting])
    fates: dict[str, Fate] = {}
    pending = None if until is None else set(until)
    heap: list[tuple[Key, int, Waiting | _Victim]] = [
        (key, seq, entry) for seq, (key, entry) in enumerate(waiting)
    ]
    heapq.heapify(heap)
    seq = len(heap)
    while heap:
        _, _, item = heapq.heappop(heap)
        if isinstance(item, _Victim):
            running = item.running
            resumed = sim.slot_for(
                pinned=item.replica,
                prefer=None,
                policy=running.policy,
                cap=running.max_slots_per_replica,
            )
            # Its replica is in the view (it was parked there), and at its cap its
            # policy holds a slot there to wait for (`_Simulation.allows`).
            assert resumed is not None
            service = sim.decode_s(resumed.replica, running.tokens_left, running.rate)
            # Not now: it resumes once parked, which the forecast's parking is not yet.
            sim.take(
                resumed,
                start_s=resumed.free_at,
                service_s=service,
                policy=running.policy,
                now=False,
            )
            continue
        fate, slot = _fate(item, sim, now)
        fates[item.ticket.id] = fate
        if pending is not None:
            pending.discard(item.ticket.id)
            if not pending:
                break
        if slot is None or fate.start_s is None:
            continue
        if fate.victim is not None:
            victim = sim.park(slot)
            heapq.heappush(heap, (victim.key, seq, victim))
            seq += 1
        rate = view.rates.get(item.ticket.policy.name)
        if item.resume is not None:
            service = sim.decode_s(slot.replica, item.resume.tokens_left, rate)
        else:
            decode = sim.decode_s(slot.replica, view.output_tokens(item.ticket), rate)
            service = fate.queue_s + fate.prefill_s + decode
            sim.prefill(
                slot.replica,
                prefill_s=fate.prefill_s,
                first_token_s=fate.start_s + fate.queue_s + fate.prefill_s,
                short=prefill_order.short(item.ticket.fresh_tokens(slot.replica.index)),
            )
        sim.take(
            slot,
            start_s=fate.start_s,
            service_s=service,
            policy=item.ticket.policy.name,
            now=fate.starts_now,
        )
    return fates
