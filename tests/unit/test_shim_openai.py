"""The OpenAI dialect of the HTTP shim, against a fake `blazar.v1.Inference` servicer.

The fake is Blazar's own gRPC boundary: it streams scripted chunks or aborts with
scripted errors through `blazar.rpc.status.abort`, exactly as the data plane does.
Golden files under golden/openai/ pin the translation; regenerate them with
BLAZAR_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import struct
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import app as shim_app
from blazar.shim import request_body, streaming, validation
from blazar.shim.openai import protocol
from blazar.shim.openai.convert import logprob, render, requests
from tests.unit import fake_inference
from tests.unit.fake_inference import (
    Daemon,
    Step,
    asgi_client,
    delta,
    fake_daemon,
    final,
    lp,
    poll,
    uvicorn_shim,
)

GOLDEN = Path(__file__).parent / "golden" / "openai"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": "{}"},
}


def calling(
    index: int,
    *,
    id: str = "",
    name: str = "",
    arguments: str = "",
    text: str = "",
    tokens: int = 1,
) -> inference_pb2.Chunk:
    """A delta carrying part of a tool call (and maybe text before it)."""
    part = inference_pb2.ToolCallDelta(index=index, id=id, name=name, arguments=arguments)
    return inference_pb2.Chunk(
        delta=inference_pb2.Delta(text=text, tokens=tokens, tool_calls=[part])
    )


WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
CALL_SCRIPT: list[Any] = [
    calling(0, id="call_a", name="get_weather"),
    calling(0, arguments='{"city": "Pa'),
    calling(0, arguments='ris", "unit": "c"}', tokens=4),
    calling(1, id="call_b", name="get_weather", arguments='{"city": "Oslo", "unit": "f"}'),
]


HELLO: list[Step] = [delta("Hel"), delta("lo"), delta(" world"), final()]


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with fake_daemon() as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(daemon.target) as c:
        yield c


# ---------------------------------------------------------------- helpers


def chat_body(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **extra}


def sse_events(text: str) -> list[Any]:
    """Parse an OpenAI SSE body strictly: only `data:` lines, each event ended by a blank line."""
    assert text.endswith("\n\n"), text
    events: list[Any] = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def normalise(events: Sequence[Any]) -> list[Any]:
    """Replace per-request ids and clock readings so streams compare across runs."""
    out = []
    for event in events:
        if isinstance(event, dict) and "id" in event:
            assert re.fullmatch(r"(chatcmpl|cmpl)-[0-9a-f]{32}", event["id"]), event["id"]
            assert isinstance(event["created"], int)
            event = {**event, "id": event["id"].split("-")[0] + "-<id>", "created": 0}
        out.append(event)
    return out


def check_golden(name: str, document: Any) -> None:
    fake_inference.check_golden(GOLDEN / f"{name}.json", document)


# ---------------------------------------------------------------- golden: requests in

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

REQUEST_CASES: dict[
    str,
    tuple[
        type[
            protocol.ChatCompletionRequest | protocol.CompletionRequest | protocol.EmbeddingRequest
        ],
        dict[str, Any],
    ],
] = {
    "request_chat_minimal": (protocol.ChatCompletionRequest, chat_body()),
    "request_chat_full": (
        protocol.ChatCompletionRequest,
        {
            "model": "gemma",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "system", "content": "You are terse."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Hello"},
                        {"type": "text", "text": "there"},
                    ],
                },
                {"role": "assistant", "content": None},
                {"role": "user", "content": "Again", "name": "bob"},
            ],
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 2**40 + 5,
            "stop": ["\n\n", "", "END"],
            "presence_penalty": 0.25,
            "frequency_penalty": -0.5,
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "someone",
            "logit_bias": {"50256": -100},
        },
    ),
    "request_chat_stop_string": (
        protocol.ChatCompletionRequest,
        chat_body(stop="###", max_tokens=1, temperature=1.5),
    ),
    "request_chat_llama_extensions": (
        protocol.ChatCompletionRequest,
        chat_body(
            top_k=1,
            min_p=0.5,
            repeat_penalty=1.25,
            # Offered tools the model must not call change nothing.
            tools=[{"type": "function", "function": {"name": "get_weather"}}],
            tool_choice="none",
        ),
    ),
    "request_chat_tools_named": (
        protocol.ChatCompletionRequest,
        chat_body(
            messages=[
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": '{"city":"Paris","unit":"c"}',
                            },
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_a",
                    "content": [{"type": "text", "text": "21"}],
                },
                {"role": "user", "content": "And Oslo?"},
            ],
            tools=[WEATHER, {"type": "function", "function": {"name": "noop"}}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
        ),
    ),
    "request_chat_tools_required": (
        protocol.ChatCompletionRequest,
        chat_body(tools=[WEATHER], tool_choice="required"),
    ),
    "request_chat_tools_auto": (protocol.ChatCompletionRequest, chat_body(tools=[WEATHER])),
    "request_completion_string": (
        protocol.CompletionRequest,
        {"model": "base", "prompt": "Once upon", "max_tokens": 16, "seed": 3, "echo": False},
    ),
    "request_completion_list_of_one": (
        protocol.CompletionRequest,
        {"model": "base", "prompt": ["Once upon"], "stop": "\n", "top_p": 1},
    ),
    "request_chat_json_schema": (
        protocol.ChatCompletionRequest,
        chat_body(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
            },
            logprobs=True,
            top_logprobs=3,
            logit_bias={"42": 5.5, "7": -100, "0": 0},
        ),
    ),
    "request_chat_json_schema_without_schema": (
        protocol.ChatCompletionRequest,
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "anything"}}),
    ),
    "request_chat_json_object": (
        protocol.ChatCompletionRequest,
        chat_body(response_format={"type": "json_object"}, logprobs=True),
    ),
    "request_chat_text_format": (
        protocol.ChatCompletionRequest,
        chat_body(response_format={"type": "text"}, logprobs=False, top_logprobs=0),
    ),
    "request_completion_logprobs_echo": (
        protocol.CompletionRequest,
        {"model": "base", "prompt": "Once upon", "logprobs": 2, "echo": True},
    ),
    "request_completion_json_object": (
        protocol.CompletionRequest,
        {"model": "base", "prompt": "{", "response_format": {"type": "json_object"}},
    ),
    "request_embeddings_string": (
        protocol.EmbeddingRequest,
        {"model": "base", "input": "Embed me"},
    ),
    "request_embeddings_list": (
        protocol.EmbeddingRequest,
        {
            "model": "base",
            "input": ["one", "two"],
            "encoding_format": "base64",
            "user": "someone",
        },
    ),
}


@pytest.mark.parametrize("name", sorted(REQUEST_CASES))
def test_request_translation_matches_golden(name: str) -> None:
    model, body = REQUEST_CASES[name]
    parsed = validation.parse_body(model, json.dumps(body).encode())
    if isinstance(parsed, protocol.ChatCompletionRequest):
        canonical: Any = requests.chat_request(parsed)
    elif isinstance(parsed, protocol.CompletionRequest):
        canonical = requests.complete_request(parsed)
    else:
        canonical = requests.embed_request(parsed)
    check_golden(
        name,
        {
            "http_body": body,
            "canonical": {
                "type": type(canonical).DESCRIPTOR.full_name,
                "message": json_format.MessageToDict(canonical, preserving_proto_field_name=True),
            },
        },
    )


PREFILL_USER = {"role": "user", "content": "Hi"}


def prefill_body(last: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    final = last if last is not None else {"role": "assistant", "content": "Sure: "}
    return {"model": "tiny", "messages": [PREFILL_USER, final], **extra}


@pytest.mark.parametrize(
    ("body", "continued"),
    [
        # OpenAI's meaning: a final assistant message is answered after, in a new turn.
        (prefill_body(), False),
        # DeepSeek's and Mistral's prefix, vLLM's continue_final_message.
        (prefill_body({"role": "assistant", "content": "Sure: ", "prefix": True}), True),
        (prefill_body(continue_final_message=True), True),
        (prefill_body(continue_final_message=True, add_generation_prompt=False), True),
        (prefill_body(continue_final_message=False, add_generation_prompt=True), False),
        (prefill_body(tools=[TOOL], tool_choice="auto", continue_final_message=True), True),
    ],
)
def test_a_final_assistant_message_is_continued_only_when_asked(
    body: dict[str, Any], continued: bool
) -> None:
    parsed = validation.parse_body(protocol.ChatCompletionRequest, json.dumps(body).encode())
    request = requests.chat_request(parsed)
    assert request.continue_final_message is continued
    assert request.messages[-1].content == "Sure: "  # kept as sent, trailing space too


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (
            prefill_body(continue_final_message=True, add_generation_prompt=True),
            "add_generation_prompt",
            "Cannot set both",
        ),
        (prefill_body(add_generation_prompt=False), "add_generation_prompt", "supported only"),
        (
            {"model": "tiny", "messages": [{**PREFILL_USER, "prefix": True}]},
            "messages[0].prefix",
            "only on the last message, an assistant one",
        ),
        (
            {"model": "tiny", "messages": [PREFILL_USER], "continue_final_message": True},
            "continue_final_message",
            "messages[0] is a user message",
        ),
        (
            prefill_body(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"},
                        }
                    ],
                },
                tools=[TOOL],
                continue_final_message=True,
            ),
            "continue_final_message",
            "makes tool calls",
        ),
        (
            prefill_body(continue_final_message=True, response_format={"type": "json_object"}),
            "continue_final_message",
            "would shape only the continuation",
        ),
        (
            prefill_body(continue_final_message=True, tools=[TOOL], tool_choice="required"),
            "tool_choice",
            "forced tool call",
        ),
    ],
)
def test_a_continuation_that_cannot_be_honoured_is_refused(
    body: dict[str, Any], param: str, fragment: str
) -> None:
    parsed = validation.parse_body(protocol.ChatCompletionRequest, json.dumps(body).encode())
    with pytest.raises(errors.InvalidRequest, match=re.escape(fragment)) as caught:
        requests.chat_request(parsed)
    assert caught.value.metadata[validation.PARAM_KEY] == param


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "I can't help with that."), ("Well.", "Well.\nI can't help with that.")],
)
def test_assistant_refusal_is_part_of_the_turn(content: str | None, expected: str) -> None:
    """OpenAI answers a refusal in `message.refusal`, not `content`; sent back in the
    history, it is what the model said, not a turn to drop."""
    assistant = {"role": "assistant", "content": content, "refusal": "I can't help with that."}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}, assistant]}
    parsed = validation.parse_body(protocol.ChatCompletionRequest, json.dumps(body).encode())
    assert requests.chat_request(parsed).messages[1].content == expected


def test_unset_sampling_fields_stay_unset() -> None:
    parsed = validation.parse_body(protocol.ChatCompletionRequest, json.dumps(chat_body()).encode())
    sampling = requests.chat_request(parsed).sampling
    for name in ("temperature", "top_p", "seed", "max_tokens", "presence_penalty"):
        assert not sampling.HasField(name), name
    zero = validation.parse_body(
        protocol.ChatCompletionRequest, json.dumps(chat_body(temperature=0)).encode()
    )
    assert requests.chat_request(zero).sampling.HasField("temperature")


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "expected"),
    [
        (NAMED_WEATHER, None, False),
        (NAMED_WEATHER, True, False),
        (NAMED_WEATHER, False, False),
        ("required", None, None),
        ("required", True, True),
        ("auto", None, None),
        (None, False, False),
    ],
)
def test_a_named_tool_choice_makes_exactly_one_call(
    tool_choice: Any, parallel: bool | None, expected: bool | None
) -> None:
    """OpenAI's named tool_choice calls exactly one function (Instructor's default mode
    reads the one call, and failed on the 8 a parallel turn allowed); the modes keep
    what `parallel_tool_calls` says, unset when it is."""
    body = chat_body(tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=parallel)
    parsed = validation.parse_body(protocol.ChatCompletionRequest, json.dumps(body).encode())
    request = requests.chat_request(parsed)
    if expected is None:
        assert not request.HasField("parallel_tool_calls")
    else:
        assert request.HasField("parallel_tool_calls")
        assert request.parallel_tool_calls is expected


@pytest.mark.parametrize("ignore_eos", [True, False, None])
def test_llama_cpp_ignore_eos_reaches_sampling(ignore_eos: bool | None) -> None:
    body = {"model": "base", "prompt": "Once", "ignore_eos": ignore_eos}
    parsed = validation.parse_body(protocol.CompletionRequest, json.dumps(body).encode())
    assert requests.complete_request(parsed).sampling.ignore_eos is bool(ignore_eos)
    chat = chat_body(ignore_eos=ignore_eos)
    parsed_chat = validation.parse_body(protocol.ChatCompletionRequest, json.dumps(chat).encode())
    assert requests.chat_request(parsed_chat).sampling.ignore_eos is bool(ignore_eos)


@pytest.mark.parametrize(
    ("extra", "max_tokens"), [({}, 16), ({"max_tokens": None}, 16), ({"max_tokens": 300}, 300)]
)
def test_completions_stop_after_16_tokens_by_default(
    extra: dict[str, Any], max_tokens: int
) -> None:
    """OpenAI's documented default for the legacy endpoint; chat keeps none (above)."""
    body = {"model": "base", "prompt": "Once", **extra}
    parsed = validation.parse_body(protocol.CompletionRequest, json.dumps(body).encode())
    assert requests.complete_request(parsed).sampling.max_tokens == max_tokens


