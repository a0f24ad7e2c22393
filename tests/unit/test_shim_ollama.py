"""The Ollama dialect of the HTTP shim: its conversion both ways (pure, by table and
golden file) and its routes against a fake `blazar.v1.Inference` servicer.

Golden files under golden/ollama/ pin the translation; regenerate them with
BLAZAR_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import canonical, context, validation
from blazar.shim.ollama import convert, listing, options, protocol, render, template
from tests.unit import fake_inference, helpers
from tests.unit.fake_inference import Daemon, asgi_client, delta, fake_daemon

GOLDEN = Path(__file__).parent / "golden" / "ollama"
NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, UTC)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with fake_daemon() as d:
        d.fake.models = MODELS
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(daemon.target) as c:
        yield c


def check_golden(name: str, document: Any) -> None:
    fake_inference.check_golden(GOLDEN / f"{name}.json", document)


def final(
    reason: int = inference_pb2.FINISH_REASON_STOP,
    *,
    prompt: int = 7,
    completion: int = 3,
    tool_calls: int = 0,
) -> inference_pb2.Chunk:
    return inference_pb2.Chunk(
        final=inference_pb2.Final(
            finish_reason=reason,  # type: ignore[arg-type]
            tool_calls=tool_calls,
            usage=inference_pb2.Usage(
                prompt_tokens=prompt, completion_tokens=completion, cached_tokens=2
            ),
            timings=inference_pb2.Timings(
                queue_ms=1.5, prefill_ms=20.25, ttft_ms=25.0, decode_ms=30.0, parked_ms=0.0
            ),
            model="tiny",
        )
    )


FILE = helpers.MODEL_FILE
MODELS = [
    inference_pb2.ModelInfo(
        id=name, lane="tiny", model="tiny-model", ready=True, created=1_767_139_200,
        context_length=2048, replicas=1, ready_replicas=1, slots=4, file=FILE,
    )
    for name in ("tiny", "tiny:270m")
] + [
    inference_pb2.ModelInfo(
        id="paused", lane="paused", model="other", ready=False, created=1_767_139_200,
        context_length=1024, replicas=0, ready_replicas=0, slots=1,
    )
]  # fmt: skip

HELLO = [delta("Hel"), delta("lo"), final()]


def calling(
    index: int, *, id: str = "", name: str = "", arguments: str = ""
) -> inference_pb2.Chunk:
    """A delta carrying part of a call, as the daemon streams a forced one."""
    part = inference_pb2.ToolCallDelta(index=index, id=id, name=name, arguments=arguments)
    return inference_pb2.Chunk(delta=inference_pb2.Delta(tokens=2, tool_calls=[part]))


# Two calls in fragments, the way a forced call streams; the second one may be cut.
CALLS = [
    delta("Checking. "),
    calling(0, id="call_0123456789abcdef01234567", name="get_weather"),
    calling(0, arguments='{"city": "Pa'),
    calling(0, arguments='ris", "days": 2}'),
    calling(1, id="call_89abcdef0123456789abcdef", name="get_time"),
    calling(1, arguments='{"zone": "UT'),
]


def parse(model: type[validation.M], body: dict[str, Any]) -> validation.M:
    return validation.parse_body(model, json.dumps(body).encode())


def message_json(message: Any) -> dict[str, Any]:
    return {
        "type": type(message).DESCRIPTOR.full_name,
        "message": json_format.MessageToDict(message, preserving_proto_field_name=True),
    }


# ---------------------------------------------------------------- golden: requests in

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}

REQUEST_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_minimal": ("chat", CHAT),
    "chat_all_options": (
        "chat",
        {
            "model": "tiny:270m",
            "messages": [
                {"role": "System", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again"},
            ],
            "stream": False,
            "keep_alive": -1,
            "think": False,
            "truncate": False,
            "options": {
                "num_predict": 12,
                "temperature": 0,
                "top_k": 5,
                "top_p": 0.5,
                "min_p": 0.1,
                "seed": 42,
                "stop": ["\n\n", ""],
                "repeat_penalty": 1.1,
                "presence_penalty": 0.5,
                "frequency_penalty": -0.5,
                "num_ctx": 2048,
            },
        },
    ),
    "chat_format_json": ("chat", {**CHAT, "format": "json"}),
    "chat_format_schema": (
        "chat",
        {**CHAT, "format": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    ),
    "chat_logprobs": ("chat", {**CHAT, "logprobs": True, "top_logprobs": 3}),
    "chat_unlimited_and_random_seed": (
        "chat",
        {**CHAT, "options": {"num_predict": -1, "seed": -1, "stop": "END"}},
    ),
    "generate_templated": ("generate", {"model": "tiny", "prompt": "Why?"}),
    "generate_with_system": (
        "generate",
        {"model": "tiny", "prompt": "Why?", "system": "Answer in French.", "format": ""},
    ),
    "generate_with_template": (
        "generate",
        {
            "model": "tiny",
            "prompt": "Why?",
            "system": "Be brief.",
            "template": "{{ if .System }}<s>{{ .System }}</s>\n{{ end }}"
            "<u>{{ .Prompt }}</u>\n<m>{{ .Response }}</m>",
        },
    ),
    "generate_raw": (
        "generate",
        {"model": "tiny", "prompt": "<start_of_turn>user\n", "raw": True, "options": {"seed": 7}},
    ),
    "embed_list": ("embed", {"model": "tiny", "input": ["a", "b"], "truncate": False}),
    "embed_string": ("embed", {"model": "tiny", "input": "a", "keep_alive": "-1m"}),
    "embeddings_old": ("embeddings", {"model": "tiny", "prompt": "a"}),
}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
# As Go clients send a tool without properties: `null`, which is none.
NOW_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": None}},
}
BARE_TOOL = {"function": {"name": "ping"}}
TOOLS = [WEATHER, NOW_TOOL, BARE_TOOL]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
            },
            # As the Python client sends it back: no id, no index.
            {"function": {"name": "get_time", "arguments": {}}},
        ],
    },
    {"role": "tool", "content": "Sunny.", "tool_name": "get_weather", "tool_call_id": "call_1"},
    {"role": "tool", "content": "12:00", "tool_name": "get_time"},
]

# (body, Blazar's tool headers)
TOOL_REQUEST_CASES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "chat_tools_auto": ({"model": "tiny", "messages": TOOL_TURNS, "tools": TOOLS}, {}),
    "chat_tools_required": ({**CHAT, "tools": TOOLS}, {"x-blazar-tool-choice": "required"}),
    "chat_tools_named": ({**CHAT, "tools": TOOLS}, {"x-blazar-tool-choice": "get_weather"}),
    "chat_tools_none_with_format": (
        {**CHAT, "tools": TOOLS, "format": "json"},
        {"x-blazar-tool-choice": "none"},
    ),
    # The model calls tools or answers in the format (the engine's grammar allows both).
    "chat_tools_auto_with_format": (
        {
            **CHAT,
            "tools": TOOLS,
            "format": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
        {},
    ),
    "chat_tools_required_one_call": (
        {**CHAT, "tools": TOOLS},
        {"x-blazar-tool-choice": "required", "x-blazar-parallel-tool-calls": "false"},
    ),
}


@pytest.mark.parametrize(
    ("tool", "parameters"),
    [
        # Go's zero values (api.Tool without Type, ToolFunctionParameters without
        # Type or Properties), read as Ollama reads them: a function without parameters.
        (
            {
                "type": "",
                "function": {"name": "now", "parameters": {"type": "", "properties": None}},
            },
            {"properties": {}},
        ),
        (NOW_TOOL, {"type": "object", "properties": {}}),
        (BARE_TOOL, None),
        (WEATHER, WEATHER["function"]["parameters"]),
    ],
)
def test_go_clients_zero_values_are_a_tool_without_parameters(
    tool: dict[str, Any], parameters: dict[str, Any] | None
) -> None:
    request = canonical_of("chat", {**CHAT, "tools": [tool]})
    sent = request.tools[0].parameters
    assert (json.loads(sent) if sent else None) == parameters


def nulled(value: Any) -> Any:
    """`value` with every "" and [] in its objects sent as null, as Go's zero values
    may arrive from a client (a nil slice is null; so is a JS client's null)."""
    if isinstance(value, dict):
        return {k: None if v in ("", []) else nulled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nulled(v) for v in value]
    return value


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("chat", {"model": "tiny", "messages": TOOL_TURNS, "tools": TOOLS}),
        ("generate", {"model": "tiny", "prompt": "Hi", "system": "", "suffix": "", "images": []}),
        ("embeddings", {"model": "tiny", "prompt": ""}),
    ],
)
def test_a_null_field_reads_as_absent_as_go_reads_it(kind: str, body: dict[str, Any]) -> None:
    """An assistant turn's `"content": null` beside its calls is "" (Go's zero value),
    not a 400."""
    sent = nulled(body)
    assert sent != body
    assert canonical_of(kind, sent) == canonical_of(kind, body)


