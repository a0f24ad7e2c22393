"""Admission for one Lane: which waiting request starts next and where, which one a
more urgent request may park, and which are refused.

No IO, no clock, no logging, no asyncio: the data plane's admission task owns one
`LaneQueue` per Lane, passes `now` and a `LaneView` (what the Lane's engines hold and
measure) to every call, and carries out the decisions it gets back. Driving it: on every
event (an arrival, a request that ends, a cancel, a fresh view) and at `next_expiry()`,
call `dispatch`, then `preemption` until it answers None, then `expire`. Apply each
decision to the view passed next (a dispatched ticket runs; a parked one does not).

Order. A request holds a `Ticket` under one `Policy` (the SLOPolicy it names, else its
Lane's, else `FIFO_POLICY`). Tickets wait in one order per Lane: higher `priority`
first; inside one priority by fair share between tenants; then earliest deadline
first, the deadline being arrival + `ttftTargetMs` (none sorts after every deadline);
then arrival; then id.

Fair share is start-time fair queuing (SFQ, Goyal et al. 1996), one virtual clock per
priority. Each start of a tenant's ticket costs it 1 / its weight in virtual time. The
tier's clock `V` is the virtual start of the ticket started last; a tenant's `F` is the
virtual finish of its ticket started last. The k-th of a tenant's waiting tickets (in
deadline order) starts at max(V, F) + (k - 1) / weight, and tickets run in that order:
under saturation tenants are served in proportion to their weights, one whose tickets
arrive after an idle spell starts at the clock (no credit saved up), and a single
tenant's tickets keep the deadline order. A ticket that waits again after its start
(parked, or its start failed) was charged then: it comes first in its tier, as a
parked generation does in the forecast, and is not charged again. Requests without a
tenant share one (the empty name), of weight 1.

Bounds. At most `maxQueueDepth` tickets of one policy wait on a Lane: one more is
refused at once (QUEUE_FULL) unless an idle slot takes it at once. A ticket that has
waited `maxQueueWaitMs` and cannot start now is taken out and refused (QUEUE_TIMEOUT),
never started late. A cancelled ticket leaves at once. A parked generation waits again
(`requeue`): it comes first in its priority, counts in its policy's depth (parking may
take the depth past the bound; arrivals are then refused), and its waits add up against
its bound; having started, it is never refused for its TTFT target.

Forecast. Every decision reads one simulation of the Lane from `now`, in ticket order
(list scheduling, the model behind every prediction):

- Each replica has `slots` slots. A slot running a request frees after that request's
  decode time, `tokens_left x step / tokens_per_step`: step is the measured decode step
  at the batch the replica will run while this queue drains (its running requests plus
  the waiting tickets, at most its slots), `step_s + step_growth_s x (batch - 1)`;
  tokens_per_step the accepted tokens per step, 1 without speculation. An idle slot is
  free now.
- Each ticket in order takes the slot that frees first (an idle one, then the session's
  `prefer`red replica, then the least loaded replica, then the lowest index), holds it for
  its service time, its prefill (`start_overhead_s`, what a start costs beyond the
  prompt as measured, plus `prompt_tokens / prefill_tokens_per_s`) plus the decode time
  of the tokens it will generate (its max_tokens, or fewer when the Lane measures a
  smaller typical completion: the share of max_tokens its policy's requests generate,
  else the Lane's mean, `LaneView.output_tokens`), and then frees it for the
  next. Its first token comes at start + prefill. A parked generation (`Resume`) takes only a
  slot of its own replica and costs its remaining decode time.
- Preemption in the forecast: a ticket whose first token would come past its deadline
  in a slot that is not idle takes instead the slot of a running request of strictly
  lower priority, if parking that request keeps the replica's parked bytes within its
  bound and lets the ticket meet its deadline (prefill from now). The cheapest victim
  is parked: fewest KV tokens, then lowest priority, then replica index and id. The
  victim re-enters the order at its priority, pinned to its replica.
- A measurement an engine has not made yet (None) counts as zero seconds: admission
  never refuses on a guess. With no replica the forecast knows nothing and refuses only
  on the bounds and on deadlines already passed.

Decisions from the forecast. `dispatch` starts the tickets that took an idle slot;
`preemption` names the first ticket that took a victim's slot; `expire` refuses the
tickets past their wait bound and, under `onOverload: reject`, those predicted to miss
their time-to-first-token target (a ticket waiting at its deadline misses it); `arrive`
runs the same simulation with the new ticket in its place and refuses it early
(SLO_UNATTAINABLE) when it would miss. A ticket refused in the simulation takes no slot,
so tickets behind it see the room it leaves.

Retry-after, from the same forecast (how fast this Lane drains), within
[RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S]: for QUEUE_FULL, until the first ticket of the
policy leaves the queue (starts or times out); for QUEUE_TIMEOUT, until the ticket's turn
would have come; for SLO_UNATTAINABLE, until a request like it would meet the target
(predicted first token minus target, as the work ahead drains), the maximum when its
prefill alone misses the target. RETRY_AFTER_UNKNOWN_S when the forecast knows nothing.

Known simplifications: the step time is the one at the batch the queue keeps the
replica at, also for its last requests as the queue runs dry; parking and resuming cost
no time; bytes freed by a simulated resume are not returned to the parking budget;
tickets that will arrive later are not foreseen (a more urgent arrival may push an
admitted ticket past its deadline, and `expire` then refuses it).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeAlias

from blazar.api import errors
from blazar.api.kinds import SLOPolicySpec

# The built-in policy's queue bound: Ollama's default OLLAMA_MAX_QUEUE. Far above what
# one host serves at once, so a Lane without a policy queues as it did before admission
# existed, yet a runaway client cannot grow the daemon's memory without end.
FIFO_MAX_QUEUE_DEPTH = 512

# A retry sooner than this would find the same queue; later than the maximum, the
# forecast is no longer worth much (arrivals change it), and a client should ask again.
RETRY_AFTER_MIN_S = 0.1
RETRY_AFTER_MAX_S = 60.0
# When there is nothing to forecast from (no replica serving yet): the shim's default.
RETRY_AFTER_UNKNOWN_S = 1.0


class Reason(StrEnum):
    """Why a ticket is refused: the reason of the error the caller gets."""

    QUEUE_FULL = errors.QueueFull.reason
    QUEUE_TIMEOUT = errors.QueueTimeout.reason
    SLO_UNATTAINABLE = errors.SloUnattainable.reason


@dataclass(frozen=True)
class Policy:
    """An SLOPolicy as admission uses it, times in seconds.

    `tpot_target_s` is carried, not used here: the engine keeps a time-per-output-token
    target by pacing the prompt chunks it decodes beside the stream (`engine.pacing`).
    """

    name: str
    priority: int = 0
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None
    max_queue_depth: int = FIFO_MAX_QUEUE_DEPTH
    max_queue_wait_s: float | None = None
    # onOverload: reject. Without a TTFT target there is nothing to predict a miss of.
    reject_early: bool = False

    @classmethod
    def of(cls, name: str, spec: SLOPolicySpec) -> Policy:
        def seconds(ms: int | None) -> float | None:
            return None if ms is None else ms / 1000

        return cls(
            name=name,
            priority=spec.priority,
            ttft_target_s=seconds(spec.ttft_target_ms),
            tpot_target_s=seconds(spec.tpot_target_ms),
            max_queue_depth=spec.max_queue_depth,
            max_queue_wait_s=seconds(spec.max_queue_wait_ms),
            reject_early=spec.on_overload == "reject",
        )


# For a Lane without sloPolicy: one tier, arrival order, no target, no wait bound (a
# request waits as long as its caller does), queued rather than refused. The name is
# not a valid resource name, so no SLOPolicy shares its queue.
FIFO_POLICY = Policy(name="builtin:fifo")


@dataclass(frozen=True)
class Ticket:
    """One request's place in its Lane's queue."""

    id: str
    policy: Policy
    # On the data plane's clock (the `now` of every call), when the request arrived.
    arrived: float
    # Estimates are fine: they weigh the ticket's own work in the forecast.
    prompt_tokens: int
    max_tokens: int
    # The replica a session used last (its cache holds the conversation): preferred
    # while it has an idle slot, as `routing.pick_replica` does.
    prefer: int | None = None
    # Seconds spent waiting in earlier stints (before a start that failed or a park):
    # the wait bound counts them all.
    waited_s: float = 0.0
    # Whose request it is, and the tenant's share of the Lane (module docstring).
    tenant: str = ""
    weight: float = 1.0

    @property
    def deadline(self) -> float:
        target = self.policy.ttft_target_s
        return math.inf if target is None else self.arrived + target


# A waiting ticket's place in the order: priority, its virtual start (fair share),
# deadline, arrival, id.
_Key: TypeAlias = tuple[int, float, float, float, str]


@dataclass(frozen=True)
class Running:
    """A request generating on a replica, as the data plane knows it."""

    id: str
    priority: int
    # Tokens it has still to generate, estimated (max_tokens, or the Lane's typical
    # completion, less what it generated).
    tokens_left: int
    # Tokens in its KV cache (prompt and output so far): what parking it copies.
    kv_tokens: int


@dataclass(frozen=True)
class ReplicaView:
    """One ready replica of the Lane: its slots, what runs on them, what it measures."""

    index: int
    slots: int
    running: tuple[Running, ...] = ()
    # Measured; None until the engine has measured it.
    prefill_tokens_per_s: float | None = None
    # Seconds per decode step with one sequence decoding, and how much longer a step
    # takes per extra sequence in the batch.
    step_s: float | None = None
    step_growth_s: float = 0.0
    # Seconds from a start to its first token beyond the prefill itself (measured).
    start_overhead_s: float = 0.0
    # The fixed part of a prefill, whatever its length (measured).
    prefill_fixed_s: float = 0.0
    # Tokens a sequence gains per decode step: 1, or 1 + accepted drafts per step
    # when speculation is on.
    tokens_per_step: float = 1.0
    kv_bytes_per_token: int = 0
    # Seconds from asking the engine to park a generation to its slot being free
    # (measured): when a preempting request starts.
    park_s: float = 0.0
    # Host memory holding parked generations, and its bound (0: this engine cannot park).
    parked_bytes: int = 0
    parked_bytes_max: int = 0

    def prefill_s(self, tokens: int) -> float:
        """Seconds from a start to the first token: the measured start overhead and the
        prompt at the measured prefill rate."""
        rate = self.prefill_tokens_per_s
        return self.start_overhead_s + self.prefill_fixed_s + (tokens / rate if rate else 0.0)

    def decode_s(self, tokens: int, *, batch: int = 1) -> float:
        """Seconds to generate `tokens` with `batch` sequences decoding together."""
        if not self.step_s:
            return 0.0
        step = self.step_s + self.step_growth_s * max(0, batch - 1)
        return tokens * step / max(self.tokens_per_step, 1.0)


@dataclass(frozen=True)
class LaneView:
    replicas: tuple[ReplicaView, ...] = ()
    # The Lane's typical completion length in tokens (a measured mean); None: count a
    # ticket's max_tokens.
    completion_tokens: float | None = None
    # By policy name, the share of max_tokens its requests generated (measured): a
    # policy's requests are alike (batch jobs run to their budget, chat turns stop
    # early), where the Lane's mean mixes them.
    completion_share: Mapping[str, float] = field(default_factory=dict)

    def output_tokens(self, ticket: Ticket) -> int:
        share = self.completion_share.get(ticket.policy.name)
        if share is not None:
            return max(1, min(ticket.max_tokens, math.ceil(share * ticket.max_tokens)))
        if self.completion_tokens is None:
            return ticket.max_tokens
        return min(ticket.max_tokens, math.ceil(self.completion_tokens))


@dataclass(frozen=True)
class Resume:
    """Where a parked generation's KV cache is, and how much it has left to generate."""

    replica: int
    tokens_left: int


