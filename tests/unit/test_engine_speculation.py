"""Speculative decoding's pure parts: n-gram drafting, verification, the on/off policy."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from blazar.api import replicas
from blazar.engine import speculation as sp
from blazar.engine import speculator

# --- NgramProposer -------------------------------------------------------------------


def _reference(tokens: Sequence[int], ngram_size: int, k: int) -> tuple[int, ...]:
    """The definition, by full scan: latest earlier occurrence of the longest suffix,
    what followed it, and past the sequence's end that same stretch again (a loop)."""
    for n in range(min(ngram_size, len(tokens)), 0, -1):
        suffix = list(tokens[-n:])
        for end in range(len(tokens) - 2, n - 2, -1):
            if list(tokens[end - n + 1 : end + 1]) == suffix:
                loop = list(tokens[end + 1 :])
                return tuple((loop * k)[:k])
    return ()


@pytest.mark.parametrize(
    ("tokens", "ngram_size", "k", "expected"),
    [
        ([], 3, 4, ()),
        ([7], 3, 4, ()),
        ([1, 2, 3, 4], 3, 4, ()),  # nothing recurs
        # A trigram hit whose continuation runs into the suffix itself.
        ([1, 2, 3, 9, 1, 2, 3], 3, 4, (9, 1, 2, 3)),
        ([1, 2, 3, 9, 1, 2, 3], 3, 2, (9, 1)),  # capped by max_draft_tokens
        ([5, 2, 3, 8, 6, 2, 3], 3, 4, (8, 6, 2, 3)),  # no trigram: falls back to the bigram (2, 3)
        ([5, 3, 8, 6, 2, 3], 3, 4, (8, 6, 2, 3)),  # only the unigram 3 recurs
        ([1, 2, 4, 1, 2, 5, 1, 2], 2, 3, (5, 1, 2)),  # the most recent occurrence wins
        ([1, 2, 4, 1, 2, 5, 1, 2], 3, 3, (5, 1, 2)),  # trigram (5,1,2) absent -> bigram
        # Latest earlier (4, 4) ends at 2: one token follows, and the run goes on.
        ([4, 4, 4, 4], 2, 3, (4, 4, 4)),
        ([1, 2, 3, 1, 2, 3], 1, 4, (1, 2, 3, 1)),  # ngram_size 1; the loop goes on
        ([7, 1, 2, 1, 2, 1, 2], 2, 5, (1, 2, 1, 2, 1)),  # a loop of two tokens
    ],
)
def test_ngram_proposals(
    tokens: list[int], ngram_size: int, k: int, expected: tuple[int, ...]
) -> None:
    p = sp.NgramProposer(ngram_size=ngram_size, max_draft_tokens=k)
    p.extend(tokens)
    assert p.propose() == expected
    assert _reference(tokens, ngram_size, k) == expected


@pytest.mark.parametrize(("limit", "expected"), [(None, (9, 1, 2)), (2, (9, 1)), (0, ()), (-1, ())])
def test_ngram_limit(limit: int | None, expected: tuple[int, ...]) -> None:
    p = sp.NgramProposer(ngram_size=2, max_draft_tokens=3)
    p.extend([1, 2, 9, 1, 2])
    assert p.propose(limit) == expected


@pytest.mark.parametrize(
    ("tokens", "ngram_size", "min_match", "expected"),
    [
        # The trigram (1, 2, 3) recurs, but the match is only 3 long (0 != 9).
        ([0, 1, 2, 3, 7, 9, 1, 2, 3], 3, 4, ()),
        # 4 long: the trigram hit extends backwards past ngram_size.
        ([9, 1, 2, 3, 7, 9, 1, 2, 3], 3, 4, (7, 9, 1, 2)),
        ([8, 9, 1, 2, 3, 7, 8, 9, 1, 2, 3], 3, 6, ()),  # 5 long
        ([5, 8, 9, 1, 2, 3, 7, 5, 8, 9, 1, 2, 3], 3, 6, (7, 5, 8, 9)),
        ([1, 2, 3, 7, 1, 2, 3], 3, 4, ()),  # the hit starts the sequence: 3 long
        ([5, 3, 8, 6, 2, 3], 3, 2, ()),  # only a unigram recurs
        ([1, 2, 3, 7, 1, 2, 3], 3, 3, (7, 1, 2, 3)),  # min_match <= ngram_size: as before
        ([4, 4, 4, 4, 4, 4], 2, 4, (4, 4, 4, 4)),  # self-overlapping run, 4 long
    ],
)
def test_ngram_min_match(
    tokens: list[int], ngram_size: int, min_match: int, expected: tuple[int, ...]
) -> None:
    p = sp.NgramProposer(ngram_size=ngram_size, max_draft_tokens=4, min_match=min_match)
    p.extend(tokens)
    assert p.propose() == expected


