"""Tool calling end to end: the official `openai` client -> shim -> daemon -> a real
engine worker with the bundled Gemma 3 270M, whose template cannot show tools (so
Blazar's own tool prompt is what it reads).

The model is a weak base model: nothing here relies on what it chooses to write, only
on what Blazar guarantees. A forced call (`required`, a named tool) validates against
its tool's schema, given a budget of tokens its grammar cannot outrun
(`pinning.budget`); an `auto` turn's calls validate, or there are none; `none` never
calls; a tool set that cannot be served is a 400 that names the parameter.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.engine import schema as schemas
from blazar.engine import tools as engine_tools
from tests.integration import pinning
from tests.integration.harness import TOOLS_LANE, TOOLS_SLOTS, Daemon, concurrently

pytestmark = pytest.mark.slow

LANE = TOOLS_LANE
TRIES = 20
TEMPERATURES = (0.0, 0.6, 1.0, 1.4)

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "description": "How many days ahead."},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": WEATHER_SCHEMA,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now in a time zone.",
            "parameters": TIME_SCHEMA,
            "strict": True,
        },
    },
]
TIME_TOOL = TOOLS[1]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris tomorrow?"},
]


@pytest.fixture(scope="module")
def daemon(tools_daemon: Daemon) -> Daemon:
    return tools_daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    sdk = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused", max_retries=0)
    yield sdk
    sdk.close()


def budget(
    tool_choice: Any,
    *,
    parallel: bool,
    tools: list[Any] = TOOLS,
    answer: dict[str, Any] | None = None,
) -> int:
    """Tokens enough for the grammar to end: its longest document plus one. A forced
    call's, or in auto mode (`tool_choice` None) with `answer`, calls or that answer."""
    wire = engine_pb2.ChatInput(
        tools=[
            inference_pb2.Tool(
                name=t["function"]["name"], parameters=json.dumps(t["function"]["parameters"])
            )
            for t in tools
        ],
        parallel_tool_calls=parallel,
    )
    if tool_choice == "required":
        wire.tool_choice.mode = inference_pb2.ToolChoice.MODE_REQUIRED
    elif tool_choice is not None:
        wire.tool_choice.mode = inference_pb2.ToolChoice.MODE_NAMED
        wire.tool_choice.name = tool_choice["function"]["name"]
    shaped = None if answer is None else schemas.grammar(answer)
    # Beside an answer, calls may end where a result would begin (the engine's stop).
    made = engine_tools.grammar(
        engine_tools.parse(wire), answer=shaped, result_stops=shaped is not None
    )
    found = pinning.budget(made)
    assert found is not None, "the grammar has a longest document"
    return found


def check_calls(calls: list[Any], *, names: set[str]) -> int:
    """Every call validates against its tool's schema; the number of calls."""
    assert calls, "a forced turn makes at least one call"
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return len(calls)


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_validates_20_of_20(client: openai.OpenAI, stream: bool) -> None:
    """20 tries whole and 20 streamed, `required` and a named tool taking turns (10
    each per mode), over seeds and temperatures, as many at once as the Lane has slots.
    One of each mode's 20 allows parallel calls."""

    def attempt(i: int) -> tuple[int, str]:
        tool_choice: Any = NAMED if i % 2 else "required"
        names = {"get_time"} if tool_choice is NAMED else set(SCHEMAS)
        # With parallel calls allowed the bundled model never ends a turn by itself: it
        # writes the grammar's cap of 8 calls, 8 times the tokens of a single call. One
        # `required` try in 20 shows that those validate too (a named tool is one call
        # whatever `parallel_tool_calls` says); it goes first, being the longest, and
        # offers only `get_time`, whose calls are the shortest.
        parallel = i == 0
        tools = [TIME_TOOL] if parallel else TOOLS
        if parallel:
            names = {"get_time"}
        options: dict[str, Any] = {
            "model": LANE,
            "messages": QUESTION,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel,
            # Other samples streamed than whole.
            "seed": 1000 + i + (500 if stream else 0),
            "temperature": TEMPERATURES[i % len(TEMPERATURES)],
            "max_tokens": budget(tool_choice, parallel=parallel, tools=tools),
        }
        if stream:
            # The SDK's own accumulator of streamed deltas.
            with client.chat.completions.stream(**options) as events:
                completion = events.get_final_completion()
        else:
            completion = client.chat.completions.create(**options)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", (i, choice)
        calls = list(choice.message.tool_calls or [])
        if not parallel:
            assert len(calls) == 1
        made = check_calls(calls, names=names)
        if stream:
            parsed = [c.function.parsed_arguments for c in calls]  # type: ignore[union-attr]
            assert parsed == [json.loads(c.function.arguments) for c in calls]
        return made, json.dumps([(c.function.name, c.function.arguments) for c in calls])

    answers = concurrently(attempt, TRIES, at_once=TOOLS_SLOTS)
    print(
        f"forced stream={stream}: {len(answers)}/{TRIES} valid, "
        f"{sum(made for made, _ in answers)} calls, "
        f"{len({answer for _, answer in answers})} distinct answers"
    )


