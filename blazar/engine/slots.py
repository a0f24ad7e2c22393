"""The decode loop's slots: one llama sequence each, what its KV cache holds and whom it
serves, and how a new job keeps part of a free slot's cache.

Decode thread only, but for `Slot.busy` / `Slot.cached_tokens`, which Health reads from
other threads: plain attribute reads of ints and references, which the GIL keeps
consistent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from blazar.engine import batching, llama
from blazar.engine.generation import Generation


@dataclass
class Slot:
    """One llama sequence (seq id = index): what its KV cache holds and whom it serves."""

    index: int
    # Exactly the tokens in this sequence's KV cache, position i = tokens[i].
    tokens: list[int] = field(default_factory=list)
    gen: Generation | None = None
    # When it last took a job (a step counter; larger = more recent).
    last_used: int = 0
    # Prompt length of the last job: where a later prompt most likely parts from it.
    prompt_len: int = 0
    # Whose requests filled its cache (`Job.cache_scope`): only theirs reuse it.
    scope: str = ""

    @property
    def busy(self) -> bool:
        return self.gen is not None

    @property
    def cached_tokens(self) -> int:
        return len(self.tokens)


def free(runtime: llama.Runtime, slots: Sequence[Slot]) -> list[batching.FreeSlot]:
    """The slots no generation holds, as `batching.choose_slot` weighs them."""
    return [
        batching.FreeSlot(s.index, s.tokens, s.last_used, runtime.pos_min(s.index), s.scope)
        for s in slots
        if s.gen is None
    ]


def busy(slots: Sequence[Slot]) -> frozenset[int]:
    """The sequence ids generations hold (`batching.choose_slot` keeps them together)."""
    return frozenset(s.index for s in slots if s.gen is not None)


def keep_prefix(runtime: llama.Runtime, slot: Slot, common: int) -> int:
    """Cut the free slot's cache back to the first `common` tokens, or to nothing when
    those cannot be kept; how many it keeps."""
    keep = batching.reusable_prefix(
        common, pos_min=runtime.pos_min(slot.index), n_swa=runtime.n_swa
    )
    if keep < len(slot.tokens):
        if keep == 0 or not runtime.truncate(slot.index, keep):
            runtime.clear(slot.index)
            keep = 0
        del slot.tokens[keep:]
    return keep


def move(runtime: llama.Runtime, src: Slot, dst: Slot) -> bool:
    """Move `src`'s generation and its cache to the free slot `dst` (`batching.compaction`);
    what `dst` cached goes to `src`, so that a later prompt may still reuse it there.
    False when llama.cpp could not copy `src`'s state: nothing moved."""
    state = runtime.seq_state(src.index, runtime.seq_state_size(src.index))
    if state is None:
        return False
    kept = runtime.seq_state(dst.index, runtime.seq_state_size(dst.index)) if dst.tokens else None
    if not runtime.set_seq_state(dst.index, state):
        # Cleared by the failed copy: put back what it held, if it can.
        if kept is None or not runtime.set_seq_state(dst.index, kept):
            dst.tokens.clear()
        return False
    runtime.clear(src.index)
    cached = dst.tokens, dst.last_used, dst.prompt_len, dst.scope
    dst.tokens, dst.last_used, dst.prompt_len = src.tokens, src.last_used, src.prompt_len
    dst.scope = src.scope
    dst.gen, src.gen = src.gen, None
    if kept is not None and runtime.set_seq_state(src.index, kept):
        src.tokens, src.last_used, src.prompt_len, src.scope = cached
    else:
        src.tokens = []
    return True
