"""The `blazar.engine.v1.Engine` servicer: the asyncio side of the worker.

It owns admission (STARTING / READY / DRAINING) and the set of in-flight requests;
it validates and tokenizes a request, checks that it fits the slot's context before
any work (`preparing`, mixed in), hands it to the decode thread and streams the events
back as Chunks (`chunks`). Park and Resume are orders to the decode thread (`parking`),
answered when carried out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from enum import StrEnum
from typing import Any, TypeAlias, TypeVar

import grpc
import structlog

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc
from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.engine import (
    chunks,
    embedding,
    jobs,
    loop,
    parking,
    preparing,
    text,
    tools,
)
from blazar.rpc import engine_metadata, limits, status

log = structlog.get_logger("blazar.engine.service")

# How long a drain waits for cancelled jobs to end once its grace is over.
CANCEL_WAIT_SECONDS = 5.0
DEFAULT_DRAIN_GRACE_SECONDS = 10.0


class EngineState(StrEnum):
    STARTING = "Starting"
    READY = "Ready"
    DRAINING = "Draining"


_WIRE_STATE = {
    EngineState.STARTING: engine_pb2.ENGINE_STATE_STARTING,
    EngineState.READY: engine_pb2.ENGINE_STATE_READY,
    EngineState.DRAINING: engine_pb2.ENGINE_STATE_DRAINING,
}

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
_Result = TypeVar("_Result")


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class EngineService(preparing.Preparing, engine_pb2_grpc.EngineServicer):
    def __init__(self, decode: loop.DecodeLoop, outbox: jobs.Outbox, *, model_path: str) -> None:
        self.state = EngineState.STARTING
        self._decode = decode
        # The decode loop's: its jobs' events reach this event loop through it.
        self._outbox = outbox
        self._model_path = model_path
        self._inflight: set[jobs.Job] = set()
        # Embed calls in progress; a drain waits for them as for generations.
        self._embedding = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._chat: text.ChatTemplate | None = None
        # Created at the first Embed; closed when draining (before the model is freed).
        self._embedder: embedding.Embedder | None = None

    def mark_ready(self, chat: text.ChatTemplate | None) -> None:
        """Admit work; `chat` renders conversations (None: Gemma's turn format)."""
        self._chat = chat
        if self.state is EngineState.STARTING:
            self.state = EngineState.READY

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new work; wait up to the grace for in-flight requests, then cancel the
        ones left (their callers get UNAVAILABLE). Returns how many were cancelled.

        So the process stops promptly after a drain, with its slots free to be saved.
        """
        self.state = EngineState.DRAINING
        # Parked generations would wait for a Resume that no longer comes.
        self._decode.order(parking.ResumeAll())
        abandoned = 0
        if not await self.wait_idle(grace_seconds):
            abandoned = len(self._inflight) + self._embedding
            log.warning("cancelling_abandoned", abandoned=abandoned)
            self.cancel_all()
        if self._embedder is not None:
            # Finishes the input in hand and refuses the rest of any Embed still running
            # (UNAVAILABLE, which the data plane retries on another replica).
            await asyncio.to_thread(self._embedder.close)
        if abandoned:
            # A cancelled job ends at the decode loop's next step (one prefill chunk at most).
            await self.wait_idle(CANCEL_WAIT_SECONDS)
        return abandoned

    def cancel_all(self) -> None:
        for job in self._inflight:
            self._decode.cancel(job)

    def _set_idle_if_done(self) -> None:
        if not self._inflight and not self._embedding:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout)
        except TimeoutError:
            return False
        return True

    # --- RPCs ---

    async def Health(
        self, request: engine_pb2.HealthRequest, context: Context
    ) -> engine_pb2.HealthResponse:
        spec = self._decode.speculation_stats
        return engine_pb2.HealthResponse(
            state=_WIRE_STATE[self.state],
            slots=[
                engine_pb2.SlotStatus(index=s.index, busy=s.busy, cached_tokens=s.cached_tokens)
                for s in self._decode.slots
            ],
            memory_bytes=rss_bytes(),
            context_per_slot=self._decode.context_per_slot,
            model_path=self._model_path,
            pid=os.getpid(),
            kv_bytes=self._decode.kv_bytes,
            threads=self._decode.threads,
            parked=self._decode.parked,
            parked_bytes=self._decode.parked_bytes,
            parked_bytes_max=self._decode.parked_bytes_max,
            step_age_ms=self._decode.step_age_s * 1000.0,
            speculation=engine_pb2.SpeculationStats(
                kind=spec.kind,
                drafted_tokens=spec.drafted,
                accepted_tokens=spec.accepted,
                disabled_requests=spec.disabled_requests,
                failure=spec.failure,
            ),
        )

    async def Drain(
        self, request: engine_pb2.DrainRequest, context: Context
    ) -> engine_pb2.DrainResponse:
        # proto3 cannot tell an unset grace from 0; both mean the default.
        grace = request.grace_seconds if request.grace_seconds > 0 else None
        abandoned = await self.drain(grace or DEFAULT_DRAIN_GRACE_SECONDS)
        log.info("drained", abandoned=abandoned)
        return engine_pb2.DrainResponse(abandoned=abandoned)

    async def Park(
        self, request: engine_pb2.ParkRequest, context: Context
    ) -> engine_pb2.ParkResponse:
        if self.state is not EngineState.READY:
            # Draining: its parked generations are being resumed, not more parked.
            await status.abort(context, errors.Unavailable(f"The engine is {self.state.lower()}."))
        result: parking.ParkResult = await self._ask(
            context, lambda reply: parking.Park(request.request_id, reply)
        )
        log.info(
            "parked",
            request_id=request.request_id,
            slot=result.slot,
            tokens=result.tokens,
            parked_bytes=result.parked_bytes,
            ms=round(result.park_ms, 2),
        )
        return engine_pb2.ParkResponse(
            slot=result.slot,
            tokens=result.tokens,
            parked_bytes=result.parked_bytes,
            park_ms=result.park_ms,
        )

    async def Resume(
        self, request: engine_pb2.ResumeRequest, context: Context
    ) -> engine_pb2.ResumeResponse:
        if self.state is EngineState.STARTING:
            await status.abort(context, errors.Unavailable("The engine is starting."))
        result: parking.ResumeResult = await self._ask(
            context, lambda reply: parking.Resume(request.request_id, reply)
        )
        log.info(
            "resumed",
            request_id=request.request_id,
            slot=result.slot,
            restored_bytes=result.restored_bytes,
            refill_tokens=result.refill_tokens,
            parked_ms=round(result.parked_ms),
            ms=round(result.resume_ms, 2),
        )
        return engine_pb2.ResumeResponse(
            slot=result.slot,
            restored_bytes=result.restored_bytes,
            refill_tokens=result.refill_tokens,
            resume_ms=result.resume_ms,
            parked_ms=result.parked_ms,
        )

    async def _ask(
        self,
        context: Context,
        order: Callable[[Callable[[_Result | errors.BlazarError], None]], parking.Order],
    ) -> _Result:
        """Send the decode thread an order built by `order(reply)`; its result, or the
        RPC ends with the error it answered. An answer that comes after the caller left
        is dropped (the order is carried out all the same)."""
        aio = asyncio.get_running_loop()
        answer: asyncio.Future[_Result | errors.BlazarError] = aio.create_future()

        def settle(outcome: _Result | errors.BlazarError) -> None:
            if not answer.done():
                answer.set_result(outcome)

        def reply(outcome: _Result | errors.BlazarError) -> None:
            # RuntimeError: the event loop is closed, so nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                aio.call_soon_threadsafe(settle, outcome)

        self._decode.order(order(reply))
        outcome = await answer
        if isinstance(outcome, errors.BlazarError):
            await status.abort(context, outcome)
        return outcome

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[inference_pb2.Chunk]:
        if self.state is not EngineState.READY:
            await status.abort(context, errors.Unavailable(f"The engine is {self.state.lower()}."))
        events: asyncio.Queue[jobs.Event] = asyncio.Queue()
        deliver = self._outbox.sender(events.put_nowait)
        arrived = time.perf_counter()
        try:
            job, calls = await self._prepare(request, deliver, arrived=arrived)
        except errors.BlazarError as err:
            await status.abort(context, err)
        started = time.perf_counter()
        self._inflight.add(job)
        self._idle.clear()
        finished: jobs.Finished | None = None
        streamed = 0
        announced = False
        try:
            self._decode.submit(job)
            held: jobs.Event | None = None
            while finished is None:
                event = held or await events.get()
                held = None
                if not announced and not isinstance(event, jobs.Failed):
                    announced = True
                    # Not to a caller that has gone (nothing would read it).
                    if job.cached_tokens is not None and not context.cancelled():
                        await context.send_initial_metadata(
                            (
                                (engine_metadata.PREFIX_REUSED_KEY, str(job.cached_tokens)),
                                (engine_metadata.PROMPT_TOKENS_KEY, str(len(job.prompt))),
                            )
                        )
                if isinstance(event, jobs.TextDelta):
                    # Deltas that queued up meanwhile (accepted draft tokens, or a
                    # stream the event loop fell behind on) go out as one chunk.
                    while not events.empty() and held is None:
                        after = events.get_nowait()
                        if isinstance(after, jobs.TextDelta):
                            event = jobs.TextDelta.joined(event, after)
                        else:
                            held = after
                    streamed += event.tokens
                    parsed = calls.feed(event.text) if calls else tools.Parsed(text=event.text)
                    yield inference_pb2.Chunk(
                        delta=chunks.delta(
                            parsed,
                            tokens=event.tokens,
                            logprobs=chunks.wire_logprobs(self._decode.vocab, event.logprobs),
                        )
                    )
                elif isinstance(event, jobs.Finished):
                    finished = event
                    if calls is not None:
                        rest = calls.finish()
                        if rest.text or rest.calls:
                            yield inference_pb2.Chunk(delta=chunks.delta(rest, tokens=0))
                    if event.reason is jobs.FinishReason.CANCELLED:
                        # Cancelled here, not by the caller (who is gone): the drain.
                        await status.abort(
                            context,
                            errors.Unavailable(
                                "The engine stopped before this request finished; retry."
                            ),
                        )
                    final = chunks.final(event)
                    if final.stop_sequence not in request.sampling.stop:
                        # A stop the engine added (where a tool's result would begin),
                        # not one of the caller's: the model ended its turn.
                        final.stop_sequence = ""
                    if calls is not None:
                        final.tool_calls = calls.made
                        if calls.called and event.reason is jobs.FinishReason.STOP:
                            final.finish_reason = inference_pb2.FINISH_REASON_TOOL_CALLS
                    final.prompt_logprobs.extend(
                        chunks.wire_logprobs(
                            self._decode.vocab, event.prompt_logprobs, special=True
                        )
                    )
                    yield inference_pb2.Chunk(final=final)
                else:
                    failure = (
                        errors.InvalidRequest(event.message, metadata=dict(event.metadata))
                        if event.invalid_request
                        else errors.BlazarError(event.message)
                    )
                    await status.abort(context, failure)
        finally:
            # No-op when finished; frees the slot (or the parked memory) when the
            # caller left.
            self._decode.cancel(job)
            self._inflight.discard(job)
            self._set_idle_if_done()
            log.info(
                "generate",
                request_id=request.request_id,
                prompt_tokens=len(job.prompt),
                # Of a cancelled request: the tokens it had been sent.
                completion_tokens=finished.completion_tokens if finished else streamed,
                cached_tokens=finished.cached_tokens if finished else None,
                finish=finished.reason if finished else "cancelled",
                tool_calls=calls.made if calls else None,
                tokens_per_second=round(finished.decode_tokens_per_second, 1) if finished else None,
                drafted_tokens=finished.drafted_tokens if finished else None,
                accepted_tokens=finished.accepted_tokens if finished else None,
                parked_ms=round(finished.parked_ms) if finished else None,
                ms=round((time.perf_counter() - started) * 1000),
            )

    async def Embed(
        self, request: inference_pb2.EmbedRequest, context: Context
    ) -> inference_pb2.EmbedResponse:
        try:
            if self.state is not EngineState.READY:
                raise errors.Unavailable(f"The engine is {self.state.lower()}.")
            if not request.inputs:
                raise errors.InvalidRequest("Give at least one input to embed.")
            started = time.perf_counter()
            self._embedding += 1
            self._idle.clear()
            try:
                vectors = await self._embeddings().embed(
                    request.inputs,
                    normalize=request.normalize,
                    dimensions=request.dimensions if request.HasField("dimensions") else None,
                    context_limit=request.context_limit or None,
                )
            finally:
                self._embedding -= 1
                self._set_idle_if_done()
        except errors.BlazarError as err:
            await status.abort(context, err)
        prompt_tokens = sum(v.tokens for v in vectors)
        log.info(
            "embed",
            inputs=len(vectors),
            prompt_tokens=prompt_tokens,
            ms=round((time.perf_counter() - started) * 1000),
        )
        return inference_pb2.EmbedResponse(
            embeddings=[inference_pb2.Embedding(values=v.values, tokens=v.tokens) for v in vectors],
            prompt_tokens=prompt_tokens,
        )

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: Context
    ) -> inference_pb2.TokenizeResponse:
        if self.state is not EngineState.READY:
            await status.abort(context, errors.Unavailable(f"The engine is {self.state.lower()}."))
        vocab = self._decode.vocab

        def split() -> inference_pb2.TokenizeResponse:
            if request.HasField("chat"):
                # Exactly as Generate renders and tokenizes a chat's prompt (`_prepare`).
                chat = chat_input(request.chat)
                toolset = tools.parse(chat)
                turns = self._chat_turns(chat.messages)
                final = chat.continue_final_message
                tokens = self._chat_tokens(
                    turns, toolset, self._render(turns, toolset, continue_final=final), final
                )
            else:
                tokens = vocab.tokenize(
                    request.text, add_bos=request.add_special, parse_special=request.parse_special
                )
            if request.count_only:
                return inference_pb2.TokenizeResponse(count=len(tokens))
            raw = [vocab.piece(t, special=True) for t in tokens]
            answer = inference_pb2.TokenizeResponse(
                count=len(tokens),
                tokens=tokens,
                # A token may be part of a multi-byte character; its piece then shows
                # U+FFFD, and only piece_bytes carries it exactly.
                pieces=[b.decode("utf-8", errors="replace") for b in raw],
                piece_bytes=raw,
            )
            if (size := answer.ByteSize()) > limits.MAX_ANSWER_BYTES:
                # Else gRPC refuses it on the way back, as RESOURCE_EXHAUSTED.
                raise errors.InvalidRequest(
                    f"The text is {len(tokens):,} tokens; listing them takes {size:,} "
                    f"bytes, more than the {limits.MAX_ANSWER_BYTES:,} one answer may "
                    "carry. Set count_only for the count alone, or send the text in parts.",
                    metadata={errors.FIELD_KEY: "count_only"},
                )
            return answer

        try:
            return await asyncio.to_thread(split)
        except errors.BlazarError as err:
            await status.abort(context, err)

    def _embeddings(self) -> embedding.Embedder:
        if self._embedder is None:
            self._embedder = embedding.Embedder(
                model=self._decode.model,
                vocab=self._decode.vocab,
                context_length=self._decode.context_per_slot,
                threads=self._decode.launch.spec.threads,
            )
        return self._embedder


def chat_input(request: inference_pb2.ChatRequest) -> engine_pb2.ChatInput:
    """The conversation and tools of a public chat request, as Generate takes them."""
    chat = engine_pb2.ChatInput(
        messages=request.messages,
        tools=request.tools,
        tool_choice=request.tool_choice,
        continue_final_message=request.continue_final_message,
    )
    if request.HasField("parallel_tool_calls"):
        chat.parallel_tool_calls = request.parallel_tool_calls
    return chat
