"""The Lane's measurements as admission reads them: moving ratios of what engines report."""

from __future__ import annotations

import math

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.dataplane import admission
from blazar.dataplane.measurements import (
    DEFAULT_CHARS_PER_TOKEN,
    LATENESS_MAX,
    LATENESS_MIN,
    LATENESS_WINDOW,
    LaneMeasurements,
)


def final(
    *,
    prompt: int = 100,
    cached: int = 0,
    completion: int = 11,
    prefill_ms: float = 100.0,
    decode_ms: float = 1000.0,
    accepted: int = 0,
    batch: float = 0.0,
    prefill_batch: float = 0.0,
) -> inference_pb2.Final:
    return inference_pb2.Final(
        usage=inference_pb2.Usage(
            prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
        ),
        timings=inference_pb2.Timings(
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            decode_batch=batch,
            prefill_batch=prefill_batch,
        ),
        routing=inference_pb2.Routing(accepted_tokens=accepted),
    )


def test_nothing_measured_is_none_not_a_guess() -> None:
    m = LaneMeasurements()
    view = m.replica_view(0, slots=4, running=())
    assert (view.prefill_tokens_per_s, view.step_s, view.tokens_per_step) == (None, None, 1.0)
    assert m.completion_tokens is None
    assert m.output_tokens(300) == 300
    assert m.prompt_tokens(400) == 400 / DEFAULT_CHARS_PER_TOKEN


def test_one_request_gives_the_rates_it_ran_at() -> None:
    m = LaneMeasurements()
    # 90 tokens prefilled in 0.1 s; 10 tokens after the first in 1 s of decode.
    m.record(0, final(cached=10), prompt_chars=300)
    view = m.replica_view(0, slots=4, running=())
    assert view.prefill_tokens_per_s == pytest.approx(900.0)
    assert view.step_s == pytest.approx(0.1)
    assert view.tokens_per_step == 1.0
    assert m.completion_tokens == 11
    assert m.output_tokens(300) == 11 and m.output_tokens(5) == 5
    assert m.prompt_tokens(300) == 100


def test_accepted_drafts_make_fewer_longer_steps() -> None:
    m = LaneMeasurements()
    # 20 tokens after the first, 10 of them accepted drafts: 10 steps of 0.1 s, on a
    # Lane whose SpecPair drafts up to a batch of 4.
    m.record(
        0, final(completion=21, accepted=10, decode_ms=1000.0), prompt_chars=0, draft_batch_max=4
    )
    view = m.replica_view(0, slots=1, running=())
    assert (view.step_s, view.draft_step_s) == (None, pytest.approx(0.1))
    assert view.tokens_per_step == pytest.approx(2.0)
    assert view.decode_s(20) == pytest.approx(1.0)


def test_a_long_prefill_weighs_more_than_a_short_one() -> None:
    m = LaneMeasurements()
    m.record(0, final(prompt=1000, prefill_ms=500.0), prompt_chars=0)  # 2,000 tokens/s
    m.record(0, final(prompt=5, prefill_ms=50.0), prompt_chars=0)  # 100 tokens/s, fixed costs
    rate = m.replica_view(0, slots=1, running=()).prefill_tokens_per_s
    assert rate is not None and rate > 1000


def test_a_replica_without_measurements_reads_the_lanes() -> None:
    m = LaneMeasurements()
    m.record(1, final(prefill_ms=200.0), prompt_chars=0)
    m.record(0, final(prefill_ms=100.0), prompt_chars=0)
    assert m.replica_view(0, slots=1, running=()).prefill_tokens_per_s == pytest.approx(1000)
    assert m.replica_view(1, slots=1, running=()).prefill_tokens_per_s == pytest.approx(500)
    fresh = m.replica_view(2, slots=1, running=()).prefill_tokens_per_s
    assert fresh is not None and 500 < fresh < 1000


def test_the_view_carries_slots_and_runs_and_cannot_park() -> None:
    running = (admission.Running("a", 0, tokens_left=5, kv_tokens=50),)
    view = LaneMeasurements().replica_view(3, slots=2, running=running)
    assert (view.index, view.slots, view.running, view.parked_bytes_max) == (3, 2, running, 0)


