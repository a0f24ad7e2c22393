"""`slots.move`: a generation and its cache to another slot, that slot's cache back."""

from __future__ import annotations

from typing import Any

import numpy as np

from blazar.engine import slots
from blazar.engine.slots import Slot


class Caches:
    """Per-sequence token lists standing for llama.cpp's KV cache and its state copies."""

    def __init__(self, **kv: list[int]) -> None:
        self.kv = {int(seq[1:]): tokens for seq, tokens in kv.items()}
        self.refuse: set[int] = set()

    def seq_state_size(self, seq: int) -> int:
        return 4 * len(self.kv.get(seq, []))

    def seq_state(self, seq: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
        return np.array(self.kv.get(seq, []), dtype=np.int32).view(np.uint8)

    def set_seq_state(self, seq: int, state: np.ndarray[Any, np.dtype[np.uint8]]) -> bool:
        if seq in self.refuse:
            self.kv[seq] = []
            return False
        self.kv[seq] = state.view(np.int32).tolist()
        return True

    def clear(self, seq: int) -> None:
        self.kv[seq] = []


def test_a_move_swaps_the_generation_and_the_free_slots_cache() -> None:
    gen: Any = object()
    src = Slot(3, tokens=[1, 2, 3], gen=gen, last_used=9, prompt_len=2, scope="a")
    dst = Slot(1, tokens=[7, 8], last_used=4, prompt_len=1, scope="b")
    caches = Caches(s3=[1, 2, 3], s1=[7, 8])
    assert slots.move(caches, src, dst)  # type: ignore[arg-type]
    # Each cache keeps the scope of the requests that filled it.
    assert (dst.gen, dst.tokens, dst.last_used, dst.prompt_len, dst.scope) == (
        gen,
        [1, 2, 3],
        9,
        2,
        "a",
    )
    assert (src.gen, src.tokens, src.last_used, src.prompt_len, src.scope) == (
        None,
        [7, 8],
        4,
        1,
        "b",
    )
    assert caches.kv == {1: [1, 2, 3], 3: [7, 8]}


def test_a_move_llama_refuses_leaves_everything_where_it_was() -> None:
    gen: Any = object()
    src = Slot(3, tokens=[1, 2, 3], gen=gen)
    dst = Slot(1, tokens=[7, 8])
    caches = Caches(s3=[1, 2, 3], s1=[7, 8])
    caches.refuse = {1}
    assert not slots.move(caches, src, dst)  # type: ignore[arg-type]
    assert (src.gen, src.tokens, dst.gen) == (gen, [1, 2, 3], None)
    # The failed copy cleared slot 1, and it could not be put back either.
    assert (dst.tokens, caches.kv[1], caches.kv[3]) == ([], [], [1, 2, 3])
