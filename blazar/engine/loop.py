"""The decode thread: sole owner of the llama runtime, the slots and the order of work.

Requests arrive as `jobs.Job`s on a thread-safe queue and wait FIFO for a free slot. A job
takes the free slot whose cache shares the longest prefix with its prompt and keeps
that prefix (`batching.choose_slot`, `batching.reusable_prefix`). Every step packs
the next token of each decoding slot and prefill chunks of the others into one batch
(`batching.plan_step`), decodes it, and samples one token per slot that finished its
prompt or decoded a token. Results leave through each job's `deliver` callback (the
service's go through a `jobs.Outbox`, which the loop flushes once a step, right before
the decode, and before it waits for work). A slot keeps its KV cache and token list
after its job ends, for the next job to reuse.

With speculative decoding (`LoopOptions.speculation`), a decoding slot's feed is its
pending token plus up to k drafted ones (n-gram lookup or a draft model, as the
`speculation.SpeculationPolicy` allows), all with logits; `emission` verifies them
after the decode.

Preemption: between steps the loop carries out Park and Resume orders (`parking`). A
parked generation leaves its slot with its sampler state and, within the engine's
bound, its KV cache in host memory; a resumed one takes the next free slot before any
waiting job, its cache restored or its tokens prefilled again.

The pieces around it: `waiting` (the inbox and the line of jobs), `slots` (what each
sequence holds, prefix keeping), `emission` (sampling a decoded piece, verifying
drafts), `parking` (the bank of parked generations), `pacing` (prompt chunk sizes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from blazar.api import errors, prefill, replicas
from blazar.engine import (
    batching,
    cpushare,
    emission,
    jobs,
    kvstore,
    llama,
    pacing,
    parking,
    slots,
    waiting,
)
from blazar.engine.generation import Generation
from blazar.engine.slots import Slot
from blazar.engine.speculator import SpeculationStats, Speculator

log = structlog.get_logger("blazar.engine.loop")


# Every stream that decodes waits for the whole step, prompt chunk included: on the
# 2-core dev box a 512-token chunk took 1.0-2.8 s, one token per stream in that time.
# A step that also decodes takes at most this many prompt tokens, unless a decoding
# request has a time-per-output-token target (`pacing`). Measured there, an
# 800-token prompt arriving beside one stream: the stream's longest pause went from
# 1.02-1.25 s to 0.33-0.41 s, the prompt's first token came 0.1-0.3 s later (1.8-2.1
# against 1.9-2.4 s). A prompt alone still takes n_batch tokens per step.
PREFILL_BESIDE_DECODE = 128

# Steps without drafts that a waiting prompt may take whole, where drafts leave it no
# room (`DecodeLoop._drafts_yield`): as many as make a prompt short (`api.prefill`).
# Measured on Machine E (default fleet, drafting at a batch of 6): three 27-token
# prompts that had just preempted batch jobs had their first token 1.5 s late when only
# a prompt that one such step takes whole was let in.
YIELD_STEPS = prefill.SHORT_PROMPT_STEPS

# A generation is moved to gather the busy slots (`DecodeLoop._compact`) only while it
# may emit this many tokens more: the copy of its cache pays for itself in the passes
# saved over that many steps (one step at the least, more when it drafts).
MOVE_MIN_ROOM = 16


@dataclass(frozen=True)
class LoopOptions:
    # The replica's launch settings: the model, its context, its speculation.
    spec: replicas.LaunchSpec
    # Save slot caches here on stop and restore them on start (None: do not).
    kv_dir: Path | None = None
    # Prompt tokens a step takes while other sequences decode (None: n_batch).
    prefill_beside_decode: int | None = PREFILL_BESIDE_DECODE
    # The host's CPU share table (`cpushare`); None: always compute on spec.threads.
    cpu_share: Path | None = None


@dataclass(frozen=True)
class _Placed:
    """A slot's piece of the step being decoded, from batch entry `first` on."""

    slot: Slot
    piece: batching.Piece
    first: int


