"""Tool calling in the engine, by state: which tool sets are refused and why, what the
forced-call grammar lets the model write, how streamed text becomes calls, and how a
conversation with tools is rendered."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2 as pb
from blazar.api import errors
from blazar.engine import sampling, schema, text, tools

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
}
Mode = pb.ToolChoice


def chat(
    *defs: tuple[str, Any],
    mode: int = Mode.MODE_AUTO,
    name: str = "",
    parallel: bool | None = None,
) -> engine_pb2.ChatInput:
    out = engine_pb2.ChatInput(
        tools=[
            pb.Tool(name=n, parameters=p if isinstance(p, str) else json.dumps(p)) for n, p in defs
        ],
        tool_choice=pb.ToolChoice(mode=mode, name=name),  # type: ignore[arg-type]
    )
    if parallel is not None:
        out.parallel_tool_calls = parallel
    return out


def toolset(
    mode: int = Mode.MODE_AUTO, name: str = "", parallel: bool | None = None
) -> tools.ToolSet:
    return tools.parse(
        chat(("weather", WEATHER), ("noop", ""), mode=mode, name=name, parallel=parallel)
    )


# ---------------------------------------------------------------- checking


def _deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}}
    return node


@pytest.mark.parametrize(
    ("request_", "field", "fragment"),
    [
        (chat(("bad name", {})), "tools[0].name", "1 to 64 letters"),
        (chat(("", {})), "tools[0].name", "1 to 64"),
        (chat(("f", {}), ("f", {})), "tools[1].name", "Tools 0 and 1 are both named 'f'"),
        (chat(("f", "{")), "tools[0].parameters", "not valid JSON"),
        # An integer past CPython's 4,300-digit limit is a ValueError, not a decode error.
        (
            chat(("f", '{"maxLength": 1' + "0" * 5000 + "}")),
            "tools[0].parameters",
            "not valid JSON",
        ),
        (chat(("f", "[" * 5000 + "]" * 5000)), "tools[0].parameters", "nested too deeply"),
        (chat(("f", "[1]")), "tools[0].parameters", "JSON Schema object"),
        (chat(("f", {"type": "string"})), "tools[0].parameters", "must describe an object"),
        (
            chat(("f", {"type": "object", "properties": {"a": {"type": "strin"}}})),
            "tools[0].parameters",
            "not a valid JSON Schema",
        ),
        (chat(("f", _deep(40))), "tools[0].parameters", "more than 32 levels"),
        (chat(("f", {"$schema": []})), "tools[0].parameters", "['$schema']: [] is not a string"),
        (chat(mode=Mode.MODE_REQUIRED), "tool_choice", "needs tools"),
        (chat(("f", {}), mode=Mode.MODE_NAMED, name="g"), "tool_choice", "'g'"),
        (chat(("f", {}), mode=Mode.MODE_AUTO, name="f"), "tool_choice", "only with MODE_NAMED"),
        (chat(mode=Mode.MODE_NONE, name="f"), "tool_choice", "only with MODE_NAMED"),
        (chat(("f", {}), mode=Mode.MODE_UNSPECIFIED, name="f"), "tool_choice", "'auto'"),
    ],
)
def test_invalid_tools_are_refused_naming_the_field(
    request_: engine_pb2.ChatInput, field: str, fragment: str
) -> None:
    with pytest.raises(errors.InvalidRequest, match=re.escape(fragment)) as caught:
        tools.parse(request_)
    assert caught.value.metadata[errors.FIELD_KEY] == field


def test_too_many_tools_are_refused() -> None:
    with pytest.raises(errors.InvalidRequest, match="At most 128"):
        tools.parse(chat(*((f"t{i}", {}) for i in range(129))))


def test_a_tool_set_reads_the_choice_and_the_parallel_flag() -> None:
    assert toolset().mode is tools.Mode.AUTO and toolset().parallel
    assert not toolset(parallel=False).parallel
    named = toolset(Mode.MODE_NAMED, "noop")
    assert named.forced and [t.name for t in named.callable] == ["noop"]
    assert not toolset(Mode.MODE_NONE).active
    assert toolset().by_name("noop") == tools.Tool("noop", "", tools.NO_PARAMETERS)


def test_depth_counts_containers_without_recursing() -> None:
    assert tools.depth({}) == 1
    assert tools.depth({"a": [1, {"b": 2}]}) == 3
    assert tools.depth(_deep(10_000)) == tools.MAX_SCHEMA_DEPTH + 1


# ---------------------------------------------------------------- the forced-call grammar


def _gbnf_regex(gbnf: str) -> re.Pattern[str]:
    """A Python regex for a grammar without recursion (rules inlined)."""
    rules = dict(line.split(" ::= ", 1) for line in gbnf.split("\n"))

    def expand(body: str) -> str:
        out, i = [], 0
        while i < len(body):
            c = body[i]
            if c == '"':
                end = tools._closing(body, i, '"')
                raw = re.sub(
                    r"\\(x[0-9A-F]{2}|.)",
                    lambda e: (
                        chr(int(e[1][1:], 16))
                        if e[1].startswith("x")
                        else {"n": "\n", "t": "\t", "r": "\r"}.get(e[1], e[1])
                    ),
                    body[i + 1 : end - 1],
                )
                out.append(f"(?:{re.escape(raw)})")
                i = end
            elif c == "[":
                end = tools._closing(body, i, "]")
                out.append(body[i:end])
                i = end
            elif c == "{":
                end = body.index("}", i) + 1
                out.append(body[i:end])
                i = end
            elif word := re.compile(r"[A-Za-z][A-Za-z0-9-]*").match(body, i):
                out.append(f"(?:{expand(rules[word.group(0)])})")
                i = word.end()
            elif c == "(":
                out.append("(?:")
                i += 1
            elif c == " ":
                i += 1
            else:
                out.append(c)
                i += 1
        return "".join(out)

    return re.compile(expand(rules["root"]), re.DOTALL)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


GOOD = call("weather", '{"city": "Paris", "unit": "c"}')
GOOD_TOO = call("weather", '{"city":"Oslo","unit":"f","days":3}')
EMPTY = call("noop", "{}")


@pytest.mark.parametrize(
    ("choice", "output", "allowed"),
    [
        ((Mode.MODE_REQUIRED, "", None), GOOD, True),
        ((Mode.MODE_REQUIRED, "", None), GOOD_TOO, True),
        ((Mode.MODE_REQUIRED, "", None), EMPTY, True),
        ((Mode.MODE_REQUIRED, "", None), f"{GOOD}\n{EMPTY}", True),
        ((Mode.MODE_REQUIRED, "", None), "\n".join([EMPTY] * 8), True),
        ((Mode.MODE_REQUIRED, "", None), "\n".join([EMPTY] * 9), False),
        ((Mode.MODE_REQUIRED, "", False), f"{GOOD}\n{EMPTY}", False),
        ((Mode.MODE_REQUIRED, "", False), GOOD, True),
        ((Mode.MODE_REQUIRED, "", None), "", False),
        ((Mode.MODE_REQUIRED, "", None), "Sure! " + GOOD, False),
        ((Mode.MODE_REQUIRED, "", None), call("weather", '{"city": "Paris", "unit": "k"}'), False),
        ((Mode.MODE_REQUIRED, "", None), call("weather", '{"city": "Paris"}'), False),
        (
            (Mode.MODE_REQUIRED, "", None),
            call("weather", '{"city": "' + "x" * 21 + '", "unit": "c"}'),
            False,
        ),
        ((Mode.MODE_REQUIRED, "", None), call("other", "{}"), False),
        ((Mode.MODE_NAMED, "noop", None), EMPTY, True),
        ((Mode.MODE_NAMED, "noop", None), GOOD, False),
    ],
)
def test_the_forced_grammar_allows_exactly_valid_calls(
    choice: tuple[int, str, bool | None], output: str, allowed: bool
) -> None:
    mode, name, parallel = choice
    pattern = _gbnf_regex(tools.grammar(toolset(mode, name, parallel)))
    assert bool(pattern.fullmatch(output)) == allowed


def test_a_schema_the_grammar_cannot_enforce_is_refused_only_when_forced() -> None:
    loose = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}
    request_ = chat(("ok", {}), ("counted", loose), mode=Mode.MODE_REQUIRED)
    with pytest.raises(errors.InvalidRequest, match="minimum") as caught:
        tools.grammar(tools.parse(request_))
    assert caught.value.metadata[errors.FIELD_KEY] == "tools[1].parameters"
    assert "cannot be forced" in caught.value.message
    # Named: only the named tool's schema has to be enforceable.
    tools.grammar(
        tools.parse(chat(("ok", {}), ("counted", loose), mode=Mode.MODE_NAMED, name="ok"))
    )
    # Auto: any valid schema; calls are validated instead.
    assert tools.parse(chat(("counted", loose))).tools[0].parameters == loose


ANSWER = {
    "type": "object",
    "properties": {"summary": {"type": "string", "maxLength": 12}},
    "required": ["summary"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("parallel", "output", "allowed"),
    [
        (None, GOOD, True),
        (None, EMPTY, True),
        (None, f"{GOOD}\n{EMPTY}", True),
        (False, f"{GOOD}\n{EMPTY}", False),
        (None, '{"summary": "Sunny"}', True),
        (None, '{"summary": 3}', False),
        (None, '{"summary": "Sunny", "more": 1}', False),
        (None, "Sunny", False),
        (None, f"Let me look. {GOOD}", False),
        (None, f'{GOOD}\n{{"summary": "Sunny"}}', False),
        (None, call("weather", '{"city": "Paris"}'), False),
        # Where the model would write a call's result, it may begin to: a stop ends it.
        (None, f"{GOOD}\n{tools.RESULT_OPEN}", True),
        (False, f"{GOOD}\n{tools.RESULT_OPEN}", True),
        (None, f"{GOOD}\n{EMPTY}\n{tools.RESULT_OPEN}", True),
        (None, f'{{"summary": "Sunny"}}\n{tools.RESULT_OPEN}', False),
        (None, tools.RESULT_OPEN, False),
    ],
)
def test_an_auto_turn_with_a_structured_answer_writes_calls_or_that_answer(
    parallel: bool | None, output: str, allowed: bool
) -> None:
    answer = schema.grammar(ANSWER)
    auto = toolset(Mode.MODE_AUTO, parallel=parallel)
    made = tools.grammar(auto, answer=answer, result_stops=True)
    assert bool(_gbnf_regex(made).fullmatch(output)) == allowed
    if tools.RESULT_OPEN in output:  # only while it is a stop string
        assert not _gbnf_regex(tools.grammar(auto, answer=answer)).fullmatch(output)


def test_a_tool_the_grammar_cannot_write_is_refused_beside_a_structured_answer() -> None:
    loose = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}
    auto = tools.parse(chat(("ok", {}), ("counted", loose)))
    with pytest.raises(errors.InvalidRequest, match="minimum") as caught:
        tools.grammar(auto, answer=schema.grammar(ANSWER))
    assert caught.value.metadata[errors.FIELD_KEY] == "tools[1].parameters"
    assert "cannot be offered beside a structured answer" in caught.value.message


def test_rule_names_are_prefixed_outside_literals_and_classes() -> None:
    gbnf = 'root ::= "root space" [a-z] space root-kv{0,3}\nspace ::= " "?\nroot-kv ::= "x"'
    assert list(tools._prefixed(gbnf, "t0-")) == [
        't0-root ::= "root space" [a-z] t0-space t0-root-kv{0,3}',
        't0-space ::= " "?',
        't0-root-kv ::= "x"',
    ]


def test_a_repetitions_count_is_no_rule_name() -> None:
    """A property named "5" has a rule "5"; the count of a pattern's `{5}` was prefixed
    with the rule names into `{tool0-5}`, and llama.cpp refused the grammar of a valid
    schema as not GBNF."""
    parameters = {
        "type": "object",
        "properties": {
            "5": {"type": "string", "maxLength": 2},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
    }
    forced = tools.ToolSet((tools.Tool("f", "", parameters),), mode=tools.Mode.NAMED, named="f")
    zip_rule = next(line for line in tools.grammar(forced).splitlines() if "tool0-zip ::=" in line)
    assert "[\\x30-\\x39]{5}" in zip_rule, zip_rule


def test_a_forced_grammar_keeps_unicode_line_breaks_inside_its_literals() -> None:
    """U+2028, U+2029 and NEL are characters of a JSON string, not ends of grammar
    rules: a forced call whose schema held one in a value failed with a 500."""
    value = "a\u2028b\u2029c\x85d"
    parameters = {"type": "object", "properties": {"s": {"const": value}}, "required": ["s"]}
    forced = tools.ToolSet((tools.Tool("f", "", parameters),), mode=tools.Mode.NAMED, named="f")
    pattern = _gbnf_regex(tools.grammar(forced))
    assert pattern.fullmatch(call("f", json.dumps({"s": value}, ensure_ascii=False)))


# ---------------------------------------------------------------- parsing


def ids() -> Any:
    counter = iter(range(100))
    return lambda: f"call_{next(counter)}"


def run(parser: tools.CallParser, pieces: list[str]) -> tuple[str, dict[int, dict[str, str]]]:
    """The text and the calls (by index, deltas joined) a parser makes of `pieces`."""
    out, calls = [], {}
    for parsed in [*(parser.feed(p) for p in pieces), parser.finish()]:
        out.append(parsed.text)
        for delta in parsed.calls:
            entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            if delta.id:
                assert not entry["id"], "id and name come once, on a call's first delta"
                entry["id"], entry["name"] = delta.id, delta.name
            entry["arguments"] += delta.arguments
    return "".join(out), calls


def splits(whole: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(whole)), min(len(whole) - 1, rng.randint(1, 12))))
    return [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]


@pytest.mark.parametrize("seed", range(30))
def test_forced_calls_stream_name_first_then_arguments_however_text_is_split(seed: int) -> None:
    output = f"{GOOD}\n{call('noop', '{ }')}"
    pieces = list(output) if seed == 0 else splits(output, seed)
    parser = tools.CallParser(toolset(Mode.MODE_REQUIRED), new_id=ids())
    said, calls = run(parser, pieces)
    assert said == ""
    assert calls == {
        0: {"id": "call_0", "name": "weather", "arguments": '{"city": "Paris", "unit": "c"}'},
        1: {"id": "call_1", "name": "noop", "arguments": "{ }"},
    }
    assert parser.called and parser.made == 2


def test_a_forced_call_cut_short_is_partial() -> None:
    parser = tools.CallParser(toolset(Mode.MODE_REQUIRED), new_id=ids())
    _, calls = run(parser, [GOOD[:60]])
    assert calls[0]["name"] == "weather" and not parser.called and parser.partial


def test_a_forced_arguments_string_may_hold_braces_and_the_closing_tag() -> None:
    arguments = '{"city": "}\\"</tool_call>{", "unit": "c"}'
    parser = tools.CallParser(toolset(Mode.MODE_REQUIRED), new_id=ids())
    _, calls = run(parser, list(call("weather", arguments)))
    assert calls[0]["arguments"] == arguments and parser.called


@pytest.mark.parametrize(
    ("output", "said", "called"),
    [
        ("Paris is sunny.", "Paris is sunny.", {}),
        (GOOD, "", {0: ("weather", {"city": "Paris", "unit": "c"})}),
        (
            f"Let me look.\n{GOOD}\n",
            "Let me look.",
            {0: ("weather", {"city": "Paris", "unit": "c"})},
        ),
        (
            f"{GOOD}\n{EMPTY}",
            "",
            {0: ("weather", {"city": "Paris", "unit": "c"}), 1: ("noop", {})},
        ),
        # Arguments as a JSON string (some models write them so) are read too.
        (call("noop", '"{}"'), "", {0: ("noop", {})}),
        # Not a valid call: the text as it was.
        (
            call("weather", '{"city": "Paris", "unit": "k"}'),
            call("weather", '{"city": "Paris", "unit": "k"}'),
            {},
        ),
        (call("weather", '{"city": "Paris"}'), call("weather", '{"city": "Paris"}'), {}),
        (call("nope", "{}"), call("nope", "{}"), {}),
        # With the whitespace before it.
        (f"Let me look.\n{call('nope', '{}')}", f"Let me look.\n{call('nope', '{}')}", {}),
        (
            f"{GOOD} \n{call('nope', '{}')}",
            f" \n{call('nope', '{}')}",
            {0: ("weather", {"city": "Paris", "unit": "c"})},
        ),
        ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", {}),
        (
            '<tool_call>{"name": "noop", "arguments": {}, "x": 1}</tool_call>',
            '<tool_call>{"name": "noop", "arguments": {}, "x": 1}</tool_call>',
            {},
        ),
        # Cut short: the text as it was.
        (GOOD[:30], GOOD[:30], {}),
        ("a <tool_ca", "a <tool_ca", {}),
        (f"Let me look.\n\n{GOOD[:30]}", f"Let me look.\n\n{GOOD[:30]}", {}),
        ("  ", "  ", {}),
        ("a \n b \n", "a \n b \n", {}),
        (f"{GOOD}\n \n", "", {0: ("weather", {"city": "Paris", "unit": "c"})}),
        (f"{GOOD}\nDone.", "\nDone.", {0: ("weather", {"city": "Paris", "unit": "c"})}),
    ],
)
def test_auto_output_is_a_call_only_when_it_validates(
    output: str, said: str, called: dict[int, tuple[str, dict[str, Any]]]
) -> None:
    for pieces in (
        [output],
        list(output),
        *(splits(output, s) for s in range(5) if len(output) > 1),
    ):
        parser = tools.CallParser(toolset(), new_id=ids())
        text_, calls = run(parser, pieces)
        assert text_ == said
        assert {i: (c["name"], json.loads(c["arguments"])) for i, c in calls.items()} == called
        assert parser.called == bool(called)


def test_auto_without_parallel_calls_keeps_a_second_call_as_text() -> None:
    parser = tools.CallParser(toolset(parallel=False), new_id=ids())
    said, calls = run(parser, [f"{GOOD}\n{EMPTY}"])
    assert list(calls) == [0] and said == f"\n{EMPTY}"


def test_auto_calls_come_out_whole_with_their_own_ids() -> None:
    parser = tools.CallParser(toolset(), new_id=ids())
    parsed = parser.feed(GOOD_TOO)
    assert parsed.calls == (
        tools.CallDelta(0, "call_0", "weather", '{"city": "Oslo", "unit": "f", "days": 3}'),
    )


def test_an_auto_call_with_half_a_surrogate_pair_keeps_its_escape() -> None:
    """JSON may escape half of a surrogate pair (`"\\ud800"`), which has no UTF-8 form:
    written out as a character, the call could not go on the wire (a 500)."""
    parser = tools.CallParser(toolset(), new_id=ids())
    parsed = parser.feed(call("weather", '{"city": "\\ud800é", "unit": "c"}'))
    assert parsed.calls == (
        tools.CallDelta(0, "call_0", "weather", '{"city": "\\ud800\\u00e9", "unit": "c"}'),
    )
    parsed.calls[0].arguments.encode("utf-8")


def test_call_ids_are_unique_and_openai_shaped() -> None:
    made = {tools.new_call_id() for _ in range(100)}
    assert len(made) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in made)


def test_auto_validation_checks_what_the_grammar_could_not() -> None:
    tool = tools.Tool(
        "t",
        "",
        {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 1},
                "e": {"type": "string", "format": "email"},
            },
        },
    )
    assert tools.valid(tool, {"n": 2, "e": "a@b.c"})
    assert not tools.valid(tool, {"n": 0})
    assert not tools.valid(tool, {"e": "nope"})
    broken = tools.Tool("t", "", {"$ref": "#/$defs/missing"})
    assert not tools.valid(broken, {})


# ---------------------------------------------------------------- rendering


def test_history_turns_keep_calls_and_results() -> None:
    messages = [
        pb.Message(role="user", content="Weather?"),
        pb.Message(
            role="assistant",
            tool_calls=[pb.ToolCall(id="c1", name="weather", arguments='{"city":"Paris"}')],
        ),
        pb.Message(role="tool", content="21C", tool_call_id="c1", name="weather"),
    ]
    turns = tools.history_turns(messages)
    assert turns[1].tool_calls == (text.ToolCall("c1", "weather", '{"city": "Paris"}'),)
    assert (turns[2].tool_call_id, turns[2].name) == ("c1", "weather")


def test_history_call_arguments_with_half_a_surrogate_pair_are_refused() -> None:
    """The caller's arguments are JSON text; one that escapes half of a surrogate pair
    (`"\\ud800"`) has no UTF-8 form, and reached the prompt as a 500."""
    arguments = '{"city": "\\ud800"}'
    call_ = pb.ToolCall(id="c1", name="weather", arguments=arguments)
    with pytest.raises(errors.InvalidRequest, match="surrogate") as caught:
        tools.history_turns([pb.Message(role="assistant", tool_calls=[call_])])
    assert caught.value.metadata[errors.FIELD_KEY] == "messages[0].tool_calls[0].arguments"


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (
            pb.Message(
                role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments="[1]")]
            ),
            "messages[0].tool_calls[0].arguments",
        ),
        (
            pb.Message(role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments="{")]),
            "messages[0].tool_calls[0].arguments",
        ),
        (
            pb.Message(role="assistant", tool_calls=[pb.ToolCall(id="c", arguments="{}")]),
            "messages[0].tool_calls[0].name",
        ),
        (
            pb.Message(role="user", tool_calls=[pb.ToolCall(id="c", name="f")]),
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_history_calls_that_cannot_be_shown_are_refused(message: pb.Message, field: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        tools.history_turns([message])
    assert caught.value.metadata[errors.FIELD_KEY] == field


CONVERSATION = [
    text.ChatTurn("system", "Be brief."),
    text.ChatTurn("user", "Weather in Paris?"),
    text.ChatTurn(
        "assistant",
        "Checking.",
        tool_calls=(text.ToolCall("c1", "weather", '{"city": "Paris", "unit": "c"}'),),
    ),
    text.ChatTurn("tool", "21", tool_call_id="c1"),
    text.ChatTurn("user", "Thanks. And Oslo?"),
]


def test_the_builtin_tool_prompt_renders_tools_calls_and_results_in_gemma_turns() -> None:
    prompt = text.render_gemma(tools.builtin_turns(CONVERSATION, toolset(parallel=False)))
    instructions = tools.instructions(toolset(parallel=False))
    assert prompt == (
        f"<start_of_turn>user\nBe brief.\n\n{instructions}\n\nWeather in Paris?<end_of_turn>\n"
        "<start_of_turn>model\nChecking.\n"
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
        "<end_of_turn>\n"
        "<start_of_turn>user\n<tool_response>\n21\n</tool_response>\n\nThanks. And Oslo?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert '{"name": "weather", "description": "", "parameters": {"type": "object"' in instructions
    assert "at most one call" in instructions


def test_the_builtin_prompt_says_what_the_choice_asks() -> None:
    assert "Call the tool 'noop' now." in tools.instructions(toolset(Mode.MODE_NAMED, "noop"))
    assert "Call one of these tools now." in tools.instructions(toolset(Mode.MODE_REQUIRED))
    assert "otherwise answer in text" in tools.instructions(toolset())


def test_without_active_tools_no_prompt_is_added_but_history_is_shown() -> None:
    turns = tools.builtin_turns(CONVERSATION, toolset(Mode.MODE_NONE))
    assert turns[0] == CONVERSATION[0]
    assert "<tool_call>" in turns[2].content


HERMES = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools>\nWrite <tool_call>{...}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_a_template_that_shows_tools_in_the_call_format_renders_them() -> None:
    template = text.ChatTemplate(HERMES)
    assert template.renders_tools
    prompt = template.render(CONVERSATION[1:3], tools=tools.template_tools(toolset()))
    assert '"name": "weather"' in prompt
    # Jinja's tojson sorts keys.
    assert (
        '<tool_call>{"arguments": {"city": "Paris", "unit": "c"}, "name": "weather"}</tool_call>'
        in prompt
    )


@pytest.mark.parametrize(
    "source",
    [
        text.NAMED_TEMPLATES["chatml"],
        # Writes the format but never shows the tools.
        "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>",
    ],
)
def test_other_templates_leave_tools_to_the_builtin_prompt(source: str) -> None:
    assert not text.ChatTemplate(source or "").renders_tools


def test_the_schema_of_the_test_tool_is_valid() -> None:
    jsonschema.Draft202012Validator.check_schema(WEATHER)


@pytest.mark.parametrize(
    ("mode", "stops", "expected"),
    [
        (Mode.MODE_AUTO, [], ("<tool_response>",)),
        (Mode.MODE_AUTO, ["\n\n"], ("\n\n", "<tool_response>")),
        (Mode.MODE_AUTO, ["<tool_response>"], ("<tool_response>",)),
        # No room left under the limit: the caller's stops win.
        (Mode.MODE_AUTO, [f"s{i}" for i in range(64)], tuple(f"s{i}" for i in range(64))),
        (Mode.MODE_NONE, [], ()),
    ],
)
def test_a_model_free_to_call_stops_where_it_would_make_up_a_result(
    mode: int, stops: list[str], expected: tuple[str, ...]
) -> None:
    from blazar.engine import preparing

    wire = pb.Sampling(stop=stops)
    params = preparing._resolve(
        wire,
        constraint=pb.Constraint(),
        toolset=toolset(mode),
        vocab=None,  # type: ignore[arg-type]
    )
    assert params.stop == expected
    assert list(wire.stop) == stops  # the caller's message is left alone


def test_a_forced_call_is_resolved_with_its_grammar() -> None:
    from blazar.engine import preparing

    params = preparing._resolve(
        pb.Sampling(),
        constraint=pb.Constraint(),
        toolset=toolset(Mode.MODE_REQUIRED),
        vocab=None,  # type: ignore[arg-type]
    )
    assert params.grammar == tools.grammar(toolset(Mode.MODE_REQUIRED))
    assert params.stop == ()


@pytest.mark.parametrize(("mode", "name"), [(Mode.MODE_REQUIRED, ""), (Mode.MODE_NAMED, "weather")])
def test_a_forced_call_is_not_cut_by_the_callers_stop_strings(mode: int, name: str) -> None:
    """The grammar writes calls only, and every call's format holds a newline: a stop
    string could only end the turn inside the call the caller forced."""
    from blazar.engine import preparing

    wire = pb.Sampling(stop=["\n", "}"])
    params = preparing._resolve(
        wire,
        constraint=pb.Constraint(),
        toolset=toolset(mode, name),
        vocab=None,  # type: ignore[arg-type]
    )
    assert params.grammar == tools.grammar(toolset(mode, name))
    assert params.stop == ()
    assert list(wire.stop) == ["\n", "}"]  # the caller's message is left alone


def _resolved(mode: int, constraint: pb.Constraint, stop: tuple[str, ...] = ()) -> Any:
    from blazar.engine import preparing

    return preparing._resolve(
        pb.Sampling(stop=stop),
        constraint=constraint,
        toolset=toolset(mode, "weather" if mode == Mode.MODE_NAMED else ""),
        vocab=None,  # type: ignore[arg-type]
    )


def test_an_auto_turn_with_a_response_format_is_resolved_to_calls_or_the_answer() -> None:
    params = _resolved(
        Mode.MODE_AUTO, pb.Constraint(json_schema=json.dumps(ANSWER)), stop=("\n\n",)
    )
    assert params.grammar == tools.grammar(
        toolset(), answer=schema.grammar(ANSWER), result_stops=True
    )
    # The caller's stops stay (quiet inside a call block, as in any auto turn).
    assert params.stop == ("\n\n", tools.RESULT_OPEN)
    # Any JSON object: the answer's grammar is the one `json_object` stands for.
    any_object = _resolved(Mode.MODE_AUTO, pb.Constraint(json_object=True))
    assert any_object.grammar == tools.grammar(
        toolset(), answer=schema.grammar({"type": "object"}), result_stops=True
    )
    # No room for the result's stop among the caller's: the grammar cannot write the
    # opening, which would then be passed on as text.
    full = tuple(f"s{i}" for i in range(sampling.MAX_STOPS))
    crowded = _resolved(Mode.MODE_AUTO, pb.Constraint(json_schema=json.dumps(ANSWER)), stop=full)
    assert crowded.stop == full
    assert crowded.grammar == tools.grammar(toolset(), answer=schema.grammar(ANSWER))
    # json_object false constrains nothing: the turn is free, as without a format.
    assert _resolved(Mode.MODE_AUTO, pb.Constraint(json_object=False)).grammar is None


@pytest.mark.parametrize(("mode", "name"), [(Mode.MODE_REQUIRED, ""), (Mode.MODE_NAMED, "weather")])
def test_a_forced_turn_with_a_response_format_writes_only_calls(mode: int, name: str) -> None:
    params = _resolved(mode, pb.Constraint(json_schema=json.dumps(ANSWER)))
    assert params.grammar == tools.grammar(toolset(mode, name))


def test_a_response_format_beside_tools_is_checked_as_if_alone() -> None:
    for mode in (Mode.MODE_AUTO, Mode.MODE_REQUIRED):
        with pytest.raises(errors.InvalidRequest, match="not valid JSON") as caught:
            _resolved(mode, pb.Constraint(json_schema="{"))
        assert caught.value.metadata[errors.FIELD_KEY] == "constraint"


def test_a_gbnf_grammar_beside_tools_is_refused_naming_the_constraint() -> None:
    for mode in (Mode.MODE_AUTO, Mode.MODE_REQUIRED):
        with pytest.raises(errors.InvalidRequest, match="GBNF grammar and tools") as caught:
            _resolved(mode, pb.Constraint(grammar='root ::= "a"'))
        assert caught.value.metadata[errors.FIELD_KEY] == "constraint"
    # With tool_choice none the tools are not in play: the grammar alone applies.
    from blazar.engine import preparing

    params = preparing._resolve(
        pb.Sampling(),
        constraint=pb.Constraint(grammar='root ::= "a"'),
        toolset=toolset(Mode.MODE_NONE),
        vocab=None,  # type: ignore[arg-type]
    )
    assert params.grammar == 'root ::= "a"'


CALLS_ONLY = [
    text.ChatTurn("user", "Weather in Paris and Oslo?"),
    text.ChatTurn(
        "assistant",
        "",
        tool_calls=(
            text.ToolCall("c1", "weather", '{"city": "Paris", "unit": "c"}'),
            text.ToolCall("c2", "weather", '{"city": "Oslo", "unit": "c"}'),
        ),
    ),
    text.ChatTurn("tool", "21", tool_call_id="c1"),
    text.ChatTurn("tool", "9", tool_call_id="c2"),
]


def _rendered_by(name: str, turns: list[text.ChatTurn]) -> str:
    source = text.NAMED_TEMPLATES[name]
    return text.render_gemma(turns) if source is None else text.ChatTemplate(source).render(turns)


@pytest.mark.parametrize("template", sorted(text.NAMED_TEMPLATES))
@pytest.mark.parametrize("conversation", [CONVERSATION, CALLS_ONLY], ids=["text", "calls-only"])
def test_the_builtin_prompt_puts_every_tool_block_on_lines_of_its_own(
    template: str, conversation: list[text.ChatTurn]
) -> None:
    """The example the model is shown, the calls in its history and the results each
    start on a line of their own, in the layout a forced call's grammar writes."""
    prompt = _rendered_by(template, tools.builtin_turns(conversation, toolset()))
    blocks = list(re.finditer(r"<tool_call>\n(.*?)\n</tool_call>", prompt, flags=re.DOTALL))
    # The example, then each call of the history.
    assert len(blocks) == 1 + (1 if conversation is CONVERSATION else 2)
    assert blocks[0].group(1) == '{"name": "<tool name>", "arguments": {...}}'
    results = list(re.finditer(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.DOTALL))
    assert [r.group(1) for r in results] == (
        ["21"] if conversation is CONVERSATION else ["21", "9"]
    )
    for block in [*blocks, *results]:
        before = prompt[: block.start()]
        assert before.endswith("\n"), before[-60:]
        # Each line of the block is a line of the prompt.
        assert prompt[block.end() :].startswith(("\n", "<")), prompt[block.end() : block.end() + 20]
    for call in blocks[1:]:
        assert tools._HEAD.match(call.group(0)) is not None


