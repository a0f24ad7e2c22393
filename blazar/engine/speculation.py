"""Speculative decoding: what to draft, what the target accepts, when it is worth it.

Pure and single-threaded (the decode thread owns every object here); no llama calls,
no clock, no logging. The decode loop uses it in five moves per step:

1. `SpeculationPolicy.draft_budget` says how many tokens a sequence may draft now
   (0 = decode normally);
2. a `DraftModel` proposes that many (`NgramDrafter` here, `draft.LlamaDraftRunner`
   for a draft model); both keep themselves in step with the sequence's tokens;
3. `Speculation.entries` packs the pending token and the draft into the target's
   batch, every entry asking for logits;
4. `Speculation.resolve` samples the target's tokens row by row with the request's
   own sampler chain and stops at the first disagreement (`verify` is the same rule
   over finished lists); its `Outcome` says which tokens to emit and from which KV
   position on the rejected draft must be removed;
5. `SpeculationPolicy.record` updates the acceptance statistics.

Why "sample then compare" is exact: every emitted token is drawn by the request's
sampler from the target's logits at its position, given a prefix that is exactly the
emitted text so far (a draft token is only kept when it equals what the target drew
there). So at temperature 0 the output equals plain greedy decoding, and at
temperature > 0 every token is a sample from the target's distribution: the draft
decides only how many target positions are evaluated in one batch, never which token
comes out. Sampling stops at the first mismatch, so the chain accepts (penalty
history, grammar state) and its random draws are exactly those of plain decoding,
seed for seed. The price against rejection sampling (Leviathan et al.) is a lower
acceptance rate at high temperature, not a different distribution.

Exact in this logic, not in llama.cpp's arithmetic: the target's logits for k + 1
positions evaluated in one batch round differently from one position per step
(measured here: 0.003-0.016 nats on average, up to 0.34), so at a near-tie the text
can part from plain decoding's, as it can when requests share a batch. Neither path
is the more correct one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from blazar.api import replicas

# --- verification ------------------------------------------------------------------


def verify(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many draft tokens the target accepts: the longest prefix with d[i] == t[i].

    `sampled[i]` is the target's token from the logits at the position after the
    pending token and `draft[:i]`, so `sampled[0]` is checked against `draft[0]`.
    Tokens of `sampled` past the first mismatch are never looked at.
    """
    accepted = 0
    for d, t in zip(draft, sampled, strict=False):
        if d != t:
            break
        accepted += 1
    return accepted


@dataclass(frozen=True)
class Outcome:
    """What one verified step of one sequence produced."""

    # Tokens for the request, in order: the accepted drafts, then the target's own
    # token after them (which becomes the sequence's next pending token). Shorter
    # when the request ended part-way (see `Speculation.resolve`).
    emitted: tuple[int, ...]
    drafted: int
    accepted: int
    # First KV position holding a rejected draft token: the loop removes
    # [rollback_from, end) with `llama_memory_seq_rm`. None when all were accepted.
    rollback_from: int | None

    @property
    def kept_drafts(self) -> tuple[int, ...]:
        """Draft tokens that are now valid KV entries (append them to the slot's tokens)."""
        return self.emitted[: self.accepted]


