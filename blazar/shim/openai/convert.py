"""Translate between OpenAI's wire format and the canonical `blazar.v1` messages.

Pure: no IO, no clock, no logging. Request side: `chat_request` and `complete_request`
build proto requests, setting in `Sampling` only what the client sent. Response side:
`ChatStream` and `CompletionStream` turn chunks into OpenAI stream chunks, `Answer`
collects a stream for the non-streaming shapes, and `error_response` renders any
`BlazarError` in OpenAI's error envelope.
"""

from __future__ import annotations

import base64
import codecs
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import canonical, http_errors, validation
from blazar.shim.openai import protocol

# OpenAI reports a backend configuration hash; Blazar has one configuration per lane,
# which the first chunk cannot know yet, so this only tells clients who answered.
SYSTEM_FINGERPRINT = "fp_blazar"

_ROLES = {"developer": "system"}
# Roles whose messages OpenAI refuses without content. Its assistant turns may omit
# content when they carry tool_calls; one with neither is still taken here, as an
# empty turn.
_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})
# proto3 int32 map keys.
_TOKEN_ID_LIMIT = 2**31
# OpenAI's legacy completions endpoint stops after 16 tokens when `max_tokens` is
# unset or null (vLLM does the same); chat has no such default and runs until the
# context is full.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response repeats: OpenAI's id, creation time, model."""

    id: str
    created: int
    model: str


# ---------------------------------------------------------------- requests


