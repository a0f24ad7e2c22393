"""The approximate prefix index as tables: texts -> block hashes -> matches per replica."""

from __future__ import annotations

import pytest

from blazar.dataplane import prefixes
from blazar.dataplane.prefixes import BLOCK_CHARS as B

LIMIT = 1_000


def text(*pieces: tuple[str, int]) -> str:
    """Whole blocks of repeated letters: ("a", 2) is two blocks of a."""
    return "".join(letter * (B * blocks) for letter, blocks in pieces)


@pytest.mark.parametrize(
    ("first", "second", "shared"),
    [
        (text(("a", 3)), text(("a", 3)), 3),
        (text(("a", 3)), text(("a", 2), ("b", 1)), 2),
        (text(("a", 1), ("b", 2)), text(("b", 3)), 0),  # same later blocks, other start
        (text(("a", 2)) + "a" * (B - 1), text(("a", 3)), 2),  # a partial block is not hashed
        ("", text(("a", 1)), 0),
    ],
)
def test_prompts_share_the_hashes_of_their_common_whole_blocks(
    first: str, second: str, shared: int
) -> None:
    a = prefixes.prompt_hashes(first, limit=LIMIT)
    b = prefixes.prompt_hashes(second, limit=LIMIT)
    assert len(a) == len(first) // B
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    assert (min(len(a), len(b)) if common is None else common) == shared


@pytest.mark.parametrize(("chars", "limit", "count"), [(10 * B, 4, 4), (10 * B, 20, 10), (B, 0, 0)])
def test_only_the_first_limit_blocks_are_hashed(chars: int, limit: int, count: int) -> None:
    hashes = prefixes.prompt_hashes("x" * chars, limit=limit)
    assert hashes == prefixes.prompt_hashes("x" * chars, limit=LIMIT)[:count]


def test_hashes_are_stable_across_calls_and_non_ascii_text_hashes() -> None:
    assert prefixes.prompt_hashes("é" * 3 * B, limit=LIMIT) == prefixes.prompt_hashes(
        "é" * 3 * B, limit=LIMIT
    )
    assert len(prefixes.prompt_hashes("\ud83d" * B, limit=LIMIT)) == 1  # a lone surrogate


SYSTEM = ("system", "s" * 2 * B)
QUESTION = ("user", "q" * 3 * B)
ANSWER = ("assistant", "a" * 2 * B)


@pytest.mark.parametrize(
    ("earlier", "later", "prefix"),
    [
        # The next turn of a conversation has the earlier turns as its prefix.
        ([SYSTEM, QUESTION], [SYSTEM, QUESTION, ANSWER, ("user", "more")], True),
        ([SYSTEM, QUESTION, ANSWER], [SYSTEM, QUESTION, ANSWER, QUESTION], True),
        # Another question after the same system prompt shares only the system turn.
        ([SYSTEM, QUESTION], [SYSTEM, ("user", "z" * 3 * B)], False),
        # The same text in another role is another prompt.
        ([("user", "s" * 2 * B), QUESTION], [SYSTEM, QUESTION], False),
    ],
)
def test_a_conversation_shares_the_blocks_of_its_earlier_turns(
    earlier: list[tuple[str, str]], later: list[tuple[str, str]], prefix: bool
) -> None:
    a = prefixes.chat_hashes(earlier, limit=LIMIT)
    b = prefixes.chat_hashes(later, limit=LIMIT)
    assert a and b
    assert (b[: len(a)] == a) is prefix


def test_content_cannot_imitate_a_turn_boundary() -> None:
    two_turns = [("user", "x" * B), ("assistant", "y" * B)]
    # The second turn as it is written out, smuggled into the first turn's content.
    one_turn = [("user", "x" * B + f"9:assistant{B}:" + "y" * B)]
    assert prefixes.chat_hashes(one_turn, limit=LIMIT) != prefixes.chat_hashes(
        two_turns, limit=LIMIT
    )


def test_a_chat_and_a_raw_prompt_never_share_a_block() -> None:
    chat = prefixes.chat_hashes([("user", "x" * 4 * B)], limit=LIMIT)
    raw = prefixes.prompt_hashes("4:user" + str(4 * B) + ":" + "x" * 4 * B, limit=LIMIT)
    assert not set(chat) & set(raw)


