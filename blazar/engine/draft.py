"""A draft model for speculative decoding, on llama-cpp-python's low-level API.

`LlamaDraftRunner` is the `speculation.DraftModel` of a `kind: model` SpecPair: its own
llama model and context (one sequence per target slot, separate KV streams), greedy
drafting, all sequences drafted together one batch per draft token. Only the decode
thread may call it, from `load` to `close`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp as lc

from blazar.engine import llama, speculation


@dataclass(frozen=True)
class DraftOptions:
    model_path: str
    slots: int
    # At least the target's, so a draft never runs out of positions first.
    context_per_slot: int
    threads: int
    gpu_layers: int = 0
    n_batch: int = 512


class LlamaDraftRunner:
    """Greedy drafts from a small model whose vocabulary matches the target's.

    Per sequence it remembers which tokens its KV cache holds. Each `propose` keeps
    the common prefix with the tokens it is given, removes the rest with
    `llama_memory_seq_rm` (rejected drafts of the last step, or a reused slot), decodes
    what is missing, then drafts: so the loop never tells it what was accepted.
    """

    def __init__(self, model: Any, ctx: Any, options: DraftOptions) -> None:
        self._model = model
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(options.n_batch, 0, options.slots)
        self._greedy = lc.llama_sampler_init_greedy()
        self._cached: dict[int, list[int]] = {}
        self.options = options
        self.vocab = llama.Vocab(lc.llama_model_get_vocab(model))
        self.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model)))
        self.context_per_slot = int(lc.llama_n_ctx_seq(ctx))

    @classmethod
    def load(cls, options: DraftOptions) -> LlamaDraftRunner:
        model, ctx = llama.open_model(
            options.model_path,
            gpu_layers=options.gpu_layers,
            slots=options.slots,
            context_per_slot=options.context_per_slot,
            n_batch=options.n_batch,
            # One logits row per sequence per decode: the last caught-up token or a draft.
            n_outputs=options.slots,
            threads=options.threads,
        )
        return cls(model, ctx, options)

    def cached_tokens(self, seq: int) -> tuple[int, ...]:
        """The tokens the draft's KV cache holds for seq, position by position."""
        return tuple(self._cached.get(seq, ()))

    def propose(self, requests: Sequence[speculation.DraftRequest]) -> dict[int, tuple[int, ...]]:
        drafts: dict[int, list[int]] = {}
        budget: dict[int, int] = {}
        catch_up: list[tuple[int, int, int]] = []  # (token, position, seq)
        for req in requests:
            k = min(req.max_tokens, self.context_per_slot - len(req.tokens))
            if k <= 0 or not req.tokens:
                continue
            cached = self._cached.setdefault(req.seq, [])
            # Re-decode at least the last token: its logits give the first draft.
            keep = min(speculation.common_prefix(cached, req.tokens), len(req.tokens) - 1)
            if keep < len(cached):
                lc.llama_memory_seq_rm(self._mem, req.seq, keep, -1)
                del cached[keep:]
            catch_up.extend((req.tokens[p], p, req.seq) for p in range(keep, len(req.tokens)))
            cached.extend(req.tokens[keep:])
            drafts[req.seq] = []
            budget[req.seq] = k
        # Prefill what each draft sequence lacks, n_batch rows at a time; a sequence's
        # first draft comes from the chunk that holds its last token.
        for start in range(0, len(catch_up), self.options.n_batch):
            chunk = catch_up[start : start + self.options.n_batch]
            last = {
                seq: i for i, (_, pos, seq) in enumerate(chunk) if pos == len(self._cached[seq]) - 1
            }
            self._decode(
                [(tok, pos, seq, last.get(seq) == i) for i, (tok, pos, seq) in enumerate(chunk)]
            )
            for seq, row in last.items():
                drafts[seq].append(self._sample(row))
        # Then one batch per further draft token, for every sequence still drafting.
        while True:
            rows = [
                (d[-1], len(self._cached[seq]), seq, True)
                for seq, d in drafts.items()
                if d and len(d) < budget[seq] and not self.vocab.is_eog(d[-1])
            ]
            if not rows:
                break
            self._decode(rows)
            for i, (tok, _, seq, _) in enumerate(rows):
                self._cached[seq].append(tok)
                drafts[seq].append(self._sample(i))
        return {seq: tuple(d) for seq, d in drafts.items()}

    def release(self, seq: int) -> None:
        lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._cached.pop(seq, None)

    def close(self) -> None:
        lc.llama_sampler_free(self._greedy)
        lc.llama_batch_free(self._batch)
        lc.llama_free(self._ctx)
        lc.llama_model_free(self._model)

    def _decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        b = self._batch
        for n, (token, pos, seq, logits) in enumerate(entries):
            b.token[n] = token
            b.pos[n] = pos
            b.n_seq_id[n] = 1
            b.seq_id[n][0] = seq
            b.logits[n] = logits
        b.n_tokens = len(entries)
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise llama.LlamaError(f"draft llama_decode returned {rc}")

    def _sample(self, row: int) -> int:
        return int(lc.llama_sampler_sample(self._greedy, self._ctx, row))