def canonical_of(kind: str, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> Any:
    tool_headers = {
        "tool_choice": (headers or {}).get("x-blazar-tool-choice", ""),
        "parallel_tool_calls": (headers or {}).get("x-blazar-parallel-tool-calls", ""),
    }
    if kind == "chat":
        return convert.chat_request(parse(protocol.ChatRequest, body), **tool_headers)
    if kind == "generate":
        return convert.generate_request(parse(protocol.GenerateRequest, body), **tool_headers)
    if kind == "embed":
        return convert.embed_request(parse(protocol.EmbedRequest, body))
    return convert.embeddings_request(parse(protocol.EmbeddingsRequest, body))


@pytest.mark.parametrize("name", sorted(REQUEST_CASES))
def test_request_translation_matches_golden(name: str) -> None:
    kind, body = REQUEST_CASES[name]
    check_golden(
        f"request_{name}",
        {"kind": kind, "http_body": body, "canonical": message_json(canonical_of(kind, body))},
    )


@pytest.mark.parametrize("name", sorted(TOOL_REQUEST_CASES))
def test_tool_request_translation_matches_golden(name: str) -> None:
    body, headers = TOOL_REQUEST_CASES[name]
    check_golden(
        f"request_{name}",
        {
            "kind": "chat",
            "headers": headers,
            "http_body": body,
            "canonical": message_json(canonical_of("chat", body, headers=headers)),
        },
    )


OLLAMA_PREFILL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure: "}]
OLLAMA_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


@pytest.mark.parametrize(
    ("messages", "continued"),
    [
        (OLLAMA_PREFILL, True),
        ([*OLLAMA_PREFILL, {"role": "user", "content": "More"}], False),
        (CHAT["messages"], False),
    ],
)
def test_a_final_assistant_message_is_continued_as_ollama_does(
    messages: list[Any], continued: bool
) -> None:
    request = convert.chat_request(parse(protocol.ChatRequest, {**CHAT, "messages": messages}))
    assert request.continue_final_message is continued


@pytest.mark.parametrize(
    ("extra", "headers", "param"),
    [
        ({"format": "json"}, {}, "format"),
        ({"tools": [OLLAMA_WEATHER]}, {"tool_choice": "required"}, "x-blazar-tool-choice"),
        (
            {
                "tools": [OLLAMA_WEATHER],
                "messages": [
                    OLLAMA_PREFILL[0],
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "get_weather", "arguments": {}}}],
                    },
                ],
            },
            {},
            "messages[1].tool_calls",
        ),
    ],
)
def test_a_continuation_that_cannot_be_honoured_is_refused(
    extra: dict[str, Any], headers: dict[str, str], param: str
) -> None:
    body = {**CHAT, "messages": OLLAMA_PREFILL, **extra}
    with pytest.raises(errors.InvalidRequest) as caught:
        convert.chat_request(parse(protocol.ChatRequest, body), **headers)
    assert caught.value.metadata[validation.PARAM_KEY] == param


def test_options_not_sent_stay_unset() -> None:
    sampling = convert.chat_request(parse(protocol.ChatRequest, CHAT)).sampling
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens"):
        assert not sampling.HasField(name), name
    # Null is not set, even for an option Blazar would refuse.
    nulls = {**CHAT, "options": {"temperature": None, "mirostat": None, "stop": None}}
    assert convert.chat_request(parse(protocol.ChatRequest, nulls)).sampling == sampling
    assert not sampling.max_tokens_up_to_context
    # num_predict only bounds the generation; -1 (until the model stops) bounds nothing.
    bounded = {**CHAT, "options": {"num_predict": 4096}}
    assert convert.chat_request(
        parse(protocol.ChatRequest, bounded)
    ).sampling.max_tokens_up_to_context
    endless = {**CHAT, "options": {"num_predict": -1}}
    assert convert.chat_request(parse(protocol.ChatRequest, endless)).sampling == sampling
    zero = {**CHAT, "options": {"temperature": 0}}
    assert convert.chat_request(parse(protocol.ChatRequest, zero)).sampling.HasField("temperature")


@pytest.mark.parametrize(
    "off",
    [
        {"mirostat": 0},
        {"mirostat": 0.0, "mirostat_tau": 5.0, "mirostat_eta": 0.1},
        {"mirostat_tau": 5, "mirostat_eta": 0.1},
        {"typical_p": 1, "tfs_z": 1.0},
    ],
)
def test_sampler_options_turned_off_are_taken(off: dict[str, Any]) -> None:
    """Clients that send every option they have (LangChain's ChatOllama with
    `mirostat=0`) send Ollama's off values: they ask for nothing, and are served as if
    not sent."""
    plain = convert.chat_request(parse(protocol.ChatRequest, CHAT)).sampling
    sent = {**CHAT, "options": {**off, "temperature": None}}
    assert convert.chat_request(parse(protocol.ChatRequest, sent)).sampling == plain


