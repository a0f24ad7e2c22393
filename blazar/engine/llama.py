"""A thin typed layer over llama-cpp-python's low-level (ctypes) API.

`Vocab` holds read-only tokenizer calls, safe from any thread. `Runtime` owns the
model, the one context and the batch; only the decode thread may call it, from
`Runtime.load` to `Runtime.close`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt
import structlog

from blazar.api import replicas
from blazar.engine import pretokenize

log = structlog.get_logger("blazar.engine.llama")

_GGML_LOG_LEVEL_WARN = 3
_GGML_LOG_LEVEL_ERROR = 4


# llama.cpp's first error since `_native_errors.clear()`: a load that fails returns
# only NULL, and the why ("key not found in model: llama.embedding_length") is this.
_native_errors: list[str] = []


@lc.llama_log_callback  # type: ignore[untyped-decorator]  # a ctypes CFUNCTYPE: untyped
def _native_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp prints hundreds of load lines; keep only what needs attention.
    if level in (_GGML_LOG_LEVEL_WARN, _GGML_LOG_LEVEL_ERROR):
        message = text.decode("utf-8", errors="replace").strip()
        if message:
            log.warning("llama_cpp", native_level=level, message=message)
            if level == _GGML_LOG_LEVEL_ERROR and not _native_errors:
                _native_errors.append(message)


def _failed(what: str) -> LlamaError:
    """`what` failed, with llama.cpp's first error since the call began, if it said one."""
    said = f" (llama.cpp: {_native_errors[0]})" if _native_errors else ""
    return LlamaError(f"{what}{said}")


def quiet_native_logs() -> None:
    """Route llama.cpp's own logging through structlog, warnings and errors only."""
    lc.llama_log_set(_native_log, ctypes.c_void_p(0))


# Tokenizers whose tokens spell a text back byte for byte (SentencePiece with byte
# fallback, byte-level BPE): LLAMA_VOCAB_TYPE_SPM and LLAMA_VOCAB_TYPE_BPE.
_SPELLING_VOCAB_TYPES = frozenset({1, 2})

# The tokens llama.cpp splits text at (`cache_special_tokens`), and those of them it
# skips without parse_special.
_PARSED_ONLY_AS_SPECIAL = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
_SPECIAL_ATTRS = _PARSED_ONLY_AS_SPECIAL | lc.LLAMA_TOKEN_ATTR_USER_DEFINED


class LlamaError(RuntimeError):
    """A llama.cpp call failed."""


