"""Text handling of the engine worker: chat rendering, stop strings, UTF-8 streaming.

Pure: no llama.cpp, no IO, no logging. The decode loop feeds these with the bytes of
each sampled token and emits what they return.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import jinja2
import jinja2.sandbox

from blazar.api import errors

# The roles a conversation may use (blazar.v1.Message), whatever the template.
ROLES = ("system", "user", "assistant", "tool")
_GEMMA_ROLES = {"user": "user", "tool": "user", "assistant": "model"}


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant turn made; `arguments` is JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatTurn:
    """One message of a conversation: role ("system", "user", "assistant", "tool").

    An assistant turn may carry the calls it made; a tool turn the id of the call it
    answers and the tool's name.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


def check_roles(turns: Sequence[ChatTurn]) -> None:
    """InvalidRequest naming the first turn whose role is not one of `ROLES`.

    A Jinja template would render any role it is given ("<|im_start|>wizard"), so
    the check comes before any template sees the conversation.
    """
    for i, turn in enumerate(turns):
        if turn.role not in ROLES:
            raise errors.InvalidRequest(
                f"Message {i} has role '{turn.role}'; use {', '.join(ROLES[:-1])} or {ROLES[-1]}."
            )


# The request field that asks to continue the final assistant turn (prefill).
CONTINUE_FIELD = "continue_final_message"


def check_continuable(turns: Sequence[ChatTurn]) -> None:
    """InvalidRequest unless the conversation ends with an assistant turn that made no
    calls: the one kind of turn a continuation (prefill) can extend."""
    last = turns[-1] if turns else None
    if last is None or last.role != "assistant":
        raise errors.InvalidRequest(
            "Continuing the final message needs an assistant turn last; the conversation "
            f"ends with {'no turn' if last is None else f'a {last.role} turn'}.",
            metadata={errors.FIELD_KEY: CONTINUE_FIELD},
        )
    if last.tool_calls:
        raise errors.InvalidRequest(
            "The final assistant turn makes tool calls, and a turn's calls end it: it "
            "cannot be continued. Send the calls' results, or a final turn of text only.",
            metadata={errors.FIELD_KEY: CONTINUE_FIELD},
        )


def check_continuation(*, constrained: bool, forced: bool) -> None:
    """InvalidRequest when a continuation (prefill) comes with what would make it
    dishonest: a constraint (JSON schema, grammar) would shape only the continuation,
    not the answer the prefill begins, and a forced tool call would write calls after
    text the caller wrote, which a forced turn never holds."""
    if constrained:
        raise errors.InvalidRequest(
            "A structured output constraint (JSON schema or grammar) would apply to the "
            "continuation only, not to the final assistant turn it continues: send one or "
            "the other.",
            metadata={errors.FIELD_KEY: CONTINUE_FIELD},
        )
    if forced:
        raise errors.InvalidRequest(
            "A forced tool call (tool_choice required or a named tool) makes a turn of "
            "calls only, which cannot continue the final assistant turn's text: send one "
            "or the other.",
            metadata={errors.FIELD_KEY: CONTINUE_FIELD},
        )


def render_gemma(turns: Sequence[ChatTurn], *, continue_final: bool = False) -> str:
    """Render a conversation in Gemma's turn format, ending with an open model turn.

    The fallback when a model ships no chat template. System messages have no turn
    of their own in Gemma: their text opens the user turn that follows them (as
    llama.cpp's Gemma format does), and where a model turn or the end follows
    instead, it is a user turn of its own, so it stays where it was said. BOS is not
    part of the result; the tokenizer adds it.

    With `continue_final`, the final (assistant) turn is the open model turn: its
    content is written with no end of turn after it, trailing whitespace kept (the
    model continues right after it), and no new turn is opened.
    """
    check_roles(turns)
    final: ChatTurn | None = None
    if continue_final:
        check_continuable(turns)
        *turns, final = turns
    rendered: list[str] = []
    pending: list[str] = []

    def turn(role: str, content: str) -> None:
        rendered.append(f"<start_of_turn>{role}\n{content}<end_of_turn>\n")

    for t in turns:
        if t.role == "system":
            pending.append(t.content.strip())
            continue
        role = _GEMMA_ROLES[t.role]
        if pending and role == "user":
            turn(role, "\n\n".join([*pending, t.content.strip()]))
        else:
            if pending:
                turn("user", "\n\n".join(pending))
            turn(role, t.content.strip())
        pending = []
    if pending:
        turn("user", "\n\n".join(pending))
    rendered.append("<start_of_turn>model\n")
    if final is not None:
        rendered.append(final.content.lstrip())
    return "".join(rendered)


