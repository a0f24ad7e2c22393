"""Which llama.cpp builds may place weights in ggml's extra CPU buffers."""

from __future__ import annotations

import pytest

from blazar.engine.llama import extra_buffers_safe

# `llama_print_system_info()` of llama-cpp-python 0.3.36 on the dev box, built
# -march=native (AMX) and with the Makefile's -mno-amx-* flags.
NATIVE = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
    "BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | "
    "AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
NO_AMX = NATIVE.replace("AMX_INT8 = 1 | ", "")


@pytest.mark.parametrize(
    ("info", "safe"),
    [
        (NATIVE, False),
        (NO_AMX, True),
        ("CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | REPACK = 1 | ", True),
    ],
)
def test_extra_buffers_only_without_amx(info: str, safe: bool) -> None:
    assert extra_buffers_safe(info) is safe
