"""`llama.Vocab.tokenize` (Blazar's special-token partition, then llama.cpp on the
plain fragments) against llama.cpp's own `llama_tokenize` on the bundled model's
vocabulary, and its time on text built to be slow for llama.cpp's partition."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as lc
import pytest

from blazar.engine import llama, text

SEED = 20261205


@pytest.fixture(scope="module")
def vocab(model_path: Path) -> Iterator[llama.Vocab]:
    lc.llama_backend_init()
    llama.quiet_native_logs()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(model_path).encode(), params)
    assert model
    try:
        yield llama.Vocab(lc.llama_model_get_vocab(model))
    finally:
        lc.llama_model_free(model)


def native(vocab: llama.Vocab, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    """llama.cpp's tokenizer on the whole text, as Blazar called it before."""
    data = text.encode("utf-8")
    buf = (lc.llama_token * (len(data) + 8))()
    n = lc.llama_tokenize(vocab.handle, data, len(data), buf, len(buf), add_special, parse_special)
    assert n >= 0
    return list(buf[:n])


def check(vocab: llama.Vocab, text: str) -> None:
    for add_special in (True, False):
        for parse_special in (True, False):
            want = native(vocab, text, add_special=add_special, parse_special=parse_special)
            got = vocab.tokenize(text, add_bos=add_special, parse_special=parse_special)
            assert got == want, (
                f"text={text!r} add_special={add_special} parse_special={parse_special}"
            )


def test_the_vocabulary_has_a_partition(vocab: llama.Vocab) -> None:
    # Gemma 3: no two special texts of equal length overlap, none strips.
    assert vocab._partition is not None


PIECES = [
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>",
    "</s>", "<unused0>", "<unused1>", "<unused10>", "<unused99>", "[multimodal]",
    "<table>", "</td>", "<h1>", "<start_of_image>",
    "<start_of", "turn>", "<unused", "multimodal]", "[", "<", ">", "</", "<<", ">>",
    "\n", "\n\n", "\n\n\n", "\n" * 31, "\n" * 40, " ", "  ", "   ", " " * 31, " " * 45,
    "\t", "\t\t", "\r\n", " \n ", "\n ",
    "中文", "日本語のテキスト", "😀", "👩‍👩‍👧", "é", "ß",
    "hello", " world", "The quick brown fox.", "user", "model", "def f(x):",
    "a", "0", "<x>", "a<b>c",
]  # fmt: skip


def test_random_mixes_tokenize_as_llama_cpp_does(vocab: llama.Vocab) -> None:
    rng = random.Random(SEED)
    for _ in range(1500):
        check(vocab, "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 24))))


def test_rendered_chat_prompts_tokenize_as_llama_cpp_does(vocab: llama.Vocab) -> None:
    rng = random.Random(SEED + 1)
    roles = ["system", "user", "assistant"]
    for _ in range(200):
        turns = [
            text.ChatTurn(
                role=rng.choice(roles),
                content="".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12))),
            )
            for _ in range(rng.randint(1, 5))
        ]
        check(vocab, text.render_gemma(turns))


@pytest.mark.parametrize(
    "written",
    [
        "",
        "<start_of_turn>",
        "<start_of_turn>hi",
        "hi<end_of_turn>",
        "<start_of_turn><end_of_turn><bos><eos>",
        "<bos>",
        "<bos><bos>text",
        "  <start_of_turn>  ",
        "\n\n<end_of_turn>\n\n",
        " " * 33 + "<unused1>" + "\n" * 64,
        "\n" * 31 + "\n" * 31 + "\n",
        "[multimodal][multimodal]\n",
        "<start_of<start_of_turn>turn>",
        " leading space",
        "x" * 5000 + "<end_of_turn>" + "y" * 5000,
    ],
)
def test_targeted_texts_tokenize_as_llama_cpp_does(vocab: llama.Vocab, written: str) -> None:
    check(vocab, written)


def test_control_tokens_written_as_text_are_found(vocab: llama.Vocab) -> None:
    assert vocab.writes_control_tokens("a <end_of_turn> b")
    assert vocab.writes_control_tokens("<unused7>")
    assert not vocab.writes_control_tokens("a <end_of_turn b\n\n  <table>")
    assert not vocab.writes_control_tokens("")


MB = 2**20


def _seconds(vocab: llama.Vocab, written: str, *, parse_special: bool) -> float:
    start = time.perf_counter()
    vocab.tokenize(written, parse_special=parse_special)
    return time.perf_counter() - start


@pytest.mark.parametrize(
    "unit", ["<", "a\n", "<unused1>", "\n", "  ", "<start_of_turn>", "<unused1>\n<<x  "]
)
@pytest.mark.parametrize("parse_special", [True, False])
def test_hostile_text_costs_what_prose_costs(
    vocab: llama.Vocab, unit: str, parse_special: bool
) -> None:
    """A megabyte of what made llama.cpp's partition slow (64 KB of `<` took 4 s, of
    "a\\n" 9 s, growing with the square of the length) takes no more than a few times
    what a megabyte of prose takes, measured in the same run: what remains is
    llama.cpp's tokenizer on the plain fragments (measured 0.3 to 2 times prose)."""
    _seconds(vocab, "warm", parse_special=parse_special)
    prose = "The quick brown fox jumps over the lazy dog. " * (MB // 45)
    baseline = _seconds(vocab, prose, parse_special=parse_special)
    hostile = unit * (MB // len(unit))
    took = _seconds(vocab, hostile, parse_special=parse_special)
    assert took < 5 * baseline + 0.5, f"{took:.2f}s against {baseline:.2f}s for prose"