# ---------------------------------------------------------------- golden: streams out

STREAM_CASES: dict[str, tuple[str, dict[str, Any], list[Step]]] = {
    "stream_chat": ("/v1/chat/completions", chat_body(stream=True), HELLO),
    "stream_chat_include_usage": (
        "/v1/chat/completions",
        chat_body(stream=True, stream_options={"include_usage": True}),
        [delta("Hi"), delta(""), delta("!"), final(prompt=12, completion=2, cached=8)],
    ),
    "stream_chat_length": (
        "/v1/chat/completions",
        chat_body(stream=True, max_tokens=2),
        [delta("a"), delta("b"), final(inference_pb2.FINISH_REASON_LENGTH, completion=2)],
    ),
    "stream_chat_error_after_start": (
        "/v1/chat/completions",
        chat_body(stream=True),
        [delta("par"), errors.Unavailable("The replica serving 'tiny' stopped.")],
    ),
    "stream_chat_truncated": ("/v1/chat/completions", chat_body(stream=True), [delta("x")]),
    "stream_chat_tool_calls": (
        "/v1/chat/completions",
        chat_body(stream=True, tools=[WEATHER], tool_choice="required"),
        [*CALL_SCRIPT, final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=2)],
    ),
    "stream_chat_text_then_tool_call": (
        "/v1/chat/completions",
        chat_body(stream=True, tools=[WEATHER]),
        [
            delta("Let me check."),
            calling(0, id="call_a", name="get_weather", arguments='{"city":"Paris","unit":"c"}'),
            final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=1),
        ],
    ),
    "stream_completion": (
        "/v1/completions",
        {"model": "tiny", "prompt": "Once", "stream": True},
        [delta(" upon"), delta(" a time"), final(inference_pb2.FINISH_REASON_LENGTH)],
    ),
    "stream_completion_include_usage": (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "Once",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        [delta(" upon"), final(prompt=2, completion=1, cached=1)],
    ),
    "stream_chat_logprobs": (
        "/v1/chat/completions",
        chat_body(stream=True, logprobs=True, top_logprobs=2),
        [
            delta("Hi", logprobs=[lp("Hi", -0.25, ("Hi", -0.25), ("Hello", -1.5))]),
            # A delta holding back half a character still reports its token.
            delta("", logprobs=[lp("\ufffd", -2.0, ("\ufffd", -2.0), ("!", -2.5))]),
            delta(" ✓", logprobs=[lp("\ufffd", -0.5, ("\ufffd", -0.5), (".", -3.0))]),
            final(completion=3),
        ],
    ),
    "stream_completion_logprobs": (
        "/v1/completions",
        {"model": "tiny", "prompt": "Once", "stream": True, "logprobs": 1},
        [
            delta(" upon", logprobs=[lp(" upon", -0.5, (" upon", -0.5))]),
            delta(" a time", 2, logprobs=[lp(" a", -0.125, (" the", -0.1)), lp(" time", -0.0625)]),
            final(inference_pb2.FINISH_REASON_LENGTH),
        ],
    ),
    "stream_completion_echo": (
        "/v1/completions",
        {"model": "tiny", "prompt": "Once", "stream": True, "echo": True},
        [delta(" upon"), final()],
    ),
}


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
async def test_stream_matches_golden(name: str, daemon: Daemon, client: httpx.AsyncClient) -> None:
    path, body, script = STREAM_CASES[name]
    daemon.fake.scripts["tiny"] = script
    response = await client.post(path, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    ids = {e["id"] for e in events if isinstance(e, dict) and "id" in e}
    assert ids == {f"{path_prefix(path)}-{response.headers['x-request-id']}"}
    check_golden(
        name,
        {
            "path": path,
            "http_body": body,
            "chunks": fake_inference.script_json(script),
            "sse": normalise(events),
        },
    )


def path_prefix(path: str) -> str:
    return "chatcmpl" if "chat" in path else "cmpl"


# ---------------------------------------------------------------- happy paths


async def test_prompt_cache_controls_that_ask_for_what_the_server_does_pass(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """An implicit, in-memory prompt cache is what this server has: asking for it is
    served, not refused (the other values are, in `test_bad_chat_body_is_400`)."""
    daemon.fake.scripts["tiny"] = [delta("Hi"), final()]
    body = chat_body(prompt_cache_retention="in_memory", prompt_cache_options={"mode": "implicit"})
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


async def test_chat_non_stream(daemon: Daemon, client: httpx.AsyncClient) -> None:
    daemon.fake.scripts["tiny"] = [delta("Hel"), delta("lo"), final(cached=4)]
    response = await client.post("/v1/chat/completions", json=chat_body(temperature=0.5))
    assert response.status_code == 200, response.text
    body = response.json()
    request_id = response.headers["x-request-id"]
    assert body == {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": body["created"],
        "model": "tiny",
        "system_fingerprint": render.SYSTEM_FINGERPRINT,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
        # llama.cpp server's extension; the scripted final has no times.
        "timings": {
            "cache_n": 4,
            "prompt_n": 3,
            "prompt_ms": 0.0,
            "prompt_per_token_ms": 0.0,
            "prompt_per_second": 0.0,
            "predicted_n": 3,
            "predicted_ms": 0.0,
            "predicted_per_token_ms": 0.0,
            "predicted_per_second": 0.0,
        },
    }
    # The request id travels to the daemon so its logs join the shim's.
    assert daemon.fake.metadata[-1]["x-request-id"] == request_id
    assert daemon.fake.requests[-1].sampling.temperature == pytest.approx(0.5)


def test_timings_in_llama_cpp_server_shape() -> None:
    """The figures tools written for llama.cpp's server read: prompt tokens computed
    (not those from the cache), rates, and the speculation counts when drafted."""
    done = inference_pb2.Final(
        usage=inference_pb2.Usage(prompt_tokens=120, completion_tokens=40, cached_tokens=100),
        timings=inference_pb2.Timings(
            prefill_ms=50.0, decode_ms=800.0, decode_tokens_per_second=48.75
        ),
        routing=inference_pb2.Routing(drafted_tokens=30, accepted_tokens=21),
    )
    assert render.timings(done) == {
        "cache_n": 100,
        "prompt_n": 20,
        "prompt_ms": 50.0,
        "prompt_per_token_ms": 2.5,
        "prompt_per_second": 400.0,
        "predicted_n": 40,
        "predicted_ms": 800.0,
        "predicted_per_token_ms": 20.0,
        "predicted_per_second": 50.0,
        "draft_n": 30,
        "draft_n_accepted": 21,
    }
    done.routing.drafted_tokens = 0
    assert "draft_n" not in render.timings(done)
    # Parked for more urgent work: the pause, beside the decode it is kept out of.
    assert "parked_ms" not in render.timings(done)
    done.timings.parked_ms = 350.0
    assert render.timings(done)["parked_ms"] == 350.0
    assert render.timings(done)["predicted_ms"] == 800.0


async def test_completion_non_stream(daemon: Daemon, client: httpx.AsyncClient) -> None:
    daemon.fake.scripts["base"] = [delta(" upon"), delta(" a time"), final()]
    response = await client.post(
        "/v1/completions", json={"model": "base", "prompt": ["Once"], "max_tokens": 4}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"] == f"cmpl-{response.headers['x-request-id']}"
    assert body["choices"] == [
        {"text": " upon a time", "index": 0, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["total_tokens"] == 10
    assert daemon.fake.requests[-1].prompt == "Once"
    assert daemon.fake.requests[-1].sampling.max_tokens == 4


async def test_models_list(daemon: Daemon, client: httpx.AsyncClient) -> None:
    daemon.fake.models = [
        inference_pb2.ModelInfo(id="gemma", lane="gemma", created=1700000000, ready=True),
        inference_pb2.ModelInfo(id="tiny", lane="gemma", created=1700000001),
    ]
    response = await client.get("/v1/models")
    assert response.status_code == 200
    assert response.json() == {
        "object": "list",
        "data": [
            {"id": "gemma", "object": "model", "created": 1700000000, "owned_by": "blazar"},
            {"id": "tiny", "object": "model", "created": 1700000001, "owned_by": "blazar"},
        ],
    }


@pytest.mark.parametrize("name", ["gemma", "tiny", "google/gemma-3"])
async def test_model_retrieve(daemon: Daemon, client: httpx.AsyncClient, name: str) -> None:
    daemon.fake.models = [
        inference_pb2.ModelInfo(id="gemma", lane="gemma", created=1700000000, ready=True),
        # Aliases of the same Lane are listed, and retrieved, under their own ids.
        inference_pb2.ModelInfo(id="tiny", lane="gemma", created=1700000000),
        inference_pb2.ModelInfo(id="google/gemma-3", lane="gemma", created=1700000000),
    ]
    response = await client.get(f"/v1/models/{name}")
    assert response.status_code == 200, response.text
    assert response.json() == {
        "id": name,
        "object": "model",
        "created": 1700000000,
        "owned_by": "blazar",
    }
    listed = await client.get("/v1/models")
    assert response.json() in listed.json()["data"]


@pytest.mark.parametrize("name", ["nope", "gemma/extra"])
async def test_model_retrieve_unknown_is_404(
    daemon: Daemon, client: httpx.AsyncClient, name: str
) -> None:
    daemon.fake.models = [inference_pb2.ModelInfo(id="gemma", lane="gemma", created=1)]
    response = await client.get(f"/v1/models/{name}")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": f"The model '{name}' does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


async def test_every_response_has_a_fresh_request_id(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    first = await client.get("/healthz")
    second = await client.post("/v1/chat/completions", content=b"{")
    ids = {first.headers["x-request-id"], second.headers["x-request-id"]}
    assert len(ids) == 2
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def routed_final(*, replica: int, reused: int) -> inference_pb2.Chunk:
    chunk = final(cached=reused)
    chunk.final.routing.CopyFrom(
        inference_pb2.Routing(lane="lane-a", replica=replica, prefix_tokens_reused=reused)
    )
    return chunk


ROUTING_HEADERS = ("x-blazar-lane", "x-blazar-replica", "x-blazar-prefix-reused")


@pytest.mark.parametrize(
    ("path", "body", "script", "headers"),
    [
        # Whole answers: the final chunk's routing.
        ("/v1/chat/completions", chat_body(), [delta("Hi"), routed_final(replica=1, reused=9)],
         ("lane-a", "1", "9")),
        ("/v1/completions", {"model": "tiny", "prompt": "Once"},
         [delta(" upon"), routed_final(replica=1, reused=0)], ("lane-a", "1", "0")),
        # Streams: the Lane and replica from the initial metadata; what the cache held
        # only where the daemon named it there too (not from an upstream Lane, as
        # here; test_shim_dialects has the case where it does) ...
        ("/v1/chat/completions", chat_body(stream=True),
         [delta("Hi"), routed_final(replica=1, reused=9)], ("lane-a", "1", None)),
        ("/v1/completions", {"model": "tiny", "prompt": "Once", "stream": True},
         [delta(" upon"), routed_final(replica=1, reused=9)], ("lane-a", "1", None)),
        # ... unless the first chunk is the final one.
        ("/v1/chat/completions", chat_body(stream=True), [routed_final(replica=1, reused=9)],
         ("lane-a", "1", "9")),
        # A daemon that names no replica gets none invented.
        ("/v1/chat/completions", chat_body(), HELLO, (None, None, None)),
    ],
)  # fmt: skip
async def test_responses_say_which_replica_served_them(
    daemon: Daemon,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    script: list[Step],
    headers: tuple[str | None, str | None, str | None],
) -> None:
    daemon.fake.scripts["tiny"] = script
    daemon.fake.replica = None if script is HELLO else 1
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert tuple(response.headers.get(name) for name in ROUTING_HEADERS) == headers


@pytest.mark.parametrize(
    ("path", "user", "header", "session"),
    [
        ("/v1/chat/completions", None, None, ""),
        ("/v1/chat/completions", "alice", None, "alice"),
        ("/v1/chat/completions", None, "conv-7", "conv-7"),
        ("/v1/chat/completions", "alice", "conv-7", "conv-7"),  # the header is more specific
        ("/v1/completions", "alice", None, "alice"),
        ("/v1/completions", "alice", "conv-7", "conv-7"),
        # OpenAI sets no bound on `user`: a longer one than Blazar's session keys is
        # keyed by its digest, not refused.
        (
            "/v1/chat/completions",
            "u" * 300,
            None,
            "sha256:8b5089b44d9fefeafc563a34f6cb19fbdbe3814023622cb463bb4a74caba1c19",
        ),
        (
            "/v1/completions",
            "u" * 300,
            None,
            "sha256:8b5089b44d9fefeafc563a34f6cb19fbdbe3814023622cb463bb4a74caba1c19",
        ),
    ],
)
async def test_the_session_key_is_the_session_header_else_the_user(
    daemon: Daemon,
    client: httpx.AsyncClient,
    path: str,
    user: str | None,
    header: str | None,
    session: str,
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    body: dict[str, Any] = chat_body() if "chat" in path else {"model": "tiny", "prompt": "Once"}
    if user is not None:
        body["user"] = user
    headers = {"x-blazar-session": header} if header is not None else {}
    response = await client.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert daemon.fake.requests[-1].session == session


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("header", "slo"), [(None, ""), ("interactive", "interactive")])
async def test_the_slo_header_names_the_policy(
    daemon: Daemon, client: httpx.AsyncClient, path: str, header: str | None, slo: str
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    body: dict[str, Any] = chat_body() if "chat" in path else {"model": "tiny", "prompt": "Once"}
    headers = {"x-blazar-slo": header} if header is not None else {}
    response = await client.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert daemon.fake.requests[-1].slo == slo


async def test_an_unknown_policy_is_400_naming_it(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    # As the data plane refuses it (dataplane.policies).
    refusal = errors.InvalidRequest(
        "The SLOPolicy 'nosuch' does not exist (the request names it in `slo` or the "
        "x-blazar-slo header); name an existing SLOPolicy, or none to use the Lane's.",
        metadata={errors.FIELD_KEY: "slo", "policy": "nosuch"},
    )
    daemon.fake.scripts["tiny"] = [refusal]
    response = await client.post(
        "/v1/chat/completions", json=chat_body(), headers={"x-blazar-slo": "nosuch"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "'nosuch'" in error["message"]


async def test_api_key_is_forwarded_as_bearer(daemon: Daemon, client: httpx.AsyncClient) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    await client.post("/v1/chat/completions", json=chat_body(), headers={"x-api-key": "k1"})
    assert daemon.fake.metadata[-1]["authorization"] == "Bearer k1"
    await client.post(
        "/v1/chat/completions", json=chat_body(), headers={"authorization": "Bearer k2"}
    )
    assert daemon.fake.metadata[-1]["authorization"] == "Bearer k2"


# ---------------------------------------------------------------- probes


async def test_healthz_follows_grpc_health(daemon: Daemon, client: httpx.AsyncClient) -> None:
    ok = await client.get("/healthz")
    assert (ok.status_code, ok.json()) == (200, {"status": "ok"})
    await daemon.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    down = await client.get("/healthz")
    assert down.status_code == 503


async def test_readyz_needs_every_listed_lane_ready(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.models = [
        inference_pb2.ModelInfo(id="a", lane="a", ready=True, replicas=1),
        inference_pb2.ModelInfo(id="b", lane="b", ready=False, replicas=2),
        # Scaled to zero: paused on purpose, so not waited for.
        inference_pb2.ModelInfo(id="p", lane="p", ready=False, replicas=0),
    ]
    waiting = await client.get("/readyz")
    assert (waiting.status_code, waiting.json()) == (503, {"status": "not ready", "lanes": ["b"]})
    daemon.fake.models[1].ready = True
    ready = await client.get("/readyz")
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    await daemon.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert (await client.get("/readyz")).status_code == 503


async def test_metrics_exposes_the_process_registry(client: httpx.AsyncClient) -> None:
    from blazar.dataplane import metrics  # registers the data plane's metrics

    metrics.REQUESTS.labels("probe-lane", "ok").inc()
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert 'blazar_requests_total{lane="probe-lane",outcome="ok"}' in response.text


async def test_daemon_down() -> None:
    async with fake_daemon() as d:
        target = d.target  # a port that nothing listens on once the server stops
    async with asgi_client(target) as client:
        assert (await client.get("/healthz")).status_code == 503
        response = await client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error"


# ---------------------------------------------------------------- errors


async def test_unknown_model_is_404(daemon: Daemon, client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body("nope", stream=True))
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model 'nope' does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


@pytest.mark.parametrize(
    ("content", "param", "fragment"),
    [
        (b'{"model": "tiny", "messages": [', None, "could not parse the JSON body"),
        (b"\xff\xfe", None, "could not parse the JSON body"),
        (b"[]", None, "must be a JSON object"),
        # Deeper than the decoder recurses, even inside a field nobody reads.
        (
            b'{"model": "tiny", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            None,
            "could not parse the JSON body",
        ),
        (b'{"x": ' + b'{"y": ' * 5000 + b"1" + b"}" * 5001, None, "nested too deeply"),
        (b'{"model": "tiny", "n": 1' + b"0" * 5000 + b"}", None, "Exceeds the limit"),
        (
            json.dumps(chat_body(temperature="hot")).encode(),
            "temperature",
            "'temperature'",
        ),
        (
            json.dumps({"model": "tiny", "messages": [{"role": "user", "content": 5}]}).encode(),
            "messages[0].content",
            "'messages[0].content'",
        ),
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}],
                }
            ).encode(),
            "messages[0].content[0].text",
            "'messages[0].content[0].text'",
        ),
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": [{"type": "image_url"}]}],
                }
            ).encode(),
            "messages[0].content[0].type",
            "'image_url'",
        ),
        (json.dumps({"messages": []}).encode(), "model", "'model'"),
        (json.dumps(chat_body(n=2)).encode(), "n", "n=2"),
        (json.dumps(chat_body(max_tokens=0)).encode(), "max_tokens", "'max_tokens'"),
        (json.dumps(chat_body(stream="yes")).encode(), "stream", "'stream'"),
        (
            json.dumps(chat_body(stream_options={"include_usage": True})).encode(),
            "stream_options",
            "only allowed when 'stream' is enabled",
        ),
        # Beyond the wire's int32, not a server error.
        (json.dumps(chat_body(max_tokens=2**31)).encode(), "max_tokens", "2147483647"),
        (
            json.dumps(chat_body(max_completion_tokens=2**31)).encode(),
            "max_completion_tokens",
            "2147483647",
        ),
        (json.dumps(chat_body(top_k=-1)).encode(), "top_k", "'top_k'"),
        (json.dumps(chat_body(repeat_penalty=0)).encode(), "repeat_penalty", "'repeat_penalty'"),
        # What tool calling does not take is refused, not ignored.
        (json.dumps(chat_body(functions=[TOOL["function"]])).encode(), "functions", "'tools'"),
        (json.dumps(chat_body(function_call="auto")).encode(), "function_call", "'tools'"),
        (
            json.dumps(chat_body(tools=[{"type": "custom", "custom": {"name": "x"}}])).encode(),
            "tools[0].type",
            "'function'",
        ),
        (
            json.dumps(chat_body(tools=[{"type": "function", "function": {}}])).encode(),
            "tools[0].function.name",
            "'tools[0].function.name'",
        ),
        (
            json.dumps(
                chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}])
            ).encode(),
            "tools[0].function.parameters",
            "'tools[0].function.parameters'",
        ),
        (json.dumps(chat_body(tool_choice="required")).encode(), "tool_choice", "'tools'"),
        (json.dumps(chat_body(tools=[TOOL], tool_choice="any")).encode(), "tool_choice", ""),
        (
            json.dumps(
                chat_body(
                    tools=[TOOL],
                    tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto"}},
                )
            ).encode(),
            "tool_choice.type",
            "'function'",
        ),
        (
            json.dumps({"model": "tiny", "messages": [{"role": "tool", "content": "21"}]}).encode(),
            "messages[0].tool_call_id",
            "'messages[0].tool_call_id'",
        ),
        (
            json.dumps(
                {"model": "tiny", "messages": [{"role": "tool", "tool_call_id": "c"}]}
            ).encode(),
            "messages[0].content",
            "a tool message needs content",
        ),
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}],
                }
            ).encode(),
            "messages[0].tool_calls",
            "Only assistant messages",
        ),
        # A tool message answers a call made before it, as OpenAI insists.
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [
                        {"role": "user", "content": "x"},
                        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                        {"role": "tool", "tool_call_id": "call_typo", "content": "21"},
                    ],
                }
            ).encode(),
            "messages[2].tool_call_id",
            "'call_typo' matches no call",
        ),
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [
                        {"role": "user", "content": "x"},
                        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
                        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                    ],
                }
            ).encode(),
            "messages[1].tool_call_id",
            "a tool message answers a call made before it",
        ),
        # System and user turns need content; an assistant turn may be empty.
        (
            json.dumps({"model": "tiny", "messages": [{"role": "user"}]}).encode(),
            "messages[0].content",
            "Missing required parameter: 'messages[0].content'",
        ),
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [
                        {"role": "assistant", "content": None},
                        {"role": "user", "content": []},
                    ],
                }
            ).encode(),
            "messages[1].content",
            "at least one content part",
        ),
        (
            json.dumps(
                {"model": "tiny", "messages": [{"role": "system", "content": None}]}
            ).encode(),
            "messages[0].content",
            "a system message needs content",
        ),
        (
            json.dumps(
                {"model": "tiny", "messages": [{"role": "developer", "content": []}]}
            ).encode(),
            "messages[0].content",
            "a developer message",
        ),
        # So are other outputs than text.
        (json.dumps(chat_body(modalities=["text", "audio"])).encode(), "modalities", "audio"),
        (json.dumps(chat_body(modalities=[])).encode(), "modalities", "text output"),
        (
            json.dumps(chat_body(audio={"voice": "alloy", "format": "wav"})).encode(),
            "audio",
            "Audio output",
        ),
        (
            json.dumps(chat_body(prediction={"type": "content", "content": "x"})).encode(),
            "prediction",
            "Predicted outputs",
        ),
        # OpenAI's fields that change what its models do, which this server cannot
        # honour: refused by name, not ignored.
        (json.dumps(chat_body(reasoning_effort="high")).encode(), "reasoning_effort", "reasoning"),
        (json.dumps(chat_body(verbosity="low")).encode(), "verbosity", "max_completion_tokens"),
        (json.dumps(chat_body(service_tier="flex")).encode(), "service_tier", "one service tier"),
        (json.dumps(chat_body(store=True)).encode(), "store", "not stored"),
        (json.dumps(chat_body(metadata={"k": "v"})).encode(), "metadata", "stores none"),
        (json.dumps(chat_body(web_search_options={})).encode(), "web_search_options", "web search"),
        (
            json.dumps(
                chat_body(
                    moderation={
                        "model": "omni-moderation-latest",
                        "policy": {"input": {"mode": "block"}, "output": {"mode": "block"}},
                    }
                )
            ).encode(),
            "moderation",
            "not run by this server",
        ),
        # As OpenAI answers it.
        (
            json.dumps(chat_body(parallel_tool_calls=False)).encode(),
            "parallel_tool_calls",
            "only allowed when 'tools' are specified",
        ),
        # The prompt cache is implicit, in memory, with no promised lifetime.
        (
            json.dumps(chat_body(prompt_cache_retention="24h")).encode(),
            "prompt_cache_retention",
            "in memory only",
        ),
        (
            json.dumps(chat_body(prompt_cache_options={"ttl": "30m"})).encode(),
            "prompt_cache_options.ttl",
            "no promised lifetime",
        ),
        (
            json.dumps(chat_body(prompt_cache_options={"mode": "explicit"})).encode(),
            "prompt_cache_options.mode",
            "no breakpoints",
        ),
        # The deprecated form of a call in the history, like the request's `functions`.
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [
                        {"role": "user", "content": "Weather?"},
                        {
                            "role": "assistant",
                            "content": None,
                            "function_call": {"name": "get_weather", "arguments": "{}"},
                        },
                    ],
                }
            ).encode(),
            "messages[1].function_call",
            "'tool_calls'",
        ),
        # An earlier audio answer, by id: nothing here can replay it.
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [
                        {"role": "user", "content": "Sing."},
                        {"role": "assistant", "audio": {"id": "audio_1"}},
                    ],
                }
            ).encode(),
            "messages[1].audio",
            "transcript",
        ),
        (
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [
                        {"role": "assistant", "tool_calls": [{**TOOL_CALL, "type": "custom"}]},
                    ],
                }
            ).encode(),
            "messages[0].tool_calls[0].type",
            "'function'",
        ),
    ],
)
async def test_bad_chat_body_is_400(
    daemon: Daemon, client: httpx.AsyncClient, content: bytes, param: str | None, fragment: str
) -> None:
    response = await client.post("/v1/chat/completions", content=content)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"]
    assert daemon.fake.requests == []  # rejected before reaching the daemon


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": ["\udc00"]}, "stop[0]"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "\ud83d"}]},
            "messages[0].content",
        ),
        ("/v1/chat/completions", chat_body(stop="x\udfff"), "stop"),
        ("/v1/embeddings", {"model": "tiny", "input": ["ok", "\ud800"]}, "input[1]"),
    ],
)
async def test_unpaired_surrogate_is_400(
    daemon: Daemon, client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    # json.dumps escapes the lone surrogate as `\ud800`, which is how clients send one.
    response = await client.post(path, content=json.dumps(body).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert "unpaired surrogate" in error["message"]
    assert daemon.fake.requests == []


async def test_unknown_route_is_an_openai_error(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/complete", json=chat_body())
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "/v1/chat/complete" in response.json()["error"]["message"]
    response = await client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert "POST" in response.json()["error"]["message"]
    assert response.headers["allow"] == "POST"


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        (["a", "b"], "exactly one string"),
        ([1, 2, 3], "token arrays are not supported"),
        ([[1, 2], [3]], "token arrays are not supported"),
        ([], "exactly one"),
    ],
)
async def test_bad_completion_prompt_is_400(
    daemon: Daemon, client: httpx.AsyncClient, prompt: Any, fragment: str
) -> None:
    response = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]
    assert response.json()["error"]["param"].startswith("prompt")


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"best_of": 3}, "best_of", "best_of=3"),
        ({"best_of": 0}, "best_of", "best_of=0"),
        ({"suffix": " the end."}, "suffix", "'suffix' is not supported"),
    ],
)
async def test_unsupported_completion_options_are_400(
    daemon: Daemon, client: httpx.AsyncClient, extra: dict[str, Any], param: str, fragment: str
) -> None:
    body = {"model": "tiny", "prompt": "a", **extra}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert fragment in error["message"]
    assert not daemon.fake.requests


