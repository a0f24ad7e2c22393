"""A thin typed layer over llama-cpp-python's low-level (ctypes) API.

`Vocab` holds read-only tokenizer calls, safe from any thread. `Runtime` owns the
model, the one context and the batch; only the decode thread may call it, from
`Runtime.load` to `Runtime.close`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llama_cpp as lc
import structlog

log = structlog.get_logger("blazar.engine.llama")

_GGML_LOG_LEVEL_WARN = 3
_GGML_LOG_LEVEL_ERROR = 4


@lc.llama_log_callback  # type: ignore[untyped-decorator]
def _native_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp prints hundreds of load lines; keep only what needs attention.
    if level in (_GGML_LOG_LEVEL_WARN, _GGML_LOG_LEVEL_ERROR):
        message = text.decode("utf-8", errors="replace").strip()
        if message:
            log.warning("llama_cpp", native_level=level, message=message)


def quiet_native_logs() -> None:
    """Route llama.cpp's own logging through structlog, warnings and errors only."""
    lc.llama_log_set(_native_log, ctypes.c_void_p(0))


class LlamaError(RuntimeError):
    """A llama.cpp call failed."""


class Vocab:
    """Tokenizer calls on a loaded model's vocabulary (read-only, thread-safe)."""

    def __init__(self, vocab: Any) -> None:
        self._vocab = vocab

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Tokens of text; special tokens written as text (e.g. `<start_of_turn>`) parse."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_bos, True)
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    def piece(self, token: int) -> bytes:
        """The bytes token stands for; control tokens (BOS, end of turn) are empty."""
        # A fresh buffer per call keeps this safe from any thread.
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    def special_text(self, token: int) -> str:
        """How a control token is written in text, e.g. `<bos>`; "" for no token."""
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    @property
    def bos_text(self) -> str:
        return self.special_text(lc.llama_vocab_bos(self._vocab))

    @property
    def eos_text(self) -> str:
        return self.special_text(lc.llama_vocab_eos(self._vocab))


@dataclass(frozen=True)
class RuntimeOptions:
    model_path: str
    slots: int
    context_per_slot: int
    threads: int
    gpu_layers: int = 0
    n_batch: int = 512


class Runtime:
    """One model, one context with `slots` sequences, one reusable batch."""

    def __init__(self, model: Any, ctx: Any, options: RuntimeOptions) -> None:
        self._model = model
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(options.n_batch, 0, options.slots)
        self.options = options
        self.n_batch = options.n_batch
        self.vocab = Vocab(lc.llama_model_get_vocab(model))
        self.context_per_slot = int(lc.llama_n_ctx_seq(ctx))
        template = lc.llama_model_chat_template(model, None)
        # The GGUF's own chat template (tokenizer.chat_template), if it ships one.
        self.chat_template: str | None = template.decode() if template else None

    @classmethod
    def load(cls, options: RuntimeOptions) -> Runtime:
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = options.gpu_layers
        model = lc.llama_model_load_from_file(options.model_path.encode(), mparams)
        if not model:
            raise LlamaError(f"could not load model {options.model_path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = options.slots * options.context_per_slot
        cparams.n_seq_max = options.slots
        # Separate KV streams per sequence: each slot gets exactly n_ctx / n_seq_max
        # positions of its own (a unified cache would let one slot starve the others).
        cparams.kv_unified = False
        cparams.n_batch = options.n_batch
        cparams.n_ubatch = options.n_batch
        # Logits are only read for each sequence's last token; sizing the output for
        # the whole batch would reserve n_batch x 262k floats (over 500 MiB).
        cparams.n_outputs_max = options.slots
        cparams.n_threads = options.threads
        cparams.n_threads_batch = options.threads
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            lc.llama_model_free(model)
            raise LlamaError("could not create a llama context")
        return cls(model, ctx, options)

    def decode(self, entries: Iterable[tuple[int, int, int, bool]]) -> None:
        """Run one batch of (token, position, sequence, wants_logits) entries."""
        b = self._batch
        n = 0
        for token, pos, seq, logits in entries:
            b.token[n] = token
            b.pos[n] = pos
            b.n_seq_id[n] = 1
            b.seq_id[n][0] = seq
            b.logits[n] = logits
            n += 1
        b.n_tokens = n
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise LlamaError(f"llama_decode returned {rc}")

    def sample(self, sampler: Any, index: int) -> int:
        """Sample (and accept) a token from the logits of batch entry `index`."""
        return int(lc.llama_sampler_sample(sampler, self._ctx, index))

    def clear(self, seq: int) -> None:
        """Drop every cached position of one sequence."""
        lc.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def close(self) -> None:
        lc.llama_batch_free(self._batch)
        lc.llama_free(self._ctx)
        lc.llama_model_free(self._model)
        lc.llama_backend_free()
