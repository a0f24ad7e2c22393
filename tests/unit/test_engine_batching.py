"""Pure decisions of the decode loop: slot choice, what a cache may keep, step packing."""

from __future__ import annotations

import random

import pytest

from blazar.engine import batching
from blazar.engine.batching import FreeSlot, Logits, Piece, Placement, Want

LONG = list(range(1, 201))  # a 200-token prompt
D8 = tuple(range(500, 508))  # an 8-token draft


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([], [], 0),
        ([1, 2, 3], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3], [1, 9, 3], 1),
        ([5], [1], 0),
    ],
)
def test_common_prefix(a: list[int], b: list[int], expected: int) -> None:
    assert batching.common_prefix(a, b) == expected
    assert batching.common_prefix(b, a) == expected


@pytest.mark.parametrize(
    ("prompt", "free", "expected"),
    [
        # Nothing cached anywhere: the lowest-index empty slot.
        ([1, 2, 3], [FreeSlot(0, []), FreeSlot(1, [])], Placement(0, 0)),
        # The longest shared prefix wins over recency.
        (
            LONG,
            [FreeSlot(0, LONG[:100], 9), FreeSlot(1, LONG[:150], 1), FreeSlot(2, [], 0)],
            Placement(1, 150),
        ),
        # Equal prefixes: the least recently used of them.
        (
            LONG,
            [FreeSlot(0, [*LONG[:100], 0], 5), FreeSlot(1, [*LONG[:100], 7], 2)],
            Placement(1, 100),
        ),
        # The whole prompt cached: keep all but its last token, which is re-evaluated.
        (LONG, [FreeSlot(0, [*LONG, 7, 8], 1)], Placement(0, 199)),
        (LONG, [FreeSlot(0, LONG, 1)], Placement(0, 199)),
        # Only BOS shared: no match, so an empty slot rather than evicting a cache.
        ([1, 50, 51, 52], [FreeSlot(0, [1, 9, 9, 9], 1), FreeSlot(1, [], 0)], Placement(1, 0)),
        # No match and no empty slot: the least recently used, whatever it holds,
        # keeping nothing (a shared BOS is not worth keeping).
        ([1, 50, 51, 52], [FreeSlot(0, [1, 9], 7), FreeSlot(1, [1, 8], 3)], Placement(1, 0)),
        (
            [1, 50, 51, 52],
            [FreeSlot(0, [1, *range(9, 30)], 1), FreeSlot(1, [1, 8, 8], 3)],
            Placement(0, 0),
        ),
        # A long cache nobody came back to goes before a recent, shorter conversation,
        # so one old prompt cannot leave two live conversations one slot to share.
        (
            list(range(3000, 3700)),
            [FreeSlot(0, list(range(1100)), 1), FreeSlot(1, list(range(5000, 5700)), 5)],
            Placement(0, 0),
        ),
        # A short prompt keeps a prefix when it is half of the prompt ...
        ([1, 2, 3, 4], [FreeSlot(0, [1, 2, 9], 1), FreeSlot(1, [], 0)], Placement(0, 2)),
        # ... and 64 shared tokens are worth keeping however long the prompt is.
        (
            list(range(1000)),
            [FreeSlot(0, [*list(range(64)), 0], 1), FreeSlot(1, [], 0)],
            Placement(0, 64),
        ),
        (
            list(range(1000)),
            [FreeSlot(0, [*list(range(63)), 0], 1), FreeSlot(1, [], 0)],
            Placement(1, 0),
        ),
        # A long cache does not match a prompt that shares only its BOS: the request
        # takes the empty slot and the cache survives for its own conversation.
        ([0, 5], [FreeSlot(0, list(range(1401)), 1), FreeSlot(1, [], 0)], Placement(1, 0)),
        # ... nor one that shares less than half of it.
        (
            list(range(600)),
            [FreeSlot(0, [*range(600), *range(5000, 5700)], 1), FreeSlot(1, [], 0)],
            Placement(1, 0),
        ),
        # A one-token prompt keeps nothing (its only token must be evaluated).
        ([1], [FreeSlot(0, [1, 2], 1)], Placement(0, 0)),
    ],
)
def test_choose_slot(prompt: list[int], free: list[FreeSlot], expected: Placement) -> None:
    assert batching.choose_slot(prompt, free) == expected