async def test_options_that_change_nothing_are_accepted(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    for body in (
        {"model": "tiny", "prompt": "a", "best_of": 1, "suffix": ""},
        {"model": "tiny", "prompt": "a", "best_of": None, "suffix": None},
    ):
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    for extra in (
        {"modalities": ["text"], "audio": None, "prediction": None},
        {"modalities": None},
        # The defaults of fields refused otherwise.
        {"reasoning_effort": "none", "verbosity": "medium", "service_tier": "auto"},
        {"store": False, "metadata": {}, "prompt_cache_key": "k"},
    ):
        response = await client.post("/v1/chat/completions", json=chat_body(**extra))
        assert response.status_code == 200, response.text


# Each OpenAI route, with a body it takes (beside the fake daemon's script for it).
ROUTE_BODIES = {
    "/v1/chat/completions": chat_body(max_tokens=4),
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 4},
    "/v1/embeddings": {"model": "tiny", "input": "Hi"},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 4},
    "/v1/responses/input_tokens": {"model": "tiny", "input": "Hi"},
}
# What OpenAI says of one unknown argument, and of several, on each route.
UNKNOWN_ONE = {
    "/v1/responses": "Unknown parameter: 'typical_p'.",
    "/v1/responses/input_tokens": "Unknown parameter: 'typical_p'.",
}
UNKNOWN_MANY = {
    "/v1/responses": "Unknown parameters: 'chat_template_kwargs', 'mirostat', 'n_probs'.",
    "/v1/responses/input_tokens": (
        "Unknown parameters: 'chat_template_kwargs', 'mirostat', 'n_probs'."
    ),
}


