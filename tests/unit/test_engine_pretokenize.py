"""`pretokenize.Partition` against a line-by-line copy of llama.cpp's
`tokenizer_st_partition` (llama-vocab.cpp), on made-up vocabularies that exercise
what Gemma 3's does not: stripping tokens, overlapping and nested specials."""

from __future__ import annotations

import random

import pytest

from blazar.engine import pretokenize
from blazar.engine.pretokenize import Special


def reference(specials: list[Special], text: bytes, *, parse_special: bool) -> list[object]:
    """llama.cpp's algorithm as written: one pass per special, longest first."""
    buffer: list[object] = [(0, len(text))] if text else []
    for s in sorted(specials, key=lambda s: -len(s.text)):
        if not parse_special and s.control:
            continue
        out: list[object] = []
        for fragment in buffer:
            if isinstance(fragment, int):
                out.append(fragment)
                continue
            assert isinstance(fragment, tuple)
            offset, length = fragment
            while True:
                match = text.find(s.text, offset, offset + length)
                if match < 0:
                    out.append((offset, length))
                    break
                if match > offset:
                    left = match - offset
                    if s.lstrip:
                        while left > 0 and text[offset + left - 1] in pretokenize.WHITESPACE:
                            left -= 1
                    if left > 0:
                        out.append((offset, left))
                out.append(s.token)
                if match + len(s.text) < offset + length:
                    right_offset = match + len(s.text)
                    right_length = length - ((match - offset) + len(s.text))
                    if s.rstrip:
                        while right_length > 0 and text[right_offset] in pretokenize.WHITESPACE:
                            right_offset += 1
                            right_length -= 1
                    offset, length = right_offset, right_length
                    if length == 0:
                        break
                else:
                    break
        buffer = out
    # Adjacent raw fragments do not occur; spell each as its bytes.
    return [f if isinstance(f, int) else text[f[0] : f[0] + f[1]] for f in buffer]  # type: ignore[index]


def _vocab(rng: random.Random, alphabet: bytes, *, strips: bool) -> list[Special]:
    texts: set[bytes] = set()
    while len(texts) < rng.randint(1, 12):
        texts.add(bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 5))))
    specials = [
        Special(
            token=1000 + k,
            text=t,
            control=rng.random() < 0.5,
            lstrip=strips and rng.random() < 0.3,
            rstrip=strips and rng.random() < 0.3,
        )
        for k, t in enumerate(sorted(texts))
    ]
    return specials


@pytest.mark.parametrize("strips", [False, True])
def test_the_partition_is_llama_cpps_on_random_vocabularies(strips: bool) -> None:
    rng = random.Random(20261205 + strips)
    alphabet = b"ab< >\n\t"
    checked = 0
    for _ in range(600):
        specials = _vocab(rng, alphabet, strips=strips)
        partition = pretokenize.Partition.of(specials)
        if partition is None:
            continue
        for _ in range(10):
            text = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
            for parse_special in (True, False):
                want = reference(specials, text, parse_special=parse_special)
                got = partition.split(text, parse_special=parse_special)
                assert got == want, (specials, text, parse_special)
                checked += 1
    assert checked > 3000


def test_equal_length_specials_that_overlap_leave_the_order_undetermined() -> None:
    assert pretokenize.ambiguous([Special(1, b"ab", False), Special(2, b"bc", False)])
    assert pretokenize.ambiguous([Special(1, b"ab", False), Special(2, b"ab", True)])
    assert pretokenize.ambiguous([Special(1, b"", False)])
    assert pretokenize.ambiguous([Special(1, b"ab", False, rstrip=True), Special(2, b" c", False)])
    assert not pretokenize.ambiguous([Special(1, b"ab", False), Special(2, b"cd", False)])
    assert not pretokenize.ambiguous([Special(1, b"ab", False), Special(2, b"bcd", False)])
    assert not pretokenize.ambiguous([Special(1, b"aa", False)])


GEMMA_LIKE = [
    Special(105, b"<start_of_turn>", True),
    Special(106, b"<end_of_turn>", True),
    Special(7, b"<unused1>", True),
    Special(8, b"<unused10>", True),
    Special(5, b"[multimodal]", False),
    *(Special(106 + k, b"\n" * k, False) for k in range(1, 32)),
    *(Special(136 + k, b" " * k, False) for k in range(2, 32)),
]


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"<start_of_turn>",
        b"<start_of_turn>user\nhi<end_of_turn>",
        b"<start_of_turn><end_of_turn><unused1><unused10>",
        b"  <unused1>  \n\n<unused1>\n",
        b"\n" * 100,
        b" " * 77 + b"\n" * 40,
        b"<start_of<start_of_turn>turn>",
        b"[multimodal][multimodal]",
        b"<<<<unused1>>>>",
    ],
)
def test_targeted_texts(text: bytes) -> None:
    partition = pretokenize.Partition.of(GEMMA_LIKE)
    assert partition is not None
    for parse_special in (True, False):
        want = reference(GEMMA_LIKE, text, parse_special=parse_special)
        assert partition.split(text, parse_special=parse_special) == want
