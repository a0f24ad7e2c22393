"""The engine's shortcuts past llama.cpp's sampler chain pick, on the real model, what
the chain picks from every row:
- plain greedy requests take the logits row's argmax instead of the chain;
- a grammar that rejects the chain's draw judges the best tokens first (`Sampler`),
  greedy and sampled. Greedy, it judges far fewer candidates doing so; with top-k the
  prose rows here rarely hold k allowed tokens among their best, and it falls back
  unless min-p proves that no token outside the best can be drawn (`slice_decides`)."""

from __future__ import annotations

import json
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
# The prose rows above: the JSON grammar rejects most of what they would write next.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "note": {"type": "string", "maxLength": 80},
    },
    "required": ["city", "unit", "note"],
    "additionalProperties": False,
}


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


# --- a grammar's fallback judges the best tokens first ----------------------------------


def _constrained(rt: llama.Runtime, **fields: object) -> sampling.SamplingParams:
    return sampling.resolve(
        inference_pb2.Sampling(**fields),  # type: ignore[arg-type]
        constraint=inference_pb2.Constraint(json_schema=json.dumps(SCHEMA)),
        vocab=rt.vocab,
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 40, "seed": 7},
        {"temperature": 1.5, "top_k": 3, "top_p": 0.9, "min_p": 0.0, "seed": 11},
        # The defaults (top-k 40, top-p 0.95, min-p 0.05): what most clients get.
        {"temperature": 0.8, "seed": 3},
        {"temperature": 1.2, "top_p": 0.5, "seed": 5},
        {"temperature": 0.7, "top_p": 1.0, "min_p": 0.2, "seed": 9},
        {"temperature": 1.0, "top_k": 100, "min_p": 0.01, "seed": 13},
    ],
    ids=["greedy", "top-k-40", "top-k-3", "defaults", "top-p-0.5", "min-p-0.2", "top-k-100"],
)
def test_judging_the_best_first_draws_what_a_whole_pass_draws(
    runtime: llama.Runtime, fields: dict[str, object]
) -> None:
    fast = sampling.build_sampler(_constrained(runtime, **fields))
    # A zero bias changes no logit, but the chain's bias stage makes it judge them all.
    whole = sampling.build_sampler(_constrained(runtime, logit_bias={5: 0.0}, **fields))
    tokens = runtime.vocab.tokenize(TEXT)[:ROWS]
    assert len(tokens) == ROWS
    ends = runtime.vocab.end_of_generation
    drawn = []
    try:
        runtime.clear(0)
        runtime.decode([(t, i, 0, True) for i, t in enumerate(tokens)])
        for row in range(ROWS):
            token = runtime.sample(whole, row)
            assert runtime.sample(fast, row) == token, (row, drawn)
            drawn.append(token)
            if token in ends:
                break  # the document is whole: nothing may follow it
    finally:
        fast.free()
        whole.free()
        runtime.clear(0)
    print(f"{fields}: {len(drawn)} tokens, judged {fast.judged:,} against {whole.judged:,}")
    assert whole.judged >= 5 * runtime.vocab.n_tokens  # the rows made the grammar judge
    if fields["temperature"] == 0.0:
        assert fast.judged * 2 < whole.judged
    if fields.keys() == {"temperature", "seed"}:
        # min-p proves the rest of the vocabulary out of the draw (`slice_decides`).
        assert fast.judged * 5 < whole.judged * 4
