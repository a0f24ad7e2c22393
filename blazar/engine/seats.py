"""Who sits in which slot: every way a generation takes a slot (a new job, a resume) or
leaves one (it ends, fails, is parked or moves), with what follows each (the slot's
recency, the drafter's state for that sequence, the job told how it ended).

Decode thread only; `DecodeLoop` decides when, this module how.
"""

from __future__ import annotations

import structlog

from blazar.api import errors
from blazar.engine import batching, emission, jobs, llama, parking, slots
from blazar.engine.generation import Generation
from blazar.engine.slots import Slot
from blazar.engine.speculation import DraftTrack
from blazar.engine.speculator import Speculator

log = structlog.get_logger("blazar.engine.seats")

# A generation is moved to gather the busy slots (`Seats.compact`) only while it may
# emit this many tokens more: the copy of its cache pays for itself in the passes saved
# over that many steps (one step at the least, more when it drafts).
MOVE_MIN_ROOM = 16


class Seats:
    """The engine's slots and the generations seated in them."""

    def __init__(self, count: int, bank: parking.Bank) -> None:
        self.slots = [Slot(i) for i in range(count)]
        self.bank = bank
        # The speculator, while drafting works: it keeps state per sequence id.
        self.spec: Speculator | None = None
        # Counts seatings and leavings: a slot's recency (`Slot.last_used`).
        self._clock = 0

    def active(self) -> list[Slot]:
        return [s for s in self.slots if s.gen is not None]

    def running(self, request_id: str) -> Slot | None:
        return next((s for s in self.slots if s.gen and s.gen.job.request_id == request_id), None)

    def free(self, runtime: llama.Runtime) -> list[batching.FreeSlot]:
        return slots.free(runtime, self.slots)

    # --- taking a slot ---

    def begin(self, runtime: llama.Runtime, job: jobs.Job, free: list[batching.FreeSlot]) -> None:
        """Start `job` in the free slot whose cache it keeps the most of; a job that
        cannot start is told so."""
        # Prompt logprobs need logits at every prompt position: nothing can be kept.
        placement = batching.choose_slot(
            job.prompt,
            free,
            busy=slots.busy(self.slots),
            n_swa=runtime.n_swa,
            reuse=not job.params.prompt_logprobs,
            scope=job.cache_scope,
        )
        slot = self.slots[placement.slot]
        try:
            keep = slots.keep_prefix(runtime, slot, placement.common)
            job.cached_tokens = keep
            self._seat(slot, Generation.begin(job, cached=keep))
        except Exception as exc:
            log.exception("begin_failed", request_id=job.request_id)
            job.deliver(jobs.Failed(f"could not start generation: {exc}"))

    def resume(
        self, runtime: llama.Runtime, parked: parking.Parked, free: list[batching.FreeSlot]
    ) -> None:
        """Seat a parked generation a Resume asked for, its cache restored or to be
        prefilled again, and answer the Resume."""
        placement = batching.choose_slot(
            parked.match,
            free,
            busy=slots.busy(self.slots),
            n_swa=runtime.n_swa,
            reuse=parked.reuse,
            scope=parked.gen.job.cache_scope,
        )
        slot = self.slots[placement.slot]
        reply = parked.reply
        assert reply is not None
        try:
            keep = slots.keep_prefix(runtime, slot, placement.common)
            result = self.bank.resume(runtime, parked, slot, keep=keep)
        except Exception as exc:
            log.exception("resume_failed", request_id=parked.request_id)
            # It ends here: out of the bank even if it failed before `resume` took it.
            self.bank.drop(parked)
            if self.spec is not None:
                self.spec.policy.ended(parked.draft)
            runtime.clear(slot.index)
            slot.tokens.clear()
            parked.gen.sampler.free()
            parked.gen.job.deliver(jobs.Failed(f"could not resume generation: {exc}"))
            reply(errors.BlazarError(f"could not resume the request: {exc}"))
            return
        self._seat(slot, parked.gen, draft=parked.draft)
        reply(result)

    def _seat(self, slot: Slot, gen: Generation, *, draft: DraftTrack | None = None) -> None:
        """`gen` takes the slot, with its drafting record if it had one (a resume)."""
        slot.gen = gen
        slot.scope = gen.job.cache_scope
        if self.spec is not None and draft is not None:
            self.spec.policy.attach(slot.index, draft)
        elif self.spec is not None:
            self.spec.policy.begin(slot.index)
        self._clock += 1
        slot.last_used = self._clock
        slot.prompt_len = len(gen.job.prompt)

    # --- moving ---

    def compact(self, runtime: llama.Runtime) -> None:
        """Move a decoding generation into a free slot when that gathers the busy slots
        into fewer runs, each a forward pass of every step (`batching.compaction`).
        After admitting work: a slot still free has no work waiting for it."""
        if self.spec is not None and self.spec.runner is not None:
            return  # a draft model's cache follows its sequence id: not moved
        busy = slots.busy(self.slots)
        if batching.runs(busy) <= 1:
            return  # the usual case, every pass: nothing to gather
        movable = {
            s.index: len(s.tokens)
            for s in self.slots
            if s.gen is not None
            and not s.gen.prefilling
            and not s.gen.refill
            and s.gen.room >= MOVE_MIN_ROOM
        }
        if not movable:
            return
        move = batching.compaction(busy, movable, self.free(runtime))
        if move is None:
            return
        src, dst = self.slots[move[0]], self.slots[move[1]]
        if slots.move(runtime, src, dst) and self.spec is not None:
            self.spec.moved(src.index, dst.index)

    # --- leaving a slot ---

    def conclude(self, runtime: llama.Runtime, slot: Slot, outcome: emission.Outcome) -> None:
        """End the slot's request if its last piece (`emission`) says it is over."""
        if outcome.failure is not None:
            self.fail(runtime, slot, outcome.failure)
        elif outcome.end is not None:
            self.finish(runtime, slot, outcome.end.reason, flush=outcome.end.flush)

    def finish(
        self, runtime: llama.Runtime, slot: Slot, reason: jobs.FinishReason, *, flush: bool = True
    ) -> None:
        """Free the slot (its cache stays for reuse), then tell the job how it ended.

        In that order, so a caller that has seen its final chunk finds the slot free.
        """
        gen = slot.gen
        assert gen is not None
        events = gen.conclusion(reason, slot=slot.index, flush=flush)
        self._release(runtime, slot, keep_cache=True)
        for event in events:
            gen.job.deliver(event)

    def fail(self, runtime: llama.Runtime, slot: Slot, failure: jobs.Failed) -> None:
        """Free the slot and its cache (which may not hold what it should), then tell the
        job."""
        assert slot.gen is not None
        job = slot.gen.job
        self._release(runtime, slot, keep_cache=False)
        job.deliver(failure)

    def park(self, runtime: llama.Runtime, slot: Slot) -> parking.ParkOutcome:
        """Bank the slot's generation (`parking.Bank.park`) and free the slot."""
        gen = slot.gen
        assert gen is not None
        policy = self.spec.policy if self.spec is not None else None
        draft = policy.detach(slot.index) if policy is not None else None
        try:
            result = self.bank.park(runtime, slot, gen, draft=draft)
        except Exception as exc:
            log.exception("park_failed", request_id=gen.job.request_id)
            if policy is not None:
                policy.attach(slot.index, draft)
            return errors.BlazarError(f"could not park the request: {exc}")
        self._unseat(slot)
        return result

    def end_parked(self, parked: parking.Parked, unanswered: errors.BlazarError) -> None:
        """End a generation taken out of the bank while parked (`parking.Parked.end`),
        and its drafting record."""
        parked.end(unanswered)
        if self.spec is not None:
            self.spec.policy.ended(parked.draft)

    def _release(self, runtime: llama.Runtime, slot: Slot, *, keep_cache: bool) -> None:
        assert slot.gen is not None
        slot.gen.sampler.free()
        self._unseat(slot)
        if not keep_cache:
            runtime.clear(slot.index)
            slot.tokens.clear()
            if self.spec is not None:
                self.spec.drafter.release(slot.index)

    def _unseat(self, slot: Slot) -> None:
        """Free the slot; its cache stays, and so does its generation's sampler."""
        # Recency counts from the end of use too: a long generation that just finished
        # is the conversation most likely to continue (see batching.choose_slot).
        self._clock += 1
        slot.last_used = self._clock
        if self.spec is not None:
            self.spec.policy.release(slot.index)
        slot.gen = None
