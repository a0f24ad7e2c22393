"""A chat's prompt with the caller's text kept as text.

A chat template writes the model's control tokens as text (`<start_of_turn>`), and the
prompt is tokenized with those parsed as special tokens. A message whose content holds
the same text (`<end_of_turn><start_of_turn>model`) would then close its turn and open
one the caller made up. So where a message's content holds text that tokenizes as a
special token, the prompt is rendered a second time with that content replaced by a
marker nobody can forge (a nonce per request, in Unicode's private use area); the two
renders line up into template text and the caller's text, and only template text is
tokenized with special tokens parsed.

A template may change a content it writes: most trim it, some do nothing. The content
is found where the marker was, as it is, stripped, or stripped on one side; a template
that changes it otherwise (or renders something else around it when it sees the
marker) cannot be lined up, and `split` answers None.

Not only contents: every string a caller gives that a template or Blazar's own tool
prompt writes into the prompt is masked the same way (`mask`): a tool's description
and the keys and strings of its parameters' schema, the name, id and the keys and
strings of the arguments of a call in the history, a tool turn's name and call id.
Those are written as JSON (Blazar's tool prompt, or a template's `tojson`), so each is
also looked for as JSON writes it, escaped. Tool names are not masked: they are 1 to
64 letters, digits, '_', '-' or '.' (`tools.NAME`), which write no control token.

Markers are ASCII letters and digits, which every encoding writes unchanged.

Pure: no llama, no IO.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from blazar.api import errors
from blazar.engine import tools as tools_
from blazar.engine.text import ChatTurn, ToolCall


@dataclass(frozen=True)
class Piece:
    """Part of the prompt: template text (`special`: control tokens written in it are
    parsed) or a caller's text (tokenized as text)."""

    text: str
    special: bool


def marker(nonce: str, index: int) -> str:
    # Letters and digits only: raw, JSON and Jinja's `tojson` all write it as it is.
    # `z` ends it, so that marker 1 is not the start of marker 10.
    return f"bzmask{nonce}x{index}z"


def masked(turns: Sequence[ChatTurn], which: Mapping[int, str], nonce: str) -> list[ChatTurn]:
    """The conversation with the content of each turn in `which` (by index) replaced by
    its marker."""
    return [
        dataclasses.replace(turn, content=marker(nonce, i)) if i in which else turn
        for i, turn in enumerate(turns)
    ]


def split(
    rendered: str, masked_render: str, which: Mapping[int, str], nonce: str
) -> list[Piece] | None:
    """`rendered` (the prompt) cut into pieces, using `masked_render` (the same
    conversation rendered with the contents in `which` masked) to tell the template's
    text from those contents. None when the two do not line up."""
    pieces: list[Piece] = []
    pos = 0
    rest = masked_render
    while True:
        found = _next_marker(rest, which, nonce)
        if found is None:
            if rendered[pos:] != rest:
                return None
            if rest:
                pieces.append(Piece(rest, special=True))
            return pieces
        start, end, index = found
        template = rest[:start]
        if not rendered.startswith(template, pos):
            return None
        if template:
            pieces.append(Piece(template, special=True))
        pos += len(template)
        rest = rest[end:]
        following = _template_prefix(rest, which, nonce)
        content = which[index]
        for written in _as_written(content):
            if rendered.startswith(written, pos) and rendered.startswith(
                following, pos + len(written)
            ):
                break
        else:
            return None
        if written:
            pieces.append(Piece(written, special=False))
        pos += len(written)


def _as_written(content: str) -> tuple[str, ...]:
    """How a template may have written a content, most faithful first: as it is,
    trimmed, or as a JSON string's inside (Blazar's tool prompt; Jinja's `tojson`,
    which also escapes `<`, `>`, `&` and `'`)."""
    escaped = json.dumps(content)[1:-1]
    htmlsafe = (
        escaped.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("'", "\\u0027")
    )
    written = (content, content.strip(), content.lstrip(), content.rstrip())
    return tuple(
        dict.fromkeys((*written, json.dumps(content, ensure_ascii=False)[1:-1], escaped, htmlsafe))
    )


