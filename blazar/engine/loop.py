"""The decode thread: sole owner of the llama runtime, the slots and the order of work.

Each pass of the loop (`DecodeLoop._run`) takes in what came, carries out Park and
Resume orders, seats work in free slots (generations the data plane resumed first, then
waiting jobs, oldest first, then those a drain resumed), gathers the busy slots, and
runs one step: draft, assemble a batch of every seated generation's next tokens and
prompt chunks, decode it, read it back. That order is the scheduling; how each part is
done lives beside it:

- `waiting`: the inbox (jobs and orders from any thread) and the line of jobs;
- `seats`: who sits in which slot, and every way a generation takes or leaves one;
- `batching`: the pure decisions (which free slot, which pieces fit a step, drafts cut
  to one pass, which move gathers the busy slots);
- `assembly`: one step's batch from the slots, paced by `pacing`;
- `emission`: sampling a decoded piece, verifying drafts, whether the request ends;
- `speculator`: drafting; `parking`: the bank of parked generations; `kvstore`: slot
  caches saved on stop and restored on start.

A slot keeps its KV cache and token list after its job ends, for the next job to reuse.
Results leave through each job's `deliver` callback (the service's go through a
`jobs.Outbox`, which the loop flushes once a step, right before the decode, and before
it waits for work).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from blazar.api import errors, replicas
from blazar.engine import (
    assembly,
    cpushare,
    emission,
    jobs,
    kvstore,
    llama,
    pacing,
    parking,
    seats,
    waiting,
)
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


class DecodeLoop:
    """The decode thread and its slots; `start` loads the model on that thread."""

    def __init__(
        self,
        launch: replicas.EngineLaunch,
        *,
        on_loaded: Callable[[BaseException | None], None],
        outbox: jobs.Outbox | None = None,
        on_failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        # The launch document, whose settings the loop reads where it uses them.
        self.launch = launch
        self._outbox = outbox
        # Told (on the decode thread) when a pass raised outside its step: the thread
        # has ended its work and stops, and nothing submitted afterwards would run.
        self._on_failed = on_failed
        self._bank = parking.Bank(max_bytes=launch.spec.max_parked_mib << 20)
        self._seats = seats.Seats(launch.spec.slots, self._bank)
        # The slots, for Health and the KV store (read from other threads: `slots`).
        self.slots = self._seats.slots
        self.kv_bytes = 0
        self._on_loaded = on_loaded
        self._waiting = waiting.WaitingLine()
        self._runtime: llama.Runtime | None = None
        # What Health reports once a failed drafter switched speculation off.
        self._spec_failed: SpeculationStats | None = None
        self._cpu: cpushare.CpuShare | None = None
        # What the caches are valid for, taken at load (`kvstore.loaded`).
        self._kv_identity: kvstore.Identity | None = None
        self._pacer = pacing.PrefillPacer(default=PREFILL_BESIDE_DECODE, max_tokens=llama.N_BATCH)
        # Threads the last step computed with (Health reads it from other threads).
        self.threads = launch.spec.threads
        # time.perf_counter() when the last decode with decoding rows ended (None: the
        # last decode had none, or failed, or since then the loop waited for work or
        # a slot changed hands): the next one measures the pass between (`pacing`).
        self._decoded_at: float | None = None
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
        return self.launch.spec.context_per_slot

    @property
    def speculation_stats(self) -> SpeculationStats:
        """Counters so far (any thread: reads of ints the decode thread updates)."""
        spec = self._seats.spec
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
        if self.launch.kv_dir is not None:
            self._kv_identity = kvstore.loaded(runtime)
            kvstore.restore_slots(runtime, Path(self.launch.kv_dir), self.slots, self._kv_identity)
        if self.launch.cpu_share is not None:
            try:
                self._cpu = cpushare.CpuShare(
                    Path(self.launch.cpu_share), cores=self.launch.host_cpus
                )
            except (OSError, RuntimeError) as exc:
                log.warning("cpu_share_off", path=self.launch.cpu_share, error=str(exc))
        self._on_loaded(None)
        try:
            while self._collect():
                self._pass(runtime)
        except Exception as exc:
            log.exception("decode_loop_failed")
            try:
                self._close(runtime)
            finally:
                # Even when closing fails too (the same broken state): the worker
                # must hear of it and exit, or it takes work nothing decodes.
                if self._on_failed is not None:
                    self._on_failed(exc)
        else:
            self._close(runtime)

    def _pass(self, runtime: llama.Runtime) -> None:
        """One pass: the orders that came, then who sits where, then one step."""
        self._pass_began = time.monotonic()
        seated = [slot.gen for slot in self.slots]
        self._control(runtime)
        self._admit(runtime)
        self._seats.compact(runtime)
        if any(slot.gen is not gen for slot, gen in zip(self.slots, seated, strict=True)):
            # A park copies a cache out, a resume copies one in, a move or a start
            # edits the cache: once, not a pass between two decodes (`pacing`), whose
            # average would shrink every prompt chunk after it.
            self._decoded_at = None
        self._share_cpu(runtime)
        try:
            self._step(runtime)
        except Exception as exc:
            log.exception("decode_step_failed")
            self._decoded_at = None  # nor is the failed step, or its error's handling
            for slot in self._seats.active():
                self._seats.fail(runtime, slot, jobs.Failed(f"decode failed: {exc}"))
        self._pass_began = 0.0

    def _close(self, runtime: llama.Runtime) -> None:
        """End every generation, answer what waits, save the caches if asked, and free
        llama's resources."""
        for slot in self._seats.active():
            self._seats.finish(runtime, slot, jobs.FinishReason.CANCELLED)
        for parked in self._bank.close():
            self._seats.end_parked(parked, errors.Unavailable("The engine stopped."))
        self._waiting.close()
        self._flush()
        if self.launch.kv_dir is not None:
            kvstore.save_slots(runtime, Path(self.launch.kv_dir), self.slots, self._kv_identity)
        if self._seats.spec is not None:
            self._seats.spec.close()
        if self._cpu is not None:
            self._cpu.close()
        runtime.close()
        self._runtime = None

    def _load(self) -> llama.Runtime:
        """The model, its context and its drafter; nothing is left open on failure."""
        runtime = llama.Runtime.load(self.launch.spec)
        launch = self.launch.spec.speculation
        if launch is not None:
            try:
                self._seats.spec = Speculator.load(
                    launch, runtime, catch_up_tokens=PREFILL_BESIDE_DECODE
                )
            except BaseException:
                runtime.close()
                raise
        self._runtime = runtime
        self.kv_bytes = runtime.kv_bytes
        return runtime

    def _collect(self) -> bool:
        """Take in what came; block while there is nothing to do. False once stopped."""
        block = not self._seats.active() and not self._waiting and self._bank.next() is None
        if block:
            self._flush()
            self._decoded_at = None  # what comes after the wait is no pass's
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
            slot = self._seats.running(rid)
            parked = self._bank.find(rid)
            if isinstance(order, parking.Park) and slot is not None:
                order.reply(self._seats.park(runtime, slot))
            elif isinstance(order, parking.Resume) and parked is not None:
                if not self._bank.ask(parked, order.reply):
                    order.reply(parking.refusal(order, "resuming"))
            else:
                queued = self._waiting.holds(rid)
                where = "running" if slot else "parked" if parked else "waiting" if queued else ""
                order.reply(parking.refusal(order, where or None))
        for parked in self._bank.cancelled():
            self._seats.end_parked(parked, errors.RequestNotFound.of(parked.request_id))

    def _admit(self, runtime: llama.Runtime) -> None:
        """Resume the parked generations the data plane asked for, then end waiting jobs
        that were cancelled and start the others, oldest first, while slots are free;
        then resume those a drain asked for. The data plane asks a Resume for a slot it
        freed, but a drain for none: the jobs waiting may be the urgent work a park
        freed a slot for, which must not wait for the very generation parked for it."""
        while (parked := self._bank.next(drained=False)) is not None and (
            free := self._seats.free(runtime)
        ):
            self._seats.resume(runtime, parked, free)
        self._waiting.end_cancelled()
        while self._waiting and (free := self._seats.free(runtime)):
            self._seats.begin(runtime, self._waiting.pop(), free)
        while (parked := self._bank.next()) is not None and (free := self._seats.free(runtime)):
            self._seats.resume(runtime, parked, free)

    def _share_cpu(self, runtime: llama.Runtime) -> None:
        """Compute the next step on this engine's share of the host's cores."""
        if self._cpu is None:
            return
        threads = self._cpu.busy(self.launch.spec.threads)
        if threads != self.threads:
            runtime.set_threads(threads)
            if self._seats.spec is not None:
                self._seats.spec.set_threads(threads)
            log.debug("threads_changed", threads=threads, wanted=self.launch.spec.threads)
            self.threads = threads

    def _step(self, runtime: llama.Runtime) -> None:
        """One batch: end what was cancelled, draft, assemble (`assembly`), send the last
        step's tokens, decode, and read each piece back (`emission`)."""
        seats = self._seats
        for slot in seats.active():
            assert slot.gen is not None
            if slot.gen.job.cancelled:
                seats.finish(runtime, slot, jobs.FinishReason.CANCELLED)
        active = sorted(seats.active(), key=lambda s: s.gen.started if s.gen else 0.0)
        if seats.spec is not None:
            self._draft(runtime, seats.spec, active)
        step = assembly.assemble(
            active, self._pacer, max_tokens=runtime.n_batch, max_outputs=runtime.n_outputs
        )
        # The last step's tokens go out, once for all its streams (`jobs.Outbox`).
        self._flush()
        if not step.entries:
            self._decoded_at = None
            return
        started = time.perf_counter()
        assembly.started(step, started)
        runtime.decode(step.entries)
        decoded_at = time.perf_counter()
        rows = sum(p.piece.tokens for p in step.placed if p.piece.decode)
        if rows and self._decoded_at is not None:
            self._pacer.between(started - self._decoded_at)
        self._decoded_at = decoded_at if rows else None
        self._pacer.observe(
            rows=rows,
            prompt_tokens=sum(p.piece.tokens for p in step.placed if not p.piece.decode),
            seconds=decoded_at - started,
        )
        for p in step.placed:
            gen = p.slot.gen
            outcome = emission.after(
                runtime, p.slot, p.first, p.piece, context=self.context_per_slot, spec=seats.spec
            )
            if p.slot.gen is gen:
                seats.conclude(runtime, p.slot, outcome)

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
            self._seats.spec = None
            spec.close()
