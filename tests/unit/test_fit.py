"""The fit ledger's arithmetic (pure): a replica's estimate by part, against the sizes
llama.cpp 0.3.36 logged creating contexts for the bundled model, and the decision."""

from __future__ import annotations

import dataclasses

import pytest

from blazar.api.replicas import SpeculationLaunch
from blazar.controller import fit
from tests import launches

MIB = 1024 * 1024
# Gemma 3 270M Q4_K_M as `modelfile.read_gguf` reads it.
GEMMA = {
    "block_count": "18",
    "embedding_length": "640",
    "attention.head_count": "4",
    "attention.head_count_kv": "1",
    "attention.key_length": "256",
    "attention.value_length": "256",
    "attention.sliding_window": "512",
    "tensor_bytes": "246587904",
    "repacked_bytes": "13271040",
    "vocab_size": "262144",
}
SHAPE = fit.ModelShape.of_parameters(GEMMA, size_bytes=253_113_024)
assert SHAPE is not None


def test_shape_reads_the_header_figures_and_falls_back_for_what_is_optional() -> None:
    expected = fit.ModelShape(
        tensor_bytes=246_587_904, n_layer=18, n_head=4, n_head_kv=1, key_length=256,
        value_length=256, n_embd=640, n_vocab=262_144, repacked_bytes=13_271_040,
    )  # fmt: skip
    assert expected == SHAPE
    # An older status without tensor_bytes: the file's size; no key/value lengths: the
    # embedding split between the heads; no KV head count: one per head.
    bare = {k: v for k, v in GEMMA.items() if not k.startswith("attention.")}
    bare["attention.head_count"] = "4"
    del bare["tensor_bytes"], bare["repacked_bytes"]
    assert fit.ModelShape.of_parameters(bare, size_bytes=99) == fit.ModelShape(
        tensor_bytes=99, n_layer=18, n_head=4, n_head_kv=4, key_length=160,
        value_length=160, n_embd=640, n_vocab=262_144,
    )  # fmt: skip


@pytest.mark.parametrize("missing", ["block_count", "vocab_size", "embedding_length"])
def test_shape_without_a_needed_figure_is_none(missing: str) -> None:
    params = {k: v for k, v in GEMMA.items() if k != missing}
    assert fit.ModelShape.of_parameters(params, size_bytes=1) is None


def test_a_figure_that_is_not_a_number_is_none() -> None:
    assert fit.ModelShape.of_parameters(GEMMA | {"block_count": "many"}, size_bytes=1) is None


Q4_0, Q4_K, IQ4_NL, Q8_0, Q6_K, F32 = 2, 12, 20, 8, 14, 0


@pytest.mark.parametrize(
    ("tensors", "repacked"),
    [
        # The bundled model: its Q4_K matrices (the embedding is Q8_0), 12.66 MiB.
        ({"token_embd.weight": (Q8_0, 900), "blk.0.attn_output.weight": (Q4_K, 30),
          "blk.0.ffn_down.weight": (Q6_K, 40), "blk.0.attn_norm.weight": (F32, 1)}, 30),
        # Its Q4_0 draft: every matrix, the tied embedding too (the output projection).
        ({"token_embd.weight": (Q4_0, 900), "blk.0.attn_q.weight": (Q4_0, 30),
          "blk.0.ffn_up.weight": (IQ4_NL, 20)}, 950),
        # An output projection of its own: the embedding only serves lookups.
        ({"token_embd.weight": (Q4_0, 900), "output.weight": (Q4_0, 900),
          "blk.0.attn_q.weight": (Q4_K, 30)}, 930),
        ({}, 0),
    ],
)  # fmt: skip
def test_repacked_bytes(tensors: dict[str, tuple[int, int]], repacked: int) -> None:
    assert fit.repacked_bytes(tensors) == repacked


@pytest.mark.parametrize(
    ("slots", "context", "cells"),
    [(1, 512, 512), (1, 100, 256), (4, 1000, 4096), (3, 1000, 3072), (8, 4096, 32768)],
)
def test_cells_are_the_padded_context_split_evenly(slots: int, context: int, cells: int) -> None:
    assert fit.cells(slots, context) == cells


# (slots, contextPerSlot, KV MiB) as llama.cpp logged them (`llama_kv_cache: size =`,
# the non-SWA and the full-size SWA cache added): every layer holds every cell.
@pytest.mark.parametrize(
    ("slots", "context", "mib"),
    [(1, 512, 9.0), (4, 1000, 72.0), (4, 2048, 144.0), (8, 4096, 576.0)],
)
def test_kv_is_what_llama_cpp_allocates(slots: int, context: int, mib: float) -> None:
    kv = fit.kv_bytes(SHAPE, cells=fit.cells(slots, context), type_k="f16", type_v="f16")
    assert kv == mib * MIB


@pytest.mark.parametrize(
    ("type_k", "type_v", "ratio"),
    [("f32", "f32", 2.0), ("q8_0", "q8_0", 17 / 32), ("q4_0", "f16", (9 / 32 + 1) / 2)],
)
def test_kv_scales_with_the_cache_types(type_k: str, type_v: str, ratio: float) -> None:
    f16 = fit.kv_bytes(SHAPE, cells=2048, type_k="f16", type_v="f16")
    assert fit.kv_bytes(SHAPE, cells=2048, type_k=type_k, type_v=type_v) == int(f16 * ratio)


def test_every_cache_type_the_api_accepts_has_a_size() -> None:
    from blazar.api.kinds import KV_CACHE_TYPES

    assert set(fit.CACHE_TYPE_BYTES) == KV_CACHE_TYPES


