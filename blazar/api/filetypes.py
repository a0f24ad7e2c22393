"""llama.cpp's names for the weight types of GGUF files (`general.file_type`).

Pure. The numbers are llama.cpp's `llama_ftype` (ggml's `LlamaFileType` in the `gguf`
package), without the `MOSTLY_` prefix: the names people quote when they say which
quantization a file is ("Q4_K_M").
"""

from __future__ import annotations

_NAMES: dict[int, str] = {
    0: "ALL_F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
}


def quantization(file_type: str | int | None) -> str:
    """The name of a `general.file_type` value (as a number or its decimal text);
    empty when it is missing or not one llama.cpp knows."""
    if isinstance(file_type, str):
        file_type = int(file_type) if file_type.isascii() and file_type.isdigit() else None
    if file_type is None:
        return ""
    return _NAMES.get(file_type, "")
