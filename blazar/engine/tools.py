"""Tool calling: which tools a request offers, how they are shown to the model, the
grammar that forces a call, and the parser that turns the model's text into calls.

Pure: no llama.cpp, no IO, no logging (the grammar of a forced call is compiled and
checked by `sampling`, like any constraint).

One call format, whatever renders the prompt: the one Hermes 2 Pro made common (Qwen
2.5 and later, and the many models tuned on them, write it):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- `MODE_REQUIRED` / `MODE_NAMED`: a grammar allows nothing but calls in exactly that
  layout, each tool's arguments written by `schema.grammar` from its parameters, so
  every call the model can write validates. One call, or with parallel calls 1 to
  `MAX_FORCED_CALLS`. The parser streams a call's name as soon as it is written and
  its arguments fragment by fragment.
- `MODE_AUTO`: no grammar; the model answers in text, and what it writes between
  `<tool_call>` and `</tool_call>` is held back until the block closes, then parsed
  and validated against the tool's schema (`jsonschema`, every keyword). A valid call
  goes out whole; anything else (not JSON, an unknown tool, arguments that do not
  validate, a second call when parallel calls are off, a block the generation ended
  inside) goes out as the text it was: a half-formed call is never passed on as one.
  (llama.cpp's server starts a grammar lazily at the opening tag instead; its grammar
  aborts the process when the token that completes the tag carries text the grammar
  refuses, so Blazar validates rather than constrains here.)
- `MODE_AUTO` with a structured answer (a response format's JSON schema): a grammar
  from the first token lets the model write either calls, as when forced, or the
  answer the format describes, and nothing else (an agent's "call tools, then answer
  in this shape").
- `MODE_NONE`: tools are neither shown nor parsed.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors, jsonschemas, jsontext
from blazar.engine import schema, text

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
RESULT_OPEN = "<tool_response>"
RESULT_CLOSE = "</tool_response>"
# OpenAI's limit on tools per request.
MAX_TOOLS = 128
# Levels of nesting of a tool's parameters schema (objects and arrays). Deeper schemas
# are refused before any converter or validator recurses through them.
MAX_SCHEMA_DEPTH = 32
# Calls a forced turn may make when parallel calls are allowed: the grammar then ends,
# so that a model that keeps calling cannot run to max_tokens.
MAX_FORCED_CALLS = 8
# OpenAI's and Anthropic's tool names, plus '.' (namespaced tools, as MCP clients name them).
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# The empty schema of a tool without parameters.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

TOOLS_FIELD = "tools"
TOOL_CHOICE_FIELD = "tool_choice"


class Mode(StrEnum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"


_MODES = {
    inference_pb2.ToolChoice.MODE_UNSPECIFIED: Mode.AUTO,
    inference_pb2.ToolChoice.MODE_AUTO: Mode.AUTO,
    inference_pb2.ToolChoice.MODE_NONE: Mode.NONE,
    inference_pb2.ToolChoice.MODE_REQUIRED: Mode.REQUIRED,
    inference_pb2.ToolChoice.MODE_NAMED: Mode.NAMED,
}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    # The parameters' JSON schema (NO_PARAMETERS when the tool has none).
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolSet:
    """The tools of one request and what it asks of them."""

    tools: tuple[Tool, ...]
    mode: Mode = Mode.AUTO
    # Mode.NAMED: the tool to call.
    named: str = ""
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether tools are shown to the model and its output parsed for calls."""
        return bool(self.tools) and self.mode is not Mode.NONE

    @property
    def forced(self) -> bool:
        return self.active and self.mode in (Mode.REQUIRED, Mode.NAMED)

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a forced call may call."""
        if self.mode is Mode.NAMED:
            return tuple(t for t in self.tools if t.name == self.named)
        return self.tools

    def by_name(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def _blame(where: str, message: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, metadata={errors.FIELD_KEY: where})


def parse(chat: engine_pb2.ChatInput) -> ToolSet:
    """The request's tools, checked: InvalidRequest names the field at fault
    (`tools[2].parameters`, `tool_choice`)."""
    if len(chat.tools) > MAX_TOOLS:
        raise _blame(TOOLS_FIELD, f"At most {MAX_TOOLS} tools are accepted; got {len(chat.tools)}.")
    mode = _MODES.get(chat.tool_choice.mode)
    if mode is None:
        raise _blame(TOOL_CHOICE_FIELD, f"Unknown tool_choice mode {chat.tool_choice.mode}.")
    if chat.tool_choice.name and mode is not Mode.NAMED:
        # A name is a choice of tool: dropping it would run another mode than asked for.
        raise _blame(
            TOOL_CHOICE_FIELD,
            f"tool_choice names the tool {chat.tool_choice.name!r} but its mode is "
            f"'{mode}'; a name goes only with MODE_NAMED.",
        )
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, wire in enumerate(chat.tools):
        where = f"tools[{i}]"
        if not NAME.fullmatch(wire.name):
            raise _blame(
                f"{where}.name",
                f"Tool {i} has the name {wire.name!r}; a tool name is 1 to 64 letters, "
                "digits, '_', '-' or '.'.",
            )
        if wire.name in seen:
            raise _blame(
                f"{where}.name", f"Tools {seen[wire.name]} and {i} are both named {wire.name!r}."
            )
        seen[wire.name] = i
        tools.append(
            Tool(wire.name, wire.description, _parameters(wire.parameters, f"{where}.parameters"))
        )
    named = ""
    if mode in (Mode.REQUIRED, Mode.NAMED) and not tools:
        raise _blame(TOOL_CHOICE_FIELD, f"tool_choice '{mode}' needs tools to call; none given.")
    if mode is Mode.NAMED:
        named = chat.tool_choice.name
        if named not in seen:
            raise _blame(
                TOOL_CHOICE_FIELD,
                f"tool_choice names the tool {named!r}, which is not among the tools.",
            )
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    return ToolSet(tuple(tools), mode=mode, named=named, parallel=parallel)


def _parameters(source: str, where: str) -> dict[str, Any]:
    if not source.strip():
        return dict(NO_PARAMETERS)
    try:
        document = jsontext.loads(source, whole_characters=True)
    except jsontext.NotJSON as exc:
        raise _blame(where, f"'{where}' is not valid JSON: {exc}.") from None
    if not isinstance(document, dict):
        raise _blame(where, f"'{where}' must be a JSON Schema object.")
    if depth(document) > MAX_SCHEMA_DEPTH:
        raise _blame(where, _too_deep(where))
    kind = document.get("type", "object")
    if kind != "object":
        raise _blame(
            where, f'\'{where}\' must describe an object ("type": "object"); got {kind!r}.'
        )
    problem = jsonschemas.problem(document)
    if problem is not None:
        at, why = problem
        raise _blame(where, f"'{where}' is not a valid JSON Schema{at}: {why}.")
    return document


def _too_deep(where: str) -> str:
    return f"'{where}' nests more than {MAX_SCHEMA_DEPTH} levels deep."


def depth(value: Any) -> int:
    """Levels of JSON containers in `value`, counted without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Sequence[Any] = list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if level <= MAX_SCHEMA_DEPTH:
            stack.extend((child, level + 1) for child in children)
    return deepest


