"""One Lane's waiting tickets and the decisions about them (see the package docstring)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from blazar.api import prefill as prefill_order
from blazar.dataplane.admission.forecast import (
    Fate,
    Waiting,
    clamp,
    forecast,
    key_of,
    may_preempt,
    may_refuse,
    may_start,
    misses_target,
    past_caller_deadline,
    refusal,
    rejects_late,
)
from blazar.dataplane.admission.terms import (
    Admit,
    Dispatch,
    Filling,
    Key,
    LaneView,
    Policy,
    Preempt,
    Reason,
    Refuse,
    Resume,
    Spill,
    Ticket,
)

# The probe `LaneQueue.gate` asks about: the smallest request there is. Its id sorts
# after any uuid hex, so among tickets arriving at the same instant it comes last.
PROBE_ID = "~probe"
# Requests supposed to arrive just before the probe (`gate`'s `ahead`): their ids sort
# before the probe's and after any uuid hex.
AHEAD_ID = "~ahead"
PROBE_PROMPT_TOKENS = 1
PROBE_MAX_TOKENS = 1
# Bounds of `LaneQueue.recheck_at`'s period: a decode step, but not so short that the
# Lane's loop forecasts without pause, nor so long that a drift goes unseen.
RECHECK_MIN_S = 0.02
RECHECK_MAX_S = 0.25
# The share of the Lane's loop those readings may take: a reading forecasts every
# waiting ticket (tens of milliseconds behind a thousand queued), and the loop is the
# daemon's, which also serves HTTP and relays every stream.
RECHECK_BUSY_SHARE = 0.2


def _ahead(
    policy: Policy,
    now: float,
    count: int,
    max_tokens: int,
    *,
    prompt: int = PROBE_PROMPT_TOKENS,
) -> dict[str, Waiting]:
    """`count` fresh requests of `policy` (`prompt` tokens each) arriving now, by id."""
    tickets = (
        Ticket(
            id=f"{AHEAD_ID}{j:06d}",
            policy=policy,
            arrived=now,
            prompt_tokens=prompt,
            max_tokens=max_tokens,
        )
        for j in range(count)
    )
    return {t.id: Waiting(t, since=now) for t in tickets}


def _missed(entry: Waiting, fate: Fate, now: float) -> Refuse | None:
    """The SLO_UNATTAINABLE refusal of a fresh ticket whose first token may come past its
    deadline (`misses_target`): predicted as forecast when that misses it, else as late
    as its margin; None when it meets it."""
    for margin in (False, True):
        if misses_target(entry, fate, now, margin=margin):
            return refusal(entry, replace(fate, refuse=Reason.SLO_UNATTAINABLE), now, margin=margin)
    return None


def _least(
    refused: Callable[[int], Refuse | None], low: int, high: int, found: Refuse
) -> tuple[int, Refuse]:
    """The least n in [low, high] that `refused` refuses, with its refusal, by bisection:
    it refuses `high` (`found`), and every n above one it refuses."""
    while low < high:
        mid = (low + high) // 2
        at = refused(mid)
        if at is None:
            low = mid + 1
        else:
            high, found = mid, at
    return high, found


class LaneQueue:
    """The tickets waiting on one Lane, and the decisions about them."""

    def __init__(self) -> None:
        self._waiting: dict[str, Waiting] = {}
        # Fair share, per priority: the virtual clock, and each tenant's virtual finish.
        self._clock: dict[int, float] = {}
        self._finish: dict[tuple[int, str], float] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, ticket_id: object) -> bool:
        return ticket_id in self._waiting

    def tickets(self) -> list[Ticket]:
        """The waiting tickets, in order."""
        return [w.ticket for _, w in self._ordered()]

    def depth(self, policy: str) -> int:
        """Tickets of the policy named `policy` waiting, parked generations included."""
        return sum(1 for w in self._waiting.values() if w.ticket.policy.name == policy)

    def arrive(
        self, ticket: Ticket, *, now: float, view: LaneView, spill: bool = False
    ) -> Admit | Refuse | Spill:
        """Queue `ticket` or refuse it at once. An admitted ticket that can start now is
        started by the next `dispatch`, the one place where tickets start. With `spill`
        (the Lane names a spillover Lane that exists), a fresh ticket predicted to miss
        its target is handed back as `Spill`, not queued; a ticket that spilled here
        is refused unless predicted to meet it (see the package docstring)."""
        if ticket.id in self._waiting:
            raise ValueError(f"ticket {ticket.id!r} is already waiting")
        entry = Waiting(ticket, since=ticket.arrived)
        decision = self._arrival(entry, now=now, view=view, spill=spill)
        if isinstance(decision, Admit):
            self._waiting[ticket.id] = entry
        return decision

    def gate(
        self,
        policy: Policy,
        *,
        now: float,
        view: LaneView,
        spill: bool = False,
        ahead: int = 0,
        ahead_max_tokens: int = PROBE_MAX_TOKENS,
        prompt: int = PROBE_PROMPT_TOKENS,
    ) -> Refuse | None:
        """What `arrive` would answer now a probe of `policy`: the smallest request
        (`PROBE_PROMPT_TOKENS` prompt token, `PROBE_MAX_TOKENS` to generate; no tenant,
        no session, arriving now, after every waiting ticket of its tier), if it
        refuses it; None when it would admit or spill it. Nothing changes.

        A refused probe means every fresh request of `policy` (no tenant, no session)
        is refused until something changes: the probe takes the same place in the
        order as any such request (after the tickets waiting now), the slot it may take
        does not depend on its size (so QUEUE_FULL, which depends only on the depth and
        on an idle slot, refuses both), and a larger prompt only delays its own first
        token (so SLO_UNATTAINABLE, a first token past the deadline also when preempting,
        refuses the larger one too). What it generates decides nothing about its own
        first token. With `spill` (the Lane names a spillover Lane), None for a policy
        with a TTFT target: a request that misses it is offered to the spillover Lane,
        and a request larger than the probe may miss it where the probe would not (a
        QUEUE_FULL probe that meets its target is refused here; a larger one is
        offered there).

        With `ahead`, the probe comes after that many fresh requests of `policy`
        arriving before it (one prompt token, `ahead_max_tokens` to generate): only a
        SLO_UNATTAINABLE refusal counts then. It stands for any such requests that are
        larger (a longer prompt or max_tokens holds their slots longer), so a caller
        that has seen `ahead` requests of the policy with at least that max_tokens
        arrive, and none of another, may refuse the next (see `filling`).

        With `prompt`, the probe and the requests ahead have that many prompt tokens
        (all short, or all long, `api.prefill`): the refusal then stands for requests
        with at least that many, after requests with at least that many."""
        if spill and policy.ttft_target_s is not None:
            return None
        # The requests ahead start on the idle slots, not wait: in the forecast, not in
        # the probe's depth.
        extras = _ahead(policy, now, ahead, ahead_max_tokens, prompt=prompt).values()
        probe = Ticket(
            id=PROBE_ID,
            policy=policy,
            arrived=now,
            prompt_tokens=prompt,
            max_tokens=PROBE_MAX_TOKENS,
        )
        decision = self._arrival(
            Waiting(probe, since=now), now=now, view=view, spill=spill, ahead=tuple(extras)
        )
        if not isinstance(decision, Refuse):
            return None
        if ahead and decision.reason != Reason.SLO_UNATTAINABLE:
            return None
        return decision

    def idle_for(self, policy: Policy, *, now: float, view: LaneView) -> int:
        """How many fresh requests of `policy`, arriving one after another now, would
        start on an idle slot (its cap and the tickets waiting ahead allowing)."""
        slots = sum(replica.slots for replica in view.replicas)
        if not slots:
            return 0
        extras = list(_ahead(policy, now, slots, PROBE_MAX_TOKENS).values())
        fates = forecast(
            self._ordered(*extras),
            now=now,
            view=view,
            until={entry.ticket.id for entry in extras},
        )
        idle = 0
        for entry in extras:
            if not fates[entry.ticket.id].idle:
                break
            idle += 1
        return idle

    def filling(
        self,
        policy: Policy,
        *,
        now: float,
        view: LaneView,
        max_tokens: int,
        spill: bool = False,
        hint: int | None = None,
        latest: tuple[int, int] | None = None,
    ) -> Filling | None:
        """While the gate of `policy` is open (`gate` refuses no probe): after how many
        more requests of it, and of what sizes, the next one is refused as
        SLO_UNATTAINABLE; None if not foreseen, or when the policy refuses nothing
        early.

        Two answers. On idle slots: after the `idle_for` requests that take them, each
        generating at least the least max_tokens (up to `max_tokens`) that fills them
        for long enough, whatever their prompts (a request on an idle slot is always
        admitted). Monotone in max_tokens, so found by bisection, or checked at `hint`
        (the answer found last) and just below it. When that closes nothing for
        requests like `latest` (the prompt tokens and max_tokens of the policy's latest
        request), an answer for such requests alone (`_like`): their prompts count, and
        so do the ones that may wait past the idle slots and still meet the target."""
        if not policy.reject_early or policy.ttft_target_s is None:
            return None
        idle = self.idle_for(policy, now=now, view=view)
        found = None
        if idle:
            found = self._on_idle(
                policy, now=now, view=view, idle=idle, max_tokens=max_tokens, spill=spill, hint=hint
            )
        if latest is not None and (found is None or found.max_tokens > latest[1]):
            like = self._like(policy, now=now, view=view, idle=idle, latest=latest, spill=spill)
            if like is not None:
                return like
        return found

    def _on_idle(
        self,
        policy: Policy,
        *,
        now: float,
        view: LaneView,
        idle: int,
        max_tokens: int,
        spill: bool,
        hint: int | None,
    ) -> Filling | None:
        """`filling`'s answer on the `idle` idle slots alone."""

        def refused(tokens: int) -> Refuse | None:
            return self.gate(
                policy, now=now, view=view, spill=spill, ahead=idle, ahead_max_tokens=tokens
            )

        if hint is not None and 1 <= hint <= max_tokens:
            at = refused(hint)
            if at is not None and (hint == 1 or refused(hint - 1) is None):
                return Filling(idle, hint, at)
        found = refused(max_tokens)
        if found is None:
            return None
        tokens, found = _least(refused, 1, max_tokens, found)
        return Filling(idle, tokens, found)

    def _like(
        self,
        policy: Policy,
        *,
        now: float,
        view: LaneView,
        idle: int,
        latest: tuple[int, int],
        spill: bool,
    ) -> Filling | None:
        """`filling`'s answer for requests like `latest`: exactly its max_tokens, and a
        short prompt of half to twice its own. After the `idle` such requests that
        take the idle slots, the least number of them waiting after those such that
        each one is admitted even were all of them the largest, and a request with
        the least prompt is refused after them even were they all the smallest.
        Requests in between fall between the two: a larger request ahead only delays
        the requests after it (a longer prompt holds its slot and the line of short
        prompts longer), so each is admitted, and the next one of at least the least
        prompt refused. Prompts stay short (`api.prefill`): a long one would leave the
        short prompts' line, and could delay the next less than a short one. None
        where a replica may park lower-priority work running on it: a larger request
        ahead is likelier to park it, which frees a slot sooner than waiting would.

        Bounded by the policy's queue depth: the waiting ones count against it, as do
        the idle ones when they come at once, before any starts, and the next is to be
        refused as SLO_UNATTAINABLE, not QUEUE_FULL. Both questions are monotone in the
        number waiting, so it is found by search, not by trying each number."""
        prompt_tokens, max_tokens = latest
        if spill or not prefill_order.short(prompt_tokens):
            return None
        if any(replica.parks_for(policy.priority) for replica in view.replicas):
            # Requests ahead may park lower-priority work, and a larger one is likelier
            # to (it may miss by waiting where a smaller one would not): its slot then
            # frees sooner than waiting would have, and the next request may be admitted
            # after larger requests where it is refused after smaller ones. Not monotone
            # in their sizes, so no answer for a band of them.
            return None
        least = max(1, prompt_tokens // 2)
        most = min(2 * prompt_tokens, prefill_order.SHORT_PROMPT_TOKENS)
        room = policy.max_queue_depth - self.depth(policy.name) - idle - 1

        def refused(waiting: int) -> Refuse | None:
            """A request of the least prompt after `idle` + `waiting` of the smallest."""
            return self.gate(
                policy,
                now=now,
                view=view,
                ahead=idle + waiting,
                ahead_max_tokens=max_tokens,
                prompt=least,
            )

        # The least number waiting that refuses it (more ahead only delays it): few,
        # mostly, so searched from none up, doubling, then halving the last step.
        if room < 0:
            return None
        low, high = 0, 0
        while (found := refused(high)) is None:
            if high >= room:
                return None
            low, high = high + 1, min(room, 2 * high + 1)
        high, found = _least(refused, low, high, found)
        if not idle + high:
            # Refused with none ahead, where a one-token prompt is not (`gate`): closed
            # now for such prompts only, which a gate message cannot say.
            return None
        if high:
            # The last of them admitted, were they all the largest: then so is each
            # one before it (fewer ahead), and each one of any size within them.
            largest = _ahead(policy, now, idle + high - 1, max_tokens, prompt=most)
            last = Ticket(
                id=PROBE_ID, policy=policy, arrived=now, prompt_tokens=most, max_tokens=max_tokens
            )
            decision = self._arrival(
                Waiting(last, since=now), now=now, view=view, spill=False,
                ahead=tuple(largest.values()),
            )  # fmt: skip
            if not isinstance(decision, Admit):
                return None
        return Filling(
            idle + high,
            max_tokens,
            found,
            most_max_tokens=max_tokens,
            least_prompt_tokens=least,
            most_prompt_tokens=most,
        )

    def _arrival(
        self,
        entry: Waiting,
        *,
        now: float,
        view: LaneView,
        spill: bool,
        ahead: tuple[Waiting, ...] = (),
    ) -> Admit | Refuse | Spill:
        """`arrive`'s decision for the fresh `entry`, which is not queued; `ahead`:
        fresh tickets forecast as if they waited too, not counted in its depth."""
        ticket = entry.ticket
        fate = forecast(self._ordered(*ahead, entry), now=now, view=view, until={ticket.id})[
            ticket.id
        ]
        policy = ticket.policy
        local: Admit | Refuse
        if not fate.idle and self.depth(policy.name) >= policy.max_queue_depth:
            local = Refuse(ticket, Reason.QUEUE_FULL, self._room_after(policy, now, view))
        elif fate.refuse is not None:
            local = refusal(entry, fate, now)
        elif rejects_late(entry) and (missed := _missed(entry, fate, now)) is not None:
            # Its first token may come a few steps past the deadline: refused now
            # rather than after a wait that may end in the same refusal.
            local = missed
        elif (late := past_caller_deadline(entry, fate, now)) is not None:
            # Its caller would be gone before its first token: refused before any work.
            local = late
        else:
            waits = fate.start_s is not None and not fate.starts_now
            local = Admit(fate.ttft_s, waits=waits)
        if ticket.spilled_from is not None:
            if isinstance(local, Admit) and fate.start_s is None:
                local = refusal(entry, replace(fate, refuse=Reason.SLO_UNATTAINABLE), now)
            elif isinstance(local, Admit) and (missed := _missed(entry, fate, now)) is not None:
                local = missed
        elif spill and misses_target(entry, fate, now, margin=True):
            return Spill(ticket, local)
        return local

    def requeue(self, ticket: Ticket, *, now: float, resume: Resume | None = None) -> None:
        """Put a started ticket back, as `Dispatch`/`Preempt` gave it: a generation
        parked on `resume.replica` (it waits for a slot there), or a start that failed
        (it waits for any). It comes first in its priority (it started before; see fair
        share) and its wait so far is kept; its depth is counted again, even over the
        bound."""
        if ticket.id in self._waiting:
            raise ValueError(f"ticket {ticket.id!r} is already waiting")
        self._waiting[ticket.id] = Waiting(ticket, since=now, resume=resume, charged=True)

    def cancel(self, ticket_id: str) -> bool:
        """Take out a ticket whose caller left; False when it was not waiting."""
        return self._waiting.pop(ticket_id, None) is not None

    def dispatch(self, *, now: float, view: LaneView) -> list[Dispatch]:
        """The tickets to start now, in order, each on a replica with an idle slot."""
        if not self._waiting or not may_start(view):
            return []
        ordered = self._ordered()
        fates = forecast(ordered, now=now, view=view)
        started = []
        for _, entry in ordered:
            fate = fates[entry.ticket.id]
            if fate.idle and fate.refuse is None and fate.replica is not None:
                del self._waiting[entry.ticket.id]
                self._charge(entry)
                ticket = replace(entry.ticket, waited_s=entry.waited(now))
                started.append(
                    Dispatch(
                        ticket,
                        fate.replica,
                        resume=entry.resume is not None,
                        queue_s=fate.queue_s,
                        prefill_s=fate.prefill_s,
                        alone=fate.alone,
                    )
                )
        return started

    def preemption(self, *, now: float, view: LaneView) -> Preempt | None:
        """The first ticket in order that would miss its deadline waiting for a slot held
        by lower-priority work, with the request to park for it (see the module's
        forecast); the ticket leaves the queue. None when no ticket needs one."""
        if not any(may_preempt(entry, view, now=now) for entry in self._waiting.values()):
            return None
        ordered = self._ordered()
        fates = forecast(ordered, now=now, view=view)
        for _, entry in ordered:
            fate = fates[entry.ticket.id]
            if fate.victim is not None and fate.refuse is None and fate.replica is not None:
                del self._waiting[entry.ticket.id]
                self._charge(entry)
                ticket = replace(entry.ticket, waited_s=entry.waited(now))
                return Preempt(
                    ticket,
                    victim=fate.victim.id,
                    replica=fate.replica,
                    queue_s=fate.queue_s,
                    prefill_s=fate.prefill_s,
                    start_s=fate.start_s or 0.0,
                )
        return None

    def expire(self, *, now: float, view: LaneView) -> list[Refuse]:
        """Take out and refuse, in order, the tickets past their wait bound and (under
        onOverload: reject) those that can no longer meet their TTFT target."""
        if not any(may_refuse(entry, now) for entry in self._waiting.values()):
            return []
        ordered = self._ordered()
        fates = forecast(ordered, now=now, view=view)
        refused = []
        for _, entry in ordered:
            fate = fates[entry.ticket.id]
            if fate.refuse is not None:
                del self._waiting[entry.ticket.id]
                refused.append(refusal(entry, fate, now))
        return refused

    def predict_ttft(self, ticket_id: str, *, now: float, view: LaneView) -> float | None:
        """Seconds from the ticket's arrival to its first token, as forecast now; None
        for a parked generation or when no replica serves. KeyError if not waiting."""
        entry = self._waiting[ticket_id]
        fates = forecast(self._ordered(), now=now, view=view, until={entry.ticket.id})
        return fates[entry.ticket.id].ttft_s

    def next_expiry(self) -> float | None:
        """When `expire` must run next though nothing else changes: the first time a
        fresh ticket reaches its wait bound, (under onOverload: reject) its deadline, or
        its caller's deadline (a parked generation has none: `Waiting.timed_out`)."""
        times = []
        for entry in self._waiting.values():
            if entry.resume is not None:
                continue
            if entry.ticket.caller_deadline < math.inf:
                times.append(entry.ticket.caller_deadline)
            bound = entry.ticket.policy.max_queue_wait_s
            if bound is not None:
                times.append(entry.since + bound - entry.ticket.waited_s)
            if rejects_late(entry):
                times.append(entry.ticket.deadline)
        return min(times, default=None)

    def recheck_at(self, *, now: float, view: LaneView, decide_s: float = 0.0) -> float | None:
        """When to read the forecast again though no event comes: while a fresh ticket
        with a deadline waits and a replica runs work it may park, one decode step from
        now there (at least `RECHECK_MIN_S`, at most `RECHECK_MAX_S`), and no sooner
        than the last reading, begun at `now` and `decide_s` long, leaves the Lane's
        loop free for all but `RECHECK_BUSY_SHARE` of its time.

        Its forecast counts on the running requests' pace, which moves between events
        (their tokens, `Running.tokens_left` and the rates read in flight): a forecast
        read only when a request arrives, starts or ends goes stale while they run
        slower than it said, and the ticket that was to wait in time is refused at its
        deadline instead of parking lower-priority work while a park could still meet
        it. Read each step, the drift shows within the preemption's margin (`_fate`:
        `WAIT_STEPS` steps)."""
        steps = []
        for entry in self._waiting.values():
            ticket = entry.ticket
            if now >= ticket.deadline or not may_preempt(entry, view, now=now):
                continue
            for replica in view.replicas:
                if replica.parks_for(ticket.policy.priority):
                    step = replica.step_of(len(replica.running))
                    steps.append(RECHECK_MAX_S if step is None else step)
        if not steps:
            return None
        period = min(RECHECK_MAX_S, max(RECHECK_MIN_S, min(steps)))
        return now + max(period, decide_s / RECHECK_BUSY_SHARE)

    def _ordered(self, *extra: Waiting) -> list[tuple[Key, Waiting]]:
        """The waiting tickets (and `extra`, as if they waited) with their keys, in order:
        each tenant's k-th fresh ticket of a tier starts at max(V, F) + (k-1) / weight."""
        entries = [*self._waiting.values(), *extra]
        by_tenant: dict[tuple[int, str], list[Waiting]] = defaultdict(list)
        keyed: list[tuple[Key, Waiting]] = []
        for entry in entries:
            ticket = entry.ticket
            if entry.charged:
                keyed.append((key_of(ticket, -math.inf), entry))
            else:
                by_tenant[(ticket.policy.priority, ticket.tenant)].append(entry)
        for (priority, tenant), mine in by_tenant.items():
            mine.sort(key=lambda w: (w.ticket.deadline, w.ticket.arrived, w.ticket.id))
            start = max(self._clock.get(priority, 0.0), self._finish.get((priority, tenant), 0.0))
            for k, entry in enumerate(mine):
                keyed.append((key_of(entry.ticket, start + k / entry.ticket.weight), entry))
        keyed.sort(key=lambda pair: pair[0])
        return keyed

    def _charge(self, entry: Waiting) -> None:
        """A fresh ticket starts: its tenant's virtual finish moves on by 1 / weight, and
        the tier's clock to the ticket's virtual start. Tenants the clock has passed are
        forgotten (max(V, F) is V for them)."""
        if entry.charged:
            return
        ticket = entry.ticket
        priority = ticket.policy.priority
        clock = self._clock.get(priority, 0.0)
        start = max(clock, self._finish.get((priority, ticket.tenant), 0.0))
        self._finish[(priority, ticket.tenant)] = start + 1.0 / ticket.weight
        self._clock[priority] = start
        self._finish = {k: f for k, f in self._finish.items() if k[0] != priority or f > start}

    def _room_after(self, policy: Policy, now: float, view: LaneView) -> float:
        """Until the first ticket of `policy` leaves the queue, started or refused."""
        fates = forecast(self._ordered(), now=now, view=view)
        times: list[float] = []
        for entry in self._waiting.values():
            if entry.ticket.policy.name != policy.name:
                continue
            fate = fates[entry.ticket.id]
            bound = entry.ticket.policy.max_queue_wait_s
            if fate.refuse is not None:
                times.append(0.0)
            if fate.start_s is not None:
                times.append(fate.start_s)
            if bound is not None:
                times.append(bound - entry.waited(now))
        return clamp(min(times, default=None))
