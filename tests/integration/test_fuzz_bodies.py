"""Fuzzing the shim's request bodies: hypothesis sends at least 1,000 bodies per
dialect to a real daemon over real sockets, and none may be answered with a 5xx.

Bodies start valid, from each route's own fields (streamed and not, tools, structured
output, sampling options), and are then mutated a few fields at a time: a value
replaced by one of the wrong type, a huge or negative number, NaN or infinity, a
deeply nested array, a huge string, a lone surrogate; a field deleted; an unknown one
added. Some are then damaged as bytes (truncated, invalid UTF-8, another encoding, not
JSON at all) or sent with another content type. Mutating a valid body rather than
generating noise is what gets past JSON parsing into each dialect's validation and
conversion, and on to the engine.

Engine work stays small so that the run takes minutes: a body that can still be valid
has its generation budget held at 1 token (`Route.budget`), unless the mutation made
the budget itself one the shim must refuse; prompts are short unless they are huge,
and then they are over the context, which is refused before any prefill.

A 5xx is a bug in the shim (or below it), and so is a 429 here (`acceptable`). So is
a streamed error after a 200, which the response's status cannot show: the daemon's
log must hold no error record. After
the run the daemon must still serve a plain chat in each dialect, on the same engine
replica (no restart).

A dialect plugs in with one `Route` per endpoint in `DIALECTS`.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.harness import Daemon, local_fleet, short_home

pytestmark = pytest.mark.slow

LANE = "fuzz"
CONTEXT_PER_SLOT = 1024
# At least this many per dialect; raise it (BLAZAR_FUZZ_BODIES) for a longer hunt.
BODIES_PER_DIALECT = int(os.environ.get("BLAZAR_FUZZ_BODIES", "1000"))


# ---------------------------------------------------------------- JSON with raw parts


@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as it is: what `json.dumps` will not write (NaN,
    1e999, a lone surrogate escape, nesting deeper than its recursion limit)."""

    text: str


def dump(value: Any) -> str:
    """`value` as JSON text, each `Raw` as it is. The encoding is json's own (C, fast
    on bodies with 20,000-element lists): each Raw goes in as a placeholder string."""
    raws: list[str] = []

    def swap(node: Any) -> Any:
        if isinstance(node, Raw):
            raws.append(node.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(node, dict):
            return {swap(k): swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) for v in node]
        return node

    # ensure_ascii: a surrogate hypothesis drew becomes an escape, as a client would send it.
    text = json.dumps(swap(value))
    return _PLACEHOLDER.sub(lambda found: raws[int(found[1])], text) if raws else text


_PLACEHOLDER = re.compile(r'"\\u0000raw(\d+)\\u0000"')


# ---------------------------------------------------------------- routes


Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Budget:
    """Where a route's generation budget lives, the first path that is set winning
    (OpenAI's max_completion_tokens over max_tokens), and what it is held to."""

    paths: tuple[Path_, ...]
    # Values the shim reads as "no budget" (Ollama's num_predict -1, -2 and 0).
    unbounded: frozenset[int] = frozenset()

    def hold(self, body: Any) -> None:
        """Set the budget to 1 token unless what is there is refused or cannot run long:
        the shim refuses a budget of a wrong type, and one over the context
        (`CONTEXT_PER_SLOT`) is `context_length_exceeded` before any work."""
        if not isinstance(body, dict):
            return
        for path in self.paths:
            parent = _walk(body, path[:-1])
            if isinstance(parent, dict) and parent.get(path[-1]) is not None:
                value = parent[path[-1]]
                if _cheap(value, self.unbounded):
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


def _cheap(value: Any, unbounded: frozenset[int]) -> bool:
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
    return n <= 2 or n > 4 * CONTEXT_PER_SLOT


def _walk(body: Any, path: Path_) -> Any:
    node = body
    for key in path:
        if isinstance(node, dict) and isinstance(key, str):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return None
    return node


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
OLLAMA_BUDGET = Budget(paths=(("options", "num_predict"),), unbounded=frozenset({-2, -1, 0}))
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
            Route("/v1/messages", anthropic_messages(), Budget(paths=(("max_tokens",),))),
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


# ---------------------------------------------------------------- mutations

