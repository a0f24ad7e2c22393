"""What admission reads and decides: policies, tickets, the view of a Lane's engines,
and the decisions it hands back (see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
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
    # The caller's own deadline (gRPC's) passed, or its first token would come after it.
    DEADLINE_EXCEEDED = errors.DeadlineExceeded.reason


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
    # maxSlotsPerReplica: the most slots of one replica its requests hold at once (the
    # rest stay free for other policies' requests); None: no cap.
    max_slots_per_replica: int | None = None

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
            reject_early=spec.on_overload != "queue",
            max_slots_per_replica=spec.max_slots_per_replica,
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
    # Of its prompt, the leading tokens the cache of `prefer` holds, by the Lane's
    # prefix index (an estimate): its prefill there is of the rest (`fresh_tokens`).
    cached_tokens: int = 0
    # Seconds spent waiting in earlier stints (before a start that failed or a park):
    # the wait bound counts them all.
    waited_s: float = 0.0
    # It started before (a start that failed and came back): its wait is in
    # blazar_queue_wait_seconds already, which observes a request once.
    restarted: bool = False
    # Whose request it is, and the tenant's share of the Lane (module docstring).
    tenant: str = ""
    weight: float = 1.0
    # The Lane it spilled over from (it arrives here predicted to miss its target
    # there): admitted only if predicted to meet it, and never spilled again.
    spilled_from: str | None = None
    # The tokens of a slot's context it needs, by the same estimate as its fit (its
    # prompt and the tokens it asks for, at least one): it starts only on a replica
    # whose slots hold that many (`LaneView.fitting`). 0: any.
    context_tokens: int = 0
    # On the same clock as `arrived`, when its caller stops waiting for it (a gRPC
    # deadline; inf: none, as over HTTP). Unlike `deadline`, nothing is ordered by it:
    # past it the ticket leaves, and work that would come after it is not done.
    caller_deadline: float = math.inf

    @property
    def deadline(self) -> float:
        target = self.policy.ttft_target_s
        return math.inf if target is None else self.arrived + target

    def fresh_tokens(self, replica: int) -> int:
        """The prompt tokens its start on `replica` prefills: those its cache does not
        hold (at least one, the token that yields the first logits), as the measured
        prefill rates count them."""
        if replica != self.prefer:
            return self.prompt_tokens
        return fresh_tokens(self.prompt_tokens, self.cached_tokens)


def fresh_tokens(prompt_tokens: int, cached_tokens: int) -> int:
    """The tokens a prompt's start prefills when a slot's cache holds `cached_tokens`
    of it: the rest, and at least one (the token that yields the first logits), as the
    measured prefill rates count them."""
    return max(1, prompt_tokens - cached_tokens)


# A waiting ticket's place in the order: priority, its virtual start (fair share),
# deadline, arrival, id.
Key: TypeAlias = tuple[int, float, float, float, str]


@dataclass(frozen=True)
class TokenRate:
    """Seconds per generated token, as a policy's requests measured them, and the
    batch they decoded at on average (None: not known, a figure read off runs in
    flight). A step grows with the batch, so the forecast scales the figure from that
    batch to the one it forecasts (`ReplicaView.decode_s`)."""

    seconds: float
    batch: float | None = None


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
    # Seconds per generated token, as its policy's requests measured them (the steps
    # they ran at over the tokens each gained them: speculation accepts many drafts
    # for text it can copy, and their rows slow every step); None: the replica's.
    rate: TokenRate | None = None
    # False: its engine refused to park it (not seated yet, say): no victim for now.
    parkable: bool = True
    # Its policy's name and `max_slots_per_replica`: the slots a policy holds on a
    # replica are counted against its cap by name ("" for none: never capped).
    policy: str = ""
    max_slots_per_replica: int | None = None
    # Seconds from now until its first token is expected, while it has started without
    # one (0.0 once it has one, or is overdue): its prompt holds its replica's prefill
    # line until then (see the forecast), and its slot frees that much later.
    prefill_left_s: float = 0.0


@dataclass(frozen=True)
class ReplicaView:
    """One ready replica of the Lane: its slots, what runs on them, what it measures."""

    index: int
    slots: int
    running: tuple[Running, ...] = ()
    # The tokens each of its slots holds (None: any request fits, as far as admission
    # knows): during a `contextPerSlot` rollout, an old replica's differs.
    context_per_slot: int | None = None
    # Measured; None until the engine has measured it.
    prefill_tokens_per_s: float | None = None
    # Seconds per decode step with one sequence decoding, and how much longer a step
    # takes per extra sequence in the batch: of steps where nothing drafts (a batch
    # above `draft_batch_max`, or a Lane without speculation).
    step_s: float | None = None
    step_growth_s: float = 0.0
    # The same of steps where sequences may draft (a batch within `draft_batch_max`):
    # their draft rows lengthen them. None until measured: the figures above then.
    draft_step_s: float | None = None
    draft_step_growth_s: float = 0.0
    # Seconds from a start to its first token beyond the prefill itself (measured).
    start_overhead_s: float = 0.0
    # The share of a prompt's prefill (`prefill_s`) that holds the replica's prefill
    # line: how soon after the first token of the prompt ahead of it a queued prompt's
    # first token comes, over its prefill (measured; 1 before: prompts one after
    # another, whole). Below 1, the engine overlaps them: the next prompt's first chunk
    # shares a step with this one's last, and short prompts share steps.
    line_share: float = 1.0
    # The fixed part of a prefill, whatever its length (measured).
    prefill_fixed_s: float = 0.0
    # The same two figures for a prompt that has its steps to itself (started on an
    # idle replica, with no other sequence in them): its prefill takes less than one
    # beside other prompts or decoding streams, whose rows share each of its steps.
    # None until measured: the figures above apply to it then.
    lone_prefill_tokens_per_s: float | None = None
    lone_prefill_fixed_s: float = 0.0
    # The start overhead of such starts, measured against that prefill; None until
    # measured (`start_overhead_s` then).
    lone_start_overhead_s: float | None = None
    # Tokens a sequence gains per decode step where it may draft: 1, or 1 + accepted
    # drafts per step when speculation is on.
    tokens_per_step: float = 1.0
    # With more sequences than this decoding, nothing drafts (the SpecPair's
    # disableAboveBatch): a step yields one token, and what was measured with drafts
    # (tokens_per_step, a policy's seconds per token) says nothing of it. None: no limit.
    draft_batch_max: int | None = None
    kv_bytes_per_token: int = 0
    # Seconds from asking the engine to park a generation to its slot being free
    # (measured): when a preempting request starts.
    park_s: float = 0.0
    # Host memory holding parked generations, and its bound (0: this engine cannot park).
    parked_bytes: int = 0
    parked_bytes_max: int = 0

    def may_park(self, run: Running, *, priority: int) -> bool:
        """Whether a request of `priority` may park `run`, running here: this engine parks
        at all, the run may be parked now, and its priority is lower (whether its bytes
        fit the bound is the forecast's to say, as it parks)."""
        return self.parked_bytes_max > 0 and run.parkable and run.priority < priority

    def parks_for(self, priority: int) -> bool:
        """Whether a request of `priority` may park any run here (`may_park`)."""
        return any(self.may_park(run, priority=priority) for run in self.running)

    def prefill_s(self, tokens: int, *, alone: bool = False) -> float:
        """Seconds from a start to the first token: the measured start overhead and the
        prompt at the measured prefill rate (`alone`: the rate of a prompt that has its
        steps to itself, once measured)."""
        rate, fixed = self.prefill_tokens_per_s, self.prefill_fixed_s
        overhead = self.start_overhead_s
        if alone and self.lone_prefill_tokens_per_s is not None:
            rate, fixed = self.lone_prefill_tokens_per_s, self.lone_prefill_fixed_s
            if self.lone_start_overhead_s is not None:
                overhead = self.lone_start_overhead_s
        return overhead + fixed + (tokens / rate if rate else 0.0)

    def lone_prefill_s(self, tokens: int) -> float | None:
        """The quickest this replica prefills a prompt of `tokens`: alone, with its
        steps to itself, and without the start overhead (the hop, template and
        tokenizer, a figure read against whatever prefill was forecast, little or
        nothing on a new replica): a lower bound of `prefill_s(alone=True)`. None
        until such a prefill was measured (the shared figures overstate it)."""
        rate = self.lone_prefill_tokens_per_s
        if rate is None:
            return None
        return self.lone_prefill_fixed_s + tokens / rate

    def drafts(self, batch: int) -> bool:
        """Whether sequences may draft at `batch` (a step's figures are then those of
        drafting steps)."""
        return self.draft_batch_max is None or batch <= self.draft_batch_max

    def step_at(self, batch: float, *, drafting: bool) -> float | None:
        """Seconds of a decode step at `batch` sequences, along the line measured for
        drafting steps or the other (each the other's until measured); None before any
        step was measured."""
        lines = [(self.draft_step_s, self.draft_step_growth_s), (self.step_s, self.step_growth_s)]
        for base, growth in lines if drafting else lines[::-1]:
            if base is not None:
                return base + growth * max(0.0, batch - 1)
        return None

    def step_of(self, batch: int) -> float | None:
        """Seconds of a decode step at `batch` sequences, drafting or not as the replica's
        SpecPair does at that batch (`drafts`); None before any step was measured."""
        return self.step_at(batch, drafting=self.drafts(batch))

    def decode_s(self, tokens: int, *, batch: int = 1, rate: TokenRate | None = None) -> float:
        """Seconds to generate `tokens` with `batch` sequences decoding together: at the
        request's policy's `rate` when it has measured one, scaled from the batch it
        measured at to `batch` along the measured step line; else a step's time for
        each `tokens_per_step`. Where the batch is too large to draft, a step for each
        token, whatever was measured with drafts."""
        drafting = self.drafts(batch)
        step = self.step_at(batch, drafting=drafting)
        if not drafting:
            if step is not None:
                return tokens * step
            return 0.0 if rate is None else tokens * rate.seconds
        if rate is not None:
            # Measured where it drafts (`LaneMeasurements.record`).
            at = None if rate.batch is None else self.step_at(rate.batch, drafting=True)
            scale = step / at if step is not None and at else 1.0
            return tokens * rate.seconds * scale
        if step is None:
            return 0.0
        return tokens * step / max(self.tokens_per_step, 1.0)


def expected_output(
    max_tokens: int, *, share: float | None, lane_share: float | None, typical: float | None
) -> int:
    """Tokens a request allowed `max_tokens` is expected to generate.

    Its policy's `share` of max_tokens once that is measured (a policy's requests are
    alike: batch jobs run to their budget, chat turns stop early). Before that, the
    larger of the Lane's `typical` completion and the Lane's share of max_tokens over
    every policy (`lane_share`): a policy not measured yet may well run to its budget,
    as the requests before it did, and a forecast that expects too little admits work
    that it must refuse later, at its deadline. All of max_tokens when nothing is
    measured."""
    if share is not None:
        return max(1, min(max_tokens, math.ceil(share * max_tokens)))
    guesses = [g for g in (typical, None if lane_share is None else lane_share * max_tokens) if g]
    if not guesses:
        return max_tokens
    return max(1, min(max_tokens, math.ceil(max(guesses))))


@dataclass(frozen=True)
class LaneView:
    replicas: tuple[ReplicaView, ...] = ()
    # The Lane's typical completion length in tokens (a measured mean); None: count a
    # ticket's max_tokens.
    completion_tokens: float | None = None
    # By policy name, the share of max_tokens its requests generated (measured).
    completion_share: Mapping[str, float] = field(default_factory=dict)
    # The same share over every request of the Lane, whatever its policy.
    lane_share: float | None = None
    # By policy name, seconds per generated token its requests measured: a batch job
    # that copies its prompt gains many tokens a step (and its draft rows slow every
    # step), a chat turn few, and the replica's figures, a mean of both, misjudge each.
    rates: Mapping[str, TokenRate] = field(default_factory=dict)
    # How much later than forecast first tokens come after a wait, measured (at least
    # 1: see `forecast`): the preemption decision scales a ticket's forecast wait and
    # prefill by it. Nothing else does: refusals and predictions read the forecast.
    lateness: float = 1.0
    # The context per slot of the replica starting (the Lane's), None when none starts:
    # a ticket that no ready replica holds waits for it if it will (`fitting`).
    starting_context: int | None = None

    def __post_init__(self) -> None:
        if not 1.0 <= self.lateness < math.inf:
            raise ValueError(f"lateness must be a finite factor >= 1, not {self.lateness!r}")

    def fitting(self, ticket: Ticket) -> frozenset[int] | None:
        """The replicas `ticket` may start on for their context (None: any): those whose
        slots hold its `context_tokens`, or none yet while only the replica starting
        would (it waits for that one). When no replica, ready or starting, holds it,
        any: it goes where it would, and that engine, which counts the tokens, has the
        final word (the estimate may be off either way)."""
        need = ticket.context_tokens
        fit = frozenset(
            r.index
            for r in self.replicas
            if r.context_per_slot is None or need <= r.context_per_slot
        )
        if len(fit) == len(self.replicas):
            return None
        if fit or (self.starting_context is not None and need <= self.starting_context):
            return fit
        return None

    def output_tokens(self, ticket: Ticket) -> int:
        return expected_output(
            ticket.max_tokens,
            share=self.completion_share.get(ticket.policy.name),
            lane_share=self.lane_share,
            typical=self.completion_tokens,
        )


@dataclass(frozen=True)
class Resume:
    """Where a parked generation's KV cache is, and how much it has left to generate."""

    replica: int
    tokens_left: int


# --- decisions -------------------------------------------------------------------


@dataclass(frozen=True)
class Admit:
    """The ticket waits (or starts at the next `dispatch`); its first token is expected
    this long after its arrival (None: nothing to predict from yet). `waits`: the
    forecast has it wait for a busy slot to free (neither an idle slot now nor a
    victim's): its first token tests the forecast of a wait, and the data plane
    measures the forecast's lateness from such tickets (`LaneView.lateness`)."""

    predicted_ttft_s: float | None
    waits: bool = False


@dataclass(frozen=True)
class Refuse:
    """The ticket is out of the queue (or never entered it); `error` is what its caller
    gets."""

    ticket: Ticket
    reason: Reason
    # None: no wait helps. Only for SLO_UNATTAINABLE, when its own prefill at its
    # quickest (`prefill_s`) misses the target.
    retry_after_s: float | None
    # Seconds it waited in all; for SLO_UNATTAINABLE, when its first token was predicted
    # (from arrival; a lower bound when no replica serves).
    waited_s: float = 0.0
    predicted_ttft_s: float | None = None
    # With no retry hint: the seconds its prompt takes to prefill alone on the replica
    # quickest for it, past its target.
    prefill_s: float | None = None

    @property
    def replica_failed(self) -> bool:
        """Whether the ticket, handed back by a failed replica, missed its target or
        wait bound meanwhile (`error`: `errors.ReplicaFailed`)."""
        return self.ticket.restarted and self.reason in (
            Reason.QUEUE_TIMEOUT,
            Reason.SLO_UNATTAINABLE,
        )

    @property
    def counted_reason(self) -> str:
        """The reason /metrics and the policy's figures count it under: admission's,
        but REPLICA_FAILED for a bound lost to a failed replica, so that a failure does
        not read as load (`blazar_admission_rejections_total`)."""
        return errors.ReplicaFailed.reason if self.replica_failed else self.reason.value

    def error(
        self, lane: str
    ) -> errors.Overloaded | errors.DeadlineExceeded | errors.ReplicaFailed:
        """The caller's error. A ticket handed back by a failed replica (`restarted`)
        that misses its target or wait bound meanwhile lost that time to the failure,
        not to load: `errors.ReplicaFailed`. One whose own prefill misses its target
        gets no retry hint (`errors.SloUnattainable.too_long`)."""
        policy = self.ticket.policy
        target = policy.ttft_target_s or 0.0
        if self.retry_after_s is None:
            return errors.SloUnattainable.too_long(
                lane=lane,
                policy=policy.name,
                prefill_s=self.prefill_s or 0.0,
                predicted_ttft_s=self.predicted_ttft_s or 0.0,
                ttft_target_s=target,
            )
        if self.replica_failed:
            timeout = self.reason == Reason.QUEUE_TIMEOUT
            return errors.ReplicaFailed.of(
                lane=lane,
                policy=policy.name,
                bound=(
                    f"{policy.max_queue_wait_s or 0.0:.2f} s wait bound (maxQueueWaitMs)"
                    if timeout
                    else f"{policy.ttft_target_s or 0.0:.2f} s target (ttftTargetMs)"
                ),
                retry_after_s=self.retry_after_s,
            )
        if self.reason == Reason.DEADLINE_EXCEEDED:
            return errors.DeadlineExceeded.of(
                lane=lane,
                deadline_s=self.ticket.caller_deadline - self.ticket.arrived,
                waited_s=self.waited_s,
                predicted_ttft_s=self.predicted_ttft_s,
            )
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
            ttft_target_s=target,
            retry_after_s=self.retry_after_s,
        )


