"""What a test may rely on when a real model writes, and how it pins the rest.

llama.cpp's kernels differ by CPU (AVX-512 or not, tinyBLAS, repacked quants) and by
batch shape, so the same request draws another text on another host, greedy included
wherever two logits are close. A test asserts what Blazar's own code guarantees
whatever the model writes, or pins what the model writes with a constraint Blazar
enforces:

- `no_end_of_generation`: a logit bias that bans the model's end-of-generation tokens,
  so that a request runs to max_tokens (finish reason LENGTH) on every CPU.
- `exactly`: a grammar that allows one text only; with digits (each digit is one
  token, see `sole_spelling_bias`), also one tokenization only.
- `longest_document`: the longest text a grammar allows, so that a budget of that
  many tokens plus one (each token the grammar accepts writes at least one byte; the
  end-of-generation token counts too) guarantees that the grammar ends the output.
- `grammar_state`: whether a text is a complete document of a grammar, a prefix of
  one, or neither, by llama.cpp's grammar engine.
- `common_greedy_prefix`: where two greedy streams of one request part, which may be
  only where the reference led by less than NEAR_TIE.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import json
import math
import re
from pathlib import Path
from typing import Any

# OpenAI's ban; the engine gives llama.cpp -inf for it (sampling.BAN_BIAS).
BAN = -100.0


@functools.cache
def _vocab_model(model_path: Path) -> Any:
    from llama_cpp import Llama

    return Llama(str(model_path), vocab_only=True, verbose=False)


def end_of_generation(model_path: Path) -> frozenset[int]:
    """Every token llama.cpp ends a generation on (Gemma 3: <eos>, <end_of_turn>, </s>)."""
    import llama_cpp as lc

    vocab = _vocab_model(model_path)
    handle = vocab._model.vocab
    return frozenset(t for t in range(vocab.n_vocab()) if lc.llama_vocab_is_eog(handle, t))


def no_end_of_generation(model_path: Path) -> dict[int, float]:
    """A logit bias under which the model cannot stop by itself."""
    return dict.fromkeys(sorted(end_of_generation(model_path)), BAN)


def spellings(model_path: Path, piece: bytes) -> list[int]:
    """Every token id whose text is exactly `piece`."""
    vocab = _vocab_model(model_path)
    return [t for t in range(vocab.n_vocab()) if vocab.detokenize([t]) == piece]


def beginning_with(model_path: Path, piece: bytes) -> list[int]:
    """Every token id whose text begins with `piece`."""
    vocab = _vocab_model(model_path)
    return [t for t in range(vocab.n_vocab()) if vocab.detokenize([t]).startswith(piece)]


@functools.cache
def sole_spelling_bias(model_path: Path, characters: str) -> dict[int, float]:
    """A logit bias after which each of `characters` has one token only.

    Gemma's vocabulary splits digits: no token holds two digits or a digit and
    anything else, and each digit has two tokens, its own and a byte-fallback one
    (<0x33> for "3"). Banning the byte tokens leaves one way to write a digit string,
    so a grammar that allows one such string fixes every token of the output.
    """
    vocab = _vocab_model(model_path)
    bias: dict[int, float] = {}
    for char in characters:
        (own,) = vocab.tokenize(char.encode(), add_bos=False, special=False)
        bias.update((t, BAN) for t in spellings(model_path, char.encode()) if t != own)
    return bias


def digits_have_one_token_each(model_path: Path) -> bool:
    """The vocabulary fact `sole_spelling_bias` relies on for digit strings: no token
    spells two digits (those that hold a digit and something else cannot start one)."""
    vocab = _vocab_model(model_path)
    pieces = (vocab.detokenize([t]) for t in range(vocab.n_vocab()))
    return not any(len(p) > 1 and p.isdigit() for p in pieces)


def digit_string(length: int, *, seed: int) -> str:
    """Digits in which no 3 consecutive ones occur twice (so that n-gram lookup over
    them finds one earlier occurrence only)."""
    import random

    rng = random.Random(seed)
    out = ""
    seen: set[str] = set()
    while len(out) < length:
        d = str(rng.randrange(10))
        gram = out[-2:] + d
        if len(gram) == 3 and gram in seen:
            continue
        if len(gram) == 3:
            seen.add(gram)
        out += d
    return out


def exactly(text: str) -> str:
    """GBNF allowing `text` and nothing else (JSON's string escapes are GBNF's too, but
    for \\b and \\f, which the texts here do not hold)."""
    return f"root ::= {json.dumps(text, ensure_ascii=False)}"


# --- the longest document a grammar allows ----------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<literal>"(?:\\.|[^"\\])*")
    | (?P<cls>\[(?:\\.|[^\]\\])*\])
    | (?P<ref>[a-zA-Z0-9_-]+)
    | (?P<open>\() | (?P<close>\)) | (?P<bar>\|)
    | (?P<rep>\{\s*\d*\s*(?:,\s*\d*\s*)?\}|[?*+])
    )""",
    re.VERBOSE,
)
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t"}


def _unescape(body: str) -> str:
    def one(m: re.Match[str]) -> str:
        e = m.group(1)
        if e[0] in "xuU":
            return chr(int(e[1:], 16))
        return _SIMPLE_ESCAPES.get(e, e)

    return _ESCAPE.sub(one, body)


def _class_bytes(cls: str) -> int:
    """The most UTF-8 bytes one character of a GBNF character class takes."""
    body = cls[1:-1]
    if body.startswith("^"):
        return 4
    chars = _unescape(body)
    return max(len(c.encode("utf-8", "surrogatepass")) for c in chars)


Toks = list[tuple[str, str]]