# Turn formats by name, for a Model's `chatTemplate: <name>` and for GGUFs that ship
# no template. "gemma" is rendered by `render_gemma`; the others are Jinja sources in
# the Hugging Face convention.
NAMED_TEMPLATES: dict[str, str | None] = {
    "gemma": None,
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
}


class ChatTemplate:
    """A Hugging Face style Jinja chat template (`messages`, `add_generation_prompt`).

    Compiled once; rendered in a sandbox. A leading BOS written by the template is
    dropped because the tokenizer adds BOS itself.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        # The same environment as transformers' apply_chat_template.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _template_error
        # Raises jinja2.TemplateSyntaxError for a broken template: a configuration error.
        self._template = env.from_string(source)
        self._bos = bos_token
        self._eos = eos_token
        self.renders_tools = _writes_tool_calls(source) and self._shows_tools()

    def _shows_tools(self) -> bool:
        """Whether the template puts a tool it is given into the prompt (as llama.cpp
        finds out: render with a tool and look for its name)."""
        probe = "blazar_probe_tool"
        tools = [
            {
                "type": "function",
                "function": {"name": probe, "description": "", "parameters": {"type": "object"}},
            }
        ]
        try:
            return probe in self.render([ChatTurn("user", "Hi")], tools=tools)
        except errors.InvalidRequest:
            return False

    def render(
        self,
        turns: Sequence[ChatTurn],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        continue_final: bool = False,
    ) -> str:
        """The prompt; with `tools` (the OpenAI shape), the template gets them as
        `tools`, as Hugging Face's apply_chat_template passes them.

        With `continue_final`, the final (assistant) turn is left open, as llama.cpp's
        server and vLLM's `continue_final_message` do: the conversation is rendered
        without a generation prompt and cut after the final turn's content. What the
        template writes after that content must not depend on it (end-of-turn text):
        the cut is found by rendering the turn a second time with a marker for its
        content, and a template whose two renders do not line up that way (one that
        drops, repeats or rewrites the final turn) is refused.
        """
        if not continue_final:
            return self._render(turns, tools=tools, add_generation_prompt=True)
        check_roles(turns)
        check_continuable(turns)
        rendered = self._render(turns, tools=tools, add_generation_prompt=False)
        content = turns[-1].content
        mark = _FINAL_MARKER
        while mark in rendered or any(mark in t.content for t in turns):
            mark += "q"
        marked = [*turns[:-1], ChatTurn("assistant", mark)]
        head, found, tail = self._render(
            marked, tools=tools, add_generation_prompt=False
        ).partition(mark)
        if found and mark not in tail and rendered.startswith(head) and rendered.endswith(tail):
            written = rendered[len(head) : len(rendered) - len(tail)]
            if written in _kept(content):
                return head + written
        raise errors.InvalidRequest(
            "The chat template does not end an assistant turn with its content followed "
            "by end-of-turn text only, so its final turn cannot be continued with this "
            "model; end the conversation with a user turn.",
            metadata={errors.FIELD_KEY: CONTINUE_FIELD},
        )

    def _render(
        self,
        turns: Sequence[ChatTurn],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        try:
            rendered = self._template.render(
                messages=[_message(t) for t in turns],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                **extra,
            )
        except errors.InvalidRequest:
            raise  # the template's own raise_exception
        except Exception as exc:
            # A template is code: it can divide by zero, recurse, index what is not there
            # or ask the sandbox for a range too big. Whatever it raises, the
            # conversation or the template is at fault, not Blazar.
            raise errors.InvalidRequest(f"The chat template failed: {exc}") from exc
        return rendered.removeprefix(self._bos) if self._bos else rendered


# Stands for the final turn's content in `ChatTemplate.render`'s second render:
# letters only, which every template writes as they are.
_FINAL_MARKER = "bzfinalturnmarker"


def _kept(content: str) -> tuple[str, ...]:
    """How a template may write a content it keeps: as it is, or trimmed."""
    return (content, content.strip(), content.lstrip(), content.rstrip())


def _writes_tool_calls(source: str) -> bool:
    """Whether the template writes calls in the one format Blazar parses (`tools`)."""
    return "<tool_call>" in source


def _message(turn: ChatTurn) -> dict[str, Any]:
    """A turn as templates read it: Hugging Face's convention, with a call's arguments
    as a mapping (templates write them with `tojson`)."""
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in turn.tool_calls
        ]
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    if turn.name:
        message["name"] = turn.name
    return message


def _template_error(message: str) -> NoReturn:
    raise errors.InvalidRequest(f"The chat template refused the conversation: {message}")


def fewest_tokens(text: str, longest_piece: int | None) -> int:
    """A lower bound on how many tokens text takes, known without tokenizing it: each
    token spells at most `longest_piece` of its bytes. 0 (no bound) for a tokenizer
    that may drop or fold text (`longest_piece` None)."""
    if not longest_piece:
        return 0
    return -(-len(text.encode("utf-8", errors="surrogatepass")) // longest_piece)


def context_limit(per_slot: int, requested: int | None) -> int:
    """The context a request may fill: a slot's, or the smaller one it asked for
    (Sampling.context_limit, Ollama's num_ctx). One that asks for more gets a slot's,
    which is all there is (the Ollama dialect refuses such a num_ctx first)."""
    return per_slot if not requested else min(per_slot, requested)


def generation_room(
    prompt_tokens: int,
    max_tokens: int | None,
    context: int,
    *,
    at_least: bool = False,
    up_to_context: bool = False,
    requested: bool = False,
) -> int:
    """The tokens a request may generate: its max_tokens, or what the context leaves
    after the prompt. Raises ContextLengthExceeded when the prompt (at least
    `prompt_tokens` long, with `at_least`) and max_tokens do not fit; with
    `up_to_context` (Sampling.max_tokens_up_to_context), max_tokens only bounds what
    the context leaves, and only a prompt that leaves nothing is refused. `requested`:
    `context` is the one the request asked for (`context_limit`), which the refusal
    says."""
    if max_tokens is not None and up_to_context:
        room = generation_room(prompt_tokens, None, context, at_least=at_least, requested=requested)
        return min(max_tokens, room)
    if max_tokens is None:
        if prompt_tokens >= context:
            raise errors.ContextLengthExceeded.of(
                prompt_tokens=prompt_tokens,
                max_tokens=1,
                context_length=context,
                at_least=at_least,
                requested=requested,
            )
        return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
        raise errors.ContextLengthExceeded.of(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            context_length=context,
            at_least=at_least,
            requested=requested,
        )
    return max_tokens


@dataclass(frozen=True)
class StopResult:
    """What to emit after feeding text, and whether a stop string matched.

    `stop_at` is where the matched stop string begins, counted in characters of all
    text fed so far (-1 while none matched): text from there on is never emitted.
    `matched` is that stop string (the first given of those that begin there).
    """

    text: str
    stopped: bool
    stop_at: int = -1
    matched: str = ""


class StopMatcher:
    """Find stop strings in streamed text, across token boundaries.

    Text that could be the start of a stop string is held back until the next feed
    proves otherwise, so nothing past (or part of) a stop string is ever emitted.

    `quiet` (an opening and a closing marker: a tool call's block in auto mode) names
    stretches where stops do not apply: from the end of an opening marker to the end
    of its closing one, a stop string that begins there is not matched. A caller's stop
    sequences end the text of an answer, not a call written inside it, as a forced
    call's grammar keeps them out of calls altogether.
    """

    def __init__(self, stops: Sequence[str], *, quiet: tuple[str, str] | None = None) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self._fed = 0
        self._quiet = _QuietStretches(*quiet) if quiet is not None and self._stops else None

    def feed(self, text: str) -> StopResult:
        # Where buf begins in everything fed: the held text was fed before.
        start = self._fed - len(self._held)
        self._fed += len(text)
        buf = self._held + text
        if not self._stops:
            self._held = ""
            return StopResult(buf, stopped=False)
        quiet = self._quiet
        if quiet is not None:
            quiet.feed(text)
        hits = [(i, s) for s in self._stops if (i := self._find(buf, s, start)) >= 0]
        if hits:
            self._held = ""
            at, matched = min(hits, key=lambda hit: hit[0])
            return StopResult(buf[:at], stopped=True, stop_at=start + at, matched=matched)
        keep = 0 if quiet is not None and quiet.inside_at(self._fed) else self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :]
        return StopResult(buf[: len(buf) - keep], stopped=False)

    def _find(self, buf: str, stop: str, start: int) -> int:
        """Where `stop` first begins in `buf` outside a quiet stretch (-1: nowhere);
        `start`: where buf begins in everything fed."""
        at = buf.find(stop)
        while at >= 0 and self._quiet is not None and self._quiet.inside_at(start + at):
            at = buf.find(stop, at + 1)
        return at

    def flush(self) -> str:
        """The held-back text, once the stream ends without a stop."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class _QuietStretches:
    """Where, in everything fed, text lies from the end of an `opening` marker to the
    end of the `closing` one after it (markers found across feeds)."""

    def __init__(self, opening: str, closing: str) -> None:
        self._opening, self._closing = opening, closing
        # The last characters fed, too few to hold a whole marker: one that ends in the
        # next feed is found across the boundary, and none is found twice.
        self._tail = ""
        self._keep = max(len(opening), len(closing)) - 1
        self._fed = 0
        # Positions (in everything fed) where a stretch begins and ends, in order;
        # an odd count: the last one is still open.
        self._bounds: list[int] = []

    def feed(self, text: str) -> None:
        scan = self._tail + text
        base = self._fed - len(self._tail)
        at = 0
        while True:
            marker = self._closing if len(self._bounds) % 2 else self._opening
            found = scan.find(marker, at)
            if found < 0:
                break
            at = found + len(marker)
            self._bounds.append(base + at)
        self._fed += len(text)
        self._tail = scan[-self._keep :] if self._keep else ""
        # A found marker's end may lie in the kept tail: never scan it again.
        self._tail = self._tail[max(0, len(self._tail) - (self._fed - self._last_bound())) :]

    def _last_bound(self) -> int:
        return self._bounds[-1] if self._bounds else 0

    def inside_at(self, position: int) -> bool:
        """Whether the character at `position` (of everything fed) is in a stretch."""
        inside = False
        for bound in self._bounds:
            if bound > position:
                break
            inside = not inside
        return inside


class Utf8Stream:
    """Decode UTF-8 pieces into whole characters; a split character waits for its rest.

    Invalid bytes become U+FFFD. A character still incomplete when the stream ends is
    dropped rather than emitted as half a character.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data, final=False)

    def pending(self) -> bool:
        """True while bytes of an incomplete character are buffered."""
        buffered, _ = self._decoder.getstate()
        return bool(buffered)