# ---------------------------------------------------------------- grammar


def grammar(tools: ToolSet, *, answer: str | None = None, result_stops: bool = False) -> str:
    """GBNF for a turn whose output has a set shape. Forced (`required`, a named tool):
    only calls, in the call format, with arguments that validate. With `answer` (the
    grammar of a structured answer, in auto mode): the calls of any tool, or that
    answer; with `result_stops` (RESULT_OPEN is a stop string of the turn) the calls
    may be followed by the opening of a result, as a free auto turn's may: the model
    ends its turn there, where it would make the result up, instead of writing calls
    until the budget or the most it may make (measured on the bundled model: one call
    and `tool_calls` in 5 of 5 turns, against 5 or 6 calls repeated up to
    `max_tokens` in 5 of 5). InvalidRequest names the tool whose schema the grammar
    cannot enforce."""
    lines: list[str] = []
    choices: list[str] = []
    for i, tool in enumerate(tools.tools):
        if tool not in tools.callable:
            continue
        try:
            arguments = schema.grammar(tool.parameters)
        except errors.InvalidRequest as err:
            where = f"tools[{i}].parameters"
            raise _blame(
                where, _unenforceable(tool, err.message, where, answer is not None)
            ) from None
        prefix = f"tool{i}-"
        lines.extend(_prefixed(arguments, prefix))
        head = schema.literal(f'"{tool.name}", "arguments": ')
        choices.append(f"{prefix}call")
        lines.append(f"{prefix}call ::= {head} {prefix}root")
    call = (
        f"call ::= {schema.literal(OPEN + chr(10) + '{' + chr(34) + 'name' + chr(34) + ': ')} "
        f"( {' | '.join(choices)} ) {schema.literal('}' + chr(10) + CLOSE)}"
    )
    more = f' ( "\\n" call ){{0,{MAX_FORCED_CALLS - 1}}}' if tools.parallel else ""
    if answer is None:
        return "\n".join([f"root ::= call{more}", call, *lines])
    shaped = list(_prefixed(answer, ANSWER_PREFIX))
    result = f" {schema.literal(chr(10) + RESULT_OPEN)}?" if result_stops else ""
    return "\n".join([f"root ::= call{more}{result} | {ANSWER_PREFIX}root", call, *lines, *shaped])


