"""Canonical generation streams into Responses API objects and streaming events.

Pure: no IO, no clock, no logging. `template` is the response object a request
starts (echoing what it asked for); `Answer.response` fills it from a whole
generation; `ResponseStream` renders the same generation as OpenAI's event sequence,
ending in the same object. `error_response` is the OpenAI error envelope with this
API's parameter names.

Output items: a `message` with one `output_text` part when the model wrote text,
then one `function_call` item per call. Calls go out only once `Final.tool_calls`
says they are whole, so a client never sees arguments that max_output_tokens cut
short; each call's arguments stream as one delta. Without text or whole calls the
output is an empty message, so that `output_text` is always there to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import canonical, http_errors, validation
from blazar.shim.openai import protocol as chat
from blazar.shim.openai.convert import envelope, logprob, render
from blazar.shim.openai.responses import protocol

# The parameters errors blame: tools are flat here (`tools[0].parameters`), and
# `input` items map onto turns many to one (instructions, merged calls).
BLAME = envelope.Blame(prompt="input", constraint="text.format", tool_fields="", turns_align=False)


@dataclass(frozen=True)
class ResponseMeta:
    """What names one response and its items: `resp_<key>`, `msg_<key>`, `fc_<key>_<n>`."""

    key: str
    created_at: int

    @property
    def id(self) -> str:
        return f"resp_{self.key}"

    @property
    def message_id(self) -> str:
        return f"msg_{self.key}"

    def call_id(self, index: int) -> str:
        return f"fc_{self.key}_{index}"


def template(body: protocol.ResponseCreateRequest, meta: ResponseMeta) -> protocol.Response:
    """The response object of a request before it has output: in progress, echoing
    the request's settings as OpenAI's does."""
    choice = body.tool_choice
    tool_choice: str | protocol.NamedFunction = "auto"
    if isinstance(choice, str):
        tool_choice = choice
    elif choice is not None:
        tool_choice = {"type": "function", "name": choice.name or ""}
    return {
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": body.temperature,
        "text": {"format": _format_echo(body.text)},
        "tool_choice": tool_choice,
        "tools": [
            {
                "type": "function",
                "name": t.name or "",
                "description": t.description,
                "parameters": t.parameters,
                "strict": t.strict,
            }
            for t in body.tools or ()
        ],
        "top_logprobs": body.top_logprobs,
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "prompt_cache_key": body.prompt_cache_key,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_retention": body.prompt_cache_retention,
        "service_tier": "default",
        "metadata": dict(body.metadata or {}),
        "background": False,
    }


def _format_echo(text: protocol.TextConfig | None) -> protocol.TextFormatEcho:
    fmt = text.format if text is not None else None
    if isinstance(fmt, protocol.JsonSchemaFormat):
        return {
            "type": "json_schema",
            "name": fmt.name,
            "schema": fmt.json_schema,
            "description": fmt.description,
            "strict": fmt.strict,
        }
    if fmt is not None and fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "text"}


def usage(final: inference_pb2.Final) -> protocol.Usage:
    prompt = final.usage.prompt_tokens
    completion = final.usage.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": final.usage.cached_tokens,
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _ended(final: inference_pb2.Final) -> protocol.Status:
    # The context filling up ends a generation as max_tokens does: OpenAI has one
    # reason for both.
    if final.finish_reason == inference_pb2.FINISH_REASON_LENGTH:
        return "incomplete"
    return "completed"


def _text_part(text: str, entries: list[chat.TokenLogprob]) -> protocol.OutputText:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": entries}


def _message(
    meta: ResponseMeta, *, status: protocol.ItemStatus, parts: list[protocol.OutputText]
) -> protocol.OutputMessage:
    return {
        "id": meta.message_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": parts,
    }


def _function_call(
    meta: ResponseMeta,
    call: inference_pb2.ToolCall,
    *,
    index: int,
    status: protocol.ItemStatus,
    arguments: str,
) -> protocol.FunctionCall:
    return {
        "id": meta.call_id(index),
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
    }


def _logprobs(entries: Sequence[inference_pb2.TokenLogprob]) -> list[chat.TokenLogprob]:
    return [logprob.token_logprob(e) for e in entries]


class Answer(canonical.Answer):
    """A whole generation (see `canonical.Answer`) as a response object."""

    def response(
        self, started: protocol.Response, meta: ResponseMeta, *, logprobs: bool = False
    ) -> protocol.Response:
        """`started` (from `template`) finished: status, output, usage."""
        final = self.finished()
        status = _ended(final)
        item_status: protocol.ItemStatus = "incomplete" if status == "incomplete" else "completed"
        output: list[protocol.OutputItem] = []
        calls = self.whole_calls()
        if self.text or not calls:
            entries = _logprobs(self.text_logprobs) if logprobs else []
            output.append(
                _message(meta, status=item_status, parts=[_text_part(self.text, entries)])
            )
        for index, call in enumerate(calls):
            output.append(
                _function_call(
                    meta, call, index=index, status="completed", arguments=call.arguments
                )
            )
        out: protocol.Response = {
            **started,
            "status": status,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "output": output,
            "usage": usage(final),
            "timings": render.timings(final),
        }
        return out


class ResponseStream:
    """Renders one generation as the Responses API's streaming events.

    Order: `response.created` and `response.in_progress`; at the first text, the
    message item and its part are added, then one `response.output_text.delta` per
    text delta; at the end the text, part and message are done, each whole call is
    added, its arguments given as one delta and done, and the item done; last
    `response.completed` (or `response.incomplete`) with the whole response, the same
    object `Answer.response` makes. A failure after the start is an `error` event
    then `response.failed`. Every event has the next `sequence_number`.
    """

    def __init__(
        self, started: protocol.Response, meta: ResponseMeta, *, logprobs: bool = False
    ) -> None:
        self._started = started
        self._meta = meta
        self._logprobs = logprobs
        self._answer = Answer()
        self._sequence = 0
        self._message_open = False
        # How many of the answer's text logprobs have gone out in deltas.
        self._sent_logprobs = 0
        self.finished = False

    def opening(self) -> list[protocol.Event]:
        return [
            self._event("response.created", response=self._started),
            self._event("response.in_progress", response=self._started),
        ]

    def render(self, chunk: inference_pb2.Chunk) -> list[protocol.Event]:
        self._answer.add(chunk)
        part = chunk.WhichOneof("part")
        if part == "delta":
            # Calls' tokens (and a character's first bytes) come with no text: the
            # message waits for text, and the answer sorts out whose logprobs are whose.
            if not chunk.delta.text:
                return []
            entries: list[chat.TokenLogprob] = []
            if self._logprobs:
                entries = _logprobs(self._answer.text_logprobs[self._sent_logprobs :])
                self._sent_logprobs = len(self._answer.text_logprobs)
            out = self._open_message()
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._meta.message_id,
                    output_index=0,
                    content_index=0,
                    delta=chunk.delta.text,
                    logprobs=entries,
                )
            )
            return out
        if part != "final":
            return []
        self.finished = True
        whole = self._answer.response(self._started, self._meta, logprobs=self._logprobs)
        out = []
        for index, item in enumerate(whole["output"]):
            if item["type"] == "message":
                out.extend(self._open_message())
                out.extend(self._close_message(item))
            else:
                out.extend(self._call(index, item))
        out.append(self._event(f"response.{whole['status']}", response=whole))
        return out

    def failure(self, err: errors.BlazarError) -> list[protocol.Event]:
        """The events of a generation that failed after the response started: the
        error, then the response failed with the text written so far."""
        rendered = error_response(err).body["error"]
        code = _failure_code(err)
        failed: protocol.Response = {
            **self._started,
            "status": "failed",
            "error": {"code": code, "message": rendered["message"]},
        }
        if self._message_open:
            entries = _logprobs(self._answer.text_logprobs) if self._logprobs else []
            failed["output"] = [
                _message(
                    self._meta, status="incomplete", parts=[_text_part(self._answer.text, entries)]
                )
            ]
        return [
            self._event(
                "error",
                code=rendered["code"] or code,
                message=rendered["message"],
                param=rendered["param"],
            ),
            self._event("response.failed", response=failed),
        ]

    def _open_message(self) -> list[protocol.Event]:
        if self._message_open:
            return []
        self._message_open = True
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=_message(self._meta, status="in_progress", parts=[]),
            ),
            self._event(
                "response.content_part.added",
                item_id=self._meta.message_id,
                output_index=0,
                content_index=0,
                part=_text_part("", []),
            ),
        ]

    def _close_message(self, item: protocol.OutputMessage) -> list[protocol.Event]:
        (part,) = item["content"]
        where = {"item_id": item["id"], "output_index": 0}
        return [
            self._event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            ),
            self._event("response.content_part.done", **where, content_index=0, part=part),
            self._event("response.output_item.done", output_index=0, item=item),
        ]

    def _call(self, output_index: int, item: protocol.FunctionCall) -> list[protocol.Event]:
        where = {"item_id": item["id"], "output_index": output_index}
        started: protocol.FunctionCall = {**item, "status": "in_progress", "arguments": ""}
        return [
            self._event("response.output_item.added", output_index=output_index, item=started),
            self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=output_index, item=item),
        ]

    def _event(self, kind: str, **fields: object) -> protocol.Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event  # type: ignore[return-value]  # the keys are those of protocol.Event


def _failure_code(err: errors.BlazarError) -> str:
    """`response.error.code`, one of OpenAI's: what failed, in its words."""
    status = http_errors.http_status(err)
    if status == 429:
        return "rate_limit_exceeded"
    if status == 400:
        return "invalid_prompt"
    return "server_error"