def test_choose_slot_passes_over_a_prefix_its_window_cannot_keep() -> None:
    # Slot 0 was restored with only its last 512 positions (of 1,000); the prompt
    # shares 900 tokens, so evaluation resumes at 900, which needs [389, 900).
    cached = list(range(1000))
    prompt = [*range(900), 5000, 5001]
    restored = FreeSlot(0, cached, 5, pos_min=488)
    empty = FreeSlot(1, [], 0, pos_min=-1)
    assert batching.choose_slot(prompt, [restored, empty], n_swa=512) == Placement(1, 0)
    # The whole cache is there: it matches.
    full = FreeSlot(0, cached, 5, pos_min=0)
    assert batching.choose_slot(prompt, [full, empty], n_swa=512) == Placement(0, 900)
    # A prompt that extends the restored sequence resumes inside its window.
    longer = [*cached, 7, 8]
    assert batching.choose_slot(longer, [restored, empty], n_swa=512) == Placement(0, 1000)


def test_choose_slot_keeps_a_prefix_only_for_the_scope_that_cached_it() -> None:
    """A slot another tenant's request filled keeps nothing for this one (its cached
    tokens would tell this caller whether its prompt matched the other's), and is
    weighed as any slot whose cache would be lost."""
    theirs = FreeSlot(0, LONG, 5, scope="a")
    empty = FreeSlot(1, [], 0, pos_min=-1, scope="b")
    assert batching.choose_slot(LONG, [theirs, empty], scope="a") == Placement(0, len(LONG) - 1)
    assert batching.choose_slot(LONG, [theirs, empty], scope="b") == Placement(1, 0)
    assert batching.choose_slot(LONG, [theirs], scope="") == Placement(0, 0)


def test_choose_slot_without_reuse_takes_an_empty_or_lru_slot() -> None:
    free = [FreeSlot(0, LONG, 4), FreeSlot(1, [3], 2), FreeSlot(2, [4], 1)]
    assert batching.choose_slot(LONG, free, reuse=False) == Placement(2, 0)


@pytest.mark.parametrize(
    ("index", "busy", "expected"),
    [
        (2, set(), 1),
        (2, {0}, 1),
        (2, {1}, 0),
        (2, {3}, 0),
        (2, {1, 3}, -1),
        (0, {1}, 0),
        (5, {4}, 0),
    ],
)
def test_new_runs(index: int, busy: set[int], expected: int) -> None:
    assert batching.new_runs(index, busy) == expected


def test_choose_slot_keeps_busy_sequences_together() -> None:
    # 6 slots, 0-2 and 4 busy, 3 and 5 free: 3 joins the two runs, 5 would start a third.
    # Slot 3 wins though it holds a cache and 5 is empty and least recently used.
    free = [FreeSlot(3, [9] * 50, 7), FreeSlot(5, [], 0)]
    assert batching.choose_slot(LONG, free, busy={0, 1, 2, 4}) == Placement(3, 0)
    # Beside one run (slot 1, next to 0) beats apart from every run (slot 4).
    free = [FreeSlot(1, [], 3), FreeSlot(4, [], 0)]
    assert batching.choose_slot(LONG, free, busy={0, 2}) == Placement(1, 0)
    assert batching.choose_slot(LONG, free, busy={0}) == Placement(1, 0)
    # Nothing busy: as before, the empty or least recently used slot.
    assert batching.choose_slot(LONG, free) == Placement(4, 0)


def test_choose_slot_prefers_a_kept_prefix_to_keeping_sequences_together() -> None:
    # The cached conversation in slot 5 saves its whole prefill; it wins over slot 1.
    free = [FreeSlot(1, [], 0), FreeSlot(5, LONG[:150], 2)]
    assert batching.choose_slot(LONG, free, busy={0, 2}) == Placement(5, 150)
    # Between two equal prefixes, the slot beside the busy ones.
    free = [FreeSlot(1, LONG[:150], 2), FreeSlot(5, LONG[:150], 1)]
    assert batching.choose_slot(LONG, free, busy={0}) == Placement(1, 150)