def script_every_route(daemon: Daemon) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    daemon.fake.embeddings = EMBEDDINGS
    daemon.fake.tokenized = inference_pb2.TokenizeResponse(tokens=[2, 9])


@pytest.mark.parametrize("path", list(ROUTE_BODIES))
async def test_an_unknown_field_is_400_naming_it_on_every_route(
    daemon: Daemon, client: httpx.AsyncClient, path: str
) -> None:
    """A field Blazar does not know would otherwise be dropped, and the request answered
    as if it had not been sent (llama.cpp's `typical_p`, `mirostat`, ...)."""
    script_every_route(daemon)
    one = await client.post(path, json={**ROUTE_BODIES[path], "typical_p": 0.5})
    assert one.status_code == 400, one.text
    assert one.json()["error"] == {
        "message": UNKNOWN_ONE.get(path, "Unrecognized request argument supplied: typical_p"),
        "type": "invalid_request_error",
        "param": "typical_p",
        "code": "unknown_parameter",
    }
    # All of them, sorted, before any other problem of the body.
    several = {"n_probs": 3, "mirostat": 2, "chat_template_kwargs": {}, "model": ""}
    many = await client.post(path, json={**ROUTE_BODIES[path], **several})
    assert many.status_code == 400, many.text
    error = many.json()["error"]
    assert error["message"] == UNKNOWN_MANY.get(
        path, "Unrecognized request arguments supplied: chat_template_kwargs, mirostat, n_probs"
    )
    assert (error["param"], error["code"]) == ("chat_template_kwargs", "unknown_parameter")
    assert daemon.fake.requests == []


