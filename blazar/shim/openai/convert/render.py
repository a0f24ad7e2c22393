"""Canonical generation streams into OpenAI's chat and completion responses.

Pure: no IO, no clock, no logging. `ChatStream` and `CompletionStream` turn chunks
into OpenAI stream chunks, `Answer` collects a stream for the non-streaming shapes;
embeddings and the model list are rendered here too.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from blazar._proto.v1 import inference_pb2
from blazar.shim import canonical, inference
from blazar.shim.openai import protocol
from blazar.shim.openai.convert import logprob

# OpenAI reports a backend configuration hash; Blazar has one configuration per lane,
# which the first chunk cannot know yet, so this only tells clients who answered.
SYSTEM_FINGERPRINT = "fp_blazar"


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response repeats: OpenAI's id, creation time, model."""

    id: str
    created: int
    model: str


def finish_reason(final: inference_pb2.Final) -> protocol.FinishReason:
    if final.finish_reason == inference_pb2.FINISH_REASON_LENGTH:
        return "length"
    if final.finish_reason == inference_pb2.FINISH_REASON_TOOL_CALLS:
        return "tool_calls"
    return "stop"


def tool_call_deltas(
    deltas: Sequence[inference_pb2.ToolCallDelta],
) -> list[protocol.ToolCallDelta]:
    """Streamed calls in OpenAI's shape: `id`, `type` and the name on a call's first
    delta, argument fragments after."""
    out: list[protocol.ToolCallDelta] = []
    for d in deltas:
        function: protocol.FunctionDelta = {}
        if d.name:
            function["name"] = d.name
        function["arguments"] = d.arguments
        item: protocol.ToolCallDelta = {"index": d.index, "function": function}
        if d.id:
            item["id"] = d.id
            item["type"] = "function"
        out.append(item)
    return out


def usage(final: inference_pb2.Final) -> protocol.Usage:
    prompt = final.usage.prompt_tokens
    completion = final.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": final.usage.cached_tokens},
    }


def timings(final: inference_pb2.Final) -> protocol.Timings:
    """The request's figures in llama.cpp server's `timings` shape."""
    computed = final.usage.prompt_tokens - final.usage.cached_tokens
    prefill_ms = final.timings.prefill_ms
    predicted = final.usage.completion_tokens
    decode_ms = final.timings.decode_ms
    # As llama.cpp relates them: rate = n / ms, whatever the ms span (here first to
    # last token), so tools that recompute one from the others agree.
    out: protocol.Timings = {
        "cache_n": final.usage.cached_tokens,
        "prompt_n": computed,
        "prompt_ms": prefill_ms,
        "prompt_per_token_ms": prefill_ms / computed if computed > 0 else 0.0,
        "prompt_per_second": computed * 1000.0 / prefill_ms if prefill_ms > 0 else 0.0,
        "predicted_n": predicted,
        "predicted_ms": decode_ms,
        "predicted_per_token_ms": decode_ms / predicted if predicted > 0 else 0.0,
        "predicted_per_second": predicted * 1000.0 / decode_ms if decode_ms > 0 else 0.0,
    }
    if final.routing.drafted_tokens:
        out["draft_n"] = final.routing.drafted_tokens
        out["draft_n_accepted"] = final.routing.accepted_tokens
    if final.timings.load_ms > 0:
        out["load_ms"] = final.timings.load_ms
    if final.timings.parked_ms > 0:
        out["parked_ms"] = final.timings.parked_ms
    return out


class ChatStream:
    """Renders one chat generation as OpenAI `chat.completion.chunk` objects.

    Order: a role chunk, one chunk per text delta, a chunk with an empty delta and the
    finish reason, then (with include_usage) a chunk with no choices and the usage.
    With logprobs, each delta chunk carries the log-probabilities of the tokens that made
    its text, as OpenAI's `logprobs.content` covers content only: those of a delta with
    no text (a character's first bytes) wait for the next text, and those of a tool
    call's markup, held back until it parsed, are dropped when the call comes.
    """

    def __init__(self, meta: ResponseMeta, *, include_usage: bool, logprobs: bool = False) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self._logprobs = logprobs
        # By choice index, the logprobs waiting for their text.
        self._held: dict[int, list[inference_pb2.TokenLogprob]] = {}
        self.finished = False

    def opening(self) -> list[protocol.ChatCompletionChunk]:
        return [self._chunk({"role": "assistant", "content": ""}, finish_reason=None)]

    def render(self, chunk: inference_pb2.Chunk) -> list[protocol.ChatCompletionChunk]:
        part = chunk.WhichOneof("part")
        if part == "delta":
            calls = chunk.delta.tool_calls
            held = self._held.setdefault(chunk.index, [])
            if chunk.delta.text:
                entries, held[:] = [*held, *chunk.delta.logprobs], []
            else:
                entries = []
                if calls:
                    held.clear()
                else:
                    held.extend(chunk.delta.logprobs)
            logprobs = logprob.chat_logprobs(entries) if self._logprobs else None
            if not chunk.delta.text and not calls:
                return []
            delta: protocol.ChatDelta = {"content": chunk.delta.text}
            if calls:
                # As OpenAI streams them: content null beside calls.
                delta = {"content": chunk.delta.text or None, "tool_calls": tool_call_deltas(calls)}
            return [self._chunk(delta, finish_reason=None, index=chunk.index, logprobs=logprobs)]
        if part != "final":
            return []
        self.finished = True
        end = self._chunk({}, finish_reason=finish_reason(chunk.final), index=chunk.index)
        end["timings"] = timings(chunk.final)
        out = [end]
        if self._include_usage:
            last = self._envelope([])
            last["usage"] = usage(chunk.final)
            out.append(last)
        return out

    def _chunk(
        self,
        delta: protocol.ChatDelta,
        *,
        finish_reason: protocol.FinishReason | None,
        index: int = 0,
        logprobs: protocol.ChatLogprobs | None = None,
    ) -> protocol.ChatCompletionChunk:
        return self._envelope(
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ]
        )

    def _envelope(self, choices: list[protocol.ChatChunkChoice]) -> protocol.ChatCompletionChunk:
        out: protocol.ChatCompletionChunk = {
            "id": self._meta.id,
            "object": "chat.completion.chunk",
            "created": self._meta.created,
            "model": self._meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }
        if self._include_usage:
            out["usage"] = None
        return out


