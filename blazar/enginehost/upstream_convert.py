"""Pure translation between Blazar's canonical generation and an OpenAI-compatible API.

An upstream Lane (`engine: upstream`) sends each request on to another server's
`/chat/completions` or `/completions`, always streaming (`stream_options.include_usage`),
and turns its server-sent events back into `blazar.v1.Chunk`s, so every dialect of the
shim renders an upstream's answer as it renders an engine's. No IO, no clock, no
logging: `client` does the HTTP.

What passes: messages (with tool calls, tool results and names), tools and
`tool_choice`, `parallel_tool_calls`, structured output (`json_schema` and
`json_object` as `response_format`), temperature, top_p, seed, max_tokens, stop,
presence and frequency penalties, logit_bias (the ids are the upstream model's: it is
the Lane's model), logprobs and top_logprobs. `top_k`, `min_p`, `repeat_penalty` and
`ignore_eos` pass under the names llama.cpp's server, vLLM and Blazar accept. Back
come text, tool-call deltas, logprobs, the finish reason and usage with cached tokens
(`usage.prompt_tokens_details.cached_tokens`) when the upstream reports them.

Refused (INVALID_ARGUMENT, before admission): a GBNF `grammar`, which OpenAI's API has
no field for, `prompt_logprobs`, which it does not return, a continued final assistant
turn (`continue_final_message`), which OpenAI-compatible servers do not agree on, and
what the engine refuses too where it would otherwise pass as something else (a schema
that is not JSON, a `tool_choice` name without MODE_NAMED).
"""

from __future__ import annotations

import datetime
import email.utils
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors, wire

CHAT_ROUTE = "chat/completions"
COMPLETIONS_ROUTE = "completions"

_FINISH = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "tool_calls": inference_pb2.FINISH_REASON_TOOL_CALLS,
    "function_call": inference_pb2.FINISH_REASON_TOOL_CALLS,
}

_TOOL_CHOICE = {
    inference_pb2.ToolChoice.MODE_AUTO: "auto",
    inference_pb2.ToolChoice.MODE_NONE: "none",
    inference_pb2.ToolChoice.MODE_REQUIRED: "required",
}


def refusal(request: engine_pb2.GenerateRequest) -> errors.InvalidRequest | None:
    """What of `request` an OpenAI-compatible upstream cannot be asked for; None when
    all of it passes."""
    if request.constraint.WhichOneof("kind") == "grammar":
        return errors.InvalidRequest(
            "This model is served by an upstream server, which takes no GBNF grammar; "
            "use a JSON schema (response_format) instead.",
            metadata={errors.FIELD_KEY: "constraint"},
        )
    if request.sampling.prompt_logprobs:
        return errors.InvalidRequest(
            "This model is served by an upstream server, which returns no prompt "
            "logprobs; remove prompt_logprobs.",
            metadata={errors.FIELD_KEY: "prompt_logprobs"},
        )
    if request.sampling.context_limit:
        return errors.InvalidRequest(
            "This model is served by an upstream server, which sizes its own context and "
            "takes no smaller one per request; remove context_limit.",
            metadata={errors.FIELD_KEY: "context_limit"},
        )
    if request.chat.continue_final_message:
        # OpenAI's API has no such field; llama.cpp's server continues a final assistant
        # turn by default, vLLM only when asked: no one body means it everywhere.
        return errors.InvalidRequest(
            "This model is served by an upstream server, which cannot be asked to "
            "continue the final assistant turn; end the conversation with a user turn.",
            metadata={errors.FIELD_KEY: "continue_final_message"},
        )
    choice = request.chat.tool_choice
    if choice.name and choice.mode != inference_pb2.ToolChoice.MODE_NAMED:
        # As the engine refuses it (`engine.tools.parse`): the mode alone would run.
        return errors.InvalidRequest(
            f"tool_choice names the tool {choice.name!r} but its mode is not MODE_NAMED; "
            "a name goes only with MODE_NAMED.",
            metadata={errors.FIELD_KEY: "tool_choice"},
        )
    texts = [("tools", tool.parameters) for tool in request.chat.tools if tool.parameters]
    if request.constraint.WhichOneof("kind") == "json_schema":
        texts.append(("constraint", request.constraint.json_schema))
    for where, text in texts:
        try:
            json.loads(text)
        except ValueError:
            return errors.InvalidRequest(
                f"A JSON schema in {where} is not valid JSON.", metadata={errors.FIELD_KEY: where}
            )
    return None


