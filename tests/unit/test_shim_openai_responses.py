"""The Responses API (`POST /v1/responses`) of the OpenAI dialect, against a fake
`blazar.v1.Inference` servicer (see `fake_inference`).

Golden files under golden/openai_responses/ pin the translation both ways: request
bodies into canonical requests, scripted chunks into the response object and the
SSE event sequence. Regenerate them with BLAZAR_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
from google.protobuf import json_format
from openai.types.responses import Response, ResponseStreamEvent

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import validation
from blazar.shim.openai.responses import protocol, requests
from tests.unit import fake_inference
from tests.unit.fake_inference import (
    Daemon,
    Step,
    asgi_client,
    delta,
    fake_daemon,
    final,
    lp,
    uvicorn_shim,
)

GOLDEN = Path(__file__).parent / "golden" / "openai_responses"
PATH = "/v1/responses"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with fake_daemon() as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(daemon.target) as c:
        yield c


WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
HELLO: list[Step] = [delta("Hel"), delta("lo"), delta(" world"), final()]


def calling(
    index: int, *, id: str = "", name: str = "", arguments: str = "", tokens: int = 1
) -> inference_pb2.Chunk:
    part = inference_pb2.ToolCallDelta(index=index, id=id, name=name, arguments=arguments)
    return inference_pb2.Chunk(delta=inference_pb2.Delta(tokens=tokens, tool_calls=[part]))


CALL_SCRIPT: list[Step] = [
    calling(0, id="call_a", name="get_weather"),
    calling(0, arguments='{"city": "Pa'),
    calling(0, arguments='ris", "unit": "c"}', tokens=4),
    calling(1, id="call_b", name="get_weather", arguments='{"city": "Oslo", "unit": "f"}'),
]


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": "Hi", **extra}


def check_golden(name: str, document: Any) -> None:
    fake_inference.check_golden(GOLDEN / f"{name}.json", document)


def sse_events(text: str) -> list[dict[str, Any]]:
    """Parse a Responses SSE body strictly: each event an `event:` line naming its
    type and one `data:` line, ended by a blank line; sequence numbers from 0."""
    assert text.endswith("\n\n"), text
    events: list[dict[str, Any]] = []
    for block in text[:-2].split("\n\n"):
        head, data, *rest = block.split("\n")
        assert not rest, block
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == head[len("event: ") :]
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


KEY = re.compile(r"(resp|msg|fc)_[0-9a-f]{32}")


def normalise(document: Any) -> Any:
    """Replace the per-request key in ids and the clock in `created_at`."""
    text = KEY.sub(lambda m: f"{m.group(1)}_<key>", json.dumps(document))
    out = json.loads(text)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("object") == "response":
                assert isinstance(node["created_at"], int)
                node["created_at"] = 0
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(out)
    return out


def parse(document: dict[str, Any]) -> protocol.ResponseCreateRequest:
    return validation.parse_body(protocol.ResponseCreateRequest, json.dumps(document).encode())


# ---------------------------------------------------------------- golden: requests in

REQUEST_CASES: dict[str, dict[str, Any]] = {
    "request_text_input": body(),
    "request_items_with_instructions": body(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                         {"type": "input_text", "text": "there"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
            {"type": "message", "role": "user", "content": "Again"},
        ],
        max_output_tokens=20,
        temperature=0.5,
        top_p=0.9,
        user="alice",
        metadata={"trace": "t-1"},
        store=False,
        truncation="disabled",
        reasoning={"effort": None},
    ),
    "request_tool_turns": body(
        input=[
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Let me check."}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
             "arguments": '{"city":"Paris","unit":"c"}', "status": "completed"},
            {"type": "function_call", "call_id": "call_b", "name": "get_weather",
             "arguments": '{"city":"Oslo","unit":"c"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "21"},
            {"type": "function_call_output", "call_id": "call_b",
             "output": [{"type": "input_text", "text": "9"}]},
        ],
        tools=[WEATHER, {"type": "function", "name": "noop"}],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    ),
    "request_tools_required": body(tools=[WEATHER], tool_choice="required"),
    "request_tools_auto": body(tools=[WEATHER], prompt_cache_key="conv-1", user="alice"),
    "request_json_schema": body(
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA,
                         "strict": True}},
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    ),
    "request_json_object": body(text={"format": {"type": "json_object"}}, safety_identifier="s-1"),
    "request_text_format": body(text={"format": {"type": "text"}}),
    "request_llama_cpp_extensions": body(
        seed=7, top_k=1, min_p=0.5, repeat_penalty=1.25, presence_penalty=0.5,
        frequency_penalty=-0.5, stop=["\n\n", "END"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REQUEST_CASES))
def test_request_translation_matches_golden(name: str) -> None:
    document = REQUEST_CASES[name]
    canonical = requests.chat_request(parse(document))
    check_golden(
        name,
        {
            "http_body": document,
            "canonical": json_format.MessageToDict(canonical, preserving_proto_field_name=True),
        },
    )


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "expected"),
    [
        ({"type": "function", "name": "get_weather"}, None, False),
        ({"type": "function", "name": "get_weather"}, True, False),
        ("required", True, True),
        ("required", None, None),
    ],
)
def test_a_named_tool_choice_makes_exactly_one_call(
    tool_choice: Any, parallel: bool | None, expected: bool | None
) -> None:
    """As in Chat Completions: a named tool_choice is exactly one call."""
    request = requests.chat_request(
        parse(body(tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=parallel))
    )
    if expected is None:
        assert not request.HasField("parallel_tool_calls")
    else:
        assert request.HasField("parallel_tool_calls")
        assert request.parallel_tool_calls is expected


def test_an_assistant_refusal_in_the_history_is_its_text() -> None:
    """An earlier answer as OpenAI's output holds it (an `output_text` part, or a
    `refusal` part) goes back as the assistant's text, as Chat Completions takes an
    assistant turn's `refusal`; a user's message has no refusal part."""
    refused = {"type": "refusal", "refusal": "I can't help with that."}
    history = [
        {"role": "user", "content": "Help?"},
        {"type": "message", "role": "assistant", "content": [refused]},
        {"role": "user", "content": "Why?"},
    ]
    request = requests.chat_request(
        protocol.ResponseCreateRequest.model_validate(body(input=history))
    )
    assert [(m.role, m.content) for m in request.messages] == [
        ("user", "Help?"),
        ("assistant", "I can't help with that."),
        ("user", "Why?"),
    ]
    for content, param in (
        ([{"type": "refusal"}], "input[1].content[0].refusal"),
        (
            [{"type": "output_text", "text": "a"}, {"type": "input_image"}],
            "input[1].content[1].type",
        ),
    ):
        bad = [history[0], {"role": "assistant", "content": content}]
        with pytest.raises(errors.InvalidRequest) as missing:
            requests.chat_request(protocol.ResponseCreateRequest.model_validate(body(input=bad)))
        assert missing.value.metadata[validation.PARAM_KEY] == param
    user_refusal = [{"role": "user", "content": [refused]}]
    with pytest.raises(errors.InvalidRequest) as not_text:
        requests.chat_request(
            protocol.ResponseCreateRequest.model_validate(body(input=user_refusal))
        )
    assert not_text.value.metadata[validation.PARAM_KEY] == "input[0].content[0].type"


def test_unset_sampling_fields_stay_unset() -> None:
    sampling = requests.chat_request(parse(body())).sampling
    for name in ("temperature", "top_p", "seed", "max_tokens", "top_k"):
        assert not sampling.HasField(name), name
    assert requests.chat_request(parse(body(temperature=0))).sampling.HasField("temperature")


# ---------------------------------------------------------------- golden: responses out

RESPONSE_CASES: dict[str, tuple[dict[str, Any], list[Step]]] = {
    "response_text": (body(metadata={"k": "v"}), HELLO),
    "response_max_output_tokens": (
        body(max_output_tokens=2),
        [delta("a"), delta("b"), final(inference_pb2.FINISH_REASON_LENGTH, completion=2)],
    ),
    "response_cached_tokens": (body(), [delta("Hi"), final(prompt=120, completion=1, cached=96)]),
    "response_tool_calls": (
        body(tools=[WEATHER], tool_choice="required"),
        [*CALL_SCRIPT, final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=2)],
    ),
    "response_text_and_call_then_cut": (
        # An auto call came whole; a second, forced-style, was cut by max_output_tokens:
        # only the whole one is output.
        body(tools=[WEATHER], max_output_tokens=12),
        [
            delta("Let me check."),
            calling(0, id="call_a", name="get_weather", arguments='{"city":"Paris","unit":"c"}'),
            calling(1, id="call_b", name="get_weather", arguments='{"city": "Os'),
            final(inference_pb2.FINISH_REASON_LENGTH, completion=12, tool_calls=1),
        ],
    ),
    "response_logprobs": (
        body(include=["message.output_text.logprobs"], top_logprobs=1),
        [
            delta("Hi", logprobs=[lp("Hi", -0.25, ("Hi", -0.25))]),
            delta("", logprobs=[lp("\ufffd", -2.0, ("\ufffd", -2.0))]),
            delta(" ✓", logprobs=[lp("\ufffd", -0.5, ("\ufffd", -0.5))]),
            final(completion=3),
        ],
    ),
    "response_json_schema": (
        body(text={"format": {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA}}),
        [delta('{"name":"Ada",'), delta('"age":36}'), final()],
    ),
}


@pytest.mark.parametrize("name", sorted(RESPONSE_CASES))
async def test_response_matches_golden(
    name: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    document, script = RESPONSE_CASES[name]
    daemon.fake.scripts["tiny"] = script
    response = await client.post(PATH, json=document)
    assert response.status_code == 200, response.text
    rendered = response.json()
    assert rendered["id"] == f"resp_{response.headers['x-request-id']}"
    check_golden(
        name,
        {
            "http_body": document,
            "chunks": fake_inference.script_json(script),
            "response": normalise(rendered),
        },
    )


STREAM_CASES: dict[str, tuple[dict[str, Any], list[Step]]] = {
    "stream_text": (body(stream=True), HELLO),
    "stream_max_output_tokens": (
        body(stream=True, max_output_tokens=2),
        [delta("a"), delta("b"), final(inference_pb2.FINISH_REASON_LENGTH, completion=2)],
    ),
    "stream_tool_calls": (
        body(stream=True, tools=[WEATHER], tool_choice="required"),
        [*CALL_SCRIPT, final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=2)],
    ),
    "stream_text_then_cut_call": (
        body(stream=True, tools=[WEATHER], tool_choice="required", max_output_tokens=12),
        [
            delta("x"),
            calling(0, id="call_a", name="get_weather", arguments='{"city": "Pa'),
            final(inference_pb2.FINISH_REASON_LENGTH, completion=12, tool_calls=0),
        ],
    ),
    "stream_empty": (body(stream=True), [final(completion=0)]),
    "stream_logprobs": (
        body(stream=True, include=["message.output_text.logprobs"]),
        [
            delta("", logprobs=[lp("\ufffd", -2.0)]),
            delta("✓", logprobs=[lp("\ufffd", -0.5)]),
            final(completion=2),
        ],
    ),
    "stream_error_after_start": (
        body(stream=True),
        [delta("par"), errors.Unavailable("The replica serving 'tiny' stopped.")],
    ),
    "stream_truncated": (body(stream=True), [delta("x")]),
}


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
async def test_stream_matches_golden(name: str, daemon: Daemon, client: httpx.AsyncClient) -> None:
    document, script = STREAM_CASES[name]
    daemon.fake.scripts["tiny"] = script
    response = await client.post(PATH, json=document)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert ids == {f"resp_{response.headers['x-request-id']}"}
    # Exactly one terminal event, last.
    terminal = [e["type"] for e in events if e["type"] in TERMINAL]
    assert terminal == [events[-1]["type"]]
    check_golden(
        name,
        {
            "http_body": document,
            "chunks": fake_inference.script_json(script),
            "sse": normalise(events),
        },
    )


TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@pytest.mark.parametrize("name", ["response_text", "response_tool_calls", "response_logprobs",
                                  "response_max_output_tokens", "response_text_and_call_then_cut"])  # fmt: skip
async def test_a_stream_ends_in_the_response_a_whole_request_gets(
    name: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    document, script = RESPONSE_CASES[name]
    daemon.fake.scripts["tiny"] = script
    whole = (await client.post(PATH, json=document)).json()
    daemon.fake.scripts["tiny"] = script
    streamed = sse_events((await client.post(PATH, json={**document, "stream": True})).text)
    assert normalise(streamed[-1]["response"]) == normalise(whole)
    # The items done along the way are the response's output, in order.
    done = [e["item"] for e in streamed if e["type"] == "response.output_item.done"]
    assert normalise(done) == normalise(whole["output"])


def sdk_event_types() -> dict[str, type[pydantic.BaseModel]]:
    """Each streaming event model of the installed `openai` package, by its `type`."""
    (union, *_) = typing.get_args(ResponseStreamEvent)
    found = {}
    for model in typing.get_args(union):
        (kind,) = typing.get_args(model.model_fields["type"].annotation)
        found[kind] = model
    return found


@pytest.mark.parametrize("name", sorted(RESPONSE_CASES) + sorted(STREAM_CASES))
async def test_every_response_and_event_validates_against_the_sdks_types(
    name: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """What the `openai` package's models require is there, with its type: the SDK
    reads leniently (a missing field reads as None), a typed client does not."""
    document, script = RESPONSE_CASES.get(name) or STREAM_CASES[name]
    if not document.get("stream"):
        daemon.fake.scripts["tiny"] = script
        Response.model_validate((await client.post(PATH, json=document)).json())
    daemon.fake.scripts["tiny"] = script
    streamed = sse_events((await client.post(PATH, json={**document, "stream": True})).text)
    models = sdk_event_types()
    for event in streamed:
        models[event["type"]].model_validate(event)


async def test_output_text_logprobs_are_its_own_tokens(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """A call's tokens come with no text (held back until the call parses): they are
    not the message's. The text's logprobs are its own tokens', whole and streamed, and
    the deltas' add up to the done event's."""
    call = calling(0, id="call_a", name="get_weather", arguments='{"city":"Paris","unit":"c"}')
    call.delta.logprobs.append(lp("}", -0.3))
    script: list[Step] = [
        delta("", logprobs=[lp("\ufffd", -0.5)]),
        delta("✓ Let me check.", logprobs=[lp("\ufffd", -0.4), lp(" Let me check.", -0.1)]),
        delta("", logprobs=[lp("<tool_call>", -0.2)]),
        call,
        final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=4, tool_calls=1),
    ]
    document = body(tools=[WEATHER], include=["message.output_text.logprobs"])
    own = [-0.5, -0.4, -0.1]
    daemon.fake.scripts["tiny"] = script
    whole = (await client.post(PATH, json=document)).json()
    message, _ = whole["output"]
    assert [e["logprob"] for e in message["content"][0]["logprobs"]] == pytest.approx(own)
    daemon.fake.scripts["tiny"] = script
    events = sse_events((await client.post(PATH, json={**document, "stream": True})).text)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert [e["logprob"] for d in deltas for e in d["logprobs"]] == pytest.approx(own)
    assert [e["logprob"] for e in done["logprobs"]] == pytest.approx(own)
    assert normalise(events[-1]["response"]) == normalise(whole)


async def test_the_response_echoes_the_settings_it_was_asked_for(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """As OpenAI's does, whole and in every lifecycle event: what a client reads back
    from `response.prompt_cache_key` is what it sent, not None."""
    echoed = {
        "prompt_cache_key": "tenant-7",
        "safety_identifier": "user-42",
        "prompt_cache_retention": "in_memory",
        "user": "u",
        "metadata": {"k": "v"},
    }
    document = body(**echoed, service_tier="auto")
    daemon.fake.scripts["tiny"] = HELLO
    whole = (await client.post(PATH, json=document)).json()
    daemon.fake.scripts["tiny"] = HELLO
    events = sse_events((await client.post(PATH, json={**document, "stream": True})).text)
    for response in [whole, *(e["response"] for e in events if "response" in e)]:
        assert {k: response[k] for k in echoed} == echoed
        assert response["service_tier"] == "default"


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"store": True}, "store", "keeps no responses"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "whole conversation"),
        ({"conversation": "conv_1"}, "conversation", "whole conversation"),
        ({"background": True}, "background", "Background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "Stored prompts"),
        ({"truncation": "auto"}, "truncation", "never drops"),
        ({"max_tool_calls": 3}, "max_tool_calls", "built-in tools"),
        ({"context_management": [{"type": "compaction"}]}, "context_management", "compaction"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "not run by this server"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "in memory only"),
        ({"prompt_cache_options": {"ttl": "30m"}}, "prompt_cache_options.ttl", "implicit"),
        ({"background_options": {}}, "background_options", "background responses"),
        ({"image": {"detail": "low"}}, "image", "image options"),
        ({"access_programs": ["x"]}, "access_programs", "access programs"),
        # Blazar's Chat Completions constraints, which here would be dropped.
        ({"grammar": 'root ::= "a"'}, "grammar", "not a Responses API parameter"),
        ({"json_schema": {"type": "object"}}, "json_schema", "'text.format'"),
        ({"service_tier": "flex"}, "service_tier", "one tier"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "do not reason"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "no reasoning"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
        ({"include": ["file_search_call.results"]}, "include[0]", "file_search_call.results"),
        ({"include": ["reasoning.encrypted_content"]}, "include[0]", "only"),
        ({"top_logprobs": 2}, "top_logprobs", "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search'"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type", "'file_search'"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "Missing"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto"}}, "tool_choice.type", "'allowed_tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name", "Missing"),
        ({"input": []}, "input", "empty"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "'item_reference'"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "'reasoning'"),
        ({"input": [{"content": "Hi"}]}, "input[0].role", "Missing"),
        ({"input": [{"role": "tool", "content": "Hi"}]}, "input[0].role", "Input should be"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type", "'input_image'"),
        ({"input": [{"role": "user", "content": []}]}, "input[0].content", "at least one"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text", "Missing"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id", "No 'function_call'"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments", "JSON text of an object"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "Missing"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c"}]}, "input[1].output", "Missing"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "Missing"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", "not padded"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k", "at most 512"),
        ({"input": None}, "input", "Invalid value"),
    ],
)  # fmt: skip
async def test_what_cannot_be_served_is_a_400_naming_it(
    daemon: Daemon, client: httpx.AsyncClient, extra: dict[str, Any], param: str, fragment: str
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    response = await client.post(PATH, json=body(**extra))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"], error
    assert daemon.fake.requests == []  # refused before reaching the daemon


@pytest.mark.parametrize(
    "document",
    [
        {"model": "tiny"},
        {"input": "Hi"},
        body(model=""),
        body(input=5),
        body(input=[5]),
        body(input=[{"role": "user", "content": 5}]),
        body(input=[{"role": "user", "content": [5]}]),
        body(input=[{"type": 5}]),
        body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]),
        body(tools={"type": "function"}),
        body(tools=[{"name": "f"}]),
        body(tools=[{"type": "function", "name": "f", "parameters": []}]),
        body(tools=[WEATHER], tool_choice=5),
        body(tools=[WEATHER], tool_choice="any"),
        body(text={"format": {"type": "xml"}}),
        body(text="json"),
        body(include="message.output_text.logprobs"),
        body(metadata={"k": 1}),
        body(metadata={str(i): "v" for i in range(17)}),
        body(stop=[1]),
        body(seed="1"),
        body(stream="yes"),
        body(store="false"),
    ],
)
async def test_a_malformed_body_is_a_400_never_a_500(
    daemon: Daemon, client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    response = await client.post(PATH, json=document)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"], error
    assert daemon.fake.requests == []


@pytest.mark.parametrize(
    "extra",
    [
        {"store": False},
        {"store": None, "previous_response_id": None, "background": False},
        {"truncation": "disabled", "service_tier": "auto"},
        {"reasoning": {"effort": "none"}},
        {"reasoning": None, "include": []},
        {"text": {"format": {"type": "text"}, "verbosity": None}},
        {"stream_options": {"include_obfuscation": False}},
    ],
)
async def test_what_changes_nothing_is_accepted(
    daemon: Daemon, client: httpx.AsyncClient, extra: dict[str, Any]
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    response = await client.post(PATH, json=body(**extra))
    assert response.status_code == 200, response.text
    assert response.json()["store"] is False


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_model_is_a_404(
    daemon: Daemon, client: httpx.AsyncClient, stream: bool
) -> None:
    response = await client.post(PATH, json=body(model="nope", stream=stream))
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
    ("field", "param"),
    [
        ("prompt", "input"),
        ("constraint", "text.format"),
        ("tools[1].parameters", "tools[1].parameters"),
        ("tools[0].name", "tools[0].name"),
        ("tool_choice", "tool_choice"),
        ("messages[3].tool_calls[0].arguments", "input"),
        ("sampling.stop", "stop"),
    ],
)
async def test_the_daemons_errors_blame_this_apis_parameters(
    daemon: Daemon, client: httpx.AsyncClient, field: str, param: str
) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.InvalidRequest("That is wrong.", metadata={errors.FIELD_KEY: field})
    ]
    response = await client.post(PATH, json=body())
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_over_the_context_names_the_sizes_in_this_apis_terms(
    daemon: Daemon, client: httpx.AsyncClient, stream: bool
) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded.of(prompt_tokens=2000, max_tokens=100, context_length=2048)
    ]
    response = await client.post(PATH, json=body(stream=stream, max_output_tokens=100))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "input"
    assert error["message"] == (
        "This model's maximum context length is 2048 tokens per request, but the request needs 2100 "
        "(2000 in the input and 100 to generate). Shorten the input, or lower "
        "max_output_tokens."
    )


async def test_a_bound_on_the_input_stays_a_bound(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """An input refused by its length in bytes, untokenized, has a lower bound for a
    count: the message says "at least", as the daemon's does."""
    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded.of(
            prompt_tokens=4167, max_tokens=5, context_length=1024, at_least=True
        )
    ]
    response = await client.post(PATH, json=body(max_output_tokens=5))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "This model's maximum context length is 1024 tokens per request, but the request needs at least "
        "4172 (at least 4167 in the input and 5 to generate). Shorten the input, or lower "
        "max_output_tokens."
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_admission_refusal_is_a_429_with_retry_after(
    daemon: Daemon, client: httpx.AsyncClient, stream: bool
) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.QueueFull.of(lane="tiny", policy="batch", max_queue_depth=4, retry_after_s=2.2)
    ]
    response = await client.post(PATH, json=body(stream=stream))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")