class CompletionStream:
    """Renders one raw completion as streamed OpenAI `text_completion` objects.

    With `echo`, the prompt goes out first as a chunk of its own.
    """

    def __init__(
        self,
        meta: ResponseMeta,
        *,
        include_usage: bool,
        logprobs: bool = False,
        echo: str | None = None,
    ) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self._logprobs = logprob.LegacyLogprobs() if logprobs else None
        self._echo = echo
        self.finished = False

    def opening(self) -> list[protocol.Completion]:
        if not self._echo:
            return []
        if self._logprobs is not None:
            self._logprobs.skip(self._echo)
        return [self._chunk(self._echo, finish_reason=None, index=0)]

    def render(self, chunk: inference_pb2.Chunk) -> list[protocol.Completion]:
        part = chunk.WhichOneof("part")
        if part == "delta":
            entries = chunk.delta.logprobs
            if not chunk.delta.text and not (self._logprobs and entries):
                return []
            logprobs = self._logprobs.render(entries) if self._logprobs else None
            return [
                self._chunk(
                    chunk.delta.text, finish_reason=None, index=chunk.index, logprobs=logprobs
                )
            ]
        if part != "final":
            return []
        self.finished = True
        end = self._chunk("", finish_reason=finish_reason(chunk.final), index=chunk.index)
        end["timings"] = timings(chunk.final)
        out = [end]
        if self._include_usage:
            last = self._envelope([])
            last["usage"] = usage(chunk.final)
            out.append(last)
        return out

    def _chunk(
        self,
        text: str,
        *,
        finish_reason: protocol.FinishReason | None,
        index: int,
        logprobs: protocol.CompletionLogprobs | None = None,
    ) -> protocol.Completion:
        return self._envelope(
            [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}]
        )

    def _envelope(self, choices: list[protocol.CompletionChoice]) -> protocol.Completion:
        out: protocol.Completion = {
            "id": self._meta.id,
            "object": "text_completion",
            "created": self._meta.created,
            "model": self._meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }
        if self._include_usage:
            out["usage"] = None
        return out


class Answer(canonical.Answer):
    """A whole generation (see `canonical.Answer`) in OpenAI's non-streaming shapes."""

    def tool_calls(self) -> list[protocol.ToolCall]:
        """The whole calls (`canonical.Answer.whole_calls`) in OpenAI's shape."""
        return [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in self.whole_calls()
        ]

    def chat_completion(
        self, meta: ResponseMeta, *, logprobs: bool = False
    ) -> protocol.ChatCompletion:
        final = self.finished()
        message: protocol.AssistantMessage = {"role": "assistant", "content": "".join(self.parts)}
        calls = self.tool_calls()
        if calls:
            message["content"] = message["content"] or None
            message["tool_calls"] = calls
        return {
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprob.chat_logprobs(self.text_logprobs) if logprobs else None,
                    "finish_reason": finish_reason(final),
                }
            ],
            "usage": usage(final),
            "timings": timings(final),
        }

    def completion(
        self, meta: ResponseMeta, *, logprobs: bool = False, echo: str | None = None
    ) -> protocol.Completion:
        """With echo and logprobs, the prompt's tokens come first (`Final.prompt_logprobs`:
        every prompt token after BOS, so none is null)."""
        final = self.finished()
        rendered: protocol.CompletionLogprobs | None = None
        if logprobs:
            legacy = logprob.LegacyLogprobs()
            entries = [*final.prompt_logprobs, *self.logprobs] if echo else self.logprobs
            if echo and not final.prompt_logprobs:
                legacy.skip(echo)
            rendered = legacy.render(entries)
        return {
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                {
                    "text": (echo or "") + "".join(self.parts),
                    "index": 0,
                    "logprobs": rendered,
                    "finish_reason": finish_reason(final),
                }
            ],
            "usage": usage(final),
            "timings": timings(final),
        }


def embedding_list(
    response: inference_pb2.EmbedResponse,
    *,
    model: str,
    encoding_format: str | None,
) -> protocol.EmbeddingList:
    """OpenAI's embeddings list; base64 is little-endian float32, as OpenAI sends it."""
    data: list[protocol.Embedding] = []
    for index, embedding in enumerate(response.embeddings):
        values = list(embedding.values)
        vector: list[float] | str = values
        if encoding_format == "base64":
            packed = struct.pack(f"<{len(values)}f", *values)
            vector = base64.b64encode(packed).decode("ascii")
        data.append({"object": "embedding", "embedding": vector, "index": index})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": response.prompt_tokens, "total_tokens": response.prompt_tokens},
    }


def model_list(response: inference_pb2.ListModelsResponse) -> protocol.ModelList:
    return {"object": "list", "data": [_model(m) for m in response.models]}


def model(response: inference_pb2.ListModelsResponse, name: str) -> protocol.Model:
    """The entry of `model_list` whose id is `name` (a Lane name or an alias);
    ModelNotFound when there is none (`modelnames.lookups`)."""
    return _model(inference.listed_model(response, name))


def _model(info: inference_pb2.ModelInfo) -> protocol.Model:
    return {"id": info.id, "object": "model", "created": info.created, "owned_by": "blazar"}