def test_a_conversation_goes_on_after_a_tool_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=LANE,
        messages=QUESTION,
        tools=TOOLS,
        # A named tool is exactly one call without `parallel_tool_calls` (as Instructor
        # sends it): one call's budget is enough.
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        seed=7,
        max_tokens=budget({"function": {"name": "get_weather"}}, parallel=False),
    )
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    history: list[Any] = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."},
    ]
    for stream in (False, True):
        options: dict[str, Any] = {
            "model": LANE,
            "messages": history,
            "tools": TOOLS,
            "seed": 8,
            "max_tokens": 64,
        }
        if stream:
            # Plain chunks: the SDK's accumulator refuses a strict tool's turn cut at max_tokens.
            chunks = list(
                client.chat.completions.create(
                    **options, stream=True, stream_options={"include_usage": True}
                )
            )
            reasons = [c.finish_reason for k in chunks for c in k.choices if c.finish_reason]
            usage = chunks[-1].usage
        else:
            after = client.chat.completions.create(**options)
            reasons, usage = [after.choices[0].finish_reason], after.usage
            # Auto: whatever the model says; any call it makes validates.
            if reasons == ["tool_calls"]:
                check_calls(list(after.choices[0].message.tool_calls or []), names=set(SCHEMAS))
        assert len(reasons) == 1 and reasons[0] in ("stop", "length", "tool_calls")
        # The tool's result is in the prompt.
        assert first.usage is not None and usage is not None
        assert usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_calls_validate_or_are_not_made(client: openai.OpenAI) -> None:
    def attempt(i: int) -> int:
        completion = client.chat.completions.create(
            model=LANE,
            messages=QUESTION,
            tools=TOOLS,
            seed=2000 + i,
            temperature=TEMPERATURES[i % len(TEMPERATURES)],
            max_tokens=96,
        )
        choice = completion.choices[0]
        calls = list(choice.message.tool_calls or [])
        assert (choice.finish_reason == "tool_calls") == bool(
            calls
        ) or choice.finish_reason == "length"
        return check_calls(calls, names=set(SCHEMAS)) if calls else 0

    made = sum(concurrently(attempt, 10, at_once=TOOLS_SLOTS))
    print(f"auto: {made} valid calls in 10 turns")


class Forecast(pydantic.BaseModel):
    """An agent's final answer (the SDK's `response_format`, strict)."""

    sky: Literal["clear", "cloudy", "rain"]
    summary: str = pydantic.Field(max_length=16)


FORECAST = Forecast.model_json_schema()