def request_body(request: engine_pb2.GenerateRequest, *, model: str) -> tuple[str, dict[str, Any]]:
    """The route under the upstream's base URL and the JSON body for `request`, asking
    for `model`. Raises what `refusal` returns."""
    refused = refusal(request)
    if refused is not None:
        raise refused
    chat = request.WhichOneof("input") == "chat"
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [_message(m) for m in request.chat.messages]
        body.update(_tools(request.chat))
    else:
        body["prompt"] = request.prompt
    body.update(_sampling(request.sampling, chat=chat))
    kind = request.constraint.WhichOneof("kind")
    if kind == "json_schema":
        schema = json.loads(request.constraint.json_schema)
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": True},
        }
    elif kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    return (CHAT_ROUTE if chat else COMPLETIONS_ROUTE), body


def _message(message: inference_pb2.Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments or "{}"},
            }
            for call in message.tool_calls
        ]
        if not message.content:
            out["content"] = None
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def _tools(chat: engine_pb2.ChatInput) -> dict[str, Any]:
    if not chat.tools:
        return {}
    tools = []
    for tool in chat.tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = (
            json.loads(tool.parameters) if tool.parameters else {"type": "object"}
        )
        tools.append({"type": "function", "function": function})
    out: dict[str, Any] = {"tools": tools}
    mode = chat.tool_choice.mode
    if mode == inference_pb2.ToolChoice.MODE_NAMED:
        out["tool_choice"] = {"type": "function", "function": {"name": chat.tool_choice.name}}
    elif mode in _TOOL_CHOICE:
        out["tool_choice"] = _TOOL_CHOICE[mode]
    if chat.HasField("parallel_tool_calls"):
        out["parallel_tool_calls"] = chat.parallel_tool_calls
    return out


def _sampling(sampling: inference_pb2.Sampling, *, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, key in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("repeat_penalty", "repeat_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("seed", "seed"),
        ("max_tokens", "max_tokens"),
    ):
        if sampling.HasField(name):
            out[key] = getattr(sampling, name)
    if sampling.stop:
        out["stop"] = list(sampling.stop)
    if sampling.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in sorted(sampling.logit_bias.items())}
    if sampling.logprobs:
        if chat:
            out["logprobs"] = True
            if sampling.top_logprobs:
                out["top_logprobs"] = sampling.top_logprobs
        else:
            # The legacy completions API: an integer, the alternatives per token.
            out["logprobs"] = max(1, sampling.top_logprobs)
    if sampling.ignore_eos:
        out["ignore_eos"] = True
    return out


