"""What one Lane's admission records of its requests: the figures of each policy
(`PolicyFigures`, read by the Control API), its refusals, queue waits and gauges
(`metrics`), and what first tokens teach the Lane's measurements.

`Recording` is mixed into `dispatcher.LaneDispatcher`: its methods run on the
dispatcher's task (`first_token` on the relay's) and read and write the dispatcher's
state (the attributes declared below) as the dispatcher's own methods do; the split is
only of the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from blazar.dataplane import admission, metrics, runs
from blazar.dataplane.measurements import LaneMeasurements

# The dispatcher's logger: these lines were its own before the split.
log = structlog.get_logger("blazar.dataplane.dispatcher")


@dataclass
class PolicyFigures:
    """What one policy's requests met on one Lane since the daemon started."""

    queued: int = 0
    first_tokens: int = 0
    # First tokens within the policy's ttftTargetMs (counted only under a target).
    met: int = 0
    targeted: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    @property
    def attainment(self) -> float | None:
        return self.met / self.targeted if self.targeted else None


class Recording:
    """The figures, counters and gauges of a Lane's dispatcher (see the module docstring)."""

    lane: str
    measurements: LaneMeasurements
    figures: dict[str, PolicyFigures]
    _policies: dict[str, admission.Policy]
    _runs: runs.LaneRuns
    _line_last: dict[runs.Identity, float]

    # What the dispatcher provides.

    def queued(self) -> dict[str, int]:
        raise NotImplementedError

    def _view(self) -> admission.LaneView:
        raise NotImplementedError

    # The records.

    def first_token(self, run: runs.Run, ttft_s: float) -> None:
        """The run's first token came `ttft_s` after its arrival."""
        ticket = run.ticket
        run.first_token_at = ticket.arrived + ttft_s
        self._line_measure(run, run.first_token_at)
        if run.started_at:
            # Net of the wait the forecast gave it behind other prompts: the hop, the
            # template and the tokenizer, not the prompts prefilled before its own. Net
            # of the prefill of what its engine did prefill, when it said (the cache
            # may have held more of the prompt than the prefix index guessed, or less).
            # Nothing before the Lane has measured a prefill: the whole prefill would
            # count as overhead, and every forecast after a restart would add it.
            expected = run.expected_prefill_s
            if run.prompt_tokens is not None and run.prefix_reused is not None:
                expected = self.measurements.expected_prefill_s(
                    run.replica.index,
                    admission.fresh_tokens(run.prompt_tokens, run.prefix_reused),
                    alone=run.alone,
                )
            if expected is not None:
                spent = ticket.arrived + ttft_s - run.started_at
                overhead = spent - run.queue_s - expected
                self.measurements.record_first_token(
                    run.replica.index, overhead_s=overhead, alone=run.alone
                )
        if run.wait_forecast_s is not None:
            self.measurements.record_wait(predicted_s=run.wait_forecast_s, measured_s=ttft_s)
        # What the forecast said of this start against what came (BLAZAR_LOG_LEVEL=debug):
        # the figures an error in `bench/overload.py`'s prediction line is read from.
        log.debug(
            "admission.first_token",
            request_id=run.request_id,
            lane=self.lane,
            replica=run.replica.index,
            policy=ticket.policy.name,
            prompt_tokens=ticket.prompt_tokens,
            predicted_s=run.predicted_ttft_s,
            measured_s=ttft_s,
            alone=run.alone,
            line_wait_s=run.queue_s,
            prefill_s=run.prefill_s,
        )
        policy = ticket.policy
        figures = self._figures(policy)
        figures.first_tokens += 1
        if policy.ttft_target_s is None:
            return
        met = ttft_s <= policy.ttft_target_s
        figures.targeted += 1
        figures.met += met
        metrics.FIRST_TOKENS.labels(self.lane, policy.name, str(met).lower()).inc()
        if figures.attainment is not None:
            metrics.ATTAINMENT.labels(self.lane, policy.name).set(figures.attainment)

    def _line_measure(self, run: runs.Run, first_token_at: float) -> None:
        """A prompt that started before the first token of the prompt ahead of it on its
        replica, and had its own after it, measures the share of its prefill the
        replica's line held it for."""
        identity = runs.identity(run.replica)
        ahead = self._line_last.get(identity)
        queued = ahead is not None and run.started_at < ahead <= first_token_at
        if queued and ahead is not None and run.prefill_s > 0:
            share = (first_token_at - ahead) / run.prefill_s
            self.measurements.record_line(run.replica.index, share=share)
        self._line_last[identity] = max(ahead or 0.0, first_token_at)

    def _count_refusal(self, refusal: admission.Refuse, *, request_id: str) -> None:
        policy = refusal.ticket.policy
        reason = refusal.counted_reason
        figures = self._figures(policy)
        figures.refused[reason] = figures.refused.get(reason, 0) + 1
        metrics.REJECTIONS.labels(self.lane, policy.name, reason).inc()
        self._observe_wait(refusal.ticket, waited_s=refusal.waited_s)
        log.info(
            "admission.refused",
            request_id=request_id,
            lane=self.lane,
            policy=policy.name,
            reason=reason,
            retry_after_s=runs.rounded(refusal.retry_after_s),
            prefill_s=runs.rounded(refusal.prefill_s),
            predicted_ttft_s=runs.rounded(refusal.predicted_ttft_s),
            prompt_tokens=refusal.ticket.prompt_tokens,
            # What the forecast saw: enough to tell a wrong figure from a full Lane.
            view=[runs.summary(replica) for replica in self._view().replicas],
        )

    def _observe_wait(self, ticket: admission.Ticket, *, waited_s: float | None = None) -> None:
        """The ticket left the queue (started or refused): its wait, once a request."""
        if not ticket.restarted:
            wait = ticket.waited_s if waited_s is None else waited_s
            metrics.QUEUE_WAIT.labels(self.lane, ticket.policy.name).observe(wait)

    def _figures(self, policy: admission.Policy) -> PolicyFigures:
        return self.figures.setdefault(policy.name, PolicyFigures())

    def _gauge(self) -> None:
        depth = self.queued()
        for name in self._policies:
            count = depth.get(name, 0)
            self._figures(self._policies[name]).queued = count
            metrics.QUEUE_DEPTH.labels(self.lane, name).set(count)
        metrics.PARKED_BYTES.labels(self.lane).set(self._runs.parked_total())
