"""Plain greedy requests take the logits row's argmax instead of llama.cpp's sampler
chain; on the real model both pick the same token at every step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.engine import llama, sampling
from tests import launches

pytestmark = pytest.mark.slow

STEPS = 48


@pytest.fixture(scope="module")
def runtime(model_path: Path) -> Iterator[llama.Runtime]:
    rt = llama.Runtime.load(launches.spec(model_path, slots=2, context_per_slot=256))
    try:
        yield rt
    finally:
        rt.close()


def _params(rt: llama.Runtime, **sampling_fields: object) -> sampling.SamplingParams:
    return sampling.resolve(
        inference_pb2.Sampling(temperature=0, **sampling_fields),  # type: ignore[arg-type]
        vocab=rt.vocab,
    )


def test_plain_greedy_has_no_chain_and_others_do(runtime: llama.Runtime) -> None:
    plain = sampling.build_sampler(_params(runtime))
    biased = sampling.build_sampler(_params(runtime, logit_bias={5: 0.0}))
    penalized = sampling.build_sampler(_params(runtime, repeat_penalty=1.3))
    try:
        assert plain.chain is None
        assert biased.chain is not None
        assert penalized.chain is not None
    finally:
        for s in (plain, biased, penalized):
            s.free()


def test_argmax_picks_what_the_greedy_chain_picks(runtime: llama.Runtime) -> None:
    # A zero bias puts the same greedy decision behind llama.cpp's full chain.
    fast = sampling.build_sampler(_params(runtime))
    chain = sampling.build_sampler(_params(runtime, logit_bias={5: 0.0}))
    prompt = runtime.vocab.tokenize("The lighthouse keeper wrote in his log that")
    try:
        runtime.clear(0)
        runtime.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
        index, pos, emitted = len(prompt) - 1, len(prompt), []
        for _ in range(STEPS):
            token = runtime.sample(fast, index)
            assert runtime.sample(chain, index) == token
            emitted.append(token)
            runtime.decode([(token, pos, 0, True)])
            index, pos = 0, pos + 1
        assert len(set(emitted)) > 5  # real text, not one token over and over
    finally:
        fast.free()
        chain.free()
        runtime.clear(0)
