"""The Anthropic dialect of the HTTP shim: its conversion both ways (pure, by table and
golden file), its routes against a fake `blazar.v1.Inference` servicer, and the
official `anthropic` client reading what the routes send.

Golden files under golden/anthropic/ pin the translation; regenerate them with
BLAZAR_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from google.protobuf import json_format

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import validation
from blazar.shim.anthropic import protocol
from blazar.shim.anthropic.convert import envelope, render, requests
from tests.unit import fake_inference
from tests.unit.fake_inference import (
    Daemon,
    Step,
    asgi_client,
    delta,
    fake_daemon,
    final,
    uvicorn_shim,
)

GOLDEN = Path(__file__).parent / "golden" / "anthropic"

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


def check_golden(name: str, document: Any) -> None:
    fake_inference.check_golden(GOLDEN / f"{name}.json", document)


def parse(model: type[validation.M], body: dict[str, Any]) -> validation.M:
    return validation.parse_body(model, json.dumps(body).encode())


def message_json(message: Any) -> dict[str, Any]:
    return {
        "type": type(message).DESCRIPTOR.full_name,
        "message": json_format.MessageToDict(message, preserving_proto_field_name=True),
    }


def calling(
    index: int, *, id: str = "", name: str = "", arguments: str = "", tokens: int = 1
) -> inference_pb2.Chunk:
    part = inference_pb2.ToolCallDelta(index=index, id=id, name=name, arguments=arguments)
    return inference_pb2.Chunk(delta=inference_pb2.Delta(tokens=tokens, tool_calls=[part]))


HI = [{"role": "user", "content": "Hi"}]


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 16, "messages": HI, **extra}


WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
HISTORY: list[Any] = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Oslo?"}]},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo", "unit": "c"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_2",
                "content": [{"type": "text", "text": "Station offline"}],
                "is_error": True,
            },
            {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}},
        ],
    },
]  # fmt: skip

# ---------------------------------------------------------------- golden: requests in

REQUEST_CASES: dict[str, dict[str, Any]] = {
    "minimal": body(),
    "system_string_and_sampling": body(
        system="Be brief.",
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        stop_sequences=["\n\nHuman:", ""],
        metadata={"user_id": "user-7"},
        service_tier="auto",
        stream=True,
    ),
    "system_blocks_and_merged_turns": body(
        system=[
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Answer in French."},
        ],
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "Still there?"}]},
            {"role": "assistant", "content": "Oui."},
            {"role": "assistant", "content": [{"type": "text", "text": "Toujours."}]},
            {"role": "user", "content": "Bye"},
        ],
        thinking={"type": "disabled"},
    ),
    "tool_history": body(messages=HISTORY, tools=[WEATHER]),
    "tool_choice_any_single": body(
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}
    ),
    "tool_choice_tool": body(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}),
    "tool_choice_none": body(tools=[{**WEATHER, "type": "custom", "strict": True}], tool_choice={"type": "none"}),
    "tool_choice_auto_parallel": body(
        tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": False}
    ),
    "output_config_format": body(
        output_config={
            "format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
        }
    ),
    "output_format_beta": body(output_format={"type": "json_schema", "schema": {"type": "object"}}),
    "output_config_format_beside_tools": body(
        tools=[WEATHER],
        output_config={"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REQUEST_CASES))
def test_request_translation_matches_golden(name: str) -> None:
    http_body = REQUEST_CASES[name]
    canonical = requests.messages_request(parse(protocol.MessagesRequest, http_body))
    check_golden(f"request_{name}", {"http_body": http_body, "canonical": message_json(canonical)})


def test_count_tokens_translation_matches_golden() -> None:
    http_body = {k: v for k, v in body(messages=HISTORY, tools=[WEATHER]).items()}
    http_body["system"] = "Be brief."
    http_body["tool_choice"] = {"type": "any"}
    del http_body["max_tokens"]
    canonical = requests.count_request(parse(protocol.CountTokensRequest, http_body))
    check_golden(
        "request_count_tokens", {"http_body": http_body, "canonical": message_json(canonical)}
    )
    # The same prompt and tools as the generation of the same body would have.
    generation = requests.messages_request(
        parse(protocol.MessagesRequest, {**http_body, "max_tokens": 5})
    )
    assert canonical.chat.messages == generation.messages
    assert canonical.chat.tools == generation.tools
    assert canonical.chat.tool_choice == generation.tool_choice


@pytest.mark.parametrize(
    ("messages", "continued", "last"),
    [
        ([*HI, {"role": "assistant", "content": "The answer is"}], True, "The answer is"),
        # Consecutive assistant messages are one turn, and that one is continued.
        (
            [
                *HI,
                {"role": "assistant", "content": "A"},
                {"role": "assistant", "content": [{"type": "text", "text": "B"}]},
            ],
            True,
            "A\nB",
        ),
        ([*HI, {"role": "assistant", "content": ""}], True, ""),
        ([*HI, {"role": "assistant", "content": "x"}, *HI], False, "Hi"),
    ],
)
def test_a_final_assistant_turn_is_continued(
    messages: list[Any], continued: bool, last: str
) -> None:
    """Anthropic's prefill: the conversation's final assistant turn is continued, and
    its count_tokens counts the same prompt."""
    request = requests.messages_request(parse(protocol.MessagesRequest, body(messages=messages)))
    assert request.continue_final_message is continued
    assert request.messages[-1].content == last
    counted = requests.count_request(
        parse(protocol.CountTokensRequest, {"model": "tiny", "messages": messages})
    )
    assert counted.chat.continue_final_message is continued


def test_sampling_not_sent_stays_unset() -> None:
    sampling = requests.messages_request(parse(protocol.MessagesRequest, body())).sampling
    for name in ("temperature", "top_p", "top_k", "seed"):
        assert not sampling.HasField(name), name
    assert sampling.max_tokens == 16


def test_max_tokens_zero_runs_to_one_token_to_prefill_the_prompt() -> None:
    """Anthropic's cache pre-warming: the engine prefills the prompt (and so keeps it in
    the slot's cache) and ends on its first token, which the answer leaves out."""
    sampling = requests.messages_request(parse(protocol.MessagesRequest, body(max_tokens=0)))
    assert sampling.sampling.max_tokens == requests.PREWARM_TOKENS == 1