def test_repeat_last_n_is_blazars_window_or_off() -> None:
    """Blazar's penalties look back over 64 tokens, Ollama's default `repeat_last_n`:
    64 asks for what Blazar does, and 0 turns the penalties off, as in Ollama's runner."""

    def sampling(options: dict[str, Any]) -> Any:
        return convert.chat_request(
            parse(protocol.ChatRequest, {**CHAT, "options": options})
        ).sampling

    penalized = {"repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2}
    assert sampling({**penalized, "repeat_last_n": 64}) == sampling(penalized)
    assert sampling(penalized).repeat_penalty == pytest.approx(1.3)
    assert sampling({**penalized, "repeat_last_n": 0}) == sampling({})
    assert sampling({"repeat_last_n": 64.0, "temperature": 0.5}) == sampling({"temperature": 0.5})
    # Off still checks what it turns off.
    with pytest.raises(errors.InvalidRequest, match=r"options\.repeat_penalty"):
        sampling({"repeat_last_n": 0, "repeat_penalty": 0})


# ---------------------------------------------------------------- refusals, by name

GEN = {"model": "tiny", "prompt": "Hi"}
A_CALL = {"function": {"name": "f", "arguments": {}}}
REFUSALS: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "chat",
        {**CHAT, "tools": [{"type": "custom", "function": {"name": "f"}}]},
        "tools[0].type",
        "'custom'",
    ),
    ("chat", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "Missing"),
    (
        "chat",
        {"model": "tiny", "messages": [{"role": "user", "tool_calls": [A_CALL]}]},
        "messages[0].tool_calls",
        "Only assistant messages",
    ),
    (
        "chat",
        {"model": "tiny", "messages": [{"role": "assistant", "tool_name": "f"}]},
        "messages[0].tool_name",
        "Only tool messages",
    ),
    (
        "chat",
        {"model": "tiny", "messages": [{"role": "user", "tool_call_id": "c"}]},
        "messages[0].tool_call_id",
        "Only tool messages",
    ),
    (
        "chat",
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                }
            ],
        },
        "messages[0].tool_calls[0].function.arguments",
        "dictionary",
    ),
    (
        "chat",
        {"model": "tiny", "messages": [{"role": "assistant", "tool_calls": [{}]}]},
        "messages[0].tool_calls[0].function",
        "Missing",
    ),
    ("generate", {**GEN, "tools": [WEATHER]}, "tools", "/api/chat"),
    (
        "chat",
        {"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
        "messages[0].images",
        "text-only",
    ),
    ("chat", {"model": "tiny", "messages": [{"role": "robot"}]}, "messages[0].role", "'robot'"),
    (
        "chat",
        {"model": "tiny", "messages": [{"role": "assistant", "thinking": "hmm"}]},
        "messages[0].thinking",
        "do not think",
    ),
    ("chat", {**CHAT, "think": True}, "think", "does not support thinking"),
    ("chat", {**CHAT, "think": "high"}, "think", "does not support thinking"),
    ("chat", {**CHAT, "truncate": True}, "truncate", "never cuts"),
    ("chat", {**CHAT, "shift": True}, "shift", "never cuts"),
    ("chat", {**CHAT, "_debug_render_only": True}, "_debug_render_only", "rendered prompt"),
    ("generate", {**GEN, "_debug_render_only": True}, "_debug_render_only", "rendered prompt"),
    ("chat", {**CHAT, "keep_alive": "soon"}, "keep_alive", "duration"),
    ("chat", {**CHAT, "keep_alive": "1 hour"}, "keep_alive", "duration"),
    ("chat", {**CHAT, "keep_alive": True}, "keep_alive", "duration"),
    ("chat", {**CHAT, "format": "yaml"}, "format", "'yaml'"),
    ("chat", {**CHAT, "top_logprobs": 2}, "top_logprobs", "'logprobs'"),
    ("chat", {**CHAT, "options": {"mirostat": 2}}, "options.mirostat", "send 0, off, or omit"),
    ("chat", {**CHAT, "options": {"mirostat": False}}, "options.mirostat", "sampler"),
    ("chat", {**CHAT, "options": {"typical_p": 0.9}}, "options.typical_p", "send 1, off"),
    ("chat", {**CHAT, "options": {"tfs_z": 0.5}}, "options.tfs_z", "sampler"),
    ("chat", {**CHAT, "options": {"repeat_last_n": -1}}, "options.repeat_last_n", "send 64, or 0"),
    ("generate", {**GEN, "options": {"repeat_last_n": 128}}, "options.repeat_last_n", "last 64"),
    (
        "chat",
        {**CHAT, "options": {"mirostat_tau": 4.0, "mirostat": 1}},
        "options.mirostat_tau",
        "only with mirostat 0",
    ),
    ("chat", {**CHAT, "options": {"num_gpu": 99}}, "options.num_gpu", "gpuLayers"),
    ("chat", {**CHAT, "options": {"use_mmap": True}}, "options.use_mmap", "engine setting"),
    (
        "chat",
        {**CHAT, "options": {"draft_num_predict": 4}},
        "options.draft_num_predict",
        "maxDraftTokens",
    ),
    ("chat", {**CHAT, "options": {"flavour": 1}}, "options.flavour", "not an option"),
    ("chat", {**CHAT, "options": {"temperature": "hot"}}, "options.temperature", "not a number"),
    ("chat", {**CHAT, "options": {"temperature": -1}}, "options.temperature", "at least 0"),
    ("chat", {**CHAT, "options": {"top_p": 1.5}}, "options.top_p", "at most 1"),
    ("chat", {**CHAT, "options": {"top_k": 2.5}}, "options.top_k", "not an integer"),
    ("chat", {**CHAT, "options": {"seed": True}}, "options.seed", "not an integer"),
    ("chat", {**CHAT, "options": {"repeat_penalty": 0}}, "options.repeat_penalty", "more than 0"),
    ("chat", {**CHAT, "options": {"num_predict": -3}}, "options.num_predict", "at least -2"),
    ("chat", {**CHAT, "options": {"num_ctx": 0}}, "options.num_ctx", "at least 1"),
    # An integer's bound is written out whole, not rounded as 2.14748e+09.
    (
        "chat",
        {**CHAT, "options": {"num_ctx": 2**31}},
        "options.num_ctx",
        "at most 2147483647.",
    ),
    (
        "chat",
        {**CHAT, "options": {"num_predict": 2**31}},
        "options.num_predict",
        "at most 2147483647.",
    ),
    ("chat", {**CHAT, "options": {"stop": [1]}}, "options.stop", "list of strings"),
    ("generate", {**GEN, "suffix": "end"}, "suffix", "fill in"),
    ("generate", {**GEN, "template": "{{ range .Messages }}{{ end }}"}, "template", "range"),
    ("generate", {**GEN, "raw": True, "template": "{{ .Prompt }}"}, "template", "raw"),
    ("generate", {**GEN, "images": ["aGk="]}, "images", "text-only"),
    ("generate", {**GEN, "context": [1, 2]}, "context", "/api/chat"),
    ("generate", {**GEN, "width": 512}, "width", "image generation"),
    ("generate", {**GEN, "height": 512}, "height", "image generation"),
    ("generate", {**GEN, "steps": 20}, "steps", "image generation"),
    ("generate", {**GEN, "raw": True, "system": "x"}, "system", "raw"),
    ("embed", {"model": "tiny", "input": "a", "truncate": True}, "truncate", "never cuts"),
    (
        "embed",
        {"model": "tiny", "input": "a", "options": {"temperature": 1}},
        "options.temperature",
        "only num_ctx",
    ),
    (
        "embeddings",
        {"model": "tiny", "prompt": "a", "keep_alive": "5 minutes"},
        "keep_alive",
        "duration",
    ),
]


@pytest.mark.parametrize(("kind", "body", "param", "says"), REFUSALS)
def test_what_blazar_cannot_honour_is_refused_by_name(
    kind: str, body: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        canonical_of(kind, body)
    assert info.value.metadata[validation.PARAM_KEY] == param
    assert says in info.value.message
    assert render.error_response(info.value).status == 400


NAMES = ("get_weather", "get_time")
MODE = inference_pb2.ToolChoice


@pytest.mark.parametrize(
    ("header", "tools", "mode", "name"),
    [
        ("", NAMES, None, ""),
        ("  ", (), None, ""),
        ("auto", NAMES, MODE.MODE_AUTO, ""),
        ("none", NAMES, MODE.MODE_NONE, ""),
        ("none", (), MODE.MODE_NONE, ""),
        ("auto", (), MODE.MODE_AUTO, ""),
        ("required", NAMES, MODE.MODE_REQUIRED, ""),
        (" get_time ", NAMES, MODE.MODE_NAMED, "get_time"),
    ],
)
def test_the_tool_choice_header(
    header: str, tools: tuple[str, ...], mode: int | None, name: str
) -> None:
    choice = context.tool_choice(header, tools=tools)
    if mode is None:
        assert choice is None
        return
    assert choice == inference_pb2.ToolChoice(mode=mode, name=name)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("header", "tools", "says"),
    [
        ("Required", NAMES, "'Required' is not auto, none, required or the name of a tool"),
        ("get_wether", NAMES, "the request's tools: get_weather, get_time"),
        ("get_time", (), "the request has no tools"),
        ("required", (), "needs tools to call"),
        ("any", NAMES, "'any'"),
    ],
)
def test_a_bad_tool_choice_header_is_refused_naming_it(
    header: str, tools: tuple[str, ...], says: str
) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        context.tool_choice(header, tools=tools)
    assert info.value.metadata[validation.PARAM_KEY] == "x-blazar-tool-choice"
    assert "x-blazar-tool-choice" in info.value.message
    assert says in info.value.message