def test_drafter_for_ngram_asks_for_long_matches() -> None:
    launch = replicas.SpeculationLaunch(
        kind="ngram",
        max_draft_tokens=4,
        disable_above_batch=4,
        min_acceptance_rate=0.3,
        ngram_size=3,
    )
    d = sp.drafter_for(launch)
    assert d is not None
    assert d.min_match == sp.NGRAM_MIN_MATCH
    short = [1, 2, 3, 9, 1, 2, 3]
    assert d.propose([sp.DraftRequest(seq=0, tokens=short, max_tokens=4)]) == {0: ()}
    run = list(range(100, 100 + sp.NGRAM_MIN_MATCH))
    out = d.propose([sp.DraftRequest(seq=0, tokens=[*run, 7, *run], max_tokens=4)])
    assert out == {0: (7, *run[:3])}


def test_ngram_incremental_matches_full_scan() -> None:
    rng = random.Random(7)
    p = sp.NgramProposer(ngram_size=3, max_draft_tokens=5)
    tokens: list[int] = []
    for _ in range(600):
        tok = rng.randrange(12)
        tokens.append(tok)
        p.append(tok)
        assert p.propose() == _reference(tokens, 3, 5)


def test_ngram_truncate_and_reset_forget_the_tail() -> None:
    p = sp.NgramProposer(ngram_size=2, max_draft_tokens=4)
    p.extend([1, 2, 8, 8, 3, 1, 2])
    assert p.propose() == (8, 8, 3, 1)
    p.truncate(5)  # [1, 2, 8, 8, 3]
    p.extend([1, 2])
    assert p.propose() == (8, 8, 3, 1)
    p.truncate(3)  # [1, 2, 8]: what followed (2, 8) is gone
    p.append(2)  # no earlier (8, 2): the unigram 2 at index 1 leads
    assert p.propose() == (8, 2, 8, 2)  # and that loop again
    p.truncate(10)  # longer than the sequence: no-op
    assert list(p.tokens) == [1, 2, 8, 2]
    p.reset([5, 6])
    assert p.propose() == ()
    assert list(p.tokens) == [5, 6]


@pytest.mark.parametrize(("ngram_size", "k"), [(0, 1), (1, 0)])
def test_ngram_rejects_bad_sizes(ngram_size: int, k: int) -> None:
    with pytest.raises(ValueError):
        sp.NgramProposer(ngram_size=ngram_size, max_draft_tokens=k)


def test_ngram_drafter_follows_the_sequence() -> None:
    d = sp.NgramDrafter(ngram_size=2, max_draft_tokens=3)
    seq = [1, 2, 3, 4, 1, 2]
    assert d.propose([sp.DraftRequest(seq=0, tokens=seq, max_tokens=3)]) == {0: (3, 4, 1)}
    # Grows: extended, not rebuilt.
    assert d.propose([sp.DraftRequest(seq=0, tokens=[*seq, 3], max_tokens=2)]) == {0: (4, 1)}
    # Diverges (slot reused with another prompt): rebuilt from the common prefix.
    other = [1, 2, 7, 1, 2]
    assert d.propose([sp.DraftRequest(seq=0, tokens=other, max_tokens=3)]) == {0: (7, 1, 2)}
    # Shrinks to a prefix.
    assert d.propose([sp.DraftRequest(seq=0, tokens=[1, 2], max_tokens=3)]) == {0: ()}
    # Sequences are independent; release forgets one.
    out = d.propose(
        [
            sp.DraftRequest(seq=0, tokens=[5, 6, 5], max_tokens=3),
            sp.DraftRequest(seq=1, tokens=[9, 9], max_tokens=3),
        ]
    )
    assert out == {0: (6, 5, 6), 1: (9, 9, 9)}
    d.release(1)
    d.release(1)
    assert d.propose([sp.DraftRequest(seq=1, tokens=[4], max_tokens=3)]) == {1: ()}


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([], [], 0),
        ([1], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3], [1, 5, 3], 1),
        ([4], [5], 0),
    ],
)
def test_common_prefix(a: list[int], b: list[int], expected: int) -> None:
    assert sp.common_prefix(a, b) == expected
    assert sp.common_prefix(b, a) == expected


