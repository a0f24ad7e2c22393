"""The Anthropic dialect end to end: the official `anthropic` client -> shim -> daemon
-> a real engine worker with the bundled Gemma 3 270M, one Lane of one slot (so that a
repeated prompt finds its prefix in the cache and one running request leaves no slot
free), and an SLOPolicy that queues nothing (so that admission refuses at once).

Nothing here depends on what the model writes: a generation that must run to its
budget is held there by a structured output no budget can finish, a stop string is
met inside a text a grammar forces, forced tool calls and structured output get a
budget their grammar cannot outrun (`pinning.budget`), and the rest asserts mechanics.
The tests that send 20 requests send them to the daemon the tool-calling modules share
(`tools_daemon`), as many at once as its Lane has slots.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pydantic
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.engine import schema as schemas
from blazar.engine import tools as engine_tools
from tests.integration import pinning
from tests.integration.harness import (
    TOOLS_LANE,
    TOOLS_SLOTS,
    Daemon,
    concurrently,
    local_fleet,
    short_home,
)

pytestmark = pytest.mark.slow

LANE = "claude"
TRIES = 20
# Anthropic's temperatures run from 0 to 1.
TEMPERATURES = (0.0, 0.5, 1.0)
# A JSON string of at least 100 characters: 3 tokens of at most 31 bytes cannot finish
# it, and the grammar keeps the model from stopping, so the budget ends the output.
RUNS_TO_BUDGET: dict[str, Any] = {"type": "string", "minLength": 100}
BUDGET = 3
HI: list[Any] = [{"role": "user", "content": "Say something."}]

TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_time", "description": "The time in a zone.", "input_schema": TIME_SCHEMA},
    {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "input_schema": WEATHER_SCHEMA,
    },
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    home = short_home()
    fleet = local_fleet(
        home, model_path, lane=LANE, spec="replicas: 1, slots: 1, contextPerSlot: 2048"
    )
    (fleet / "policy.yaml").write_text(
        "apiVersion: blazar.dev/v1alpha1\n"
        "kind: SLOPolicy\n"
        "metadata: {name: tight}\n"
        "spec: {maxQueueDepth: 0}\n"
    )
    d = Daemon(home=home, watch=fleet).start()
    try:
        d.wait_condition("lane", LANE, "Ready", timeout=240)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def client(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    sdk = anthropic.Anthropic(base_url=f"http://{daemon.http}", api_key="unused", max_retries=0)
    yield sdk
    sdk.close()


@pytest.fixture
def tools_client(tools_daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    """A client of the daemon the tool-calling modules share (`TOOLS_SLOTS` slots), for
    the tests that send 20 requests, as many at once as it has slots."""
    sdk = anthropic.Anthropic(
        base_url=f"http://{tools_daemon.http}", api_key="unused", max_retries=0
    )
    yield sdk
    sdk.close()


def prompt_total(usage: Any) -> int:
    """The prompt's tokens, as Anthropic adds them up."""
    return int(
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )


def output_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "schema": schema}}