@dataclass
class StreamTranslator:
    """Turns an upstream's stream events (each `data:` JSON object) into chunks: a
    Delta per event with text, tool calls or logprobs, and one Final from `finish`."""

    tokens: int = 0
    finish_reason: str | None = None
    usage: Mapping[str, Any] = field(default_factory=dict)
    tool_indexes: set[int] = field(default_factory=set)
    # Events fed so far.
    events: int = 0
    # The request's max_tokens (None: unset). An upstream that streams past it is cut
    # there, as an engine would stop: one that ignores it would otherwise hold the
    # Lane's slot and the caller's stream for as long as it goes on.
    max_tokens: int | None = None
    # Whether the upstream went past max_tokens (its answer ends there, "length").
    overran: bool = False

    def feed(self, event: Any) -> list[inference_pb2.Chunk]:
        """The chunks of one event; UNAVAILABLE for an error event, or one that is not
        shaped as OpenAI's (a server that is not OpenAI-compatible, or a broken one)."""
        self.events += 1
        if isinstance(event, Mapping) and "error" in event:
            raise stream_error(event["error"])
        try:
            if not isinstance(event, Mapping):
                raise TypeError("not a JSON object")
            return self._feed(event)
        except (TypeError, ValueError, AttributeError) as exc:
            raise errors.Unavailable(
                f"The upstream server sent an event not shaped as OpenAI's ({exc}): "
                f"{json.dumps(event)[:200]}"
            ) from None

    def incomplete(self, *, done: bool, content_type: str) -> errors.Unavailable | None:
        """Why a stream that ended (`done`: with `data: [DONE]`) is not a whole answer:
        it ended with neither `[DONE]` nor a finish reason (the upstream stopped
        mid-answer), or held no event at all (not an event stream); None when whole."""
        if done or self.finish_reason is not None:
            return None
        if not self.events:
            return errors.Unavailable(
                "The upstream server answered HTTP 200 with no server-sent event "
                f"(content-type {content_type or 'none'}): is upstream.url the OpenAI "
                "base URL of a server that streams, /v1 included?"
            )
        return errors.Unavailable(
            "The upstream server's stream ended mid-answer, with neither a finish reason "
            "nor [DONE]."
        )

    def _feed(self, event: Mapping[str, Any]) -> list[inference_pb2.Chunk]:
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            self.usage = usage
        chunks = []
        for choice in event.get("choices") or ():
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
            delta = _delta(choice)
            if delta is not None:
                if self.max_tokens is not None and self.tokens + delta.tokens > self.max_tokens:
                    self.overran = True
                    self.finish_reason = "length"
                    break
                self.tokens += delta.tokens
                self.tool_indexes.update(call.index for call in delta.tool_calls)
                chunks.append(inference_pb2.Chunk(delta=delta))
        return chunks

    def finish(self, *, prefill_s: float = 0.0, decode_s: float = 0.0) -> inference_pb2.Chunk:
        """The Final, with the times the caller measured: `prefill_s` from sending the
        request to its first delta (the upstream's queue, prefill and the network),
        `decode_s` from there to the end."""
        reason = _FINISH.get(self.finish_reason or "stop", inference_pb2.FINISH_REASON_STOP)
        if self.tool_indexes and reason == inference_pb2.FINISH_REASON_STOP:
            # Servers that predate `tool_calls` as a finish reason say "stop".
            reason = inference_pb2.FINISH_REASON_TOOL_CALLS
        whole = len(self.tool_indexes)
        if reason == inference_pb2.FINISH_REASON_LENGTH and whole:
            whole -= 1  # the last call may be cut short
        details = self.usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        usage = inference_pb2.Usage(
            prompt_tokens=_int(self.usage.get("prompt_tokens")),
            completion_tokens=_int(self.usage.get("completion_tokens"), default=self.tokens),
            cached_tokens=_int(cached),
        )
        final = inference_pb2.Final(finish_reason=reason, usage=usage, tool_calls=whole)
        final.routing.prefix_tokens_reused = usage.cached_tokens
        final.timings.prefill_ms = prefill_s * 1000.0
        final.timings.decode_ms = decode_s * 1000.0
        if decode_s > 0 and usage.completion_tokens > 1:
            final.timings.decode_tokens_per_second = (usage.completion_tokens - 1) / decode_s
        return inference_pb2.Chunk(final=final)