# The prefix of the structured answer's rules beside the calls' (`tool{i}-`).
ANSWER_PREFIX = "answer-"


def _unenforceable(tool: Tool, why: str, where: str, beside_answer: bool) -> str:
    if beside_answer:
        return (
            f"Tool '{tool.name}' cannot be offered beside a structured answer: {why} "
            f"('{where}'; the grammar that lets the model either call a tool or answer in "
            "the response format must write every call. Without a response format, "
            "tool_choice 'auto' accepts any valid schema and validates calls instead.)"
        )
    return (
        f"Tool '{tool.name}' cannot be forced: {why} ('{where}'; "
        "tool_choice 'auto' accepts any valid schema and validates calls instead.)"
    )


_RULE = re.compile(r"^([A-Za-z0-9-]+) ::= (.*)$")
_WORD = re.compile(r"[A-Za-z0-9-]+")


def _prefixed(gbnf: str, prefix: str) -> Iterator[str]:
    """The rules of `gbnf` with `prefix` before every rule name, where defined and
    where referred to (not inside string literals or character classes)."""
    # At "\n" only, not `splitlines`: a literal may hold U+2028, U+2029 or NEL.
    rules = [_RULE.match(line) for line in gbnf.split("\n") if line.strip()]
    names = {m.group(1) for m in rules if m}
    for m in rules:
        if m is None:
            raise ValueError("a converter grammar rule spans lines")
        yield f"{prefix}{m.group(1)} ::= {_rename(m.group(2), names, prefix)}"