@pytest.mark.parametrize(
    ("header", "fields", "session"),
    [
        (None, {}, ""),
        (None, {"safety_identifier": "s"}, "s"),
        (None, {"safety_identifier": "s", "user": "u"}, "u"),
        (None, {"safety_identifier": "s", "user": "u", "prompt_cache_key": "k"}, "k"),
        ("conv-7", {"prompt_cache_key": "k"}, "conv-7"),
    ],
)
async def test_the_session_is_the_header_else_the_cache_key_else_the_user(
    daemon: Daemon,
    client: httpx.AsyncClient,
    header: str | None,
    fields: dict[str, str],
    session: str,
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    headers = {"x-blazar-session": header} if header else {}
    response = await client.post(PATH, json=body(**fields), headers=headers)
    assert response.status_code == 200, response.text
    assert daemon.fake.requests[-1].session == session


# ---------------------------------------------------------------- the official client


async def test_the_official_client_reads_text_and_streams(daemon: Daemon) -> None:
    daemon.fake.models = [inference_pb2.ModelInfo(id="tiny", lane="tiny", created=1)]
    async with uvicorn_shim(daemon.target) as base:
        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            daemon.fake.scripts["tiny"] = [delta("Hel"), delta("lo"), final(prompt=9, cached=4)]
            whole = await sdk.responses.create(model="tiny", input="Hi", instructions="Be kind.")
            assert whole.status == "completed"
            assert whole.output_text == "Hello"
            assert whole.usage is not None
            assert whole.usage.input_tokens_details.cached_tokens == 4
            assert whole.usage.total_tokens == 12

            daemon.fake.scripts["tiny"] = HELLO
            async with sdk.responses.stream(model="tiny", input="Hi") as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                streamed = await stream.get_final_response()
            assert deltas == ["Hel", "lo", " world"]
            assert streamed.output_text == "Hello world"

            daemon.fake.scripts["tiny"] = HELLO
            raw = await sdk.responses.create(model="tiny", input="Hi", stream=True)
            kinds = [event.type async for event in raw]
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert kinds[-1] == "response.completed"
        finally:
            await sdk.close()


async def test_the_official_client_parses_function_calls(daemon: Daemon) -> None:
    script = [*CALL_SCRIPT, final(inference_pb2.FINISH_REASON_TOOL_CALLS, tool_calls=2)]
    tools: Any = [WEATHER]
    expected = [{"city": "Paris", "unit": "c"}, {"city": "Oslo", "unit": "f"}]
    async with uvicorn_shim(daemon.target) as base:
        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            daemon.fake.scripts["tiny"] = list(script)
            async with sdk.responses.stream(
                model="tiny", input="Weather?", tools=tools, tool_choice="required"
            ) as stream:
                done = [
                    e.arguments
                    async for e in stream
                    if e.type == "response.function_call_arguments.done"
                ]
                streamed = await stream.get_final_response()
            calls = [item for item in streamed.output if item.type == "function_call"]
            assert [(c.call_id, c.name) for c in calls] == [
                ("call_a", "get_weather"),
                ("call_b", "get_weather"),
            ]
            assert [c.parsed_arguments for c in calls] == expected
            assert [json.loads(a) for a in done] == expected

            daemon.fake.scripts["tiny"] = list(script)
            whole = await sdk.responses.create(model="tiny", input="Weather?", tools=tools)
            calls_made = [item for item in whole.output if item.type == "function_call"]
            assert [json.loads(c.arguments) for c in calls_made] == expected

            # The calls and their outputs go back as input, as the client holds them.
            daemon.fake.scripts["tiny"] = HELLO
            history: Sequence[Any] = [
                {"role": "user", "content": "Weather?"},
                *[c.model_dump(exclude_none=True) for c in calls_made],
                {"type": "function_call_output", "call_id": "call_a", "output": "21"},
                {"type": "function_call_output", "call_id": "call_b", "output": "9"},
            ]
            after = await sdk.responses.create(model="tiny", input=list(history), tools=tools)
            assert after.output_text == "Hello world"
            sent = daemon.fake.requests[-1]
            assert [(m.role, m.tool_call_id, m.name) for m in sent.messages] == [
                ("user", "", ""),
                ("assistant", "", ""),
                ("tool", "call_a", "get_weather"),
                ("tool", "call_b", "get_weather"),
            ]
            assert [c.id for c in sent.messages[1].tool_calls] == ["call_a", "call_b"]
        finally:
            await sdk.close()


async def test_a_stream_that_fails_midway_ends_in_response_failed(daemon: Daemon) -> None:
    daemon.fake.scripts["tiny"] = [delta("par"), errors.Unavailable("The replica stopped.")]
    async with uvicorn_shim(daemon.target) as base:
        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            raw = await sdk.responses.create(model="tiny", input="Hi", stream=True)
            events = [event async for event in raw]
        finally:
            await sdk.close()
    error, failed = events[-2:]
    assert error.type == "error" and error.message == "The replica stopped."
    assert failed.type == "response.failed"
    assert failed.response.status == "failed"
    assert failed.response.error is not None
    assert failed.response.error.code == "server_error"
    assert failed.response.output_text == "par"


# ---------------------------------------------------------------- input_tokens, stored


COUNTED: list[dict[str, Any]] = [
    {"model": "tiny", "input": "Hi"},
    {"model": "tiny", "input": "Hi", "instructions": "Be brief.", "tools": [WEATHER]},
    {
        "model": "tiny",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "tools": [WEATHER],
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON_SCHEMA}},
    },
]