@pytest.mark.parametrize("path", list(ROUTE_BODIES))
async def test_an_unknown_field_sent_as_null_is_one_not_sent(
    daemon: Daemon, client: httpx.AsyncClient, path: str
) -> None:
    """As OpenAI takes an argument it does not recognise when it is null; clients that
    serialize every field they know send their unset ones so."""
    script_every_route(daemon)
    response = await client.post(path, json={**ROUTE_BODIES[path], "typical_p": None})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_llama_cpp_cache_prompt_true_is_taken_and_false_refused(
    daemon: Daemon, client: httpx.AsyncClient, path: str
) -> None:
    """llama.cpp's `cache_prompt`: true is what the engine does (reuse the cached
    prefix), so it passes; false asks for a prefill from scratch, which it cannot do."""
    script_every_route(daemon)
    taken = await client.post(path, json={**ROUTE_BODIES[path], "cache_prompt": True})
    assert taken.status_code == 200, taken.text
    refused = await client.post(path, json={**ROUTE_BODIES[path], "cache_prompt": False})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("cache_prompt", None)
    assert "always reuses the cached prefix" in error["message"]
    assert len(daemon.fake.requests) == 1


async def test_unknown_fields_inside_the_body_are_left_alone(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Only the top level is strict: clients echo fields of OpenAI's output (an id, a
    status) back inside messages, tools and items."""
    script_every_route(daemon)
    message = {"role": "user", "content": [{"type": "text", "text": "Hi", "cache": 1}], "id": "m"}
    tool = {**TOOL, "id": "t"}
    chat = await client.post(
        "/v1/chat/completions", json=chat_body(messages=[message], tools=[tool])
    )
    assert chat.status_code == 200, chat.text
    item = {"type": "message", "role": "user", "content": "Hi", "id": "msg_1", "status": "done"}
    response = await client.post("/v1/responses", json={"model": "tiny", "input": [item]})
    assert response.status_code == 200, response.text


async def test_stream_options_need_a_stream(daemon: Daemon, client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "a", "stream_options": {"include_usage": True}}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream_options"
    assert not daemon.fake.requests


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_obfuscation_is_refused_not_ignored(
    daemon: Daemon, client: httpx.AsyncClient, path: str
) -> None:
    """OpenAI pads streamed chunks when asked (`obfuscation`); these are not padded."""
    daemon.fake.scripts["tiny"] = HELLO
    base = chat_body(stream=True) if "chat" in path else {"model": "tiny", "prompt": "a"}
    base["stream"] = True
    asked = {**base, "stream_options": {"include_obfuscation": True}}
    response = await client.post(path, json=asked)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stream_options.include_obfuscation"
    assert not daemon.fake.requests
    declined = {**base, "stream_options": {"include_obfuscation": False, "include_usage": True}}
    response = await client.post(path, json=declined)
    assert response.status_code == 200, response.text


async def test_context_length_exceeded_is_400(daemon: Daemon, client: httpx.AsyncClient) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded.of(prompt_tokens=900, max_tokens=200, context_length=1024)
    ]
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json=chat_body(stream=stream))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "messages"
        assert "1024" in error["message"] and "1100" in error["message"]
        # OpenAI's opening words, by which LiteLLM raises ContextWindowExceededError.
        assert error["message"].startswith("This model's maximum context length is 1024 tokens")
    response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert response.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    ("metadata", "retry_after"),
    [({"retry_after_ms": "2500"}, "3"), ({"retry_after_ms": "10"}, "1"), ({}, "1")],
)
async def test_overloaded_is_429_with_retry_after(
    daemon: Daemon, client: httpx.AsyncClient, metadata: dict[str, str], retry_after: str
) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.Overloaded("Queue full for lane tiny.", metadata=metadata)
    ]
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json=chat_body(stream=stream))
        assert response.status_code == 429
        assert response.headers["retry-after"] == retry_after
        assert response.json()["error"] == {
            "message": "Queue full for lane tiny.",
            "type": "rate_limit_error",
            "param": None,
            "code": "overloaded",
        }


@pytest.mark.parametrize(
    ("error", "http_status"),
    [
        (errors.Unavailable("No ready replica."), 503),
        (errors.InvalidRequest("Bad stop."), 400),
        (errors.BlazarError("Engine crashed."), 500),
    ],
)
async def test_daemon_errors_map_to_http_status(
    daemon: Daemon, client: httpx.AsyncClient, error: errors.BlazarError, http_status: int
) -> None:
    daemon.fake.scripts["tiny"] = [error]
    response = await client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == http_status
    assert response.json()["error"]["message"] == error.message
    daemon.fake.scripts["__list__"] = [error]
    assert (await client.get("/v1/models")).status_code == http_status


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "x" * 5_600_000}),
        (
            "/v1/chat/completions",
            chat_body(messages=[{"role": "user", "content": "x" * 5_600_000}]),
        ),
    ],
)
async def test_a_request_too_large_for_grpc_is_413_not_overloaded(
    daemon: Daemon, client: httpx.AsyncClient, path: str, body: dict[str, Any], stream: bool
) -> None:
    # The fake daemon keeps gRPC's default 4 MiB limit, so gRPC itself refuses the
    # request (RESOURCE_EXHAUSTED without Blazar's metadata); it never reaches the fake.
    daemon.fake.scripts["tiny"] = HELLO
    response = await client.post(path, json={**body, "stream": stream})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == ("request_too_large", None)
    assert error["message"].startswith("The request is larger than the server accepts: ")
    assert "the limit is 4194304 bytes (4 MiB)" in error["message"]
    assert "retry-after" not in response.headers
    assert daemon.fake.requests == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_over_the_shims_limit_is_413_before_it_is_read(
    daemon: Daemon, client: httpx.AsyncClient, path: str, declared: bool
) -> None:
    limit = request_body.MAX_BODY_BYTES
    piece = b"x" * 2**20
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(limit // len(piece) + 8):
            sent += len(piece)
            yield piece
        yield b'"}'

    headers = {"content-type": "application/json"}
    if declared:  # an honest Content-Length: refused before a byte of the body is read
        headers["content-length"] = str(limit + 8 * len(piece) + 32)
    response = await client.post(path, content=chunks(), headers=headers)
    assert response.status_code == 413
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert error["message"].startswith("The request body is larger than the server accepts: ")
    assert "the limit is 16777216 bytes (16 MiB)" in error["message"]
    assert daemon.fake.requests == []
    if declared:  # refused on the header alone
        assert sent == 0
        assert error["message"].startswith(
            f"The request body is larger than the server accepts: {limit + 8 * len(piece) + 32} bytes"
        )
    else:  # chunked: refused once past the limit, not after the whole body
        assert 0 < sent <= limit + len(piece)
        assert f"more than {limit} bytes" in error["message"]


async def test_a_client_gone_while_sending_its_body_is_499_not_a_failure(
    daemon: Daemon,
) -> None:
    app = shim_app.create_app(inference_target=daemon.target)
    messages = iter(
        [
            {"type": "http.request", "body": b'{"model": "tiny", "pro', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("shim", 80),
    }  # fmt: skip
    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == streaming.CLIENT_CLOSED_REQUEST
    assert daemon.fake.requests == []


async def test_a_large_body_is_parsed_off_the_event_loop(
    daemon: Daemon, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing a body built to be slow must not stall every stream on the event loop."""
    daemon.fake.scripts["tiny"] = HELLO
    on_loop: list[bool] = []
    threads: list[str] = []
    original = validation.parse_body

    def parse_body(model: Any, raw: bytes) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        threads.append(threading.current_thread().name)
        return original(model, raw)

    monkeypatch.setattr(validation, "parse_body", parse_body)
    small = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
    # A known field: an unknown one would be refused (after parsing, but with a 400).
    large = {**small, "user": "u" * (request_body.PARSE_INLINE_BYTES + 1)}
    for body in (small, large):
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    assert on_loop == [True, False]
    # Its own single thread: large bodies are parsed one at a time.
    assert threads[1].startswith("large-body-parser")


