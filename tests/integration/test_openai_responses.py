"""The Responses API end to end: the official `openai` client (`responses.create`,
`responses.stream`) -> shim -> daemon -> a real engine worker with the bundled
Gemma 3 270M.

As in test_openai_tools, nothing relies on what the weak base model chooses to write,
only on what Blazar guarantees: the shapes and order of the output and events, a
forced call whose arguments validate (under a budget its grammar cannot outrun), a
`text.format` schema that validates, usage that counts the reused prompt, and errors
that name their parameter. One daemon (shared with the tool-calling modules), few
tokens per request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.engine import schema as schemas
from blazar.engine import tools as engine_tools
from tests.integration import pinning
from tests.integration.harness import (
    TOOLS_CONTEXT_PER_SLOT,
    TOOLS_LANE,
    TOOLS_SLOTS,
    Daemon,
    concurrently,
)
from tests.integration.test_openai_tools import QUESTION, TEMPERATURES, TIME_SCHEMA

pytestmark = pytest.mark.slow

LANE = TOOLS_LANE
CONTEXT_PER_SLOT = TOOLS_CONTEXT_PER_SLOT
TRIES = 20
# test_openai_tools' tools in the Responses API's flat shape, but for the forecast's
# unbounded `days` integer: the chat test covers it, and a model that writes long
# numbers at a high temperature makes a forced turn run to its budget.
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
FLAT_TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "The time now in a time zone.",
        "parameters": TIME_SCHEMA,
        "strict": True,
    },
]
INSTRUCTIONS = QUESTION[0]["content"]
ASK = QUESTION[1]["content"]
# Forced calls answer this one: the call the model then likes best (get_time) is its
# shortest, which keeps 40 forced turns cheap; either tool's call must validate.
ASK_TIME = "What time is it in Tokyo now?"


@pytest.fixture(scope="module")
def daemon(tools_daemon: Daemon) -> Daemon:
    return tools_daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    sdk = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused", max_retries=0)
    yield sdk
    sdk.close()


def check_text_response(response: Any, *, max_output_tokens: int) -> None:
    """A text answer's response object, whatever the text."""
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.model == LANE
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"]
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert 0 <= usage.output_tokens <= max_output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # Required by the SDK's ResponseUsage: the implicit cache writes nothing on request.
    assert usage.input_tokens_details.cache_write_tokens == 0


def test_text_input(client: openai.OpenAI) -> None:
    response = client.responses.create(model=LANE, input=ASK, max_output_tokens=8)
    check_text_response(response, max_output_tokens=8)


def test_items_with_instructions(client: openai.OpenAI) -> None:
    items: Any = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello! How can I help?"}],
        },
        {"role": "user", "content": ASK},
    ]
    bare = client.responses.create(model=LANE, input=items, max_output_tokens=8)
    instructed = client.responses.create(
        model=LANE, input=items, instructions=INSTRUCTIONS, max_output_tokens=8
    )
    for response in (bare, instructed):
        check_text_response(response, max_output_tokens=8)
    # The instructions, and every item, reach the prompt.
    assert instructed.instructions == INSTRUCTIONS
    assert bare.usage is not None and instructed.usage is not None
    assert instructed.usage.input_tokens > bare.usage.input_tokens
    plain = client.responses.create(model=LANE, input=ASK, max_output_tokens=1)
    assert plain.usage is not None and bare.usage.input_tokens > plain.usage.input_tokens


def test_streaming_event_order(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=LANE, input=ASK, max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # However many deltas the model's text takes (none, if it ends at once).
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        kinds[-1],
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    check_text_response(final, max_output_tokens=8)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text


SKY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"sky": {"enum": ["clear", "cloudy", "rain"]}, "warm": {"type": "boolean"}},
    "required": ["sky", "warm"],
    "additionalProperties": False,
}


