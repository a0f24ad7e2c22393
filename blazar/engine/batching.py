"""Pure decisions of the decode loop: which slot a request takes, how much of that
slot's cached prefix survives, and how one step's batch is packed.

No llama.cpp, no IO, no clock: the loop passes in what it knows and acts on the answer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class FreeSlot:
    """A slot no request is using: what its KV cache holds and when it last served."""

    index: int
    tokens: Sequence[int]
    # A counter, larger = used more recently; 0 = never.
    last_used: int = 0
    # The oldest position its cache still holds (-1: empty); above 0 when only a
    # sliding window's worth survives (a restored state).
    pos_min: int = 0
    # Whose requests filled its cache (`Job.cache_scope`).
    scope: str = ""


@dataclass(frozen=True)
class Placement:
    slot: int
    # Prompt tokens the slot's cache holds and can keep (`reusable_prefix`).
    common: int


# A shared prefix this long is always worth keeping; shorter ones must cover half the
# prompt. Keeping a few tokens (BOS, a template's opening) saves nothing and would make
# a fresh prompt's greedy output depend on what a slot happened to hold: llama.cpp's
# numerics differ between a prompt evaluated whole and one resumed at position 2.
MIN_KEEP_TOKENS = 64


def worth_keeping(common: int, prompt_len: int) -> bool:
    """Whether `common` shared tokens are worth keeping for a prompt."""
    return common > 0 and common >= min(MIN_KEEP_TOKENS, prompt_len // 2)


def choose_slot(
    prompt: Sequence[int],
    free: Sequence[FreeSlot],
    *,
    busy: Collection[int] = (),
    n_swa: int = 0,
    reuse: bool = True,
    scope: str = "",
) -> Placement:
    """Where a prompt goes, and how much of that slot's cache it keeps.

    A slot matches when the prefix the prompt would keep there is worth keeping
    (`worth_keeping`) and at least as long as what it would throw away: a shared BOS
    or template opening does not make a request wipe another conversation's long
    cache (llama.cpp's server has the same rule: the shared prefix must be half of
    what the slot holds). Among matches the longest prefix wins (ties: the least
    recently used). With none, the slot beside the most `busy` ones (`new_runs`), then
    an empty slot, else the least recently used one, which still keeps whatever of its
    cache is worth keeping. Recency rather than size decides, so a long cache nobody
    returns to does not hold its slot for ever while two other conversations evict
    each other from the remaining one.

    The shared length is capped at len(prompt) - 1: the last prompt token is always
    evaluated again, so that there are logits to sample the first new token from. A
    slot whose cache lacks part of the window the shared prefix needs (`n_swa`,
    `reusable_prefix`) keeps nothing. With reuse=False (the request needs logits for
    every prompt position) nothing is kept anywhere, and nothing is kept from a slot
    that requests of another `scope` filled (their tenant's: `Job.cache_scope`).
    """
    if not free:
        raise ValueError("no free slot")
    limit = max(len(prompt) - 1, 0)

    def kept(slot: FreeSlot) -> int:
        shared = reuse and slot.scope == scope
        common = min(common_prefix(slot.tokens, prompt), limit) if shared else 0
        common = reusable_prefix(common, pos_min=slot.pos_min, n_swa=n_swa)
        return common if worth_keeping(common, len(prompt)) else 0

    def rank(slot: FreeSlot) -> tuple[bool, int, int, int, int]:
        keep = kept(slot)
        lost = len(slot.tokens) - keep
        runs = new_runs(slot.index, busy)
        if keep > 0 and keep >= lost:
            return (False, -keep, runs, slot.last_used, slot.index)
        return (True, runs, int(lost > 0), slot.last_used, slot.index)

    best = min(free, key=rank)
    return Placement(slot=best.index, common=kept(best))


def new_runs(index: int, busy: Collection[int]) -> int:
    """How many runs of consecutive busy sequence ids taking slot `index` adds: 1 when
    neither neighbour is busy, 0 beside one, -1 when it joins two.

    With one KV stream per sequence, llama.cpp runs each run of consecutive sequence
    ids of a batch as its own forward pass (`split_equal`, sequential), and a pass
    costs the whole model's weights and output head again. Measured on the bundled
    model, 4 sequences x 1 token on a 6-slot context: 36.5 ms per step as ids 0-3,
    76.7 ms as ids 0, 2, 4, 5 (three runs).
    """
    return 1 - (index - 1 in busy) - (index + 1 in busy)


def runs(busy: Collection[int]) -> int:
    """How many runs of consecutive sequence ids `busy` holds: each is a forward pass of
    its own in every step (`new_runs`)."""
    return sum(1 for index in busy if index - 1 not in busy)


def compaction(
    busy: Collection[int], movable: Mapping[int, int], free: Sequence[FreeSlot]
) -> tuple[int, int] | None:
    """A move of one generation, from a slot of `movable` (busy slot -> tokens its cache
    holds, what the move copies) to a free slot, that leaves the `busy` slots in fewer
    runs (`runs`); None when no move does.

    Ends and parks scatter the busy slots, and new work cannot always fill the holes
    (a policy at its slot cap, say): four generations on slots 0, 1, 3 and 4 decode in
    two passes a step, for as long as they run. Moving one costs a copy of its cache,
    and of the free slot's, which goes to the slot it leaves (`slots.move`):
    milliseconds, against a pass saved every step after. Among the moves that leave the
    fewest runs, the one that copies the fewest tokens.
    """
    now = runs(busy)
    if now <= 1:
        return None
    best: tuple[tuple[int, int, int], tuple[int, int]] | None = None
    for src, tokens in movable.items():
        rest = set(busy) - {src}
        # What leaving `src` and joining the free slot each do to the runs (`new_runs`).
        left = now - new_runs(src, rest)
        for slot in free:
            after = left + new_runs(slot.index, rest)
            if after >= now:
                continue
            key = (after, tokens + len(slot.tokens), slot.index)
            if best is None or key < best[0]:
                best = (key, (src, slot.index))
    return None if best is None else best[1]


def passes(counts: Mapping[int, int]) -> list[int]:
    """The rows of each forward pass llama.cpp runs for a batch in which sequence
    (slot) `s` has `counts[s]` tokens, the batch in slot order (`plan_step`).

    With one KV stream per sequence it splits a batch into micro-batches with the same
    number of tokens from each sequence of a run of consecutive ids
    (`llama_batch_allocr::split_equal`, sequential): from the lowest id with tokens
    left, the run of consecutive ids with tokens left, each giving as many tokens as
    the fewest of them has left. Each pass costs the model's weights again.
    """
    left = {slot: n for slot, n in counts.items() if n > 0}
    out = []
    while left:
        run = [min(left)]
        while run[-1] + 1 in left:
            run.append(run[-1] + 1)
        take = min(left[slot] for slot in run)
        out.append(take * len(run))
        for slot in run:
            left[slot] -= take
            if not left[slot]:
                del left[slot]
    return out


# What one forward pass of a decoding batch costs by its rows (every row asks for
# logits), in units of one row of a pass whose rows come in groups of 4. Measured on
# the bundled model, 2 threads, raw `llama_decode` on 6 streams of 300 cached tokens
# (Machine E, 2.3-3.1 ms a unit: `bench/decode_passes.py`, docs/BENCHMARKS.md): a pass
# costs about 8 rows on its own (the model's weights are read again), each row 1, and
# each row beyond a multiple of 4 about 3 more (llama.cpp's repacked CPU kernels run
# the output head over rows in groups of 4 and the rest one by one). Up to 3 rows
# take a cheaper path, measured directly.
PASS_ROWS = 8.0
REMAINDER_ROWS = 3.0
SMALL_PASS = {1: 4.0, 2: 9.0, 3: 12.0}


def pass_cost(rows: int) -> float:
    """One pass of `rows` rows, in units of an aligned row (see `PASS_ROWS`)."""
    if rows <= 0:
        return 0.0
    if rows in SMALL_PASS:
        return SMALL_PASS[rows]
    return PASS_ROWS + rows + REMAINDER_ROWS * (rows % 4)


def step_cost(counts: Mapping[int, int]) -> float:
    """A decoding step whose sequence `s` has `counts[s]` tokens (`passes`)."""
    return sum(pass_cost(rows) for rows in passes(counts))


def trim_drafts(
    drafts: Mapping[int, Sequence[int]],
    feeds: Mapping[int, int],
    *,
    probes: Collection[int] = (),
) -> dict[int, tuple[int, ...]]:
    """Cut a step's drafts to the shape that decodes the most rows per unit of cost.

    `feeds` holds every decoding sequence's tokens before drafts (1: its pending
    token); `drafts` what some of them drafted after it. Uneven feeds split a step
    into several passes (`passes`): six sequences feeding 9, 9, 9, 9, 8 and 8 tokens
    run as one pass of 48 rows and one of 4, where 8 each is one pass of 48 (176
    against 140 ms, `bench/decode_passes.py`), and a sequence that drafts 3 beside
    others that draft 8 costs a pass of its own. So every draft is cut to one common
    length, or, with the other choice, a draft shorter than it is dropped: whichever
    length and choice gives the most rows per `step_cost`, and the fewest rows on a
    tie (counting drafts as rows that hold: whether they are worth drafting at all is
    `SpeculationPolicy`'s to say). With one sequence this keeps 8 rows of 9, 4 of 4,
    and 1 of 3.

    The drafts of `probes` (sequences whose drafting is paused for poor acceptance,
    trying a few tokens now and then) are kept as they are, and the others are cut as
    if the probes drafted nothing: counted as rows that hold, a probe's would shorten
    the others' drafts to its length, when they mostly do not hold.
    """
    kept = {seq: tuple(d) for seq, d in drafts.items() if seq in probes}
    others = {seq: d for seq, d in drafts.items() if seq not in kept}
    longest = max((len(d) for d in others.values()), default=0)
    best: dict[int, tuple[int, ...]] = {seq: () for seq in others}
    best_key = (-1.0, 0)
    for length in range(longest + 1):
        for drop_short in (False, True):
            trial = {
                seq: () if drop_short and len(d) < length else tuple(d[:length])
                for seq, d in others.items()
            }
            counts = {seq: n + len(trial.get(seq, ())) for seq, n in feeds.items()}
            rows = sum(counts.values())
            # On a tie, fewer rows: a draft is a guess.
            key = (rows / step_cost(counts), -rows) if rows else (0.0, 0)
            if key > best_key:
                best, best_key = trial, key
    return {seq: kept[seq] if seq in kept else best[seq] for seq in drafts}


def pad_drafts(
    drafts: Mapping[int, Sequence[int]],
    feeds: Mapping[int, int],
    fillers: Mapping[int, Sequence[int]],
) -> dict[int, tuple[int, ...]]:
    """Lengthen drafts with `fillers` where the step costs no more for it.

    `drafts` is a step's drafts as `trim_drafts` cut them (the drafting sequences at one
    common length), `feeds` every decoding sequence's tokens before drafts, and
    `fillers` weaker proposals for sequences that draft nothing (an n-gram match too
    short for a draft of their own). A sequence that decodes one row beside drafting
    ones costs a forward pass of its own (`passes`): three sequences feeding 9 and one
    feeding 1 run as passes of 4 and 24 rows, as dear as one pass of 36. Filled to the
    common length it joins their pass, and whatever of its filler holds is a token for
    nothing. So each filler, in sequence order, is taken (cut to the common length)
    when the step's `step_cost` does not grow; a filler shorter than that length is
    not (it would leave the step as uneven).
    """
    out = {seq: tuple(d) for seq, d in drafts.items()}
    length = max((len(d) for d in out.values()), default=0)
    if length == 0:
        return out

    def cost() -> float:
        return step_cost({seq: n + len(out.get(seq, ())) for seq, n in feeds.items()})

    now = cost()
    for seq in sorted(fillers):
        filler = tuple(fillers[seq][:length])
        if out.get(seq) or len(filler) < length or feeds.get(seq) != 1:
            continue
        out[seq] = filler
        after = cost()
        if after > now:
            out[seq] = ()
        else:
            now = after
    return out


def reusable_prefix(common: int, *, pos_min: int, n_swa: int) -> int:
    """How many of `common` cached tokens may be kept, given what the cache still holds.

    A sliding-window layer lets the token at position n see positions n - n_swa + 1
    .. n (llama.cpp's standard SWA mask). Its cache may hold only that window: a
    restored sequence state does, and so does a cache that is not full-size.
    Evaluation resumes at position `common`, so [common - n_swa + 1, common) must all
    be present, or without a window [0, common); otherwise keep nothing.
    """
    if common <= 0 or pos_min < 0:
        return 0
    oldest_needed = max(0, common - n_swa + 1) if n_swa > 0 else 0
    return common if pos_min <= oldest_needed else 0


class Logits(StrEnum):
    """Which batch entries of a piece ask for logits."""

    NONE = "none"
    LAST = "last"
    ALL = "all"


@dataclass(frozen=True)
class Want:
    """What one active sequence would put into the next batch."""

    slot: int
    # Sampled tokens to decode, each with logits: 1, or 1 verified + k drafted tokens.
    decode: int = 0
    # Prompt tokens not yet in the KV cache.
    prefill: int = 0
    # Every prefilled position needs logits (prompt logprobs), not just the last.
    prompt_logits: bool = False


@dataclass(frozen=True)
class Piece:
    """A run of consecutive tokens of one sequence in the batch."""

    slot: int
    tokens: int
    logits: Logits
    decode: bool

    @property
    def outputs(self) -> int:
        if self.logits is Logits.ALL:
            return self.tokens
        return 1 if self.logits is Logits.LAST else 0


def plan_step(
    wants: Sequence[Want],
    *,
    max_tokens: int,
    max_outputs: int,
    prefill_beside_decode: int | None = None,
) -> list[Piece]:
    """Pack one batch: decode tokens first, then prefill chunks in `wants` order.

    `max_tokens` bounds the entries (n_batch), `max_outputs` the entries with logits
    (the context's output rows; exceeding it aborts llama.cpp). A prompt's final chunk
    needs one output for its last token; when none is left the chunk stops one short.
    Decoding sequences never wait behind a prefill: a long prompt costs the others at
    most one chunk per step, and `prefill_beside_decode` (if given) caps the prompt
    tokens of a step that also decodes, so that chunk is short while others stream.

    Pieces are chosen in that order but returned in sequence (slot) order: with one
    KV stream per sequence, llama.cpp runs a batch whose sequences are out of order
    about twice as slowly (measured, 8 streams x 1 token: 80 ms against 38 ms per
    step), and reused slots make arrival order differ from slot order.
    """
    pieces: list[Piece] = []
    tokens, outputs = max_tokens, max_outputs
    for w in wants:
        if 0 < w.decode <= min(tokens, outputs):
            pieces.append(Piece(w.slot, w.decode, Logits.ALL, decode=True))
            tokens -= w.decode
            outputs -= w.decode
    if pieces and prefill_beside_decode is not None:
        tokens = min(tokens, prefill_beside_decode)
    for w in wants:
        if w.prefill <= 0 or tokens <= 0:
            continue
        n = min(w.prefill, tokens)
        if w.prompt_logits:
            n = min(n, outputs)
            logits = Logits.ALL
        elif n == w.prefill and outputs > 0:
            logits = Logits.LAST
        else:
            n = min(n, w.prefill - 1)
            logits = Logits.NONE
        if n <= 0:
            continue
        piece = Piece(w.slot, n, logits, decode=False)
        pieces.append(piece)
        tokens -= n
        outputs -= piece.outputs
    return sorted(pieces, key=lambda piece: piece.slot)