def test_a_message_not_streaming(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model=LANE,
        max_tokens=BUDGET,
        messages=HI,
        output_config=output_format(RUNS_TO_BUDGET),  # type: ignore[arg-type]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.model == LANE
    assert message.id.startswith("msg_") and message._request_id
    (block,) = message.content
    assert block.type == "text" and block.text.startswith('"')
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert message.usage.output_tokens == BUDGET
    assert prompt_total(message.usage) > 5


def test_a_message_streaming_in_anthropics_event_order(
    client: anthropic.Anthropic, daemon: Daemon
) -> None:
    with client.messages.stream(
        model=LANE,
        max_tokens=BUDGET,
        messages=HI,
        output_config=output_format(RUNS_TO_BUDGET),  # type: ignore[arg-type]
    ) as stream:
        kinds = [e.type for e in stream if e.type not in ("text", "input_json")]
        final = stream.get_final_message()
    deltas = len(kinds) - 5
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.content[0].type == "text" and final.content[0].text.startswith('"')
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == BUDGET
    assert prompt_total(final.usage) > 5
    # The raw stream: every event named, a ping after message_start.
    raw = httpx.post(
        f"http://{daemon.http}/v1/messages",
        json={
            "model": LANE,
            "max_tokens": BUDGET,
            "messages": HI,
            "stream": True,
            "output_config": output_format(RUNS_TO_BUDGET),
        },
        timeout=60,
    )
    names = [line[len("event: ") :] for line in raw.text.splitlines() if line.startswith("event:")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert raw.headers["request-id"] == raw.headers["x-request-id"]


def test_system_as_blocks_and_count_tokens_equal_the_prompt_generated(
    client: anthropic.Anthropic,
) -> None:
    system: list[Any] = [
        {"type": "text", "text": "You are terse."},
        {"type": "text", "text": "You answer in French.", "cache_control": {"type": "ephemeral"}},
    ]
    bodies: list[dict[str, Any]] = [
        {"messages": HI},
        {"messages": HI, "system": system},
        {"messages": QUESTION, "system": "Be brief.", "tools": TOOLS},
        {"messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "any"}},
    ]
    counts = []
    for body in bodies:
        counted = client.messages.count_tokens(model=LANE, **body)
        generated = client.messages.create(model=LANE, max_tokens=1, **body)
        assert counted.input_tokens == prompt_total(generated.usage), body
        counts.append(counted.input_tokens)
    # The system prompt and the tools are counted.
    assert counts[1] > counts[0] and counts[2] > counts[0]


def test_message_start_tells_the_prompts_tokens_as_count_tokens_counts_them(
    client: anthropic.Anthropic,
) -> None:
    """The stream's first event holds the prompt's usage (reused and prefilled), as
    Anthropic's does, equal to count_tokens and to the final usage."""
    counted = client.messages.count_tokens(model=LANE, messages=HI).input_tokens
    for _ in range(2):  # the second time, its prefix comes from the cache
        with client.messages.stream(model=LANE, max_tokens=2, messages=HI) as events:
            start = next(e for e in events if e.type == "message_start")
            final = events.get_final_message()
        started = start.message.usage
        assert started.input_tokens + (started.cache_read_input_tokens or 0) == counted
        assert prompt_total(final.usage) == counted


def test_count_tokens_counts_a_conversation_longer_than_one_answer_could_list(
    client: anthropic.Anthropic,
) -> None:
    """A 2 MB turn: its tokens listed would take more than the 4 MiB one gRPC answer may
    carry, so the shim asks Tokenize for the count alone."""

    def count(words: int) -> int:
        turn = [{"role": "user", "content": "word " * words}]
        return client.messages.count_tokens(model=LANE, messages=turn).input_tokens

    half, part, whole = count(50_000), count(100_000), count(400_000)
    # The rendered chat around the turn is the same each time: the counts grow in step.
    assert whole - part == 6 * (part - half) > 0


def test_max_tokens_past_the_context_stops_where_the_context_ends(
    client: anthropic.Anthropic,
) -> None:
    """max_tokens bounds the answer and reserves nothing, as on Anthropic's current
    models: LangChain's ChatAnthropic sends 4096 whatever the prompt, on a 2,048-token
    Lane. The answer runs to the context's end and says so. A schema whose string
    needs more room than is left pins that the model cannot end its turn first."""
    room = 6

    def turn(words: int) -> list[Any]:
        return [{"role": "user", "content": "word " * words}]

    def count(words: int) -> int:
        return client.messages.count_tokens(model=LANE, messages=turn(words)).input_tokens

    low, high = count(1000), count(1500)
    words = 1000 + (2048 - room - low) * 500 // (high - low)
    assert count(words) == 2048 - room
    # 200 characters cannot fit in the 6 tokens left whatever the sampler draws: the
    # bundled vocabulary's longest token spells 31, so 6 spell at most 186.
    longer = {"type": "object", "properties": {"a": {"type": "string", "minLength": 200}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    message = client.messages.create(
        model=LANE, max_tokens=4096, messages=turn(words), output_config=output_format(longer)
    )
    assert message.stop_reason == "model_context_window_exceeded"
    assert (prompt_total(message.usage), message.usage.output_tokens) == (2048 - room, room)


def test_stop_sequences_end_the_text_before_them(client: anthropic.Anthropic) -> None:
    """A grammar forces a text with the stop string inside it: the text ends before it,
    and the answer names the stop sequence that ended it."""
    forced = {"enum": ["red STOP blue"]}
    for stream in (False, True):
        options: dict[str, Any] = {
            "model": LANE,
            "max_tokens": 16,
            "messages": HI,
            "stop_sequences": ["STOP"],
            "output_config": output_format(forced),
        }
        if stream:
            with client.messages.stream(**options) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**options)
        (block,) = message.content
        assert block.type == "text" and block.text == '"red '
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")


def test_stop_sequences_do_not_cut_a_forced_tool_call(client: anthropic.Anthropic) -> None:
    """Every call's format holds a newline and its input's JSON a brace: stop strings
    that would match inside the call leave the forced call whole."""
    tool_choice: dict[str, Any] = {"type": "tool", "name": "get_weather"}
    for stream in (False, True):
        options: dict[str, Any] = {
            "model": LANE,
            "max_tokens": budget(tool_choice),
            "messages": QUESTION,
            "tools": TOOLS,
            "tool_choice": {**tool_choice, "disable_parallel_tool_use": True},
            "stop_sequences": ["\n", "{", "city"],
        }
        if stream:
            with client.messages.stream(**options) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**options)
        assert (message.stop_reason, message.stop_sequence) == ("tool_use", None), message
        (use,) = message.content
        assert use.type == "tool_use" and use.name == "get_weather", message
        jsonschema.validate(use.input, WEATHER_SCHEMA)


def budget(tool_choice: dict[str, Any]) -> int:
    """Tokens enough for a forced single call's grammar to end: its longest document + 1."""
    wire = engine_pb2.ChatInput(
        tools=[
            inference_pb2.Tool(name=t["name"], parameters=json.dumps(t["input_schema"]))
            for t in TOOLS
        ],
        parallel_tool_calls=False,
    )
    if tool_choice["type"] == "any":
        wire.tool_choice.mode = inference_pb2.ToolChoice.MODE_REQUIRED
    else:
        wire.tool_choice.mode = inference_pb2.ToolChoice.MODE_NAMED
        wire.tool_choice.name = tool_choice["name"]
    found = pinning.budget(engine_tools.grammar(engine_tools.parse(wire)))
    assert found is not None, "a forced call's grammar has a longest document"
    return found


def forced(client: anthropic.Anthropic, tool_choice: dict[str, Any]) -> anthropic.types.Message:
    return client.messages.create(
        model=LANE,
        max_tokens=budget(tool_choice),
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={**tool_choice, "disable_parallel_tool_use": True},  # type: ignore[typeddict-item]
    )


def test_a_conversation_goes_on_after_a_tool_result(client: anthropic.Anthropic) -> None:
    first = forced(client, {"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    history: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 degrees."},
                {"type": "text", "text": "Tell me in one sentence."},
            ],
        },
    ]
    counted = client.messages.count_tokens(model=LANE, messages=history, tools=TOOLS)
    for stream in (False, True):
        options: dict[str, Any] = {
            "model": LANE,
            "max_tokens": 8,
            "messages": history,
            "tools": TOOLS,
        }
        if stream:
            with client.messages.stream(**options) as events:
                after = events.get_final_message()
        else:
            after = client.messages.create(**options)
        assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
        # The call and its result are in the prompt.
        assert prompt_total(after.usage) == counted.input_tokens
        assert counted.input_tokens > prompt_total(first.usage)
        # Auto: whatever the model says; any call it makes validates.
        for block in after.content:
            if block.type == "tool_use":
                jsonschema.validate(block.input, SCHEMAS[block.name])


def test_unknown_model_is_404(client: anthropic.Anthropic) -> None:
    for call in (
        lambda: client.messages.create(model="no-such-model", max_tokens=4, messages=HI),
        lambda: client.messages.create(
            model="no-such-model", max_tokens=4, messages=HI, stream=True
        ),
        lambda: client.messages.count_tokens(model="no-such-model", messages=HI),
    ):
        with pytest.raises(anthropic.NotFoundError) as missing:
            call()
        body = missing.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "not_found_error"
        assert "no-such-model" in body["error"]["message"]


def test_the_models_api_in_anthropics_shape(client: anthropic.Anthropic, daemon: Daemon) -> None:
    """`client.models` gets Anthropic's Models API on the path OpenAI's clients list
    models on; an OpenAI client there still gets OpenAI's list."""
    listed = list(client.models.list())
    assert [m.id for m in listed] == [LANE]
    assert (listed[0].type, listed[0].display_name) == ("model", LANE)
    assert listed[0].created_at.year >= 2026
    one = client.models.retrieve(f"{LANE}:latest")
    assert one.id == LANE and one.type == "model"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert missing.value.request_id
    openai_shape = httpx.get(f"http://{daemon.http}/v1/models").json()
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "model"


def test_bad_requests_are_400_in_anthropics_shape(
    client: anthropic.Anthropic, daemon: Daemon
) -> None:
    no_budget = httpx.post(
        f"http://{daemon.http}/v1/messages", json={"model": LANE, "messages": HI}, timeout=30
    )
    assert no_budget.status_code == 400
    assert no_budget.json()["error"] == {
        "type": "invalid_request_error",
        "message": "Missing required parameter: 'max_tokens'.",
    }
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    # Streamed too: both come before the first event, with their status.
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(
                model=LANE,
                max_tokens=4,
                messages=[{"role": "user", "content": [image]}],  # type: ignore[list-item]
                stream=stream,
            )
        assert "'image' block" in str(refused.value)
        with pytest.raises(anthropic.BadRequestError) as too_long:
            client.messages.create(
                model=LANE,
                max_tokens=4,
                messages=[{"role": "user", "content": "word " * 2100}],
                stream=stream,
            )
        body = too_long.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
        assert "2048" in body["error"]["message"]


def test_an_admission_refusal_is_429_with_retry_after(
    client: anthropic.Anthropic, daemon: Daemon
) -> None:
    """The one slot runs a long generation; a request under a policy that queues nothing
    is refused at once, whole or streamed."""
    with client.messages.stream(
        model=LANE,
        max_tokens=400,
        messages=HI,
        # Output no budget finishes (the converter spells out at most 1,000 of anything).
        output_config=output_format(  # type: ignore[arg-type]
            {"type": "array", "minItems": 1000, "items": {"type": "string", "minLength": 1000}}
        ),
    ) as holding:
        next(iter(holding))  # message_start: the generation has its slot
        for stream in (False, True):
            with pytest.raises(anthropic.RateLimitError) as refused:
                client.messages.create(
                    model=LANE,
                    max_tokens=4,
                    messages=HI,
                    stream=stream,
                    extra_headers={"x-blazar-slo": "tight"},
                )
            assert refused.value.status_code == 429
            assert int(refused.value.response.headers["retry-after"]) >= 1
            body = refused.value.body
            assert isinstance(body, dict) and body["error"]["type"] == "rate_limit_error"
            assert "SLOPolicy 'tight'" in body["error"]["message"]


def test_a_repeated_long_prompt_reads_the_cache(client: anthropic.Anthropic) -> None:
    text = " ".join(f"Item {i} is a fact worth keeping in mind." for i in range(60))
    messages: list[Any] = [{"role": "user", "content": f"{text}\nSummarize {time.time()}."}]
    first = client.messages.create(model=LANE, max_tokens=1, messages=messages)
    second = client.messages.create(model=LANE, max_tokens=1, messages=messages)
    total = prompt_total(first.usage)
    assert total > 500
    assert prompt_total(second.usage) == total
    assert second.usage.cache_read_input_tokens is not None
    assert second.usage.cache_read_input_tokens > total // 2
    assert second.usage.input_tokens < first.usage.input_tokens
    # Streamed: message_start's usage is zero (the prompt's counts come at the end);
    # message_delta carries them, and so does the client's final message.
    with client.messages.stream(model=LANE, max_tokens=1, messages=messages) as stream:
        deltas = [e.usage for e in stream if e.type == "message_delta"]
        streamed = stream.get_final_message().usage
    (delta,) = deltas
    assert delta.cache_read_input_tokens is not None
    assert delta.cache_read_input_tokens > total // 2
    assert delta.input_tokens == total - delta.cache_read_input_tokens
    assert prompt_total(streamed) == total
    assert streamed.cache_read_input_tokens == delta.cache_read_input_tokens


def test_max_tokens_zero_prewarms_the_cache(client: anthropic.Anthropic) -> None:
    """Anthropic's cache pre-warming: no content, and the prompt is in the cache for the
    next request, streamed or not."""
    text = " ".join(f"Rule {i} says to keep answers short." for i in range(40))
    for stream in (False, True):
        messages: list[Any] = [{"role": "user", "content": f"{text}\nWarm {time.time()}."}]
        if stream:
            with client.messages.stream(model=LANE, max_tokens=0, messages=messages) as events:
                kinds = [e.type for e in events]
                warm = events.get_final_message()
            assert kinds == ["message_start", "message_delta", "message_stop"]
        else:
            warm = client.messages.create(model=LANE, max_tokens=0, messages=messages)
        assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
        total = prompt_total(warm.usage)
        assert total > 300
        read = client.messages.create(model=LANE, max_tokens=1, messages=messages)
        assert prompt_total(read.usage) == total
        # All but the last token, whose logits the next request computes again.
        assert read.usage.cache_read_input_tokens == total - 1


FORCING: list[dict[str, Any]] = [{"type": "any"}, {"type": "tool", "name": "get_time"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_validates_20_of_20(
    tools_client: anthropic.Anthropic, stream: bool
) -> None:
    """`any` and `tool` by turns (a forced call costs about 30 grammar-bound tokens,
    so 20 tries per way of reading the answer are what the suite can carry), as many at
    once as the Lane has slots."""

    def attempt(i: int) -> str:
        tool_choice = FORCING[i % len(FORCING)]
        names = {tool_choice["name"]} if "name" in tool_choice else set(SCHEMAS)
        options: dict[str, Any] = {
            "model": TOOLS_LANE,
            "max_tokens": budget(tool_choice),
            "messages": QUESTION,
            "tools": TOOLS,
            "tool_choice": {**tool_choice, "disable_parallel_tool_use": True},
            "extra_body": {"temperature": TEMPERATURES[i % len(TEMPERATURES)]},
        }
        if stream:
            with tools_client.messages.stream(**options) as events:
                message = events.get_final_message()
        else:
            message = tools_client.messages.create(**options)
        assert message.stop_reason == "tool_use", (i, message)
        (use,) = message.content
        assert use.type == "tool_use" and use.name in names, (i, message)
        jsonschema.validate(use.input, SCHEMAS[use.name])
        return json.dumps([use.name, use.input], sort_keys=True)

    distinct = set(concurrently(attempt, TRIES, at_once=TOOLS_SLOTS))
    print(f"forced, stream={stream}: {TRIES}/{TRIES} valid, {len(distinct)} distinct calls")


class Forecast(pydantic.BaseModel):
    # An enum: the client moves a string's maxLength into its description.
    city: Literal["Paris", "Oslo", "Lima"]
    sunny: bool


WEATHER_REPORT: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


def test_structured_output_validates_20_of_20(tools_client: anthropic.Anthropic) -> None:
    """`output_config.format` (the client's structured outputs) is the json_schema
    constraint: half whole, half streamed, as many at once as the Lane has slots, and
    the client's own `parse` once."""
    limit = pinning.budget(schemas.grammar(WEATHER_REPORT))
    assert limit is not None
    ask: list[Any] = [{"role": "user", "content": "Describe the weather in Paris as JSON."}]

    def attempt(i: int) -> None:
        options: dict[str, Any] = {
            "model": TOOLS_LANE,
            "max_tokens": limit,
            "messages": ask,
            "output_config": output_format(WEATHER_REPORT),
            "extra_body": {"temperature": TEMPERATURES[i % len(TEMPERATURES)]},
        }
        if i % 2:
            with tools_client.messages.stream(**options) as events:
                message = events.get_final_message()
        else:
            message = tools_client.messages.create(**options)
        assert message.stop_reason == "end_turn", (i, message)
        (block,) = message.content
        assert block.type == "text"
        jsonschema.validate(json.loads(block.text), WEATHER_REPORT)

    concurrently(attempt, TRIES, at_once=TOOLS_SLOTS)
    longest = pinning.budget(schemas.grammar(Forecast.model_json_schema()))
    assert longest is not None
    parsed = tools_client.messages.parse(
        model=TOOLS_LANE, max_tokens=longest, messages=ask, output_format=Forecast
    )
    assert isinstance(parsed.parsed_output, Forecast)


def test_an_unknown_policy_is_a_400_on_every_route(client: anthropic.Anthropic) -> None:
    """The data plane checks the policy a request names on every RPC, admitted or not."""
    named = {"x-blazar-slo": "no-such-policy"}
    for call in (
        lambda: client.messages.create(model=LANE, max_tokens=1, messages=HI, extra_headers=named),
        lambda: client.messages.create(
            model=LANE, max_tokens=1, messages=HI, stream=True, extra_headers=named
        ),
        lambda: client.messages.count_tokens(model=LANE, messages=HI, extra_headers=named),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            call()
        body = refused.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
        assert "SLOPolicy 'no-such-policy' does not exist" in body["error"]["message"]


def test_a_message_says_when_its_first_token_was_expected_streamed_or_not(
    client: anthropic.Anthropic,
) -> None:
    whole = client.messages.with_raw_response.create(model=LANE, max_tokens=1, messages=HI)
    assert int(whole.headers["x-blazar-predicted-ttft-ms"]) >= 0
    assert whole.parse().usage.output_tokens == 1
    with client.messages.with_streaming_response.create(
        model=LANE, max_tokens=1, messages=HI, stream=True
    ) as streamed:
        assert int(streamed.headers["x-blazar-predicted-ttft-ms"]) >= 0
        assert any(line.startswith("event: message_stop") for line in streamed.iter_lines())


# --- a final assistant turn continued (prefill), in every dialect ----------------------

PREFILL = "The capital of France is"
# What the model's template (Gemma 3's) renders for HI with PREFILL as the open final
# turn: the oracle a plain completion of the same text gives (BOS is the engine's).
PREFILLED_PROMPT = (
    "<start_of_turn>user\nSay something.<end_of_turn>\n<start_of_turn>model\n" + PREFILL
)
CONTINUED = 4


def oracle(daemon: Daemon) -> tuple[str, int]:
    """The greedy completion of the rendered prompt, and its prompt tokens."""
    sdk = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused", max_retries=0)
    with sdk:
        done = sdk.completions.create(
            model=LANE, prompt=PREFILLED_PROMPT, max_tokens=CONTINUED, temperature=0
        )
    assert done.usage is not None
    return done.choices[0].text, done.usage.prompt_tokens


def test_anthropic_continues_a_final_assistant_turn(
    client: anthropic.Anthropic, daemon: Daemon
) -> None:
    """Anthropic's prefill: the answer is the greedy continuation of the prompt that
    ends in the open assistant turn, and only that (whole and streamed); the prefill
    counts as prompt tokens, in count_tokens too."""
    expected, prompt_tokens = oracle(daemon)
    messages: list[Any] = [*HI, {"role": "assistant", "content": PREFILL}]
    answer = client.messages.create(
        model=LANE, max_tokens=CONTINUED, messages=messages, extra_body={"temperature": 0}
    )
    assert answer.content[0].type == "text"
    assert answer.content[0].text == expected
    assert prompt_total(answer.usage) == prompt_tokens
    assert client.messages.count_tokens(model=LANE, messages=messages).input_tokens == prompt_tokens
    with client.messages.stream(
        model=LANE, max_tokens=CONTINUED, messages=messages, extra_body={"temperature": 0}
    ) as events:
        streamed = "".join(events.text_stream)
    assert streamed == expected
    closed = client.messages.count_tokens(model=LANE, messages=HI).input_tokens
    assert prompt_tokens > closed  # the prefill is prompt


def test_openai_continues_a_final_assistant_message_only_when_asked(daemon: Daemon) -> None:
    expected, prompt_tokens = oracle(daemon)
    sdk = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [*HI, {"role": "assistant", "content": PREFILL}]
    with sdk:
        asked = [
            {"extra_body": {"continue_final_message": True, "add_generation_prompt": False}},
            {"messages": [*HI, {"role": "assistant", "content": PREFILL, "prefix": True}]},
        ]
        for how in asked:
            kwargs: dict[str, Any] = {"messages": messages, **how}
            done = sdk.chat.completions.create(
                model=LANE, max_tokens=CONTINUED, temperature=0, **kwargs
            )
            assert done.choices[0].message.content == expected, how
            assert done.usage is not None and done.usage.prompt_tokens == prompt_tokens
            stream = sdk.chat.completions.create(
                model=LANE, max_tokens=CONTINUED, temperature=0, stream=True, **kwargs
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == expected, how
        # Unasked, OpenAI's meaning: the assistant turn is closed and a new one begins.
        new_turn = sdk.chat.completions.create(
            model=LANE, max_tokens=1, temperature=0, messages=messages
        )
        assert new_turn.usage is not None and new_turn.usage.prompt_tokens > prompt_tokens


def test_ollama_continues_a_final_assistant_message(daemon: Daemon) -> None:
    expected, prompt_tokens = oracle(daemon)
    sdk = ollama.Client(host=f"http://{daemon.http}")
    messages: list[Any] = [*HI, {"role": "assistant", "content": PREFILL}]
    options = {"temperature": 0, "num_predict": CONTINUED}
    done = sdk.chat(model=LANE, messages=messages, options=options)
    assert done.message.content == expected
    assert done.prompt_eval_count == prompt_tokens
    streamed = "".join(
        part.message.content or ""
        for part in sdk.chat(model=LANE, messages=messages, options=options, stream=True)
    )
    assert streamed == expected