def test_step_time_is_a_line_in_the_batch_it_was_measured_at() -> None:
    """Requests that decoded alone (10 ms a step) and four at a time (25 ms a step):
    5 ms more per extra sequence, so a forecast at batch 4 is not one at batch 1."""
    m = LaneMeasurements()
    for _ in range(3):
        m.record(0, final(completion=11, decode_ms=100.0, batch=1.0), prompt_chars=0)
        m.record(0, final(completion=11, decode_ms=250.0, batch=4.0), prompt_chars=0)
    view = m.replica_view(0, slots=4, running=())
    assert view.step_s == pytest.approx(0.010)
    assert view.step_growth_s == pytest.approx(0.005)
    assert view.decode_s(10, batch=4) == pytest.approx(0.25)


@pytest.mark.parametrize("batch", [0.0, 1.0, 3.0])
def test_one_batch_size_measured_gives_one_step_time(batch: float) -> None:
    """No spread of batch sizes, no slope to read (0: an engine that does not say)."""
    m = LaneMeasurements()
    m.record(0, final(completion=11, decode_ms=200.0, batch=batch), prompt_chars=0)
    m.record(0, final(completion=21, decode_ms=400.0, batch=batch), prompt_chars=0)
    view = m.replica_view(0, slots=4, running=())
    assert (view.step_s, view.step_growth_s) == (pytest.approx(0.02), 0.0)


def test_a_line_that_would_cross_zero_is_proportional_instead() -> None:
    """Steps measured at batches 2 and 4 so steep that batch 1 would take no time."""
    m = LaneMeasurements()
    for _ in range(3):
        m.record(0, final(completion=11, decode_ms=100.0, batch=2.0), prompt_chars=0)
        m.record(0, final(completion=11, decode_ms=400.0, batch=4.0), prompt_chars=0)
    view = m.replica_view(0, slots=4, running=())
    assert view.step_s is not None and view.step_s > 0
    assert view.step_growth_s == pytest.approx(view.step_s)


def test_a_prefill_has_a_fixed_part_and_a_rate() -> None:
    """Short prompts cost mostly the step they join: 40 ms + 1 ms a token here. A rate
    read from them alone (20 tokens in 60 ms: 333 tokens/s) would put a 1,209-token
    prompt at 3.6 s; the line puts it at 1.25 s, as measured."""
    m = LaneMeasurements()
    for tokens in (20, 60, 20, 300, 20, 60):
        m.record(0, final(prompt=tokens, prefill_ms=40.0 + tokens), prompt_chars=0)
    view = m.replica_view(0, slots=4, running=())
    assert view.prefill_fixed_s == pytest.approx(0.040)
    assert view.prefill_s(1209) == pytest.approx(1.249)
    assert m.expected_prefill_s(0, 1209) == pytest.approx(1.249)


def test_a_prompt_alone_is_fitted_apart_from_every_prompt() -> None:
    """Prompts that shared their steps (a burst's, or one beside decoding streams)
    each report the whole time of steps that also carried the others: 25 tokens in
    200 ms. The first of a burst, alone on an idle replica, took 50 ms: a prompt
    forecast alone reads its own fit, any other the fit of every prompt."""
    m = LaneMeasurements()
    for _ in range(5):
        m.record(0, final(prompt=25, prefill_ms=200.0, prefill_batch=4.0), prompt_chars=0)
    m.record(0, final(prompt=25, prefill_ms=50.0, prefill_batch=1.0), prompt_chars=0)
    view = m.replica_view(0, slots=4, running=())
    # The moving average of every prompt: 200 ms, then 50 ms at weight 0.2.
    assert view.prefill_s(25) == pytest.approx(0.170)
    assert view.prefill_s(25, alone=True) == pytest.approx(0.050)
    assert m.expected_prefill_s(0, 25) == pytest.approx(0.170)
    assert m.expected_prefill_s(0, 25, alone=True) == pytest.approx(0.050)
    # Another replica reads the Lane's figures, both kinds.
    other = m.replica_view(1, slots=4, running=())
    assert other.prefill_s(25, alone=True) == pytest.approx(0.050)