# --- decisions -------------------------------------------------------------------


@dataclass(frozen=True)
class Admit:
    """The ticket waits (or starts at the next `dispatch`); its first token is expected
    this long after its arrival (None: nothing to predict from yet)."""

    predicted_ttft_s: float | None


@dataclass(frozen=True)
class Refuse:
    """The ticket is out of the queue (or never entered it); `error` is what its caller
    gets."""

    ticket: Ticket
    reason: Reason
    retry_after_s: float
    # Seconds it waited in all; for SLO_UNATTAINABLE, when its first token was predicted
    # (from arrival; a lower bound when no replica serves).
    waited_s: float = 0.0
    predicted_ttft_s: float | None = None
    # Its generation was parked on this replica: the engine drops that KV.
    parked_on: int | None = None

    def error(self, lane: str) -> errors.Overloaded:
        policy = self.ticket.policy
        if self.reason == Reason.QUEUE_FULL:
            return errors.QueueFull.of(
                lane=lane,
                policy=policy.name,
                max_queue_depth=policy.max_queue_depth,
                retry_after_s=self.retry_after_s,
            )
        if self.reason == Reason.QUEUE_TIMEOUT:
            return errors.QueueTimeout.of(
                lane=lane,
                policy=policy.name,
                waited_s=self.waited_s,
                max_queue_wait_s=policy.max_queue_wait_s or 0.0,
                retry_after_s=self.retry_after_s,
            )
        return errors.SloUnattainable.of(
            lane=lane,
            policy=policy.name,
            predicted_ttft_s=self.predicted_ttft_s or 0.0,
            ttft_target_s=policy.ttft_target_s or 0.0,
            retry_after_s=self.retry_after_s,
        )


