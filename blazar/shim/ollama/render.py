"""Render canonical generations and errors in Ollama's wire format.

Pure: no IO, no clock, no logging (timestamps come in as arguments). `Lines` renders a
chunk stream as Ollama's NDJSON objects, `answer` a collected one, each ending with
Ollama's statistics (`metrics`, in nanoseconds); `embed_response` and
`embeddings_response` answer the two embedding routes; `error_response` renders any
`BlazarError` as Ollama's `{"error": ...}` with the shared HTTP status.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import canonical, http_errors
from blazar.shim.ollama import protocol

# Which route a line answers: /api/chat or /api/generate.
Kind = Literal["chat", "generate"]


def timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with a `Z`, as Go writes `time.Time`."""
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def done_reason(final: inference_pb2.Final) -> protocol.DoneReason:
    """A turn that ended in tool calls is "stop" too: Ollama has no other reason for it."""
    if final.finish_reason == inference_pb2.FINISH_REASON_LENGTH:
        return "length"
    return "stop"


def tool_calls(calls: Sequence[inference_pb2.ToolCall]) -> list[protocol.CallMade]:
    """Whole calls (`canonical.Answer.whole_calls`) in Ollama's shape, numbered in
    their turn, with the arguments as an object: a whole call's are a JSON object."""
    return [
        {
            "id": call.id,
            "function": {
                "index": index,
                "name": call.name,
                "arguments": json.loads(call.arguments or "{}"),
            },
        }
        for index, call in enumerate(calls)
    ]


def _ns(milliseconds: float) -> int:
    return max(0, round(milliseconds * 1_000_000))


def metrics(final: inference_pb2.Final) -> protocol.Metrics:
    """Ollama's statistics from the canonical figures, in nanoseconds.

    `load_duration` is the queue time (admission, a free slot, preparing the prompt,
    and waking a sleeping Lane, `Timings.load_ms`): Ollama counts loading a model and
    waiting for its runner there. The prompt's figures are the prefill's own (the wait
    behind other prompts' chunks, `prefill_wait_ms`, is not evaluating this one);
    `eval_*` the generation's: as Ollama times it, from the prompt's evaluation to the
    last token, so the first token's own time (sampled after the prefill, up to its
    delivery: `ttft_ms` past the parts, less any time parked) counts with the decode.
    Otherwise one generated token would read as taking no time at all, and a client's
    `eval_count / eval_duration` would divide by zero. The total runs from arrival to
    the last token: time to first token plus decoding, or, when the generation was
    parked after its first token, the parts plus the time parked.
    """
    timings = final.timings
    parts_ms = timings.queue_ms + timings.prefill_wait_ms + timings.prefill_ms
    first_token_ms = max(0.0, timings.ttft_ms - parts_ms - timings.parked_ms)
    total_ms = max(
        timings.ttft_ms + timings.decode_ms,
        parts_ms + timings.decode_ms + timings.parked_ms,
    )
    return {
        "total_duration": _ns(total_ms),
        "load_duration": _ns(timings.queue_ms),
        "prompt_eval_count": final.usage.prompt_tokens,
        "prompt_eval_duration": _ns(timings.prefill_ms),
        "eval_count": final.usage.completion_tokens,
        "eval_duration": _ns(first_token_ms + timings.decode_ms),
    }


def logprobs(entries: Sequence[inference_pb2.TokenLogprob]) -> list[protocol.Logprob]:
    out: list[protocol.Logprob] = []
    for entry in entries:
        item: protocol.Logprob = {
            "token": entry.token,
            "logprob": entry.logprob,
            "bytes": list(entry.bytes),
        }
        if entry.top:
            item["top_logprobs"] = [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in entry.top
            ]
        out.append(item)
    return out


Line = protocol.ChatResponse | protocol.GenerateResponse


def _line(
    kind: Kind,
    *,
    model: str,
    created_at: str,
    text: str,
    done: bool,
    calls: list[protocol.CallMade] | None = None,
) -> Line:
    if kind == "chat":
        message: protocol.AssistantMessage = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        chat: protocol.ChatResponse = {
            "model": model,
            "created_at": created_at,
            "message": message,
            "done": done,
        }
        return chat
    generate: protocol.GenerateResponse = {
        "model": model,
        "created_at": created_at,
        "response": text,
        "done": done,
    }
    return generate


def _finish(line: Line, final: inference_pb2.Final) -> Line:
    line["done_reason"] = done_reason(final)
    line.update(metrics(final))  # type: ignore[typeddict-item]
    return line