def test_tools_beside_a_response_format_give_valid_calls_or_a_parsed_answer(
    client: openai.OpenAI,
) -> None:
    """An agent's turn: tools it may call, and the shape of its final answer. Each
    turn is valid calls or an answer the SDK parses into `Forecast`, never text beside
    or instead of them; half the turns streamed."""
    answer = dict(Forecast.model_json_schema(), additionalProperties=False)
    tokens = budget(None, parallel=False, answer=answer)

    def attempt(i: int) -> str:
        options: dict[str, Any] = {
            "model": LANE,
            "messages": QUESTION,
            "tools": TOOLS,
            "response_format": Forecast,
            "parallel_tool_calls": False,
            "seed": 4000 + i,
            "temperature": TEMPERATURES[i % len(TEMPERATURES)],
            "max_tokens": tokens,
        }
        if i % 2:
            with client.chat.completions.stream(**options) as events:
                completion = events.get_final_completion()
        else:
            completion = client.chat.completions.parse(**options)
        choice = completion.choices[0]
        if choice.finish_reason == "tool_calls":
            check_calls(list(choice.message.tool_calls or []), names=set(SCHEMAS))
            assert not choice.message.content
            return "call"
        assert choice.finish_reason == "stop", choice
        assert not choice.message.tool_calls
        assert isinstance(choice.message.parsed, Forecast), choice.message.content
        return "answer"

    made_turns = concurrently(attempt, TOOLS_SLOTS, at_once=TOOLS_SLOTS)
    print(f"tools beside a response format: {collections.Counter(made_turns)}")


def test_a_call_cut_short_beside_a_response_format_is_not_the_answers_text(
    client: openai.OpenAI, model_path: Path
) -> None:
    """The turn may hold calls or the answer: a call the budget cuts is left out, not
    passed on as content, which the SDK parses as the format (`<tool_call>` is not
    JSON: its stream raised ValueError instead of LengthFinishReasonError). Banning
    the tokens that begin with the answer's `{` pins the model to a call; four tokens
    end inside its opening tag and newline, before any `{` is due."""
    options: dict[str, Any] = {
        "model": LANE,
        "messages": QUESTION,
        "tools": TOOLS,
        "response_format": Forecast,
        "max_tokens": 4,
        "logit_bias": dict.fromkeys(
            map(str, pinning.beginning_with(model_path, b"{")), pinning.BAN
        ),
    }
    with (
        pytest.raises(openai.LengthFinishReasonError),
        client.chat.completions.stream(**options) as events,
    ):
        for _ in events:
            pass
    fmt = {"type": "json_schema", "json_schema": {"name": "Forecast", "schema": FORECAST}}
    completion = client.chat.completions.create(**{**options, "response_format": fmt})
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content and not choice.message.tool_calls


def test_tool_choice_none_never_calls(client: openai.OpenAI) -> None:
    def attempt(i: int) -> None:
        completion = client.chat.completions.create(
            model=LANE,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="none",
            seed=3000 + i,
            temperature=TEMPERATURES[i % len(TEMPERATURES)],
            max_tokens=48,
        )
        choice = completion.choices[0]
        assert choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")

    concurrently(attempt, 5, at_once=TOOLS_SLOTS)


def _deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}}
    return node


def _tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param", "fragment"),
    [
        (
            [_tool("f", {"type": "object", "properties": {"a": {"type": "strin"}}})],
            "auto",
            "tools[0].function.parameters",
            "not a valid JSON Schema",
        ),
        ([_tool("f", {}), _tool("f", {})], "auto", "tools[1].function.name", "both named"),
        ([_tool("f", _deep(40))], "auto", "tools[0].function.parameters", "levels deep"),
        ([_tool("has space", {})], "auto", "tools[0].function.name", "tool name"),
        (
            [
                _tool(
                    "f", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}
                )
            ],
            "required",
            "tools[0].function.parameters",
            "minimum",
        ),
        (
            [_tool("f", {})],
            {"type": "function", "function": {"name": "g"}},
            "tool_choice",
            "'g'",
        ),
    ],
)
def test_invalid_tools_are_a_400_naming_the_parameter(
    client: openai.OpenAI, tools: list[Any], tool_choice: Any, param: str, fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=LANE, messages=QUESTION, tools=tools, tool_choice=tool_choice, max_tokens=8
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    assert fragment in error["message"], error