def _rename(body: str, names: set[str], prefix: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c in '"[':
            end = _closing(body, i, '"' if c == '"' else "]")
            out.append(body[i:end])
            i = end
        elif c == "{":  # a repetition's counts: `{5}` is no reference to a rule "5"
            end = body.index("}", i) + 1
            out.append(body[i:end])
            i = end
        elif word := _WORD.match(body, i):
            name = word.group(0)
            out.append(prefix + name if name in names else name)
            i = word.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _closing(body: str, start: int, close: str) -> int:
    """Index just past the literal or class opened at `start`."""
    i = start + 1
    while i < len(body):
        if body[i] == "\\":
            i += 2
            continue
        if body[i] == close:
            return i + 1
        i += 1
    raise ValueError("an unterminated literal in a converter grammar")


# ---------------------------------------------------------------- rendering


def template_tools(tools: ToolSet) -> list[dict[str, Any]]:
    """The tools as chat templates read them (the OpenAI shape, Hugging Face's convention)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
            },
        }
        for t in tools.tools
    ]


def instructions(tools: ToolSet) -> str:
    """Blazar's own tool prompt, for templates that cannot show tools."""
    listed = "\n".join(
        json.dumps(
            {"name": t.name, "description": t.description, "parameters": t.parameters},
            ensure_ascii=False,
        )
        for t in tools.tools
    )
    if tools.mode is Mode.NAMED:
        when = f"Call the tool {tools.named!r} now."
    elif tools.mode is Mode.REQUIRED:
        when = "Call one of these tools now."
    else:
        when = "Call a tool when it helps to answer; otherwise answer in text."
    many = " Make one or more calls." if tools.parallel else " Make at most one call."
    return (
        "You can call these tools (each with a JSON schema of its arguments):\n"
        f"{listed}\n\n"
        "To call a tool, write a block like this, with the tool's name and its arguments "
        "as a JSON object:\n"
        f'{OPEN}\n{{"name": "<tool name>", "arguments": {{...}}}}\n{CLOSE}\n'
        f"{when}{many if tools.mode is not Mode.NAMED else ''} A tool's result comes back "
        f"between {RESULT_OPEN} and {RESULT_CLOSE}."
    )


def call_text(call: text.ToolCall) -> str:
    """A call as the model writes it in the call format."""
    return f'{OPEN}\n{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}\n{CLOSE}'


def builtin_turns(turns: Sequence[text.ChatTurn], tools: ToolSet | None) -> list[text.ChatTurn]:
    """The conversation for a template that cannot show tools: the tool prompt in the
    system turn, calls written into their assistant turns in the call format, tool
    results as user turns (merged with a user turn next to them, so that templates that
    insist on alternating turns accept them)."""
    out: list[text.ChatTurn] = []
    if tools is not None and tools.active:
        prompt = instructions(tools)
        if turns and turns[0].role == "system":
            out.append(text.ChatTurn("system", f"{turns[0].content}\n\n{prompt}"))
            turns = turns[1:]
        else:
            out.append(text.ChatTurn("system", prompt))
    merge_next = False
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            parts = [turn.content] if turn.content else []
            parts.extend(call_text(c) for c in turn.tool_calls)
            out.append(text.ChatTurn("assistant", "\n".join(parts)))
            merge_next = False
        elif turn.role == "tool":
            result = f"{RESULT_OPEN}\n{turn.content}\n{RESULT_CLOSE}"
            if merge_next or (out and out[-1].role == "user"):
                out[-1] = text.ChatTurn("user", f"{out[-1].content}\n{result}")
            else:
                out.append(text.ChatTurn("user", result))
            merge_next = True
        elif turn.role == "user" and merge_next:
            out[-1] = text.ChatTurn("user", f"{out[-1].content}\n\n{turn.content}")
            merge_next = False
        else:
            out.append(text.ChatTurn(turn.role, turn.content))
            merge_next = False
    return out


def history_turns(messages: Sequence[inference_pb2.Message]) -> list[text.ChatTurn]:
    """The conversation's turns; InvalidRequest names a call whose arguments are not a
    JSON object (`messages[3].tool_calls[0].arguments`)."""
    turns: list[text.ChatTurn] = []
    for i, m in enumerate(messages):
        calls: list[text.ToolCall] = []
        for j, c in enumerate(m.tool_calls):
            where = f"messages[{i}].tool_calls[{j}]"
            if m.role != "assistant":
                raise _blame(where, f"Message {i} has tool calls; only assistant turns make them.")
            if not c.name:
                raise _blame(f"{where}.name", f"Tool call {j} of message {i} has no name.")
            why = ""
            try:
                # Whole characters: half a surrogate pair ("\\ud800") has no UTF-8 form,
                # so no prompt can hold it (refused as the shim refuses it elsewhere).
                arguments = jsontext.loads(c.arguments or "{}", whole_characters=True)
            except jsontext.NotJSON as exc:
                arguments, why = None, f" ({exc})"
            if not isinstance(arguments, dict):
                raise _blame(
                    f"{where}.arguments",
                    f"The arguments of tool call {j} of message {i} are not a JSON object{why}.",
                )
            calls.append(
                text.ToolCall(
                    id=c.id, name=c.name, arguments=json.dumps(arguments, ensure_ascii=False)
                )
            )
        turns.append(
            text.ChatTurn(
                m.role,
                m.content,
                tool_calls=tuple(calls),
                tool_call_id=m.tool_call_id,
                name=m.name,
            )
        )
    return turns


# ---------------------------------------------------------------- parsing


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class CallDelta:
    """Part of a call (see blazar.v1.ToolCallDelta)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Parsed:
    """What a piece of the model's text comes to: text, and parts of calls."""

    text: str = ""
    calls: tuple[CallDelta, ...] = ()


@dataclass
class CallParser:
    """Splits a generation's text into text and calls, as it streams (see module doc).

    `feed` takes text as it is generated; `finish` flushes what was held back when the
    generation ends. `made` counts the calls passed on whole.
    """

    tools: ToolSet
    new_id: Callable[[], str] = new_call_id
    made: int = 0
    # Auto with a structured answer: the grammar lets the model write calls or that
    # answer and nothing else, so what is held when a generation that has not begun
    # the answer ends (a call, or its opening tag, cut short) is a call cut short:
    # left out, as a forced one is when collected, never text.
    shaped: bool = False
    # Auto: text was passed on (with `shaped`, the answer was begun).
    _texted: bool = False
    # Text not yet passed on: a possible start of OPEN, whitespace that may only
    # separate calls, or (auto) an open block.
    _held: str = ""
    _in_call: bool = False
    # Auto: the whitespace before the open block, which goes out with it when the
    # block is not a call (the text as it was), and nowhere when it is one.
    _gap: str = ""
    # Forced: where the call being streamed is (head, arguments, tail).
    _stage: str = "head"
    _args: _JsonScan = field(default_factory=lambda: _JsonScan())
    # A call was begun and not finished (forced, or shaped).
    partial: bool = False

    @property
    def called(self) -> bool:
        """Whether calls were made, each of them whole (none cut short)."""
        return self.made > 0 and not self.partial

    def feed(self, chunk: str) -> Parsed:
        if self.tools.forced:
            return self._feed_forced(chunk)
        return self._feed_auto(chunk)

    def finish(self) -> Parsed:
        """The text held back, once the generation has ended."""
        held, self._held = self._held, ""
        if self.tools.forced:
            return Parsed()
        if self.shaped and not self._texted:
            self.partial = self.partial or self._in_call or bool(held.strip())
            self._in_call = False
            return Parsed()
        if self._in_call:
            self._in_call = False
            return Parsed(text=self._gap + OPEN + held)
        # Whitespace after the last call only separated it from nothing.
        return Parsed(text="" if self.made and not held.strip() else held)

    # --- auto

    def _feed_auto(self, chunk: str) -> Parsed:
        buf = self._held + chunk
        out: list[str] = []
        calls: list[CallDelta] = []
        while True:
            if self._in_call:
                end = buf.find(CLOSE)
                if end < 0:
                    self._held = buf
                    break
                body, buf = buf[:end], buf[end + len(CLOSE) :]
                self._in_call = False
                call = self._validated(body)
                if call is None:
                    out.append(self._gap + OPEN + body + CLOSE)
                else:
                    calls.append(call)
                continue
            start = buf.find(OPEN)
            if start >= 0:
                before = buf[:start].rstrip()
                self._gap = buf[len(before) : start]
                out.append(before)
                buf = buf[start + len(OPEN) :]
                self._in_call = True
                continue
            # Trailing whitespace waits: before a call, or after the last, it only
            # separates, and goes nowhere.
            keep = _partial_suffix(buf, OPEN)
            ready = buf[: len(buf) - keep].rstrip()
            out.append(ready)
            self._held = buf[len(ready) :]
            break
        said = "".join(out)
        self._texted = self._texted or bool(said)
        return Parsed(text=said, calls=tuple(calls))

    def _validated(self, body: str) -> CallDelta | None:
        """The whole call a block holds, when it is one: JSON with a known tool's name
        and arguments valid against its schema; else None."""
        if self.made and not self.tools.parallel:
            return None
        try:
            document = jsontext.loads(body)
        except jsontext.NotJSON:
            return None
        if not isinstance(document, dict) or set(document) - {"name", "arguments"}:
            return None
        name, arguments = document.get("name"), document.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = jsontext.loads(arguments)
            except jsontext.NotJSON:
                return None
        tool = self.tools.by_name(name) if isinstance(name, str) else None
        if tool is None or not isinstance(arguments, dict) or not valid(tool, arguments):
            return None
        index, self.made = self.made, self.made + 1
        return CallDelta(index, self.new_id(), tool.name, jsontext.dumps(arguments))

    # --- forced

    def _feed_forced(self, chunk: str) -> Parsed:
        """The grammar allows only `OPEN\\n{"name": "<name>", "arguments": <JSON>}\\nCLOSE`,
        calls separated by a newline: the name goes out once written, the arguments as
        they come."""
        calls: list[CallDelta] = []
        buf = self._held + chunk
        self._held = ""
        while buf:
            if self._stage == "head":
                m = _HEAD.match(buf)
                if m is None:
                    self._held = buf  # the rest of the head is still to come
                    break
                self.partial = True
                calls.append(CallDelta(self.made, self.new_id(), m.group(1)))
                buf = buf[m.end() :]
                self._stage = "arguments"
                self._args = _JsonScan()
            elif self._stage == "arguments":
                used = self._args.feed(buf)
                if used:
                    calls.append(CallDelta(self.made, arguments=buf[:used]))
                buf = buf[used:]
                if self._args.done:
                    self._stage = "tail"
            else:
                end = buf.find(CLOSE)
                if end < 0:
                    self._held = buf
                    break
                buf = buf[end + len(CLOSE) :]
                self.made += 1
                self.partial = False
                self._stage = "head"
        return Parsed(calls=_merged(calls))


_HEAD = re.compile(r"\s*" + re.escape(OPEN) + r'\n\{"name": "([^"]+)", "arguments": ')


def _merged(calls: list[CallDelta]) -> tuple[CallDelta, ...]:
    """Consecutive argument fragments of one call as one delta."""
    out: list[CallDelta] = []
    for call in calls:
        last = out[-1] if out else None
        if last is not None and last.index == call.index and not call.id:
            out[-1] = CallDelta(last.index, last.id, last.name, last.arguments + call.arguments)
        else:
            out.append(call)
    return tuple(out)


@dataclass
class _JsonScan:
    """Finds where a JSON object ends in streamed text (strings and nesting tracked)."""

    level: int = 0
    in_string: bool = False
    escaped: bool = False
    done: bool = False

    def feed(self, chunk: str) -> int:
        """Characters of `chunk` that belong to the value (all, until it ends)."""
        for i, c in enumerate(chunk):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.level == 0:
                        return self._end(i)
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.level += 1
            elif c in "}]":
                self.level -= 1
                if self.level == 0:
                    return self._end(i)
        return len(chunk)

    def _end(self, i: int) -> int:
        self.done = True
        return i + 1


def _partial_suffix(buf: str, word: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `word`."""
    for n in range(min(len(word) - 1, len(buf)), 0, -1):
        if buf.endswith(word[:n]):
            return n
    return 0


def valid(tool: Tool, arguments: dict[str, Any]) -> bool:
    """Whether `arguments` validate against the tool's schema (formats checked too)."""
    from jsonschema import validators

    cls = validators.validator_for(tool.parameters)
    checker = cls.FORMAT_CHECKER
    try:
        return bool(cls(tool.parameters, format_checker=checker).is_valid(arguments))
    except Exception:
        # A schema jsonschema cannot apply ($ref to nowhere, a pattern Python's re
        # refuses): nothing validates against it.
        return False
