"""What passes between the service and the decode thread: a `Job` in, `Event`s out.

The service builds a `Job` per generation request and hands it to the decode loop;
the loop reports through the job's `deliver` callback, from the decode thread, with
`TextDelta`s while text is produced and one `Finished` or `Failed` at the end.
`Job.cancel` is the one call that crosses back (any thread).
"""

from __future__ import annotations

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
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the decode thread to stop this job at its next step (any thread)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
