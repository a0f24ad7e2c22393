"""Pure text handling of the engine worker: chat fallback, stop strings, UTF-8 streaming."""

from __future__ import annotations

import jinja2
import pytest

from blazar.api import errors, kinds
from blazar.engine import text
from blazar.engine.text import ChatTurn as T

# --- Gemma turn-format fallback ---------------------------------------------------------


@pytest.mark.parametrize(
    ("turns", "expected"),
    [
        (
            [T("user", "Hi")],
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        ),
        (
            [T("system", "Be brief."), T("user", " What is 2+2? ")],
            "<start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        ),
        (
            [T("user", "a"), T("assistant", "b"), T("user", "c")],
            "<start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n"
            "<start_of_turn>user\nc<end_of_turn>\n<start_of_turn>model\n",
        ),
        (  # before a model turn, the system text is a user turn of its own
            [T("system", "S"), T("assistant", "hello"), T("user", "u")],
            "<start_of_turn>user\nS<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
            "<start_of_turn>user\nu<end_of_turn>\n<start_of_turn>model\n",
        ),
        (  # several system messages are joined
            [T("system", "A"), T("system", "B"), T("user", "u")],
            "<start_of_turn>user\nA\n\nB\n\nu<end_of_turn>\n<start_of_turn>model\n",
        ),
        (  # a system message in mid-conversation stays where it was said
            [T("user", "U1"), T("assistant", "A1"), T("system", "S"), T("user", "U2")],
            "<start_of_turn>user\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
            "<start_of_turn>user\nS\n\nU2<end_of_turn>\n<start_of_turn>model\n",
        ),
        (  # ... and one with no user turn after it becomes the last user turn
            [T("user", "U1"), T("assistant", "A1"), T("system", "S")],
            "<start_of_turn>user\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
            "<start_of_turn>user\nS<end_of_turn>\n<start_of_turn>model\n",
        ),
        (  # system alone becomes a user turn
            [T("system", "S")],
            "<start_of_turn>user\nS<end_of_turn>\n<start_of_turn>model\n",
        ),
        (  # tool results have no turn of their own in Gemma: they speak as the user
            [T("tool", "42")],
            "<start_of_turn>user\n42<end_of_turn>\n<start_of_turn>model\n",
        ),
    ],
)
def test_render_gemma(turns: list[T], expected: str) -> None:
    assert text.render_gemma(turns) == expected


def test_render_gemma_rejects_unknown_role() -> None:
    with pytest.raises(errors.InvalidRequest, match="wizard"):
        text.render_gemma([T("wizard", "x")])


# --- Jinja chat templates ----------------------------------------------------------------

SIMPLE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
STRICT = (
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{{ raise_exception('no system role') }}{% endif %}{{ m.content }}{% endfor %}"
)


@pytest.mark.parametrize(
    ("source", "bos", "turns", "expected"),
    [
        (SIMPLE, "<s>", [T("user", "hi")], "[user] hi</s>\n[assistant] "),  # BOS dropped
        (
            SIMPLE,
            "",
            [T("system", "S"), T("user", "u")],
            "[system] S</s>\n[user] u</s>\n[assistant] ",
        ),
        (STRICT, "<s>", [T("user", "a"), T("assistant", "b")], "ab"),
    ],
)
def test_chat_template_renders(source: str, bos: str, turns: list[T], expected: str) -> None:
    assert text.ChatTemplate(source, bos_token=bos, eos_token="</s>").render(turns) == expected


@pytest.mark.parametrize(
    ("source", "match"),
    [
        (STRICT, "no system role"),  # the template's own raise_exception
        ("{{ messages[5].content.upper() }}", "chat template failed"),
    ],
)
def test_chat_template_errors_are_invalid_requests(source: str, match: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=match):
        text.ChatTemplate(source).render([T("system", "s")])


def test_chat_template_syntax_error_is_raised_at_compile_time() -> None:
    with pytest.raises(jinja2.TemplateSyntaxError):
        text.ChatTemplate("{% for %}")


# --- stop strings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stops", "pieces", "emitted", "stopped", "tail"),
    [
        ([], ["a", "b"], ["a", "b"], False, ""),
        (["END"], ["hello", " world"], ["hello", " world"], False, ""),
        (["END"], ["helloEND"], ["hello"], True, ""),
        # spans token boundaries; the partial "EN" is held back, never emitted
        (["END"], ["hello E", "N", "D!"], ["hello ", "", ""], True, ""),
        # a held prefix that turns out not to be a stop is released
        (["END"], ["hello E", "NX"], ["hello ", "ENX"], False, ""),
        # the stream ends while a prefix is held: flush returns it
        (["END"], ["abc EN"], ["abc "], False, "EN"),
        # earliest match wins across stop strings
        (["world", "lo"], ["hello world"], ["hel"], True, ""),
        # text past the stop inside the same piece is dropped
        (["\n\n"], ["line\n", "\nnext"], ["line", ""], True, ""),
        # the stop string is the whole piece
        (["###"], ["###"], [""], True, ""),
        # overlapping prefixes: "aab" inside "aaab"
        (["aab"], ["a", "a", "a", "b"], ["", "", "a", ""], True, ""),
        # empty stop strings are ignored
        ([""], ["x"], ["x"], False, ""),
        # multi-byte characters
        (["é!"], ["café", "!"], ["caf", ""], True, ""),
    ],
)
def test_stop_matcher(
    stops: list[str], pieces: list[str], emitted: list[str], stopped: bool, tail: str
) -> None:
    m = text.StopMatcher(stops)
    results = [m.feed(p) for p in pieces]
    assert [r.text for r in results] == emitted
    assert [r.stopped for r in results] == [False] * (len(pieces) - 1) + [stopped]
    # Everything before the stop string went out, so it begins where the output ends.
    assert results[-1].stop_at == (len("".join(emitted)) if stopped else -1)
    # The stop string that matched is named (the first given of those at that place).
    matched = results[-1].matched
    assert (
        (matched in stops and "".join(pieces)[results[-1].stop_at :].startswith(matched))
        if stopped
        else matched == ""
    )
    assert m.flush() == tail


