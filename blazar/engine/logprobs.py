"""Log-probabilities from raw logits (pure numpy).

Only requests that ask for logprobs pay for this: a log-softmax over a 262k-token
vocabulary costs about a millisecond per position on a small CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Rows = npt.NDArray[np.float32]

# OpenAI's limit for top_logprobs.
MAX_TOP = 20


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    # The most likely alternatives, best first: (token, logprob).
    top: tuple[tuple[int, float], ...] = ()


def log_normalizers(rows: Rows) -> npt.NDArray[np.float64]:
    """logsumexp of each row (shape (n, vocab) -> (n,)), computed stably."""
    peak = rows.max(axis=1, keepdims=True)
    sums = np.exp(rows - peak).sum(axis=1, dtype=np.float64)
    norms: npt.NDArray[np.float64] = np.log(sums) + peak[:, 0].astype(np.float64)
    return norms


def top_alternatives(row: Rows, n: int, norm: float) -> tuple[tuple[int, float], ...]:
    """The n most likely tokens of one row with their logprobs, best first (ties: lower id)."""
    if n <= 0:
        return ()
    n = min(n, row.shape[0])
    candidates = np.argpartition(-row, n - 1)[:n]
    ranked = sorted(candidates.tolist(), key=lambda t: (-float(row[t]), t))
    return tuple((t, float(row[t]) - norm) for t in ranked)


def score(rows: Rows, targets: Sequence[int], *, top: int = 0) -> list[TokenLogprob]:
    """Row i scored against targets[i]: the target's logprob and the top alternatives."""
    if len(targets) != rows.shape[0]:
        raise ValueError("one target per row")
    if not targets:
        return []
    norms = log_normalizers(rows)
    return [
        TokenLogprob(
            token=t,
            logprob=float(rows[i, t]) - float(norms[i]),
            top=top_alternatives(rows[i], top, float(norms[i])),
        )
        for i, t in enumerate(targets)
    ]