@pytest.mark.parametrize("prefill_batch", [1.0, 3.0, 0.0])
def test_a_prefill_alone_reads_as_any_until_measured(prefill_batch: float) -> None:
    """0.0: an engine that does not tell (an upstream Lane) is not alone."""
    m = LaneMeasurements()
    m.record(0, final(prompt=100, prefill_ms=100.0, prefill_batch=prefill_batch), prompt_chars=0)
    view = m.replica_view(0, slots=4, running=())
    assert view.prefill_s(100) == pytest.approx(0.1)
    assert view.prefill_s(100, alone=True) == pytest.approx(0.1)
    assert m.expected_prefill_s(0, 100, alone=True) == pytest.approx(0.1)


def test_the_start_overhead_is_what_first_tokens_took_beyond_the_prefill() -> None:
    m = LaneMeasurements()
    assert m.replica_view(0, slots=1, running=()).start_overhead_s == 0.0
    m.record_first_token(0, overhead_s=0.05)
    m.record_first_token(0, overhead_s=-1.0)  # sooner than predicted: counted as none
    overhead = m.replica_view(0, slots=1, running=()).start_overhead_s
    assert overhead == pytest.approx(0.05 * 0.8)
    # A replica without its own figure reads the Lane's.
    assert m.replica_view(1, slots=1, running=()).start_overhead_s == pytest.approx(overhead)


def test_a_start_alone_has_its_own_overhead_against_its_own_prefill() -> None:
    """Shared starts came 0.1 s past their fit (what their shared steps took beyond
    it), a start alone 0.01 s past the fit of prompts alone: the forecast of a prompt
    alone adds its own 0.01 s, not the shared starts' 0.1 s."""
    m = LaneMeasurements()
    m.record(0, final(prompt=100, prefill_ms=100.0, prefill_batch=1.0), prompt_chars=0)
    m.record_first_token(0, overhead_s=0.1)
    view = m.replica_view(0, slots=1, running=())
    # No start alone measured yet: the one overhead there is.
    assert view.prefill_s(100, alone=True) == pytest.approx(0.2)
    m.record_first_token(0, overhead_s=0.01, alone=True)
    view = m.replica_view(0, slots=1, running=())
    assert view.start_overhead_s == pytest.approx(0.1)
    assert view.prefill_s(100) == pytest.approx(0.2)
    assert view.prefill_s(100, alone=True) == pytest.approx(0.11)
    assert m.replica_view(1, slots=1, running=()).prefill_s(100, alone=True) == pytest.approx(0.11)


def test_the_line_share_is_measured_per_replica_within_0_and_1() -> None:
    """1 (prompts one after another, whole) until a queued prompt measured it; a
    replica that has not measured it reads the Lane's; samples out of [0, 1] count at
    the bound."""
    m = LaneMeasurements()
    assert m.replica_view(0, slots=4, running=()).line_share == 1.0
    m.record_line(0, share=0.5)
    assert m.replica_view(0, slots=4, running=()).line_share == pytest.approx(0.5)
    assert m.replica_view(1, slots=4, running=()).line_share == pytest.approx(0.5)
    m.record_line(1, share=3.0)
    assert m.replica_view(1, slots=4, running=()).line_share == pytest.approx(1.0)
    m.record_line(0, share=-1.0)
    assert m.replica_view(0, slots=4, running=()).line_share == pytest.approx(0.4)


def test_each_policy_has_its_share_of_max_tokens() -> None:
    """Batch jobs ran to their 256 tokens and chat turns stopped at a quarter of theirs:
    the Lane's mean (about 100) would make a running batch job end far too soon."""
    m = LaneMeasurements()
    for _ in range(3):
        m.record(0, final(completion=256), prompt_chars=0, policy="batch", max_tokens=256)
        m.record(0, final(completion=16), prompt_chars=0, policy="chat", max_tokens=64)
    assert m.output_tokens(256, policy="batch") == 256
    assert m.output_tokens(64, policy="chat") == 16
    assert m.output_tokens(2000, policy="chat") == 500
    # A policy not seen yet: the larger of the Lane's typical completion and its share
    # of max_tokens over every policy (272 of 320 here, a moving ratio).
    lane_share = m.lane_share or 0.0
    assert lane_share > 0.5
    typical = m.completion_tokens or 0.0
    assert m.output_tokens(256, policy="new") == math.ceil(max(typical, lane_share * 256))
    assert m.output_tokens(8, policy="new") == 8
    assert m.completion_share == {"batch": pytest.approx(1.0), "chat": pytest.approx(0.25)}