@dataclass(frozen=True)
class Filling:
    """A gate open for now that closes as requests come (`LaneQueue.filling`): after
    `requests` more fresh requests of its policy (no tenant, no session), each with
    max_tokens of at least `max_tokens`, and, where set (not 0), at most
    `most_max_tokens` and a prompt of `least_prompt_tokens` to `most_prompt_tokens`
    tokens as admission estimates it, the next one is refused with `refusal` if its
    own prompt has at least `least_prompt_tokens` (any, when not set)."""

    requests: int
    max_tokens: int
    refusal: Refuse
    most_max_tokens: int = 0
    least_prompt_tokens: int = 0
    most_prompt_tokens: int = 0


@dataclass(frozen=True)
class Spill:
    """The ticket is predicted to miss its TTFT target here and its Lane names a
    spillover Lane: offer it there (with `spilled_from` set) instead of queueing it.
    `local` is what this Lane decided otherwise, and stands if the other refuses: a
    refusal (the caller gets it, with the smaller retry-after of the two), or, under
    onOverload: queue, an admission (arrive again here, without spill). The ticket is
    not in the queue."""

    ticket: Ticket
    local: Admit | Refuse


@dataclass(frozen=True)
class Dispatch:
    """Start `ticket` on `replica` now; `resume`: from its parked KV, on that replica."""

    ticket: Ticket
    replica: int
    resume: bool = False
    # A fresh start as the forecast gave it: its prefill waits `queue_s` behind the
    # prompts started before it on the replica, then takes `prefill_s` (start overhead
    # included); its first token is expected queue_s + prefill_s from now. 0.0 for a
    # resume (no prompt to prefill). Figures for the data plane to measure against,
    # not part of the decision: two decisions are equal when they start the same ticket
    # in the same place.
    queue_s: float = field(default=0.0, compare=False)
    prefill_s: float = field(default=0.0, compare=False)
    # Its prefill as the forecast gave it is that of a prompt alone on its replica
    # (`ReplicaView.prefill_s`): the replica was idle.
    alone: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class Preempt:
    """Park `victim` on `replica`, then start `ticket` in the slot it leaves. Requeue
    the victim's ticket with `Resume(replica, tokens_left)` once it is parked. If the
    victim ended meanwhile, its slot is free for `ticket` all the same; if the engine
    cannot park it, requeue `ticket` instead."""

    ticket: Ticket
    victim: str
    replica: int
    # As `Dispatch`'s, for the ticket's start once the victim is parked, `start_s` from
    # now (the measured park and a step): its first token is expected start_s +
    # queue_s + prefill_s from now.
    queue_s: float = field(default=0.0, compare=False)
    prefill_s: float = field(default=0.0, compare=False)
    start_s: float = field(default=0.0, compare=False)