def test_generate_takes_no_forced_tool_choice() -> None:
    none = {"x-blazar-tool-choice": "none"}
    assert canonical_of("generate", GEN, headers=none).messages[0].content == "Hi"
    with pytest.raises(errors.InvalidRequest, match="needs tools"):
        canonical_of("generate", GEN, headers={"x-blazar-tool-choice": "required"})


@pytest.mark.parametrize(("header", "parallel"), [("", None), ("true", True), (" false", False)])
def test_the_parallel_tool_calls_header(header: str, parallel: bool | None) -> None:
    assert context.parallel_tool_calls(header) is parallel
    sent = canonical_of("chat", CHAT, headers={"x-blazar-parallel-tool-calls": header})
    assert sent.HasField("parallel_tool_calls") is (parallel is not None)


@pytest.mark.parametrize("header", ["False", "0", "no", "yes please"])
def test_a_bad_parallel_tool_calls_header_is_refused_naming_it(header: str) -> None:
    for kind, body in (("chat", CHAT), ("generate", GEN)):
        with pytest.raises(errors.InvalidRequest) as info:
            canonical_of(kind, body, headers={"x-blazar-parallel-tool-calls": header})
        assert info.value.metadata[validation.PARAM_KEY] == "x-blazar-parallel-tool-calls"
        assert f"{header.strip()!r}" in info.value.message


@pytest.mark.parametrize(
    ("keep_alive", "seconds"),
    [(None, None), (-1, -1.0), (-0.5, -1.0), ("-1", -1.0), ("-1m", -1.0), ("-1h30m", -1.0),
     (0, 0.0), ("0", 0.0), ("0s", 0.0), (300, 300.0), ("300", 300.0), (2.5, 2.5),
     ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5), ("250ms", 0.25), ("+10s", 10.0),
     ("-x", "refused"), ("5", 5.0), ("5 m", "refused"), ("m", "refused"), (True, "refused"),
     (float("nan"), "refused"), (float("inf"), "refused")],
)  # fmt: skip
def test_keep_alive_in_seconds(keep_alive: Any, seconds: float | str | None) -> None:
    """Ollama's keep_alive as the canonical keep_alive_s: a negative one is -1 (keep
    loaded), 0 unloads, a number is seconds, text a Go duration or a number."""
    if seconds == "refused":
        with pytest.raises(errors.InvalidRequest) as info:
            convert.keep_alive_seconds(keep_alive)
        assert info.value.metadata[validation.PARAM_KEY] == "keep_alive"
    else:
        assert convert.keep_alive_seconds(keep_alive) == seconds


def test_keep_alive_travels_on_every_canonical_request() -> None:
    chat = canonical_of("chat", {**CHAT, "keep_alive": "5m"})
    assert chat.HasField("keep_alive_s") and chat.keep_alive_s == 300.0
    generate = canonical_of("generate", {**GEN, "keep_alive": 0})
    assert generate.HasField("keep_alive_s") and generate.keep_alive_s == 0.0
    raw = canonical_of("generate", {**GEN, "raw": True, "keep_alive": -1})
    assert raw.keep_alive_s == -1.0
    embed = canonical_of("embed", {"model": "tiny", "input": "a", "keep_alive": "10s"})
    assert embed.keep_alive_s == 10.0
    assert not canonical_of("chat", CHAT).HasField("keep_alive_s")


@pytest.mark.parametrize(("num_ctx", "fits"), [(1, True), (2048, True), (2049, False)])
def test_num_ctx_up_to_the_lanes_context_per_slot(num_ctx: int, fits: bool) -> None:
    if fits:
        options.check_num_ctx(num_ctx, MODELS[0])
        return
    with pytest.raises(errors.ContextLengthExceeded) as info:
        options.check_num_ctx(num_ctx, MODELS[0])
    # Both numbers, and where the smaller one comes from.
    assert "2049" in info.value.message and "contextPerSlot 2048" in info.value.message
    assert "'tiny'" in info.value.message


def test_num_ctx_on_an_upstream_lane_is_the_upstreams_to_refuse() -> None:
    """An upstream Lane's context is its upstream's: refusing num_ctx 8192 against the
    2,048 default, and telling the caller to raise contextPerSlot (which apply refuses
    on an upstream Lane), was wrong on both counts (found through llama-server)."""
    remote = inference_pb2.ModelInfo()
    remote.CopyFrom(MODELS[0])
    remote.upstream = True
    options.check_num_ctx(131072, remote)


S, P = "SYS", "PROMPT"
TEMPLATES: list[tuple[str, str, str]] = [
    # (template, system, rendered)
    ("{{ .Prompt }}", S, P),
    ("[{{ .System }}] {{ .Prompt }}", S, f"[{S}] {P}"),
    ("{{ if .System }}<s>{{ .System }}</s>{{ end }}<u>{{ .Prompt }}", S, f"<s>{S}</s><u>{P}"),
    ("{{ if .System }}<s>{{ .System }}</s>{{ end }}<u>{{ .Prompt }}", "", f"<u>{P}"),
    ("{{ if .System }}A{{ else }}B{{ end }}{{ .Prompt }}", "", f"B{P}"),
    ("{{ if .System }}A{{ if .Prompt }}C{{ end }}{{ else }}B{{ end }}", S, "AC"),
    ("{{ if .System }}A{{ if .Prompt }}C{{ else }}D{{ end }}{{ end }}E", "", "E"),
    # Cut where the answer goes: what follows {{ .Response }} is not the prompt.
    ("<u>{{ .Prompt }}</u>\n<m>{{ .Response }}</m>\n", S, f"<u>{P}</u>\n<m>"),
    # Go's trim markers.
    ("<u>\n  {{- .Prompt -}}  \n</u>", S, f"<u>{P}</u>"),
    ("{{.Prompt}}", S, P),
]


@pytest.mark.parametrize(("source", "system", "rendered"), TEMPLATES)
def test_legacy_templates_render_as_ollama_does(source: str, system: str, rendered: str) -> None:
    assert template.render(source, system=system, prompt=P) == rendered


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("{{ range .Messages }}{{ .Content }}{{ end }}", "{{ range .Messages }}"),
        ("{{ .Messages }}", "{{ .Messages }}"),
        ("{{ if .System }}x", "without its {{ end }}"),
        ("x{{ end }}", "without its {{ if }}"),
        ("{{ .Prompt", "unclosed"),
        ('{{ printf "%s" .Prompt }}', "printf"),
    ],
)
def test_other_template_actions_are_refused_naming_them(source: str, says: str) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        template.render(source, system="", prompt="")
    assert says in info.value.message
    assert info.value.metadata[validation.PARAM_KEY] == "template"


# ---------------------------------------------------------------- responses out, pure


