"""What a Lane's engines measure, as admission's forecast reads it.

Pure: no IO, no clock. The dispatcher records each finished request's `Final` (the
usage and timings the engine reports, relayed by the data plane) against its replica,
and reads back a `admission.ReplicaView` per replica and the Lane's typical completion
length. Every figure is a moving average of measurements, never a constant: until a
replica has measured something its own figure is the Lane's (what its other replicas
measured), and until the Lane has, None (which admission counts as no time at all).

Rates are ratios of moving sums (tokens over seconds), not moving averages of
per-request rates: a 5-token prefill, dominated by fixed costs, would otherwise weigh
as much as a 1,500-token one in the prefill rate.

One figure measures the forecast itself: its `lateness`, how much later than admission
predicted the first tokens of requests that waited for a busy slot came (measured over
predicted time to first token, both from arrival). The forecast's model leaves out
what it cannot see (a step slowing as the batch grows past what it measured, parks and
resumes taking time), and the error shows only in such requests: one that took an
idle slot never waited on the forecast. Admission's preemption decision scales a
ticket's forecast wait by it (`admission.LaneView.lateness`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from blazar._proto.v1 import inference_pb2
from blazar.dataplane import admission

# Weight of the newest request in every moving average: about the last ten requests
# make the figure, so it follows a change of load within a few seconds of traffic.
WEIGHT = 0.2

# Characters per prompt token before the Lane has measured its own ratio (the usual
# rule of thumb for English text and BPE vocabularies). A ticket's prompt size weighs
# only its own prefill, which counts as no time until a prefill rate is measured too.
DEFAULT_CHARS_PER_TOKEN = 4.0

# The lateness is an upper quantile of the latest waits' measured / predicted ratios,
# not their mean: it feeds a decision about whether a ticket may miss its deadline, and
# a scaled forecast that nine waits in ten came within protects the target where a mean
# would leave every other wait later than it. By nearest rank over twenty, the two
# worst ratios in the window move nothing (a wait upset by a failure, say), and twenty
# waits are a burst or two of traffic, so the figure follows a change of load.
LATENESS_WINDOW = 20
LATENESS_QUANTILE = 0.9
# Bounds: never below the forecast itself (lateness scales only the decision to park,
# and a forecast that runs late must not be read as early), and never past 3x: beyond,
# the forecast is broken rather than late, and every ticket would park work.
LATENESS_MIN = 1.0
LATENESS_MAX = 3.0


@dataclass
class _Mean:
    """An exponentially weighted moving average; None until the first sample."""

    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + WEIGHT * (sample - self.value)


@dataclass
class _Ratio:
    """Moving sums of a numerator and a denominator, read as their ratio."""

    top: _Mean = field(default_factory=_Mean)
    bottom: _Mean = field(default_factory=_Mean)

    def add(self, top: float, bottom: float) -> None:
        self.top.add(top)
        self.bottom.add(bottom)

    @property
    def value(self) -> float | None:
        if self.top.value is None or not self.bottom.value:
            return None
        return self.top.value / self.bottom.value


@dataclass
class _LineFit:
    """y as a line in x, by weighted least squares over moving sums.

    Decode steps: seconds per step against the batch (sequences decoded together), each
    request weighing its steps; a step grows with the batch (every sequence's row goes
    through the output matrix), so a figure measured at one batch misjudges another.
    Prefill: seconds against the prompt tokens prefilled, each request weighing one;
    a prefill has a fixed part (the step it joins, the first sampling), so a rate taken
    from short prompts misjudges a long one. Below `min_variance` of spread in x there is
    no slope to read, and the line is `constant` (y's mean) or proportional (through 0).
    """

    min_variance: float
    constant: bool
    weight: _Mean = field(default_factory=_Mean)
    x: _Mean = field(default_factory=_Mean)
    y: _Mean = field(default_factory=_Mean)
    xx: _Mean = field(default_factory=_Mean)
    xy: _Mean = field(default_factory=_Mean)

    def add(self, *, x: float, y_total: float, weight: float = 1.0) -> None:
        """`weight` samples at `x` whose y add up to `y_total`."""
        self.weight.add(weight)
        self.x.add(weight * x)
        self.y.add(y_total)
        self.xx.add(weight * x * x)
        self.xy.add(x * y_total)

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope); None before anything was measured."""
        w, x, y = self.weight.value, self.x.value, self.y.value
        if not w or x is None or y is None:
            return None
        mean_x, mean_y = x / w, y / w
        variance = (self.xx.value or 0.0) / w - mean_x * mean_x
        proportional = (0.0, mean_y / mean_x) if mean_x > 0 else (mean_y, 0.0)
        if mean_x <= 0 or variance < self.min_variance:
            return (mean_y, 0.0) if self.constant else proportional
        slope = max(0.0, ((self.xy.value or 0.0) / w - mean_x * mean_y) / variance)
        intercept = mean_y - slope * mean_x
        # A line that would cross zero before the smallest x seen: through 0 instead.
        return (intercept, slope) if intercept >= 0.0 else proportional


@dataclass
class _Quantile:
    """The `q`-quantile (nearest rank) of the latest `size` samples; None before any."""

    q: float
    size: int
    samples: deque[float] = field(default_factory=deque)

    def add(self, sample: float) -> None:
        self.samples.append(sample)
        while len(self.samples) > self.size:
            self.samples.popleft()

    @property
    def value(self) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(self.q * len(ordered)) - 1))]