@dataclass(frozen=True)
class Dispatch:
    """Start `ticket` on `replica` now; `resume`: from its parked KV, on that replica."""

    ticket: Ticket
    replica: int
    resume: bool = False


@dataclass(frozen=True)
class Preempt:
    """Park `victim` on `replica`, then start `ticket` in the slot it leaves. Requeue
    the victim's ticket with `Resume(replica, tokens_left)` once it is parked. If the
    victim ended meanwhile, its slot is free for `ticket` all the same; if the engine
    cannot park it, requeue `ticket` instead."""

    ticket: Ticket
    victim: str
    replica: int


# --- the queue -------------------------------------------------------------------


@dataclass(frozen=True)
class _Waiting:
    ticket: Ticket
    # When this stint of waiting began (its arrival, or when it was requeued).
    since: float
    resume: Resume | None = None
    # Started before (requeued): its tenant's share was charged then.
    charged: bool = False

    def waited(self, now: float) -> float:
        return self.ticket.waited_s + max(0.0, now - self.since)

    def timed_out(self, now: float, *, starts_now: bool) -> bool:
        """At its bound a ticket may still start, but not wait on."""
        bound = self.ticket.policy.max_queue_wait_s
        if bound is None:
            return False
        waited = self.waited(now)
        return waited > bound or (waited >= bound and not starts_now)