def longest_document(grammar: str) -> int | None:
    """The most bytes a text of `grammar`'s language has; None when unbounded.

    For the GBNF llama.cpp reads and Blazar's schema converter writes: rules of
    literals, character classes, references, groups, alternatives and repetitions.
    """
    rules: dict[str, str] = {}
    for line in grammar.splitlines():
        if "::=" in line and not line.lstrip().startswith("#"):
            name, body = line.split("::=", 1)
            rules[name.strip()] = body
    memo: dict[str, int | None] = {}
    visiting: set[str] = set()

    def rule(name: str) -> int | None:
        if name in memo:
            return memo[name]
        if name in visiting:
            return None  # recursive: unbounded
        visiting.add(name)
        memo[name] = expression(rules[name])
        visiting.discard(name)
        return memo[name]

    def expression(text: str) -> int | None:
        tokens: Toks = []
        pos, end = 0, len(text.rstrip())
        while pos < end:
            m = _TOKEN.match(text, pos)
            assert m is not None and m.lastgroup is not None, text[pos:]
            tokens.append((m.lastgroup, m.group(m.lastgroup)))
            pos = m.end()
        value, rest = alternatives(tokens)
        assert not rest, rest
        return value

    def alternatives(tokens: Toks) -> tuple[int | None, Toks]:
        best: int | None = 0
        while True:
            value, tokens = sequence(tokens)
            best = None if best is None or value is None else max(best, value)
            if tokens and tokens[0][0] == "bar":
                tokens = tokens[1:]
                continue
            return best, tokens

    def sequence(tokens: Toks) -> tuple[int | None, Toks]:
        total: int | None = 0
        while tokens and tokens[0][0] not in ("bar", "close"):
            kind, text = tokens[0]
            tokens = tokens[1:]
            item: int | None
            if kind == "literal":
                item = len(_unescape(text[1:-1]).encode("utf-8", "surrogatepass"))
            elif kind == "cls":
                item = _class_bytes(text)
            elif kind == "ref":
                item = rule(text)
            elif kind == "open":
                item, tokens = alternatives(tokens)
                assert tokens and tokens[0][0] == "close"
                tokens = tokens[1:]
            else:
                raise AssertionError(f"unexpected {text!r}")
            while tokens and tokens[0][0] == "rep":
                item = _repeat(item, tokens[0][1].replace(" ", ""))
                tokens = tokens[1:]
            total = None if total is None or item is None else total + item
        return total, tokens

    return rule("root")


def _repeat(item: int | None, rep: str) -> int | None:
    if item == 0:
        return 0
    if rep == "?":
        return item
    if rep in ("*", "+"):
        return None
    bounds = rep[1:-1].split(",")
    upper = bounds[-1]
    if upper == "":
        return None
    return None if item is None else item * int(upper)


def budget(grammar: str) -> int | None:
    """max_tokens under which `grammar` surely ends the output; None when it may not."""
    longest = longest_document(grammar)
    # Every token the grammar accepts writes at least one byte (llama.cpp's grammar
    # refuses empty pieces), and the end-of-generation token is counted too.
    return None if longest is None else longest + 1


# --- checking a text against a grammar ----------------------------------------------


class GrammarState(enum.StrEnum):
    COMPLETE = "complete"
    PREFIX = "prefix"
    INVALID = "invalid"


def grammar_state(model_path: Path, grammar: str, text: str) -> GrammarState:
    """Where `text` stands in `grammar`'s language, by llama.cpp's grammar engine.

    The grammar reads bytes, so any tokenization of the text gives the same answer.
    """
    import llama_cpp as lc

    vocab = _vocab_model(model_path)
    handle = vocab._model.vocab
    tokens = vocab.tokenize(text.encode(), add_bos=False, special=False)
    assert vocab.detokenize(tokens) == text.encode(), text
    sampler = lc.llama_sampler_init_grammar(handle, grammar.encode(), b"root")
    assert sampler, grammar

    def allows(token: int) -> bool:
        single = lc.llama_token_data(token, 1.0, 0.0)
        one = lc.llama_token_data_array(ctypes.pointer(single), 1, -1, False)
        lc.llama_sampler_apply(sampler, ctypes.byref(one))
        return bool(single.logit != -math.inf)

    try:
        for token in tokens:
            if not allows(token):
                return GrammarState.INVALID
            lc.llama_sampler_accept(sampler, token)
        eos = int(lc.llama_vocab_eos(handle))
        return GrammarState.COMPLETE if allows(eos) else GrammarState.PREFIX
    finally:
        lc.llama_sampler_free(sampler)


# --- comparing greedy streams ---------------------------------------------------------

# Batches of other shapes (or another CPU) round logits differently: by 0.003-0.016
# nats on average here, but up to 0.34 at single positions (see speculation.py; 0.38
# in test_engine_speculation). Two greedy streams of the same request may part where
# the top two were this close; a stream that reads a wrong cache parts by nats.
NEAR_TIE = 0.5


def margin(entry: Any, banned: frozenset[int] = frozenset()) -> float:
    """How far a greedy pick (a logprobs entry with top >= 2) led the best other token
    the request allowed."""
    others = [t.logprob for t in entry.top if t.id != entry.id and t.id not in banned]
    return float(entry.logprob - max(others)) if others else math.inf


def common_greedy_prefix(
    reference: list[Any], other: list[int], *, banned: frozenset[int] = frozenset()
) -> int:
    """How many leading tokens the greedy stream `other` (ids) shares with `reference`
    (its logprobs entries); asserts that they part, if at all, only at a near-tie of
    the reference, the one place rounding can turn."""
    n = min(len(reference), len(other))
    parted = next((i for i in range(n) if reference[i].id != other[i]), n)
    if parted < n:
        gap = margin(reference[parted], banned)
        assert gap < NEAR_TIE, f"streams part at token {parted}, where greedy led by {gap:.3f}"
    return parted