def test_a_policy_not_measured_yet_is_not_expected_to_stop_early() -> None:
    """The bench's flood: the warm-up ran 16-token requests to their end under another
    policy; 64-token requests of a policy never seen must not be expected to stop at
    16 (the forecast admitted work it then refused at its deadline)."""
    m = LaneMeasurements()
    for _ in range(5):
        m.record(0, final(completion=16), prompt_chars=0, policy="warm-up", max_tokens=16)
    assert m.output_tokens(64, policy="interactive") == 64
    # A Lane whose requests stop well short of their budget: its mean completion.
    m = LaneMeasurements()
    for _ in range(5):
        m.record(0, final(completion=100), prompt_chars=0, policy="chat", max_tokens=2000)
    assert m.output_tokens(2000, policy="other") == 100


def test_each_policy_has_its_own_seconds_per_token() -> None:
    """The mixed burst: batch jobs that copy their prompt gained 7 tokens a step, in
    slow steps full of draft rows; chat turns one a step, in fast ones. The replica's
    figures mix them; each policy keeps what its requests measured."""
    m = LaneMeasurements()
    for _ in range(3):
        m.record(
            0, final(completion=71, accepted=60, decode_ms=1800.0), prompt_chars=0, policy="batch"
        )
        m.record(
            0, final(completion=11, accepted=0, decode_ms=300.0), prompt_chars=0, policy="chat"
        )
    rates = m.token_rates
    assert {name: rate.seconds for name, rate in rates.items()} == {
        "batch": pytest.approx(0.0257, abs=1e-3),
        "chat": pytest.approx(0.03),
    }


def test_steps_where_sequences_draft_are_fitted_apart_from_steps_where_none_does() -> None:
    """A SpecPair that drafts up to a batch of 4: jobs at 2 and 4 drafting (40 and 60 ms
    a step, draft rows in each) and turns at 6 without drafts (30 ms a step). One line
    through all three would read 6 sequences as faster than 4 drafting, and 4 drafting
    as slower than it is at 6: each regime has its own."""
    m = LaneMeasurements()
    for _ in range(3):
        for batch, decode_ms, accepted in ((2.0, 400.0, 20), (4.0, 600.0, 20)):
            m.record(
                0,
                final(completion=31, accepted=accepted, decode_ms=decode_ms, batch=batch),
                prompt_chars=0,
                policy="batch",
                draft_batch_max=4,
            )
        m.record(
            0,
            final(completion=11, decode_ms=300.0, batch=6.0),
            prompt_chars=0,
            policy="chat",
            draft_batch_max=4,
        )
    view = m.replica_view(0, slots=6, running=(), draft_batch_max=4)
    # 40 ms at 2, 60 ms at 4: 30 ms at 1, 10 ms more a sequence.
    assert view.draft_step_s == pytest.approx(0.03)
    assert view.draft_step_growth_s == pytest.approx(0.01)
    assert view.step_s == pytest.approx(0.03) and view.step_growth_s == 0.0
    # Drafting steps gained 3 tokens each; the turns' plain steps are not counted there.
    assert view.tokens_per_step == pytest.approx(3.0)
    assert view.decode_s(30, batch=3) == pytest.approx(10 * 0.05)
    assert view.decode_s(30, batch=6) == pytest.approx(30 * 0.03)
    # A policy's rate is what it gains where it may draft, at the batch it ran at
    # there: the turns measured none (nothing drafts at 6), the jobs 50 ms over 3 tokens
    # at a batch of 3 on average (moving sums, which start from the first sample).
    rates = m.token_rates
    assert list(rates) == ["batch"]
    assert rates["batch"].seconds == pytest.approx(1.0 / 60, rel=0.1)
    assert rates["batch"].batch == pytest.approx(3.0, rel=0.1)


