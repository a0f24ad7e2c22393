"""The hardware ceiling: raw `llama_decode` step time by sequences and logits rows.

No server, no Blazar: one llama.cpp context with 8 sequences, one token per sequence
per step, and logits requested for `rows` of them. It shows what batching and
speculation can gain on this model before any serving overhead. The rows with no
logits at all time the model without its output head (262k x 640 for Gemma 3), so
the difference to one row is what that head costs.

    python bench/decode_rows.py [--threads 2] [--steps 12]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import llama_cpp as lc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rawllama

# (sequences, logits rows, batch order); "shuffled" puts the sequences out of order,
# which is what reused slots produce when the loop does not sort its batch.
SHAPES = [
    (1, 0, "sorted"), (1, 1, "sorted"), (2, 2, "sorted"), (2, 1, "sorted"),
    (4, 4, "sorted"), (4, 1, "sorted"), (8, 8, "sorted"), (8, 1, "sorted"),
    (8, 0, "sorted"), (8, 8, "shuffled"),
]  # fmt: skip
SHUFFLED = [3, 0, 5, 1, 7, 2, 6, 4]


def main() -> int:
    args = rawllama.arguments(__doc__.splitlines()[0], steps=12)
    model, ctx = rawllama.open_context(args.model, threads=args.threads, sequences=8, context=512)
    batch = lc.llama_batch_init(512, 0, 8)
    pos = 0
    print(f"model {args.model.name}, {args.threads} threads")
    print("sequences  logits rows  order     ms/step  tokens/s")
    for seqs, rows, order in SHAPES:
        seq_ids = SHUFFLED[:seqs] if order == "shuffled" else list(range(seqs))
        times = []
        for _ in range(args.steps):
            batch.n_tokens = seqs
            for i, seq in enumerate(seq_ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = 100 + i, pos, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = int(i < rows)
            start = time.perf_counter()
            if lc.llama_decode(ctx, batch) != 0:
                print("llama_decode failed", file=sys.stderr)
                return 1
            times.append((time.perf_counter() - start) * 1000)
            pos += 1
        ms = statistics.median(times)
        print(f"{seqs:>9}  {rows:>11}  {order:<8}  {ms:7.1f}  {seqs * 1000 / ms:8.1f}")
    rawllama.close(model, ctx, batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
