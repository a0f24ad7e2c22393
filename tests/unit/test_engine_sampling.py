"""Engine sampling defaults and validation (the pure half of blazar.engine.sampling)."""

from __future__ import annotations

from typing import Any

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.engine import sampling


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {},
            sampling.SamplingParams(seed=7),
        ),
        (  # zero differs from unset
            {"temperature": 0.0, "top_k": 0, "min_p": 0.0, "seed": 0},
            sampling.SamplingParams(temperature=0.0, top_k=0, min_p=0.0, seed=0),
        ),
        (
            {"max_tokens": 5, "stop": ["\n", "END"], "repeat_penalty": 1.25},
            sampling.SamplingParams(max_tokens=5, stop=("\n", "END"), repeat_penalty=1.25, seed=7),
        ),
        (
            {"presence_penalty": 0.5, "frequency_penalty": 0.25, "top_p": 0.5},
            sampling.SamplingParams(
                presence_penalty=0.5, frequency_penalty=0.25, top_p=0.5, seed=7
            ),
        ),
    ],
)
def test_resolve(fields: dict[str, Any], expected: sampling.SamplingParams) -> None:
    assert sampling.resolve(inference_pb2.Sampling(**fields), seed=7) == expected


def test_unset_seed_is_random() -> None:
    seeds = {sampling.resolve(inference_pb2.Sampling()).seed for _ in range(8)}
    assert len(seeds) > 1


@pytest.mark.parametrize(
    ("params", "greedy", "penalized"),
    [
        (sampling.SamplingParams(), False, False),
        (sampling.SamplingParams(temperature=0.0), True, False),
        (sampling.SamplingParams(repeat_penalty=1.2), False, True),
        (sampling.SamplingParams(presence_penalty=0.1), False, True),
    ],
)
def test_flags(params: sampling.SamplingParams, greedy: bool, penalized: bool) -> None:
    assert (params.greedy, params.penalized) == (greedy, penalized)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"repeat_penalty": 0.0}, "repeat_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_resolve_rejects(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=message):
        sampling.resolve(inference_pb2.Sampling(**fields))
