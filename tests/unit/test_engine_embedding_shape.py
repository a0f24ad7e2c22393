"""How the engine shapes a pooled embedding (`embedding.shaped`): the whole vector or
its first `dimensions` values, at unit length when asked (always when shortened)."""

from __future__ import annotations

import numpy as np
import pytest

from blazar.engine import embedding

POOLED = np.array([3.0, 4.0, 12.0])  # |v| = 13; its first two values have |v| = 5


@pytest.mark.parametrize(
    ("normalize", "dimensions", "expected"),
    [
        (False, None, [3.0, 4.0, 12.0]),
        (True, None, [3 / 13, 4 / 13, 12 / 13]),
        (True, 2, [0.6, 0.8]),
        # Shortened means unit length, as OpenAI and Ollama shorten, whatever normalize says.
        (False, 2, [0.6, 0.8]),
        (False, 1, [1.0]),
        (True, 3, [3 / 13, 4 / 13, 12 / 13]),
    ],
)
def test_shaped(normalize: bool, dimensions: int | None, expected: list[float]) -> None:
    shaped = embedding.shaped(POOLED, normalize=normalize, dimensions=dimensions)
    assert shaped.tolist() == pytest.approx(expected)


def test_a_zero_vector_stays_zero() -> None:
    assert embedding.shaped(np.zeros(3), normalize=True, dimensions=2).tolist() == [0.0, 0.0]