async def test_malformed_request_does_not_disturb_concurrent_good_one(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    gate = asyncio.Event()
    daemon.fake.scripts["tiny"] = [delta("one"), gate, delta(" two"), final()]
    good = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(stream=True)))
    await poll(lambda: len(daemon.fake.requests) == 1, what="the good request to start")
    bad = await client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": ')
    assert bad.status_code == 400
    gate.set()
    response = await good
    events = sse_events(response.text)
    text = "".join(
        e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict)
    )
    assert text == "one two"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert daemon.fake.cancelled == []


def raw_lp(data: bytes, logprob: float, *top: tuple[bytes, float]) -> inference_pb2.TokenLogprob:
    """A token by its bytes, which need not be whole UTF-8 characters."""
    return inference_pb2.TokenLogprob(
        token=data.decode(errors="replace"),
        logprob=logprob,
        bytes=data,
        top=[
            inference_pb2.TokenLogprob(token=t.decode(errors="replace"), logprob=p, bytes=t)
            for t, p in top
        ],
    )


def test_legacy_logprobs_name_partial_characters_by_their_bytes() -> None:
    # "é!" from two byte-fallback tokens and "!"; the alternatives differ only in bytes.
    legacy = logprob.LegacyLogprobs()
    legacy.skip("caf")
    first = legacy.render([raw_lp(b"\xc3", -0.5, (b"\xc3", -0.5), (b"\xe2", -1.5))])
    rest = legacy.render(
        [raw_lp(b"\xa9", -0.25, (b"\xa9", -0.25), (b"\xa8", -2.0)), raw_lp(b"!", -1.0)]
    )
    assert first["tokens"] + rest["tokens"] == ["bytes:\\xc3", "bytes:\\xa9", "!"]
    assert first["top_logprobs"] == [{"bytes:\\xc3": -0.5, "bytes:\\xe2": -1.5}]
    assert rest["top_logprobs"][0] == {"bytes:\\xa9": -0.25, "bytes:\\xa8": -2.0}
    # The split character counts once, at the token that completes it: offsets stay
    # inside "café!".
    assert first["text_offset"] + rest["text_offset"] == [3, 3, 4]


# ---------------------------------------------------------------- golden: whole responses

RESPONSE_CASES: dict[str, tuple[str, dict[str, Any], list[Step]]] = {
    "response_chat_logprobs": (
        "/v1/chat/completions",
        chat_body(logprobs=True, top_logprobs=1),
        [
            delta("Yes", logprobs=[lp("Yes", -0.5, ("Yes", -0.5))]),
            delta(".", logprobs=[lp(".", -0.25, (".", -0.25))]),
            final(completion=2),
        ],
    ),
    "response_completion_logprobs_echo": (
        "/v1/completions",
        {"model": "tiny", "prompt": "Once upon", "logprobs": 1, "echo": True, "max_tokens": 2},
        [
            delta(" a", logprobs=[lp(" a", -0.5, (" the", -0.25))]),
            delta(" time", logprobs=[lp(" time", -0.125, (" time", -0.125))]),
            final(
                inference_pb2.FINISH_REASON_LENGTH,
                prompt=3,
                completion=2,
                prompt_logprobs=[
                    lp("Once", -7.5, ("The", -2.0)),
                    lp(" upon", -3.25, (" upon", -3.25)),
                ],
            ),
        ],
    ),
    "response_completion_logprobs_zero": (
        "/v1/completions",
        {"model": "tiny", "prompt": "Once", "logprobs": 0},
        [delta(" upon", logprobs=[lp(" upon", -0.5)]), final(completion=1)],
    ),
    "response_completion_echo": (
        "/v1/completions",
        {"model": "tiny", "prompt": "Once", "echo": True},
        [delta(" upon"), final(completion=1)],
    ),
    "response_chat_tool_calls": (
        "/v1/chat/completions",
        chat_body(tools=[WEATHER], tool_choice="required"),
        [*CALL_SCRIPT, final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=2)],
    ),
    # Cut short by max_tokens: the last call may be half-formed, and is left out.
    "response_chat_tool_calls_length": (
        "/v1/chat/completions",
        chat_body(tools=[WEATHER], tool_choice="required", max_tokens=9),
        [
            *CALL_SCRIPT[:3],
            calling(1, id="call_b", name="get_weather", arguments='{"city": "Os'),
            final(inference_pb2.FINISH_REASON_LENGTH, completion=9, tool_calls=1),
        ],
    ),
    # An auto call is whole when it goes out: text after it cut short keeps it.
    "response_chat_auto_call_then_length": (
        "/v1/chat/completions",
        chat_body(tools=[WEATHER], max_tokens=9),
        [
            calling(0, id="call_a", name="get_weather", arguments='{"city":"Paris","unit":"c"}'),
            delta("Anything"),
            final(inference_pb2.FINISH_REASON_LENGTH, completion=9, tool_calls=1),
        ],
    ),
    "response_chat_text_and_tool_call": (
        "/v1/chat/completions",
        chat_body(tools=[WEATHER]),
        [
            delta("Let me check."),
            calling(0, id="call_a", name="get_weather", arguments='{"city":"Paris","unit":"c"}'),
            final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=1),
        ],
    ),
}


def normalise_body(body: Any) -> Any:
    return normalise([body])[0]


@pytest.mark.parametrize("name", sorted(RESPONSE_CASES))
async def test_response_matches_golden(
    name: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    path, body, script = RESPONSE_CASES[name]
    daemon.fake.scripts["tiny"] = script
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    check_golden(
        name,
        {
            "path": path,
            "http_body": body,
            "chunks": fake_inference.script_json(script),
            "response": normalise_body(response.json()),
        },
    )


EMBEDDINGS = inference_pb2.EmbedResponse(
    embeddings=[
        inference_pb2.Embedding(values=[0.5, -0.25, 0.125], tokens=3),
        inference_pb2.Embedding(values=[1.0, 0.0, -1.0], tokens=2),
    ],
    model="lane-a",
    prompt_tokens=5,
)


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
async def test_embeddings_match_golden(
    encoding_format: str | None, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = []
    daemon.fake.embeddings = EMBEDDINGS
    body: dict[str, Any] = {"model": "tiny", "input": ["one two", "three"]}
    if encoding_format:
        body["encoding_format"] = encoding_format
    response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    sent = daemon.fake.requests[-1]
    assert (list(sent.inputs), sent.normalize) == (["one two", "three"], True)
    check_golden(
        f"response_embeddings_{encoding_format or 'default'}",
        {
            "http_body": body,
            "daemon": json_format.MessageToDict(EMBEDDINGS, preserving_proto_field_name=True),
            "response": response.json(),
        },
    )


@pytest.mark.parametrize("tokens", [[15339, 1917], [[15339, 1917], [9906]]])
async def test_embedding_token_arrays_are_refused_saying_what_to_send(
    daemon: Daemon, client: httpx.AsyncClient, tokens: Any
) -> None:
    """LangChain's OpenAIEmbeddings sends tiktoken ids by default (as here, base64):
    the 400 names the setting that makes it send the text."""
    body = {"model": "tiny", "input": tokens, "encoding_format": "base64"}
    response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input"
    assert "token arrays are not supported" in error["message"]
    assert "check_embedding_ctx_length=False" in error["message"]


# ---------------------------------------------------------------- structured output, logprobs


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias", "'abc' is not a token id"),
        ({"logit_bias": {"-3": 1}}, "logit_bias", "'-3'"),
        ({"logit_bias": {" 5": 1}}, "logit_bias", "' 5' is not a token id"),
        ({"logit_bias": {"1_000": 1}}, "logit_bias", "'1_000' is not a token id"),
        ({"logit_bias": {"\u0663": 1}}, "logit_bias", "is not a token id"),
        ({"logit_bias": {"+5": 1}}, "logit_bias", "'+5' is not a token id"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
        ({"logit_bias": {"5": "x"}}, "logit_bias.5", "'logit_bias.5'"),
        ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "'top_logprobs'"),
        ({"response_format": {"type": "xml"}}, "response_format", "'response_format'"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "json_schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "Missing required parameter",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "response_format.json_schema.schema",
            "'response_format.json_schema.schema'",
        ),
    ],
)
async def test_bad_structured_output_or_logprobs_is_400(
    daemon: Daemon, client: httpx.AsyncClient, extra: dict[str, Any], param: str, fragment: str
) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body(**extra))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert fragment in error["message"]
    assert daemon.fake.requests == []