def test_ngram_index_is_incremental() -> None:
    # 4k tokens with no repeats make a full scan per step quadratic; the index keeps
    # each append to a handful of dict writes.
    p = sp.NgramProposer(ngram_size=3, max_draft_tokens=8)
    p.extend(range(4096))
    assert sum(len(t) for t in p._index) == 4095 + 4094 + 4093
    assert p.propose() == ()


# --- verify / Speculation ------------------------------------------------------------


@pytest.mark.parametrize(
    ("draft", "sampled", "expected"),
    [
        ((), (5,), 0),
        ((1, 2, 3), (1, 2, 3, 4), 3),
        ((1, 2, 3), (1, 9, 3, 4), 1),
        ((1, 2, 3), (9, 2, 3, 4), 0),
        ((1, 2, 3), (1, 2, 9), 2),
        ((1, 2, 3), (1, 2), 2),  # sampling stopped early
    ],
)
def test_verify(draft: tuple[int, ...], sampled: tuple[int, ...], expected: int) -> None:
    assert sp.verify(draft, sampled) == expected


def test_speculation_entries() -> None:
    s = sp.Speculation(seq=2, position=10, pending=7, draft=(8, 9))
    assert s.entries() == [(7, 10, 2, True), (8, 11, 2, True), (9, 12, 2, True)]
    assert sp.Speculation(seq=0, position=0, pending=1).entries() == [(1, 0, 0, True)]


@pytest.mark.parametrize(
    ("draft", "target", "emitted", "accepted", "rollback", "rows_sampled"),
    [
        ((), (4,), (4,), 0, None, 1),  # no draft: a plain decode step
        ((8, 9), (8, 9, 4), (8, 9, 4), 2, None, 3),  # all accepted + the bonus token
        ((8, 9), (8, 5, 4), (8, 5), 1, 12, 2),  # second rejected: drop position 12 on
        ((8, 9), (3, 9, 4), (3,), 0, 11, 1),  # first rejected: drop both drafts
    ],
)
def test_speculation_resolve(
    draft: tuple[int, ...],
    target: tuple[int, ...],
    emitted: tuple[int, ...],
    accepted: int,
    rollback: int | None,
    rows_sampled: int,
) -> None:
    s = sp.Speculation(seq=0, position=10, pending=7, draft=draft)
    rows: list[int] = []

    def sample(i: int) -> int:
        rows.append(i)
        return target[i]

    out = s.resolve(sample)
    assert out == sp.Outcome(
        emitted=emitted, drafted=len(draft), accepted=accepted, rollback_from=rollback
    )
    assert out.kept_drafts == draft[:accepted]
    assert out.accepted == sp.verify(draft, target)
    # Rows are sampled in order and never past the first rejection (the chain accepts
    # every sampled token, so extra samples would corrupt penalties and grammar).
    assert rows == list(range(rows_sampled))


@pytest.mark.parametrize(
    ("draft", "target", "emitted", "accepted", "rollback"),
    [
        ((8, 9), (8, None), (8,), 1, 12),  # ended on an accepted draft token
        ((8, 9), (3, None), (3,), 0, 11),  # ended on a rejection (never asks row 1)
        ((8, 9), (None,), (), 0, 11),  # ended before anything was sampled
        ((8, 9), (8, 9, None), (8, 9), 2, None),  # ended with every draft accepted
    ],
)
def test_speculation_resolve_stops_when_the_request_ends(
    draft: tuple[int, ...],
    target: tuple[int | None, ...],
    emitted: tuple[int, ...],
    accepted: int,
    rollback: int | None,
) -> None:
    s = sp.Speculation(seq=0, position=10, pending=7, draft=draft)
    out = s.resolve(lambda i: target[i])
    assert (out.emitted, out.accepted, out.rollback_from) == (emitted, accepted, rollback)