def test_choose_slot_needs_a_free_slot() -> None:
    with pytest.raises(ValueError):
        batching.choose_slot([1], [])


@pytest.mark.parametrize(
    ("common", "pos_min", "n_swa", "expected"),
    [
        (0, 0, 0, 0),
        (100, -1, 0, 0),  # empty sequence
        (100, 0, 0, 100),  # full cache, no window
        (100, 5, 0, 0),  # without a window every position is needed
        (1000, 0, 512, 1000),  # full-size SWA cache
        (1000, 489, 512, 1000),  # position 1000 sees [489, 1000]: all there
        (1000, 490, 512, 0),  # position 489 is gone
        (699, 188, 512, 699),  # a restored 700-token state holds [188, 700)
        (600, 188, 512, 0),  # ... which cannot resume further back
        (300, 0, 512, 300),
        (300, 10, 512, 0),
    ],
)
def test_reusable_prefix(common: int, pos_min: int, n_swa: int, expected: int) -> None:
    assert batching.reusable_prefix(common, pos_min=pos_min, n_swa=n_swa) == expected


def piece(slot: int, tokens: int, logits: Logits, *, decode: bool = False) -> Piece:
    return Piece(slot, tokens, logits, decode=decode)


@pytest.mark.parametrize(
    ("wants", "max_tokens", "max_outputs", "expected"),
    [
        ([], 512, 64, []),
        # Decode tokens and prefill chunks together, returned in slot order.
        (
            [Want(0, prefill=100), Want(1, decode=1), Want(2, decode=1)],
            512,
            64,
            [
                piece(0, 100, Logits.LAST),
                piece(1, 1, Logits.ALL, decode=True),
                piece(2, 1, Logits.ALL, decode=True),
            ],
        ),
        # The oldest job is served first when the budget is short, but the batch still
        # goes in slot order (out-of-order streams run twice as slowly in llama.cpp).
        (
            [Want(2, prefill=400), Want(0, prefill=300)],
            512,
            64,
            [piece(0, 112, Logits.NONE), piece(2, 400, Logits.LAST)],
        ),
        (
            [Want(3, decode=1), Want(1, decode=1), Want(2, decode=1)],
            512,
            64,
            [
                piece(1, 1, Logits.ALL, decode=True),
                piece(2, 1, Logits.ALL, decode=True),
                piece(3, 1, Logits.ALL, decode=True),
            ],
        ),
        # A long prompt is chunked to the room left after the decode tokens.
        (
            [Want(0, decode=1), Want(1, prefill=1000), Want(2, prefill=30)],
            512,
            64,
            [piece(0, 1, Logits.ALL, decode=True), piece(1, 511, Logits.NONE)],
        ),
        # Two prompts share a step when both fit.
        (
            [Want(1, prefill=300), Want(2, prefill=100)],
            512,
            64,
            [piece(1, 300, Logits.LAST), piece(2, 100, Logits.LAST)],
        ),
        (
            [Want(1, prefill=300), Want(2, prefill=400)],
            512,
            64,
            [piece(1, 300, Logits.LAST), piece(2, 212, Logits.NONE)],
        ),
        # Prompt logprobs: every position is an output, so the chunk is output-bound.
        (
            [Want(0, decode=1), Want(1, prefill=500, prompt_logits=True)],
            512,
            64,
            [piece(0, 1, Logits.ALL, decode=True), piece(1, 63, Logits.ALL)],
        ),
        # No output left for a prompt's last token: stop one short of the end.
        (
            [Want(0, prefill=10, prompt_logits=True), Want(1, prefill=5)],
            512,
            10,
            [piece(0, 10, Logits.ALL), piece(1, 4, Logits.NONE)],
        ),
        # A one-token remainder with no output left waits for the next step.
        ([Want(0, prefill=1)], 512, 0, []),
        # Speculation: several tokens of one sequence, each with logits.
        (
            [Want(0, decode=5), Want(1, decode=1)],
            512,
            64,
            [piece(0, 5, Logits.ALL, decode=True), piece(1, 1, Logits.ALL, decode=True)],
        ),
        # A sequence whose tokens do not fit waits; smaller ones still go.
        (
            [Want(0, decode=5), Want(1, decode=1)],
            4,
            64,
            [piece(1, 1, Logits.ALL, decode=True)],
        ),
        # Token budget exactly used up by the first prompt.
        (
            [Want(0, prefill=512), Want(1, prefill=3)],
            512,
            64,
            [piece(0, 512, Logits.LAST)],
        ),
    ],
)
def test_plan_step(
    wants: list[Want], max_tokens: int, max_outputs: int, expected: list[Piece]
) -> None:
    pieces = batching.plan_step(wants, max_tokens=max_tokens, max_outputs=max_outputs)
    assert pieces == expected
    assert sum(p.tokens for p in pieces) <= max_tokens
    assert sum(p.outputs for p in pieces) <= max_outputs