class Lines:
    """Renders one generation as Ollama's stream: an object per text delta
    (`done: false`), an object per tool call, then one with `done: true`, the done
    reason and the statistics.

    Ollama streams a call whole, never its arguments in fragments, and only the final
    chunk says which calls are whole (`Final.tool_calls`: a forced call that
    `num_predict` cut short is not). So the calls' deltas are joined as they come and
    each whole call goes out, in its own object, just before the last one.
    """

    def __init__(
        self, kind: Kind, *, model: str, clock: Callable[[], str], logprobs: bool = False
    ) -> None:
        self._kind = kind
        self._model = model
        self._clock = clock
        self._logprobs = logprobs
        self._calls = canonical.Answer()
        self.finished = False

    def render(self, chunk: inference_pb2.Chunk) -> list[Line]:
        part = chunk.WhichOneof("part")
        if part == "delta":
            if chunk.delta.tool_calls:
                self._calls.add(chunk)
            entries = chunk.delta.logprobs if self._logprobs else ()
            if not chunk.delta.text and not entries:
                return []
            line = self._line(chunk.delta.text, done=False)
            if self._logprobs:
                line["logprobs"] = logprobs(entries)
            return [line]
        if part != "final":
            return []
        self.finished = True
        self._calls.add(chunk)
        out = [self._line("", done=False, calls=[c]) for c in tool_calls(self._calls.whole_calls())]
        out.append(_finish(self._line("", done=True), chunk.final))
        return out

    def _line(self, text: str, *, done: bool, calls: list[protocol.CallMade] | None = None) -> Line:
        return _line(
            self._kind,
            model=self._model,
            created_at=self._clock(),
            text=text,
            done=done,
            calls=calls,
        )


def answer(
    kind: Kind,
    collected: canonical.Answer,
    *,
    model: str,
    created_at: str,
    with_logprobs: bool = False,
) -> Line:
    """A whole generation as one object (`stream: false`), with its whole tool calls."""
    final = collected.finished()
    line = _line(
        kind,
        model=model,
        created_at=created_at,
        text=collected.text,
        done=True,
        calls=tool_calls(collected.whole_calls()),
    )
    if with_logprobs:
        line["logprobs"] = logprobs(collected.logprobs)
    return _finish(line, final)


def loaded(kind: Kind, *, model: str, created_at: str, unload: bool = False) -> Line:
    """The answer to a preload, or with `unload` to an unload (see `is_load`), as
    Ollama's: no text, done, done_reason "load" or "unload"."""
    line = _line(kind, model=model, created_at=created_at, text="", done=True)
    line["done_reason"] = "unload" if unload else "load"
    return line


def embed_response(
    response: inference_pb2.EmbedResponse, *, model: str, total_s: float
) -> protocol.EmbedResponse:
    """The embeddings as the engine shaped them (`dimensions` included), and how long
    the request took (`total_s`; Ollama's `load_duration`, a model load, has no
    counterpart Blazar measures here and is left out)."""
    vectors = [list(embedding.values) for embedding in response.embeddings]
    return {
        "model": model,
        "embeddings": vectors,
        "total_duration": _ns(total_s * 1000.0),
        "prompt_eval_count": response.prompt_tokens,
    }


def embeddings_response(response: inference_pb2.EmbedResponse) -> protocol.EmbeddingsResponse:
    """The one embedding; an empty prompt has none (Ollama answers an empty list)."""
    values = response.embeddings[0].values if response.embeddings else ()
    return {"embedding": list(values)}


# ---------------------------------------------------------------- errors


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: protocol.ErrorBody
    headers: dict[str, str]


def error_response(err: errors.BlazarError) -> ErrorResponse:
    """Ollama's `{"error": "..."}` with the status every dialect shares."""
    return ErrorResponse(
        status=http_errors.http_status(err),
        body={"error": _error_message(err)},
        headers=http_errors.headers(err),
    )


def _error_message(err: errors.BlazarError) -> str:
    """The error's sentence, with a prompt that does not fit told in Ollama's terms.
    `options.num_predict` only bounds the generation (`max_tokens_up_to_context`), so
    the prompt is what to shorten."""
    sizes = err.sizes() if isinstance(err, errors.ContextLengthExceeded) else None
    if sizes is None:
        limit = err.metadata.get(errors.CONTEXT_LIMIT_KEY)
        if isinstance(err, errors.ContextLengthExceeded) and limit and "input" in err.metadata:
            # An embedding's input over the request's num_ctx.
            some = "at least " if errors.PROMPT_TOKENS_AT_LEAST_KEY in err.metadata else ""
            return (
                f"Input {err.metadata['input']} is {some}{err.metadata.get('prompt_tokens')} "
                f"tokens long, but the request's options.num_ctx is {limit} tokens. Shorten "
                "or split it, or raise num_ctx."
            )
        return err.message
    if sizes.requested:
        # The context is the request's own `options.num_ctx` (`Sampling.context_limit`).
        return (
            f"The request's options.num_ctx is {sizes.context_length} tokens, but the "
            f"request {sizes.needs(prompt='prompt')}. Shorten the prompt or raise num_ctx."
        )
    return sizes.refusal(prompt="prompt", advice="Shorten the prompt.")
