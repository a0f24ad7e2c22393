"""Embeddings: a second llama context on the decode loop's model, owned by its own thread.

The embedding context is created by the embedding thread at its first request and
freed by that thread on `close`; no other thread touches it, and the decode loop's
context is never touched from here. Only the model, which llama.cpp treats as
read-only once loaded, is shared. So `close` must finish before the decode loop frees
the model: the service closes the embedder when it drains.

Mean pooling is done here rather than by llama.cpp's LLAMA_POOLING_TYPE_MEAN, which
gives the same vector (to float rounding) but needs the whole input in one physical
batch, and this llama.cpp computes the 262k-wide logits of every output token even in
embeddings mode: 1 GiB of scratch for a 500-token input. Decoding in chunks of
`CHUNK` tokens (the KV cache carries the causal context across chunks) and summing
the per-token embeddings bounds that at about `CHUNK` MiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as lc
import numpy as np
import structlog

from blazar.api import errors
from blazar.engine import llama

log = structlog.get_logger("blazar.engine.embedding")

# Tokens decoded per step; each costs 1 MiB of logits scratch (262k floats).
CHUNK = 64


@dataclass(frozen=True)
class Vector:
    values: list[float]
    # Tokens the input took (BOS included).
    tokens: int


@dataclass(frozen=True)
class _Work:
    inputs: list[list[int]]
    normalize: bool
    deliver: Callable[[list[Vector] | BaseException], None]
    # Set when the caller has gone: the work stops at its next chunk.
    cancelled: threading.Event = field(default_factory=threading.Event)


class _Cancelled(Exception):
    pass


_STOP = object()


class Embedder:
    """Mean-pooled embeddings of texts; `embed` from the event loop, `close` from any thread."""

    def __init__(
        self, *, model: Any, vocab: llama.Vocab, context_length: int, threads: int
    ) -> None:
        self._model = model
        self._vocab = vocab
        self.context_length = context_length
        self._threads = threads
        self.dimensions = int(lc.llama_model_n_embd(model))
        self._inbox: queue.Queue[_Work | object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="embed", daemon=True)
        self._lock = threading.Lock()
        self._closed = False
        self._started = False

    async def embed(self, texts: Sequence[str], *, normalize: bool) -> list[Vector]:
        """One vector per text, in order; ContextLengthExceeded names the first too long."""
        for i, text in enumerate(texts):
            # Checked on the text: an empty one still tokenizes to BOS.
            if not text:
                raise errors.InvalidRequest(f"Input {i} is empty.")
        inputs = await asyncio.to_thread(self._tokenize, texts)
        for i, tokens in enumerate(inputs):
            if len(tokens) > self.context_length:
                raise errors.ContextLengthExceeded(
                    f"Input {i} is {len(tokens)} tokens long, but this model embeds at most "
                    f"{self.context_length} tokens per input. Shorten or split it.",
                    metadata={
                        "prompt_tokens": str(len(tokens)),
                        "context_length": str(self.context_length),
                        "input": str(i),
                    },
                )
        aio = asyncio.get_running_loop()
        done: asyncio.Future[list[Vector]] = aio.create_future()

        def deliver(result: list[Vector] | BaseException) -> None:
            # RuntimeError: the event loop is closed, so nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                aio.call_soon_threadsafe(_settle, done, result)

        with self._lock:
            if self._closed:
                raise errors.Unavailable("The engine is draining.")
            if not self._started:
                self._thread.start()
                self._started = True
            work = _Work(inputs, normalize, deliver)
            self._inbox.put(work)
        try:
            return await done
        except asyncio.CancelledError:
            # The caller left: a long batch must not hold up the requests behind it.
            work.cancelled.set()
            raise

    def close(self) -> None:
        """Finish the request being computed, refuse the rest, free the context (blocks)."""
        with self._lock:
            self._closed = True
            started = self._started
            self._inbox.put(_STOP)
        if started:
            self._thread.join()

    def _tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._vocab.tokenize(t, add_bos=True, parse_special=False) for t in texts]

    # --- embedding thread only below ---

    def _run(self) -> None:
        ctx: Any = None
        batch: Any = None
        try:
            while True:
                item = self._inbox.get()
                if not isinstance(item, _Work):
                    return
                try:
                    if ctx is None:
                        ctx = self._open()
                        batch = lc.llama_batch_init(CHUNK, 0, 1)
                    vectors = [
                        self._one(ctx, batch, t, item.normalize, cancelled=item.cancelled)
                        for t in item.inputs
                    ]
                except _Cancelled:
                    log.info("embed_cancelled", inputs=len(item.inputs))
                except Exception as exc:
                    log.exception("embed_failed")
                    item.deliver(errors.BlazarError(f"Embedding failed: {exc}"))
                else:
                    item.deliver(vectors)
        finally:
            if batch is not None:
                lc.llama_batch_free(batch)
            if ctx is not None:
                lc.llama_free(ctx)
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Work):
                    item.deliver(errors.Unavailable("The engine is draining."))

    def _open(self) -> Any:
        params = lc.llama_context_default_params()
        params.n_ctx = self.context_length
        params.n_batch = CHUNK
        params.n_ubatch = CHUNK
        params.n_seq_max = 1
        params.embeddings = True
        params.pooling_type = lc.LLAMA_POOLING_TYPE_NONE  # per-token; pooled below
        params.n_threads = self._threads
        params.n_threads_batch = self._threads
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            raise llama.LlamaError("could not create the embedding context")
        log.info("embedding_context", context_length=self.context_length, dims=self.dimensions)
        return ctx

    def _one(
        self,
        ctx: Any,
        batch: Any,
        tokens: list[int],
        normalize: bool,
        *,
        cancelled: threading.Event,
    ) -> Vector:
        total = np.zeros(self.dimensions, dtype=np.float64)
        try:
            for start in range(0, len(tokens), CHUNK):
                if cancelled.is_set():
                    raise _Cancelled
                chunk = tokens[start : start + CHUNK]
                for i, token in enumerate(chunk):
                    batch.token[i] = token
                    batch.pos[i] = start + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = True  # every token's embedding is pooled
                batch.n_tokens = len(chunk)
                rc = lc.llama_decode(ctx, batch)
                if rc != 0:
                    raise llama.LlamaError(f"llama_decode returned {rc}")
                rows = lc.llama_get_embeddings(ctx)
                if not rows:
                    raise llama.LlamaError("no embeddings after decode")
                total += np.ctypeslib.as_array(rows, shape=(len(chunk), self.dimensions)).sum(
                    axis=0
                )
        finally:
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        values = total / len(tokens)
        if normalize:
            norm = float(np.linalg.norm(values))
            if norm > 0.0:
                values = values / norm
        return Vector(values=values.tolist(), tokens=len(tokens))


def _settle(future: asyncio.Future[list[Vector]], result: list[Vector] | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