def test_prefill_beside_decode_caps_the_prompt_chunk_only_while_others_decode() -> None:
    wants = [Want(0, decode=1), Want(1, prefill=1000), Want(2, prefill=30)]
    pieces = batching.plan_step(wants, max_tokens=512, max_outputs=64, prefill_beside_decode=96)
    assert pieces == [piece(0, 1, Logits.ALL, decode=True), piece(1, 96, Logits.NONE)]
    # Alone, a prompt takes the whole batch.
    alone = batching.plan_step(wants[1:], max_tokens=512, max_outputs=64, prefill_beside_decode=96)
    assert alone == [piece(1, 512, Logits.NONE)]


@pytest.mark.parametrize(
    ("piece_", "outputs"),
    [
        (piece(0, 7, Logits.ALL), 7),
        (piece(0, 7, Logits.LAST), 1),
        (piece(0, 7, Logits.NONE), 0),
    ],
)
def test_piece_outputs(piece_: Piece, outputs: int) -> None:
    assert piece_.outputs == outputs


@pytest.mark.parametrize(
    ("common", "prompt_len", "expected"),
    [(0, 10, False), (1, 2, True), (1, 4, False), (2, 4, True), (64, 10_000, True)],
)
def test_worth_keeping(common: int, prompt_len: int, expected: bool) -> None:
    assert batching.worth_keeping(common, prompt_len) is expected


# --- forward passes and draft trimming --------------------------------------------


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ({}, []),
        ({0: 9, 1: 9, 2: 9, 3: 9}, [36]),
        # Uneven drafts: every sequence's shortest share, then what the longer have left.
        ({0: 9, 1: 9, 2: 9, 3: 9, 4: 8, 5: 8}, [48, 4]),
        ({0: 9, 1: 8, 2: 1, 3: 8, 4: 1, 5: 1}, [6, 14, 1, 7]),
        # Ids that are not consecutive are passes of their own.
        ({0: 1, 2: 1, 4: 1, 5: 1}, [1, 1, 2]),
        ({3: 2, 4: 2, 0: 0}, [4]),
    ],
)
def test_passes_follow_llamas_sequential_equal_split(
    counts: dict[int, int], expected: list[int]
) -> None:
    assert batching.passes(counts) == expected


def test_pass_cost_prefers_rows_in_groups_of_four() -> None:
    cost = batching.pass_cost
    assert cost(0) == 0
    # 8 rows cost less than 9 and less than two passes of 4.
    assert cost(8) < cost(9) and cost(8) < 2 * cost(4)
    assert cost(48) < cost(54) and cost(48) / 48 < cost(36) / 36
    # One pass per step is cheaper than the same rows in two.
    assert batching.step_cost({i: 8 for i in range(6)}) < batching.step_cost(
        {0: 9, 1: 9, 2: 9, 3: 9, 4: 8, 5: 8}
    )


DRAFT = tuple(range(100, 108))  # 8 drafted tokens


