"""Preemption on the engine ("slot banking"): generations taken out of their slots for
more urgent work and put back later, and the host memory that holds their caches.

`Bank.park`, at a step boundary, takes a running generation out of its slot. Its
sequence's KV cache is copied to host memory (`llama_state_seq_get_data`) when that
keeps the bank within its bound (a Lane's `kvCache.maxParkedMiB`); past it only its
tokens are kept. The `Generation` is kept whole, native sampler included, so its random
state, grammar state, penalty history, held-back stop-string text and partial UTF-8
character are exactly as they were, and so is its pending token (`Generation.feed`):
sampled, not yet decoded. Its caller's stream stays open and simply gets nothing.

`Bank.resume` puts it into a free slot, any one: the saved cache is written into that
sequence (`llama_state_seq_set_data` takes a state copied from another sequence), or,
without one (past the bound, or llama.cpp refused the state), its tokens are prefilled
again in the loop's ordinary chunks, after whatever prefix of them the slot still holds
(`Generation.refill`; one parked mid-prompt just goes on with its prompt). The pending
token is decoded next either way, so the next token sampled is the one that would have
come without the pause: none lost, none repeated.

A parked generation leaves the bank, and its memory is freed, when it resumes, when its
caller cancels it, and when the worker stops; a drain asks for every one to resume
(`ResumeAll`), so that they can finish within its grace. Orders (`Park`, `Resume`,
`ResumeAll`) reach the decode thread through its inbox and are carried out between
steps; everything here runs on the decode thread, but for Health's plain int reads of
`Bank.count` and `Bank.bytes`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from blazar.api import errors
from blazar.engine import jobs, llama
from blazar.engine.generation import Generation
from blazar.engine.speculation import DraftTrack

_MS = 1000.0


@dataclass(frozen=True)
class ParkResult:
    # The slot it left.
    slot: int
    # Tokens its cache held: what prefilling it again would cost.
    tokens: int
    # Host memory holding its cache; 0 past the bound (only its tokens are kept).
    parked_bytes: int
    park_ms: float


@dataclass(frozen=True)
class ResumeResult:
    slot: int
    # Bytes of cache restored from host memory; 0 when it prefills again.
    restored_bytes: int
    # Tokens it prefills again (0 when its cache was restored).
    refill_tokens: int
    resume_ms: float
    # How long it was parked, this time.
    parked_ms: float


ParkOutcome = ParkResult | errors.BlazarError
ResumeOutcome = ResumeResult | errors.BlazarError


@dataclass(frozen=True)
class Park:
    """Order: park the running request `request_id`. `reply` is called once, from the
    decode thread."""

    request_id: str
    reply: Callable[[ParkOutcome], None]


@dataclass(frozen=True)
class Resume:
    """Order: resume the parked request `request_id` in the next free slot. `reply` is
    called once, from the decode thread, when it runs again (or cannot)."""

    request_id: str
    reply: Callable[[ResumeOutcome], None]


@dataclass(frozen=True)
class ResumeAll:
    """Order of a drain: resume every parked generation as slots free up, after the
    jobs waiting for one."""


Order = Park | Resume | ResumeAll


def refusal(order: Park | Resume, state: str | None) -> errors.BlazarError:
    """The error for an order the request's `state` (None: not on this engine) refuses."""
    if state is None:
        return errors.RequestNotFound.of(order.request_id)
    wanted = "running" if isinstance(order, Park) else "parked"
    return errors.RequestStateConflict.of(order.request_id, state=state, wanted=wanted)


class Seat(Protocol):
    """What the bank needs of a decode-loop slot."""

    @property
    def index(self) -> int: ...

    # Exactly the tokens in the slot's KV cache.
    tokens: list[int]


def _nobody(outcome: ResumeOutcome) -> None:
    """The reply of a resume that no caller waits for (a drain's)."""


# Compared by identity: two parked generations are never the same one.
@dataclass(eq=False)
class Parked:
    gen: Generation
    # Exactly the tokens its cache held when it was parked.
    tokens: list[int]
    # Its sequence state as llama.cpp copied it; None past the bound (or once resumed).
    state: npt.NDArray[np.uint8] | None
    # Set once a Resume asked for it.
    reply: Callable[[ResumeOutcome], None] | None = None
    # Its drafting record, which it takes back when resumed (None: no speculation).
    draft: DraftTrack | None = None

    @property
    def request_id(self) -> str:
        return self.gen.job.request_id

    @property
    def nbytes(self) -> int:
        return 0 if self.state is None else int(self.state.nbytes)

    @property
    def match(self) -> list[int]:
        """What a free slot's cache is compared with to choose where it resumes (the
        prompt while it was still being prefilled: a slot may hold more of it)."""
        return self.gen.job.prompt if self.gen.prefilling else self.tokens

    def end(self, unanswered: errors.BlazarError) -> None:
        """End it while parked (taken out of the bank: cancelled by its caller, or the
        worker stops). A Resume that waited for it is answered `unanswered`."""
        if self.reply is not None:
            self.reply(unanswered)
        events = self.gen.conclusion(jobs.FinishReason.CANCELLED, slot=-1)
        self.gen.sampler.free()
        for event in events:
            self.gen.job.deliver(event)

    @property
    def reuse(self) -> bool:
        """Whether it may keep a prefix a free slot holds: not with a saved cache (that
        replaces the slot's whole cache), nor while it needs logits for every prompt
        position."""
        return self.state is None and not (
            self.gen.prefilling and self.gen.job.params.prompt_logprobs
        )


