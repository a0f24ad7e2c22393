"""What a slot's decoded piece emits: the tokens sampled from its logits rows, handed
to its generation, and whether the request ends.

After a prompt chunk: its prompt logprobs, then (at the prompt's end) the first token.
After fed tokens: one fed token samples its successor; the pending token plus a draft
is verified row by row with the request's own sampler until a row disagrees with the
draft (`speculation.Speculation.resolve`), and the rejected rest is cut from the KV
cache and the slot's tokens. Every emitted token is exactly what plain decoding would
have drawn, logprobs and grammar included.

Decode thread only. The loop acts on the `Outcome` (finishing or failing the request
frees its slot, `seats.Seats.conclude`); what fails while sampling is that request's
own failure (`after`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from blazar.api import errors
from blazar.engine import batching, generation, jobs, llama, speculation
from blazar.engine.slots import Slot
from blazar.engine.speculator import Speculator


@dataclass(frozen=True)
class Outcome:
    """How the request stands after its piece: going on (both None), ending, or failed."""

    end: generation.End | None = None
    failure: jobs.Failed | None = None


GOING_ON = Outcome()


log = structlog.get_logger("blazar.engine.emission")


def after(
    runtime: llama.Runtime,
    slot: Slot,
    first: int,
    piece: batching.Piece,
    *,
    context: int,
    spec: Speculator | None,
) -> Outcome:
    """What the slot's piece, decoded at batch entries from `first`, emits. What fails
    here (the request's sampler, its logprobs) is that request's own fault: the batch
    is decoded and the other slots are fine."""
    gen = slot.gen
    assert gen is not None
    try:
        if piece.decode:
            return after_decode(runtime, slot, first, piece.tokens, context=context, spec=spec)
        return after_prefill(runtime, slot, first, piece, context=context)
    except errors.InvalidRequest as exc:
        # A contradiction in the request itself that showed only now.
        log.info("request_invalid", request_id=gen.job.request_id, error=exc.message)
        return Outcome(failure=jobs.Failed.invalid(exc))
    except Exception as exc:
        log.exception("sampling_failed", request_id=gen.job.request_id)
        return Outcome(failure=jobs.Failed(f"sampling failed: {exc}"))


def after_prefill(
    runtime: llama.Runtime, slot: Slot, first: int, piece: batching.Piece, *, context: int
) -> Outcome:
    """A prompt chunk (or a resumed generation's refill) at batch entries from `first`."""
    gen = slot.gen
    assert gen is not None
    if piece.logits is batching.Logits.ALL:
        # Row i holds the logits after prompt position p0 + i, predicting p0 + i + 1.
        p0 = gen.prefilled - piece.tokens
        targets = gen.job.prompt[p0 + 1 : gen.prefilled + 1]
        if targets:
            gen.score_prompt(runtime.logits(first, len(targets)), targets)
    # A refill ends with its next token already sampled (in `feed`).
    if not gen.prefilling and not gen.feed:
        gen.prefill_done = time.perf_counter()
        index = first + piece.tokens - 1
        token, end = _emit(runtime, slot, index, cached=len(slot.tokens), context=context)
        if end is not None:
            return Outcome(end=end)
        gen.feed.append(token)
    elif not gen.refill:
        gen.unpause()  # its tokens are back after a resume: decoding goes on
    return GOING_ON


def after_decode(
    runtime: llama.Runtime,
    slot: Slot,
    first: int,
    count: int,
    *,
    context: int,
    spec: Speculator | None,
) -> Outcome:
    """The slot's fed tokens, decoded at batch entries first .. first + count - 1: the
    last emitted token becomes the next feed."""
    gen = slot.gen
    assert gen is not None
    step = speculation.Speculation.fed(seq=slot.index, tokens=slot.tokens, count=count)
    end: generation.End | None = None

    def sample(i: int) -> int | None:
        nonlocal end
        if end is not None:
            return None
        # Row i's token follows position + i: that many + 1 tokens are then valid.
        token, end = _emit(runtime, slot, first + i, cached=step.position + i + 1, context=context)
        return token

    outcome = step.resolve(sample)
    if outcome.rollback_from is not None:
        if not runtime.truncate(slot.index, outcome.rollback_from):
            # Cannot happen with a full-size KV cache; never decode on a stale one
            # (failing clears the slot's cache).
            return Outcome(failure=jobs.Failed("could not roll back a rejected draft"))
        del slot.tokens[outcome.rollback_from :]
    if outcome.drafted:
        assert spec is not None
        gen.record_draft(spec.kind, drafted=outcome.drafted, accepted=outcome.accepted)
        spec.record(slot.index, drafted=outcome.drafted, accepted=outcome.accepted)
    if end is not None:
        return Outcome(end=end)
    gen.feed.append(outcome.emitted[-1])
    return GOING_ON


def _emit(
    runtime: llama.Runtime, slot: Slot, index: int, *, cached: int, context: int
) -> tuple[int, generation.End | None]:
    """Sample from batch entry `index` and hand the token to the generation; say
    whether the request ends.

    `cached` counts the slot's tokens up to the one whose logits are at `index`
    (during verification the slot also holds drafts that may yet be rejected). The
    caller ends the request after fixing the slot's cache when a draft was rejected,
    so that the slot is consistent before it is freed.
    """
    gen = slot.gen
    assert gen is not None
    # Copied before sampling: the raw distribution, before bias and grammar.
    row = runtime.logits(index).copy() if gen.job.params.logprobs else None
    token = runtime.sample(gen.sampler, index)
    end = gen.emit(token, vocab=runtime.vocab, row=row, context_full=cached >= context)
    return token, end