INTERESTING_NUMBERS = st.sampled_from(
    [
        *(0, -1, 1, 2, -2, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63, -(2**63)),
        *(2**64, 10**30, 0.5, -0.0, 1e-320, 1.7976931348623157e308, -1e308, 2.5),
    ]
)
RAW_VALUES = st.sampled_from(
    [
        Raw("NaN"),
        Raw("Infinity"),
        Raw("-Infinity"),
        Raw("1e999"),
        Raw("-1e999"),
        Raw("1E400"),
        Raw("1e-400"),
        Raw("-0"),
        Raw("1" + "0" * 5000),  # past CPython's 4,300-digit int conversion limit
        Raw("12345678901234567890123456789012345678901234567890"),
        Raw('"\\ud800"'),  # a lone high surrogate
        Raw('"x\\udfffy"'),  # a lone low surrogate
        Raw('"\\udbff\\udfff"'),  # a valid pair: U+10FFFF
        Raw('"a\\u0000b"'),
        Raw('"\\u202e\\u2028\\ufeff"'),
    ]
)


def _nested(depth: int, *, obj: bool) -> Raw:
    if obj:
        return Raw('{"a":' * depth + "1" + "}" * depth)
    return Raw("[" * depth + "]" * depth)


NESTED = st.builds(
    _nested, st.sampled_from([20, 100, 500, 900, 990, 1100, 5000, 100_000]), obj=st.booleans()
)
HUGE = st.sampled_from(
    [
        "x" * 100_000,
        "word " * 40_000,
        "\U0001f642" * 50_000,
        "<start_of_turn>user\n" * 2_000,
    ]
)
HUGE_LISTS = st.sampled_from([["x"] * 5_000, [1] * 20_000, [[1, 2]] * 3_000, [{}] * 5_000])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    INTERESTING_NUMBERS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(
        [
            *("", " ", "null", "0", "-1", "1e999", "auto", "none", "required", "json", "function"),
            *(
                "user",
                "assistant",
                "tool",
                "system",
                "text",
                "base64",
                "5m",
                "-1h",
                "\x00",
                "\u2028",
            ),
        ]
    ),
)
CONTAINERS = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
WEIRD = st.one_of(SCALARS, CONTAINERS, RAW_VALUES, NESTED)
# Large values: up to 600 kB of JSON each, one per body (see `mutated`).
LARGE = st.one_of(HUGE, HUGE_LISTS)
UNKNOWN_KEYS = st.one_of(
    st.text(max_size=10),
    st.sampled_from(
        ["__proto__", "constructor", "model ", "MODEL", "", "$ref", "$schema", "options"]
    ),
    st.just(Raw('"\\ud800key"')),
)


