"""Translate between OpenAI's wire format and the canonical `blazar.v1` messages.

Pure: no IO, no clock, no logging. Request side: `chat_request` and `complete_request`
build proto requests, setting in `Sampling` only what the client sent. Response side:
`ChatStream` and `CompletionStream` turn chunks into OpenAI stream chunks, `Answer`
collects a stream for the non-streaming shapes, and `error_response` renders any
`BlazarError` in OpenAI's error envelope.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import http_errors, validation
from blazar.shim.openai import protocol

# OpenAI reports a backend configuration hash; Blazar has one configuration per lane,
# which the first chunk cannot know yet, so this only tells clients who answered.
SYSTEM_FINGERPRINT = "fp_blazar"

_ROLES = {"developer": "system"}
# proto3 uint32: OpenAI accepts any integer seed, so larger ones are folded in.
_SEED_MODULUS = 2**32


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response repeats: OpenAI's id, creation time, model."""

    id: str
    created: int
    model: str


# ---------------------------------------------------------------- requests


def chat_request(body: protocol.ChatCompletionRequest) -> inference_pb2.ChatRequest:
    _require_single_choice(body)
    messages = [
        inference_pb2.Message(
            role=_ROLES.get(message.role, message.role),
            content=_flatten(message.content, param=f"messages[{i}].content"),
        )
        for i, message in enumerate(body.messages)
    ]
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    return inference_pb2.ChatRequest(
        model=body.model, messages=messages, sampling=_sampling(body, max_tokens=max_tokens)
    )


def complete_request(body: protocol.CompletionRequest) -> inference_pb2.CompleteRequest:
    _require_single_choice(body)
    if isinstance(body.prompt, str):
        prompt = body.prompt
    elif len(body.prompt) == 1:
        prompt = body.prompt[0]
    else:
        raise _invalid(
            f"'prompt' must be a string or a list of exactly one string; got a list of "
            f"{len(body.prompt)}. Send one request per prompt.",
            param="prompt",
        )
    return inference_pb2.CompleteRequest(
        model=body.model, prompt=prompt, sampling=_sampling(body, max_tokens=body.max_tokens)
    )


