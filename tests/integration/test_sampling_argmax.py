"""Plain greedy requests take the logits row's argmax instead of llama.cpp's sampler
chain; on the real model both pick the same token from every row."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.engine import llama, sampling
from tests import launches

pytestmark = pytest.mark.slow

ROWS = 48
TEXT = (
    "The lighthouse keeper wrote in his log that the storm had passed before dawn, that "
    "the lamp had burned all night, and that three fishing boats came home at first light "
    "with nets so full of herring that the harbour smelled of fish until noon."
)


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
    banned = sampling.build_sampler(_params(runtime, logit_bias={5: -100.0}))
    penalized = sampling.build_sampler(_params(runtime, repeat_penalty=1.3))
    try:
        assert plain.chain is None
        assert biased.chain is not None
        assert banned.chain is None  # bans alone keep the argmax
        assert penalized.chain is not None
    finally:
        for s in (plain, biased, banned, penalized):
            s.free()


def test_argmax_picks_what_the_greedy_chain_picks(runtime: llama.Runtime) -> None:
    """Row by row of one decode of a fixed text (not of a generation, whose text, and
    so which rows are compared, would be the model's and the CPU's choice)."""
    # A zero bias puts the same greedy decision behind llama.cpp's full chain.
    fast = sampling.build_sampler(_params(runtime))
    chain = sampling.build_sampler(_params(runtime, logit_bias={5: 0.0}))
    tokens = runtime.vocab.tokenize(TEXT)
    assert len(tokens) >= ROWS
    tokens = tokens[:ROWS]
    try:
        runtime.clear(0)
        runtime.decode([(t, i, 0, True) for i, t in enumerate(tokens)])
        for row in range(len(tokens)):
            assert runtime.sample(chain, row) == runtime.sample(fast, row), row
    finally:
        fast.free()
        chain.free()
        runtime.clear(0)


def test_argmax_with_bans_picks_what_the_chain_picks(runtime: llama.Runtime) -> None:
    """A logit bias of bans only keeps the argmax path (banned rows set to -inf), and
    it picks what llama.cpp's chain with the same bans picks: here, row by row, the
    best token once the row's own best is banned."""
    tokens = runtime.vocab.tokenize(TEXT)[:ROWS]
    unbanned = sampling.build_sampler(_params(runtime, logit_bias={5: 0.0}))
    try:
        runtime.clear(0)
        runtime.decode([(t, i, 0, True) for i, t in enumerate(tokens)])
        for row in range(len(tokens)):
            best = runtime.sample(unbanned, row)
            neutral = 5 if best != 5 else 6
            bans = {best: -100.0, 1: -100.0}
            fast = sampling.build_sampler(_params(runtime, logit_bias=bans))
            chain = sampling.build_sampler(_params(runtime, logit_bias={**bans, neutral: 0.0}))
            try:
                assert fast.chain is None and chain.chain is not None
                picked = runtime.sample(chain, row)
                assert runtime.sample(fast, row) == picked != best, row
            finally:
                fast.free()
                chain.free()
    finally:
        unbanned.free()
        runtime.clear(0)