@dataclass(frozen=True)
class Speculation:
    """One sequence's share of a target batch: its pending token plus a draft."""

    seq: int
    # KV position of `pending`: the number of tokens the sequence has cached.
    position: int
    pending: int
    draft: tuple[int, ...] = ()

    def entries(self) -> list[tuple[int, int, int, bool]]:
        """(token, position, sequence, wants_logits) rows for `llama.Runtime.decode`.

        Row i's logits give the target's token after `draft[:i]`: k + 1 rows for k
        drafted tokens, so the context needs that many outputs per sequence.
        """
        tokens = (self.pending, *self.draft)
        return [(tok, self.position + i, self.seq, True) for i, tok in enumerate(tokens)]

    @classmethod
    def fed(cls, *, seq: int, tokens: Sequence[int], count: int) -> Speculation:
        """The speculation a slot just decoded, read back from its token list.

        For a loop that appends every fed token (pending + drafts) to the slot's
        tokens before decoding: the last `count` of `tokens` are that feed.
        """
        if not 1 <= count <= len(tokens):
            raise ValueError(f"{count} fed tokens of {len(tokens)}")
        start = len(tokens) - count
        return cls(seq=seq, position=start, pending=tokens[start], draft=tuple(tokens[start + 1 :]))

    def resolve(self, sample: Callable[[int], int | None]) -> Outcome:
        """Sample row by row (`sample(i)` draws from row i of `entries`) and verify.

        Rows are sampled in order and only up to the first row whose token differs
        from the draft, because sampling also accepts the token into the chain.
        `sample` returns None when the request has already ended (the previous token
        was end-of-generation, hit a stop string or max_tokens): resolving stops there.
        """
        emitted: list[int] = []
        for i in range(len(self.draft) + 1):
            token = sample(i)
            if token is None:
                break
            emitted.append(token)
            if i == len(self.draft) or token != self.draft[i]:
                break
        accepted = verify(self.draft, emitted)
        rollback = None if accepted == len(self.draft) else self.position + 1 + accepted
        return Outcome(
            emitted=tuple(emitted),
            drafted=len(self.draft),
            accepted=accepted,
            rollback_from=rollback,
        )


# --- drafting ----------------------------------------------------------------------


@dataclass(frozen=True)
class DraftRequest:
    """Ask for up to `max_tokens` draft tokens continuing `tokens`."""

    seq: int
    # Everything the sequence holds: cached tokens plus the pending one.
    tokens: Sequence[int]
    max_tokens: int


class DraftModel(Protocol):
    """What the decode loop needs from a drafter (n-gram lookup or a draft model).

    Called from the decode thread only. A drafter keeps its own per-sequence state
    (an n-gram index, or a draft model's KV cache) in step with `tokens` by itself:
    it compares them with what it saw last time, keeps the common prefix and drops the
    rest (for a draft model: `llama_memory_seq_rm` from the first differing position),
    so rejected drafts and slot reuse need no extra call.
    """

    def propose(self, requests: Sequence[DraftRequest]) -> Mapping[int, tuple[int, ...]]:
        """Draft tokens per sequence; fewer than asked (even none) is fine."""
        ...

    def release(self, seq: int) -> None:
        """Forget a sequence (its slot was freed)."""
        ...