@pytest.mark.parametrize(
    ("slots", "context", "flash", "graph_mib"),
    [
        # llama.cpp logged 66.57, 81.64 and 201.76 MiB (`compute buffer size`).
        (1, 512, True, 70.0),
        (16, 4096, True, 85.0),
        (1, 16384, False, 198.0),
    ],
)
def test_compute_is_the_logits_rows_twice_activations_and_scores(
    slots: int, context: int, flash: bool, graph_mib: float
) -> None:
    rows = fit.output_rows(slots, 0)
    got = fit.compute_bytes(SHAPE, rows=rows, cells_per_slot=context, flash_attention=flash)
    output_buffer = rows * SHAPE.n_vocab * 4
    assert got - output_buffer == graph_mib * MIB


def test_drafted_tokens_ask_for_more_logits_rows_up_to_the_batch() -> None:
    assert fit.output_rows(4, 0) == 68
    assert fit.output_rows(4, 8) == 4 * 9 + 64
    assert fit.output_rows(64, 32) == 512


def test_estimate_adds_the_parts() -> None:
    launch = launches.spec(slots=4, context_per_slot=2048)
    est = fit.estimate(launch, SHAPE)
    assert est.weights == 246_587_904 + 13_271_040  # mapped, and the repacked copies
    assert est.kv == 144 * MIB
    assert est.compute == (2 * 68 + 5) * MIB
    assert (est.draft, est.runtime) == (0, fit.RUNTIME_BYTES)
    assert est.total == est.weights + est.kv + est.compute + est.runtime


def test_flash_attention_off_adds_the_attention_scores() -> None:
    auto = fit.estimate(launches.spec(slots=1, context_per_slot=16384), SHAPE)
    off = fit.estimate(launches.spec(slots=1, context_per_slot=16384, flash_attention="off"), SHAPE)
    assert off.compute - auto.compute == 16384 * 512 * 4 * 4


def test_a_draft_model_adds_its_weights_f16_cache_and_buffers() -> None:
    draft_shape = dataclasses.replace(SHAPE, tensor_bytes=150 * MIB, repacked_bytes=140 * MIB)
    pair = SpeculationLaunch(
        kind="model", max_draft_tokens=8, disable_above_batch=4, min_acceptance_rate=0.3,
        draft_model_path="/d.gguf",
    )  # fmt: skip
    launch = launches.spec(slots=2, context_per_slot=1024, type_k="q8_0", speculation=pair)
    est = fit.estimate(launch, SHAPE, draft=draft_shape)
    kv_f16 = fit.kv_bytes(SHAPE, cells=2048, type_k="f16", type_v="f16")
    # Its graph reserves 2 + 64 logits rows; its output buffer holds one per slot.
    assert est.draft == (150 + 140) * MIB + kv_f16 + (66 + 5 + 2) * MIB
    # The target's logits rows make room for the drafts it verifies.
    assert est.compute == (2 * (2 * 9 + 64) + 5) * MIB
    assert est.total == est.weights + est.kv + est.compute + est.draft + est.runtime


@pytest.mark.parametrize(
    ("held", "outstanding"),
    [
        # Starting, nothing resident yet: the whole estimate.
        (fit.Held(estimate=500), 500),
        # Settled: the mapped weights (resident, not anonymous) are still counted.
        (fit.Held(estimate=500, resident=520, anonymous=250), 270),
        # Half loaded: what it has not allocated yet, and its mapped pages.
        (fit.Held(estimate=500, resident=300, anonymous=100), 400),
        # Everything anonymous and past the estimate: MemAvailable knows it all.
        (fit.Held(estimate=500, resident=600, anonymous=600), 0),
    ],
)
def test_what_a_replica_holds_beyond_mem_available(held: fit.Held, outstanding: int) -> None:
    assert held.outstanding == outstanding


@pytest.mark.parametrize(
    ("need", "available", "fits", "free"),
    [
        (100, 1000, True, 500),
        (500, 1000, True, 500),
        (501, 1000, False, 500),
        (1, 400, False, -100),
    ],
)
def test_decide(need: int, available: int, fits: bool, free: int) -> None:
    held = [fit.Held(estimate=300), fit.Held(estimate=400, resident=400, anonymous=200)]
    assert fit.decide(need, available=available, held=held) == fit.Fit(
        fits=fits, need=need, free=free, available=available, outstanding=500
    )


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * MIB, "3.0 MiB"),
     (5 * 1024**4, "5.0 TiB"), (4096 * 1024**4, "4096.0 TiB"), (-20 * MIB, "-20.0 MiB")],
)  # fmt: skip
def test_human(n: int, text: str) -> None:
    assert fit.human(n) == text


def test_the_shortfall_says_needed_and_free_in_both_units() -> None:
    shortfall = fit.Fit(fits=False, need=3 * 1024**3, free=MIB, available=2 * MIB, outstanding=MIB)
    message = fit.shortfall_message(shortfall, index=1)
    assert message.startswith(
        "Replica 1 needs 3.0 GiB (3221225472 bytes) but 1.0 MiB (1048576 bytes) is free: "
        "2.0 MiB available on the host, less 1.0 MiB held by running replicas"
    )


@pytest.mark.parametrize(
    ("total", "never", "ends"),
    [
        (None, False, "the Lane starts by itself once it fits."),
        (4 * 1024**3, False, "the Lane starts by itself once it fits."),
        (2 * 1024**3, True, "the host's 2.0 GiB in all, so it can never fit as it is: "
         "lower slots, contextPerSlot or the cache types."),
    ],
)  # fmt: skip
def test_a_replica_larger_than_the_host_can_never_fit(
    total: int | None, never: bool, ends: str
) -> None:
    decision = fit.decide(3 * 1024**3, available=MIB, held=[], total=total)
    assert (decision.fits, decision.never) == (False, never)
    assert fit.shortfall_message(decision, index=0).endswith(ends)