@pytest.mark.parametrize(
    ("tokens", "count", "expected"),
    [
        ([1, 2, 3, 4, 5], 1, sp.Speculation(seq=3, position=4, pending=5)),
        ([1, 2, 3, 4, 5], 3, sp.Speculation(seq=3, position=2, pending=3, draft=(4, 5))),
        ([7], 1, sp.Speculation(seq=3, position=0, pending=7)),
    ],
)
def test_speculation_fed(tokens: list[int], count: int, expected: sp.Speculation) -> None:
    assert sp.Speculation.fed(seq=3, tokens=tokens, count=count) == expected


@pytest.mark.parametrize(("tokens", "count"), [([1, 2], 0), ([1, 2], 3), ([], 1)])
def test_speculation_fed_rejects_bad_counts(tokens: list[int], count: int) -> None:
    with pytest.raises(ValueError):
        sp.Speculation.fed(seq=0, tokens=tokens, count=count)


def test_sample_then_compare_emits_the_target_stream_seed_for_seed() -> None:
    """Speculation changes how many positions a step evaluates, never what comes out."""
    rng_plain, rng_spec = random.Random(3), random.Random(3)

    def target_next(prefix: Sequence[int], rng: random.Random) -> int:
        # A toy "model": a distribution depending on the last token, one draw per call.
        return (prefix[-1] * 3 + rng.randrange(3)) % 11

    plain = [1]
    while len(plain) < 60:
        plain.append(target_next(plain, rng_plain))

    drafter = sp.NgramDrafter(ngram_size=2, max_draft_tokens=4)
    spec = [1]
    while len(spec) < 60:
        draft = drafter.propose([sp.DraftRequest(seq=0, tokens=spec, max_tokens=4)])[0]
        step = sp.Speculation(seq=0, position=len(spec) - 1, pending=spec[-1], draft=draft)

        def sample(i: int, draft: tuple[int, ...] = draft) -> int:
            return target_next([*spec, *draft[:i]], rng_spec)

        spec.extend(step.resolve(sample).emitted)
    assert spec[:60] == plain


# --- SpeculationPolicy ---------------------------------------------------------------


def _policy(**kw: float) -> sp.SpeculationPolicy:
    args: dict[str, float] = {
        "max_draft_tokens": 4,
        "disable_above_batch": 2,
        "min_acceptance_rate": 0.5,
        "window": 8,
        "warmup": 4,
        "probe_every": 3,
        "probe_tokens": 2,
    }
    args.update(kw)
    return sp.SpeculationPolicy(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("active", "room", "expected"),
    [(1, None, 4), (2, None, 4), (3, None, 0), (1, 2, 2), (1, 0, 0), (1, -3, 0)],
)
def test_budget_by_batch_and_room(active: int, room: int | None, expected: int) -> None:
    p = _policy()
    p.begin(0)
    assert p.draft_budget(0, active=active, room=room) == expected


def test_batch_skips_are_counted() -> None:
    p = _policy()
    p.draft_budget(0, active=3)
    p.draft_budget(1, active=3)
    assert p.totals.batch_skips == 2


def test_low_acceptance_pauses_after_warmup_then_probes() -> None:
    p = _policy()
    p.begin(0)
    # Warm-up: 3 drafted, 0 accepted -> still below the 4-token warm-up.
    p.record(0, drafted=3, accepted=0)
    assert p.draft_budget(0, active=1) == 4
    p.record(0, drafted=1, accepted=0)  # 4 seen, rate 0 < 0.5 -> paused
    assert p.sequence(0).state is sp.DraftState.PAUSED
    assert p.totals.disabled == 1
    assert [p.draft_budget(0, active=1) for _ in range(3)] == [0, 0, 2]  # probe every 3 steps
    p.record(0, drafted=2, accepted=0)  # a bad probe: wait again
    assert [p.draft_budget(0, active=1) for _ in range(3)] == [0, 0, 2]
    # The probe proposed nothing (no n-gram hit): probe again next step.
    p.record(0, drafted=0, accepted=0)
    assert p.draft_budget(0, active=1) == 2
    p.record(0, drafted=2, accepted=1)  # good enough -> speculating again
    assert p.sequence(0).state is sp.DraftState.SPECULATING
    assert p.totals.reenabled == 1
    assert p.draft_budget(0, active=1) == 4
    # Fresh warm-up after resuming: one bad step does not pause it again.
    p.record(0, drafted=3, accepted=0)
    assert p.sequence(0).state is sp.DraftState.SPECULATING