def test_statistics_are_nanoseconds_from_the_canonical_figures() -> None:
    assert render.metrics(final().final) == {
        "total_duration": 55_000_000,  # time to first token + decode
        "load_duration": 1_500_000,  # queue
        "prompt_eval_count": 7,
        "prompt_eval_duration": 20_250_000,
        "eval_count": 3,
        # Decode, and the first token's own 3.25 ms past the queue and prefill.
        "eval_duration": 33_250_000,
    }
    one_token = inference_pb2.Final(
        usage=inference_pb2.Usage(prompt_tokens=7, completion_tokens=1),
        timings=inference_pb2.Timings(queue_ms=1, prefill_ms=20, ttft_ms=21.5, decode_ms=0),
    )
    # One token took time too, as Ollama reports it: eval_count / eval_duration is a rate.
    assert render.metrics(one_token)["eval_duration"] == 500_000
    parked = inference_pb2.Final(
        timings=inference_pb2.Timings(
            queue_ms=1, prefill_ms=2, ttft_ms=4, decode_ms=10, parked_ms=100
        )
    )
    # Parked after the first token: the total counts the time parked, the generation not.
    assert render.metrics(parked)["total_duration"] == 113_000_000
    assert render.metrics(parked)["eval_duration"] == 10_000_000
    waited = inference_pb2.Final(
        timings=inference_pb2.Timings(
            queue_ms=1, prefill_wait_ms=3, prefill_ms=2, ttft_ms=6, decode_ms=10, parked_ms=100
        )
    )
    # The wait behind other prompts is part of the total, not of the prompt's evaluation.
    metrics = render.metrics(waited)
    assert (metrics["total_duration"], metrics["prompt_eval_duration"]) == (116_000_000, 2_000_000)


def test_lines_render_text_then_a_final_line_with_statistics() -> None:
    lines = render.Lines("generate", model="tiny", clock=lambda: "T")
    rendered = [obj for chunk in [delta(""), *HELLO] for obj in lines.render(chunk)]
    assert [line.get("response") for line in rendered] == ["Hel", "lo", ""]
    assert [line["done"] for line in rendered] == [False, False, True]
    assert rendered[-1]["done_reason"] == "stop"
    assert rendered[-1]["eval_count"] == 3
    assert lines.finished


def test_a_generation_cut_by_its_length_says_so() -> None:
    collected = canonical.Answer()
    for chunk in (delta("ab"), final(inference_pb2.FINISH_REASON_LENGTH)):
        collected.add(chunk)
    out = render.answer("chat", collected, model="tiny", created_at="T")
    assert out["done_reason"] == "length"
    assert out["message"] == {"role": "assistant", "content": "ab"}  # type: ignore[typeddict-item]


def test_a_collected_stream_without_its_end_is_an_error() -> None:
    collected = canonical.Answer()
    collected.add(delta("ab"))
    with pytest.raises(errors.Unavailable):
        render.answer("chat", collected, model="tiny", created_at="T")


def test_timestamps_are_rfc3339_in_utc() -> None:
    assert render.timestamp(NOW) == "2026-01-02T03:04:05.678901Z"


@pytest.mark.parametrize("dimensions", [None, 1, 64])
def test_embed_asks_the_engine_for_its_dimensions(dimensions: int | None) -> None:
    body = protocol.EmbedRequest(model="m", input="a", dimensions=dimensions)
    request = convert.embed_request(body)
    assert request.normalize
    assert (request.dimensions if request.HasField("dimensions") else None) == dimensions


@pytest.mark.parametrize("name", ["tags", "show", "ps"])
def test_model_listings_match_golden(name: str) -> None:
    listed = inference_pb2.ListModelsResponse(models=MODELS)
    if name == "tags":
        document: Any = listing.tags(listed)
    elif name == "show":
        document = listing.show(listing.model_info(listed, "tiny:270m"))
    else:
        document = listing.ps(listed, now=NOW)
    check_golden(f"response_{name}", document)


def test_ps_lists_each_serving_lane_once_and_forever() -> None:
    listed = inference_pb2.ListModelsResponse(models=MODELS)
    (running,) = listing.ps(listed, now=NOW)["models"]
    assert running["name"] == "tiny"  # the Lane's name, not each alias; "paused" is not running
    assert running["expires_at"].startswith("2318-")  # Ollama's "forever"


@pytest.mark.parametrize(
    ("sleeps_in_s", "expires"),
    [
        (300.0, "2026-01-02T03:09:05.678901Z"),  # idle.sleepAfter or keep_alive "5m"
        (0.0, "2026-01-02T03:04:05.678901Z"),  # keep_alive 0: asleep once idle
        (1e300, "2318-"),  # past Ollama's forever: forever
    ],
)
def test_ps_expires_when_the_lane_will_sleep(sleeps_in_s: float, expires: str) -> None:
    """It said forever for every Lane, even one idle.sleepAfter or a keep_alive was
    about to put to sleep."""
    models = [inference_pb2.ModelInfo() for _ in MODELS]
    for copy, info in zip(models, MODELS, strict=True):
        copy.CopyFrom(info)
        copy.sleeps_in_s = sleeps_in_s
    (running,) = listing.ps(inference_pb2.ListModelsResponse(models=models), now=NOW)["models"]
    assert running["expires_at"].startswith(expires)


# ---------------------------------------------------------------- routes

TOOL_CHAT = {**CHAT, "tools": [WEATHER, NOW_TOOL]}
STREAM_CASES: dict[str, tuple[str, dict[str, Any], list[Any]]] = {
    "chat_tool_calls_stream": (
        "/api/chat",
        TOOL_CHAT,
        [
            *CALLS,
            calling(1, arguments='C"}'),
            final(inference_pb2.FINISH_REASON_TOOL_CALLS, tool_calls=2),
        ],
    ),
    "chat_tool_calls_no_stream": (
        "/api/chat",
        {**TOOL_CHAT, "stream": False},
        [
            *CALLS,
            calling(1, arguments='C"}'),
            final(inference_pb2.FINISH_REASON_TOOL_CALLS, tool_calls=2),
        ],
    ),
    # num_predict cut the second call: only the first is whole, and only it goes out.
    "chat_tool_call_cut_stream": (
        "/api/chat",
        TOOL_CHAT,
        [*CALLS, final(inference_pb2.FINISH_REASON_LENGTH, tool_calls=1)],
    ),
    "chat_tool_call_cut_no_stream": (
        "/api/chat",
        {**TOOL_CHAT, "stream": False},
        [*CALLS, final(inference_pb2.FINISH_REASON_LENGTH, tool_calls=1)],
    ),
    "chat_stream": ("/api/chat", CHAT, HELLO),
    "chat_no_stream": ("/api/chat", {**CHAT, "stream": False}, HELLO),
    "generate_stream": ("/api/generate", GEN, HELLO),
    "generate_no_stream": ("/api/generate", {**GEN, "stream": False}, HELLO),
    "chat_stream_failing_midway": (
        "/api/chat",
        CHAT,
        [delta("Hel"), errors.Unavailable("Lost the engine of replica 0.")],
    ),
    "generate_stream_truncated": ("/api/generate", GEN, [delta("Hel")]),
    # The calls' deltas came, but not the final chunk that says which are whole.
    "chat_tool_calls_stream_truncated": ("/api/chat", TOOL_CHAT, CALLS),
}