class LaneQueue:
    """The tickets waiting on one Lane, and the decisions about them."""

    def __init__(self) -> None:
        self._waiting: dict[str, _Waiting] = {}
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

    def arrive(self, ticket: Ticket, *, now: float, view: LaneView) -> Admit | Refuse:
        """Queue `ticket` or refuse it at once. An admitted ticket that can start now is
        started by the next `dispatch`, the one place where tickets start."""
        if ticket.id in self._waiting:
            raise ValueError(f"ticket {ticket.id!r} is already waiting")
        entry = _Waiting(ticket, since=ticket.arrived)
        fate = _forecast(self._ordered(extra=entry), now=now, view=view)[ticket.id]
        policy = ticket.policy
        if not fate.idle and self.depth(policy.name) >= policy.max_queue_depth:
            return Refuse(ticket, Reason.QUEUE_FULL, self._room_after(policy, now, view))
        if fate.refuse is not None:
            return _refusal(entry, fate, now)
        self._waiting[ticket.id] = entry
        return Admit(fate.ttft_s)

    def requeue(self, ticket: Ticket, *, now: float, resume: Resume | None = None) -> None:
        """Put a started ticket back, as `Dispatch`/`Preempt` gave it: a generation
        parked on `resume.replica` (it waits for a slot there), or a start that failed
        (it waits for any). It comes first in its priority (it started before; see fair
        share) and its wait so far is kept; its depth is counted again, even over the
        bound."""
        if ticket.id in self._waiting:
            raise ValueError(f"ticket {ticket.id!r} is already waiting")
        self._waiting[ticket.id] = _Waiting(ticket, since=now, resume=resume, charged=True)

    def cancel(self, ticket_id: str) -> bool:
        """Take out a ticket whose caller left; False when it was not waiting."""
        return self._waiting.pop(ticket_id, None) is not None

    def dispatch(self, *, now: float, view: LaneView) -> list[Dispatch]:
        """The tickets to start now, in order, each on a replica with an idle slot."""
        ordered = self._ordered()
        fates = _forecast(ordered, now=now, view=view)
        started = []
        for _, entry in ordered:
            fate = fates[entry.ticket.id]
            if fate.idle and fate.refuse is None and fate.replica is not None:
                del self._waiting[entry.ticket.id]
                self._charge(entry)
                ticket = replace(entry.ticket, waited_s=entry.waited(now))
                started.append(Dispatch(ticket, fate.replica, resume=entry.resume is not None))
        return started

    def preemption(self, *, now: float, view: LaneView) -> Preempt | None:
        """The first ticket in order that would miss its deadline waiting for a slot held
        by lower-priority work, with the request to park for it (see the module's
        forecast); the ticket leaves the queue. None when no ticket needs one."""
        ordered = self._ordered()
        fates = _forecast(ordered, now=now, view=view)
        for _, entry in ordered:
            fate = fates[entry.ticket.id]
            if fate.victim is not None and fate.refuse is None and fate.replica is not None:
                del self._waiting[entry.ticket.id]
                self._charge(entry)
                ticket = replace(entry.ticket, waited_s=entry.waited(now))
                return Preempt(ticket, victim=fate.victim.id, replica=fate.replica)
        return None

    def expire(self, *, now: float, view: LaneView) -> list[Refuse]:
        """Take out and refuse, in order, the tickets past their wait bound and (under
        onOverload: reject) those that can no longer meet their TTFT target."""
        ordered = self._ordered()
        fates = _forecast(ordered, now=now, view=view)
        refused = []
        for _, entry in ordered:
            fate = fates[entry.ticket.id]
            if fate.refuse is not None:
                del self._waiting[entry.ticket.id]
                refused.append(_refusal(entry, fate, now))
        return refused

    def predict_ttft(self, ticket_id: str, *, now: float, view: LaneView) -> float | None:
        """Seconds from the ticket's arrival to its first token, as forecast now; None
        for a parked generation or when no replica serves. KeyError if not waiting."""
        entry = self._waiting[ticket_id]
        return _forecast(self._ordered(), now=now, view=view)[entry.ticket.id].ttft_s

    def next_expiry(self) -> float | None:
        """When `expire` must run next though nothing else changes: the first time a
        ticket reaches its wait bound or (under onOverload: reject) its deadline."""
        times = []
        for entry in self._waiting.values():
            bound = entry.ticket.policy.max_queue_wait_s
            if bound is not None:
                times.append(entry.since + bound - entry.ticket.waited_s)
            if _rejects_late(entry):
                times.append(entry.ticket.deadline)
        return min(times, default=None)

    def _ordered(self, extra: _Waiting | None = None) -> list[tuple[_Key, _Waiting]]:
        """The waiting tickets (and `extra`, as if it waited) with their keys, in order:
        each tenant's k-th fresh ticket of a tier starts at max(V, F) + (k-1) / weight."""
        entries = [*self._waiting.values(), *([extra] if extra is not None else [])]
        by_tenant: dict[tuple[int, str], list[_Waiting]] = defaultdict(list)
        keyed: list[tuple[_Key, _Waiting]] = []
        for entry in entries:
            ticket = entry.ticket
            if entry.charged:
                keyed.append((_key(ticket, -math.inf), entry))
            else:
                by_tenant[(ticket.policy.priority, ticket.tenant)].append(entry)
        for (priority, tenant), mine in by_tenant.items():
            mine.sort(key=lambda w: (w.ticket.deadline, w.ticket.arrived, w.ticket.id))
            start = max(self._clock.get(priority, 0.0), self._finish.get((priority, tenant), 0.0))
            for k, entry in enumerate(mine):
                keyed.append((_key(entry.ticket, start + k / entry.ticket.weight), entry))
        keyed.sort(key=lambda pair: pair[0])
        return keyed

    def _charge(self, entry: _Waiting) -> None:
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
        fates = _forecast(self._ordered(), now=now, view=view)
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
        return _clamp(min(times, default=None))