class NgramProposer:
    """Prompt-lookup drafting for one sequence.

    Finds the most recent earlier occurrence of the sequence's last n tokens
    (n = ngram_size down to 1) and proposes the tokens that followed it. An index
    maps each n-gram to the end of its latest occurrence that has a successor, updated
    as tokens are appended: O(ngram_size) per token, O(1) lookups per proposal.

    With `min_match` > 1 a proposal needs that occurrence to share at least the last
    `min_match` tokens with the sequence (checked backwards from the hit, so it may
    exceed ngram_size): short matches are common in any prose and rarely predict
    what follows, while text being copied matches over long stretches.
    """

    def __init__(
        self, *, ngram_size: int = 3, max_draft_tokens: int = 8, min_match: int = 1
    ) -> None:
        if ngram_size < 1 or max_draft_tokens < 1 or min_match < 1:
            raise ValueError("ngram_size, max_draft_tokens and min_match must be >= 1")
        self.ngram_size = ngram_size
        self.max_draft_tokens = max_draft_tokens
        self.min_match = min_match
        self._tokens: list[int] = []
        # n -> n-gram -> index of its last token; only n-grams that end before the
        # sequence's last token are indexed, so a hit never is the suffix itself.
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram_size + 1)]

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def reset(self, tokens: Iterable[int] = ()) -> None:
        self._tokens = []
        for table in self._index:
            table.clear()
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        seq = self._tokens
        seq.append(token)
        # The previous last token now has a successor: index the n-grams ending there.
        end = len(seq) - 2
        for n in range(1, min(self.ngram_size, end + 1) + 1):
            self._index[n][tuple(seq[end - n + 1 : end + 1])] = end

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (rebuilds the index: rare, on slot reuse)."""
        if length < len(self._tokens):
            self.reset(self._tokens[:length])

    def propose(self, limit: int | None = None, *, min_match: int | None = None) -> tuple[int, ...]:
        """Up to min(limit, max_draft_tokens) tokens; () when no n-gram recurs (or the
        match is shorter than `min_match`, by default the proposer's own)."""
        least = self.min_match if min_match is None else min_match
        k = self.max_draft_tokens if limit is None else min(limit, self.max_draft_tokens)
        seq = self._tokens
        if k <= 0 or not seq:
            return ()
        for n in range(min(self.ngram_size, len(seq)), 0, -1):
            end = self._index[n].get(tuple(seq[-n:]))
            if end is None:
                continue
            if n < least and not self._matches(end, least):
                return ()
            # An occurrence fewer than k tokens back (a run of one token, a short loop)
            # has only `period` tokens after it before the sequence ends; the text goes
            # on repeating them, so does the draft. A run drafted 1 token a step here.
            start = end + 1
            period = len(seq) - start
            return tuple(seq[start + i % period] for i in range(k))
        return ()

    def _matches(self, end: int, length: int) -> bool:
        """Whether the `length` tokens ending at `end` equal the sequence's last ones."""
        seq = self._tokens
        if end + 1 < length:
            return False
        return seq[end + 1 - length : end + 1] == seq[len(seq) - length :]


class NgramDrafter:
    """`DraftModel` over one `NgramProposer` per sequence."""

    def __init__(
        self, *, ngram_size: int = 3, max_draft_tokens: int = 8, min_match: int = 1
    ) -> None:
        self.ngram_size = ngram_size
        self.max_draft_tokens = max_draft_tokens
        self.min_match = min_match
        self._proposers: dict[int, NgramProposer] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> dict[int, tuple[int, ...]]:
        out: dict[int, tuple[int, ...]] = {}
        for req in requests:
            proposer = self._synced(req.seq, req.tokens)
            out[req.seq] = proposer.propose(req.max_tokens)
        return out

    def fill(self, requests: Sequence[DraftRequest]) -> dict[int, tuple[int, ...]]:
        """Weaker proposals (any recurring n-gram, however short its match) for
        sequences that have no draft of their own this step: only worth decoding where
        they cost nothing (`batching.pad_drafts`)."""
        return {
            req.seq: self._synced(req.seq, req.tokens).propose(req.max_tokens, min_match=1)
            for req in requests
        }

    def release(self, seq: int) -> None:
        self._proposers.pop(seq, None)

    def _synced(self, seq: int, tokens: Sequence[int]) -> NgramProposer:
        proposer = self._proposers.get(seq)
        if proposer is None:
            proposer = self._proposers[seq] = NgramProposer(
                ngram_size=self.ngram_size,
                max_draft_tokens=self.max_draft_tokens,
                min_match=self.min_match,
            )
        known = proposer.tokens
        n = len(known)
        # The usual case: the sequence only grew. Slice comparison runs in C.
        if len(tokens) >= n and list(tokens[:n]) == known:
            proposer.extend(tokens[n:])
        else:
            proposer.truncate(common_prefix(known, tokens))
            proposer.extend(tokens[len(proposer.tokens) :])
        return proposer


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


# --- policy ------------------------------------------------------------------------


class DraftState(StrEnum):
    SPECULATING = "Speculating"
    # Acceptance fell below the floor: only a small probe now and then.
    PAUSED = "Paused"


@dataclass(frozen=True)
class SequenceCounters:
    """Per request, for the routing fields of its final chunk."""

    drafted: int = 0
    accepted: int = 0
    state: DraftState = DraftState.SPECULATING
    # The batch-size or acceptance rule switched speculation off at some point.
    switched_off: bool = False


@dataclass(frozen=True)
class PolicyCounters:
    """Per engine, for Health and metrics."""

    drafted: int = 0
    accepted: int = 0
    # Times a sequence was paused for low acceptance / resumed after a good probe.
    disabled: int = 0
    reenabled: int = 0
    # Sequence-steps that did not speculate because the batch was too big.
    batch_skips: int = 0
    # Released requests that had speculation switched off at some point (either rule).
    disabled_requests: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class DraftTrack:
    """One request's drafting record (`SpeculationPolicy`): it follows the request when
    it moves to another slot or is parked, and ends with it."""

    window: deque[bool]
    state: DraftState = DraftState.SPECULATING
    drafted: int = 0
    accepted: int = 0
    # Steps until a paused sequence may probe again (<= 0: probe now).
    probe_in: int = 0
    switched_off: bool = False


class SpeculationPolicy:
    """Decides per step whether, and how far, each sequence speculates.

    Off for everyone while more than `disable_above_batch` sequences decode (the
    batch already fills the machine; extra rows only add work). Off for a sequence
    whose acceptance over its last `window` drafted tokens falls below
    `min_acceptance_rate`, once it has drafted at least `warmup` tokens; such a
    sequence drafts `probe_tokens` every `probe_every` steps and resumes when a probe
    does at least as well as the floor (text can turn copy-heavy, e.g. code edits).

    How far each draft is then cut so that the step runs as few and as full forward
    passes as it can is `batching.trim_drafts`'s.
    """

    def __init__(
        self,
        *,
        max_draft_tokens: int,
        disable_above_batch: int,
        min_acceptance_rate: float,
        window: int = 64,
        warmup: int = 16,
        probe_every: int = 32,
        probe_tokens: int = 3,
    ) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.disable_above_batch = disable_above_batch
        self.min_acceptance_rate = min_acceptance_rate
        self.window = window
        self.warmup = min(warmup, window)
        self.probe_every = probe_every
        self.probe_tokens = min(probe_tokens, max_draft_tokens)
        self._tracks: dict[int, DraftTrack] = {}
        self._drafted = 0
        self._accepted = 0
        self._disabled = 0
        self._reenabled = 0
        self._batch_skips = 0
        self._disabled_requests = 0

    @classmethod
    def from_launch(cls, launch: replicas.SpeculationLaunch) -> SpeculationPolicy:
        return cls(
            max_draft_tokens=launch.max_draft_tokens,
            disable_above_batch=launch.disable_above_batch,
            min_acceptance_rate=launch.min_acceptance_rate,
        )

    @property
    def totals(self) -> PolicyCounters:
        return PolicyCounters(
            drafted=self._drafted,
            accepted=self._accepted,
            disabled=self._disabled,
            reenabled=self._reenabled,
            batch_skips=self._batch_skips,
            disabled_requests=self._disabled_requests,
        )

    def begin(self, seq: int) -> None:
        """A new request starts in this sequence: fresh statistics."""
        self.release(seq)
        self._track(seq)

    def move(self, src: int, dst: int) -> None:
        """The request in sequence `src` goes on in `dst`, its statistics with it."""
        track = self._tracks.pop(src, None)
        if track is not None:
            self._tracks[dst] = track

    def release(self, seq: int) -> None:
        """The sequence's request ended: count it if speculation was switched off."""
        self.ended(self.detach(seq))

    def detach(self, seq: int) -> DraftTrack | None:
        """The sequence's request leaves its slot for a while (it is parked): its record
        goes with it, to come back with `attach`, or to end with `ended`."""
        return self._tracks.pop(seq, None)

    def attach(self, seq: int, track: DraftTrack | None) -> None:
        """A parked request is seated in `seq` again: it goes on with its record (a
        paused one still pauses), not a fresh one."""
        self._tracks.pop(seq, None)
        if track is not None:
            self._tracks[seq] = track

    def ended(self, track: DraftTrack | None) -> None:
        """A request ended, with this record: count it if speculation was switched off."""
        if track is not None and track.switched_off:
            self._disabled_requests += 1

    def _track(self, seq: int) -> DraftTrack:
        t = self._tracks.get(seq)
        if t is None:
            t = self._tracks[seq] = DraftTrack(window=deque(maxlen=self.window))
        return t

    def sequence(self, seq: int) -> SequenceCounters:
        t = self._tracks.get(seq)
        if t is None:
            return SequenceCounters()
        return SequenceCounters(
            drafted=t.drafted, accepted=t.accepted, state=t.state, switched_off=t.switched_off
        )

    def draft_budget(self, seq: int, *, active: int, room: int | None = None) -> int:
        """Tokens `seq` may draft this step (0: plain decode). Call once per step.

        `active` is the number of sequences decoding this step; `room` caps the draft
        so the step cannot emit past max_tokens or the slot's context, nor ask for
        more logits rows than the context has left: pass
        min(max_tokens - completion, context_per_slot - cached, outputs_left) - 1.
        """
        t = self._track(seq)
        if t.state is DraftState.PAUSED:
            t.probe_in -= 1
        if active > self.disable_above_batch:
            self._batch_skips += 1
            t.switched_off = True
            return 0
        if t.state is DraftState.SPECULATING:
            budget = self.max_draft_tokens
        elif t.probe_in <= 0:
            budget = self.probe_tokens
        else:
            return 0
        return max(0, budget if room is None else min(budget, room))

    def record(self, seq: int, *, drafted: int, accepted: int, filler: bool = False) -> None:
        """Account one verified step (drafted == 0 — nothing proposed — is a no-op).
        A `filler` (`batching.pad_drafts`: decoded because it cost nothing) counts in
        the totals only: the sequence's own drafts are what its window judges."""
        if drafted <= 0:
            return
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        t = self._track(seq)
        t.drafted += drafted
        t.accepted += accepted
        self._drafted += drafted
        self._accepted += accepted
        if filler:
            return
        if t.state is DraftState.PAUSED:
            # A probe: resume on a good one, with a fresh window and warm-up.
            if accepted >= self.min_acceptance_rate * drafted and accepted > 0:
                t.state = DraftState.SPECULATING
                t.window.clear()
                self._reenabled += 1
            else:
                t.probe_in = self.probe_every
            return
        t.window.extend([True] * accepted + [False] * (drafted - accepted))
        seen = len(t.window)
        if seen >= self.warmup and sum(t.window) < self.min_acceptance_rate * seen:
            t.state = DraftState.PAUSED
            t.window.clear()
            t.probe_in = self.probe_every
            t.switched_off = True
            self._disabled += 1


# Prompt lookup drafts only after a match this long (see `NgramProposer`). Replaying
# outputs of the bundled model (128 tokens each) through the measured row costs with
# aligned rows (`batching.trim_drafts`): a minimum of 1, 3 or 8 tokens keeps about
# 2.0x on a copy task with each, but costs sampled open prose 4-6% / 2-7% / 0-2%.
NGRAM_MIN_MATCH = 8


def drafter_for(launch: replicas.SpeculationLaunch) -> NgramDrafter | None:
    """The pure drafter a launch asks for; None for `kind: model` (see `draft.py`)."""
    if launch.kind == "ngram":
        if launch.ngram_size is None:
            raise ValueError("n-gram speculation needs an ngram_size")
        return NgramDrafter(
            ngram_size=launch.ngram_size,
            max_draft_tokens=launch.max_draft_tokens,
            min_match=max(NGRAM_MIN_MATCH, launch.ngram_size),
        )
    return None