class Bank:
    """The parked generations of one engine and the host memory their caches take."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.count = 0
        self._parked: list[Parked] = []
        # Those a Resume asked for, in the order asked.
        self._asked: collections.deque[Parked] = collections.deque()

    def find(self, request_id: str) -> Parked | None:
        return next((p for p in self._parked if p.request_id == request_id), None)

    def park(
        self, runtime: llama.Runtime, slot: Seat, gen: Generation, *, draft: DraftTrack | None
    ) -> ParkResult:
        """Bank the generation running in `slot`, with its drafting record: its cache
        copied out if the bound allows. The caller then frees the slot (keeping its
        cache, which a resume without a saved state may find again)."""
        started = time.perf_counter()
        size = runtime.seq_state_size(slot.index)
        state = runtime.seq_state(slot.index, size) if self.bytes + size <= self.max_bytes else None
        parked = Parked(gen, list(slot.tokens), state, draft=draft)
        gen.pause()
        self._parked.append(parked)
        self.bytes += parked.nbytes
        self.count = len(self._parked)
        return ParkResult(
            slot=slot.index,
            tokens=len(parked.tokens),
            parked_bytes=parked.nbytes,
            park_ms=(time.perf_counter() - started) * _MS,
        )

    def ask(self, parked: Parked, reply: Callable[[ResumeOutcome], None]) -> bool:
        """Resume `parked` at the next free slot, `reply` once it runs; False when a
        caller already waits for that (a drain's resume waits for nobody)."""
        if parked.reply is None:
            self._asked.append(parked)
        elif parked.reply is not _nobody:
            return False
        parked.reply = reply
        return True

    def resume_all(self) -> None:
        for parked in self._parked:
            if parked.reply is None:
                self.ask(parked, _nobody)

    def next(self, *, drained: bool = True) -> Parked | None:
        """The first generation a Resume asked for, still waiting for a slot; without
        `drained`, the first a caller's Resume asked for (not a drain's)."""
        return next((p for p in self._asked if drained or p.reply is not _nobody), None)

    def resume(
        self, runtime: llama.Runtime, parked: Parked, slot: Seat, *, keep: int
    ) -> ResumeResult:
        """Put `parked`'s generation back into `slot`, whose cache holds the first `keep`
        tokens of `parked.match` (0 unless `parked.reuse`), and free its memory. The
        caller seats the generation, then replies."""
        started = time.perf_counter()
        state = self._take(parked)
        gen = parked.gen
        restored = 0
        if state is not None and runtime.set_seq_state(slot.index, state):
            slot.tokens = list(parked.tokens)
            restored = int(state.nbytes)
        else:
            if state is not None:
                # llama.cpp refused it and cleared the sequence: prefill everything.
                keep = 0
                slot.tokens = []
            if gen.prefilling:
                gen.restart_prefill(keep)
            else:
                # Parked again before a refill was done: the rest of that refill follows.
                gen.refill = parked.tokens[keep:] + gen.refill
        # Prefilling again still counts as parked, until the loop has its tokens back.
        parked_s = gen.parked_for if gen.refill else gen.unpause()
        return ResumeResult(
            slot=slot.index,
            restored_bytes=restored,
            refill_tokens=0 if restored else max(len(parked.tokens) - keep, 0),
            resume_ms=(time.perf_counter() - started) * _MS,
            parked_ms=parked_s * _MS,
        )

    def drop(self, parked: Parked) -> None:
        """Take out a generation whose resume failed, if it is still in (it failed
        before `resume` took it out): it has ended, and no later pass may resume it."""
        if parked in self._parked:
            self._take(parked)

    def cancelled(self) -> list[Parked]:
        """Take out the parked generations whose callers cancelled them."""
        gone = [p for p in self._parked if p.gen.job.cancelled]
        for parked in gone:
            self._take(parked)
        return gone

    def close(self) -> list[Parked]:
        """Take out every parked generation (the worker stops)."""
        gone = list(self._parked)
        for parked in gone:
            self._take(parked)
        return gone

    def _take(self, parked: Parked) -> npt.NDArray[np.uint8] | None:
        """Out of the bank, its memory no longer counted; its saved state, if any."""
        self._parked.remove(parked)
        if parked.reply is not None and parked in self._asked:
            self._asked.remove(parked)
        self.bytes -= parked.nbytes
        self.count = len(self._parked)
        state, parked.state = parked.state, None
        return state
