"""Sampling settings of one request, and the llama.cpp sampler chain built from them.

`resolve` (pure) applies the engine's defaults to the wire `Sampling` and validates
it; `build_chain` turns the result into a native `llama_sampler` chain, so sampling
over the 262k-token vocabulary happens in C and logits never reach Python.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from blazar._proto.v1 import inference_pb2
from blazar.api import errors

PENALTY_LAST_N = 64


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    # None: generate until the slot's context is full.
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return (self.repeat_penalty, self.presence_penalty, self.frequency_penalty) != (
            1.0,
            0.0,
            0.0,
        )


def resolve(sampling: inference_pb2.Sampling, *, seed: int | None = None) -> SamplingParams:
    """Fill unset fields with the defaults; raise InvalidRequest for impossible values.

    `seed` stands in for an unset `sampling.seed` (tests pass one; by default a fresh
    random seed is drawn).
    """
    d = SamplingParams()
    p = SamplingParams(
        temperature=sampling.temperature if sampling.HasField("temperature") else d.temperature,
        top_k=sampling.top_k if sampling.HasField("top_k") else d.top_k,
        top_p=sampling.top_p if sampling.HasField("top_p") else d.top_p,
        min_p=sampling.min_p if sampling.HasField("min_p") else d.min_p,
        repeat_penalty=(
            sampling.repeat_penalty if sampling.HasField("repeat_penalty") else d.repeat_penalty
        ),
        presence_penalty=(
            sampling.presence_penalty
            if sampling.HasField("presence_penalty")
            else d.presence_penalty
        ),
        frequency_penalty=(
            sampling.frequency_penalty
            if sampling.HasField("frequency_penalty")
            else d.frequency_penalty
        ),
        seed=(
            sampling.seed
            if sampling.HasField("seed")
            else (secrets.randbits(32) if seed is None else seed)
        ),
        max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else None,
        stop=tuple(sampling.stop),
    )
    problems = [
        msg
        for bad, msg in (
            (p.temperature < 0, "temperature must be >= 0"),
            (p.top_k < 0, "top_k must be >= 0"),
            (not 0.0 <= p.top_p <= 1.0, "top_p must be between 0 and 1"),
            (not 0.0 <= p.min_p <= 1.0, "min_p must be between 0 and 1"),
            (p.repeat_penalty <= 0, "repeat_penalty must be > 0"),
            (p.max_tokens is not None and p.max_tokens < 1, "max_tokens must be >= 1"),
        )
        if bad
    ]
    if problems:
        raise errors.InvalidRequest("Invalid sampling: " + "; ".join(problems) + ".")
    return p


def build_chain(params: SamplingParams) -> Any:
    """A new native sampler chain (the caller frees it with `llama_sampler_free`).

    Order as in llama.cpp's common sampler: penalties, top-k, top-p, min-p,
    temperature, then the random draw; temperature 0 ends in greedy instead.
    """
    import llama_cpp as lc

    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    stages: list[Any] = []
    if params.penalized:
        stages.append(
            lc.llama_sampler_init_penalties(
                PENALTY_LAST_N,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
        )
    if params.greedy:
        stages.append(lc.llama_sampler_init_greedy())
    else:
        if params.top_k > 0:
            stages.append(lc.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            stages.append(lc.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            stages.append(lc.llama_sampler_init_min_p(params.min_p, 1))
        stages.append(lc.llama_sampler_init_temp(params.temperature))
        stages.append(lc.llama_sampler_init_dist(params.seed))
    for stage in stages:
        lc.llama_sampler_chain_add(chain, stage)  # the chain takes ownership
    return chain