class Vocab:
    """Tokenizer calls on a loaded model's vocabulary (read-only, thread-safe)."""

    def __init__(self, vocab: Any) -> None:
        self._vocab = vocab
        self.n_tokens = int(lc.llama_vocab_n_tokens(vocab))

    @property
    def handle(self) -> Any:
        """The native `llama_vocab *`, for samplers that need it (grammar)."""
        return self._vocab

    def tokenize(self, text: str, *, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        """Tokens of text; special tokens written as text (e.g. `<start_of_turn>`) parse
        unless parse_special is False.

        The same tokens as llama.cpp's own `llama_tokenize`, which scans a text once
        per special token (6,414 for Gemma 3) and walks its fragment list from the head
        at every match: seconds for 64 KB of `<`, hours for megabytes of "a\\n". Blazar
        splits at the special tokens itself, in one scan (`pretokenize`), and hands
        llama.cpp only the plain fragments between them. Even short texts go this way:
        a 1 KB chat prompt took 0.3 ms against 0.6 ms natively (0.21 against 0.15
        at 256 bytes), so a threshold would save nothing worth a second path.
        """
        data = text.encode("utf-8")
        partition = self._partition
        if partition is None:
            return self._native(data, add_special=add_bos, parse_special=parse_special)
        # As llama.cpp's SPM and BPE paths do: BOS first and EOS last when the model
        # asks for them, each special token as itself, each raw fragment alone (SPM's
        # space prefix goes on a fragment that is first or follows a special token,
        # and every fragment is one of those).
        tokens: list[int] = []
        if add_bos and lc.llama_vocab_get_add_bos(self._vocab):
            tokens.append(lc.llama_vocab_bos(self._vocab))
        # Hostile text repeats its fragments.
        known: dict[bytes, list[int]] = {}
        for fragment in partition.split(data, parse_special=parse_special):
            if isinstance(fragment, int):
                tokens.append(fragment)
                continue
            plain = known.get(fragment)
            if plain is None:
                # No special text is left in a fragment: without parse_special and
                # add_special llama.cpp skips the control tokens' scans and adds nothing.
                plain = self._native(fragment, add_special=False, parse_special=False)
                known[fragment] = plain
            tokens += plain
        if add_bos and lc.llama_vocab_get_add_eos(self._vocab):
            tokens.append(lc.llama_vocab_eos(self._vocab))
        return tokens

    def writes_control_tokens(self, text: str) -> bool:
        """Whether `text` holds text that tokenizes as a control token (`<end_of_turn>`):
        whether it tokenizes otherwise with parse_special. Without a control token's
        text in it (the common case, one scan to tell), it cannot."""
        partition = self._partition
        if partition is not None and not partition.finds_control(text.encode("utf-8")):
            return False
        return self.tokenize(text, add_bos=False, parse_special=True) != self.tokenize(
            text, add_bos=False, parse_special=False
        )

    def _native(self, data: bytes, *, add_special: bool, parse_special: bool) -> list[int]:
        capacity = len(data) + 8
        while True:
            buf = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(
                self._vocab, data, len(data), buf, capacity, add_special, parse_special
            )
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    @functools.cached_property
    def _partition(self) -> pretokenize.Partition | None:
        """llama.cpp's special-token partition for this vocabulary (0.2 s to build for
        Gemma 3, once: `Runtime.warm_up` does it), or None where Blazar cannot
        reproduce it: a tokenizer other than SPM or BPE, or special texts whose order
        llama.cpp leaves to an unstable sort."""
        if lc.llama_vocab_type(self._vocab) not in _SPELLING_VOCAB_TYPES:
            return None
        specials = []
        for token in range(self.n_tokens):
            attr = lc.llama_vocab_get_attr(self._vocab, token)
            if attr & _SPECIAL_ATTRS:
                specials.append(
                    pretokenize.Special(
                        token=token,
                        text=lc.llama_vocab_get_text(self._vocab, token),
                        control=bool(attr & _PARSED_ONLY_AS_SPECIAL),
                        lstrip=bool(attr & lc.LLAMA_TOKEN_ATTR_LSTRIP),
                        rstrip=bool(attr & lc.LLAMA_TOKEN_ATTR_RSTRIP),
                    )
                )
        return pretokenize.Partition.of(specials)

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes token stands for; control tokens (BOS, end of turn) are empty
        unless special is True (then they read as written, e.g. `<bos>`)."""
        # A fresh buffer per call keeps this safe from any thread.
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    @functools.cached_property
    def longest_piece(self) -> int | None:
        """The most bytes one token spells (a control token as written), asked of each
        token once (~0.7 s for 262k); None for a tokenizer that may drop or fold text
        (WordPiece, Unigram), whose token count a text's length does not bound."""
        if lc.llama_vocab_type(self._vocab) not in _SPELLING_VOCAB_TYPES:
            return None
        return max(len(self.piece(t, special=True)) for t in range(self.n_tokens))

    @functools.cached_property
    def end_of_generation(self) -> frozenset[int]:
        """Every token a generation ends on (asked of each token once, ~60 ms for 262k)."""
        return frozenset(t for t in range(self.n_tokens) if self.is_eog(t))

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


# KV cache element types by their llama.cpp names (`--cache-type-k/v`): the ggml type
# and its size in bytes per element (block size / elements per block).
_GGML_TYPE_BF16 = 30  # not exported by llama_cpp
CACHE_TYPES: dict[str, tuple[int, float]] = {
    "f32": (lc.GGML_TYPE_F32, 4.0),
    "f16": (lc.GGML_TYPE_F16, 2.0),
    "bf16": (_GGML_TYPE_BF16, 2.0),
    "q8_0": (lc.GGML_TYPE_Q8_0, 34 / 32),
    "q4_0": (lc.GGML_TYPE_Q4_0, 18 / 32),
    "q4_1": (lc.GGML_TYPE_Q4_1, 20 / 32),
    "iq4_nl": (lc.GGML_TYPE_IQ4_NL, 18 / 32),
    "q5_0": (lc.GGML_TYPE_Q5_0, 22 / 32),
    "q5_1": (lc.GGML_TYPE_Q5_1, 24 / 32),
}

# A Lane's flashAttention as llama.cpp's flash_attn_type.
_FLASH_ATTENTION = {
    "auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}

# Output rows (logits) per step beyond one per slot: room for prompt logprobs.
EXTRA_OUTPUT_ROWS = 64


def extra_buffers_safe(system_info: str) -> bool:
    """Whether weights may go to ggml's extra CPU buffer types (AMX, repacked layouts).

    Not when the library was built with AMX: ggml's AMX kernels in llama-cpp-python
    0.3.36 die with SIGILL (`tilezero` without a valid tile config) at the first batch
    of more than one token, seen on a Sapphire Rapids host. The Makefile builds without
    AMX; this keeps a wheel built otherwise from crash-looping every replica. Without
    the extra buffers, steps of 1 to 16 logits rows ran within about 10% of the
    no-AMX build's (measured minutes apart on the same host).
    """
    return "AMX_INT8 = 1" not in system_info


def open_model(spec: replicas.LaunchSpec, *, n_batch: int, n_outputs: int) -> tuple[Any, Any]:
    """Load the GGUF a launch names and create its context for its slots; (model, ctx).

    The one place the engine's llama.cpp settings live, for the target and the draft
    (`draft.draft_spec`). `n_outputs` caps the rows of logits one decode may produce.
    """
    model_path, slots, context_per_slot = spec.model_path, spec.slots, spec.context_per_slot
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = spec.gpu_layers
    mparams.use_extra_bufts = extra_buffers_safe(lc.llama_print_system_info().decode())
    _native_errors.clear()
    model = lc.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise _failed(f"could not load model {model_path}")
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = slots * context_per_slot
    cparams.n_seq_max = slots
    # Separate KV streams per sequence: each slot gets exactly n_ctx / n_seq_max
    # positions of its own (a unified cache would let one slot starve the others).
    cparams.kv_unified = False
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_batch
    # Logits are read for a few entries per step only (each sequence's last token,
    # drafts, prompt-logprob chunks); sizing the output for the whole batch would
    # reserve n_batch x 262k floats (over 500 MiB).
    cparams.n_outputs_max = n_outputs
    # Full-size sliding-window caches: rolling back a rejected draft (and keeping a
    # reused prefix) needs positions a pruned window would already have dropped.
    cparams.swa_full = True
    cparams.flash_attn_type = _FLASH_ATTENTION[spec.flash_attention]
    cparams.type_k = CACHE_TYPES[spec.type_k][0]
    cparams.type_v = CACHE_TYPES[spec.type_v][0]
    cparams.n_threads = spec.threads
    cparams.n_threads_batch = spec.threads
    cparams.no_perf = True
    _native_errors.clear()
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        lc.llama_model_free(model)
        raise _failed(f"could not create a llama context for {model_path}")
    return model, ctx


# Tokens one decode step takes at most (llama.cpp's n_batch and n_ubatch).
N_BATCH = 512


def outputs_per_slot(spec: replicas.LaunchSpec) -> int:
    """Batch entries per sequence and step that may ask for logits: the token to
    sample from, plus the drafted tokens verified beside it."""
    return 1 + (spec.speculation.max_draft_tokens if spec.speculation else 0)


def output_rows(spec: replicas.LaunchSpec, *, n_batch: int = N_BATCH) -> int:
    """Rows of logits one step may produce. The compute buffer holds that many rows of
    the whole vocabulary (1 MiB each for 262k tokens), so not n_batch."""
    return min(n_batch, spec.slots * outputs_per_slot(spec) + EXTRA_OUTPUT_ROWS)


def _meta(model: Any, key: str) -> str | None:
    """A GGUF metadata value of the model as text, or None."""
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace") if n >= 0 else None


class Runtime:
    """One model, one context with `slots` sequences, one reusable batch."""

    def __init__(
        self, model: Any, ctx: Any, spec: replicas.LaunchSpec, *, n_batch: int = N_BATCH
    ) -> None:
        self._model = model
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(n_batch, 0, spec.slots)
        self.spec = spec
        self.n_batch = n_batch
        self.n_outputs = output_rows(spec, n_batch=n_batch)
        self.vocab = Vocab(lc.llama_model_get_vocab(model))
        self.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model)))
        self.context_per_slot = int(lc.llama_n_ctx_seq(ctx))
        # Sliding-window size of the model's SWA layers; 0 when it has none.
        self.n_swa = int(lc.llama_model_n_swa(model))
        self.kv_bytes = self._kv_bytes()
        template = lc.llama_model_chat_template(model, None)
        # The GGUF's own chat template (tokenizer.chat_template), if it ships one.
        self.chat_template: str | None = template.decode() if template else None
        self.architecture = _meta(model, "general.architecture") or ""

    @classmethod
    def load(cls, spec: replicas.LaunchSpec) -> Runtime:
        model, ctx = open_model(spec, n_batch=N_BATCH, n_outputs=output_rows(spec))
        runtime = cls(model, ctx, spec)
        runtime.warm_up()
        return runtime

    def warm_up(self) -> None:
        """Decode one token and forget it, as llama.cpp's server does: the first decode
        builds the graph and touches every weight page, which should not be paid by the
        first request's time to first token; nor should the tokenizer's tables."""
        bos = int(lc.llama_vocab_bos(lc.llama_model_get_vocab(self._model)))
        self.decode([(max(bos, 0), 0, 0, True)])
        lc.llama_memory_clear(self._mem, True)
        # Builds the special-token partitions (0.2 s for Gemma 3's vocabulary), which the
        # first prompt would otherwise wait for.
        for parse_special in (True, False):
            self.vocab.tokenize("", add_bos=False, parse_special=parse_special)

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

    def set_threads(self, threads: int) -> None:
        """CPU threads of the following decodes (one-token steps and prompt chunks)."""
        lc.llama_set_n_threads(self._ctx, threads, threads)

    @property
    def model(self) -> Any:
        """The native `llama_model *`; other contexts (embeddings) may share it until
        `close`."""
        return self._model

    def sample(self, sampler: Any, index: int) -> int:
        """Sample (and accept) a token from the logits of batch entry `index` with a
        `sampling.Sampler`."""
        return int(sampler.sample(self._ctx, index))

    def logits(self, index: int, count: int = 1) -> npt.NDArray[np.float32]:
        """Raw logits of `count` consecutive batch entries that asked for them, from
        entry `index` on, shape (count, n_vocab). A view: valid until the next decode."""
        ptr = lc.llama_get_logits_ith(self._ctx, index)
        if not ptr:
            raise LlamaError(f"no logits for batch entry {index}")
        # Output rows are stored contiguously in batch order (llama.h).
        return np.ctypeslib.as_array(ptr, shape=(count, self.n_vocab))

    def clear(self, seq: int) -> None:
        """Drop every cached position of one sequence."""
        lc.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def truncate(self, seq: int, keep: int) -> bool:
        """Drop positions >= keep of one sequence; False if the cache cannot do that."""
        return bool(lc.llama_memory_seq_rm(self._mem, seq, keep, -1))

    def pos_min(self, seq: int) -> int:
        """Smallest position the cache still holds for seq (-1 when empty)."""
        return int(lc.llama_memory_seq_pos_min(self._mem, seq))

    def save_seq(self, seq: int, path: str, tokens: list[int]) -> int:
        """Write one sequence's KV state and its tokens to a file; bytes written (0: failed)."""
        arr = (lc.llama_token * len(tokens))(*tokens)
        return int(lc.llama_state_seq_save_file(self._ctx, path.encode(), seq, arr, len(tokens)))

    def load_seq(self, seq: int, path: str) -> list[int] | None:
        """Load a file written by save_seq into seq; its tokens, or None if it failed."""
        capacity = self.context_per_slot
        arr = (lc.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        read = lc.llama_state_seq_load_file(
            self._ctx, path.encode(), seq, arr, capacity, ctypes.byref(count)
        )
        if read == 0:
            self.clear(seq)
            return None
        return list(arr[: count.value])

    def seq_state_size(self, seq: int) -> int:
        """Bytes `seq_state` would copy (llama.cpp sizes it by a dry run of the copy)."""
        return int(lc.llama_state_seq_get_size(self._ctx, seq))

    def seq_state(self, seq: int, size: int) -> npt.NDArray[np.uint8] | None:
        """One sequence's KV cache copied to host memory (`size` from seq_state_size);
        None if llama.cpp failed. The sequence itself is left as it was."""
        buf = np.empty(size, dtype=np.uint8)
        data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))
        written = int(lc.llama_state_seq_get_data(self._ctx, data, size, seq))
        return buf[:written] if written else None

    def set_seq_state(self, seq: int, state: npt.NDArray[np.uint8]) -> bool:
        """Replace seq's cache with a state `seq_state` copied (from any sequence of this
        context); False, with seq cleared, if llama.cpp refused it."""
        data = state.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))
        if lc.llama_state_seq_set_data(self._ctx, data, state.size, seq) == 0:
            self.clear(seq)
            return False
        return True

    def _kv_bytes(self) -> int:
        """Bytes of K and V cache for all slots (full-size SWA cache: every layer full)."""
        model = self._model
        arch = _meta(model, "general.architecture") or ""
        n_head = int(lc.llama_model_n_head(model)) or 1
        head = int(lc.llama_model_n_embd(model)) // n_head
        key = int(_meta(model, f"{arch}.attention.key_length") or head)
        value = int(_meta(model, f"{arch}.attention.value_length") or head)
        per_token = int(lc.llama_model_n_head_kv(model)) * (
            key * CACHE_TYPES[self.spec.type_k][1] + value * CACHE_TYPES[self.spec.type_v][1]
        )
        cells = self.spec.slots * self.context_per_slot
        return int(int(lc.llama_model_n_layer(model)) * cells * per_token)

    def close(self) -> None:
        lc.llama_batch_free(self._batch)
        lc.llama_free(self._ctx)
        lc.llama_model_free(self._model)
        lc.llama_backend_free()