@pytest.mark.parametrize(
    ("output", "called"),
    [
        (GOOD[:30], {}),
        (tools.OPEN[:5], {}),
        (f"{GOOD}\n{EMPTY[:20]}", {0: ("weather", {"city": "Paris", "unit": "c"})}),
        (f"{GOOD}\n{tools.OPEN[:3]}", {0: ("weather", {"city": "Paris", "unit": "c"})}),
        (f"{GOOD}\n{EMPTY}", {0: ("weather", {"city": "Paris", "unit": "c"}), 1: ("noop", {})}),
    ],
)
def test_a_call_cut_short_beside_a_structured_answer_is_left_out(
    output: str, called: dict[int, tuple[str, dict[str, Any]]]
) -> None:
    """The grammar let the model write calls or the answer: a call block the budget
    ended is a cut call, never the answer's text (an SDK parses that text as the
    format, and `<tool_call>` is not JSON)."""
    for pieces in ([output], list(output), *(splits(output, s) for s in range(5))):
        parser = tools.CallParser(toolset(), new_id=ids(), shaped=True)
        text_, calls = run(parser, pieces)
        assert text_ == ""
        assert {i: (c["name"], json.loads(c["arguments"])) for i, c in calls.items()} == called
        assert parser.made == len(called)
        assert parser.partial == (not output.endswith(tools.CLOSE))


def test_an_answer_beside_tools_is_text() -> None:
    answer = '{"summary": "Sunny"}'
    parser = tools.CallParser(toolset(), new_id=ids(), shaped=True)
    assert run(parser, list(answer)) == (answer, {})
    # Cut short, even where what is left could begin a call: the answer's text.
    for cut in (answer[:9], '{"summary": "a <tool'):
        parser = tools.CallParser(toolset(), new_id=ids(), shaped=True)
        assert run(parser, [cut]) == (cut, {}) and not parser.partial