@pytest.mark.parametrize(
    ("header", "user_id", "session"),
    [
        ("", None, ""),
        ("", "user-7", "user-7"),
        ("s-1", "user-7", "s-1"),
        (
            "",
            "u" * 300,
            "sha256:8b5089b44d9fefeafc563a34f6cb19fbdbe3814023622cb463bb4a74caba1c19",
        ),  # past a session key's 256 bytes: its digest
    ],
)
def test_the_session_is_the_header_else_metadata_user_id(
    header: str, user_id: str | None, session: str
) -> None:
    parsed = parse(protocol.MessagesRequest, body(metadata={"user_id": user_id}))
    assert requests.messages_request(parsed, session=header).session == session


# ---------------------------------------------------------------- validation by name

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}

INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "max_tokens missing": (
        {"model": "tiny", "messages": HI},
        "Missing required parameter: 'max_tokens'",
    ),
    "max_tokens negative": (body(max_tokens=-1), "'max_tokens'"),
    "temperature over 1": (body(temperature=1.5), "'temperature'"),
    "no messages": (body(messages=[]), "'messages'"),
    "bad role": (body(messages=[{"role": "tool", "content": "x"}]), "'messages[0].role'"),
    "image": (
        body(messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, IMAGE]}]),
        "'messages[0].content[1]' is a 'image' block, which is not supported: Blazar serves "
        "text-only models",
    ),
    "document": (
        body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
        "'document' block, which is not supported: Blazar reads no documents",
    ),
    "text document": (
        body(messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Sky: blue."}},
        ]}]),
        "send a text document's text in a text block",
    ),
    "search result": (
        body(messages=[{"role": "user", "content": [
            {"type": "search_result", "source": "https://a.example", "title": "A",
             "content": [{"type": "text", "text": "Blue."}]},
        ]}]),
        "Blazar cites no search results; send a result's text in a text block",
    ),
    "image in a tool result": (
        body(
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}
            ]
        ),
        "'messages[0].content[0].content[0]' is a 'image' block",
    ),
    "thinking block": (
        body(
            messages=[
                *HI,
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm", "signature": "x"}]},
                *HI,
            ]
        ),
        "'messages[1].content[0]' is a 'thinking' block, which is not supported: Blazar's models do not think",
    ),
    "server tool block": (
        body(messages=[{"role": "user", "content": [{"type": "web_search_tool_result", "tool_use_id": "s"}]}]),
        "Blazar runs no server tools",
    ),
    "unknown block": (
        body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]),
        "not a content block type Blazar knows",
    ),
    "block without a type": (
        body(messages=[{"role": "user", "content": [{"text": "Hi"}]}]),
        "Invalid value for 'messages[0].content[0]': a content block is an object whose 'type'",
    ),
    "result block without a type": (
        body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": ["x"]}]}]),
        "Invalid value for 'messages[0].content[0].content[0]': a content block is an object whose 'type'",
    ),
    "empty content": (body(messages=[{"role": "user", "content": []}]), "at least one content block"),
    "citations": (
        body(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{"type": "char_location"}]}]}]),
        "'messages[0].content[0].citations' are not supported",
    ),
    "prefill ending in whitespace": (
        body(messages=[*HI, {"role": "assistant", "content": "The answer is "}]),
        "final assistant content cannot end with trailing whitespace",
    ),
    "prefill with a call": (
        body(messages=[*HI, {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}},
        ]}], tools=[WEATHER]),
        "'messages[1]' is a final assistant turn with tool_use blocks",
    ),
    "prefill with a forced call": (
        body(messages=[*HI, {"role": "assistant", "content": "{"}], tools=[WEATHER],
             tool_choice={"type": "any"}),
        "a forced tool call (tool_choice 'any') cannot continue",
    ),
    "prefill with an output format": (
        body(messages=[*HI, {"role": "assistant", "content": "{"}],
             output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}),
        "an output format would shape only its continuation",
    ),
    "tool_use in a user turn": (
        body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
        "only assistant turns make tool calls",
    ),
    "a call code execution made": (
        body(
            messages=[
                *HI,
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use", "id": "t", "name": "f", "input": {},
                            "caller": {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"},
                        }
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
            ]
        ),
        "'messages[1].content[0].caller' 'code_execution_20250825' is not supported",
    ),
    "tool_result in an assistant turn": (
        body(
            messages=[
                *HI,
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
                *HI,
            ]
        ),
        "tool results come in user turns",
    ),
    "tool_result answering no call": (
        body(
            messages=[
                *HI,
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]},
            ]
        ),
        "'messages[2].content[0].tool_use_id' 'toolu_2' matches no tool_use block",
    ),
    "tool_result before its call": (
        body(
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                *HI,
            ]
        ),
        "'messages[0].content[0].tool_use_id' 'toolu_1' matches no tool_use block",
    ),
    "thinking": (body(thinking={"type": "enabled", "budget_tokens": 2048}), "'thinking' is not supported"),
    "thinking between tools": (body(thinking={"type": "between_tools"}), "'thinking' is not supported"),
    "mcp_servers": (body(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), "'mcp_servers'"),
    "container": (body(container="container_1"), "'container' is not supported"),
    "context_management": (
        body(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}),
        "'context_management.edits[0]' 'clear_tool_uses_20250919' is not supported",
    ),
    "inference_geo": (body(inference_geo="us"), "'inference_geo' 'us' is not supported"),
    "billing_policy": (
        body(billing_policy={"type": "billing_policy", "bill_to": "user_profile"}),
        "'billing_policy.bill_to' 'user_profile' is not supported",
    ),
    "fallback_credit_token": (body(fallback_credit_token="fct_1"), "'fallback_credit_token' is not"),
    "effort": (body(output_config={"effort": "high"}), "'output_config.effort' is not supported"),
    "priority tier": (body(service_tier="priority"), "'service_tier' 'priority' is not supported"),
    "fast": (body(speed="fast"), "'speed' 'fast' is not supported"),
    "thread": (body(thread={"type": "create"}), "'thread' is not supported"),
    "thread by id": (body(thread="thr_1"), "'thread' is not supported"),
    "thread continued": (
        body(thread={"type": "continue", "previous_message_id": "msg_1"}),
        "'thread' is not supported",
    ),
    "compaction": (body(compaction={"type": "summarize"}), "'compaction' is not supported"),
    "diagnostics": (body(diagnostics={"previous_message_id": None}), "'diagnostics' is not supported"),
    "fallbacks": (body(fallbacks=[{"model": "other"}]), "'fallbacks' is not supported"),
    "eager input streaming": (
        body(tools=[{**WEATHER, "eager_input_streaming": True}]),
        "'tools[0].eager_input_streaming' is not supported",
    ),
    "server tool": (
        body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "'tools[0]' is the server tool 'web_search_20250305'",
    ),
    "tool without schema": (
        body(tools=[{"name": "f"}]),
        "Missing required parameter: 'tools[0].input_schema'",
    ),
    "input_examples": (body(tools=[{**WEATHER, "input_examples": [{}]}]), "'tools[0].input_examples'"),
    "defer_loading": (body(tools=[{**WEATHER, "defer_loading": True}]), "'tools[0].defer_loading'"),
    "code execution callers only": (
        body(tools=[{**WEATHER, "allowed_callers": ["code_execution_20250825"]}]),
        "'tools[0].allowed_callers' without \"direct\"",
    ),
    "tool_choice without tools": (body(tool_choice={"type": "any"}), "'tool_choice' 'any' needs 'tools'"),
    "tool_choice tool without name": (
        body(tools=[WEATHER], tool_choice={"type": "tool"}),
        "Missing required parameter: 'tool_choice.name'",
    ),
    "tool_choice names no tool": (
        body(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_time"}),
        "names the tool 'get_time', which is not among the tools",
    ),
    "tool_choice name without tool type": (
        body(tools=[WEATHER], tool_choice={"type": "auto", "name": "get_weather"}),
        "'tool_choice.name' goes only with type 'tool'",
    ),
    "bad tool_choice type": (body(tools=[WEATHER], tool_choice={"type": "some"}), "'tool_choice.type'"),
    "two output formats": (
        body(
            output_config={"format": {"type": "json_schema", "schema": {}}},
            output_format={"type": "json_schema", "schema": {}},
        ),
        "Send one of 'output_config.format' and 'output_format'",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(INVALID))
async def test_invalid_requests_are_400_naming_the_field(
    name: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    http_body, fragment = INVALID[name]
    daemon.fake.scripts["tiny"] = [delta("x"), final()]
    response = await client.post("/v1/messages", json=http_body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"], error
    assert error["request_id"] == response.headers["request-id"]
    assert not daemon.fake.requests, "a refused request never reaches the daemon"


async def test_a_tool_the_model_may_call_directly_is_offered(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = [delta("x"), final()]
    callers = ["direct", "code_execution_20250825"]
    response = await client.post(
        "/v1/messages", json=body(tools=[{**WEATHER, "allowed_callers": callers}])
    )
    assert response.status_code == 200, response.text
    (sent,) = daemon.fake.requests
    assert [tool.name for tool in sent.tools] == ["get_weather"]


async def test_a_call_the_model_made_directly_stays_in_the_history(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = [delta("x"), final()]
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
    messages = [
        *HI,
        {"role": "assistant", "content": [{**call, "caller": {"type": "direct"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "9"}]},
    ]
    response = await client.post("/v1/messages", json=body(tools=[WEATHER], messages=messages))
    assert response.status_code == 200, response.text
    (sent,) = daemon.fake.requests
    assert [c.id for m in sent.messages for c in m.tool_calls] == ["t1"]


async def test_a_body_that_is_not_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/messages", content=b"{nope")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_fields_that_change_nothing_are_accepted(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Cache marks (Blazar caches every prefix), standard tiers, strict tools, any
    region, billing oneself, clearing thinking (there is none; Claude Code asks on every
    request): accepted, as they ask for nothing Blazar does not do."""
    daemon.fake.scripts["tiny"] = [delta("ok"), final()]
    response = await client.post(
        "/v1/messages",
        json=body(
            cache_control={"type": "ephemeral"},
            service_tier="standard_only",
            speed="standard",
            thinking={"type": "disabled"},
            tools=[{**WEATHER, "strict": True, "cache_control": {"type": "ephemeral"}}],
            inference_geo="global",
            billing_policy={"type": "billing_policy", "bill_to": "self"},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            fallback_credit_token=None,
        ),
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("field", ["top_q", "response_format", "max_tokens_to_sample"])
async def test_an_unknown_top_level_field_is_a_400_naming_it(
    path: str, field: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """As Anthropic answers it, in its words: a field Blazar does not know would do
    nothing, so it is refused rather than dropped."""
    daemon.fake.scripts["tiny"] = [delta("ok"), final()]
    request = (
        body(**{field: 1})
        if path == "/v1/messages"
        else {"model": "tiny", "messages": HI, field: 1}
    )
    response = await client.post(path, json=request)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": f"{field}: Extra inputs are not permitted",
    }
    assert not daemon.fake.requests


async def test_every_unknown_field_is_named_at_once_and_a_null_one_is_not_sent(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = [delta("ok"), final()]
    response = await client.post("/v1/messages", json=body(top_q=1, frobnicate=2, typo=None))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        "frobnicate: Extra inputs are not permitted; top_q: Extra inputs are not permitted"
    )
    response = await client.post("/v1/messages", json=body(typo=None))
    assert response.status_code == 200, response.text


async def test_count_tokens_refuses_what_only_a_generation_takes(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Anthropic's count_tokens has no `max_tokens` nor `stream`: extra there too."""
    response = await client.post(
        "/v1/messages/count_tokens", json={"model": "tiny", "messages": HI, "max_tokens": 8}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "max_tokens: Extra inputs are not permitted"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(
    "thinking", [{"type": "adaptive"}, {"type": "adaptive", "display": "omitted"}]
)
async def test_adaptive_thinking_is_the_models_choice_not_to_think(
    path: str, thinking: dict[str, Any], daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Under `adaptive` the model decides whether to think (the default of Anthropic's
    newer models and of the clients written for them), and Blazar's never do: taken."""
    daemon.fake.scripts["tiny"] = [delta("ok"), final()]
    request = body(thinking=thinking)
    if path != "/v1/messages":
        del request["max_tokens"]  # count_tokens has none
    response = await client.post(path, json=request)
    assert response.status_code == 200, response.text
    if path == "/v1/messages":
        assert [block["type"] for block in response.json()["content"]] == ["text"]


# ---------------------------------------------------------------- golden: responses out

CALLS: list[Step] = [
    calling(0, id="call_a", name="get_weather"),
    calling(0, arguments='{"city": "Pa'),
    calling(0, arguments='ris", "unit": "c"}', tokens=4),
    calling(1, id="call_b", name="get_weather", arguments='{"city": "Oslo", "unit": "f"}'),
]
RESPONSE_CASES: dict[str, tuple[dict[str, Any], list[Step]]] = {
    "text": (body(), [delta("Hel"), delta(""), delta("lo"), final(prompt=12, completion=3, cached=8)]),
    "max_tokens": (body(max_tokens=2), [delta("a"), delta("b"), final(inference_pb2.FINISH_REASON_LENGTH, completion=2)]),
    # Stopped before max_tokens by the end of the context, which max_tokens does not
    # reserve: Anthropic's current models say so.
    "context_window": (body(max_tokens=4096), [delta("a"), final(inference_pb2.FINISH_REASON_LENGTH, completion=1)]),
    "empty": (body(), [final(completion=1)]),
    "tool_calls": (
        body(tools=[WEATHER], tool_choice={"type": "any"}),
        [*CALLS, final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=2)],
    ),
    "text_then_tool_call": (
        body(tools=[WEATHER]),
        [
            delta("Let me check."),
            calling(0, id="call_a", name="get_weather", arguments='{"city":"Paris","unit":"c"}'),
            final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=9, tool_calls=1),
        ],
    ),
    # The second call was cut short by max_tokens: only the whole one goes out.
    "tool_call_cut_short": (
        body(max_tokens=9, tools=[WEATHER], tool_choice={"type": "any"}),
        [*CALLS[:3], calling(1, id="call_b", name="get_weather", arguments='{"city": "Os'),
         final(inference_pb2.FINISH_REASON_LENGTH, completion=9, tool_calls=1)],
    ),
    "tool_without_arguments": (
        body(tools=[{"name": "now", "input_schema": {"type": "object"}}], tool_choice={"type": "any"}),
        [calling(0, id="call_n", name="now", arguments="{}"),
         final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=4, tool_calls=1)],
    ),
    # max_tokens 0 pre-warms the cache: whatever the one token the engine ran to, the
    # answer holds nothing and stops on max_tokens.
    "prewarm": (body(max_tokens=0), [delta("Hel"), final(inference_pb2.FINISH_REASON_STOP, completion=1, cached=4)]),
    "prewarm_tool_call": (
        body(max_tokens=0, tools=[{"name": "now", "input_schema": {"type": "object"}}], tool_choice={"type": "any"}),
        [calling(0, id="call_n", name="now", arguments="{}"),
         final(inference_pb2.FINISH_REASON_TOOL_CALLS, completion=1, tool_calls=1)],
    ),
}  # fmt: skip
STREAM_FAILURES: dict[str, list[Step]] = {
    "error_midway": [delta("Hel"), errors.Unavailable("The replica serving 'tiny' stopped.")],
    "truncated": [delta("Hel")],
}


def sse_events(text: str) -> list[dict[str, Any]]:
    """Parse Anthropic's SSE strictly: `event:` and `data:` lines, the event's name
    equal to its data's `type`, each event ended by a blank line."""
    assert text.endswith("\n\n"), text
    events = []
    for block in text[:-2].split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == head[len("event: ") :]
        events.append(event)
    return events


def normalise(document: Any, request_id: str) -> Any:
    """The per-request ids, which the request-id header gives, as placeholders."""
    rendered = json.dumps(document)
    assert re.fullmatch("[0-9a-f]{32}", request_id)
    return json.loads(rendered.replace(request_id, "<request-id>"))


@pytest.mark.parametrize("name", sorted(RESPONSE_CASES))
async def test_response_and_stream_match_golden(
    name: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    http_body, script = RESPONSE_CASES[name]
    daemon.fake.scripts["tiny"] = script
    whole = await client.post("/v1/messages", json=http_body)
    assert whole.status_code == 200, whole.text
    assert whole.headers["content-type"] == "application/json"
    assert whole.headers["request-id"] == whole.headers["x-request-id"]
    streamed = await client.post("/v1/messages", json={**http_body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    check_golden(
        f"response_{name}",
        {
            "http_body": http_body,
            "chunks": fake_inference.script_json(script),
            "json": normalise(whole.json(), whole.headers["request-id"]),
            "sse": normalise(events, streamed.headers["request-id"]),
        },
    )
    # The stream, accumulated, is the whole answer.
    assert accumulate(events) == whole.json() | {"id": events[0]["message"]["id"]}


def accumulate(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The message a stream describes, built as Anthropic's clients build it."""
    names = [e["type"] for e in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    message = dict(events[0]["message"])
    content: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    open_blocks: set[int] = set()
    for event in events[2:-2]:
        index = event["index"]
        if event["type"] == "content_block_start":
            assert index == len(content) and not open_blocks
            content.append(dict(event["content_block"]))
            open_blocks.add(index)
        elif event["type"] == "content_block_delta":
            assert index in open_blocks
            delta_ = event["delta"]
            if delta_["type"] == "text_delta":
                content[index]["text"] += delta_["text"]
            else:
                partial[index] = partial.get(index, "") + delta_["partial_json"]
        else:
            assert event["type"] == "content_block_stop"
            open_blocks.remove(index)
            if index in partial:
                content[index]["input"] = json.loads(partial[index])
    assert not open_blocks
    message["content"] = content
    message.update(events[-2]["delta"])
    message["usage"] = events[-2]["usage"]
    return message


async def test_message_start_holds_the_prompts_usage_when_the_daemon_told_it(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """As Anthropic's does: clients that read the input tokens from message_start alone
    (LangChain's streaming usage, for one) saw 0. The daemon tells the prompt's tokens
    with the first chunk; the end's usage says the same."""
    http_body, script = RESPONSE_CASES["text"]
    daemon.fake.scripts["tiny"] = script
    daemon.fake.replica, daemon.fake.prefix_reused, daemon.fake.prompt_tokens = 0, 3, 8
    try:
        streamed = await client.post("/v1/messages", json={**http_body, "stream": True})
    finally:
        daemon.fake.replica = daemon.fake.prefix_reused = daemon.fake.prompt_tokens = None
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["x-blazar-prompt-tokens"] == "8"
    usage = sse_events(streamed.text)[0]["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (5, 3)
    assert (usage["output_tokens"], usage["cache_creation_input_tokens"]) == (0, 0)


@pytest.mark.parametrize("name", sorted(STREAM_FAILURES))
async def test_a_stream_failing_midway_ends_with_an_error_event(
    name: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    script = STREAM_FAILURES[name]
    daemon.fake.scripts["tiny"] = script
    streamed = await client.post("/v1/messages", json=body(stream=True))
    assert streamed.status_code == 200
    events = sse_events(streamed.text)
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["type"] == "overloaded_error"
    check_golden(
        f"stream_{name}",
        {
            "chunks": fake_inference.script_json(script),
            "sse": normalise(events, streamed.headers["request-id"]),
        },
    )


def test_usage_counts_the_prompt_once() -> None:
    """Anthropic's total input is input + cache read + cache creation: the prompt."""
    chunk = final(prompt=100, completion=5, cached=64).final
    counted = render.usage(chunk)
    assert counted == {
        "input_tokens": 36,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
    }
    total = (
        counted["input_tokens"]
        + counted["cache_read_input_tokens"]
        + counted["cache_creation_input_tokens"]
    )
    assert total == 100


@pytest.mark.parametrize(
    ("reason", "max_tokens", "stop_reason"),
    [
        (inference_pb2.FINISH_REASON_STOP, 16, "end_turn"),
        (inference_pb2.FINISH_REASON_LENGTH, 3, "max_tokens"),
        (inference_pb2.FINISH_REASON_LENGTH, 4, "model_context_window_exceeded"),
        (inference_pb2.FINISH_REASON_TOOL_CALLS, 16, "tool_use"),
    ],
)
def test_stop_reasons(reason: int, max_tokens: int, stop_reason: str) -> None:
    """`final` generated 3 tokens: a length stop before max_tokens is the context's end."""
    assert (
        render.stop_reason(final(reason, completion=3).final, max_tokens=max_tokens) == stop_reason
    )


def test_a_stop_sequence_is_named() -> None:
    ended = final(inference_pb2.FINISH_REASON_STOP).final
    ended.stop_sequence = "\n\nHuman:"
    assert (render.stop_reason(ended, max_tokens=16), render.stop_sequence(ended)) == (
        "stop_sequence",
        "\n\nHuman:",
    )


# ---------------------------------------------------------------- errors

ERRORS: list[tuple[errors.BlazarError, int, str]] = [
    (errors.InvalidRequest("Bad."), 400, "invalid_request_error"),
    (errors.RequestTooLarge("Too big."), 413, "request_too_large"),
    (errors.Unauthenticated("Who?"), 401, "authentication_error"),
    (errors.PermissionDenied("No."), 403, "permission_error"),
    (errors.ModelNotFound.of("nope"), 404, "not_found_error"),
    (errors.QueueFull.of(lane="tiny", policy="p", max_queue_depth=0, retry_after_s=2.2), 429, "rate_limit_error"),
    (errors.Unavailable("Draining."), 529, "overloaded_error"),
    (errors.DeadlineExceeded("Late."), 504, "timeout_error"),
    (errors.BlazarError("Boom."), 500, "api_error"),
]  # fmt: skip


@pytest.mark.parametrize(("err", "status", "kind"), ERRORS, ids=lambda x: str(x)[:20])
def test_error_envelope(err: errors.BlazarError, status: int, kind: str) -> None:
    rendered = envelope.error_response(err, request_id="r1")
    assert rendered.status == status
    assert rendered.body == {
        "type": "error",
        "error": {"type": kind, "message": err.message},
        "request_id": "r1",
    }
    assert ("retry-after" in rendered.headers) == (status == 429)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "at_least", "message"),
    [
        (3000, 16, False, "prompt is too long: 3000 tokens > 2048 maximum"),
        (3000, 16, True, "prompt is too long: at least 3000 tokens > 2048 maximum"),
        (
            2000,
            100,
            False,
            "input length and `max_tokens` exceed context limit: 2000 + 100 > 2048, "
            "decrease input length or `max_tokens` and try again",
        ),
        # A prompt that fills the context exactly is not over it: what is to be
        # generated is (never "2048 tokens > 2048 maximum").
        (
            2048,
            16,
            False,
            "input length and `max_tokens` exceed context limit: 2048 + 16 > 2048, "
            "decrease input length or `max_tokens` and try again",
        ),
    ],
)
def test_a_request_over_the_context_is_told_in_anthropics_words(
    prompt: int, max_tokens: int, at_least: bool, message: str
) -> None:
    """Clients tell an overflow by these words: langchain-anthropic's
    ContextOverflowError by "prompt is too long", LiteLLM's ContextWindowExceededError
    by that or "exceed context limit"."""
    err = errors.ContextLengthExceeded.of(
        prompt_tokens=prompt, max_tokens=max_tokens, context_length=2048, at_least=at_least
    )
    rendered = envelope.error_response(err)
    assert rendered.status == 400
    assert rendered.body["error"] == {"type": "invalid_request_error", "message": message}


def test_tool_errors_name_anthropics_field() -> None:
    err = errors.InvalidRequest(
        "'tools[0].parameters' is not a valid JSON Schema at its top: bad.",
        metadata={errors.FIELD_KEY: "tools[0].parameters"},
    )
    message = envelope.error_response(err).body["error"]["message"]
    assert message == "'tools[0].input_schema' is not a valid JSON Schema at its top: bad."


@pytest.mark.parametrize("stream", [False, True])
async def test_daemon_errors_before_the_first_chunk_keep_their_status(
    stream: bool, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.QueueFull.of(lane="tiny", policy="tight", max_queue_depth=0, retry_after_s=2.2)
    ]
    response = await client.post("/v1/messages", json=body(stream=stream))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert response.json()["error"]["type"] == "rate_limit_error"
    missing = await client.post("/v1/messages", json=body(model="nope", stream=stream))
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "type": "not_found_error",
        "message": "The model 'nope' does not exist.",
    }
    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded.of(prompt_tokens=3000, max_tokens=16, context_length=2048)
    ]
    overflow = await client.post("/v1/messages", json=body(stream=stream))
    assert overflow.status_code == 400
    assert overflow.json()["error"]["message"] == "prompt is too long: 3000 tokens > 2048 maximum"


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("POST", "/v1/messages/batches", 404, "not_found_error"),
        ("GET", "/v1/messages/count_tokens/x", 404, "not_found_error"),
        ("GET", "/v1/messages", 405, "invalid_request_error"),
        ("DELETE", "/v1/messages/count_tokens", 405, "invalid_request_error"),
    ],
)
async def test_unrouted_messages_paths_answer_in_anthropics_envelope(
    client: httpx.AsyncClient, method: str, path: str, status: int, kind: str
) -> None:
    response = await client.request(method, path)
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert path in error["error"]["message"]
    assert error["request_id"] == response.headers["request-id"]
    # Other paths keep OpenAI's envelope.
    other = await client.post("/v1/messagesx")
    assert other.status_code == 404 and "type" not in other.json()


# ---------------------------------------------------------------- count_tokens


async def test_count_tokens_asks_tokenize_for_the_chat(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = []
    daemon.fake.tokenized = inference_pb2.TokenizeResponse(tokens=[2, 105, 2364, 107], model="tiny")
    count = {"model": "tiny", "system": "Be brief.", "messages": HI, "tools": [WEATHER]}
    response = await client.post("/v1/messages/count_tokens", json=count)
    assert response.status_code == 200, response.text
    assert response.json() == {"input_tokens": 4}
    assert response.headers["request-id"]
    (sent,) = daemon.fake.requests
    assert isinstance(sent, inference_pb2.TokenizeRequest)
    # Only the count comes back: a long conversation's tokens could outgrow one answer.
    assert sent.model == "tiny" and sent.HasField("chat") and sent.count_only
    assert [m.role for m in sent.chat.messages] == ["system", "user"]
    assert [t.name for t in sent.chat.tools] == ["get_weather"]
    missing = await client.post("/v1/messages/count_tokens", json={**count, "model": "nope"})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    refused = await client.post(
        "/v1/messages/count_tokens", json={**count, "thinking": {"type": "enabled"}}
    )
    assert refused.status_code == 400 and "'thinking'" in refused.json()["error"]["message"]


# ---------------------------------------------------------------- the official client


async def test_the_official_client_reads_messages_streams_and_tool_use(daemon: Daemon) -> None:
    async with uvicorn_shim(daemon.target) as base:
        sdk = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
        try:
            daemon.fake.scripts["tiny"] = [delta("Hel"), delta("lo"), final(prompt=9, cached=4)]
            whole = await sdk.messages.create(model="tiny", max_tokens=8, messages=HI)
            assert whole.content[0].type == "text" and whole.content[0].text == "Hello"
            assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
            assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens) == (5, 4)
            assert whole._request_id and whole.id == f"msg_{whole._request_id}"

            daemon.fake.scripts["tiny"] = [
                *CALLS,
                final(
                    inference_pb2.FINISH_REASON_TOOL_CALLS, prompt=20, completion=9, tool_calls=2
                ),
            ]
            async with sdk.messages.stream(
                model="tiny",
                max_tokens=64,
                messages=HI,
                tools=[WEATHER],  # type: ignore[list-item]
                tool_choice={"type": "any"},
            ) as stream:
                kinds = [event.type async for event in stream]
                streamed = await stream.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert streamed.stop_reason == "tool_use"
            uses = [b for b in streamed.content if b.type == "tool_use"]
            assert [(u.id, u.name, u.input) for u in uses] == [
                ("call_a", "get_weather", {"city": "Paris", "unit": "c"}),
                ("call_b", "get_weather", {"city": "Oslo", "unit": "f"}),
            ]
            assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (20, 9)

            # The answer goes back in the history as the client built it.
            daemon.fake.scripts["tiny"] = [delta("Sunny."), final()]
            history: list[Any] = [
                *HI,
                {"role": "assistant", "content": streamed.content},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "call_a", "content": "21"},
                        {"type": "tool_result", "tool_use_id": "call_b", "content": "3"},
                    ],
                },
            ]
            after = await sdk.messages.create(model="tiny", max_tokens=8, messages=history)
            assert after.content[0].type == "text" and after.content[0].text == "Sunny."
            sent = daemon.fake.requests[-1]
            assert [(m.role, m.tool_call_id, m.name) for m in sent.messages] == [
                ("user", "", ""),
                ("assistant", "", ""),
                ("tool", "call_a", "get_weather"),
                ("tool", "call_b", "get_weather"),
            ]
            assert json.loads(sent.messages[1].tool_calls[1].arguments) == {
                "city": "Oslo",
                "unit": "f",
            }

            daemon.fake.tokenized = inference_pb2.TokenizeResponse(tokens=[1, 2, 3])
            counted = await sdk.messages.count_tokens(model="tiny", messages=HI)
            assert counted.input_tokens == 3
        finally:
            await sdk.close()


async def test_the_official_client_raises_anthropics_errors(daemon: Daemon) -> None:
    async with uvicorn_shim(daemon.target) as base:
        sdk = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
        try:
            daemon.fake.scripts["tiny"] = [
                errors.SloUnattainable.of(
                    lane="tiny",
                    policy="interactive",
                    predicted_ttft_s=3.5,
                    ttft_target_s=2.0,
                    retry_after_s=1.5,
                )
            ]
            for stream in (False, True):
                with pytest.raises(anthropic.RateLimitError) as refused:
                    await sdk.messages.create(
                        model="tiny", max_tokens=8, messages=HI, stream=stream
                    )
                assert refused.value.status_code == 429
                assert refused.value.response.headers["retry-after"] == "2"
                assert refused.value.request_id
            with pytest.raises(anthropic.NotFoundError):
                await sdk.messages.create(model="nope", max_tokens=8, messages=HI)
            with pytest.raises(anthropic.BadRequestError) as bad:
                await sdk.messages.create(
                    model="tiny",
                    max_tokens=8,
                    messages=HI,
                    extra_body={"thinking": {"type": "enabled", "budget_tokens": 2048}},
                )
            assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            # Mid-stream: the client raises on the `error` event.
            daemon.fake.scripts["tiny"] = [delta("Hel"), errors.Unavailable("Engine lost.")]
            with pytest.raises(anthropic.APIStatusError) as midway:
                async with sdk.messages.stream(model="tiny", max_tokens=8, messages=HI) as s:
                    async for _ in s:
                        pass
            assert "Engine lost." in str(midway.value)
        finally:
            await sdk.close()


async def test_a_thread_is_refused_so_the_tool_runner_sends_the_whole_conversation(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """The `anthropic` client's tool runner asks for a server-held thread (`thread:
    {"type": "create"}`) and then sends only each new turn. Blazar holds none, so it
    refuses `thread` with the `error_code` on which the runner sends the whole
    conversation without it instead of a turn out of its context."""
    daemon.fake.scripts["tiny"] = [
        *CALLS,
        final(inference_pb2.FINISH_REASON_TOOL_CALLS, tool_calls=2),
    ]
    for thread in ({"type": "create"}, "thr_1"):
        response = await client.post("/v1/messages", json=body(thread=thread))
        assert response.status_code == 400
        details = response.json()["error"]["details"]
        assert details == {"error_code": "thread_unsupported_request"}
    assert not daemon.fake.requests

    @anthropic.beta_async_tool
    async def get_weather(city: str, unit: str) -> str:
        """The weather in a city.

        Args:
            city: the city
            unit: c or f
        """
        return f"Sunny in {city}"

    async with uvicorn_shim(daemon.target) as base:
        sdk = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
        try:
            runner = sdk.beta.messages.tool_runner(
                model="tiny", max_tokens=64, messages=HI, tools=[get_weather], max_iterations=2
            )
            replies = [reply async for reply in runner]
        finally:
            await sdk.close()
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"]
    # Both turns reached the daemon whole: the second carries the first's calls and
    # their results.
    assert len(daemon.fake.requests) == 2
    second = daemon.fake.requests[-1]
    assert [(m.role, m.tool_call_id) for m in second.messages] == [
        ("user", ""),
        ("assistant", ""),
        ("tool", "call_a"),
        ("tool", "call_b"),
    ]
    assert [m.content for m in second.messages[2:]] == ["Sunny in Paris", "Sunny in Oslo"]


def test_a_system_message_stays_a_system_turn_where_it_stands() -> None:
    """The `anthropic` client (2.15) types `{"role": "system"}` messages
    (`SystemMessageParam` in `MessageParam`), and its tool runner appends them mid
    conversation; they are kept, in place, rather than refused."""
    sent: list[anthropic.types.MessageParam] = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": [{"type": "text", "text": "Tools changed."}]},
        {"role": "user", "content": "c"},
    ]
    body = parse(
        protocol.MessagesRequest,
        {"model": "tiny", "max_tokens": 4, "system": "Be brief.", "messages": sent},
    )
    chat = requests.messages_request(body)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "a"),
        ("assistant", "b"),
        ("system", "Tools changed."),
        ("user", "c"),
    ]