def _next_marker(text: str, which: Mapping[int, str], nonce: str) -> tuple[int, int, int] | None:
    """(start, end, turn index) of the first marker in `text`."""
    best: tuple[int, int, int] | None = None
    for index in which:
        mark = marker(nonce, index)
        start = text.find(mark)
        if start >= 0 and (best is None or start < best[0]):
            best = (start, start + len(mark), index)
    return best


def _template_prefix(text: str, which: Mapping[int, str], nonce: str) -> str:
    """The template text at the start of `text`, up to the next marker."""
    found = _next_marker(text, which, nonce)
    return text if found is None else text[: found[0]]


@dataclass(frozen=True)
class Masked:
    """A conversation and its tools with the caller's risky strings masked."""

    turns: list[ChatTurn]
    tools: tools_.ToolSet | None
    # Marker index -> the string it stands for; and -> where the caller gave it
    # (`messages[2].tool_calls[0].arguments`, `tools[1].description`).
    which: dict[int, str]
    where: dict[int, str]


class _Masker:
    """Hands out markers for the strings `risky` says write control tokens."""

    def __init__(self, risky: Callable[[str], bool], nonce: str, first: int) -> None:
        self._risky = risky
        self._nonce = nonce
        self._next = first
        self.which: dict[int, str] = {}
        self.where: dict[int, str] = {}

    def string(self, value: str, where: str) -> str:
        if not value or not self._risky(value):
            return value
        index = self._next
        self._next += 1
        self.which[index] = value
        self.where[index] = where
        return marker(self._nonce, index)

    def json(self, value: Any, where: str) -> Any:
        """`value` (parsed JSON) with its risky keys and strings masked; the whole is
        checked first, as most values hold nothing risky."""
        if not self._risky(json.dumps(value, ensure_ascii=False)):
            return value
        try:
            return self._walk(value, where)
        except RecursionError:
            raise errors.InvalidRequest(
                f"{where} is nested too deeply to be checked for control-token text.",
                metadata={errors.FIELD_KEY: where},
            ) from None

    def _walk(self, value: Any, where: str) -> Any:
        if isinstance(value, str):
            return self.string(value, where)
        if isinstance(value, list):
            return [self._walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {
                self.string(k, f"{where}.{k}"): self._walk(v, f"{where}.{k}")
                for k, v in value.items()
            }
        return value


def mask(
    turns: Sequence[ChatTurn],
    toolset: tools_.ToolSet | None,
    *,
    risky: Callable[[str], bool],
    nonce: str,
) -> Masked:
    """Every caller string in the conversation and its tools that `risky` says writes
    a control token, replaced by a marker (a turn's content by marker i, for turn i,
    as `masked` does; the rest from len(turns) on)."""
    masker = _Masker(risky, nonce, first=len(turns))
    out: list[ChatTurn] = []
    for i, turn in enumerate(turns):
        content = turn.content
        if content and risky(content):
            masker.which[i] = content
            masker.where[i] = f"messages[{i}].content"
            content = marker(nonce, i)
        calls = []
        for j, call in enumerate(turn.tool_calls):
            at = f"messages[{i}].tool_calls[{j}]"
            arguments = masker.json(json.loads(call.arguments), f"{at}.arguments")
            calls.append(
                ToolCall(
                    id=masker.string(call.id, f"{at}.id"),
                    name=masker.string(call.name, f"{at}.name"),
                    arguments=json.dumps(arguments, ensure_ascii=False),
                )
            )
        out.append(
            ChatTurn(
                turn.role,
                content,
                tool_calls=tuple(calls),
                tool_call_id=masker.string(turn.tool_call_id, f"messages[{i}].tool_call_id"),
                name=masker.string(turn.name, f"messages[{i}].name"),
            )
        )
    shown = toolset
    if toolset is not None:
        shown = dataclasses.replace(
            toolset,
            tools=tuple(
                tools_.Tool(
                    tool.name,
                    masker.string(tool.description, f"tools[{k}].description"),
                    masker.json(tool.parameters, f"tools[{k}].parameters"),
                )
                for k, tool in enumerate(toolset.tools)
            ),
        )
    return Masked(turns=out, tools=shown, which=masker.which, where=masker.where)
