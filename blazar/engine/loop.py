"""The decode thread: sole owner of the llama runtime, the slots and the order of work.

Requests arrive as `Job`s on a thread-safe queue; each step packs the next token of
every decoding slot and a prefill chunk of every prefilling slot into one batch,
decodes it, and samples one token per slot that asked for logits. Results leave
through each job's `deliver` callback (the service hops them onto its event loop).

Health reads `Slot.busy` / `Slot.cached_tokens` from other threads: plain attribute
reads of ints and references, which the GIL keeps consistent; nothing else about a
slot is touched outside this thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import llama_cpp as lc
import structlog

from blazar.engine import llama, sampling, text

log = structlog.get_logger("blazar.engine.loop")


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TextDelta:
    text: str
    tokens: int


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    slot: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms: float

    @property
    def decode_tokens_per_second(self) -> float:
        # decode_ms spans first to last token: completion_tokens - 1 decode steps.
        steps = self.completion_tokens - 1
        return steps * 1000.0 / self.decode_ms if steps > 0 and self.decode_ms > 0 else 0.0


@dataclass(frozen=True)
class Failed:
    message: str


Event = TextDelta | Finished | Failed


class Job:
    """One generation request, handed from the service to the decode thread."""

    def __init__(
        self,
        *,
        request_id: str,
        prompt: list[int],
        params: sampling.SamplingParams,
        max_tokens: int,
        deliver: Callable[[Event], None],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.max_tokens = max_tokens
        self.deliver = deliver
        self.arrived = time.perf_counter()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the decode thread to stop this job at its next step (any thread)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class Generation:
    """Progress of the job a slot is serving."""

    job: Job
    sampler: Any
    started: float
    prefilled: int = 0
    # Sampled but not yet decoded into the KV cache.
    pending: int | None = None
    completion: int = 0
    # Generated tokens whose text has not gone out in a delta yet.
    untold: int = 0
    utf8: text.Utf8Stream = field(default_factory=text.Utf8Stream)
    stops: text.StopMatcher = field(default_factory=lambda: text.StopMatcher(()))
    prefill_done: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.job.prompt)


@dataclass
class Slot:
    """One llama sequence (seq id = index): what its KV cache holds and whom it serves."""

    index: int
    tokens: list[int] = field(default_factory=list)
    gen: Generation | None = None

    @property
    def busy(self) -> bool:
        return self.gen is not None

    @property
    def cached_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class LoopOptions:
    runtime: llama.RuntimeOptions
    # Sequences decoded together. 1 serves requests one at a time in FIFO order.
    parallel: int = 1


_STOP = object()


class DecodeLoop:
    """The decode thread and its slots; `start` loads the model on that thread."""

    def __init__(
        self, options: LoopOptions, *, on_loaded: Callable[[BaseException | None], None]
    ) -> None:
        self.options = options
        self.slots = [Slot(i) for i in range(options.runtime.slots)]
        self._on_loaded = on_loaded
        self._inbox: queue.Queue[Job | object] = queue.Queue()
        self._runtime: llama.Runtime | None = None
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)

    @property
    def vocab(self) -> llama.Vocab:
        if self._runtime is None:
            raise RuntimeError("model not loaded")
        return self._runtime.vocab

    @property
    def model_chat_template(self) -> str | None:
        if self._runtime is None:
            raise RuntimeError("model not loaded")
        return self._runtime.chat_template

    @property
    def context_per_slot(self) -> int:
        return self.options.runtime.context_per_slot

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job (any thread); it starts when a slot frees up, in FIFO order."""
        self._inbox.put(job)

    def stop(self) -> None:
        """Cancel whatever is left, free llama resources, end the thread (any thread)."""
        self._inbox.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # --- decode thread only below ---

    def _run(self) -> None:
        try:
            self._runtime = llama.Runtime.load(self.options.runtime)
        except BaseException as exc:
            self._on_loaded(exc)
            return
        self._on_loaded(None)
        try:
            while self._admit():
                try:
                    self._step(self._runtime)
                except Exception as exc:
                    log.exception("decode_step_failed")
                    for slot in self._active():
                        self._fail(self._runtime, slot, f"decode failed: {exc}")
        finally:
            for slot in self._active():
                self._finish(self._runtime, slot, FinishReason.CANCELLED)
            self._drop_waiting()
            self._runtime.close()
            self._runtime = None

    def _active(self) -> list[Slot]:
        return [s for s in self.slots if s.gen is not None]

    def _admit(self) -> bool:
        """Move queued jobs into free slots; block while idle. False once stopped."""
        assert self._runtime is not None
        while True:
            active = self._active()
            if len(active) >= self.options.parallel:
                return True
            try:
                item = self._inbox.get(block=not active)
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            assert isinstance(item, Job)
            if item.cancelled:
                continue
            free = next(s for s in self.slots if s.gen is None)
            try:
                self._begin(self._runtime, free, item)
            except Exception as exc:
                log.exception("begin_failed", request_id=item.request_id)
                item.deliver(Failed(f"could not start generation: {exc}"))

    def _begin(self, runtime: llama.Runtime, slot: Slot, job: Job) -> None:
        chain = sampling.build_chain(job.params)
        if job.params.penalized:
            # Penalties look back over the prompt too, as in llama.cpp's server.
            for token in job.prompt[-sampling.PENALTY_LAST_N :]:
                lc.llama_sampler_accept(chain, token)
        runtime.clear(slot.index)
        slot.tokens.clear()
        slot.gen = Generation(
            job=job,
            sampler=chain,
            started=time.perf_counter(),
            stops=text.StopMatcher(job.params.stop),
        )

    def _step(self, runtime: llama.Runtime) -> None:
        """One batch: decode tokens first, then prefill chunks in the remaining room."""
        entries: list[tuple[int, int, int, bool]] = []
        outputs: list[tuple[Slot, int]] = []
        for slot in self._active():
            gen = slot.gen
            assert gen is not None
            if gen.job.cancelled:
                self._finish(runtime, slot, FinishReason.CANCELLED)
            elif gen.pending is not None:
                entries.append((gen.pending, len(slot.tokens), slot.index, True))
                slot.tokens.append(gen.pending)
                gen.pending = None
                outputs.append((slot, len(entries) - 1))
        for slot in self._active():
            gen = slot.gen
            assert gen is not None
            room = runtime.n_batch - len(entries)
            if not gen.prefilling or room <= 0:
                continue
            prompt = gen.job.prompt
            chunk = prompt[gen.prefilled : gen.prefilled + room]
            end = gen.prefilled + len(chunk)
            entries.extend(
                (tok, gen.prefilled + i, slot.index, gen.prefilled + i == len(prompt) - 1)
                for i, tok in enumerate(chunk)
            )
            slot.tokens.extend(chunk)
            gen.prefilled = end
            if end == len(prompt):
                outputs.append((slot, len(entries) - 1))
        if not entries:
            return
        runtime.decode(entries)
        now = time.perf_counter()
        for slot, index in outputs:
            gen = slot.gen
            assert gen is not None
            if gen.prefill_done == 0.0:
                gen.prefill_done = now
            self._on_token(runtime, slot, runtime.sample(gen.sampler, index))

    def _on_token(self, runtime: llama.Runtime, slot: Slot, token: int) -> None:
        gen = slot.gen
        assert gen is not None
        now = time.perf_counter()
        gen.completion += 1
        gen.untold += 1
        gen.first_token = gen.first_token or now
        gen.last_token = now
        if runtime.vocab.is_eog(token):
            self._finish(runtime, slot, FinishReason.STOP)
            return
        result = gen.stops.feed(gen.utf8.feed(runtime.vocab.piece(token)))
        if result.text:
            gen.job.deliver(TextDelta(result.text, gen.untold))
            gen.untold = 0
        if result.stopped:
            self._finish(runtime, slot, FinishReason.STOP, flush=False)
        elif gen.completion >= gen.job.max_tokens or len(slot.tokens) >= self.context_per_slot:
            self._finish(runtime, slot, FinishReason.LENGTH)
        else:
            gen.pending = token

    def _finish(
        self, runtime: llama.Runtime, slot: Slot, reason: FinishReason, *, flush: bool = True
    ) -> None:
        """Free the slot (KV cache included), then tell the job how it ended.

        In that order, so a caller that has seen its final chunk finds the slot free.
        """
        gen = slot.gen
        assert gen is not None
        job = gen.job
        tail = gen.stops.flush() if flush and reason is not FinishReason.CANCELLED else ""
        ms = 1000.0
        first = gen.first_token or gen.started
        finished = Finished(
            reason=reason,
            slot=slot.index,
            prompt_tokens=len(job.prompt),
            completion_tokens=gen.completion,
            cached_tokens=0,
            queue_ms=(gen.started - job.arrived) * ms,
            prefill_ms=((gen.prefill_done or gen.started) - gen.started) * ms,
            ttft_ms=(first - job.arrived) * ms if gen.first_token else 0.0,
            decode_ms=((gen.last_token or first) - first) * ms,
        )
        untold = gen.untold
        self._release(runtime, slot)
        if tail:
            job.deliver(TextDelta(tail, untold))
        job.deliver(finished)

    def _fail(self, runtime: llama.Runtime, slot: Slot, message: str) -> None:
        assert slot.gen is not None
        job = slot.gen.job
        self._release(runtime, slot)
        job.deliver(Failed(message))

    def _release(self, runtime: llama.Runtime, slot: Slot) -> None:
        assert slot.gen is not None
        lc.llama_sampler_free(slot.gen.sampler)
        runtime.clear(slot.index)
        slot.tokens.clear()
        slot.gen = None

    def _drop_waiting(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Job):
                item.deliver(Failed("engine stopped"))
