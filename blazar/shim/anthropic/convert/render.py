"""Canonical generation streams as Anthropic's Messages API responses.

Pure: no IO, no clock, no logging. `message` renders a collected answer, `Events` a
chunk stream as Anthropic's named SSE events (`message_start` to `message_stop`), and
`token_count` a Tokenize response as count_tokens answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from blazar._proto.v1 import inference_pb2
from blazar.shim import canonical
from blazar.shim.anthropic import protocol


@dataclass(frozen=True)
class ResponseMeta:
    """What a response repeats: Anthropic's message id and the model as asked for; the
    `max_tokens` asked for, which tells an answer stopped by it from one stopped by the
    end of the context; and whether the request only pre-warms the cache
    (`max_tokens: 0`): its answer holds no content, stops on `max_tokens` and counts no
    output tokens, whatever the one token the engine ran to
    (`requests.PREWARM_TOKENS`) was."""

    id: str
    model: str
    max_tokens: int
    prewarm: bool = False


def stop_reason(final: inference_pb2.Final, *, max_tokens: int) -> protocol.StopReason:
    """FINISH_REASON_STOP is the model's end of turn, or one of the caller's stop
    sequences when `Final.stop_sequence` names it. FINISH_REASON_LENGTH before
    `max_tokens` tokens is the end of the context, which Anthropic's current models
    report as "model_context_window_exceeded" (max_tokens reserves no room there:
    `requests.messages_request`)."""
    if final.finish_reason == inference_pb2.FINISH_REASON_LENGTH:
        if final.usage.completion_tokens < max_tokens:
            return "model_context_window_exceeded"
        return "max_tokens"
    if final.finish_reason == inference_pb2.FINISH_REASON_TOOL_CALLS:
        return "tool_use"
    return "stop_sequence" if final.stop_sequence else "end_turn"


def stop_sequence(final: inference_pb2.Final) -> str | None:
    return final.stop_sequence or None


def usage(final: inference_pb2.Final, *, prewarm: bool = False) -> protocol.Usage:
    """The prompt's tokens reused from the cache are read from it; the rest were
    prefilled (`input_tokens`). Blazar keeps every prompt's cache without being asked,
    so no tokens are counted as written to it. A pre-warming request outputs none."""
    cached = final.usage.cached_tokens
    return {
        "input_tokens": final.usage.prompt_tokens - cached,
        "output_tokens": 0 if prewarm else final.usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _no_usage() -> protocol.Usage:
    return {
        "input_tokens": 0,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _tool_use(call: inference_pb2.ToolCall) -> protocol.ToolUseContent:
    arguments = json.loads(call.arguments or "{}")
    assert isinstance(arguments, dict), "a whole call's arguments are a JSON object"
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def message(answer: canonical.Answer, meta: ResponseMeta) -> protocol.MessageResponse:
    """A whole generation: its text as one block (none when empty), then its whole calls;
    nothing when it pre-warms the cache."""
    final = answer.finished()
    content: list[protocol.Content] = []
    if answer.text and not meta.prewarm:
        content.append({"type": "text", "text": answer.text})
    if not meta.prewarm:
        content.extend(_tool_use(call) for call in answer.whole_calls())
    stop = _stop(final, meta)
    return {
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": stop["stop_reason"],
        "stop_sequence": stop["stop_sequence"],
        "usage": usage(final, prewarm=meta.prewarm),
    }


def _stop(final: inference_pb2.Final, meta: ResponseMeta) -> protocol.StopDelta:
    """Why the answer stopped; a pre-warming request at its `max_tokens` of 0."""
    if meta.prewarm:
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    return {
        "stop_reason": stop_reason(final, max_tokens=meta.max_tokens),
        "stop_sequence": stop_sequence(final),
    }


class Events:
    """Renders one generation as Anthropic's stream of named events.

    Order: `message_start` (no content, no stop reason; the prompt's usage, see
    `opening`) and a `ping`; the text as one block (`content_block_start`,
    a `text_delta` per canonical delta, `content_block_stop`) once there is text; at the
    end each whole tool call as a `tool_use` block whose input arrives in one
    `input_json_delta`; then `message_delta` with the stop reason and the whole usage,
    and `message_stop`. Tool calls wait for the final chunk because only `Final.tool_calls`
    says which are whole: a call is never streamed half-formed.
    """

    def __init__(self, meta: ResponseMeta) -> None:
        self._meta = meta
        self._calls = canonical.Answer()
        self._text_open = False
        self._blocks = 0
        self.finished = False

    def opening(
        self, *, prompt_tokens: int | None = None, cached_tokens: int = 0
    ) -> list[protocol.Event]:
        """`message_start` and a `ping`. The start's usage holds the prompt's counts when
        the daemon told them with the first chunk (`prompt_tokens`, of which
        `cached_tokens` came from the cache), as Anthropic's does: clients that read the
        input tokens there alone see them; else zeros, and the counts come at the end."""
        usage = _no_usage()
        if prompt_tokens is not None:
            cached = min(cached_tokens, prompt_tokens)
            usage["input_tokens"] = prompt_tokens - cached
            usage["cache_read_input_tokens"] = cached
        start: protocol.MessageResponse = {
            "id": self._meta.id,
            "type": "message",
            "role": "assistant",
            "model": self._meta.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def render(self, chunk: inference_pb2.Chunk) -> list[protocol.Event]:
        part = chunk.WhichOneof("part")
        if part == "delta":
            self._calls.add(chunk)
            if not chunk.delta.text or self._meta.prewarm:
                return []
            out: list[protocol.Event] = []
            if not self._text_open:
                self._text_open = True
                out.append(
                    {
                        "type": "content_block_start",
                        "index": self._blocks,
                        "content_block": {"type": "text", "text": ""},
                    }
                )
            out.append(
                {
                    "type": "content_block_delta",
                    "index": self._blocks,
                    "delta": {"type": "text_delta", "text": chunk.delta.text},
                }
            )
            return out
        if part != "final":
            return []
        self.finished = True
        self._calls.add(chunk)
        out = []
        if self._text_open:
            out.append({"type": "content_block_stop", "index": self._blocks})
            self._blocks += 1
        for call in () if self._meta.prewarm else self._calls.whole_calls():
            block = _tool_use(call)
            out.extend(self._tool_use_block(block, arguments=call.arguments or "{}"))
        final = chunk.final
        out.append(
            {
                "type": "message_delta",
                "delta": _stop(final, self._meta),
                "usage": usage(final, prewarm=self._meta.prewarm),
            }
        )
        out.append({"type": "message_stop"})
        return out

    def _tool_use_block(
        self, block: protocol.ToolUseContent, *, arguments: str
    ) -> list[protocol.Event]:
        index = self._blocks
        self._blocks += 1
        return [
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {**block, "input": {}},
            },
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": arguments},
            },
            {"type": "content_block_stop", "index": index},
        ]


def token_count(response: inference_pb2.TokenizeResponse) -> protocol.TokenCount:
    return {"input_tokens": response.count}