def test_the_first_given_stop_is_named_when_two_begin_at_one_place() -> None:
    assert text.StopMatcher(["ab", "abc"]).feed("xabc").matched == "ab"
    assert text.StopMatcher(["abc", "ab"]).feed("xabc").matched == "abc"


QUIET = ("<tool_call>", "</tool_call>")
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": "x}y"}}\n</tool_call>'


def feed_all(m: text.StopMatcher, pieces: list[str]) -> tuple[str, text.StopResult]:
    """What went out, and the last result: pieces are fed until a stop matches."""
    out = ""
    for piece in pieces:
        result = m.feed(piece)
        out += result.text
        if result.stopped:
            break
    return out, result


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7, 64])
@pytest.mark.parametrize("stops", [["\n"], ["}"], ["\n", "}"], ["y"]])
def test_stops_do_not_apply_inside_a_quiet_block_whatever_the_pieces(
    split: int, stops: list[str]
) -> None:
    """Found by a review: an auto-mode tool call cut by the caller's stop sequence
    ("\n" follows every call's opening marker) came back as text. Inside the block
    they do not apply; after it, they do again."""
    whole = "Sure. " + CALL + " then\nmore} y"
    pieces = [whole[i : i + split] for i in range(0, len(whole), split)]
    out, last = feed_all(text.StopMatcher(stops, quiet=QUIET), pieces)
    assert out.startswith("Sure. " + CALL)  # the block went out whole
    assert last.stopped and last.stop_at == len(out)
    assert whole[last.stop_at :].startswith(last.matched)
    assert last.stop_at >= len("Sure. " + CALL)


def test_a_stop_before_the_block_still_ends_the_text() -> None:
    out, last = feed_all(text.StopMatcher(["\n"], quiet=QUIET), ["Hi\n", CALL])
    assert (out, last.stopped) == ("Hi", True)


def test_without_quiet_markers_a_stop_inside_the_block_ends_the_text() -> None:
    out, last = feed_all(text.StopMatcher(["\n"]), [CALL])
    assert (out, last.stopped) == ("<tool_call>", True)


def test_an_unclosed_block_keeps_stops_quiet_to_the_end() -> None:
    m = text.StopMatcher(["}"], quiet=QUIET)
    out, last = feed_all(m, ["<tool_", "call>{", '"a": 1}', "}"])
    assert (out, last.stopped, m.flush()) == ('<tool_call>{"a": 1}}', False, "")


# --- UTF-8 streaming --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pieces", "out", "pending"),
    [
        ([b"abc"], ["abc"], False),
        (["é".encode()[:1], "é".encode()[1:]], ["", "é"], False),
        # a 4-byte emoji split over three tokens
        ([b"\xf0\x9f", b"\x98", b"\x80!"], ["", "", "\U0001f600!"], False),
        # the character is still incomplete when the stream ends
        ([b"ok", "日".encode()[:2]], ["ok", ""], True),
        # invalid bytes become U+FFFD instead of breaking the stream
        ([b"\xff", b"a"], ["\ufffd", "a"], False),
        ([b""], [""], False),
    ],
)
def test_utf8_stream(pieces: list[bytes], out: list[str], pending: bool) -> None:
    s = text.Utf8Stream()
    assert [s.feed(p) for p in pieces] == out
    assert s.pending() is pending


