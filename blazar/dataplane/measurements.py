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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from blazar._proto.v1 import inference_pb2
from blazar.dataplane import admission

# Weight of the newest request in every moving average: about the last ten requests
# make the figure, so it follows a change of load within a few seconds of traffic.
WEIGHT = 0.2

# Characters per prompt token before the Lane has measured its own ratio (the usual
# rule of thumb for English text and BPE vocabularies). A ticket's prompt size weighs
# only its own prefill, which counts as no time until a prefill rate is measured too.
DEFAULT_CHARS_PER_TOKEN = 4.0


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


# Below this spread of measured batch sizes (variance, in sequences squared) a slope
# of step time against batch would be a guess: the step time is then one figure.
_MIN_BATCH_VARIANCE = 0.25


@dataclass
class _StepFit:
    """Seconds per decode step as a line in the batch (sequences decoded together), by
    weighted least squares over moving sums: each request weighs its decode steps. A
    step's time grows with the batch (every sequence's row goes through the output
    matrix), so a figure measured at one batch misjudges another."""

    steps: _Mean = field(default_factory=_Mean)
    batch: _Mean = field(default_factory=_Mean)
    seconds: _Mean = field(default_factory=_Mean)
    batch2: _Mean = field(default_factory=_Mean)
    batch_seconds: _Mean = field(default_factory=_Mean)

    def add(self, *, seconds: float, steps: int, batch: float) -> None:
        """`steps` decode steps that took `seconds` in all at a mean `batch`."""
        self.steps.add(steps)
        self.batch.add(steps * batch)
        self.seconds.add(seconds)
        self.batch2.add(steps * batch * batch)
        self.batch_seconds.add(batch * seconds)

    def line(self) -> tuple[float, float] | None:
        """(seconds per step at batch 1, seconds more per extra sequence); None before
        anything was measured."""
        w, b, s = self.steps.value, self.batch.value, self.seconds.value
        if not w or b is None or s is None:
            return None
        mean_b, mean_s = b / w, s / w
        variance = (self.batch2.value or 0.0) / w - mean_b * mean_b
        if mean_b <= 0 or variance < _MIN_BATCH_VARIANCE:
            return mean_s, 0.0
        slope = ((self.batch_seconds.value or 0.0) / w - mean_b * mean_s) / variance
        slope = max(0.0, slope)
        at_one = mean_s - slope * (mean_b - 1.0)
        if at_one <= 0.0:
            # The line would cross zero below the batches seen: proportional instead.
            return mean_s / max(mean_b, 1.0), mean_s / max(mean_b, 1.0)
        return at_one, slope


@dataclass
class _Rates:
    # Prompt tokens prefilled (cached ones excluded) over seconds of prefill.
    prefill: _Ratio = field(default_factory=_Ratio)
    # Seconds of decode per decode step, by batch.
    step: _StepFit = field(default_factory=_StepFit)
    # Tokens decoded over decode steps (above 1 with accepted speculative drafts).
    per_step: _Ratio = field(default_factory=_Ratio)

    def record(self, final: inference_pb2.Final) -> None:
        usage, timings = final.usage, final.timings
        fresh = usage.prompt_tokens - usage.cached_tokens
        if fresh > 0 and timings.prefill_ms > 0:
            self.prefill.add(fresh, timings.prefill_ms / 1000.0)
        # The first token comes out of the prefill; every later one out of a decode
        # step, which yields one token plus the drafts it accepted.
        decoded = usage.completion_tokens - 1
        steps = decoded - final.routing.accepted_tokens
        if steps > 0 and timings.decode_ms > 0:
            # An engine that does not report its batch decoded alone as far as we know.
            batch = timings.decode_batch or 1.0
            self.step.add(seconds=timings.decode_ms / 1000.0, steps=steps, batch=batch)
            self.per_step.add(decoded, steps)


class LaneMeasurements:
    """The moving averages of one Lane and of each of its replicas (by index)."""

    def __init__(self) -> None:
        self._lane = _Rates()
        self._replicas: dict[int, _Rates] = {}
        self._completion = _Mean()
        self._chars_per_token = _Ratio()

    def record(self, replica: int, final: inference_pb2.Final, *, prompt_chars: int) -> None:
        """A request that finished on `replica`, and the characters of its prompt."""
        self._lane.record(final)
        self._replicas.setdefault(replica, _Rates()).record(final)
        self._completion.add(final.usage.completion_tokens)
        if final.usage.prompt_tokens > 0 and prompt_chars > 0:
            self._chars_per_token.add(prompt_chars, final.usage.prompt_tokens)

    @property
    def completion_tokens(self) -> float | None:
        """The Lane's typical completion length in tokens; None before any request ends."""
        return self._completion.value

    def prompt_tokens(self, chars: int) -> int:
        """An estimate of a prompt's tokens from its characters, before tokenizing it."""
        ratio = self._chars_per_token.value or DEFAULT_CHARS_PER_TOKEN
        return max(1, math.ceil(chars / ratio))

    def output_tokens(self, max_tokens: int) -> int:
        """Tokens a request allowed `max_tokens` is expected to generate."""
        typical = self._completion.value
        return max_tokens if typical is None else min(max_tokens, math.ceil(typical))

    def replica_view(
        self,
        index: int,
        *,
        slots: int,
        running: Sequence[admission.Running],
        parked_bytes: int = 0,
        parked_bytes_max: int = 0,
        kv_bytes_per_token: int = 0,
    ) -> admission.ReplicaView:
        """The replica as admission sees it, with the parking figures its dispatcher
        keeps (what the engine's Park answers said, and the Lane's bound)."""
        own = self._replicas.get(index, self._lane)

        def pick(mine: _Ratio, lanes: _Ratio) -> float | None:
            return mine.value if mine.value is not None else lanes.value

        lane = self._lane
        step = own.step.line() or lane.step.line()
        return admission.ReplicaView(
            index=index,
            slots=slots,
            running=tuple(running),
            prefill_tokens_per_s=pick(own.prefill, lane.prefill),
            step_s=step[0] if step else None,
            step_growth_s=step[1] if step else 0.0,
            tokens_per_step=pick(own.per_step, lane.per_step) or 1.0,
            kv_bytes_per_token=kv_bytes_per_token,
            parked_bytes=parked_bytes,
            parked_bytes_max=parked_bytes_max,
        )