# --- the forecast ----------------------------------------------------------------


@dataclass(frozen=True)
class _Fate:
    """What the forecast says of one waiting ticket. For a refused one, where it would
    have gone: it takes no slot in the forecast."""

    # Seconds from now until it starts; None when no replica it may use serves.
    start_s: float | None = None
    # Seconds from its arrival to its first token; None for a parked generation.
    ttft_s: float | None = None
    # Seconds of prefill before its first token, once started.
    prefill_s: float = 0.0
    replica: int | None = None
    # Starts now on an idle slot: `dispatch` starts it (unless refused).
    idle: bool = False
    # Starts now in this request's slot once it is parked: `preemption` says so (unless
    # refused).
    victim: Running | None = None
    refuse: Reason | None = None

    @property
    def starts_now(self) -> bool:
        return self.idle or self.victim is not None


def _refusal(entry: _Waiting, fate: _Fate, now: float) -> Refuse:
    ticket = entry.ticket
    parked_on = entry.resume.replica if entry.resume else None
    if fate.refuse == Reason.QUEUE_TIMEOUT:
        return Refuse(
            ticket,
            Reason.QUEUE_TIMEOUT,
            _clamp(fate.start_s),
            waited_s=entry.waited(now),
            parked_on=parked_on,
        )
    # SLO_UNATTAINABLE: a request like it meets the target once the work ahead has
    # drained by the amount it misses by; never, if its own prefill misses it.
    target = ticket.policy.ttft_target_s or 0.0
    retry: float | None = None
    predicted = fate.ttft_s
    if fate.start_s is not None:
        first_token_s = fate.start_s + fate.prefill_s
        retry = RETRY_AFTER_MAX_S if fate.prefill_s > target else first_token_s - target
    else:
        predicted = max(0.0, now - ticket.arrived)
    return Refuse(
        ticket,
        Reason.SLO_UNATTAINABLE,
        _clamp(retry),
        waited_s=entry.waited(now),
        predicted_ttft_s=predicted,
        parked_on=parked_on,
    )


