"""Each dialect's routes for the body fuzz run (`test_bodies.py`): valid bodies with
every field that matters to a route somewhere (streamed and not, tools, structured
output, sampling options), and where a route's generation budget lives (`Budget`), so
that the run can hold it at one token.

A dialect plugs in with one `Route` per endpoint in `DIALECTS`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from tests.integration.fuzz.mutation import Path_, Raw, walk
from tests.integration.fuzz.serving import CONTEXT_PER_SLOT, LANE


@dataclass(frozen=True)
class Budget:
    """Where a route's generation budget lives, the first path that is set winning
    (OpenAI's max_completion_tokens over max_tokens), and what it is held to."""

    paths: tuple[Path_, ...]
    # Values the shim reads as "no budget" (Ollama's num_predict -1, -2 and 0).
    unbounded: frozenset[int] = frozenset()
    # Whether the budget reserves its tokens beside the prompt, so that one over the
    # context is refused before any work (OpenAI's max_tokens); Ollama's num_predict
    # only bounds the generation, which the context's end stops.
    reserves: bool = True

    def hold(self, body: Any) -> None:
        """Set the budget to 1 token unless what is there is refused or cannot run long:
        the shim refuses a budget of a wrong type, and one that `reserves` over the
        context (`CONTEXT_PER_SLOT`) is `context_length_exceeded` before any work."""
        if not isinstance(body, dict):
            return
        for path in self.paths:
            parent = walk(body, path[:-1])
            if isinstance(parent, dict) and parent.get(path[-1]) is not None:
                value = parent[path[-1]]
                if _cheap(value, self.unbounded, reserves=self.reserves):
                    return
                parent[path[-1]] = 1
                return
        # Nothing set: the default is unbounded (or long), so set the first path if
        # its parents are objects or absent (a wrong type there is refused anyway).
        node: Any = body
        first = self.paths[0]
        for key in first[:-1]:
            if not isinstance(node, dict):
                return
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        if isinstance(node, dict):
            node[first[-1]] = 1


def _cheap(value: Any, unbounded: frozenset[int], *, reserves: bool) -> bool:
    if isinstance(value, Raw):
        try:
            value = json.loads(value.text)  # "-0" and "1e-400" are numbers, and 0
        except (ValueError, RecursionError):
            return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True  # refused: not an integer (or, for Ollama, read as one only if whole)
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return True
    n = int(value)
    if n in unbounded:
        return False
    return n <= 2 or (reserves and n > 4 * CONTEXT_PER_SLOT)


@dataclass(frozen=True)
class Route:
    path: str
    # Valid bodies for the route, with every field that matters to it somewhere.
    bodies: st.SearchStrategy[dict[str, Any]]
    budget: Budget | None = None


TEXT = st.text(min_size=1, max_size=12)
# One draw in eight: for what the shim refuses by design (so a body stops there).
RARELY = st.integers(0, 7).map(lambda n: n == 0)
SCHEMA = st.sampled_from(
    [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        {"enum": ["x", "y"]},
        {"type": "string", "pattern": "^[a-z]+$"},
        {},
    ]
)
TOOL_PARAMETERS = st.sampled_from(
    [
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        {"type": "object", "properties": {}},
        {},
    ]
)


def _maybe(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict holding any subset of `fields`."""
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def openai_chat(draw: st.DrawFn) -> dict[str, Any]:
    user_content: Any = draw(st.one_of(TEXT, st.just([{"type": "text", "text": "Hi"}])))
    if draw(RARELY):
        user_content = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    messages: list[Any] = [{"role": "system", "content": "Be brief."}]
    if draw(st.booleans()):
        messages += [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
        ]
    messages.append({"role": "user", "content": user_content})
    body: dict[str, Any] = {"model": LANE, "messages": messages, "max_tokens": 1}
    body |= draw(
        _maybe(
            stream=st.booleans(),
            stream_options=st.just({"include_usage": True}),
            temperature=st.floats(0, 2),
            top_p=st.floats(0, 1),
            top_k=st.integers(0, 50),
            min_p=st.floats(0, 1),
            repeat_penalty=st.floats(0.5, 2),
            presence_penalty=st.floats(-2, 2),
            frequency_penalty=st.floats(-2, 2),
            seed=st.integers(-1, 2**40),
            stop=st.one_of(TEXT, st.lists(TEXT, max_size=3)),
            logit_bias=st.dictionaries(
                st.integers(0, 300_000).map(str), st.floats(-100, 100), max_size=2
            ),
            logprobs=st.booleans(),
            top_logprobs=st.integers(0, 20),
            user=TEXT,
            n=st.just(1),
            ignore_eos=st.booleans(),
            max_completion_tokens=st.just(1),
        )
    )
    constraint = draw(st.sampled_from(["none", "json_object", "json_schema", "grammar", "tools"]))
    if constraint == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif constraint == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": draw(SCHEMA), "strict": True},
        }
    elif constraint == "grammar":
        body["grammar"] = 'root ::= "a" | "b"'
    elif constraint == "tools":
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather.",
                    "parameters": draw(TOOL_PARAMETERS),
                },
            }
        ]
        body |= draw(
            _maybe(
                tool_choice=st.sampled_from(
                    [
                        "auto",
                        "none",
                        "required",
                        {"type": "function", "function": {"name": "get_weather"}},
                    ]
                ),
                parallel_tool_calls=st.booleans(),
            )
        )
    return _coherent(body)


def _coherent(body: dict[str, Any]) -> dict[str, Any]:
    """Options that need another one set get it, so that the body is valid."""
    if "stream_options" in body:
        body["stream"] = True
    if "top_logprobs" in body:
        body["logprobs"] = True
    return body


@st.composite
def openai_completion(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": LANE,
        "prompt": draw(st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=1))),
        "max_tokens": 1,
    }
    body |= draw(
        _maybe(
            stream=st.booleans(),
            stream_options=st.just({"include_usage": True}),
            echo=st.booleans(),
            logprobs=st.integers(0, 5),
            temperature=st.floats(0, 2),
            seed=st.integers(0, 2**32),
            stop=st.lists(TEXT, max_size=2),
            response_format=st.just({"type": "json_object"}),
            json_schema=SCHEMA,
        )
    )
    if draw(RARELY):
        body |= draw(_maybe(best_of=st.integers(1, 2), suffix=TEXT))
    return _coherent(body)


OPENAI_EMBEDDING = st.fixed_dictionaries(
    {"model": st.just(LANE), "input": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3))},
    optional={
        "encoding_format": st.sampled_from(["float", "base64"]),
        "dimensions": st.just(640),
        "user": TEXT,
    },
)

OLLAMA_OPTIONS = _maybe(
    temperature=st.floats(0, 2),
    top_k=st.integers(0, 50),
    top_p=st.floats(0, 1),
    min_p=st.floats(0, 1),
    seed=st.integers(-1, 2**40),
    stop=st.one_of(TEXT, st.lists(TEXT, max_size=2)),
    repeat_penalty=st.floats(0.5, 2),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    num_ctx=st.sampled_from([256, CONTEXT_PER_SLOT, 4096]),
).map(lambda options: {"num_predict": 1, **options})
OLLAMA_GENERATION = _maybe(
    stream=st.booleans(),
    format=st.one_of(st.just("json"), SCHEMA),
    # Negative: keep loaded, which is what Blazar does (others are refused).
    keep_alive=st.sampled_from(["-1", "-1h", "-5m30s", -1, -0.5]),
    think=st.booleans(),
    truncate=st.just(False),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 20),
)


@st.composite
def ollama_chat(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[Any] = draw(
        st.sampled_from(
            [
                [{"role": "user", "content": "Hi"}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                [
                    {"role": "user", "content": "Weather?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                        ],
                    },
                    {"role": "tool", "content": "Sunny.", "tool_name": "get_weather"},
                ],
                [],
            ]
        )
    )
    body = {"model": LANE, "messages": messages, "options": draw(OLLAMA_OPTIONS)}
    body |= draw(OLLAMA_GENERATION)
    if draw(RARELY):
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": draw(TOOL_PARAMETERS)},
            }
        ]
    return body


@st.composite
def ollama_generate(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": LANE, "prompt": draw(TEXT), "options": draw(OLLAMA_OPTIONS)}
    body |= draw(OLLAMA_GENERATION)
    body |= draw(
        _maybe(
            system=TEXT,
            raw=st.booleans(),
            template=st.just("{{ .Prompt }}{{ .Response }}"),
        )
    )
    if draw(RARELY):
        body |= draw(
            _maybe(
                suffix=TEXT,
                context=st.lists(st.integers(0, 1000), max_size=3),
                images=st.just(["aGk="]),
            )
        )
    return body


OLLAMA_EMBED = st.fixed_dictionaries(
    {"model": st.just(LANE), "input": st.one_of(TEXT, st.lists(TEXT, max_size=3))},
    optional={
        "dimensions": st.integers(1, 640),
        "truncate": st.just(False),
        "options": st.just({"num_ctx": 512}),
        "keep_alive": st.sampled_from(["-1m", -1]),
    },
)


@st.composite
def openai_responses(draw: st.DrawFn) -> dict[str, Any]:
    text_input: Any = draw(
        st.one_of(
            TEXT,
            st.just([{"role": "user", "content": "Hi"}]),
            st.just(
                [
                    {"role": "developer", "content": [{"type": "input_text", "text": "Brief."}]},
                    {"role": "user", "content": "Weather?"},
                    {
                        "type": "function_call",
                        "call_id": "call_1",
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
                ]
            ),
        )
    )
    body: dict[str, Any] = {"model": LANE, "input": text_input, "max_output_tokens": 1}
    body |= draw(
        _maybe(
            instructions=TEXT,
            stream=st.booleans(),
            temperature=st.floats(0, 2),
            top_p=st.floats(0, 1),
            user=TEXT,
            metadata=st.just({"k": "v"}),
            store=st.just(False),
            text=st.one_of(
                st.just({"format": {"type": "json_object"}}),
                SCHEMA.map(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}}),
            ),
        )
    )
    if draw(RARELY):
        body["tools"] = [
            {"type": "function", "name": "get_weather", "parameters": draw(TOOL_PARAMETERS)}
        ]
        body["tool_choice"] = draw(st.sampled_from(["auto", "none", "required"]))
    return body


@st.composite
def anthropic_messages(draw: st.DrawFn, *, count: bool = False) -> dict[str, Any]:
    messages: list[Any] = draw(
        st.sampled_from(
            [
                [{"role": "user", "content": "Hi"}],
                [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                [
                    {"role": "user", "content": "Weather?"},
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "tool_use",
                                "id": "toolu_1",
                                "name": "get_weather",
                                "input": {"city": "Paris"},
                            }
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny."}
                        ],
                    },
                ],
            ]
        )
    )
    body: dict[str, Any] = {"model": LANE, "messages": messages}
    if not count:
        body["max_tokens"] = 1
        body |= draw(
            _maybe(
                stream=st.booleans(),
                stop_sequences=st.lists(TEXT, max_size=2),
                temperature=st.floats(0, 1),
                top_p=st.floats(0, 1),
                top_k=st.integers(0, 50),
                metadata=TEXT.map(lambda u: {"user_id": u}),
            )
        )
    body |= draw(
        _maybe(
            system=st.one_of(TEXT, st.just([{"type": "text", "text": "Be brief."}])),
        )
    )
    if draw(RARELY):
        body["tools"] = [{"name": "get_weather", "input_schema": draw(TOOL_PARAMETERS)}]
        body["tool_choice"] = draw(
            st.sampled_from(
                [{"type": "auto"}, {"type": "any"}, {"type": "none"},
                 {"type": "tool", "name": "get_weather"}]
            )
        )  # fmt: skip
    return body


OPENAI_BUDGET = Budget(paths=(("max_completion_tokens",), ("max_tokens",)))
OLLAMA_BUDGET = Budget(
    paths=(("options", "num_predict"),), unbounded=frozenset({-2, -1, 0}), reserves=False
)
# A schema whose keywords were read before it was validated: TypeError, HTTP 500.
NOT_A_SCHEMA = {"type": "object", "properties": {"a": {}}, "required": 5}


@dataclass(frozen=True)
class Dialect:
    routes: list[Route]
    # A plain chat, which must still answer 200 after the run.
    plain: tuple[str, dict[str, Any]]
    # Bodies that once got a 5xx: sent on every run, before the generated ones.
    regressions: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


# One Route per endpoint.
DIALECTS: dict[str, Dialect] = {
    "anthropic": Dialect(
        routes=[
            # max_tokens only bounds the answer, which the context's end stops, as on
            # Anthropic's current models: nothing over the context is refused.
            Route(
                "/v1/messages",
                anthropic_messages(),
                Budget(paths=(("max_tokens",),), reserves=False),
            ),
            Route("/v1/messages/count_tokens", anthropic_messages(count=True)),
        ],
        plain=(
            "/v1/messages",
            {"model": LANE, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ),
    "openai": Dialect(
        routes=[
            Route("/v1/chat/completions", openai_chat(), OPENAI_BUDGET),
            Route("/v1/completions", openai_completion(), Budget(paths=(("max_tokens",),))),
            Route("/v1/embeddings", OPENAI_EMBEDDING),
            Route("/v1/responses", openai_responses(), Budget(paths=(("max_output_tokens",),))),
        ],
        plain=(
            "/v1/chat/completions",
            {"model": LANE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
        regressions=[
            (
                "/v1/completions",
                {"model": LANE, "prompt": "x", "max_tokens": 1, "json_schema": NOT_A_SCHEMA},
            ),
            (
                "/v1/chat/completions",
                {
                    "model": LANE,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 1,
                    "tools": [{"type": "function", "function": {"name": "x" * 100_000}}],
                },
            ),
            (
                "/v1/chat/completions",
                {
                    "model": LANE,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 1,
                    "tools": [
                        {
                            "type": "function",
                            "function": {"name": "f", "parameters": {"$schema": []}},
                        }
                    ],
                },
            ),
        ],
    ),
    "ollama": Dialect(
        routes=[
            Route("/api/chat", ollama_chat(), OLLAMA_BUDGET),
            Route("/api/generate", ollama_generate(), OLLAMA_BUDGET),
            Route("/api/embed", OLLAMA_EMBED),
        ],
        plain=(
            "/api/chat",
            {
                "model": LANE,
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": False,
                "options": {"num_predict": 2},
            },
        ),
        regressions=[
            (
                "/api/generate",
                {
                    "model": LANE,
                    "prompt": "x",
                    "format": NOT_A_SCHEMA,
                    "options": {"num_predict": 1},
                },
            ),
        ],
    ),
}