@pytest.mark.parametrize("body", COUNTED)
def test_input_tokens_counts_the_chat_a_response_would_render(body: dict[str, Any]) -> None:
    counted = requests.count_request(protocol.InputTokensRequest.model_validate(body))
    created = requests.chat_request(protocol.ResponseCreateRequest.model_validate(body))
    assert counted.model == "tiny"
    assert counted.chat == created


def test_input_tokens_without_input_counts_instructions_and_tools() -> None:
    body = {"model": "tiny", "instructions": "Be brief.", "tools": [WEATHER]}
    counted = requests.count_request(protocol.InputTokensRequest.model_validate(body))
    assert [m.role for m in counted.chat.messages] == ["system"]
    assert [t.name for t in counted.chat.tools] == ["get_weather"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"personality": "friendly"}, "personality"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
async def test_input_tokens_refuses_what_a_response_refuses(
    daemon: Daemon, client: httpx.AsyncClient, extra: dict[str, Any], param: str
) -> None:
    response = await client.post(
        f"{PATH}/input_tokens", json={"model": "tiny", "input": "Hi", **extra}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert daemon.fake.requests == []


async def test_input_tokens_answers_openais_shape(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = []
    daemon.fake.tokenized = inference_pb2.TokenizeResponse(tokens=[2, 9, 7, 5])
    response = await client.post(
        f"{PATH}/input_tokens",
        json={"model": "tiny", "input": "Hi"},
        headers={"x-blazar-slo": "batch"},
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"object": "response.input_tokens", "input_tokens": 4}
    (sent,) = daemon.fake.requests
    assert [m.content for m in sent.chat.messages] == ["Hi"] and sent.count_only
    assert daemon.fake.metadata[-1]["x-blazar-slo"] == "batch"
    missing = await client.post(f"{PATH}/input_tokens", json={"model": "nope", "input": "Hi"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")


@pytest.mark.parametrize(
    ("method", "path", "action"),
    [
        ("GET", "/resp_abc", "retrieve"),
        ("DELETE", "/resp_abc", "delete"),
        ("POST", "/resp_abc/cancel", "cancel"),
        ("GET", "/resp_abc/input_items", "list the input items of"),
    ],
)
async def test_stored_response_routes_say_nothing_is_stored(
    client: httpx.AsyncClient, method: str, path: str, action: str
) -> None:
    response = await client.request(method, f"{PATH}{path}")
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_id")
    assert "'resp_abc'" in error["message"] and "keeps no responses" in error["message"]
    assert f"none to {action}" in error["message"]


async def test_compacting_is_a_404_that_says_so(client: httpx.AsyncClient) -> None:
    """`responses.compact` posts to a path `{response_id}` also matches: it must not
    meet that route's 405 telling the client to use GET or DELETE."""
    response = await client.post(f"{PATH}/compact", json={"model": "tiny", "input": "Hi"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "Compacting a conversation" in error["message"]
    assert "not supported" in error["message"]