def normalise(obj: dict[str, Any]) -> dict[str, Any]:
    if "created_at" in obj:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", obj["created_at"])
        obj = {**obj, "created_at": "<now>"}
    return obj


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
async def test_generation_matches_golden(
    name: str, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    path, body, script = STREAM_CASES[name]
    daemon.fake.scripts["tiny"] = script
    response = await client.post(path, json=body)
    assert response.status_code == 200
    if body.get("stream") is False:
        assert response.headers["content-type"] == "application/json"
        out: Any = normalise(response.json())
    else:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        assert response.text.endswith("\n")
        out = [normalise(json.loads(line)) for line in response.text.splitlines()]
    check_golden(
        f"generation_{name}",
        {"path": path, "http_body": body, "chunks": fake_inference.script_json(script), "out": out},
    )


def test_a_streamed_call_goes_out_whole_once_the_final_chunk_says_so() -> None:
    lines = render.Lines("chat", model="tiny", clock=lambda: "T")
    before = [line for chunk in CALLS for line in lines.render(chunk)]
    # Only the text streamed: no call, nor any part of one, before the end.
    assert [line["message"] for line in before] == [  # type: ignore[typeddict-item]
        {"role": "assistant", "content": "Checking. "}
    ]
    end = lines.render(final(inference_pb2.FINISH_REASON_LENGTH, tool_calls=1))
    assert [line["done"] for line in end] == [False, True]
    assert end[0]["message"]["tool_calls"] == [  # type: ignore[typeddict-item]
        {
            "id": "call_0123456789abcdef01234567",
            "function": {
                "index": 0,
                "name": "get_weather",
                "arguments": {"city": "Paris", "days": 2},
            },
        }
    ]
    assert end[1]["done_reason"] == "length"


async def test_the_tool_headers_reach_the_daemon(daemon: Daemon, client: httpx.AsyncClient) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    sent = {**TOOL_CHAT, "stream": False}
    for header, expected in [
        ("required", inference_pb2.ToolChoice(mode=MODE.MODE_REQUIRED)),
        ("get_time", inference_pb2.ToolChoice(mode=MODE.MODE_NAMED, name="get_time")),
    ]:
        response = await client.post(
            "/api/chat",
            json=sent,
            headers={"x-blazar-tool-choice": header, "x-blazar-parallel-tool-calls": "false"},
        )
        assert response.status_code == 200
        assert daemon.fake.requests[-1].tool_choice == expected
        assert daemon.fake.requests[-1].parallel_tool_calls is False
    refused = await client.post("/api/chat", json=sent, headers={"x-blazar-tool-choice": "nope"})
    assert refused.status_code == 400
    assert set(refused.json()) == {"error"}
    assert "x-blazar-tool-choice" in refused.json()["error"] and "'nope'" in refused.json()["error"]
    assert len(daemon.fake.requests) == 2


async def test_a_body_that_declares_no_type_is_read_as_json(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Ollama parses a body as JSON whatever it declares, and LiteLLM's `ollama_chat`
    provider sends its bodies without a Content-Type (its async client: as
    `application/octet-stream`)."""
    daemon.fake.scripts["tiny"] = HELLO
    for declared in [None, "application/octet-stream"]:
        request = client.build_request(
            "POST", "/api/chat", content=json.dumps({**CHAT, "stream": False}).encode()
        )
        del request.headers["content-type"]
        if declared is not None:
            request.headers["content-type"] = declared
        response = await client.send(request)
        assert response.status_code == 200, response.text
        assert response.json()["done"] is True
    assert len(daemon.fake.requests) == 2


async def test_the_session_and_slo_headers_reach_the_daemon(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    headers = {"x-blazar-session": "s-1", "x-blazar-slo": "batch"}
    for path, body in [
        ("/api/chat", CHAT),
        ("/api/generate", GEN),
        ("/api/generate", {**GEN, "raw": True}),
    ]:
        response = await client.post(path, json={**body, "stream": False}, headers=headers)
        assert response.status_code == 200
    assert [(r.session, r.slo) for r in daemon.fake.requests] == [("s-1", "batch")] * 3
    assert isinstance(daemon.fake.requests[-1], inference_pb2.CompleteRequest)


async def test_an_error_before_the_first_chunk_keeps_its_status(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = [errors.Overloaded("Busy.", metadata={"retry_after_ms": "2500"})]
    for stream in (True, False):
        response = await client.post("/api/chat", json={**CHAT, "stream": stream})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "3"
        assert response.json() == {"error": "Busy."}


async def test_a_prompt_over_the_context_is_told_in_ollamas_terms(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded.of(prompt_tokens=3000, max_tokens=100, context_length=2048)
    ]
    response = await client.post("/api/chat", json=CHAT)
    assert response.status_code == 400
    assert response.json() == {
        "error": "This model's maximum context length is 2048 tokens per request, but the request needs 3100 "
        "(3000 in the prompt and 100 to generate). Shorten the prompt."
    }


async def test_a_prompt_over_num_ctx_is_told_naming_num_ctx(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Refused as a prompt over the Lane's context is (400, both sizes), naming the
    request's own num_ctx as the context it did not fit."""
    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded.of(
            prompt_tokens=30, max_tokens=1, context_length=16, requested=True
        )
    ]
    response = await client.post("/api/chat", json={**CHAT, "options": {"num_ctx": 16}})
    assert response.status_code == 400
    assert response.json() == {
        "error": "The request's options.num_ctx is 16 tokens, but the request needs 31 (30 in "
        "the prompt and 1 to generate). Shorten the prompt or raise num_ctx."
    }


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
@pytest.mark.parametrize("stream", [True, False])
async def test_num_ctx_below_the_lane_bounds_the_requests_context(
    path: str, stream: bool, daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Ollama sizes the context by num_ctx: the daemon is asked to keep the prompt and
    the generation within it (`Sampling.context_limit`), not the Lane's 2048."""
    daemon.fake.scripts["tiny"] = HELLO
    request = CHAT if path == "/api/chat" else GEN
    response = await client.post(
        path, json={**request, "stream": stream, "options": {"num_ctx": 64, "num_predict": 500}}
    )
    assert response.status_code == 200, response.text
    (sent,) = daemon.fake.requests
    assert sent.sampling.context_limit == 64
    assert sent.sampling.max_tokens == 500 and sent.sampling.max_tokens_up_to_context


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/embed", {"model": "tiny", "input": ["a", "b"]}),
        ("/api/embeddings", {"model": "tiny", "prompt": "a"}),
    ],
)
async def test_num_ctx_below_the_lane_bounds_each_input_embedded(
    path: str, body: dict[str, Any], daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Ollama embeds within num_ctx (cutting a longer input where Blazar refuses it)."""
    daemon.fake.scripts["tiny"] = []
    response = await client.post(path, json={**body, "options": {"num_ctx": 16}})
    assert response.status_code == 200, response.text
    (sent,) = daemon.fake.requests
    assert isinstance(sent, inference_pb2.EmbedRequest) and sent.context_limit == 16


async def test_an_input_over_num_ctx_is_told_naming_num_ctx(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded(
            "Input 1 is 30 tokens long, but the request asked for a context of 16 tokens "
            "(context_limit). Shorten or split it.",
            metadata={
                "prompt_tokens": "30",
                "context_length": "16",
                "input": "1",
                errors.CONTEXT_LIMIT_KEY: "16",
            },
        )
    ]
    response = await client.post(
        "/api/embed", json={"model": "tiny", "input": ["a", "b"], "options": {"num_ctx": 16}}
    )
    assert response.status_code == 400
    assert response.json() == {
        "error": "Input 1 is 30 tokens long, but the request's options.num_ctx is 16 tokens. "
        "Shorten or split it, or raise num_ctx."
    }


def test_num_ctx_is_no_bound_sent_to_an_upstream_lane() -> None:
    """An upstream server sizes its own context, which Blazar does not know."""
    remote = inference_pb2.ModelInfo()
    remote.CopyFrom(MODELS[0])
    remote.upstream = True
    local = inference_pb2.Sampling(context_limit=64)
    options.bound_context(local, MODELS[0])
    assert local.context_limit == 64
    upstream = inference_pb2.Sampling(context_limit=64)
    options.bound_context(upstream, remote)
    assert not upstream.HasField("context_limit")


async def test_a_bound_on_the_prompt_stays_a_bound_in_ollamas_terms(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """A prompt refused by its length in bytes, untokenized, has a lower bound for a
    count: the answer says "at least", as the daemon's does."""
    daemon.fake.scripts["tiny"] = [
        errors.ContextLengthExceeded.of(
            prompt_tokens=4167, max_tokens=5, context_length=1024, at_least=True
        )
    ]
    response = await client.post("/api/chat", json=CHAT)
    assert response.status_code == 400
    assert response.json()["error"] == (
        "This model's maximum context length is 1024 tokens per request, but the request needs at least "
        "4172 (at least 4167 in the prompt and 5 to generate). Shorten the prompt."
    )


async def test_unknown_model_is_404(daemon: Daemon, client: httpx.AsyncClient) -> None:
    for path, body in [
        ("/api/chat", {**CHAT, "model": "nope"}),
        ("/api/chat", {"model": "nope", "messages": []}),  # a preload
        ("/api/generate", {"model": "nope", "prompt": "x", "stream": False}),
        ("/api/embed", {"model": "nope", "input": "x"}),
        ("/api/show", {"model": "nope"}),
        ("/api/chat", {**CHAT, "model": "nope", "options": {"num_ctx": 10}}),
    ]:
        response = await client.post(path, json=body)
        assert response.status_code == 404, (path, body)
        assert "nope" in response.json()["error"]


async def test_num_ctx_over_the_lane_is_a_400_before_generating(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    daemon.fake.scripts["tiny"] = HELLO
    body = {**CHAT, "options": {"num_ctx": 4096}}
    response = await client.post("/api/chat", json=body)
    assert response.status_code == 400
    assert "4096" in response.json()["error"] and "2048" in response.json()["error"]
    assert daemon.fake.requests == []
    fits = await client.post(
        "/api/chat", json={**CHAT, "stream": False, "options": {"num_ctx": 2048}}
    )
    assert fits.status_code == 200


async def test_a_preload_answers_load_without_generating(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    for path, body in [
        ("/api/chat", {"model": "tiny", "messages": []}),
        # Go's api.ChatRequest{Model: m} (no omitempty on messages), as Ollama reads it.
        ("/api/chat", {"model": "tiny", "messages": None, "options": None}),
        ("/api/generate", {"model": "tiny"}),
        ("/api/generate", {"model": "tiny", "prompt": None, "system": None}),
    ]:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["done"] is True
        assert response.json()["done_reason"] == "load"
    assert daemon.fake.requests == []
    assert [k.HasField("keep_alive_s") for k in daemon.fake.keep_alives] == [False] * 4


@pytest.mark.parametrize(
    ("path", "extra", "fragment"),
    [
        ("/api/generate", {"options": {"mirostat": 2}}, "'options.mirostat'"),
        ("/api/chat", {"options": {"temperature": -1}}, "'options.temperature'"),
        ("/api/chat", {"options": {"num_ctx": 4096}}, "4096"),
        ("/api/generate", {"format": "xml"}, "'format'"),
        # The engine refuses such a schema on a generation; a preload reaches none.
        ("/api/generate", {"format": {"type": "object", "properties": 5}}, "not a valid JSON Schema['properties']"),
        ("/api/chat", {"format": {"type": "strin"}}, "not a valid JSON Schema['type']"),
        ("/api/chat", {"think": True}, "thinking"),
        ("/api/generate", {"images": ["aGk="]}, "'images'"),
        ("/api/generate", {"suffix": "x", "keep_alive": 0}, "'suffix'"),
    ],
)  # fmt: skip
async def test_a_preload_refuses_what_a_generation_would(
    daemon: Daemon, client: httpx.AsyncClient, path: str, extra: dict[str, Any], fragment: str
) -> None:
    """A preload is not a way around the checks: Ollama reads its options, format and
    the model's capabilities before it loads, so a field Blazar would refuse on a
    generation is refused here too, rather than answered "load" and dropped."""
    response = await client.post(path, json={"model": "tiny", **extra})
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]
    assert daemon.fake.keep_alives == [] and daemon.fake.requests == []


async def test_keep_alive_0_without_a_prompt_unloads(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """Ollama's unload idiom answers as Ollama does (done_reason "unload") and asks the
    daemon to put the Lane to sleep; nothing is generated."""
    chat = await client.post("/api/chat", json={"model": "tiny", "messages": [], "keep_alive": 0})
    assert chat.status_code == 200
    body = chat.json()
    assert body["message"] == {"role": "assistant", "content": ""}
    assert (body["done"], body["done_reason"], body["model"]) == (True, "unload", "tiny")
    generate = await client.post("/api/generate", json={"model": "tiny", "keep_alive": "0s"})
    assert generate.status_code == 200
    assert generate.json()["response"] == "" and generate.json()["done_reason"] == "unload"
    assert [k.keep_alive_s for k in daemon.fake.keep_alives] == [0.0, 0.0]
    assert daemon.fake.requests == []
    loaded = await client.post("/api/generate", json={"model": "tiny", "keep_alive": "10m"})
    assert loaded.json()["done_reason"] == "load"
    assert daemon.fake.keep_alives[-1].keep_alive_s == 600.0


async def test_debug_render_only_points_to_a_template_only_where_one_is_shown(
    client: httpx.AsyncClient,
) -> None:
    refused = await client.post("/api/chat", json={**CHAT, "_debug_render_only": True})
    assert refused.status_code == 400
    shown = (await client.post("/api/show", json={"model": "tiny"})).json()
    assert ("/api/show" in refused.json()["error"]) == ("template" in shown)


async def test_a_bad_body_is_400_naming_the_field(client: httpx.AsyncClient) -> None:
    response = await client.post("/api/chat", json={"model": "tiny", "messages": "hi"})
    assert response.status_code == 400
    assert "messages" in response.json()["error"]
    response = await client.post("/api/chat", content=b"{")
    assert response.status_code == 400


async def test_embed_and_the_older_embeddings(daemon: Daemon, client: httpx.AsyncClient) -> None:
    daemon.fake.scripts["tiny"] = []
    daemon.fake.embeddings = inference_pb2.EmbedResponse(
        embeddings=[inference_pb2.Embedding(values=[0.6, 0.8], tokens=3)], prompt_tokens=3
    )
    response = await client.post("/api/embed", json={"model": "tiny", "input": "hi"})
    total = response.json()["total_duration"]
    assert isinstance(total, int) and 0 < total < 10**10
    assert response.json() == {
        "model": "tiny",
        "embeddings": [[pytest.approx(0.6), pytest.approx(0.8)]],
        "total_duration": total,
        "prompt_eval_count": 3,
    }
    old = await client.post("/api/embeddings", json={"model": "tiny", "prompt": "hi"})
    assert old.json() == {"embedding": [pytest.approx(0.6), pytest.approx(0.8)]}
    # /api/embed normalizes, as Ollama does; /api/embeddings does not.
    assert [r.normalize for r in daemon.fake.requests] == [True, False]
    # Nothing to embed: Ollama's preload, answered without embedding.
    empty = await client.post("/api/embed", json={"model": "tiny", "input": []})
    assert empty.json()["embeddings"] == []
    empty_old = await client.post("/api/embeddings", json={"model": "tiny", "prompt": ""})
    assert empty_old.json() == {"embedding": []}
    assert len(daemon.fake.requests) == 2


async def test_embed_with_nothing_to_embed_is_a_preload(
    daemon: Daemon, client: httpx.AsyncClient
) -> None:
    """As in Ollama, an empty or absent `input` loads the model (the `ollama` client's
    `embed(model)` sends `input: ""`) and its keep_alive acts, as on chat and generate."""
    daemon.fake.scripts["tiny"] = []
    for body in (
        {"model": "tiny", "input": ""},
        {"model": "tiny"},
        # Go's api.EmbedRequest{Model: m}: `input` is an interface, nil is null.
        {"model": "tiny", "input": None, "options": None},
        {"model": "tiny", "input": [], "keep_alive": 0},
    ):
        response = await client.post("/api/embed", json=body)
        assert response.status_code == 200, (body, response.text)
        assert response.json()["embeddings"] == []
    old = await client.post("/api/embeddings", json={"model": "tiny", "keep_alive": "10m"})
    assert old.json() == {"embedding": []}
    assert daemon.fake.requests == []
    sent = [(k.model, k.keep_alive_s if k.HasField("keep_alive_s") else None)
            for k in daemon.fake.keep_alives]  # fmt: skip
    assert sent == [("tiny", None)] * 3 + [("tiny", 0.0), ("tiny", 600.0)]
    unknown = await client.post("/api/embed", json={"model": "nope", "input": ""})
    assert unknown.status_code == 404


async def test_listings(client: httpx.AsyncClient) -> None:
    tags = (await client.get("/api/tags")).json()
    assert [m["name"] for m in tags["models"]] == ["tiny", "tiny:270m", "paused"]
    show = await client.post("/api/show", json={"name": "tiny:270m"})  # the older spelling
    assert show.json()["details"]["quantization_level"] == "Q4_K_M"
    ps = (await client.get("/api/ps")).json()
    assert [m["name"] for m in ps["models"]] == ["tiny"]


async def test_head_on_a_real_server_has_no_body(daemon: Daemon) -> None:
    shim = fake_inference.uvicorn_shim(daemon.target)
    async with shim as base, httpx.AsyncClient(base_url=base) as http:
        for path in ("/", "/api/version", "/api/tags"):
            response = await http.head(path)
            assert (response.status_code, response.content) == (200, b""), path


async def test_server_probes(client: httpx.AsyncClient) -> None:
    root = await client.get("/")
    assert (root.status_code, root.text) == (200, "Ollama is running")
    assert (await client.head("/")).status_code == 200
    version = (await client.get("/api/version")).json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert (await client.head("/api/version")).status_code == 200
    # Clients read it as Ollama's version and refuse an old one: GitHub Copilot's
    # Ollama provider wants 0.6.4 at least. Blazar's own (0.x) would read as too old.
    assert tuple(int(part) for part in version.split(".")) >= (0, 6, 4)
    assert version == protocol.API_VERSION


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"),
     ("POST", "/api/copy"), ("DELETE", "/api/delete")],
)  # fmt: skip
async def test_model_management_points_to_blazar_apply(
    client: httpx.AsyncClient, method: str, path: str
) -> None:
    response = await client.request(method, path, json={"model": "tiny"})
    assert response.status_code == 400
    assert "blazar apply" in response.json()["error"]
    assert path in response.json()["error"]


async def test_unknown_api_path_is_an_ollama_error(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/nothing")
    assert response.status_code == 404
    assert set(response.json()) == {"error"}
    wrong_method = await client.get("/api/chat")
    assert wrong_method.status_code == 405
    assert set(wrong_method.json()) == {"error"}
    # Elsewhere, OpenAI's envelope as before.
    assert "message" in (await client.get("/v1/nothing")).json()["error"]


# Every top-level field of Ollama's requests (ollama/ollama `api/types.go`) on the
# routes Blazar serves: each is declared, so it acts or is refused by name; any other
# is an unknown field.
OLLAMA_FIELDS = {
    protocol.ChatRequest: {
        "model", "messages", "stream", "format", "keep_alive", "tools", "options", "think",
        "truncate", "shift", "_debug_render_only", "logprobs", "top_logprobs",
    },
    protocol.GenerateRequest: {
        "model", "prompt", "suffix", "system", "template", "context", "stream", "raw",
        "format", "keep_alive", "images", "options", "think", "truncate", "shift",
        "_debug_render_only", "logprobs", "top_logprobs",
        # The `ollama` Python client's image generation.
        "width", "height", "steps",
    },
    protocol.EmbedRequest: {"model", "input", "keep_alive", "truncate", "dimensions", "options"},
    protocol.EmbeddingsRequest: {"model", "prompt", "keep_alive", "options"},
    protocol.ShowRequest: {"model", "system", "template", "verbose", "options", "name"},
}  # fmt: skip


@pytest.mark.parametrize("model", list(OLLAMA_FIELDS), ids=lambda m: m.__name__)
def test_every_field_of_ollamas_requests_is_declared(model: type[protocol._Body]) -> None:
    assert OLLAMA_FIELDS[model] <= validation.field_names(model)


def test_every_field_the_ollama_client_sends_is_declared() -> None:
    """The official client sends only the fields its request models have: none of them
    may be refused as unknown."""
    import ollama._types as client_types

    for ours, theirs in [
        (protocol.ChatRequest, client_types.ChatRequest),
        (protocol.GenerateRequest, client_types.GenerateRequest),
        (protocol.EmbedRequest, client_types.EmbedRequest),
        (protocol.EmbeddingsRequest, client_types.EmbeddingsRequest),
        (protocol.ShowRequest, client_types.ShowRequest),
    ]:
        assert set(theirs.model_fields) <= validation.field_names(ours), ours.__name__


UNKNOWN_FIELDS = [
    ("/api/chat", {**CHAT, "num_ctx": 4096}, ["num_ctx"]),
    ("/api/chat", {**CHAT, "user": "me", "seed": 1, "tool_choice": "auto"},
     ["seed", "tool_choice", "user"]),
    ("/api/chat", {**CHAT, "prompt": "Hi"}, ["prompt"]),
    # A preload is checked too: it would not answer "load" and drop the field.
    ("/api/chat", {"model": "tiny", "messages": [], "num_gpu": 0}, ["num_gpu"]),
    ("/api/generate", {**GEN, "temperature": 0, "max_tokens": 5}, ["max_tokens", "temperature"]),
    ("/api/generate", {**GEN, "debug_render_only": True}, ["debug_render_only"]),
    ("/api/embed", {"model": "tiny", "input": "hi", "user": "me"}, ["user"]),
    ("/api/embed", {"model": "tiny", "input": "hi", "encoding_format": "float"},
     ["encoding_format"]),
    ("/api/embeddings", {"model": "tiny", "prompt": "hi", "input": "hi"}, ["input"]),
    ("/api/show", {"model": "tiny", "details": True}, ["details"]),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "unknown"), UNKNOWN_FIELDS)
async def test_an_unknown_top_level_field_is_a_400_naming_every_one(
    daemon: Daemon, client: httpx.AsyncClient, path: str, body: dict[str, Any], unknown: list[str]
) -> None:
    daemon.fake.scripts["tiny"] = [delta("x"), final()]
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    said = response.json()["error"]
    assert list(response.json()) == ["error"]
    assert path in said
    for name in unknown:
        assert f"'{name}'" in said
    assert ("inside 'options'" in said) == any(options.is_option(n) for n in unknown)
    assert daemon.fake.requests == [] and daemon.fake.keep_alives == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/chat", CHAT),
        ("/api/generate", GEN),
        ("/api/embed", {"model": "tiny", "input": "hi"}),
        ("/api/embeddings", {"model": "tiny", "prompt": "hi"}),
        ("/api/show", {"model": "tiny"}),
    ],
)
async def test_an_unknown_field_sent_as_null_is_one_not_sent(
    daemon: Daemon, client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    daemon.fake.scripts["tiny"] = [delta("x"), final()]
    response = await client.post(path, json={**body, "user": None, "num_ctx": None})
    assert response.status_code == 200, response.text


async def test_show_as_gos_client_sends_it(client: httpx.AsyncClient) -> None:
    """Go's `api.ShowRequest` has no omitempty: its unset fields arrive as "" and null."""
    body = {"model": "tiny", "system": "", "template": "", "verbose": False, "options": None,
            "name": ""}  # fmt: skip
    response = await client.post("/api/show", json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "field",
    [
        {"system": "Be brief."},
        {"template": "{{ .Prompt }}"},
        {"options": {"seed": 1}},
        {"verbose": True},
    ],
)
async def test_show_refuses_what_it_cannot_show_by_name(
    client: httpx.AsyncClient, field: dict[str, Any]
) -> None:
    response = await client.post("/api/show", json={"model": "tiny", **field})
    assert response.status_code == 400
    [name] = field
    assert response.json()["error"].startswith(f"'{name}' is not supported on /api/show")
