"""Raw `llama_decode` steps of uneven speculative shapes against `batching.step_cost`.

No server, no Blazar loop: one llama.cpp context made as the engine makes it (one KV
stream per slot, 6 slots of 2,048 here), every slot holding 300 cached tokens, then
steps in which slot `s` decodes `shape[s]` tokens, every one with logits (a pending
token and its draft). llama.cpp splits such a batch into one forward pass per run of
consecutive slots and per draft length (`batching.passes`); this prints each shape's
median step beside what `batching.step_cost` models it to cost, in units of one row,
and the milliseconds per unit, which should stay about level down the table when the
model's constants (`batching.PASS_ROWS`, `REMAINDER_ROWS`, `SMALL_PASS`) fit this host.

    python bench/decode_passes.py [--threads 2] [--steps 10]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import llama_cpp as lc

from blazar.engine import batching

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rawllama

SLOTS = 6
CACHED = 300
# Tokens each slot decodes in one step (0: the slot is idle).
SHAPES = [
    (1, 0, 0, 0, 0, 0), (2, 0, 0, 0, 0, 0), (3, 0, 0, 0, 0, 0), (4, 0, 0, 0, 0, 0),
    (5, 0, 0, 0, 0, 0), (8, 0, 0, 0, 0, 0), (9, 0, 0, 0, 0, 0),
    (1, 1, 1, 1, 0, 0), (1, 1, 1, 1, 1, 1), (8, 8, 0, 0, 0, 0), (9, 9, 0, 0, 0, 0),
    (8, 8, 8, 0, 0, 0), (9, 9, 9, 0, 0, 0), (9, 9, 9, 9, 0, 0), (8, 8, 8, 8, 8, 0),
    (8, 8, 8, 8, 8, 8), (9, 9, 9, 9, 9, 9), (9, 9, 9, 9, 8, 8), (9, 8, 9, 8, 9, 9),
    (9, 8, 1, 8, 1, 1), (9, 9, 1, 9, 1, 1), (9, 9, 9, 1, 1, 1), (8, 8, 0, 8, 8, 0),
    (9, 9, 0, 9, 9, 0), (1, 0, 1, 0, 1, 1),
]  # fmt: skip


def main() -> int:
    args = rawllama.arguments(__doc__.splitlines()[0], steps=10)
    model, ctx = rawllama.open_context(
        args.model, threads=args.threads, sequences=SLOTS, context=2048
    )
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(512, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> float:
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        started = time.perf_counter()
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - started

    for seq in range(SLOTS):
        decode([(100 + j, j, seq, False) for j in range(CACHED)])
    print(f"{'tokens by slot':22} {'passes':14} {'ms':>7} {'units':>6} {'ms/unit':>8}")
    for shape in SHAPES:
        times = []
        for _ in range(args.steps):
            entries = [
                (100 + j, CACHED + j, seq, True) for seq, n in enumerate(shape) for j in range(n)
            ]
            times.append(decode(entries))
            for seq in range(SLOTS):
                lc.llama_memory_seq_rm(memory, seq, CACHED, -1)
        ms = statistics.median(times[2:]) * 1000
        counts = dict(enumerate(shape))
        units = batching.step_cost(counts)
        passes = "+".join(map(str, batching.passes(counts)))
        tokens = ",".join(map(str, shape))
        print(f"{tokens:22} {passes:14} {ms:7.1f} {units:6.1f} {ms / units:8.2f}")
    rawllama.close(model, ctx, batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