def _step_fit() -> _LineFit:
    # Batches spread less than this (sequences squared) give no slope: one step time.
    return _LineFit(min_variance=0.25, constant=True)


def _prefill_fit() -> _LineFit:
    # Prompts spread less than this (tokens squared, about 16 tokens) give no fixed
    # part: tokens over seconds, as a rate.
    return _LineFit(min_variance=256.0, constant=False)


@dataclass
class _Rates:
    # Seconds of prefill by prompt tokens prefilled (cached ones excluded): of every
    # prompt, and of the prompts that had their steps to themselves
    # (`Timings.prefill_batch` 1). The second apart, because a prompt that shares its
    # steps reports the whole time of steps that also carried other prompts' chunks
    # and decoding streams' rows, and a replica under load has mostly those: a prompt
    # that starts on an idle replica would read as two or three times what it takes.
    # The first is for every other start, which may share its steps or not (whether a
    # burst's first prompt gets a step of its own before the next arrives is a race).
    prefill: _LineFit = field(default_factory=_prefill_fit)
    lone_prefill: _LineFit = field(default_factory=_prefill_fit)
    # Seconds of decode per decode step, by batch: of requests that decoded where
    # nothing drafts (at a batch above the SpecPair's disableAboveBatch, or on a Lane
    # without one), and of those that decoded where sequences may draft, whose steps
    # carry draft rows (`drafting`, `LaneMeasurements.record`). Apart, because the two
    # differ by more than the batch does: on one host, 6 sequences took 56 ms a step
    # without drafts, 4 sequences drafting about 100 ms.
    step: _LineFit = field(default_factory=_step_fit)
    draft_step: _LineFit = field(default_factory=_step_fit)
    # Tokens decoded over decode steps, where sequences may draft (above 1 with
    # accepted speculative drafts).
    per_step: _Ratio = field(default_factory=_Ratio)
    # Seconds from a start to its first token beyond the prefill the rate predicts and
    # the wait the forecast gave it behind other prompts on the replica: the hop to the
    # engine, its template and tokenizer, the step the prefill joins, the first chunk's
    # way back. What the forecast would otherwise miss on every start.
    start_overhead: _Mean = field(default_factory=_Mean)
    # The same of starts forecast alone on their replica, measured against the prefill
    # of prompts alone: each kind of start against its own fit (what a shared start's
    # prefill takes beyond its fit is no part of a lone start's).
    lone_start_overhead: _Mean = field(default_factory=_Mean)
    # Of a prompt that started while the one ahead of it on the replica had no first
    # token yet: its first token's distance from that one's, over its forecast prefill
    # (within [0, 1]). The share of a prefill the replica's prefill line holds alone:
    # the engine puts the next prompt's first chunk in the step of this one's last,
    # and short prompts in one step together.
    line_share: _Mean = field(default_factory=_Mean)
    # Seconds a Park took, from asking the engine to its answer: an urgent request that
    # preempts starts only then (the engine parks between two decode steps). Each
    # sample at most the copy and one step (`LaneMeasurements.record_park`).
    park: _Mean = field(default_factory=_Mean)

    def record(self, final: inference_pb2.Final, *, drafting: bool) -> None:
        usage, timings = final.usage, final.timings
        fresh = usage.prompt_tokens - usage.cached_tokens
        if fresh > 0 and timings.prefill_ms > 0:
            seconds = timings.prefill_ms / 1000.0
            self.prefill.add(x=fresh, y_total=seconds)
            if 0.0 < timings.prefill_batch <= 1.0:
                self.lone_prefill.add(x=fresh, y_total=seconds)
        # The first token comes out of the prefill; every later one out of a decode
        # step, which yields one token plus the drafts it accepted.
        decoded = usage.completion_tokens - 1
        steps = decoded - final.routing.accepted_tokens
        if steps > 0 and timings.decode_ms > 0:
            fit = self.draft_step if drafting else self.step
            fit.add(x=_decode_batch(final), y_total=timings.decode_ms / 1000.0, weight=steps)
            if drafting:
                self.per_step.add(decoded, steps)

    def prefill_line(self, lane: _Rates, *, alone: bool) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a prefill, alone or any, from these
        rates else the Lane's (`lane`); alone reads as any until measured."""
        every = self.prefill.line() or lane.prefill.line()
        if alone:
            return self.lone_prefill.line() or lane.lone_prefill.line() or every
        return every


