"""Tool calling in the Ollama dialect end to end: the official `ollama` client -> shim ->
daemon -> a real engine worker with the bundled Gemma 3 270M (whose template cannot
show tools, so it reads Blazar's own tool prompt).

Nothing here relies on what the model chooses to write, only on what Blazar
guarantees. Ollama has no tool choice: Blazar's `x-blazar-tool-choice` header forces a
call (`required`, or a tool's name), and a forced call validates against its tool's
schema given a budget its first call cannot outrun (`pinning.budget`). Calls may be
parallel, as in Ollama, unless `x-blazar-parallel-tool-calls: false`: then the model
may go on to further calls until the budget ends them, and the calls the answer carries
are the whole ones, each validated here. `none` never calls; a tool result is taken
back into the conversation.

The schemas use only what the official client passes on: it rebuilds each tool with
its own model, which keeps `type`, `properties`, `required`, and per property `type`,
`items`, `description` and `enum` (`test_the_client_sends_the_schemas_unchanged`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.engine import schema as schemas
from blazar.engine import tools as engine_tools
from tests.integration import pinning
from tests.integration.harness import TOOLS_LANE, TOOLS_SLOTS, Daemon, concurrently

pytestmark = pytest.mark.slow

LANE = TOOLS_LANE
HEADER = "x-blazar-tool-choice"
PARALLEL = "x-blazar-parallel-tool-calls"
TRIES = 20
TEMPERATURES = (0.0, 0.6, 1.0, 1.4)

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Tokyo"]},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "Asia/Tokyo"]}},
    "required": ["zone"],
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now in a time zone.",
            "parameters": TIME_SCHEMA,
        },
    },
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tools_daemon: Daemon) -> Daemon:
    return tools_daemon


Clients = Callable[..., ollama.Client]


@pytest.fixture
def clients(daemon: Daemon) -> Iterator[Clients]:
    """An official client per tool choice (the header, None for none sent) and, when
    given, `parallel` (the x-blazar-parallel-tool-calls header)."""
    made: list[ollama.Client] = []

    def client(choice: str | None, *, parallel: bool | None = None) -> ollama.Client:
        headers = {HEADER: choice} if choice is not None else {}
        if parallel is not None:
            headers[PARALLEL] = str(parallel).lower()
        sdk = ollama.Client(host=f"http://{daemon.http}", headers=headers)
        made.append(sdk)
        return sdk

    yield client
    for sdk in made:
        sdk._client.close()


def budget(choice: str) -> int:
    """Tokens enough for a forced turn's first call to close: the longest single call
    the grammar allows, plus one (each token writes at least one byte)."""
    wire = engine_pb2.ChatInput(
        tools=[
            inference_pb2.Tool(name=name, parameters=json.dumps(schema))
            for name, schema in SCHEMAS.items()
        ],
        parallel_tool_calls=False,
    )
    if choice == "required":
        wire.tool_choice.mode = inference_pb2.ToolChoice.MODE_REQUIRED
    else:
        wire.tool_choice.mode = inference_pb2.ToolChoice.MODE_NAMED
        wire.tool_choice.name = choice
    found = pinning.budget(engine_tools.grammar(engine_tools.parse(wire)))
    assert found is not None, "a forced call's grammar has a longest document"
    return found


def check_calls(calls: list[Any], *, names: set[str]) -> int:
    """Every call is to an allowed tool, with arguments (an object, as Ollama's are)
    that validate against its schema; the number of calls."""
    assert calls, "a forced turn makes at least one call"
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(dict(call.function.arguments), SCHEMAS[call.function.name])
    return len(calls)


def test_the_client_sends_the_schemas_unchanged() -> None:
    """What the forced calls below are validated against is what reached Blazar."""
    for tool in TOOLS:
        sent = ollama.Tool.model_validate(tool).model_dump(exclude_none=True)
        assert sent["function"]["parameters"] == tool["function"]["parameters"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_validates_20_of_20(clients: Clients, stream: bool) -> None:
    """20 tries whole and 20 streamed, the header's `required` and a named tool taking
    turns (10 each per mode), over seeds and temperatures, as many at once as the Lane
    has slots."""
    by_choice = {c: (clients(c, parallel=False), clients(c)) for c in ("required", "get_time")}

    def attempt(i: int) -> int:
        choice = "get_time" if i % 2 else "required"
        one_call, parallel = by_choice[choice]
        names = set(SCHEMAS) if choice == "required" else {choice}
        # With parallel calls allowed (the default) the bundled model goes on calling
        # until the budget ends its turn: one try in 20 shows that what it sends then is
        # whole and valid too (`required` whole, the named tool streamed), at a cost the
        # suite can carry; it goes first, being the longest.
        several = i == (1 if stream else 0)
        client = parallel if several else one_call
        options = {
            "num_predict": budget(choice),
            # Other samples streamed than whole.
            "seed": 1000 + i + (500 if stream else 0),
            "temperature": TEMPERATURES[i % len(TEMPERATURES)],
        }
        if stream:
            parts = list(
                client.chat(
                    model=LANE, messages=QUESTION, tools=TOOLS, options=options, stream=True
                )
            )
            assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
            # Each call came whole in an object of its own, never in the last one.
            calls = [c for p in parts[:-1] for c in p.message.tool_calls or []]
            assert not parts[-1].message.tool_calls
            final = parts[-1]
        else:
            final = client.chat(model=LANE, messages=QUESTION, tools=TOOLS, options=options)
            calls = list(final.message.tool_calls or [])
        if several:
            # Ollama's reasons: a turn that called ends with "stop", or the budget cut a
            # further call (which is then left out).
            assert final.done_reason in ("stop", "length"), (i, final)
        else:
            assert final.done_reason == "stop", (i, final)
            assert len(calls) == 1
        return check_calls(calls, names=names)

    made = concurrently(attempt, TRIES, at_once=TOOLS_SLOTS)
    print(f"forced stream={stream}: {len(made)}/{TRIES} valid, {sum(made)} calls")


def test_a_tool_result_turn_is_answered(daemon: Daemon, clients: Clients) -> None:
    # Ollama's wire format itself, which the client reads past: the call's id and index.
    first = httpx.post(
        f"http://{daemon.http}/api/chat",
        json={
            "model": LANE,
            "messages": QUESTION,
            "tools": TOOLS,
            "stream": False,
            "options": {"num_predict": budget("get_weather"), "seed": 7},
        },
        headers={HEADER: "get_weather", PARALLEL: "false"},
        timeout=120,
    )
    assert first.status_code == 200, first.text
    answer = first.json()
    calls = answer["message"]["tool_calls"]
    assert calls[0]["id"].startswith("call_")
    assert [c["function"]["index"] for c in calls] == list(range(len(calls)))
    for call in calls:
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(call["function"]["arguments"], WEATHER_SCHEMA)
    history: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": answer["message"]["content"], "tool_calls": calls},
        *(
            {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 degrees."}
            for _ in calls
        ),
    ]
    client = clients(None)  # auto: the model answers, or calls again
    for stream in (False, True):
        options = {"num_predict": 16, "seed": 8}
        if stream:
            parts = list(
                client.chat(model=LANE, messages=history, tools=TOOLS, options=options, stream=True)
            )
            final = parts[-1]
            made = [c for p in parts for c in p.message.tool_calls or []]
        else:
            final = client.chat(model=LANE, messages=history, tools=TOOLS, options=options)
            made = list(final.message.tool_calls or [])
        assert final.done and final.done_reason in ("stop", "length")
        # The call and its result are in the prompt.
        assert final.prompt_eval_count and final.prompt_eval_count > answer["prompt_eval_count"]
        if made:
            check_calls(made, names=set(SCHEMAS))


def test_tool_choice_none_never_calls(clients: Clients) -> None:
    client = clients("none")
    for i in range(4):
        options = {"num_predict": 16, "seed": 3000 + i, "temperature": TEMPERATURES[i]}
        if i % 2:
            parts = list(
                client.chat(
                    model=LANE, messages=QUESTION, tools=TOOLS, options=options, stream=True
                )
            )
            assert not any(p.message.tool_calls for p in parts)
            final = parts[-1]
        else:
            final = client.chat(model=LANE, messages=QUESTION, tools=TOOLS, options=options)
            assert not final.message.tool_calls
        assert final.done_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("choice", "tools", "fragment"),
    [
        ("get_wether", TOOLS, "'get_wether'"),
        ("Required", TOOLS, "'Required'"),
        ("required", None, "needs tools"),
    ],
)
def test_a_bad_header_is_a_400_naming_it(
    clients: Clients,
    choice: str,
    tools: list[Any] | None,
    fragment: str,
) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        clients(choice).chat(model=LANE, messages=QUESTION, tools=tools)
    assert caught.value.status_code == 400
    assert HEADER in caught.value.error and fragment in caught.value.error


def test_what_ollama_has_no_tools_for_is_refused(daemon: Daemon, clients: Clients) -> None:
    # The client's generate cannot send tools; a raw request can.
    generate = httpx.post(
        f"http://{daemon.http}/api/generate",
        json={"model": LANE, "prompt": "Hi", "tools": TOOLS},
        timeout=60,
    )
    assert generate.status_code == 400 and "'tools'" in generate.json()["error"]


ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"sky": {"type": "string", "enum": ["clear", "rain"]}},
    "required": ["sky"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_format_beside_tools_gives_valid_calls_or_an_answer_in_it(
    clients: Clients, stream: bool
) -> None:
    """`format` with tools: the model calls tools or answers in the format, nothing
    else (one grammar allows both); whichever it picks validates."""
    wire = engine_pb2.ChatInput(
        tools=[
            inference_pb2.Tool(name=name, parameters=json.dumps(schema))
            for name, schema in SCHEMAS.items()
        ],
        parallel_tool_calls=False,
    )
    answer = schemas.grammar(ANSWER_SCHEMA)
    made = engine_tools.grammar(engine_tools.parse(wire), answer=answer, result_stops=True)
    tokens = pinning.budget(made)
    assert tokens is not None
    client = clients(None, parallel=False)
    options = {"num_predict": tokens, "seed": 11, "temperature": 1.0}
    if stream:
        chunks = list(
            client.chat(
                model=LANE,
                messages=QUESTION,
                tools=TOOLS,
                format=ANSWER_SCHEMA,
                options=options,
                stream=True,
            )
        )
        content = "".join(c.message.content or "" for c in chunks)
        calls = [call for c in chunks for call in c.message.tool_calls or []]
        final = chunks[-1]
    else:
        final = client.chat(
            model=LANE, messages=QUESTION, tools=TOOLS, format=ANSWER_SCHEMA, options=options
        )
        content, calls = final.message.content or "", list(final.message.tool_calls or [])
    assert final.done_reason == "stop"
    if calls:
        assert check_calls(calls, names=set(SCHEMAS)) == 1 and not content
    else:
        jsonschema.validate(json.loads(content), ANSWER_SCHEMA)