def test_chat_hashes_stop_reading_turns_past_the_limit() -> None:
    turns = [("user", "x" * B)] * 1000
    assert prefixes.chat_hashes(turns, limit=3) == prefixes.chat_hashes(turns, limit=LIMIT)[:3]


@pytest.mark.parametrize(
    ("slots", "context", "blocks"),
    [(4, 2048, 4 * 2048 * 4 // B), (1, 512, 512 * 4 // B), (1, 1, 1)],
)
def test_capacity_is_what_the_kv_cache_holds_at_four_characters_a_token(
    slots: int, context: int, blocks: int
) -> None:
    assert prefixes.capacity(slots=slots, context_per_slot=context) == blocks


# Prompts as lists of block names; each name stands for one hash.
def H(blocks: str) -> list[int]:
    """Chain hashes of a prompt whose blocks are the letters of `blocks`."""
    return list(prefixes.prompt_hashes("".join(c * B for c in blocks), limit=LIMIT))


@pytest.mark.parametrize(
    ("served", "capacity", "prompt", "expected"),
    [
        ([], 10, "abc", {}),
        ([(0, "abc")], 10, "abcd", {0: 3}),
        ([(0, "abc")], 10, "ab", {0: 2}),
        ([(0, "abc")], 10, "xbc", {}),
        ([(0, "abc"), (1, "ab")], 10, "abcd", {0: 3, 1: 2}),
        ([(0, "abc"), (1, "xyz")], 10, "xyzw", {1: 3}),
        # Over capacity, the least recent prompt goes, tail first: what is left of it
        # is still a prefix.
        ([(0, "abc"), (0, "xyz")], 4, "abc", {0: 1}),
        ([(0, "abc"), (0, "xyz")], 4, "xyz", {0: 3}),
        # Serving a prompt again makes it the most recent.
        ([(0, "abc"), (0, "xyz"), (0, "abc")], 4, "xyz", {0: 1}),
        # A prompt longer than the capacity keeps its head.
        ([(0, "abcdef")], 3, "abcdef", {0: 3}),
        # A shared head is recorded once.
        ([(0, "abc"), (0, "abd")], 4, "abc", {0: 3}),
        ([(0, "abc"), (0, "abd")], 4, "abd", {0: 3}),
    ],
)
def test_match_counts_the_leading_blocks_each_replica_holds(
    served: list[tuple[int, str]], capacity: int, prompt: str, expected: dict[int, int]
) -> None:
    index = prefixes.PrefixIndex(capacity)
    for replica, blocks in served:
        index.record(replica, H(blocks))
    assert index.match(H(prompt)) == expected
    assert all(held <= capacity for held in index.held().values())


def test_a_forgotten_replica_holds_nothing() -> None:
    index = prefixes.PrefixIndex(10)
    index.record(0, H("abc"))
    index.record(1, H("abc"))
    index.record(1, [])
    index.forget(0)
    index.forget(7)  # never seen: nothing to do
    assert index.match(H("abc")) == {1: 3}
    assert index.held() == {1: 3}


def test_an_index_holds_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least 1 block"):
        prefixes.PrefixIndex(0)


def test_a_scope_sees_its_own_chains_and_none_of_another_scopes() -> None:
    """Prefix routing per tenant (`prefixes.scoped`): the same prompt of two scopes
    shares no block, one scope's prompts share what they share unscoped, and the shared
    scope "" is the hashes as they are."""
    a = prefixes.prompt_hashes(text(("a", 3)), limit=LIMIT)
    b = prefixes.prompt_hashes(text(("a", 2), ("b", 1)), limit=LIMIT)
    mine_a, mine_b = prefixes.scoped(a, "t1"), prefixes.scoped(b, "t1")
    assert mine_a[:2] == mine_b[:2] and mine_a[2] != mine_b[2]
    assert set(prefixes.scoped(a, "t2")).isdisjoint(mine_a)
    assert set(mine_a).isdisjoint(a)
    assert prefixes.scoped(a, "") == a
    index = prefixes.PrefixIndex(capacity=64)
    index.record(0, mine_a)
    assert index.match(prefixes.scoped(a, "t2")) == {}
    assert index.match(mine_b) == {0: 2}