def _int(value: Any, *, default: int = 0) -> int:
    """A count the upstream reported, or `default` for one that is not a count: not an
    integer, negative (the daemon's counters only go up) or beyond an int32 field."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= wire.INT32_MAX:
        return value
    return default


def _delta(choice: Mapping[str, Any]) -> inference_pb2.Delta | None:
    delta = inference_pb2.Delta()
    body = choice.get("delta")
    if isinstance(body, Mapping):  # chat
        delta.text = body.get("content") or ""
        for call in body.get("tool_calls") or ():
            function = call.get("function") or {}
            delta.tool_calls.append(
                inference_pb2.ToolCallDelta(
                    index=_int(call.get("index")),
                    id=call.get("id") or "",
                    name=function.get("name") or "",
                    arguments=function.get("arguments") or "",
                )
            )
    else:  # completions
        delta.text = choice.get("text") or ""
    delta.logprobs.extend(_logprobs(choice.get("logprobs")))
    if not delta.text and not delta.tool_calls and not delta.logprobs:
        return None
    # Servers stream a token per event; logprobs, when asked for, count them exactly.
    delta.tokens = len(delta.logprobs) or 1
    return delta


def _logprobs(body: Any) -> list[inference_pb2.TokenLogprob]:
    if not isinstance(body, Mapping):
        return []
    content = body.get("content")
    if isinstance(content, list):  # chat: one object per token
        return [
            _token(item, top=[_token(t) for t in item.get("top_logprobs") or ()])
            for item in content
        ]
    tokens = body.get("tokens")  # completions: parallel lists
    if not isinstance(tokens, list):
        return []
    values = body.get("token_logprobs") or []
    tops = body.get("top_logprobs") or []
    out = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], Mapping) else {}
        out.append(
            inference_pb2.TokenLogprob(
                token=str(token),
                logprob=float(values[i] or 0.0) if i < len(values) else 0.0,
                bytes=str(token).encode(),
                top=[
                    inference_pb2.TokenLogprob(token=t, logprob=float(v), bytes=t.encode())
                    for t, v in top.items()
                ],
            )
        )
    return out


def _token(
    item: Mapping[str, Any], *, top: list[inference_pb2.TokenLogprob] | None = None
) -> inference_pb2.TokenLogprob:
    token = str(item.get("token", ""))
    raw = item.get("bytes")
    data = bytes(raw) if isinstance(raw, list) else token.encode()
    return inference_pb2.TokenLogprob(
        token=token, logprob=float(item.get("logprob") or 0.0), bytes=data, top=top or []
    )


def _error_message(body: Any) -> str:
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping):
            return str(inner.get("message") or inner)
        return str(inner)
    return str(body)


# What stands for an upstream's key in what the upstream said.
REDACTED = "[redacted]"


def redacted(err: errors.BlazarError, secret: str | None) -> errors.BlazarError:
    """`err` without `secret` (the key the upstream was sent) in its message: a server
    may quote the key it refuses ("Invalid API key sk-..."), and what it says reaches
    callers, statuses, events and logs."""
    if not secret or secret not in err.message:
        return err
    return type(err)(err.message.replace(secret, REDACTED), metadata=err.metadata)


def stream_error(body: Any) -> errors.BlazarError:
    """An error event in the middle of an upstream's stream."""
    return errors.Unavailable(f"The upstream server failed mid-answer: {_error_message(body)}")


# The longest wait an upstream's Retry-After is passed on with: a date far ahead (a
# clock set wrong, a maintenance window) would have callers wait for hours otherwise.
MAX_RETRY_AFTER_S = 600


def retry_after_ms(value: str | None, *, now: datetime.datetime) -> int | None:
    """An upstream's `Retry-After` header as milliseconds from `now`: delta-seconds
    or an HTTP-date (RFC 9110; a date without a zone is GMT), clamped to 0 (a date
    past) .. MAX_RETRY_AFTER_S. None when not sent or neither form."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        seconds = float(min(int(value), MAX_RETRY_AFTER_S))
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        seconds = (when - now).total_seconds()
    return round(min(max(seconds, 0.0), MAX_RETRY_AFTER_S) * 1000)


def http_error(status: int, text: str, *, retry_after_ms: int | None = None) -> errors.BlazarError:
    """The error a caller gets for an upstream's HTTP error answer. The caller's
    request is at fault only for 400 and 422; a refused key, an unknown model name or
    a failing server are the Lane's operator's to fix (UNAVAILABLE); 429 is overload.
    A 429's or 503's `retry_after_ms` (its `Retry-After`) is the error's hint."""
    try:
        message = _error_message(json.loads(text))
    except ValueError:
        message = text.strip() or f"HTTP {status}"
    said = f"The upstream server answered HTTP {status}: {message}"
    if status in (400, 413, 422):
        return errors.InvalidRequest(said)
    metadata = {}
    if status in (429, 503) and retry_after_ms is not None:
        metadata[errors.RETRY_AFTER_KEY] = str(retry_after_ms)
    if status == 429:
        return errors.Overloaded(said, metadata=metadata)
    return errors.Unavailable(said, metadata=metadata)