@pytest.mark.parametrize(
    ("feeds", "drafts", "expected"),
    [
        ({}, {}, {}),
        # One sequence: 8 rows of 9; 4 rows; 3 rows are not worth more than 1.
        ({0: 1}, {0: DRAFT}, {0: DRAFT[:7]}),
        ({0: 1}, {0: DRAFT[:3]}, {0: DRAFT[:3]}),
        ({0: 1}, {0: DRAFT[:2]}, {0: ()}),
        # Four sequences drafting 8 fill one pass of 36 rows.
        ({i: 1 for i in range(4)}, dict.fromkeys(range(4), DRAFT), dict.fromkeys(range(4), DRAFT)),
        # Six: one pass of 48 (7 each), not 54 with 2 left over, nor 52 in two passes.
        ({i: 1 for i in range(6)}, dict.fromkeys(range(6), DRAFT), dict.fromkeys(range(6), DRAFT[:7])),
        # Sequences that do not draft yet beside ones that do: the drafts stay whole
        # (cutting some would split the step further).
        ({i: 1 for i in range(6)}, {0: DRAFT, 1: DRAFT, 3: DRAFT},
         {0: DRAFT, 1: DRAFT, 3: DRAFT}),
        # A 1-token draft beside 8-token ones costs a pass of its own: dropped.
        ({i: 1 for i in range(4)}, {0: DRAFT, 1: DRAFT, 2: DRAFT, 3: DRAFT[:1]},
         {0: DRAFT, 1: DRAFT, 2: DRAFT, 3: ()}),
    ],
)  # fmt: skip
def test_trim_drafts_picks_the_cheapest_shape_per_row(
    feeds: dict[int, int],
    drafts: dict[int, tuple[int, ...]],
    expected: dict[int, tuple[int, ...]],
) -> None:
    assert batching.trim_drafts(drafts, feeds) == expected


def test_a_probe_keeps_its_draft_and_cuts_no_others() -> None:
    feeds = {i: 1 for i in range(4)}
    drafts = {0: DRAFT, 1: DRAFT, 2: DRAFT, 3: DRAFT[:3]}
    # Counted as holding, the probe's 3 tokens would cut the others to 3 (4 x 4 rows in
    # one pass); as a probe, it is kept and they keep their 8.
    assert batching.trim_drafts(drafts, feeds) == dict.fromkeys(range(4), DRAFT[:3])
    assert batching.trim_drafts(drafts, feeds, probes={3}) == {
        0: DRAFT,
        1: DRAFT,
        2: DRAFT,
        3: DRAFT[:3],
    }
    # A probe alone is kept whatever it costs.
    assert batching.trim_drafts({0: DRAFT[:2]}, {0: 1}, probes={0}) == {0: DRAFT[:2]}


def _rows_per_cost(feeds: dict[int, int], drafts: dict[int, tuple[int, ...]]) -> float:
    counts = {seq: n + len(drafts.get(seq, ())) for seq, n in feeds.items()}
    return sum(counts.values()) / batching.step_cost(counts)


def test_trim_drafts_never_loses_to_the_whole_drafts_or_none() -> None:
    rng = random.Random(7)
    for _ in range(500):
        slots = rng.sample(range(8), rng.randint(1, 8))
        feeds = dict.fromkeys(slots, 1)
        drafts = {seq: tuple(range(rng.randint(0, 8))) for seq in slots if rng.random() < 0.7}
        out = batching.trim_drafts(drafts, feeds)
        assert out.keys() == drafts.keys()
        assert all(drafts[seq][: len(d)] == d for seq, d in out.items())
        best = _rows_per_cost(feeds, out)
        assert best >= _rows_per_cost(feeds, drafts) - 1e-12
        assert best >= _rows_per_cost(feeds, {}) - 1e-12


def _free(*indexes: int, cached: tuple[int, ...] = ()) -> list[FreeSlot]:
    return [FreeSlot(i, [7] * (5 if i in cached else 0)) for i in indexes]