def test_good_acceptance_keeps_speculating_and_window_forgets() -> None:
    p = _policy()
    p.begin(0)
    for _ in range(10):
        p.record(0, drafted=4, accepted=4)
    assert p.sequence(0).state is sp.DraftState.SPECULATING
    # Window of 8: two bad steps (8 rejected) push the rate to 0 -> paused.
    p.record(0, drafted=4, accepted=0)
    assert p.sequence(0).state is sp.DraftState.SPECULATING  # 4 of 8 = 0.5, not below
    p.record(0, drafted=4, accepted=0)
    assert p.sequence(0).state is sp.DraftState.PAUSED


def test_counters() -> None:
    p = _policy()
    p.begin(0)
    p.begin(1)
    p.record(0, drafted=4, accepted=3)
    p.record(1, drafted=2, accepted=2)
    p.record(1, drafted=0, accepted=0)
    assert p.sequence(0) == sp.SequenceCounters(drafted=4, accepted=3)
    assert p.sequence(1) == sp.SequenceCounters(drafted=2, accepted=2)
    assert p.totals.drafted == 6
    assert p.totals.accepted == 5
    assert p.totals.acceptance_rate == pytest.approx(5 / 6)
    assert sp.PolicyCounters().acceptance_rate == 0.0
    p.begin(0)  # a new request: per-sequence counters restart, totals stay
    assert p.sequence(0) == sp.SequenceCounters()
    assert p.totals.drafted == 6
    p.release(1)
    assert p.sequence(1) == sp.SequenceCounters()
    # A sequence the loop forgot to begin is tracked on first use.
    p.record(5, drafted=1, accepted=1)
    assert p.sequence(5).drafted == 1


@pytest.mark.parametrize(("drafted", "accepted"), [(2, 3), (2, -1)])
def test_record_rejects_impossible_counts(drafted: int, accepted: int) -> None:
    with pytest.raises(ValueError):
        _policy().record(0, drafted=drafted, accepted=accepted)


def test_disabled_requests_count_switched_off_sequences() -> None:
    p = _policy()
    p.begin(0)
    p.begin(1)
    p.begin(2)
    p.record(0, drafted=4, accepted=0)  # paused by acceptance
    assert p.sequence(0).switched_off
    p.draft_budget(1, active=3)  # skipped by batch size
    assert p.sequence(1).switched_off
    p.record(2, drafted=4, accepted=4)
    assert not p.sequence(2).switched_off
    for seq in (0, 1, 2):
        p.release(seq)
    assert p.totals.disabled_requests == 2
    p.begin(0)
    p.draft_budget(0, active=3)
    p.begin(0)  # a new request in the same slot counts the old one
    assert p.totals.disabled_requests == 3
    p.release(7)  # never begun: nothing to count
    assert p.totals.disabled_requests == 3


def test_min_rate_zero_never_pauses() -> None:
    p = _policy(min_acceptance_rate=0.0)
    for _ in range(20):
        p.record(0, drafted=4, accepted=0)
    assert p.sequence(0).state is sp.DraftState.SPECULATING


@pytest.mark.parametrize(
    ("launch", "drafter"),
    [
        (
            replicas.SpeculationLaunch(
                kind="ngram",
                max_draft_tokens=6,
                disable_above_batch=3,
                min_acceptance_rate=0.4,
                ngram_size=2,
            ),
            True,
        ),
        (
            replicas.SpeculationLaunch(
                kind="model",
                max_draft_tokens=6,
                disable_above_batch=3,
                min_acceptance_rate=0.4,
                draft_model_path="/d.gguf",
            ),
            False,
        ),
    ],
)
def test_from_launch(launch: replicas.SpeculationLaunch, drafter: bool) -> None:
    p = sp.SpeculationPolicy.from_launch(launch)
    assert (p.max_draft_tokens, p.disable_above_batch, p.min_acceptance_rate) == (6, 3, 0.4)
    d = sp.drafter_for(launch)
    assert (d is not None) == drafter
    if d is not None:
        assert (d.ngram_size, d.max_draft_tokens) == (2, 6)


