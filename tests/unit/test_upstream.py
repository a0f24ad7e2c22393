"""Upstream Lanes' pure pieces: the OpenAI translation both ways and error mapping."""

from __future__ import annotations

import json
from typing import Any

import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2 as pb
from blazar.api import errors
from blazar.enginehost import upstream_convert as convert


def chat_request(**sampling: Any) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(
            messages=[
                pb.Message(role="user", content="hi", name="ann"),
                pb.Message(
                    role="assistant",
                    tool_calls=[pb.ToolCall(id="c1", name="f", arguments='{"a":1}')],
                ),
                pb.Message(role="tool", content="2", tool_call_id="c1", name="f"),
            ],
            tools=[pb.Tool(name="f", description="d", parameters='{"type":"object"}')],
            tool_choice=pb.ToolChoice(mode=pb.ToolChoice.MODE_NAMED, name="f"),
            parallel_tool_calls=False,
        ),
        sampling=pb.Sampling(**sampling),
    )


def test_a_chat_request_becomes_an_openai_body() -> None:
    request = chat_request(
        temperature=0.5, max_tokens=7, stop=["x"], seed=3, top_k=5, logprobs=True, top_logprobs=2
    )
    request.sampling.logit_bias[12] = -100.0
    route, body = convert.request_body(request, model="up")
    assert route == "chat/completions"
    assert body["model"] == "up" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [
        {"role": "user", "content": "hi", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
            ],
        },
        {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "f"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False
    assert body["temperature"] == 0.5 and body["max_tokens"] == 7 and body["seed"] == 3
    assert body["stop"] == ["x"] and body["top_k"] == 5
    assert body["logit_bias"] == {"12": -100.0}
    assert body["logprobs"] is True and body["top_logprobs"] == 2
    assert "top_p" not in body  # unset stays unset: the upstream's default


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (pb.Constraint(json_object=True), {"type": "json_object"}),
        (
            pb.Constraint(json_schema='{"type":"string"}'),
            {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": {"type": "string"}, "strict": True},
            },
        ),
    ],
)
def test_structured_output_passes_as_response_format(
    constraint: pb.Constraint, expected: dict[str, Any]
) -> None:
    request = engine_pb2.GenerateRequest(prompt="p", constraint=constraint)
    route, body = convert.request_body(request, model="m")
    assert route == "completions" and body["prompt"] == "p"
    assert body["response_format"] == expected


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            engine_pb2.GenerateRequest(prompt="p", constraint=pb.Constraint(grammar="root ::= x")),
            "constraint",
        ),
        (
            engine_pb2.GenerateRequest(prompt="p", sampling=pb.Sampling(prompt_logprobs=True)),
            "prompt_logprobs",
        ),
        (
            engine_pb2.GenerateRequest(prompt="p", constraint=pb.Constraint(json_schema="{")),
            "constraint",
        ),
    ],
)
def test_what_cannot_pass_is_refused(request_: engine_pb2.GenerateRequest, field: str) -> None:
    refused = convert.refusal(request_)
    assert isinstance(refused, errors.InvalidRequest)
    assert refused.metadata[errors.FIELD_KEY] == field
    with pytest.raises(errors.InvalidRequest):
        convert.request_body(request_, model="m")


def test_a_chat_stream_becomes_chunks() -> None:
    t = convert.StreamTranslator()
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}
                        ]
                    },
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 9,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
    ]
    chunks = [c for e in events for c in t.feed(e)]
    assert [c.delta.text for c in chunks] == ["Hel", ""]
    assert chunks[1].delta.tool_calls[0] == pb.ToolCallDelta(
        index=0, id="c", name="f", arguments="{"
    )
    final = t.finish().final
    assert final.finish_reason == pb.FINISH_REASON_TOOL_CALLS and final.tool_calls == 1
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (9, 3)
    assert final.usage.cached_tokens == 4 == final.routing.prefix_tokens_reused


def test_a_completion_stream_with_logprobs_and_no_usage() -> None:
    t = convert.StreamTranslator()
    chunks = t.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "ab",
                    "logprobs": {
                        "tokens": ["a", "b"],
                        "token_logprobs": [-0.5, -1.0],
                        "top_logprobs": [{"a": -0.5}, {"b": -1.0}],
                    },
                    "finish_reason": "length",
                }
            ]
        }
    )
    assert chunks[0].delta.tokens == 2
    assert [lp.logprob for lp in chunks[0].delta.logprobs] == [-0.5, -1.0]
    final = t.finish().final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 2  # counted when the upstream reports none


def test_an_error_event_mid_stream_is_unavailable() -> None:
    with pytest.raises(errors.Unavailable, match="boom"):
        convert.StreamTranslator().feed({"error": {"message": "boom"}})


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, errors.InvalidRequest),
        (422, errors.InvalidRequest),
        (401, errors.Unavailable),
        (404, errors.Unavailable),
        (429, errors.Overloaded),
        (500, errors.Unavailable),
        (503, errors.Unavailable),
    ],
)
def test_http_errors(status: int, kind: type[errors.BlazarError]) -> None:
    err = convert.http_error(status, json.dumps({"error": {"message": "why"}}), retry_after="2")
    assert type(err) is kind
    assert "why" in err.message and str(status) in err.message
    if status == 429:
        assert err.metadata[errors.RETRY_AFTER_KEY] == "2000"