@pytest.mark.parametrize(
    ("busy", "movable", "free", "expected"),
    [
        # One run already, or none: nothing to gain.
        ({0, 1, 2}, {0: 5, 1: 5, 2: 5}, _free(3, 4), None),
        (set(), {}, _free(0, 1), None),
        # 0, 1, 3, 4 -> the smallest cache moves into the hole.
        ({0, 1, 3, 4}, {0: 50, 1: 50, 3: 50, 4: 20}, _free(2, 5), (4, 2)),
        ({0, 1, 3, 4}, {0: 10, 1: 50, 3: 50, 4: 20}, _free(2, 5), (0, 2)),
        # Only a move that leaves fewer runs: 0 and 3 of 0, 2, 3 could go to 1.
        ({0, 2, 3}, {2: 1}, _free(1, 4, 5), None),
        ({0, 2, 3}, {0: 9, 2: 1}, _free(1, 4, 5), (0, 1)),
        # Between free slots that serve alike: the one whose cache is smaller to copy.
        ({1, 4}, {4: 9}, _free(0, 2, cached=(2,)), (4, 0)),
        ({1, 4}, {4: 9}, _free(0, 2, cached=(0,)), (4, 2)),
    ],
)  # fmt: skip
def test_compaction_gathers_the_busy_slots_with_the_cheapest_move(
    busy: set[int],
    movable: dict[int, int],
    free: list[FreeSlot],
    expected: tuple[int, int] | None,
) -> None:
    assert batching.compaction(busy, movable, free) == expected


def test_runs_counts_consecutive_busy_ids() -> None:
    assert [batching.runs(b) for b in (set(), {3}, {0, 1, 2}, {0, 2, 3}, {0, 2, 4})] == [
        0,
        1,
        1,
        2,
        3,
    ]


def test_compaction_counts_runs_as_a_recount_would() -> None:
    rng = random.Random(11)
    for _ in range(300):
        slots = rng.randint(2, 12)
        busy = set(rng.sample(range(slots), rng.randint(1, slots - 1)))
        free = [FreeSlot(i, []) for i in range(slots) if i not in busy]
        movable = {i: rng.randint(1, 9) for i in busy if rng.random() < 0.7}
        move = batching.compaction(busy, movable, free)
        best = min(
            (batching.runs(busy - {src} | {dst.index}) for src in movable for dst in free),
            default=batching.runs(busy),
        )
        if move is None:
            assert best >= batching.runs(busy) or batching.runs(busy) <= 1
        else:
            src, dst = move
            assert src in movable and dst not in busy
            assert batching.runs(busy - {src} | {dst}) == best < batching.runs(busy)


@pytest.mark.parametrize(
    ("drafts", "feeds", "fillers", "expected"),
    [
        # 9, 9, 9 and 1 rows: passes of 4 and 24, as dear as one of 36.
        ({0: D8, 1: D8, 2: D8}, {0: 1, 1: 1, 2: 1, 3: 1}, {3: D8}, {0: D8, 1: D8, 2: D8, 3: D8}),
        # 9, 9, 1, 1: passes of 4 and 16 cost less than one of 36: left plain.
        ({0: D8, 1: D8}, {0: 1, 1: 1, 2: 1, 3: 1}, {2: D8, 3: D8}, {0: D8, 1: D8}),
        # Six sequences, five drafting 7: passes of 6 and 35 against one of 48.
        (
            {s: D8[:7] for s in range(5)},
            dict.fromkeys(range(6), 1),
            {5: D8},
            {**{s: D8[:7] for s in range(5)}, 5: D8[:7]},
        ),
        # A filler shorter than the common length would leave the step uneven.
        ({0: D8, 1: D8, 2: D8}, {0: 1, 1: 1, 2: 1, 3: 1}, {3: D8[:5]}, {0: D8, 1: D8, 2: D8}),
        # Nobody drafts: nothing to join.
        ({}, {0: 1, 1: 1}, {1: D8}, {}),
    ],
)
def test_pad_drafts_fills_where_the_step_costs_no_more(
    drafts: dict[int, tuple[int, ...]],
    feeds: dict[int, int],
    fillers: dict[int, tuple[int, ...]],
    expected: dict[int, tuple[int, ...]],
) -> None:
    out = batching.pad_drafts(drafts, feeds, fillers)
    assert {seq: d for seq, d in out.items() if d} == expected
