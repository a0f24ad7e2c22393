"""Log-probabilities from raw logits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from blazar.engine import logprobs


def rows(*values: list[float]) -> np.ndarray:  # type: ignore[type-arg]
    return np.array(values, dtype=np.float32)


def test_log_normalizers_is_a_stable_logsumexp() -> None:
    r = rows([0.0, 0.0], [1000.0, 1000.0], [-1e4, 0.0])
    np.testing.assert_allclose(logprobs.log_normalizers(r), [math.log(2), 1000 + math.log(2), 0.0])


@pytest.mark.parametrize(
    ("row", "n", "expected_ids"),
    [
        ([0.0, 3.0, 1.0, 2.0], 2, [1, 3]),
        ([0.0, 3.0, 1.0, 2.0], 0, []),
        ([0.0, 3.0, 1.0, 2.0], 9, [1, 3, 2, 0]),  # capped at the vocabulary
        ([1.0, 1.0, 1.0], 2, [0, 1]),  # ties: lower id first
    ],
)
def test_top_alternatives(row: list[float], n: int, expected_ids: list[int]) -> None:
    r = rows(row)
    norm = float(logprobs.log_normalizers(r)[0])
    top = logprobs.top_alternatives(r[0], n, norm)
    assert [t for t, _ in top] == expected_ids
    for t, lp in top:
        assert lp == pytest.approx(row[t] - norm)


def test_score_targets_and_alternatives() -> None:
    r = rows([0.0, math.log(3.0)], [5.0, 5.0])
    scored = logprobs.score(r, [0, 1], top=1)
    assert [s.token for s in scored] == [0, 1]
    assert scored[0].logprob == pytest.approx(math.log(0.25))
    assert scored[0].top == ((1, pytest.approx(math.log(0.75))),)
    assert scored[1].logprob == pytest.approx(math.log(0.5))
    assert scored[1].top[0][0] == 0
    probs = np.exp([s.logprob for s in logprobs.score(rows([1.0, 2.0, 3.0]), [0], top=3)[0:1]])
    assert probs[0] < 1


def test_score_needs_one_target_per_row() -> None:
    assert logprobs.score(rows([1.0]), [0]) != []
    assert logprobs.score(np.zeros((0, 3), dtype=np.float32), []) == []
    with pytest.raises(ValueError):
        logprobs.score(rows([1.0], [2.0]), [0])