def chat_request(
    body: protocol.ChatCompletionRequest, *, session: str = "", slo: str = ""
) -> inference_pb2.ChatRequest:
    """The canonical request; `session` (the `x-blazar-session` header) keys replica
    stickiness, else the body's `user`, OpenAI's end-user id; `slo` (the `x-blazar-slo`
    header) names the SLOPolicy, else the Lane's applies."""
    _require_single_choice(body)
    _require_stream_for_options(body)
    _refuse_functions(body)
    _refuse_non_text_output(body)
    _require_content(body.messages)
    messages = [_message(message, i) for i, message in enumerate(body.messages)]
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    sampling = _sampling(body, max_tokens=max_tokens)
    if body.top_logprobs and not body.logprobs:
        raise _invalid("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
    if body.logprobs:
        sampling.logprobs = True
        sampling.top_logprobs = body.top_logprobs or 0
    request = inference_pb2.ChatRequest(
        model=body.model,
        messages=messages,
        sampling=sampling,
        constraint=_constraint(body),
        session=session or body.user or "",
        slo=slo,
        tools=[_tool(t) for t in body.tools or ()],
        tool_choice=_tool_choice(body),
    )
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls
    return request


def _message(message: protocol.ChatMessage, i: int) -> inference_pb2.Message:
    if message.role == "tool" and not message.tool_call_id:
        raise _invalid(
            f"Missing required parameter: 'messages[{i}].tool_call_id' (a tool message "
            "answers a call).",
            param=f"messages[{i}].tool_call_id",
        )
    if message.tool_calls and message.role != "assistant":
        raise _invalid(
            f"Only assistant messages carry 'tool_calls'; message {i} is a {message.role} one.",
            param=f"messages[{i}].tool_calls",
        )
    return inference_pb2.Message(
        role=_ROLES.get(message.role, message.role),
        content=_flatten(message.content, param=f"messages[{i}].content"),
        tool_calls=[
            inference_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in message.tool_calls or ()
        ],
        tool_call_id=message.tool_call_id or "",
        # A tool message's name is the tool's (other roles' names are participants').
        name=(message.name or "") if message.role == "tool" else "",
    )


def _tool(tool: protocol.FunctionTool) -> inference_pb2.Tool:
    function = tool.function
    parameters = function.parameters
    return inference_pb2.Tool(
        name=function.name,
        description=function.description or "",
        parameters="" if parameters is None else canonical.json_text(parameters),
    )


_CHOICES = {
    "auto": inference_pb2.ToolChoice.MODE_AUTO,
    "none": inference_pb2.ToolChoice.MODE_NONE,
    "required": inference_pb2.ToolChoice.MODE_REQUIRED,
}


def _tool_choice(body: protocol.ChatCompletionRequest) -> inference_pb2.ToolChoice | None:
    """None (unset) is OpenAI's default, and Blazar's: "auto" when there are tools."""
    choice = body.tool_choice
    if choice is None:
        return None
    if not body.tools and choice != "none":
        raise _invalid(
            "'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice"
        )
    if isinstance(choice, str):
        return inference_pb2.ToolChoice(mode=_CHOICES[choice])
    return inference_pb2.ToolChoice(
        mode=inference_pb2.ToolChoice.MODE_NAMED, name=choice.function.name
    )


def complete_request(
    body: protocol.CompletionRequest, *, session: str = "", slo: str = ""
) -> inference_pb2.CompleteRequest:
    """The canonical request; `session` and `slo` as for `chat_request`."""
    _require_single_choice(body)
    _require_stream_for_options(body)
    _refuse_best_of_and_suffix(body)
    if isinstance(body.prompt, str):
        prompt = body.prompt
    elif not all(isinstance(item, str) for item in body.prompt):
        raise _invalid(
            "'prompt' must be a string or a list of one string; token arrays are not "
            "supported. Send the text.",
            param="prompt",
        )
    elif len(body.prompt) == 1 and isinstance(body.prompt[0], str):
        prompt = body.prompt[0]
    else:
        raise _invalid(
            f"'prompt' must be a string or a list of exactly one string; got a list of "
            f"{len(body.prompt)}. Send one request per prompt.",
            param="prompt",
        )
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    sampling = _sampling(body, max_tokens=max_tokens)
    if body.logprobs is not None:
        sampling.logprobs = True
        sampling.top_logprobs = body.logprobs
        if body.echo:
            if body.stream:
                raise _invalid(
                    "'echo' with 'logprobs' is not supported when streaming; the prompt's "
                    "log-probabilities only arrive at the end.",
                    param="echo",
                )
            sampling.prompt_logprobs = True
    return inference_pb2.CompleteRequest(
        model=body.model,
        prompt=prompt,
        sampling=sampling,
        constraint=_constraint(body),
        session=session or body.user or "",
        slo=slo,
    )


def prompt_text(body: protocol.CompletionRequest) -> str:
    """The one prompt string of a request `complete_request` accepted."""
    first = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    assert isinstance(first, str), "complete_request refuses token arrays"
    return first


def embed_request(body: protocol.EmbeddingRequest) -> inference_pb2.EmbedRequest:
    """OpenAI's embeddings are unit length, so Blazar's are normalized too."""
    if isinstance(body.input, str):
        inputs = [body.input]
    elif all(isinstance(item, str) for item in body.input):
        inputs = [item for item in body.input if isinstance(item, str)]
    else:
        raise _invalid(
            "'input' must be a string or a list of strings; token arrays are not supported.",
            param="input",
        )
    if not inputs:
        raise _invalid("'input' must not be an empty list.", param="input")
    for i, text in enumerate(inputs):
        if not text:
            param = "input" if isinstance(body.input, str) else f"input[{i}]"
            raise _invalid(f"'{param}' must not be empty.", param=param)
    return inference_pb2.EmbedRequest(model=body.model, inputs=inputs, normalize=True)


def _constraint(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> inference_pb2.Constraint | None:
    """OpenAI's `response_format`, or llama.cpp's `grammar` or `json_schema`: one of them."""
    given = _constraints(body)
    named = list(given)
    if len(named) > 1:
        raise _invalid(
            f"Send one of 'response_format', 'grammar' and 'json_schema'; got "
            f"'{named[0]}' and '{named[1]}'.",
            param=named[1],
        )
    return given[named[0]] if named else None


def blame_of(body: protocol.ChatCompletionRequest | protocol.CompletionRequest) -> Blame:
    """The parameters errors about this request's prompt and constraint blame."""
    constraint = next(iter(_constraints(body)), "response_format")
    prompt = "prompt" if isinstance(body, protocol.CompletionRequest) else "messages"
    return Blame(prompt=prompt, constraint=constraint)


def _constraints(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> dict[str, inference_pb2.Constraint]:
    """The constraints the request sends, by parameter. An empty grammar constrains
    nothing, as in llama.cpp; nor does a `text` response format."""
    schema = body.json_schema
    given = {
        "response_format": _format_constraint(body.response_format),
        "grammar": inference_pb2.Constraint(grammar=body.grammar) if body.grammar else None,
        "json_schema": None if schema is None else canonical.json_schema(schema),
    }
    return {name: constraint for name, constraint in given.items() if constraint is not None}


def _format_constraint(fmt: protocol.ResponseFormat | None) -> inference_pb2.Constraint | None:
    if isinstance(fmt, protocol.JsonObjectFormat):
        return canonical.json_object()
    if isinstance(fmt, protocol.JsonSchemaFormat):
        schema = fmt.json_schema.json_schema
        if schema is None:
            return canonical.json_object()
        return canonical.json_schema(schema)
    return None


def _require_single_choice(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> None:
    if body.n is not None and body.n != 1:
        raise _invalid(f"Only n=1 is supported; got n={body.n}.", param="n")


def _require_stream_for_options(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> None:
    """OpenAI refuses `stream_options` on a request that does not stream."""
    if body.stream_options is not None and not body.stream:
        raise _invalid(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )


def _refuse_best_of_and_suffix(body: protocol.CompletionRequest) -> None:
    """As with `n`, ignoring these would pass off a different answer as the one asked for."""
    if body.best_of is not None and body.best_of != 1:
        raise _invalid(f"Only best_of=1 is supported; got best_of={body.best_of}.", param="best_of")
    if body.suffix:
        raise _invalid(
            "'suffix' is not supported by this server: completions only continue the prompt.",
            param="suffix",
        )


def _refuse_non_text_output(body: protocol.ChatCompletionRequest) -> None:
    """Blazar generates text only, token by token, with no predicted-output path."""
    if body.modalities is not None and body.modalities != ["text"]:
        raise _invalid(
            f"Only text output is supported; 'modalities' must be [\"text\"], got "
            f"{json.dumps(body.modalities)}.",
            param="modalities",
        )
    if body.audio is not None:
        raise _invalid("Audio output is not supported by this server.", param="audio")
    if body.prediction is not None:
        raise _invalid(
            "Predicted outputs ('prediction') are not supported by this server.",
            param="prediction",
        )


def _refuse_functions(body: protocol.ChatCompletionRequest) -> None:
    """The deprecated form of tools: say which form to use rather than ignore it."""
    for param in ("functions", "function_call"):
        if getattr(body, param) is not None:
            raise _invalid(
                f"'{param}' (deprecated by OpenAI) is not supported by this server; send "
                "'tools' and 'tool_choice'.",
                param=param,
            )


def _require_content(messages: Sequence[protocol.ChatMessage]) -> None:
    """A system or user turn without content is a client bug, not an empty turn."""
    for i, message in enumerate(messages):
        if message.role not in _CONTENT_REQUIRED:
            continue
        param = f"messages[{i}].content"
        if message.content is None:
            raise _invalid(
                f"Missing required parameter: '{param}' (a {message.role} message needs content).",
                param=param,
            )
        if isinstance(message.content, list) and not message.content:
            raise _invalid(
                f"Invalid value for '{param}': a {message.role} message needs at least one "
                "content part.",
                param=param,
            )


def _flatten(content: str | list[protocol.ContentPart] | None, *, param: str) -> str:
    """Join text parts with newlines, as vLLM and llama.cpp's server do."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise _invalid(
                f"Only text content parts are supported; '{param}[{i}]' has type '{part.type}'.",
                param=f"{param}[{i}].type",
            )
        if part.text is None:
            raise _invalid(
                f"Missing required parameter: '{param}[{i}].text'.", param=f"{param}[{i}].text"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _sampling(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest, *, max_tokens: int | None
) -> inference_pb2.Sampling:
    sampling = canonical.sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repeat_penalty=body.repeat_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else (body.stop or ()),
    )
    for key, bias in (body.logit_bias or {}).items():
        # Digits only: int() would also take " 5", "1_000" and other scripts' digits.
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < _TOKEN_ID_LIMIT:
            raise _invalid(
                f"Invalid key in 'logit_bias': {key!r} is not a token id.", param="logit_bias"
            )
        sampling.logit_bias[token] = bias
    sampling.ignore_eos = bool(body.ignore_eos)
    return sampling


def include_usage(body: protocol.ChatCompletionRequest | protocol.CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _invalid(message: str, *, param: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, metadata={validation.PARAM_KEY: param})


# ---------------------------------------------------------------- responses


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
    return out


def chat_logprobs(entries: Sequence[inference_pb2.TokenLogprob]) -> protocol.ChatLogprobs:
    """Chat's `choices[].logprobs`: one entry per token, alternatives best first."""
    return {"content": [_token_logprob(e) for e in entries], "refusal": None}


def _token_logprob(entry: inference_pb2.TokenLogprob) -> protocol.TokenLogprob:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in entry.top
        ],
    }


class LegacyLogprobs:
    """The completions API's parallel lists; `text_offset` continues across calls.

    A token's offset counts the characters of the text before it. A token holding part
    of a multi-byte character (a byte-fallback token) adds nothing until the token
    that completes the character, so offsets never run past the text.
    """

    def __init__(self) -> None:
        self._offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def render(self, entries: Sequence[inference_pb2.TokenLogprob]) -> protocol.CompletionLogprobs:
        out: protocol.CompletionLogprobs = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry in entries:
            token = _legacy_token(entry.bytes)
            out["tokens"].append(token)
            out["token_logprobs"].append(entry.logprob)
            # OpenAI always lists the sampled token too: up to `logprobs` + 1 entries.
            alternatives = {_legacy_token(t.bytes): t.logprob for t in entry.top}
            alternatives.setdefault(token, entry.logprob)
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self._offset)
            self._offset += len(self._decoder.decode(entry.bytes))
        return out

    def skip(self, text: str) -> None:
        """Advance past text that has no log-probabilities (an echoed prompt)."""
        self._offset += len(text)


def _legacy_token(data: bytes) -> str:
    """A token as the completions API names it: its text, or OpenAI's `bytes:\\xNN`
    form when its bytes are not whole UTF-8 characters (so that alternatives made of
    different bytes stay different keys)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class ChatStream:
    """Renders one chat generation as OpenAI `chat.completion.chunk` objects.

    Order: a role chunk, one chunk per text delta, a chunk with an empty delta and the
    finish reason, then (with include_usage) a chunk with no choices and the usage.
    With logprobs, each delta chunk carries its tokens' log-probabilities.
    """

    def __init__(self, meta: ResponseMeta, *, include_usage: bool, logprobs: bool = False) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self._logprobs = logprobs
        self.finished = False

    def opening(self) -> list[protocol.ChatCompletionChunk]:
        return [self._chunk({"role": "assistant", "content": ""}, finish_reason=None)]

    def render(self, chunk: inference_pb2.Chunk) -> list[protocol.ChatCompletionChunk]:
        part = chunk.WhichOneof("part")
        if part == "delta":
            logprobs = chat_logprobs(chunk.delta.logprobs) if self._logprobs else None
            calls = chunk.delta.tool_calls
            if not chunk.delta.text and not calls and not (logprobs and logprobs["content"]):
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
        self._logprobs = LegacyLogprobs() if logprobs else None
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
                    "logprobs": chat_logprobs(self.logprobs) if logprobs else None,
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
            legacy = LegacyLogprobs()
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
    dimensions: int | None = None,
) -> protocol.EmbeddingList:
    """OpenAI's embeddings list; base64 is little-endian float32, as OpenAI sends it."""
    data: list[protocol.Embedding] = []
    for index, embedding in enumerate(response.embeddings):
        values = list(embedding.values)
        if dimensions is not None and dimensions != len(values):
            raise _invalid(
                f"This model's embeddings have {len(values)} dimensions and cannot be "
                f"shortened; omit 'dimensions' or set it to {len(values)}.",
                param="dimensions",
            )
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
    ModelNotFound when there is none."""
    for info in response.models:
        if info.id == name:
            return _model(info)
    raise errors.ModelNotFound.of(name)


def _model(info: inference_pb2.ModelInfo) -> protocol.Model:
    return {"id": info.id, "object": "model", "created": info.created, "owned_by": "blazar"}


# ---------------------------------------------------------------- errors


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: protocol.ErrorBody
    headers: dict[str, str]


@dataclass(frozen=True)
class Blame:
    """The parameters of one request that errors about its prompt (too long, empty)
    and its constraint blame: OpenAI names `messages` or `prompt`, and the constraint
    is whichever of `response_format`, `grammar` and `json_schema` was sent."""

    prompt: str = "messages"
    constraint: str = "response_format"


CHAT_BLAME = Blame()
COMPLETION_BLAME = Blame(prompt="prompt")
EMBEDDING_BLAME = Blame(prompt="input")


# The OpenAI parameter behind the other fields of the gRPC request an error can blame.
_PARAMS = {
    "sampling.logit_bias": "logit_bias",
    "sampling.stop": "stop",
    "inputs": "input",
}


def error_response(err: errors.BlazarError, *, blame: Blame = CHAT_BLAME) -> ErrorResponse:
    """OpenAI's `{"error": {message, type, param, code}}` with the matching HTTP status."""
    status = http_errors.http_status(err)
    headers = http_errors.headers(err)
    field = err.metadata.get(errors.FIELD_KEY, "")
    param = err.metadata.get(validation.PARAM_KEY) or (
        {"prompt": blame.prompt, "constraint": blame.constraint}.get(field)
        or _PARAMS.get(field)
        or _tool_param(field)
    )
    code: str | None = None
    if isinstance(err, errors.ModelNotFound):
        code, param = "model_not_found", "model"
    elif isinstance(err, errors.ContextLengthExceeded):
        code, param = "context_length_exceeded", param or blame.prompt
    elif status in (413, 429):
        code = err.reason.lower()
    elif status == 401:
        code = "invalid_api_key"
    body: protocol.ErrorBody = {
        "error": {
            "message": err.message,
            "type": _error_type(status),
            "param": param,
            "code": code,
        }
    }
    return ErrorResponse(status=status, body=body, headers=headers)


# Fields of a request's tools and tool turns that are one level deeper in OpenAI's
# shape: `tools[0].parameters` is `tools[0].function.parameters`.
_TOOL_FIELD = re.compile(
    r"^((?:tools|messages\[\d+\]\.tool_calls)\[\d+\])\.(name|parameters|arguments)$"
)


def _tool_param(field: str) -> str | None:
    if field in ("tools", "tool_choice"):
        return field
    m = _TOOL_FIELD.match(field)
    if m:
        return f"{m.group(1)}.function.{m.group(2)}"
    # `messages[2].tool_calls[0]`: the same path in OpenAI's shape.
    return field if field.startswith("messages[") else None


def _error_type(status: int) -> str:
    # OpenAI answers most client mistakes, including a wrong key, as invalid_request_error.
    if status >= 500:
        return "server_error"
    if status == 429:
        return "rate_limit_error"
    if status == 403:
        return "permission_error"
    return "invalid_request_error"