async def test_echo_with_logprobs_cannot_stream(daemon: Daemon, client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1, "stream": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "echo"


async def test_response_format_reaches_the_daemon(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = [delta('{"name": "Ada", "age": 36}'), final()]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }
    response = await client.post(
        "/v1/chat/completions", json=chat_body(response_format=response_format)
    )
    assert response.status_code == 200, response.text
    constraint = daemon.fake.requests[-1].constraint
    assert json.loads(constraint.json_schema) == PERSON_SCHEMA
    assert not daemon.fake.requests[-1].sampling.logprobs
    assert response.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            chat_body(response_format={"type": "json_object", "schema": PERSON_SCHEMA}),
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}},
        ),
        (
            "/v1/responses",
            {
                "model": "tiny",
                "input": "x",
                "text": {"format": {"type": "json_object", "schema": PERSON_SCHEMA}},
            },
        ),
    ],
)
async def test_json_object_with_llama_cpps_schema_constrains_to_it(
    daemon: Daemon, client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    """llama.cpp's server reads a `schema` beside `"type": "json_object"` as the schema
    to enforce; dropped, the output would be any object, not the one asked for."""
    daemon.fake.scripts["tiny"] = [delta('{"name": "Ada", "age": 36}'), final()]
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    constraint = daemon.fake.requests[-1].constraint
    if path == "/v1/completions":
        assert constraint.WhichOneof("kind") == "json_object"
    else:
        assert json.loads(constraint.json_schema) == PERSON_SCHEMA


@pytest.mark.parametrize(
    ("seed", "sent"), [(-1, None), (0, 0), (7, 7), (-2, 2**32 - 2), (2**32 + 3, 3)]
)
async def test_seed_minus_one_draws_a_random_seed_as_in_llama_cpp(
    daemon: Daemon, client: httpx.AsyncClient, seed: int, sent: int | None
) -> None:
    daemon.fake.scripts["tiny"] = [delta("x"), final()]
    response = await client.post("/v1/chat/completions", json=chat_body(seed=seed))
    assert response.status_code == 200, response.text
    sampling = daemon.fake.requests[-1].sampling
    assert (sampling.seed if sampling.HasField("seed") else None) == sent


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # llama.cpp's server's own fields, on both endpoints.
        ({"grammar": 'root ::= "yes" | "no"'}, {"grammar": 'root ::= "yes" | "no"'}),
        ({"json_schema": PERSON_SCHEMA}, {"json_schema": PERSON_SCHEMA}),
        # An empty grammar constrains nothing, as in llama.cpp; a text format neither.
        ({"grammar": ""}, None),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "text"}}, {"grammar": 'root ::= "a"'}),
    ],
)  # fmt: skip
async def test_llama_cpp_constraint_fields_reach_the_daemon(
    daemon: Daemon,
    client: httpx.AsyncClient,
    extra: dict[str, Any],
    expected: dict[str, Any] | None,
) -> None:
    for path, body in (
        ("/v1/chat/completions", chat_body(**extra)),
        ("/v1/completions", {"model": "tiny", "prompt": "a", **extra}),
    ):
        daemon.fake.scripts["tiny"] = [delta("yes"), final()]
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        sent = daemon.fake.requests[-1]
        if expected is None:
            assert not sent.HasField("constraint")
        elif "grammar" in expected:
            assert sent.constraint.grammar == expected["grammar"]
        else:
            assert json.loads(sent.constraint.json_schema) == expected["json_schema"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
        ({"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema"),
        ({"response_format": {"type": "json_object"}, "json_schema": {}}, "json_schema"),
        ({"json_schema": "{}"}, "json_schema"),
        ({"grammar": 3}, "grammar"),
    ],
)
async def test_more_than_one_constraint_is_400(
    daemon: Daemon, client: httpx.AsyncClient, extra: dict[str, Any], param: str
) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body(**extra))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert daemon.fake.requests == []


@pytest.mark.parametrize(
    ("field", "extra", "param"),
    [
        ("constraint", {"response_format": {"type": "json_object"}}, "response_format"),
        ("constraint", {"grammar": 'root ::= "a"'}, "grammar"),
        ("constraint", {"json_schema": {"type": "object"}}, "json_schema"),
        # The engine alone knows the vocabulary, so only it can refuse a token id.
        ("sampling.logit_bias", {"logit_bias": {"262144": 5}}, "logit_bias"),
        ("sampling.stop", {"stop": [str(i) for i in range(65)]}, "stop"),
        ("sampling.unheard_of", {}, None),
    ],
)
async def test_field_errors_from_the_engine_are_400(
    daemon: Daemon,
    client: httpx.AsyncClient,
    field: str,
    extra: dict[str, Any],
    param: str | None,
) -> None:
    blamed = {errors.FIELD_KEY: field}
    daemon.fake.scripts["tiny"] = [errors.InvalidRequest("The engine says no.", metadata=blamed)]
    for path, body in (
        ("/v1/chat/completions", chat_body(**extra)),
        ("/v1/completions", {"model": "tiny", "prompt": "a", **extra}),
    ):
        for stream in (False, True):
            response = await client.post(path, json={**body, "stream": stream})
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["message"] == "The engine says no."
            assert error["param"] == param


async def test_an_empty_prompt_from_the_engine_blames_the_prompt(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    blamed = {errors.FIELD_KEY: "prompt"}
    daemon.fake.scripts["tiny"] = [errors.InvalidRequest("The prompt is empty.", metadata=blamed)]
    for path, body, param in (
        ("/v1/completions", {"model": "tiny", "prompt": ""}, "prompt"),
        ("/v1/chat/completions", chat_body(), "messages"),
    ):
        response = await client.post(path, json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"model": "tiny", "input": [1, 2, 3]}, "input", "token arrays"),
        ({"model": "tiny", "input": [[1, 2]]}, "input", "token arrays"),
        ({"model": "tiny", "input": []}, "input", "empty list"),
        ({"model": "tiny", "input": ""}, "input", "must not be empty"),
        ({"model": "tiny", "input": ["a", ""]}, "input[1]", "must not be empty"),
        (
            {"model": "tiny", "input": "a", "encoding_format": "int8"},
            "encoding_format",
            "'encoding_format'",
        ),
        ({"input": "a"}, "model", "'model'"),
    ],
)
async def test_bad_embeddings_body_is_400(
    daemon: Daemon, client: httpx.AsyncClient, body: dict[str, Any], param: str, fragment: str
) -> None:
    response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert fragment in error["message"]
    assert daemon.fake.requests == []