def input_token_count(response: inference_pb2.TokenizeResponse) -> protocol.InputTokenCount:
    return {"object": "response.input_tokens", "input_tokens": response.count}


def not_stored(response_id: str, *, action: str) -> errors.ObjectNotFound:
    """What retrieving, deleting or cancelling a response meets: Blazar stores none
    (`store` must be false), so no id is ever found; said plainly, not as an unknown
    route. `action` is what the client tried ("retrieve", "delete", "cancel")."""
    shown = response_id
    if len(shown) > errors.ModelNotFound.ECHO_MAX_CHARS:
        shown = shown[: errors.ModelNotFound.ECHO_MAX_CHARS] + "..."
    return errors.ObjectNotFound(
        f"No response found with id '{shown}': this server keeps no responses (requests "
        f"must send 'store': false or leave it out), so there is none to {action}. Send "
        "the whole conversation in 'input' instead.",
        metadata={validation.PARAM_KEY: "response_id"},
    )


def not_compacted() -> errors.ObjectNotFound:
    """What `POST /v1/responses/compact` (the `openai` client's `responses.compact`)
    meets: this server never summarizes or drops part of a conversation, as it refuses
    `context_management`."""
    return errors.ObjectNotFound(
        "Compacting a conversation (POST /v1/responses/compact) is not supported by this "
        "server: it never summarizes or drops part of a conversation to fit. Send the "
        "whole conversation in 'input'; one too long for the context is a 400, and "
        "shortening it is yours."
    )


def error_response(err: errors.BlazarError) -> envelope.ErrorResponse:
    """OpenAI's error envelope blaming this API's parameters, with a prompt that does
    not fit told in its terms (the daemon's sentence says max_tokens)."""
    rendered = envelope.error_response(err, blame=BLAME)
    sizes = err.sizes() if isinstance(err, errors.ContextLengthExceeded) else None
    if sizes is not None:
        rendered.body["error"]["message"] = sizes.refusal(
            prompt="input", advice="Shorten the input, or lower max_output_tokens."
        )
    return rendered