def test_text_format_json_schema_validates_20_of_20(client: openai.OpenAI) -> None:
    tokens = pinning.budget(schemas.grammar(SKY_SCHEMA))
    assert tokens is not None
    options: dict[str, Any] = {
        "model": LANE,
        "input": "Describe the weather in Paris as JSON.",
        "text": {"format": {"type": "json_schema", "name": "sky", "schema": SKY_SCHEMA}},
        "max_output_tokens": tokens,
    }

    def attempt(i: int) -> None:
        temperature = TEMPERATURES[i % len(TEMPERATURES)]
        if i % 2:
            with client.responses.stream(**options, temperature=temperature) as stream:
                response = stream.get_final_response()
        else:
            response = client.responses.create(**options, temperature=temperature)
        assert response.status == "completed", (i, response)
        jsonschema.validate(json.loads(response.output_text), SKY_SCHEMA)

    concurrently(attempt, TRIES, at_once=TOOLS_SLOTS)


def forced_budget(tool_choice: Any) -> int:
    """Tokens enough for a forced call's grammar to end (one call): its longest
    document plus one, as in test_openai_tools."""
    wire = engine_pb2.ChatInput(
        tools=[
            inference_pb2.Tool(name=t["name"], parameters=json.dumps(t["parameters"]))
            for t in FLAT_TOOLS
        ],
        parallel_tool_calls=False,
    )
    if tool_choice == "required":
        wire.tool_choice.mode = inference_pb2.ToolChoice.MODE_REQUIRED
    else:
        wire.tool_choice.mode = inference_pb2.ToolChoice.MODE_NAMED
        wire.tool_choice.name = tool_choice["name"]
    found = pinning.budget(engine_tools.grammar(engine_tools.parse(wire)))
    assert found is not None, "a forced call's grammar has a longest document"
    return found


def check_calls(output: list[Any], *, names: set[str]) -> int:
    """Every call validates against its tool's schema; the number of calls."""
    calls = [item for item in output if item.type == "function_call"]
    assert calls, "a forced turn makes at least one call"
    assert [item.type for item in output] == ["function_call"] * len(calls)
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert len({c.call_id for c in calls}) == len(calls)
    return len(calls)