@dataclass
class _PolicyRate:
    """Seconds of decoding over the tokens decoded, and the batch they decoded at
    (weighed by the tokens): one moving sum of tokens under both."""

    seconds: _Mean = field(default_factory=_Mean)
    batch_tokens: _Mean = field(default_factory=_Mean)
    tokens: _Mean = field(default_factory=_Mean)

    def add(self, *, seconds: float, tokens: int, batch: float) -> None:
        self.seconds.add(seconds)
        self.batch_tokens.add(batch * tokens)
        self.tokens.add(tokens)

    @property
    def value(self) -> admission.TokenRate | None:
        seconds, batch_tokens, tokens = (
            self.seconds.value,
            self.batch_tokens.value,
            self.tokens.value,
        )
        if seconds is None or batch_tokens is None or not tokens:
            return None
        return admission.TokenRate(seconds / tokens, batch_tokens / tokens)


def _decode_batch(final: inference_pb2.Final) -> float:
    # An engine that does not report its batch decoded alone as far as we know.
    return final.timings.decode_batch or 1.0


class LaneMeasurements:
    """The moving averages of one Lane and of each of its replicas (by index)."""

    def __init__(self) -> None:
        self._lane = _Rates()
        self._replicas: dict[int, _Rates] = {}
        self._completion = _Mean()
        # By policy: tokens generated over the max_tokens the requests allowed.
        self._share: dict[str, _Ratio] = {}
        self._lane_share = _Ratio()
        # By policy, its rate where sequences may draft.
        self._rates: dict[str, _PolicyRate] = {}
        self._chars_per_token = _Ratio()
        # Measured over predicted time to first token of the requests that waited.
        self._lateness = _Quantile(q=LATENESS_QUANTILE, size=LATENESS_WINDOW)

    def record(
        self,
        replica: int,
        final: inference_pb2.Final,
        *,
        prompt_chars: int,
        policy: str = "",
        max_tokens: int = 0,
        draft_batch_max: int | None = None,
    ) -> None:
        """A request that finished on `replica`: the characters of its prompt, the
        policy it ran under and the max_tokens it allowed, and its Lane's SpecPair's
        disableAboveBatch (None: no SpecPair). It decoded where sequences may draft
        when its Lane drafts and its mean batch is within that limit; a Lane without a
        SpecPair has one kind of step, kept as steps where nothing drafts."""
        batch = _decode_batch(final)
        drafting = draft_batch_max is not None and batch <= draft_batch_max
        self._lane.record(final, drafting=drafting)
        self._replicas.setdefault(replica, _Rates()).record(final, drafting=drafting)
        self._completion.add(final.usage.completion_tokens)
        if max_tokens > 0:
            generated = min(final.usage.completion_tokens, max_tokens)
            self._lane_share.add(generated, max_tokens)
            if policy:
                self._share.setdefault(policy, _Ratio()).add(generated, max_tokens)
        # As `_Rates.record` counts them: the first token comes out of the prefill.
        # A policy's rate is what its requests gain from drafting: one measured where
        # nothing drafts says nothing of it (the forecast reads a step a token there).
        decoded = final.usage.completion_tokens - 1
        usual = drafting or draft_batch_max is None
        if policy and usual and decoded > 0 and final.timings.decode_ms > 0:
            seconds = final.timings.decode_ms / 1000.0
            rate = self._rates.setdefault(policy, _PolicyRate())
            rate.add(seconds=seconds, tokens=decoded, batch=batch)
        if final.usage.prompt_tokens > 0 and prompt_chars > 0:
            self._chars_per_token.add(prompt_chars, final.usage.prompt_tokens)

    def expected_prefill_s(
        self, replica: int, prompt_tokens: int, *, alone: bool = False
    ) -> float | None:
        """The prefill the replica's measurements predict for a prompt alone on it or
        beside other sequences (None before the Lane has measured any)."""
        own = self._replicas.get(replica, self._lane)
        line = own.prefill_line(self._lane, alone=alone)
        return line[0] + line[1] * prompt_tokens if line else None

    def record_first_token(self, replica: int, *, overhead_s: float, alone: bool = False) -> None:
        """A started request's first token came `overhead_s` after its start plus the
        prefill its replica's rate predicted plus the wait the forecast gave it behind
        other prompts (negative: sooner; counted as none); `alone`: it was forecast as
        a prompt alone on its replica, against that prefill."""
        sample = max(0.0, overhead_s)
        for rates in (self._lane, self._replicas.setdefault(replica, _Rates())):
            (rates.lone_start_overhead if alone else rates.start_overhead).add(sample)

    def record_line(self, replica: int, *, share: float) -> None:
        """A prompt that queued behind another on `replica` had its first token `share`
        of its forecast prefill after that one's (clamped to [0, 1])."""
        sample = min(max(share, 0.0), 1.0)
        self._lane.line_share.add(sample)
        self._replicas.setdefault(replica, _Rates()).line_share.add(sample)

    def record_wait(self, *, predicted_s: float, measured_s: float) -> None:
        """A request that admission forecast to wait for a busy slot, with its first
        token `predicted_s` after its arrival, had it `measured_s` after (a prediction of
        no time has nothing to scale, and tells nothing)."""
        if predicted_s > 0.0 and math.isfinite(predicted_s) and math.isfinite(measured_s):
            self._lateness.add(max(0.0, measured_s) / predicted_s)

    @property
    def lateness(self) -> float:
        """How much later than forecast first tokens come after a wait: the upper
        quantile of the latest waits' measured / predicted, within [LATENESS_MIN,
        LATENESS_MAX]; 1.0 (the forecast as it is) before any wait was measured."""
        value = self._lateness.value
        if value is None:
            return 1.0
        return min(max(value, LATENESS_MIN), LATENESS_MAX)

    def record_park(self, replica: int, *, seconds: float, bound_s: float | None = None) -> None:
        """The engine of `replica` parked a generation in `seconds`, counted as at most
        `bound_s`: the engine's copy and the decode step it was running when asked,
        which is all a park waits for. A Park that came while a long prompt chunk ran
        waits longer once, and a few such samples would otherwise hold the figure up
        for good: the forecast would then refuse urgent requests rather than park, and
        no park would come to bring it down again."""
        if bound_s is not None:
            seconds = min(seconds, bound_s)
        self._lane.park.add(seconds)
        self._replicas.setdefault(replica, _Rates()).park.add(seconds)

    def step_s(self, replica: int, *, batch: int, draft_batch_max: int | None) -> float | None:
        """A decode step of `batch` sequences on `replica`, as measured (None before)."""
        view = self.replica_view(replica, slots=batch, running=(), draft_batch_max=draft_batch_max)
        return view.step_of(batch)

    @property
    def completion_tokens(self) -> float | None:
        """The Lane's typical completion length in tokens; None before any request ends."""
        return self._completion.value

    def prompt_tokens(self, chars: int) -> int:
        """An estimate of a prompt's tokens from its characters, before tokenizing it."""
        return max(1, math.ceil(chars / self.chars_per_token))

    @property
    def chars_per_token(self) -> float:
        """The characters a prompt token stands for, as measured (a default before)."""
        return self._chars_per_token.value or DEFAULT_CHARS_PER_TOKEN

    @property
    def completion_share(self) -> dict[str, float]:
        """By policy, the share of max_tokens its requests generated."""
        return {name: v for name, ratio in self._share.items() if (v := ratio.value) is not None}

    @property
    def token_rates(self) -> dict[str, admission.TokenRate]:
        """By policy, the seconds per generated token its requests measured, and the
        batch they decoded at."""
        return {name: v for name, rate in self._rates.items() if (v := rate.value) is not None}

    @property
    def lane_share(self) -> float | None:
        """The share of max_tokens the Lane's requests generated, whatever their policy."""
        return self._lane_share.value

    def output_tokens(self, max_tokens: int, *, policy: str = "") -> int:
        """Tokens a request allowed `max_tokens` is expected to generate
        (`admission.expected_output`)."""
        return admission.expected_output(
            max_tokens,
            share=self._share[policy].value if policy in self._share else None,
            lane_share=self._lane_share.value,
            typical=self._completion.value,
        )

    def replica_view(
        self,
        index: int,
        *,
        slots: int,
        running: Sequence[admission.Running],
        context_per_slot: int | None = None,
        parked_bytes: int = 0,
        parked_bytes_max: int = 0,
        kv_bytes_per_token: int = 0,
        draft_batch_max: int | None = None,
    ) -> admission.ReplicaView:
        """The replica as admission sees it, with the parking figures its dispatcher
        keeps (what the engine's Park answers said, and the Lane's bound)."""
        own = self._replicas.get(index, self._lane)

        def pick(mine: _Ratio | _Mean, lanes: _Ratio | _Mean) -> float | None:
            """The replica's own figure, else the Lane's."""
            return mine.value if mine.value is not None else lanes.value

        lane = self._lane
        step = own.step.line() or lane.step.line()
        draft_step = own.draft_step.line() or lane.draft_step.line()
        prefill = own.prefill_line(lane, alone=False)
        lone = own.lone_prefill.line() or lane.lone_prefill.line()
        overhead = pick(own.start_overhead, lane.start_overhead)
        lone_overhead = pick(own.lone_start_overhead, lane.lone_start_overhead)
        park = pick(own.park, lane.park)
        line = pick(own.line_share, lane.line_share)
        view = admission.ReplicaView(
            index=index,
            slots=slots,
            running=tuple(running),
            context_per_slot=context_per_slot,
            prefill_tokens_per_s=1.0 / prefill[1] if prefill and prefill[1] > 0 else None,
            prefill_fixed_s=prefill[0] if prefill else 0.0,
            lone_prefill_tokens_per_s=1.0 / lone[1] if lone and lone[1] > 0 else None,
            lone_prefill_fixed_s=lone[0] if lone else 0.0,
            lone_start_overhead_s=lone_overhead,
            step_s=step[0] + step[1] if step else None,
            step_growth_s=step[1] if step else 0.0,
            draft_step_s=draft_step[0] + draft_step[1] if draft_step else None,
            draft_step_growth_s=draft_step[1] if draft_step else 0.0,
            tokens_per_step=pick(own.per_step, lane.per_step) or 1.0,
            draft_batch_max=draft_batch_max,
            start_overhead_s=overhead or 0.0,
            line_share=1.0 if line is None else line,
            park_s=park or 0.0,
            kv_bytes_per_token=kv_bytes_per_token,
            parked_bytes=parked_bytes,
            parked_bytes_max=parked_bytes_max,
        )
        if park is None:
            # Before any park is measured: the engine parks between two decode steps,
            # so a park waits for the step in flight, one step at the batch running
            # now (measured parks on Machine E took 144-236 ms beside drafting steps
            # of about that), not no time at all.
            view = replace(view, park_s=view.step_of(max(1, len(running))) or 0.0)
        return view


def in_flight_token_rates(
    runs: Iterable[tuple[str, float, int]],
) -> dict[str, admission.TokenRate]:
    """By policy, seconds per token of its runs in flight: (policy, seconds since the
    first token, tokens decoded since) each, read as the ratio of the sums, at a batch
    not known. A run that has decoded nothing since its first token tells nothing."""
    seconds: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for policy, spent, decoded in runs:
        if decoded > 0 and spent > 0:
            seconds[policy] = seconds.get(policy, 0.0) + spent
            tokens[policy] = tokens.get(policy, 0) + decoded
    return {policy: admission.TokenRate(seconds[policy] / tokens[policy]) for policy in seconds}