@pytest.mark.parametrize(
    ("architecture", "name"),
    [("gemma3", "gemma"), ("gemma2", "gemma"), ("gemma", "gemma"), ("llama", "llama3"),
     ("qwen2", "chatml"), ("phi3", "chatml"), ("", "chatml")],
)  # fmt: skip
def test_fallback_template_by_architecture(architecture: str, name: str) -> None:
    assert kinds.fallback_template(architecture) == name
    assert name in text.NAMED_TEMPLATES


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "chatml",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            "llama3",
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
    ],
)
def test_named_templates_render(name: str, expected: str) -> None:
    source = text.NAMED_TEMPLATES[name]
    assert source is not None
    template = text.ChatTemplate(source, bos_token="<|begin_of_text|>")
    turns = [text.ChatTurn("system", "Be brief."), text.ChatTurn("user", "Hi")]
    assert template.render(turns) == expected


def test_every_name_a_model_may_give_is_a_template() -> None:
    assert set(kinds.CHAT_TEMPLATE_NAMES) == set(text.NAMED_TEMPLATES)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("{% for m in messages %}{{ 1 / 0 }}{% endfor %}", "division by zero"),
        ("{% for i in range(300000) %}x{% endfor %}{{ messages }}", "range"),
        (
            "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}{{ messages }}",
            "recursion",
        ),
        ("{{ messages[0]['content'] + 1 }}", "str"),
        ('{% for m in messages %}{{ "%(name)s" % m }}{% endfor %}', "name"),
    ],
)
def test_a_template_that_breaks_while_rendering_is_the_callers_error(
    source: str, fragment: str
) -> None:
    template = text.ChatTemplate(source)
    with pytest.raises(errors.InvalidRequest, match="The chat template failed") as caught:
        template.render([T("user", "Hi")])
    assert fragment in str(caught.value).lower()


@pytest.mark.parametrize(
    ("text_", "longest", "fewest"),
    [
        ("", 48, 0),
        ("a" * 48, 48, 1),
        ("a" * 49, 48, 2),
        ("é" * 24, 48, 1),  # bytes, not characters: 48 of them
        ("\ud800", 4, 1),  # an unpaired surrogate (the engine refuses it later) counts too
        ("a" * 1000, None, 0),  # a tokenizer that may fold text: no bound
    ],
)
def test_fewest_tokens_is_the_bytes_over_the_longest_piece(
    text_: str, longest: int | None, fewest: int
) -> None:
    assert text.fewest_tokens(text_, longest) == fewest


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "room"),
    [(10, None, 2038), (10, 100, 100), (2047, None, 1), (2000, 48, 48)],
)
def test_generation_room(prompt: int, max_tokens: int | None, room: int) -> None:
    assert text.generation_room(prompt, max_tokens, 2048) == room


@pytest.mark.parametrize(("prompt", "max_tokens"), [(2048, None), (2000, 49), (10, 2048)])
def test_no_generation_room_is_context_length_exceeded(prompt: int, max_tokens: int | None) -> None:
    with pytest.raises(errors.ContextLengthExceeded, match="maximum context length is 2048 tokens"):
        text.generation_room(prompt, max_tokens, 2048)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "room"),
    [(10, 100, 100), (2000, 49, 48), (10, 4096, 2038), (2047, 4096, 1), (10, None, 2038)],
)
def test_max_tokens_up_to_context_only_bounds_the_room(
    prompt: int, max_tokens: int | None, room: int
) -> None:
    """Ollama's num_predict: a bound, not a reservation; the context's end stops it."""
    assert text.generation_room(prompt, max_tokens, 2048, up_to_context=True) == room


@pytest.mark.parametrize(("prompt", "max_tokens"), [(2048, 16), (3000, 4096), (2048, None)])
def test_up_to_context_still_refuses_a_prompt_that_leaves_no_room(
    prompt: int, max_tokens: int | None
) -> None:
    with pytest.raises(errors.ContextLengthExceeded) as caught:
        text.generation_room(prompt, max_tokens, 2048, up_to_context=True)
    assert caught.value.metadata["max_tokens"] == "1"


def test_a_bound_on_the_prompt_says_at_least() -> None:
    with pytest.raises(errors.ContextLengthExceeded) as caught:
        text.generation_room(90_000, 16, 2048, at_least=True)
    assert "needs at least 90016 (at least 90000 in the prompt and 16" in str(caught.value)
    assert caught.value.metadata["prompt_tokens"] == "90000"


@pytest.mark.parametrize(
    ("per_slot", "requested", "limit"),
    [(2048, None, 2048), (2048, 0, 2048), (2048, 16, 16), (2048, 2048, 2048), (2048, 4096, 2048)],
)
def test_context_limit_is_the_smaller_of_the_slots_and_the_requests(
    per_slot: int, requested: int | None, limit: int
) -> None:
    assert text.context_limit(per_slot, requested) == limit


