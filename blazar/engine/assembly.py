"""One step's batch, assembled from the slots: what each seated generation asks for
(its feed of pending and drafted tokens, or a chunk of its prompt), how many prompt
tokens the step may take beside the decoding rows (`pacing`), the pieces that fit
(`batching.plan_step`) and their batch entries.

Decode thread only. The loop decodes what `assemble` returns and hands each piece to
`emission`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from blazar.api import prefill
from blazar.engine import batching, pacing
from blazar.engine.slots import Slot

# Steps without drafts that a waiting prompt may take whole, where drafts leave it no
# room (`drafts_yield`): as many as make a prompt short (`api.prefill`). Measured on
# Machine E (default fleet, drafting at a batch of 6): three 27-token prompts that had
# just preempted batch jobs had their first token 1.5 s late when only a prompt that
# one such step takes whole was let in.
YIELD_STEPS = prefill.SHORT_PROMPT_STEPS

# One batch entry: token, position, sequence id, whether its logits are wanted.
Entry = tuple[int, int, int, bool]


@dataclass(frozen=True)
class Placed:
    """A slot's piece of the step being decoded, from batch entry `first` on."""

    slot: Slot
    piece: batching.Piece
    first: int


@dataclass(frozen=True)
class Step:
    placed: list[Placed]
    entries: list[Entry]


def assemble(
    active: list[Slot], pacer: pacing.PrefillPacer, *, max_tokens: int, max_outputs: int
) -> Step:
    """The next batch of the `active` slots (oldest generation first): decode tokens
    first, then prefill chunks: short prompts first, then the others, oldest first
    within each (`api.prefill`). Takes the tokens placed from each generation's feed
    or prompt into its slot's tokens."""
    wants = [want(slot) for slot in active]
    budget = prefill_budget(pacer, active, wants)
    if budget == 0 and (favoured := drafts_yield(pacer, active, wants)):
        for slot in active:
            if slot.gen is not None:
                del slot.gen.feed[1:]
        wants = [want(slot) for slot in active]
        budget = prefill_budget(pacer, active, wants)
        # Only the prompts the drafts gave way to: an older, longer one would take
        # the room first, and the drafts would give way for all its chunks.
        wants = [w if w.decode or w.slot in favoured else replace(w, prefill=0) for w in wants]
    # Stable: oldest first within short prompts and within the rest.
    wants.sort(key=lambda w: 0 if not w.decode and prefill.short(w.prefill) else 1)
    pieces = batching.plan_step(
        wants, max_tokens=max_tokens, max_outputs=max_outputs, prefill_beside_decode=budget
    )
    by_index = {slot.index: slot for slot in active}
    entries: list[Entry] = []
    placed = [place(by_index[piece.slot], piece, entries) for piece in pieces]
    return Step(placed, entries)


def want(slot: Slot) -> batching.Want:
    gen = slot.gen
    assert gen is not None
    # A resumed generation prefills its tokens again before its pending token.
    return batching.Want(
        slot=slot.index,
        decode=0 if gen.refill else len(gen.feed),
        prefill=gen.to_prefill,
        prompt_logits=gen.job.params.prompt_logprobs and gen.prefilling,
    )


def prefill_budget(
    pacer: pacing.PrefillPacer, active: list[Slot], wants: list[batching.Want]
) -> int | None:
    """Prompt tokens this step may take beside its decoding rows: paced to the
    tightest time-per-output-token target among them (`pacing`)."""
    targets = [
        slot.gen.job.tpot_target_s
        for slot, w in zip(active, wants, strict=True)
        if w.decode and slot.gen is not None and slot.gen.job.tpot_target_s is not None
    ]
    rows = sum(w.decode for w in wants)
    drafts = sum(w.decode - 1 for w in wants if w.decode > 1)
    return pacer.budget(rows=rows, target_s=min(targets, default=None), drafts=drafts)


def drafts_yield(
    pacer: pacing.PrefillPacer, active: list[Slot], wants: list[batching.Want]
) -> set[int]:
    """The slots of the waiting prompts that this step's drafts, which leave them no
    room within the streams' target (`pacing`), give way to (none: they do not yield):
    those that steps without drafts would take whole within `YIELD_STEPS`.

    Their first token is then a few steps away, where the drafts would hold them back
    for as long as they keep paying (seconds, behind streams that copy their text); the
    streams decode one token each in those steps, within their target. A longer prompt
    still waits for steps whose drafts leave it room, even beside a short one (the step
    gives it none of the room): yielding would slow the streams for the many steps it
    takes in small chunks, and it comes sooner taken whole once they end."""
    plain = [replace(w, decode=min(w.decode, 1)) for w in wants]
    room = prefill_budget(pacer, active, plain)
    if room is None:
        return set()
    return {w.slot for w in wants if not w.decode and 0 < w.prefill <= room * YIELD_STEPS}


def place(slot: Slot, piece: batching.Piece, entries: list[Entry]) -> Placed:
    """Append the slot's piece to the batch entries; the slot's tokens follow them."""
    gen = slot.gen
    assert gen is not None
    tokens = gen.take_feed(piece.tokens) if piece.decode else gen.take_prompt(piece.tokens)
    first, start, last = len(entries), len(slot.tokens), len(tokens) - 1
    every = piece.logits is batching.Logits.ALL
    at_end = piece.logits is batching.Logits.LAST
    entries.extend(
        (tok, start + i, slot.index, every or (at_end and i == last))
        for i, tok in enumerate(tokens)
    )
    slot.tokens.extend(tokens)
    return Placed(slot, piece, first)


def started(step: Step, now: float) -> None:
    """Count the step, about to be decoded, in each generation's timings: a decode step
    at its batch, or a prompt step shared with the step's other sequences."""
    decoding = [p.slot.gen for p in step.placed if p.piece.decode and p.slot.gen is not None]
    for gen in decoding:
        gen.decode_steps += 1
        gen.decode_batched += len(decoding)
    for p in step.placed:
        if not p.piece.decode and p.slot.gen is not None:
            p.slot.gen.prompt_step(now, sequences=len(step.placed))
