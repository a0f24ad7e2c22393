"""The data plane's estimate of what a request needs of a slot (`budget.estimate`),
which admission reads to pick a replica whose slots hold it and to forecast its output."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.dataplane import budget, routing

ROUTE = routing.Route(
    lane="tiny", model="tiny-model", aliases=(), replicas=(), created=0, context_length=2048
)
# A Lane whose measurements read any prompt as 100 tokens.
LANE: Any = SimpleNamespace(measurements=SimpleNamespace(prompt_tokens=lambda chars: 100))


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        # Unset: the rest of a slot's context; the prompt needs a slot.
        (inference_pb2.Sampling(), (100, 1948, 101)),
        # OpenAI's max_tokens reserves its tokens beside the prompt.
        (inference_pb2.Sampling(max_tokens=4096), (100, 4096, 4196)),
        (inference_pb2.Sampling(max_tokens=16), (100, 16, 116)),
        # Ollama's num_predict only bounds: the context's end stops the generation.
        (inference_pb2.Sampling(max_tokens=4096, max_tokens_up_to_context=True), (100, 1948, 101)),
        (inference_pb2.Sampling(max_tokens=16, max_tokens_up_to_context=True), (100, 16, 101)),
    ],
)
def test_a_budget_reserves_max_tokens_unless_it_only_bounds(
    sampling: inference_pb2.Sampling, expected: tuple[int, int, int]
) -> None:
    generate = engine_pb2.GenerateRequest(sampling=sampling)
    assert budget.estimate(LANE, ROUTE, generate, prompt_chars=400) == expected