def _require_single_choice(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> None:
    if body.n is not None and body.n != 1:
        raise _invalid(f"Only n=1 is supported; got n={body.n}.", param="n")


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
    sampling = inference_pb2.Sampling()
    if body.temperature is not None:
        sampling.temperature = body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    if body.presence_penalty is not None:
        sampling.presence_penalty = body.presence_penalty
    if body.frequency_penalty is not None:
        sampling.frequency_penalty = body.frequency_penalty
    if body.seed is not None:
        sampling.seed = body.seed % _SEED_MODULUS
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    sampling.stop.extend(s for s in stops if s)
    return sampling


def include_usage(body: protocol.ChatCompletionRequest | protocol.CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _invalid(message: str, *, param: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, metadata={validation.PARAM_KEY: param})


# ---------------------------------------------------------------- responses


def finish_reason(final: inference_pb2.Final) -> protocol.FinishReason:
    if final.finish_reason == inference_pb2.FINISH_REASON_LENGTH:
        return "length"
    return "stop"


def usage(final: inference_pb2.Final) -> protocol.Usage:
    prompt = final.usage.prompt_tokens
    completion = final.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": final.usage.cached_tokens},
    }


def truncated() -> errors.Unavailable:
    """The daemon closed a stream without its final chunk (it is shutting down)."""
    return errors.Unavailable("The generation stream ended before it finished; retry.")


class ChatStream:
    """Renders one chat generation as OpenAI `chat.completion.chunk` objects.

    Order: a role chunk, one chunk per text delta, a chunk with an empty delta and the
    finish reason, then (with include_usage) a chunk with no choices and the usage.
    """

    def __init__(self, meta: ResponseMeta, *, include_usage: bool) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self.finished = False

    def opening(self) -> list[protocol.ChatCompletionChunk]:
        return [self._chunk({"role": "assistant", "content": ""}, finish_reason=None)]

    def render(self, chunk: inference_pb2.Chunk) -> list[protocol.ChatCompletionChunk]:
        part = chunk.WhichOneof("part")
        if part == "delta":
            if not chunk.delta.text:
                return []
            return [
                self._chunk({"content": chunk.delta.text}, finish_reason=None, index=chunk.index)
            ]
        if part != "final":
            return []
        self.finished = True
        out = [self._chunk({}, finish_reason=finish_reason(chunk.final), index=chunk.index)]
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
    ) -> protocol.ChatCompletionChunk:
        return self._envelope(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
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
    """Renders one raw completion as streamed OpenAI `text_completion` objects."""

    def __init__(self, meta: ResponseMeta, *, include_usage: bool) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self.finished = False

    def opening(self) -> list[protocol.Completion]:
        return []

    def render(self, chunk: inference_pb2.Chunk) -> list[protocol.Completion]:
        part = chunk.WhichOneof("part")
        if part == "delta":
            if not chunk.delta.text:
                return []
            return [self._chunk(chunk.delta.text, finish_reason=None, index=chunk.index)]
        if part != "final":
            return []
        self.finished = True
        out = [self._chunk("", finish_reason=finish_reason(chunk.final), index=chunk.index)]
        if self._include_usage:
            last = self._envelope([])
            last["usage"] = usage(chunk.final)
            out.append(last)
        return out

    def _chunk(
        self, text: str, *, finish_reason: protocol.FinishReason | None, index: int
    ) -> protocol.Completion:
        return self._envelope(
            [{"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}]
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


@dataclass
class Answer:
    """A whole generation, collected from its chunks for a non-streaming response."""

    parts: list[str] = field(default_factory=list)
    final: inference_pb2.Final | None = None

    def add(self, chunk: inference_pb2.Chunk) -> None:
        part = chunk.WhichOneof("part")
        if part == "delta":
            self.parts.append(chunk.delta.text)
        elif part == "final":
            self.final = chunk.final

    def _finished(self) -> inference_pb2.Final:
        if self.final is None:
            raise truncated()
        return self.final

    def chat_completion(self, meta: ResponseMeta) -> protocol.ChatCompletion:
        final = self._finished()
        return {
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(self.parts)},
                    "logprobs": None,
                    "finish_reason": finish_reason(final),
                }
            ],
            "usage": usage(final),
        }

    def completion(self, meta: ResponseMeta) -> protocol.Completion:
        final = self._finished()
        return {
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                {
                    "text": "".join(self.parts),
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": finish_reason(final),
                }
            ],
            "usage": usage(final),
        }


def model_list(response: inference_pb2.ListModelsResponse) -> protocol.ModelList:
    return {
        "object": "list",
        "data": [
            {"id": m.id, "object": "model", "created": m.created, "owned_by": "blazar"}
            for m in response.models
        ],
    }


# ---------------------------------------------------------------- errors


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: protocol.ErrorBody
    headers: dict[str, str]


def error_response(err: errors.BlazarError, *, prompt_param: str = "messages") -> ErrorResponse:
    """OpenAI's `{"error": {message, type, param, code}}` with the matching HTTP status.

    `prompt_param` names the field blamed for an over-long prompt (`prompt` for
    completions), as OpenAI does.
    """
    status = http_errors.http_status(err)
    headers: dict[str, str] = {}
    if status == 429:
        headers["retry-after"] = str(http_errors.retry_after_seconds(err))
    param = err.metadata.get(validation.PARAM_KEY)
    code: str | None = None
    if isinstance(err, errors.ModelNotFound):
        code, param = "model_not_found", "model"
    elif isinstance(err, errors.ContextLengthExceeded):
        code, param = "context_length_exceeded", param or prompt_param
    elif status == 429:
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


def _error_type(status: int) -> str:
    # OpenAI answers most client mistakes, including a wrong key, as invalid_request_error.
    if status >= 500:
        return "server_error"
    if status == 429:
        return "rate_limit_error"
    if status == 403:
        return "permission_error"
    return "invalid_request_error"
