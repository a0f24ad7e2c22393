"""Prompt chunks beside decoding streams, sized to their time-per-output-token target."""

from __future__ import annotations

import pytest

from blazar.api.prefill import MIN_CHUNK
from blazar.engine.pacing import PrefillPacer


def measured(*, decode_s: float = 0.020, per_token_s: float = 0.0005) -> PrefillPacer:
    """A pacer that has seen a 1-row decode step and a step with a 100-token chunk."""
    pacer = PrefillPacer(default=128, max_tokens=512)
    pacer.observe(rows=1, prompt_tokens=0, seconds=decode_s)
    pacer.observe(rows=1, prompt_tokens=100, seconds=decode_s + 100 * per_token_s)
    return pacer


def test_without_a_target_the_default_cap_applies() -> None:
    assert measured().budget(rows=1, target_s=None) == 128


def test_nothing_decodes_nothing_is_capped_beyond_the_default() -> None:
    assert measured().budget(rows=0, target_s=0.05) == 128


def test_unmeasured_it_does_not_guess() -> None:
    pacer = PrefillPacer(default=128, max_tokens=512)
    assert pacer.budget(rows=1, target_s=0.1) == 128
    pacer.observe(rows=1, prompt_tokens=0, seconds=0.02)
    assert pacer.budget(rows=1, target_s=0.1) == 128  # per-token cost still unknown


def test_the_chunk_fills_the_room_the_target_leaves() -> None:
    # 100 ms target, 20 ms of decoding, 0.5 ms per prompt token: 160 tokens.
    assert measured().budget(rows=1, target_s=0.100) == 160


def test_a_loose_target_lets_the_chunk_grow_to_the_batch() -> None:
    assert measured().budget(rows=1, target_s=2.0) == 512


def test_a_target_decoding_alone_misses_still_moves_the_prompt_on() -> None:
    assert measured(decode_s=0.2).budget(rows=1, target_s=0.1) == MIN_CHUNK


def test_more_rows_leave_less_room() -> None:
    pacer = measured()
    pacer.observe(rows=4, prompt_tokens=0, seconds=0.050)
    assert pacer.budget(rows=4, target_s=0.100) == 100


def test_an_unmeasured_row_count_scales_the_nearest() -> None:
    # 1 row took 20 ms: 2 rows are taken as 40 ms, leaving 60 ms for 120 tokens.
    assert measured().budget(rows=2, target_s=0.100) == 120


def test_a_prompt_alone_measures_the_per_token_cost() -> None:
    pacer = PrefillPacer(default=128, max_tokens=512)
    pacer.observe(rows=0, prompt_tokens=512, seconds=0.256)
    pacer.observe(rows=1, prompt_tokens=0, seconds=0.020)
    assert pacer.budget(rows=1, target_s=0.100) == 160


def test_measurements_are_averaged() -> None:
    pacer = measured()
    pacer.observe(rows=1, prompt_tokens=0, seconds=0.070)  # one slow step
    # 20 ms moves a fifth of the way to 70: 30 ms, leaving 70 ms for 140 tokens.
    assert pacer.decode_s(1) == pytest.approx(0.030)
    assert pacer.budget(rows=1, target_s=0.100) == 140


def test_a_step_faster_than_its_decode_alone_teaches_no_rate() -> None:
    pacer = measured()
    pacer.observe(rows=1, prompt_tokens=50, seconds=0.010)
    # The rate stays; the miss (45 ms against 10 ms) is an error to keep clear of:
    # a fifth of 35 ms, twice, leaves 100 - 20 - 14 = 66 ms for 132 tokens.
    assert pacer.budget(rows=1, target_s=0.100) == 132


def test_chunks_keep_clear_of_the_target_by_the_typical_error() -> None:
    pacer = measured()  # 20 ms + 0.5 ms a token, predicted exactly so far
    assert pacer.budget(rows=1, target_s=0.100) == 160
    pacer.observe(rows=1, prompt_tokens=100, seconds=0.080)  # predicted 70 ms: 10 ms off
    # Error 2 ms (a fifth of 10), per-token 0.52 ms: (100 - 20 - 4) / 0.52 = 146.
    assert pacer.budget(rows=1, target_s=0.100) == 146


def test_drafts_that_leave_no_room_for_the_smallest_chunk_hold_the_prompt_back() -> None:
    """4 rows took 94 ms (streams with drafts): a 100 ms target leaves 6 ms, 12 tokens
    at 0.5 ms, 4 short of the smallest chunk. Rows that are drafts come first, so no
    prompt this step; plain decoding rows still let the prompt move on by MIN_CHUNK."""
    pacer = measured()
    pacer.observe(rows=4, prompt_tokens=0, seconds=0.094)
    assert pacer.budget(rows=4, target_s=0.100, drafts=3) == 0
    assert pacer.budget(rows=4, target_s=0.100, drafts=0) == MIN_CHUNK
    # Drafts that leave room for a chunk take nothing from it.
    assert pacer.budget(rows=4, target_s=0.200, drafts=3) == 212


def test_the_pass_between_two_decodes_leaves_less_room() -> None:
    pacer = measured()
    pacer.between(0.010)
    # 100 ms target, 20 ms of decoding and 10 ms between decodes: 140 tokens.
    assert pacer.budget(rows=1, target_s=0.100) == 140
    pacer.between(0.060)
    # Averaged: a fifth of the way from 10 to 60 ms, 20 ms, leaving 60 ms: 120 tokens.
    assert pacer.budget(rows=1, target_s=0.100) == 120