async def test_embeddings_errors(daemon: Daemon, client: httpx.AsyncClient) -> None:
    missing = await client.post("/v1/embeddings", json={"model": "nope", "input": "a"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")

    daemon.fake.scripts["tiny"] = []
    daemon.fake.embeddings = EMBEDDINGS
    # The engine shortens (and refuses more than the model has); the shim asks.
    right = await client.post(
        "/v1/embeddings", json={"model": "tiny", "input": "a", "dimensions": 2}
    )
    assert right.status_code == 200
    assert daemon.fake.requests[-1].dimensions == 2
    whole = await client.post("/v1/embeddings", json={"model": "tiny", "input": "a"})
    assert whole.status_code == 200
    assert not daemon.fake.requests[-1].HasField("dimensions")
    huge = await client.post(
        "/v1/embeddings", json={"model": "tiny", "input": "a", "dimensions": 2**31}
    )
    assert (huge.status_code, huge.json()["error"]["param"]) == (400, "dimensions")

    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded(
            "Input 0 is 5000 tokens long, but this model embeds at most 2048 tokens per input.",
            metadata={"prompt_tokens": "5000", "context_length": "2048"},
        )
    ]
    long = await client.post("/v1/embeddings", json={"model": "tiny", "input": "a"})
    assert long.status_code == 400
    error = long.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")
    assert "5000" in error["message"] and "2048" in error["message"]

    daemon.fake.scripts["tiny"] = [
        errors.InvalidRequest(
            "The request has 3000 inputs; at most 2048 are embedded per request.",
            metadata={errors.FIELD_KEY: "inputs", "inputs": "3000"},
        )
    ]
    many = await client.post("/v1/embeddings", json={"model": "tiny", "input": ["a"] * 3000})
    assert many.status_code == 400
    assert many.json()["error"]["param"] == "input"


# ---------------------------------------------------------------- real server


async def test_client_disconnect_cancels_the_rpc(daemon: Daemon) -> None:
    gate = asyncio.Event()  # never set: the daemon would stream forever
    daemon.fake.scripts["tiny"] = [delta("first"), gate]
    async with uvicorn_shim(daemon.target) as base, httpx.AsyncClient(base_url=base) as http:
        async with http.stream(
            "POST", "/v1/chat/completions", json=chat_body(stream=True)
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if '"first"' in line:
                    break
        await poll(lambda: daemon.fake.cancelled == ["tiny"], what="the RPC to be cancelled")


async def test_disconnect_while_queued_cancels_the_rpc(daemon: Daemon) -> None:
    gate = asyncio.Event()  # the first chunk never comes, as in a long admission queue
    daemon.fake.scripts["tiny"] = [gate]
    async with uvicorn_shim(daemon.target) as base:
        for stream in (True, False):
            async with httpx.AsyncClient(base_url=base) as http:
                request = asyncio.create_task(
                    http.post("/v1/chat/completions", json=chat_body(stream=stream))
                )
                await poll(lambda: len(daemon.fake.requests) == 1, what="the RPC to start")
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
            await poll(lambda: daemon.fake.cancelled == ["tiny"], what="the RPC to be cancelled")
            daemon.fake.requests.clear()
            daemon.fake.cancelled.clear()


async def test_official_openai_client_sees_an_admission_refusal_as_429(daemon: Daemon) -> None:
    """What the data plane sends when admission refuses: the SDK's RateLimitError, with
    the status, a Retry-After in whole seconds rounded up, and OpenAI's error body."""
    daemon.fake.scripts["tiny"] = [
        errors.SloUnattainable.of(
            lane="tiny",
            policy="interactive",
            predicted_ttft_s=3.5,
            ttft_target_s=2.0,
            retry_after_s=1.5004,
        )
    ]
    async with uvicorn_shim(daemon.target) as base:
        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as refused:
                    await sdk.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": "Hi"}],
                        stream=stream,
                        extra_headers={"x-blazar-slo": "interactive"},
                    )
                error = refused.value
                assert error.status_code == 429
                assert error.response.headers["retry-after"] == "2"
                assert error.code == "slo_unattainable"
                assert error.type == "rate_limit_error"
                assert isinstance(error.body, dict)
                assert "SLOPolicy 'interactive'" in error.body["message"]
                assert daemon.fake.requests[-1].slo == "interactive"
        finally:
            await sdk.close()


async def test_official_openai_client(daemon: Daemon) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    daemon.fake.models = [inference_pb2.ModelInfo(id="tiny", lane="tiny", created=1)]
    async with uvicorn_shim(daemon.target) as base:
        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            stream = await sdk.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            pieces, reasons, usage = [], [], None
            async for chunk in stream:
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                    reasons.append(choice.finish_reason)
                usage = chunk.usage or usage
            assert "".join(pieces) == "Hello world"
            assert reasons[-1] == "stop"
            assert usage is not None and usage.total_tokens == 10

            completion = await sdk.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
            )
            assert completion.choices[0].message.content == "Hello world"
            assert completion.choices[0].finish_reason == "stop"
            assert completion.usage is not None
            assert completion.usage.prompt_tokens_details is not None
            assert completion.usage.prompt_tokens_details.cached_tokens == 0

            text = await sdk.completions.create(model="tiny", prompt="Say")
            assert text.choices[0].text == "Hello world"

            models = await sdk.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            retrieved = await sdk.models.retrieve("tiny")
            assert (retrieved.id, retrieved.object) == ("tiny", "model")
            with pytest.raises(openai.NotFoundError) as unknown:
                await sdk.models.retrieve("missing")
            assert unknown.value.code == "model_not_found"

            daemon.fake.embeddings = EMBEDDINGS
            # Asked for floats, or for nothing (the SDK then asks for base64 and decodes it).
            choices: list[dict[str, Any]] = [{"encoding_format": "float"}, {}]
            for options in choices:
                vectors = await sdk.embeddings.create(
                    model="tiny", input=["one two", "three"], **options
                )
                assert [d.embedding for d in vectors.data] == [[0.5, -0.25, 0.125], [1, 0, -1]]
                assert vectors.usage.prompt_tokens == 5
            raw = await sdk.embeddings.create(
                model="tiny", input="one two", encoding_format="base64"
            )
            packed = base64.b64decode(str(raw.data[0].embedding))
            assert struct.unpack("<3f", packed[:12]) == (0.5, -0.25, 0.125)

            daemon.fake.scripts["tiny"] = [
                delta("{}", logprobs=[lp("{}", -0.5, ("{}", -0.5), ("[]", -1.0))]),
                final(),
            ]
            structured = await sdk.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Hi"}],
                response_format={"type": "json_object"},
                logprobs=True,
                top_logprobs=2,
                logit_bias={"42": -100},
            )
            assert structured.choices[0].message.content == "{}"
            assert structured.choices[0].logprobs is not None
            content = structured.choices[0].logprobs.content
            assert content is not None
            assert [t.token for t in content[0].top_logprobs] == ["{}", "[]"]
            sent = daemon.fake.requests[-1]
            assert sent.constraint.json_object and dict(sent.sampling.logit_bias) == {42: -100}
            daemon.fake.scripts["tiny"] = HELLO

            with pytest.raises(openai.NotFoundError) as not_found:
                await sdk.chat.completions.create(
                    model="missing", messages=[{"role": "user", "content": "Hi"}]
                )
            assert not_found.value.code == "model_not_found"

            daemon.fake.scripts["tiny"] = [delta("par"), errors.Unavailable("Replica died.")]
            broken = await sdk.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True
            )
            with pytest.raises(openai.APIError, match="Replica died"):
                async for _ in broken:
                    pass
        finally:
            await sdk.close()


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("tools[1].parameters", "tools[1].function.parameters"),
        ("tools[0].name", "tools[0].function.name"),
        ("tools", "tools"),
        ("tool_choice", "tool_choice"),
        ("messages[2].tool_calls[0].arguments", "messages[2].tool_calls[0].function.arguments"),
        ("messages[2].tool_calls[0]", "messages[2].tool_calls[0]"),
    ],
)
async def test_tool_errors_from_the_engine_name_openais_parameter(
    daemon: Daemon, client: httpx.AsyncClient, field: str, param: str
) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.InvalidRequest("Tool 'x' cannot be forced.", metadata={errors.FIELD_KEY: field})
    ]
    response = await client.post(
        "/v1/chat/completions", json=chat_body(tools=[WEATHER], tool_choice="required")
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_the_official_client_accumulates_streamed_tool_calls(daemon: Daemon) -> None:
    script = [
        *CALL_SCRIPT,
        final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=2),
    ]
    messages: list[Any] = [{"role": "user", "content": "Weather?"}]
    async with uvicorn_shim(daemon.target) as base:
        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            # The SDK's own accumulator, which parses strict tools' arguments.
            daemon.fake.scripts["tiny"] = list(script)
            async with sdk.chat.completions.stream(
                model="tiny", messages=messages, tools=[WEATHER], tool_choice="required"
            ) as stream:
                done = [e async for e in stream if e.type == "tool_calls.function.arguments.done"]
                streamed = await stream.get_final_completion()
            choice = streamed.choices[0]
            assert choice.finish_reason == "tool_calls"
            calls = choice.message.tool_calls or []
            assert [(c.id, c.type, c.function.name) for c in calls] == [
                ("call_a", "function", "get_weather"),
                ("call_b", "function", "get_weather"),
            ]
            assert [c.function.parsed_arguments for c in calls] == [  # type: ignore[union-attr]
                {"city": "Paris", "unit": "c"},
                {"city": "Oslo", "unit": "f"},
            ]
            assert [e.name for e in done] == ["get_weather", "get_weather"]

            daemon.fake.scripts["tiny"] = list(script)
            whole = await sdk.chat.completions.create(
                model="tiny", messages=messages, tools=[WEATHER], tool_choice="required"
            )
            message = whole.choices[0].message
            assert whole.choices[0].finish_reason == "tool_calls"
            assert message.content is None
            assert [json.loads(c.function.arguments) for c in message.tool_calls or []] == [
                {"city": "Paris", "unit": "c"},
                {"city": "Oslo", "unit": "f"},
            ]

            # The answer goes back in the history as the client built it.
            daemon.fake.scripts["tiny"] = HELLO
            history = [
                *messages,
                message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": "call_a", "content": "21"},
                {"role": "tool", "tool_call_id": "call_b", "content": "3"},
            ]
            after = await sdk.chat.completions.create(
                model="tiny", messages=history, tools=[WEATHER]
            )
            assert after.choices[0].message.content == "Hello world"
            sent = daemon.fake.requests[-1]
            assert [c.id for c in sent.messages[1].tool_calls] == ["call_a", "call_b"]
            assert [(m.role, m.tool_call_id) for m in sent.messages[2:]] == [
                ("tool", "call_a"),
                ("tool", "call_b"),
            ]
        finally:
            await sdk.close()


async def test_chat_logprobs_are_the_contents_tokens_not_a_calls(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Found by a review: `logprobs.content` listed a call's markup tokens
    ('<', 'tool', '_', 'call', '>', ...), where OpenAI's covers content only. A call's
    tokens come with no text, held back until it parses: they are not content's. A
    character's first bytes (no text yet) wait for its text, whole and streamed."""
    call = calling(0, id="call_a", name="get_weather", arguments='{"city":"Paris","unit":"c"}')
    call.delta.logprobs.append(lp("}", -0.3))
    script: list[Step] = [
        delta("", logprobs=[lp("\ufffd", -0.5)]),
        delta("✓ Let me check.", logprobs=[lp("\ufffd", -0.4), lp(" Let me check.", -0.1)]),
        delta("", logprobs=[lp("<tool_call>", -0.2)]),
        call,
        final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=4, tool_calls=1),
    ]
    document = chat_body(tools=[WEATHER], logprobs=True)
    own = [-0.5, -0.4, -0.1]
    daemon.fake.scripts["tiny"] = script
    whole = (await client.post("/v1/chat/completions", json=document)).json()
    (choice,) = whole["choices"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(own)
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    daemon.fake.scripts["tiny"] = script
    streamed = await client.post("/v1/chat/completions", json={**document, "stream": True})
    chunks = [e for e in sse_events(streamed.text) if e != "[DONE]" and e["choices"]]
    entries = [
        e["logprob"]
        for c in chunks
        if c["choices"][0].get("logprobs")
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert entries == pytest.approx(own)