def test_a_prompt_over_the_requested_context_says_it_is_the_requests() -> None:
    """Ollama's num_ctx below the Lane's: the same refusal, saying whose context it is."""
    with pytest.raises(errors.ContextLengthExceeded) as caught:
        text.generation_room(30, 100, 16, up_to_context=True, requested=True)
    assert caught.value.metadata[errors.CONTEXT_LIMIT_KEY] == "16"
    sizes = caught.value.sizes()
    assert sizes is not None and sizes.requested and sizes.context_length == 16
    assert "asked for a context of 16 tokens (context_limit)" in caught.value.message
    # The room left in it bounds num_predict: the generation stops at its end.
    assert text.generation_room(10, 100, 16, up_to_context=True, requested=True) == 6


# --- continuing the final assistant turn (prefill) --------------------------------------

PREFILL = [T("system", "S"), T("user", "Hi"), T("assistant", "  Sure: {")]
# Gemma 3's own template, in short: contents trimmed, each turn closed.
GEMMA_JINJA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.parametrize(
    ("final", "expected"),
    [
        # OpenAI's meaning: the final assistant turn is closed, the answer a new turn.
        (
            False,
            "<start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\nSure: {"
            "<end_of_turn>\n<start_of_turn>model\n",
        ),
        # Continued: left open, no end of turn, no new turn; trailing space kept.
        (True, "<start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\nSure: {"),
    ],
)
def test_render_gemma_continues_the_final_assistant_turn_when_asked(
    final: bool, expected: str
) -> None:
    assert text.render_gemma(PREFILL, continue_final=final) == expected


def test_render_gemma_continuation_keeps_the_prefills_trailing_whitespace() -> None:
    turns = [T("user", "Hi"), T("assistant", "The answer is ")]
    assert text.render_gemma(turns, continue_final=True).endswith("model\nThe answer is ")


@pytest.mark.parametrize(
    ("source", "turns", "expected"),
    [
        (
            GEMMA_JINJA,
            PREFILL,
            "<start_of_turn>system\nS<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n"
            "<start_of_turn>model\nSure: {",
        ),
        # A template that keeps contents as they are keeps the prefill's spaces.
        (SIMPLE, [T("user", "u"), T("assistant", "a ")], "[user] u</s>\n[assistant] a "),
        # An empty prefill opens the turn as a generation prompt would.
        (SIMPLE, [T("user", "u"), T("assistant", "")], "[user] u</s>\n[assistant] "),
        (
            text.NAMED_TEMPLATES["chatml"],
            [T("user", "u"), T("assistant", "{")],
            "<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n{",
        ),
    ],
)
def test_chat_template_continues_the_final_assistant_turn(
    source: str, turns: list[T], expected: str
) -> None:
    template = text.ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.render(turns, continue_final=True) == expected


@pytest.mark.parametrize(
    "source",
    [
        # Drops the final assistant turn.
        "{% for m in messages %}{% if not loop.last %}{{ m.content }}|{% endif %}{% endfor %}",
        # Writes what follows the content from the content itself.
        "{% for m in messages %}{{ m.content }}<{{ m.content | length }}>{% endfor %}",
        # Writes the content twice.
        "{% for m in messages %}{{ m.content }}={{ m.content }};{% endfor %}",
        # Rewrites it.
        "{% for m in messages %}{{ m.content | upper }};{% endfor %}",
    ],
)
def test_a_template_that_does_not_end_the_turn_with_its_content_cannot_continue_it(
    source: str,
) -> None:
    with pytest.raises(errors.InvalidRequest, match="cannot be continued") as caught:
        text.ChatTemplate(source).render(
            [T("user", "u"), T("assistant", "go")], continue_final=True
        )
    assert caught.value.metadata[errors.FIELD_KEY] == "continue_final_message"


@pytest.mark.parametrize(
    ("turns", "match"),
    [
        ([T("user", "u")], "ends with a user turn"),
        ([], "ends with no turn"),
        (
            [T("user", "u"), T("assistant", "", tool_calls=(text.ToolCall("c", "f", "{}"),))],
            "makes tool calls",
        ),
    ],
)
def test_only_a_final_assistant_turn_of_text_is_continued(turns: list[T], match: str) -> None:
    for render in (
        lambda: text.render_gemma(turns, continue_final=True),
        lambda: text.ChatTemplate(SIMPLE).render(turns, continue_final=True),
    ):
        with pytest.raises(errors.InvalidRequest, match=match):
            render()


@pytest.mark.parametrize(
    ("constrained", "forced", "match"),
    [(True, False, "constraint"), (False, True, "forced tool call"), (True, True, "constraint")],
)
def test_a_continuation_refuses_a_constraint_or_a_forced_call(
    constrained: bool, forced: bool, match: str
) -> None:
    with pytest.raises(errors.InvalidRequest, match=match):
        text.check_continuation(constrained=constrained, forced=forced)
    text.check_continuation(constrained=False, forced=False)