def test_a_lane_without_speculation_keeps_one_kind_of_step() -> None:
    m = LaneMeasurements()
    m.record(0, final(completion=11, decode_ms=200.0, batch=6.0), prompt_chars=0, policy="chat")
    view = m.replica_view(0, slots=6, running=())
    assert (view.step_s, view.draft_step_s) == (pytest.approx(0.02), None)
    assert m.token_rates["chat"] == admission.TokenRate(pytest.approx(0.02), pytest.approx(6.0))


def test_a_park_not_measured_yet_takes_the_step_in_flight() -> None:
    """The engine parks between two decode steps: before any park is measured, one
    takes a step at the batch running now (two runs, 10 ms a step plus 5 ms a sequence
    more), and once one is measured, what it took."""
    m = LaneMeasurements()
    for _ in range(3):
        m.record(0, final(completion=11, decode_ms=100.0, batch=1.0), prompt_chars=0)
        m.record(0, final(completion=11, decode_ms=250.0, batch=4.0), prompt_chars=0)
    running = (admission.Running("a", 0, 5, 50), admission.Running("b", 0, 5, 50))
    assert m.replica_view(0, slots=4, running=running).park_s == pytest.approx(0.015)
    assert m.replica_view(0, slots=4, running=()).park_s == pytest.approx(0.010)
    assert LaneMeasurements().replica_view(0, slots=4, running=running).park_s == 0.0
    m.record_park(0, seconds=0.2)
    assert m.replica_view(0, slots=4, running=running).park_s == pytest.approx(0.2)
    # Counted as at most its bound (the engine's copy and the step in flight).
    fresh = LaneMeasurements()
    fresh.record_park(0, seconds=0.6, bound_s=0.12)
    assert fresh.replica_view(0, slots=4, running=()).park_s == pytest.approx(0.12)
    assert m.step_s(0, batch=4, draft_batch_max=None) == pytest.approx(0.025)


def test_runs_in_flight_measure_their_policy_before_any_finishes() -> None:
    from blazar.dataplane.measurements import in_flight_token_rates

    runs = [("batch", 2.0, 40), ("batch", 1.0, 60), ("chat", 0.5, 10), ("chat", 0.3, 0)]
    # Ratio of sums (3 s over 100 tokens), and a run with nothing decoded tells nothing.
    assert in_flight_token_rates(runs) == {
        "batch": admission.TokenRate(pytest.approx(0.03)),
        "chat": admission.TokenRate(pytest.approx(0.05)),
    }
    assert in_flight_token_rates([("idle", 0.4, 0)]) == {}


def test_the_forecast_is_on_time_until_a_wait_is_measured() -> None:
    m = LaneMeasurements()
    assert m.lateness == 1.0
    # A prediction of no time has nothing to scale: it tells nothing.
    m.record_wait(predicted_s=0.0, measured_s=0.4)
    assert m.lateness == 1.0
    m.record_wait(predicted_s=1.5, measured_s=1.95)
    assert m.lateness == pytest.approx(1.3)


@pytest.mark.parametrize(
    ("measured_s", "lateness"),
    [
        # Early first tokens do not make the forecast read as early: at least 1.
        (0.5, LATENESS_MIN),
        # A forecast 10x off is broken, not late: at most 3.
        (10.0, LATENESS_MAX),
    ],
)
def test_the_lateness_is_bounded(measured_s: float, lateness: float) -> None:
    m = LaneMeasurements()
    for _ in range(LATENESS_WINDOW):
        m.record_wait(predicted_s=1.0, measured_s=measured_s)
    assert m.lateness == lateness


def test_the_lateness_is_an_upper_quantile_of_the_latest_waits() -> None:
    """Nine waits in ten came within it: the two worst of twenty move nothing, a third
    does; and the window forgets what came before its last twenty waits."""
    m = LaneMeasurements()
    for ratio in [1.1] * 9 + [1.2] * 9 + [2.5] * 2:
        m.record_wait(predicted_s=2.0, measured_s=2.0 * ratio)
    assert m.lateness == pytest.approx(1.2)
    m.record_wait(predicted_s=2.0, measured_s=5.0)  # the oldest 1.1 leaves the window
    assert m.lateness == pytest.approx(2.5)
    for _ in range(LATENESS_WINDOW):
        m.record_wait(predicted_s=2.0, measured_s=2.2)
    assert m.lateness == pytest.approx(1.1)