def _paths(node: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every position in a body (not the root)."""
    found: list[Path_] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str):
                found.append((*prefix, key))
                found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.append((*prefix, i))
            found += _paths(value, (*prefix, i))
    return found


def _containers(node: Any, prefix: Path_ = ()) -> list[Path_]:
    found = [prefix] if isinstance(node, dict | list) else []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str):
                found += _containers(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _containers(value, (*prefix, i))
    return found


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> tuple[Any, list[str]]:
    """`body` after 0 to 3 mutations, and what they were. A large value (`LARGE`) ends
    the mutations: mutating inside it, or adding more, makes bodies of many MB that
    only test the size limit, slowly."""
    done: list[str] = []
    large = False

    def weird() -> Any:
        nonlocal large
        large = draw(st.integers(0, 9)) == 0
        return copy.deepcopy(draw(LARGE if large else WEIRD))

    # Strategies hand out shared objects (st.just, sampled_from): mutate copies only.
    current: Any = copy.deepcopy(body)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "wrap"]))
        if kind == "add":
            spots = _containers(current)
            if not spots:
                continue
            spot = draw(st.sampled_from(spots))
            node = _walk(current, spot) if spot else current
            value = weird()
            if isinstance(node, dict):
                key = draw(UNKNOWN_KEYS)
                node[key] = value
                done.append(f"add {spot}+{key!r}")
            elif isinstance(node, list):
                node.insert(draw(st.integers(0, len(node))), value)
                done.append(f"insert into {spot}")
            continue
        paths = _paths(current)
        if not paths:
            continue
        path = draw(st.sampled_from(paths))
        parent = _walk(current, path[:-1]) if path[:-1] else current
        key = path[-1]
        if kind == "delete":
            if isinstance(parent, dict):
                parent.pop(key, None)
            elif isinstance(parent, list) and isinstance(key, int):
                del parent[key]
            done.append(f"delete {path}")
        else:
            old = parent[key]
            new = [old] if kind == "wrap" else weird()
            parent[key] = new
            done.append(f"{kind} {path}")
        if large:
            break
    return current, done


CONTENT_TYPES = st.sampled_from(
    ["application/json"] * 12
    + ["application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded"]
    + ["multipart/form-data; boundary=x", "application/octet-stream", "", None]
)


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> tuple[bytes, str]:
    """The encoded body, most often as it is, else damaged as bytes."""
    kind = draw(
        st.sampled_from(["none"] * 16 + ["truncate", "bad-utf8", "utf16", "bom", "replace"])
    )
    if kind == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))], kind
    if kind == "bad-utf8":
        at = draw(st.integers(0, len(data)))
        junk = draw(
            st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])
        )
        return data[:at] + junk + data[at:], kind
    if kind == "utf16":
        return data.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass"), kind
    if kind == "bom":
        return b"\xef\xbb\xbf" + data, kind
    if kind == "replace":
        other = draw(
            st.one_of(
                st.sampled_from([b"", b"null", b"[]", b'"x"', b"1", b"{", b"a=b&c=d", b"{}" * 3]),
                st.binary(max_size=64),
            )
        )
        return other, kind
    return data, kind


@dataclass(frozen=True)
class Case:
    route: Route
    body: bytes
    content_type: str | None
    description: str


@st.composite
def cases(draw: st.DrawFn, routes: list[Route]) -> Case:
    route = draw(st.sampled_from(routes))
    body, mutations = draw(mutated(draw(route.bodies)))
    if route.budget is not None:
        route.budget.hold(body)
    data, damage = draw(damaged(dump(body).encode("utf-8", "surrogatepass")))
    content_type = draw(CONTENT_TYPES)
    what = f"{route.path} mutations={mutations} damage={damage} content-type={content_type!r}"
    return Case(route, data, content_type, what)


# ---------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    home = short_home()
    fleet = local_fleet(
        home,
        model_path,
        lane=LANE,
        spec=f"replicas: 1, slots: 2, contextPerSlot: {CONTEXT_PER_SLOT}",
    )
    d = Daemon(home=home, watch=fleet).start()
    try:
        d.wait_condition("lane", LANE, "Ready", timeout=240)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{daemon.http}", timeout=60) as c:
        yield c


def send(client: httpx.Client, case: Case) -> httpx.Response:
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    return client.post(case.route.path, content=case.body, headers=headers)


def acceptable(status: int) -> bool:
    """Not a server failure, nor a refusal to retry: this daemon has no SLOPolicy and
    one client sending one request at a time, so admission never refuses (a 429 was an
    error message too long for gRPC's trailers, read as RESOURCE_EXHAUSTED)."""
    return status < 500 and status != 429


SENT: collections.Counter[str] = collections.Counter()
STATUSES: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_no_request_body_gets_a_5xx_and_the_daemon_serves_on(
    name: str, client: httpx.Client, daemon: Daemon, record_property: Callable[..., None]
) -> None:
    dialect = DIALECTS[name]
    started = time.monotonic()
    for path, body in dialect.regressions:
        response = client.post(path, json=body)
        assert acceptable(response.status_code), (path, response.status_code, response.text[:500])

    @settings(
        max_examples=BODIES_PER_DIALECT,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases(dialect.routes))
    def run(case: Case) -> None:
        response = send(client, case)
        SENT[name] += 1
        STATUSES[name][response.status_code] += 1
        assert acceptable(response.status_code), (
            f"{case.description}\nbody: {case.body[:2000]!r}\n"
            f"-> {response.status_code} {response.text[:2000]}"
        )

    run()
    seconds = time.monotonic() - started
    record_property("seconds", round(seconds, 1))
    print(f"{name}: {SENT[name]} bodies in {seconds:.0f} s, statuses {dict(STATUSES[name])}")
    assert SENT[name] >= BODIES_PER_DIALECT

    path, body = dialect.plain
    plain = client.post(path, json=body)
    assert plain.status_code == 200, plain.text
    assert client.get("/readyz").status_code == 200
    (replica,) = daemon.get("lane", LANE)["status"]["replicaStatuses"]
    assert replica.get("restarts", 0) == 0, replica
    # A stream that failed after its 200 went out says so only in the daemon's log.
    logged = daemon.log_path.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in logged if line.startswith("{")]
    failures = [r for r in records if r.get("level") in ("error", "critical")]
    assert not failures, failures[:5]
