"""What passes between the service and the decode thread: a `Job` in, `Event`s out.

The service builds a `Job` per generation request and hands it to the decode loop;
the loop reports through the job's `deliver` callback, from the decode thread, with
`TextDelta`s while text is produced and one `Finished` or `Failed` at the end.
`Job.cancel` is the one call that crosses back (any thread).

`Outbox` carries the events onto the service's event loop, one wake-up per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from blazar.api import errors
from blazar.engine import logprobs, sampling


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TextDelta:
    text: str
    tokens: int
    # One per token covered, when the job asked for logprobs.
    logprobs: tuple[logprobs.TokenLogprob, ...] = ()

    @classmethod
    def joined(cls, first: TextDelta, second: TextDelta) -> TextDelta:
        """One delta covering both, in order."""
        return cls(
            first.text + second.text,
            first.tokens + second.tokens,
            first.logprobs + second.logprobs,
        )


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    # -1: cancelled while waiting, before it had a slot.
    slot: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_ms: float
    # From the first decode step carrying its prompt to its first token, less the time
    # parked meanwhile.
    prefill_ms: float
    ttft_ms: float
    decode_ms: float
    # One per prompt token after the first, when the job asked for prompt logprobs.
    prompt_logprobs: tuple[logprobs.TokenLogprob, ...] = ()
    # The drafter's kind ("ngram", "model") when the request drafted; else "".
    speculation: str = ""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Time it spent parked (preempted), not counted in prefill_ms or decode_ms.
    parked_ms: float = 0.0
    # Sequences decoded together per decode step while it decoded, on average.
    decode_batch: float = 0.0
    # Sequences in the decode steps that carried its prompt, on average, itself
    # included: 1.0 when it had every such step to itself.
    prefill_batch: float = 0.0
    # From its slot's start to the first decode step carrying its prompt: the wait
    # behind other prompts' chunks, less the time parked meanwhile.
    prefill_wait_ms: float = 0.0
    # The caller's stop string that ended it ("" when the model or a bound did).
    stop_sequence: str = ""

    @property
    def decode_tokens_per_second(self) -> float:
        # decode_ms spans first to last token: completion_tokens - 1 decode steps.
        steps = self.completion_tokens - 1
        return steps * 1000.0 / self.decode_ms if steps > 0 and self.decode_ms > 0 else 0.0


@dataclass(frozen=True)
class Failed:
    message: str
    # The request asked for something that cannot be done (not the engine's fault):
    # the caller gets INVALID_ARGUMENT, with the field at fault in `metadata`.
    invalid_request: bool = False
    metadata: tuple[tuple[str, str], ...] = ()

    @classmethod
    def invalid(cls, err: errors.InvalidRequest) -> Failed:
        return cls(err.message, invalid_request=True, metadata=tuple(err.metadata.items()))


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
        arrived: float | None = None,
        tpot_target_s: float | None = None,
        cache_scope: str = "",
        stop_quiet: tuple[str, str] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.max_tokens = max_tokens
        self.deliver = deliver
        # perf_counter() when the request reached the engine, before it was prepared
        # (preparing runs in a thread pool, so jobs can come out of it in another order).
        self.arrived = time.perf_counter() if arrived is None else arrived
        # The caller's time-per-output-token target: prompt chunks decoded beside this
        # job are sized to keep it (`pacing`). None: no target.
        self.tpot_target_s = tpot_target_s
        # Whose cached prompts it may reuse, and who may reuse what it leaves in its
        # slot's cache (the data plane's tenant; "" without an auth file).
        self.cache_scope = cache_scope
        # The markers of a block its stop strings do not apply inside (a tool call the
        # model may write in auto mode: `text.StopMatcher`); None: they apply anywhere.
        self.stop_quiet = stop_quiet
        # Prompt tokens its slot's cache held when it took the slot (None: it has not
        # yet). Written by the decode thread before it delivers the job's first event,
        # read by the service once that event is in.
        self.cached_tokens: int | None = None
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the decode thread to stop this job at its next step (any thread)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Outbox:
    """Events from the decode thread to an event loop, handed over once per step.

    `sender` gives a job's `deliver` callback that only holds its events; `flush`
    wakes the event loop once for everything held. The decode loop flushes right
    before it releases the GIL into `llama_decode` (and before it waits for work).

    Waking the event loop at each event, as `call_soon_threadsafe` from the decode
    thread did, let it take the GIL at every token: the decode thread then waited for
    the event loop's work in the middle of its own, between two decodes (measured
    with its calls timed in a worker, 32 streams on 8 slots: 2.5-5 ms a step, against
    0.9 once per step). The wake-up is one byte written to a pipe the event loop
    reads, with the GIL kept through the write (a write that lets it go hands it over
    at once). With one stream's chunk to send, the event loop sends it while the next
    step computes; with several, the flush waits (at most `_WAIT_S`) until the event
    loop has taken them in: on two cores busy with llama.cpp's threads that work slows
    the step it runs beside more than it costs before it. Alternating A/B runs of
    tok/s on one quiet host (docs/BENCHMARKS.md, thirteenth session) put both choices
    2-10% above one wake-up per event; neither alone was best at 1, 8 and 32 streams.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._held: list[tuple[Callable[[Event], None], Event]] = []
        # The streams (sinks) the held events are for.
        self._sinks: set[Callable[[Event], None]] = set()
        self._read_fd, self._write_fd = os.pipe()  # not inherited by children
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        # Set by the event loop once it has taken in what a flush handed over.
        self._taken = threading.Event()
        loop.add_reader(self._read_fd, self._hand_over)

    def sender(self, sink: Callable[[Event], None]) -> Callable[[Event], None]:
        """A `deliver` callback whose events reach `sink`, on the event loop, after
        the next flush."""

        def hold(event: Event) -> None:
            with self._lock:
                self._held.append((sink, event))
                self._sinks.add(sink)

        return hold

    def flush(self) -> None:
        """Wake the event loop for the held events (nothing when none are held).

        A full pipe (EAGAIN) means a wake-up is pending already; a closed one, that the
        event loop is gone and nobody listens any more: either way, nothing to do."""
        with self._lock:
            if not self._held:
                return
            wait = len(self._sinks) > 1
            self._taken.clear()
        _write_holding_gil(self._write_fd, b"\0", 1)
        if wait:
            self._taken.wait(_WAIT_S)

    def close(self) -> None:
        """Stop reading (on the event loop's thread); held events are dropped."""
        self._loop.remove_reader(self._read_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)

    def _hand_over(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._read_fd, 4096)
        with self._lock:
            batch, self._held = self._held, []
            self._sinks.clear()
        for sink, event in batch:
            sink(event)
        # After the callbacks those sinks scheduled: the streams have taken their events.
        self._loop.call_soon(self._taken.set)


# The longest a flush waits for the event loop: a loop busy elsewhere (a request being
# prepared) must not hold up every stream's next step for long.
_WAIT_S = 0.005

# libc's write(2) through ctypes.PyDLL, which keeps the GIL during the call (see Outbox).
_write_holding_gil = ctypes.PyDLL(None).write
_write_holding_gil.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
_write_holding_gil.restype = ctypes.c_ssize_t