NAMED = {"type": "function", "name": "get_time"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_validates_20_of_20(client: openai.OpenAI, stream: bool) -> None:
    """Tries alternate `required` and a named tool. One call per turn: the engine's
    grammar for parallel calls is the Chat Completions test's (test_openai_tools), and
    how several calls are rendered here is pinned by the unit goldens; parallel turns
    run to 8 calls, a cost this file does not repeat. As many at once as the Lane has
    slots."""

    def attempt(i: int) -> None:
        tool_choice: Any = NAMED if i % 2 else "required"
        options: dict[str, Any] = {
            "model": LANE,
            "instructions": INSTRUCTIONS,
            "input": ASK_TIME,
            "tools": FLAT_TOOLS,
            "tool_choice": tool_choice,
            "parallel_tool_calls": False,
            "temperature": TEMPERATURES[i % len(TEMPERATURES)],
            "max_output_tokens": forced_budget(tool_choice),
            # llama.cpp's extension, as on its /v1/responses: other samples streamed.
            "extra_body": {"seed": 1000 + i + (500 if stream else 0)},
        }
        if stream:
            # The SDK's accumulator of events, which parses strict tools' arguments.
            with client.responses.stream(**options) as events:
                response = events.get_final_response()
            for item in response.output:
                assert item.type == "function_call"
                assert item.parsed_arguments == json.loads(item.arguments)
        else:
            response = client.responses.create(**options)
        assert response.status == "completed", (i, response)
        names = {"get_time"} if tool_choice is NAMED else set(SCHEMAS)
        assert check_calls(response.output, names=names) == 1

    concurrently(attempt, TRIES, at_once=TOOLS_SLOTS)


def test_a_function_call_output_turn_is_accepted(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=LANE,
        instructions=INSTRUCTIONS,
        input=ASK,
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=forced_budget({"name": "get_weather"}),
    )
    (call,) = first.output
    assert call.type == "function_call"
    history: list[Any] = [
        {"role": "user", "content": ASK},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."},
    ]
    whole = client.responses.create(
        model=LANE, instructions=INSTRUCTIONS, input=history, tools=FLAT_TOOLS, max_output_tokens=16
    )
    events = list(
        client.responses.create(
            model=LANE,
            instructions=INSTRUCTIONS,
            input=history,
            tools=FLAT_TOOLS,
            max_output_tokens=16,
            stream=True,
        )
    )
    streamed = events[-1].response  # type: ignore[union-attr]
    for after in (whole, streamed):
        # Auto: whatever the model says; any call it makes validates.
        assert after.status in ("completed", "incomplete")
        calls = [item for item in after.output if item.type == "function_call"]
        if calls:
            check_calls(calls, names=set(SCHEMAS))
        # The call and its output are in the prompt.
        assert first.usage is not None and after.usage is not None
        assert after.usage.input_tokens > first.usage.input_tokens


def test_a_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    text = " ".join(f"Fact {i}: the sky over city {i} is clear." for i in range(60))
    options: dict[str, Any] = {
        "model": LANE,
        "input": text,
        "max_output_tokens": 1,
        "prompt_cache_key": "responses-cache-test",
    }
    cold = client.responses.create(**options)
    warm = client.responses.create(**options)
    assert cold.usage is not None and warm.usage is not None
    assert warm.usage.input_tokens == cold.usage.input_tokens > 500
    assert warm.usage.input_tokens_details.cached_tokens > warm.usage.input_tokens // 2
    # Streamed, the same figure arrives with response.completed / incomplete.
    events = list(client.responses.create(**options, stream=True))
    usage = events[-1].response.usage
    assert usage is not None and usage.input_tokens == cold.usage.input_tokens
    assert usage.input_tokens_details.cached_tokens > usage.input_tokens // 2


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model="nope", input="Hi", stream=stream)
        assert info.value.code == "model_not_found"
        assert info.value.param == "model"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"truncation": "auto"}, "truncation"),
    ],
)
def test_a_refused_field_is_a_400_naming_it(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(
                model=LANE, input="Hi", max_output_tokens=4, stream=stream, **extra
            )
        assert info.value.param == param, info.value.body


def test_an_input_over_the_context_is_a_400_naming_the_sizes(client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(
                model=LANE, input="Hi", max_output_tokens=CONTEXT_PER_SLOT + 10, stream=stream
            )
        err = info.value
        assert err.code == "context_length_exceeded"
        assert err.param == "input"
        assert str(CONTEXT_PER_SLOT) in err.message and "max_output_tokens" in err.message


def test_input_tokens_counts_what_usage_reports(client: openai.OpenAI) -> None:
    """`responses.input_tokens.count` renders and tokenizes the prompt exactly as
    `responses.create` does: its count is the response's `usage.input_tokens`."""
    options: dict[str, Any] = {
        "model": LANE,
        "instructions": INSTRUCTIONS,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
        "tools": FLAT_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
    }
    counted = client.responses.input_tokens.count(**options)
    assert counted.object == "response.input_tokens"
    # One token is enough: the prompt is counted before any is generated.
    created = client.responses.create(**options, max_output_tokens=1, store=False)
    assert created.usage is not None and counted.input_tokens == created.usage.input_tokens
    alone = client.responses.input_tokens.count(model=LANE, instructions=INSTRUCTIONS)
    assert 0 < alone.input_tokens < counted.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="nope", input="Hi")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_tokens.count(model=LANE, input="Hi", previous_response_id="r")
    assert refused.value.param == "previous_response_id"  # type: ignore[attr-defined]


def test_stored_responses_are_a_clear_404(client: openai.OpenAI) -> None:
    for call in (
        lambda: client.responses.retrieve("resp_123"),
        lambda: client.responses.delete("resp_123"),
        lambda: client.responses.cancel("resp_123"),
        lambda: client.responses.input_items.list("resp_123"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert "'resp_123'" in missing.value.message
        assert "keeps no responses" in missing.value.message
    # Nor is anything compacted (a POST the stored-response route must not take).
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.compact(model=LANE, input="Hi")
    assert "not supported" in refused.value.message