def _key(ticket: Ticket, virtual_start: float) -> _Key:
    return (-ticket.policy.priority, virtual_start, ticket.deadline, ticket.arrived, ticket.id)


def _clamp(seconds: float | None) -> float:
    if seconds is None:
        return RETRY_AFTER_UNKNOWN_S
    return min(max(seconds, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)


def _rejects_late(entry: _Waiting) -> bool:
    """Refused when predicted to miss its deadline: a fresh ticket under onOverload:
    reject with a TTFT target. A parked generation has started: only its wait bound
    can take it out."""
    return (
        entry.resume is None
        and entry.ticket.policy.reject_early
        and entry.ticket.deadline < math.inf
    )


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


@dataclass(frozen=True)
class _Victim:
    """A generation the forecast parked: it waits, pinned, at its priority."""

    running: Running
    replica: int

    @property
    def key(self) -> _Key:
        # First inside its priority: it started before anything still waiting there.
        return (-self.running.priority, -math.inf, -math.inf, -math.inf, self.running.id)


class _Simulation:
    """The Lane's slots as the forecast hands them out."""

    def __init__(self, view: LaneView, now: float, *, waiting: int) -> None:
        self.now = now
        self.slots: list[_Slot] = []
        self.load: dict[int, int] = {}
        self.parked: dict[int, int] = {}
        self.batch: dict[int, int] = {}
        for replica in view.replicas:
            self.load[replica.index] = len(replica.running)
            self.parked[replica.index] = replica.parked_bytes
            self.batch[replica.index] = max(1, min(replica.slots, len(replica.running) + waiting))
            for position, run in enumerate(replica.running):
                free_at = self.decode_s(replica, run.tokens_left)
                self.slots.append(_Slot(replica, position, free_at, idle=False, holder=run))
            for position in range(len(replica.running), replica.slots):
                self.slots.append(_Slot(replica, position, 0.0, idle=True, holder=None))

    def decode_s(self, replica: ReplicaView, tokens: int) -> float:
        """Decode time on `replica` at the batch it will run while this queue drains."""
        return replica.decode_s(tokens, batch=self.batch[replica.index])

    def slot_for(self, *, pinned: int | None, prefer: int | None) -> _Slot | None:
        """The slot that frees first: an idle one, then on `prefer`, then on the least
        loaded replica, then the lowest index. None when no slot may take it."""

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

        candidates = [s for s in self.slots if pinned is None or s.replica.index == pinned]
        return min(candidates, key=rank, default=None)

    def victim_for(self, ticket: Ticket) -> _Slot | None:
        """The slot of the running request of lower priority cheapest to park, among
        those whose parking fits the replica's bound and lets `ticket` meet its deadline."""
        options = []
        for slot in self.slots:
            run, replica = slot.holder, slot.replica
            if run is None or run.priority >= ticket.policy.priority:
                continue
            cost = run.kv_tokens * replica.kv_bytes_per_token
            bound = replica.parked_bytes_max
            fits = bound > 0 and self.parked[replica.index] + cost <= bound
            first_token = replica.park_s + replica.prefill_s(ticket.prompt_tokens)
            meets = self.now + first_token <= ticket.deadline
            if fits and meets:
                options.append(((run.kv_tokens, run.priority, replica.index, run.id), slot))
        if not options:
            return None
        return min(options, key=lambda option: option[0])[1]

    def take(self, slot: _Slot, *, start_s: float, service_s: float) -> None:
        index = slot.replica.index
        if slot.idle:
            self.load[index] += 1
        slot.free_at = start_s + service_s
        slot.idle = False
        slot.holder = None

    def park(self, slot: _Slot) -> _Victim:
        assert slot.holder is not None
        replica = slot.replica
        self.parked[replica.index] += slot.holder.kv_tokens * replica.kv_bytes_per_token
        return _Victim(slot.holder, replica.index)


def _fate(entry: _Waiting, sim: _Simulation, now: float) -> tuple[_Fate, _Slot | None]:
    """Where the forecast puts one waiting ticket, and the slot it takes (its `victim`'s
    when it preempts); `refuse` set when it is to be taken out instead."""
    ticket = entry.ticket
    pinned = entry.resume.replica if entry.resume else None
    slot = sim.slot_for(pinned=pinned, prefer=ticket.prefer)
    victim: Running | None = None
    fate = _Fate()
    if slot is not None:
        start = slot.free_at
        prefill = 0.0 if entry.resume else slot.replica.prefill_s(ticket.prompt_tokens)
        misses = now + start + prefill > ticket.deadline
        if misses and not slot.idle and entry.resume is None:
            parked = sim.victim_for(ticket)
            if parked is not None:
                slot, victim, start = parked, parked.holder, parked.replica.park_s
                prefill = slot.replica.prefill_s(ticket.prompt_tokens)
        fate = _Fate(
            start_s=start,
            ttft_s=None if entry.resume else max(0.0, now - ticket.arrived) + start + prefill,
            prefill_s=prefill,
            replica=slot.replica.index,
            idle=slot.idle,
            victim=victim,
        )
    if entry.timed_out(now, starts_now=fate.starts_now):
        return replace(fate, refuse=Reason.QUEUE_TIMEOUT), None
    if _rejects_late(entry) and (
        now >= ticket.deadline
        or (fate.start_s is not None and now + fate.start_s + fate.prefill_s > ticket.deadline)
    ):
        return replace(fate, refuse=Reason.SLO_UNATTAINABLE), None
    return fate, slot


def _forecast(
    waiting: list[tuple[_Key, _Waiting]], *, now: float, view: LaneView
) -> dict[str, _Fate]:
    """Every waiting ticket's fate, simulated in order (see the module docstring)."""
    sim = _Simulation(view, now, waiting=len(waiting))
    fates: dict[str, _Fate] = {}
    heap: list[tuple[_Key, int, _Waiting | _Victim]] = [
        (key, seq, entry) for seq, (key, entry) in enumerate(waiting)
    ]
    heapq.heapify(heap)
    seq = len(heap)
    while heap:
        _, _, item = heapq.heappop(heap)
        if isinstance(item, _Victim):
            resumed = sim.slot_for(pinned=item.replica, prefer=None)
            assert resumed is not None  # its replica is in the view: it was parked there
            service = sim.decode_s(resumed.replica, item.running.tokens_left)
            sim.take(resumed, start_s=resumed.free_at, service_s=service)
            continue
        fate, slot = _fate(item, sim, now)
        fates[item.ticket.id] = fate
        if slot is None or fate.start_s is None:
            continue
        if fate.victim is not None:
            victim = sim.park(slot)
            heapq.heappush(heap, (victim.key, seq, victim))
            seq += 1
        if item.resume is not None:
            service = sim.decode_s(slot.replica, item.resume.tokens_left)
        else:
            service = fate.prefill_s + sim.decode_s(slot.replica, view.output_tokens(item.ticket))
        sim.take(slot, start_s=fate.start_s, service_s=service)
    return fates