class DecodeLoop:
    """The decode thread and its slots; `start` loads the model on that thread."""

    def __init__(
        self,
        options: LoopOptions,
        *,
        on_loaded: Callable[[BaseException | None], None],
        outbox: jobs.Outbox | None = None,
    ) -> None:
        self.options = options
        self._outbox = outbox
        self.slots = [Slot(i) for i in range(options.spec.slots)]
        self.kv_bytes = 0
        self._on_loaded = on_loaded
        self._waiting = waiting.WaitingLine()
        self._bank = parking.Bank(max_bytes=options.spec.max_parked_mib << 20)
        self._runtime: llama.Runtime | None = None
        self._spec: Speculator | None = None
        # What Health reports once a failed drafter switched speculation off.
        self._spec_failed: SpeculationStats | None = None
        self._clock = 0
        self._cpu: cpushare.CpuShare | None = None
        self._pacer = pacing.PrefillPacer(
            default=options.prefill_beside_decode, max_tokens=llama.N_BATCH
        )
        # Threads the last step computed with (Health reads it from other threads).
        self.threads = options.spec.threads
        # time.monotonic() when the current pass of the loop began; 0.0 between passes.
        self._pass_began = 0.0
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)

    @property
    def runtime(self) -> llama.Runtime:
        """The loaded runtime, for read-only facts of the model (vocabulary, template,
        architecture); only the decode thread calls its methods."""
        if self._runtime is None:
            raise RuntimeError("model not loaded")
        return self._runtime

    @property
    def vocab(self) -> llama.Vocab:
        return self.runtime.vocab

    @property
    def model(self) -> Any:
        """The loaded `llama_model *`, shared with the embedding context; freed when the
        decode thread stops."""
        return self.runtime.model

    @property
    def model_chat_template(self) -> str | None:
        return self.runtime.chat_template

    @property
    def architecture(self) -> str:
        """general.architecture of the loaded GGUF ("gemma3", "llama", "qwen2", ...)."""
        return self.runtime.architecture

    @property
    def context_per_slot(self) -> int:
        return self.options.spec.context_per_slot

    @property
    def speculation_stats(self) -> SpeculationStats:
        """Counters so far (any thread: reads of ints the decode thread updates)."""
        spec = self._spec
        if spec is None:
            return self._spec_failed or SpeculationStats()
        return spec.stats()

    @property
    def step_age_s(self) -> float:
        """How long the decode thread has been in its current pass; 0.0 while it waits
        for work (any thread: a read of a float the decode thread writes)."""
        began = self._pass_began
        return time.monotonic() - began if began else 0.0

    @property
    def parked(self) -> int:
        """Generations parked now (any thread, as Health reads slots)."""
        return self._bank.count

    @property
    def parked_bytes(self) -> int:
        return self._bank.bytes

    @property
    def parked_bytes_max(self) -> int:
        return self._bank.max_bytes

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: jobs.Job) -> None:
        """Queue a job (any thread); it starts when a slot frees up, in order of arrival."""
        self._waiting.put(job)

    def order(self, order: parking.Order) -> None:
        """Park or resume a request at the next step boundary (any thread); the order's
        reply says how it went."""
        self._waiting.put(order)

    def cancel(self, job: jobs.Job) -> None:
        """Cancel a job wherever it is: waiting, running or parked (any thread)."""
        job.cancel()
        self._waiting.wake()

    def stop(self) -> None:
        """Cancel whatever is left, save the caches if asked, free llama resources and
        end the thread (any thread)."""
        self._waiting.stop()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- decode thread only below ---

    def _run(self) -> None:
        try:
            runtime = self._load()
        except BaseException as exc:
            self._on_loaded(exc)
            return
        if self.options.kv_dir is not None:
            kvstore.restore_slots(runtime, self.options.kv_dir, self.slots)
        if self.options.cpu_share is not None:
            try:
                self._cpu = cpushare.CpuShare(self.options.cpu_share)
            except (OSError, RuntimeError) as exc:
                log.warning("cpu_share_off", path=str(self.options.cpu_share), error=str(exc))
        self._on_loaded(None)
        try:
            while self._collect():
                self._pass_began = time.monotonic()
                self._control(runtime)
                self._admit(runtime)
                self._compact(runtime)
                self._share_cpu(runtime)
                try:
                    self._step(runtime)
                except Exception as exc:
                    log.exception("decode_step_failed")
                    for slot in self._active():
                        self._fail(runtime, slot, jobs.Failed(f"decode failed: {exc}"))
                self._pass_began = 0.0
        finally:
            for slot in self._active():
                self._finish(runtime, slot, jobs.FinishReason.CANCELLED)
            for parked in self._bank.close():
                self._end_parked(parked, errors.Unavailable("The engine stopped."))
            self._waiting.close()
            self._flush()
            if self.options.kv_dir is not None:
                kvstore.save_slots(runtime, self.options.kv_dir, self.slots)
            if self._spec is not None:
                self._spec.close()
            if self._cpu is not None:
                self._cpu.close()
            runtime.close()
            self._runtime = None

    def _load(self) -> llama.Runtime:
        """The model, its context and its drafter; nothing is left open on failure."""
        runtime = llama.Runtime.load(self.options.spec)
        launch = self.options.spec.speculation
        if launch is not None:
            try:
                self._spec = Speculator.load(
                    launch, runtime, catch_up_tokens=self.options.prefill_beside_decode
                )
            except BaseException:
                runtime.close()
                raise
        self._runtime = runtime
        self.kv_bytes = runtime.kv_bytes
        return runtime

    def _active(self) -> list[Slot]:
        return [s for s in self.slots if s.gen is not None]

    def _collect(self) -> bool:
        """Take in what came; block while there is nothing to do. False once stopped."""
        block = not self._active() and not self._waiting and self._bank.next() is None
        if block:
            self._flush()
            if self._cpu is not None:
                self._cpu.idle()
        return self._waiting.collect(block=block)

    def _flush(self) -> None:
        """Send what the jobs were told (see `jobs.Outbox`)."""
        if self._outbox is not None:
            self._outbox.flush()

    def _control(self, runtime: llama.Runtime) -> None:
        """Carry out the Park and Resume orders that came in (resumes are then served
        by `_admit`); end the parked generations whose callers cancelled them."""
        for order in self._waiting.take_orders():
            if isinstance(order, parking.ResumeAll):
                self._bank.resume_all()
                continue
            rid = order.request_id
            slot = next((s for s in self.slots if s.gen and s.gen.job.request_id == rid), None)
            parked = self._bank.find(rid)
            if isinstance(order, parking.Park) and slot is not None:
                order.reply(self._park(runtime, slot))
            elif isinstance(order, parking.Resume) and parked is not None:
                if not self._bank.ask(parked, order.reply):
                    order.reply(parking.refusal(order, "resuming"))
            else:
                queued = self._waiting.holds(rid)
                where = "running" if slot else "parked" if parked else "waiting" if queued else ""
                order.reply(parking.refusal(order, where or None))
        for parked in self._bank.cancelled():
            self._end_parked(parked, errors.RequestNotFound.of(parked.request_id))

    def _park(self, runtime: llama.Runtime, slot: Slot) -> parking.ParkOutcome:
        gen = slot.gen
        assert gen is not None
        try:
            result = self._bank.park(runtime, slot, gen)
        except Exception as exc:
            log.exception("park_failed", request_id=gen.job.request_id)
            return errors.BlazarError(f"could not park the request: {exc}")
        self._unseat(slot)
        return result

    def _end_parked(self, parked: parking.Parked, unanswered: errors.BlazarError) -> None:
        """End a generation taken out of the bank while parked: cancelled by its caller,
        or the worker stops. A Resume that waited for it is answered `unanswered`."""
        gen = parked.gen
        if parked.reply is not None:
            parked.reply(unanswered)
        events = gen.conclusion(jobs.FinishReason.CANCELLED, slot=-1)
        gen.sampler.free()
        for event in events:
            gen.job.deliver(event)

    def _admit(self, runtime: llama.Runtime) -> None:
        """Resume the parked generations asked for, then end waiting jobs that were
        cancelled and start the others, oldest first, while slots are free."""
        while (parked := self._bank.next()) is not None and (
            free := slots.free(runtime, self.slots)
        ):
            self._resume(runtime, parked, free)
        self._waiting.end_cancelled()
        while self._waiting:
            free = slots.free(runtime, self.slots)
            if not free:
                return
            job = self._waiting.pop()
            # Prompt logprobs need logits at every prompt position: nothing can be kept.
            placement = batching.choose_slot(
                job.prompt,
                free,
                busy=slots.busy(self.slots),
                n_swa=runtime.n_swa,
                reuse=not job.params.prompt_logprobs,
            )
            slot = self.slots[placement.slot]
            try:
                self._begin(runtime, slot, job, placement.common)
            except Exception as exc:
                log.exception("begin_failed", request_id=job.request_id)
                job.deliver(jobs.Failed(f"could not start generation: {exc}"))

    def _compact(self, runtime: llama.Runtime) -> None:
        """Move a decoding generation into a free slot when that gathers the busy slots
        into fewer runs, each a forward pass of every step (`batching.compaction`). After
        `_admit`: a slot still free has no work waiting for it."""
        if self._spec is not None and self._spec.runner is not None:
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
        move = batching.compaction(busy, movable, slots.free(runtime, self.slots))
        if move is None:
            return
        src, dst = self.slots[move[0]], self.slots[move[1]]
        if slots.move(runtime, src, dst) and self._spec is not None:
            self._spec.moved(src.index, dst.index)

    def _share_cpu(self, runtime: llama.Runtime) -> None:
        """Compute the next step on this engine's share of the host's cores."""
        if self._cpu is None:
            return
        threads = self._cpu.busy(self.options.spec.threads)
        if threads != self.threads:
            runtime.set_threads(threads)
            if self._spec is not None:
                self._spec.set_threads(threads)
            log.debug("threads_changed", threads=threads, wanted=self.options.spec.threads)
            self.threads = threads

    def _resume(
        self, runtime: llama.Runtime, parked: parking.Parked, free: list[batching.FreeSlot]
    ) -> None:
        placement = batching.choose_slot(
            parked.match,
            free,
            busy=slots.busy(self.slots),
            n_swa=runtime.n_swa,
            reuse=parked.reuse,
        )
        slot = self.slots[placement.slot]
        reply = parked.reply
        assert reply is not None
        try:
            keep = slots.keep_prefix(runtime, slot, placement.common)
            result = self._bank.resume(runtime, parked, slot, keep=keep)
        except Exception as exc:
            log.exception("resume_failed", request_id=parked.request_id)
            runtime.clear(slot.index)
            slot.tokens.clear()
            parked.gen.sampler.free()
            parked.gen.job.deliver(jobs.Failed(f"could not resume generation: {exc}"))
            reply(errors.BlazarError(f"could not resume the request: {exc}"))
            return
        self._seat(slot, parked.gen)
        reply(result)

    def _begin(self, runtime: llama.Runtime, slot: Slot, job: jobs.Job, common: int) -> None:
        keep = slots.keep_prefix(runtime, slot, common)
        job.cached_tokens = keep
        self._seat(slot, Generation.begin(job, cached=keep))

    def _seat(self, slot: Slot, gen: Generation) -> None:
        slot.gen = gen
        if self._spec is not None:
            self._spec.policy.begin(slot.index)
        self._clock += 1
        slot.last_used = self._clock
        slot.prompt_len = len(gen.job.prompt)

    def _step(self, runtime: llama.Runtime) -> None:
        """One batch: decode tokens first, then prefill chunks: short prompts first,
        then the others, oldest job first within each (`api.prefill`)."""
        for slot in self._active():
            assert slot.gen is not None
            if slot.gen.job.cancelled:
                self._finish(runtime, slot, jobs.FinishReason.CANCELLED)
        active = sorted(self._active(), key=lambda s: s.gen.started if s.gen else 0.0)
        if self._spec is not None:
            self._draft(runtime, self._spec, active)
        wants = [self._want(slot) for slot in active]
        budget = self._prefill_budget(active, wants)
        if budget == 0 and (favoured := self._drafts_yield(active, wants)):
            for slot in active:
                if slot.gen is not None:
                    del slot.gen.feed[1:]
            wants = [self._want(slot) for slot in active]
            budget = self._prefill_budget(active, wants)
            # Only the prompts the drafts gave way to: an older, longer one would
            # take the room first, and the drafts would give way for all its chunks.
            wants = [
                want if want.decode or want.slot in favoured else replace(want, prefill=0)
                for want in wants
            ]
        # Stable: oldest first within short prompts and within the rest.
        wants.sort(key=lambda want: 0 if not want.decode and prefill.short(want.prefill) else 1)
        pieces = batching.plan_step(
            wants,
            max_tokens=runtime.n_batch,
            max_outputs=runtime.n_outputs,
            prefill_beside_decode=budget,
        )
        entries: list[tuple[int, int, int, bool]] = []
        placed = [self._place(piece, entries) for piece in pieces]
        # The last step's tokens go out, once for all its streams (`jobs.Outbox`).
        self._flush()
        if not entries:
            return
        decoding = [p.slot.gen for p in placed if p.piece.decode and p.slot.gen is not None]
        for gen in decoding:
            gen.decode_steps += 1
            gen.decode_batched += len(decoding)
        started = time.perf_counter()
        for place in placed:
            if not place.piece.decode and place.slot.gen is not None:
                place.slot.gen.prompt_step(started, sequences=len(placed))
        runtime.decode(entries)
        self._pacer.observe(
            rows=sum(p.tokens for p in pieces if p.decode),
            prompt_tokens=sum(p.tokens for p in pieces if not p.decode),
            seconds=time.perf_counter() - started,
        )
        for place in placed:
            self._sample(runtime, place)

    def _prefill_budget(self, active: list[Slot], wants: list[batching.Want]) -> int | None:
        """Prompt tokens this step may take beside its decoding rows: paced to the
        tightest time-per-output-token target among them (`pacing`)."""
        targets = [
            slot.gen.job.tpot_target_s
            for slot, want in zip(active, wants, strict=True)
            if want.decode and slot.gen is not None and slot.gen.job.tpot_target_s is not None
        ]
        rows = sum(want.decode for want in wants)
        drafts = sum(want.decode - 1 for want in wants if want.decode > 1)
        return self._pacer.budget(rows=rows, target_s=min(targets, default=None), drafts=drafts)

    def _drafts_yield(self, active: list[Slot], wants: list[batching.Want]) -> set[int]:
        """The slots of the waiting prompts that this step's drafts, which leave them
        no room within the streams' target (`pacing`), give way to (none: they do not
        yield): those that steps without drafts would take whole within `YIELD_STEPS`.
        Their first token is then a few steps away, where the drafts would hold them
        back for as long as they keep paying (seconds, behind streams that copy their
        text); the streams decode one token each in those steps, within their target.
        A longer prompt still waits for steps whose drafts leave it room, even beside a
        short one (the step gives it none of the room): yielding would slow the streams
        for the many steps it takes in small chunks, and it comes sooner taken whole
        once they end."""
        plain = [replace(want, decode=min(want.decode, 1)) for want in wants]
        room = self._prefill_budget(active, plain)
        if room is None:
            return set()
        return {
            want.slot
            for want in wants
            if not want.decode and 0 < want.prefill <= room * YIELD_STEPS
        }

    @staticmethod
    def _want(slot: Slot) -> batching.Want:
        gen = slot.gen
        assert gen is not None
        # A resumed generation prefills its tokens again before its pending token.
        return batching.Want(
            slot=slot.index,
            decode=0 if gen.refill else len(gen.feed),
            prefill=gen.to_prefill,
            prompt_logits=gen.job.params.prompt_logprobs and gen.prefilling,
        )

    def _place(self, piece: batching.Piece, entries: list[tuple[int, int, int, bool]]) -> _Placed:
        """Append a slot's piece to the batch entries; the slot's tokens follow them."""
        slot = self.slots[piece.slot]
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
        return _Placed(slot, piece, first)

    def _sample(self, runtime: llama.Runtime, place: _Placed) -> None:
        """Sample what the decoded piece asks for (`emission`) and end the request if it
        is over. What fails here (the request's sampler, its logprobs) is that request's
        own fault: the batch is decoded and the other slots are fine."""
        slot, piece = place.slot, place.piece
        gen = slot.gen
        assert gen is not None
        context = self.context_per_slot
        try:
            if piece.decode:
                outcome = emission.after_decode(
                    runtime, slot, place.first, piece.tokens, context=context, spec=self._spec
                )
            else:
                outcome = emission.after_prefill(runtime, slot, place.first, piece, context=context)
        except errors.InvalidRequest as exc:
            # A contradiction in the request itself that showed only now.
            log.info("request_invalid", request_id=gen.job.request_id, error=exc.message)
            outcome = emission.Outcome(failure=jobs.Failed.invalid(exc))
        except Exception as exc:
            log.exception("sampling_failed", request_id=gen.job.request_id)
            outcome = emission.Outcome(failure=jobs.Failed(f"sampling failed: {exc}"))
        if slot.gen is not gen:
            return
        if outcome.failure is not None:
            self._fail(runtime, slot, outcome.failure)
        elif outcome.end is not None:
            self._finish(runtime, slot, outcome.end.reason, flush=outcome.end.flush)

    def _draft(self, runtime: llama.Runtime, spec: Speculator, active: list[Slot]) -> None:
        """Extend decoding slots' feeds with drafted tokens, as the policy allows."""
        try:
            spec.extend_feeds(
                active,
                context=self.context_per_slot,
                capacity=min(runtime.n_outputs, runtime.n_batch),
            )
        except Exception as exc:
            # Drafting only saves time, and a drafter that failed half-way (a draft
            # model's decode) no longer knows what its cache holds: speculation is off
            # for the rest of this worker's life, and every request decodes plainly.
            # Health says so (an operator sees a slower replica, not a quiet one).
            log.exception("drafting_failed", kind=spec.kind)
            self._spec_failed = spec.stats(failure=f"the {spec.kind} drafter failed: {exc}")
            self._spec = None
            spec.close()

    def _finish(
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

    def _fail(self, runtime: llama.Runtime, slot: Slot, failure: jobs.Failed) -> None:
        assert slot.gen is not None
        job = slot.gen.job
        self._release(runtime, slot, keep_cache=False)
        job.deliver(failure)

    def _release(self, runtime: llama.Runtime, slot: Slot, *, keep_cache: bool) -> None:
        assert slot.gen is not None
        slot.gen.sampler.free()
        self._unseat(slot)
        if not keep_cache:
            runtime.clear(slot.index)
            slot.tokens.clear()
            if self._spec is not None:
                self._spec.drafter.release(slot.index)

    def _unseat(self, slot: Slot) -> None:
        """Free the slot; its cache stays, and so does its generation's sampler."""
        # Recency counts from the end of use too: a long generation that just finished
        # is the conversation most likely to continue (see batching.choose_slot).
        self._clock += 1
        slot.last_used = self._clock
        if self._spec is not None:
            self._spec.policy.release(slot.index)
        slot.gen = None
