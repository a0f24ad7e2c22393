"""Ollama's legacy prompt templates (`template` on /api/generate), the part Blazar renders.

Pure. Ollama's templates are Go `text/template`s; a generate request's `template`
replaces the model's and is rendered with `.System` and `.Prompt`, then cut at
`{{ .Response }}` (where the model's answer goes; without one, the whole template is
the prompt). Blazar renders that legacy form: the fields `.System`, `.Prompt` and
`.Response`, `{{ if .System }}` / `{{ if .Prompt }}` blocks with `{{ else }}` and
`{{ end }}`, and Go's `{{-` / `-}}` whitespace trimming. Anything else (`.Messages`,
`range`, functions) is refused naming the action, never rendered half right.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from blazar.api import errors
from blazar.shim import validation

# An action, with Go's trim markers: "{{- " eats the white space before it, " -}}" after.
_ACTION = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.DOTALL)
_FIELDS = ("System", "Prompt")
_SUPPORTED = (
    "{{ .System }}, {{ .Prompt }}, {{ .Response }}, {{ if .System }} / {{ if .Prompt }} "
    "with {{ else }} and {{ end }}"
)


@dataclass
class _Block:
    # Whether the enclosing text renders, the condition, and whether past `else`.
    outer: bool
    condition: bool
    in_else: bool = False

    @property
    def active(self) -> bool:
        return self.outer and self.condition != self.in_else


def render(template: str, *, system: str, prompt: str) -> str:
    """The prompt `template` makes of `system` and `prompt`, up to `{{ .Response }}`."""
    values = {"System": system, "Prompt": prompt}
    pieces = _pieces(template)
    _check_blocks(pieces)
    out: list[str] = []
    blocks: list[_Block] = []
    for is_action, piece in pieces:
        active = not blocks or blocks[-1].active
        if not is_action:
            if active:
                out.append(piece)
        elif piece == "end":
            blocks.pop()
        elif piece == "else":
            blocks[-1].in_else = True
        elif piece.startswith("if "):
            blocks.append(_Block(outer=active, condition=bool(values[piece[4:]])))
        elif piece == ".Response":
            if active:
                break
        elif active:
            out.append(values[piece[1:]])
    return "".join(out)


def _pieces(template: str) -> list[tuple[bool, str]]:
    """Text and actions in order, trimmed as Go trims; an action Blazar does not render
    is an InvalidRequest naming it."""
    pieces: list[tuple[bool, str]] = []
    position = 0
    trim_next = False
    for match in _ACTION.finditer(template):
        text = template[position : match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        pieces.append((False, text))
        action = " ".join(match.group(2).split())
        if not (
            action in ("end", "else", ".Response")
            or action in {f".{name}" for name in _FIELDS}
            or action in {f"if .{name}" for name in _FIELDS}
        ):
            raise _unsupported(f"{{{{ {action} }}}}")
        pieces.append((True, action))
        trim_next = bool(match.group(3))
        position = match.end()
    rest = template[position:]
    if "{{" in rest:
        raise _unsupported("an unclosed '{{'")
    pieces.append((False, rest.lstrip() if trim_next else rest))
    return pieces


def _check_blocks(pieces: list[tuple[bool, str]]) -> None:
    depth = 0
    for is_action, piece in pieces:
        if not is_action:
            continue
        if piece.startswith("if "):
            depth += 1
        elif piece in ("end", "else") and depth == 0:
            raise _unsupported(f"{{{{ {piece} }}}} without its {{{{ if }}}}")
        elif piece == "end":
            depth -= 1
    if depth:
        raise _unsupported("an {{ if }} without its {{ end }}")


def _unsupported(what: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"Invalid value for 'template': {what} is not supported. Blazar renders Ollama's "
        f"legacy templates only: {_SUPPORTED}. Use /api/chat for a conversation, or "
        "'raw': true with a prompt you formatted yourself.",
        metadata={validation.PARAM_KEY: "template"},
    )
