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

Pure: no llama, no IO.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from blazar.engine.text import ChatTurn


@dataclass(frozen=True)
class Piece:
    """Part of the prompt: template text (`special`: control tokens written in it are
    parsed) or a caller's text (tokenized as text)."""

    text: str
    special: bool


def marker(nonce: str, index: int) -> str:
    return f"\ue000{nonce}:{index}\ue001"


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
    """How a template may have written a content, most faithful first."""
    return tuple(dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())))


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
