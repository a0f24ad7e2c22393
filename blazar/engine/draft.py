"""A draft model for speculative decoding, on llama-cpp-python's low-level API.

`LlamaDraftRunner` is the `speculation.DraftModel` of a `kind: model` SpecPair: its own
llama model and context (one sequence per target slot, separate KV streams), greedy
drafting, all sequences drafted together one batch per draft token, and at most one
chunk of catch-up per step. Only the decode thread may call it, from `load` to `close`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp as lc

from blazar.api import replicas
from blazar.engine import llama, speculation


def draft_spec(
    target: replicas.LaunchSpec, *, model_path: str, context_per_slot: int
) -> replicas.LaunchSpec:
    """The draft model's launch: the target's slots, threads and llama.cpp settings,
    its own file, an f16 cache of `context_per_slot` (at least the target's, so a
    draft never runs out of positions first), nothing of the target's own."""
    return dataclasses.replace(
        target,
        model_path=model_path,
        context_per_slot=context_per_slot,
        type_k="f16",
        type_v="f16",
        kv_persist=False,
        chat_template=None,
        speculation=None,
    )


@dataclass(frozen=True)
class DraftOptions:
    # The draft model's launch (`draft_spec`).
    spec: replicas.LaunchSpec
    n_batch: int = llama.N_BATCH
    # Tokens one `propose` may decode to catch sequences up (None: n_batch). Drafting
    # sequences decode, so the loop passes its cap on prompt tokens beside decoding.
    catch_up_tokens: int | None = None


class LlamaDraftRunner:
    """Greedy drafts from a small model whose vocabulary matches the target's.

    Per sequence it remembers which tokens its KV cache holds (`cached_tokens`), and
    updates that record only after the cache changed. Each `propose` keeps the common
    prefix with the tokens it is given, removes the rest with `llama_memory_seq_rm`
    (rejected drafts of the last step, or a reused slot), decodes what is missing,
    then drafts: so the loop never tells it what was accepted.

    Catching up costs at most one chunk (`catch_up_tokens`, all sequences together) per
    `propose`, so a draft model keeps the loop's chunked-prefill promise: a fresh long
    prompt, prefilled into the target chunk by chunk, is not then prefilled into the
    draft in one go while every other stream waits. What does not fit is carried over:
    a sequence that is not caught up gets no draft this step (it decodes plainly) and
    continues catching up at the next call. Sequences that lack least go first, so
    streams that are drafting already (one or two new tokens per step) keep drafting
    while a long prompt catches up in the rest of the chunk.

    Why not catch up alongside the target's own prefill chunks: the loop would have
    to feed the drafter its prompt chunks (a second way to fill the same cache, next
    to the catch-up that generated tokens, rolled-back drafts, reused and restored
    slots need anyway), and it would prefill sequences the policy never lets draft.
    Bounding the work here keeps the `DraftModel` contract as it is and costs each
    step at most one draft chunk either way; the price is that a long prompt starts
    drafting a few steps (its length / chunk) after its first token.
    """

    def __init__(self, model: Any, ctx: Any, options: DraftOptions) -> None:
        self._model = model
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(options.n_batch, 0, options.spec.slots)
        self._greedy = lc.llama_sampler_init_greedy()
        self._cached: dict[int, list[int]] = {}
        self.options = options
        self.vocab = llama.Vocab(lc.llama_model_get_vocab(model))
        self.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model)))
        self.context_per_slot = int(lc.llama_n_ctx_seq(ctx))

    @classmethod
    def load(cls, options: DraftOptions) -> LlamaDraftRunner:
        model, ctx = llama.open_model(
            options.spec,
            n_batch=options.n_batch,
            # One logits row per sequence per decode: the last caught-up token or a draft.
            n_outputs=options.spec.slots,
        )
        return cls(model, ctx, options)

    def cached_tokens(self, seq: int) -> tuple[int, ...]:
        """The tokens the draft's KV cache holds for seq, position by position."""
        return tuple(self._cached.get(seq, ()))

    def propose(self, requests: Sequence[speculation.DraftRequest]) -> dict[int, tuple[int, ...]]:
        budget: dict[int, int] = {}
        lacking: list[tuple[int, Sequence[int]]] = []  # (seq, tokens) to catch up
        for req in requests:
            k = min(req.max_tokens, self.context_per_slot - len(req.tokens))
            if k <= 0 or not req.tokens:
                continue
            self._trim(req.seq, req.tokens)
            budget[req.seq] = k
            lacking.append((req.seq, req.tokens))
        drafts = {seq: [token] for seq, token in self._catch_up(lacking).items()}
        # Then one batch per further draft token, for every sequence still drafting.
        while True:
            rows = [
                (d[-1], len(self._cached[seq]), seq, True)
                for seq, d in drafts.items()
                if len(d) < budget[seq] and not self.vocab.is_eog(d[-1])
            ]
            if not rows:
                break
            self._decode(rows)
            for i, (tok, _, seq, _) in enumerate(rows):
                self._cached[seq].append(tok)
                drafts[seq].append(self._sample(i))
        return {seq: tuple(d) for seq, d in drafts.items()}

    def set_threads(self, threads: int) -> None:
        """CPU threads of the draft model's following decodes."""
        lc.llama_set_n_threads(self._ctx, threads, threads)

    def release(self, seq: int) -> None:
        lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._cached.pop(seq, None)

    def close(self) -> None:
        lc.llama_sampler_free(self._greedy)
        lc.llama_batch_free(self._batch)
        lc.llama_free(self._ctx)
        lc.llama_model_free(self._model)

    def _trim(self, seq: int, tokens: Sequence[int]) -> None:
        """Drop what the cache holds past its common prefix with tokens, and always
        the last of tokens: re-decoding it gives the logits of the first draft."""
        cached = self._cached.setdefault(seq, [])
        keep = min(speculation.common_prefix(cached, tokens), len(tokens) - 1)
        if keep >= len(cached):
            return
        if not lc.llama_memory_seq_rm(self._mem, seq, keep, -1):
            # A cache that cannot cut a sequence short (recurrent memory) starts over.
            lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
            keep = 0
        del cached[keep:]

    def _catch_up(self, lacking: Sequence[tuple[int, Sequence[int]]]) -> dict[int, int]:
        """Decode up to one chunk of missing tokens in one batch, shortest lack first; the
        first draft token of each sequence whose last token was among them."""
        entries: list[tuple[int, int, int, bool]] = []
        fed: list[tuple[int, Sequence[int]]] = []
        last: dict[int, int] = {}  # seq -> its row holding the sequence's last token
        room = min(self.options.catch_up_tokens or self.options.n_batch, self.options.n_batch)
        for seq, tokens in sorted(lacking, key=lambda r: len(r[1]) - len(self._cached[r[0]])):
            start = len(self._cached[seq])
            end = min(len(tokens), start + room)
            if end <= start:
                break  # the chunk is full
            entries.extend((tokens[p], p, seq, p == len(tokens) - 1) for p in range(start, end))
            fed.append((seq, tokens[start:end]))
            if end == len(tokens):
                last[seq] = len(entries) - 1
            room -= end - start
        if not entries:
            return {}
        self._decode(entries)
        for seq, part in fed:
            self._cached[seq].extend(part)
        return {seq: self._sample(row) for seq, row in last.items()}

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