class _Copies:
    """A drafter that always has as many tokens as it is asked for."""

    def propose(self, requests: Sequence[sp.DraftRequest]) -> dict[int, tuple[int, ...]]:
        return {r.seq: tuple(range(r.max_tokens)) for r in requests}

    def release(self, seq: int) -> None:
        pass


@pytest.mark.parametrize(("streams", "drafted"), [(1, 7), (4, 8), (6, 7)])
def test_speculator_cuts_drafts_to_one_full_pass(streams: int, drafted: int) -> None:
    policy = sp.SpeculationPolicy(
        max_draft_tokens=8, disable_above_batch=8, min_acceptance_rate=0.3
    )
    spec = speculator.Speculator("fake", policy, _Copies())
    candidates = [speculator.Candidate(seq, [1, 2, 3], room=100) for seq in range(streams)]
    feeds = dict.fromkeys(range(streams), 1)
    out = spec.draft(candidates, active=streams, feeds=feeds, spare=200)
    assert [len(d) for d in out.values()] == [drafted] * streams


def test_speculator_keeps_a_probe_without_cutting_the_other_drafts() -> None:
    policy = sp.SpeculationPolicy(
        max_draft_tokens=8, disable_above_batch=8, min_acceptance_rate=0.3
    )
    policy.begin(3)
    policy.record(3, drafted=16, accepted=0)  # paused: probes now and then
    assert policy.sequence(3).state is sp.DraftState.PAUSED
    for _ in range(policy.probe_every - 1):
        policy.draft_budget(3, active=4)
    spec = speculator.Speculator("fake", policy, _Copies())
    candidates = [speculator.Candidate(seq, [1, 2, 3], room=100) for seq in range(4)]
    out = spec.draft(candidates, active=4, feeds=dict.fromkeys(range(4), 1), spare=200)
    assert [len(out[seq]) for seq in range(4)] == [8, 8, 8, policy.probe_tokens]


def test_a_filler_counts_in_the_totals_but_not_in_the_window() -> None:
    """Fillers are decoded because they cost nothing: their rejections must not pause
    the sequence's own drafting."""
    p = _policy()
    p.begin(0)
    for _ in range(4):
        p.record(0, drafted=4, accepted=0, filler=True)
    assert p.sequence(0).state is sp.DraftState.SPECULATING
    assert (p.totals.drafted, p.totals.accepted) == (16, 0)


def test_speculator_fills_a_sequence_with_no_match_where_it_costs_nothing() -> None:
    """Three sequences copy a long text (their drafts need an 8-token match, and have
    one); the fourth has only a short recurring n-gram. Decoding one row beside three
    9-row drafts costs a pass of its own, so its weak proposal is filled in to the
    common length, counted as a filler; two such sequences beside two drafting ones
    would make the step dearer, and are left plain."""
    copied = list(range(100, 120)) * 2
    short = [7, 8, 9, 1, 2, 3, 4, 5, 6, 10, 11, 12, 7, 8, 9]

    def drafts(texts: list[list[int]]) -> tuple[dict[int, tuple[int, ...]], frozenset[int]]:
        policy = sp.SpeculationPolicy(
            max_draft_tokens=8, disable_above_batch=8, min_acceptance_rate=0.3
        )
        drafter = sp.NgramDrafter(ngram_size=3, max_draft_tokens=8, min_match=8)
        spec = speculator.Speculator("ngram", policy, drafter)
        candidates = [speculator.Candidate(s, t, room=100) for s, t in enumerate(texts)]
        feeds = dict.fromkeys(range(len(texts)), 1)
        out = spec.draft(candidates, active=len(texts), feeds=feeds, spare=200)
        return out, spec.fillers

    out, fillers = drafts([copied, copied, copied, short])
    assert [len(out[s]) for s in range(4)] == [8, 8, 8, 8]
    assert out[3] == (1, 2, 3, 4, 5, 6, 10, 11)
    assert fillers == {3}
    out, fillers = drafts([copied, copied, short, short])
    assert [len(out[s]) for s in range(4)] == [8, 8, 0, 0]
    assert fillers == frozenset()
