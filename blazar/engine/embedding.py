"""Embeddings: a second llama context on the decode loop's model, owned by its own thread.

The embedding context is created by the embedding thread at its first request and
freed by that thread on `close`; no other thread touches it, and the decode loop's
context is never touched from here. Only the model, which llama.cpp treats as
read-only once loaded, is shared. So `close` must finish before the decode loop frees
the model: the service closes the embedder when it drains.

Mean pooling is done here rather than by llama.cpp's LLAMA_POOLING_TYPE_MEAN, which
gives the same vector (to float rounding) but needs the whole input in one physical
batch. Decoding in chunks of `CHUNK` tokens (the KV cache carries the causal context
across chunks) and summing the per-token embeddings bounds the scratch memory.

llama.cpp builds the output head into every graph, embeddings mode included, and the
head (262k x 640 for Gemma 3) costs more than the rest of the model. `_HeadSkip`
stops each decode right after the embeddings node, so the head is never computed:
the vectors are bit-identical, and an input embeds at about prefill speed.

Requests take turns input by input (not request by request), so a request with
thousands of inputs delays a one-input request by at most one input.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
import structlog

from blazar.api import errors
from blazar.engine import llama, text
from blazar.rpc import limits

log = structlog.get_logger("blazar.engine.embedding")

# Tokens decoded per step; each reserves 1 MiB of logits scratch (262k floats).
CHUNK = 64

# Per request, as OpenAI's embeddings endpoint limits it.
MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 300_000
# A text longer than this is first bounded by its bytes (`_tokenize`); a shorter one
# tokenizes in microseconds, less than finding the bound the first time.
UNTOKENIZED_CHECK_CHARS = 2_048
# The vectors of one request travel in one gRPC message to the data plane and on to the
# shim or a client (`limits.MAX_ANSWER_BYTES`): 1,700 inputs of 640 dimensions were
# embedded for 43 s and then refused on the way back. Fewer inputs per request are taken
# for wider vectors (a vector costs 4 bytes a dimension, plus its framing), checked
# before any work.
_VECTOR_FRAMING_BYTES = 24


def max_inputs_for(dimensions: int) -> int:
    """How many vectors of `dimensions` fit one response, at most `MAX_INPUTS`."""
    vector_bytes = 4 * dimensions + _VECTOR_FRAMING_BYTES
    return max(1, min(MAX_INPUTS, limits.MAX_ANSWER_BYTES // vector_bytes))


# The graph node llama.cpp names the embeddings it returns (per token with pooling
# NONE); the output head comes after it.
_EMBEDDINGS_NODE = b"result_embd_pooled"


def shaped(values: np.ndarray, *, normalize: bool, dimensions: int | None) -> np.ndarray:
    """A pooled vector as the request asks for it: with `dimensions`, its first that
    many values scaled to unit length (how OpenAI's text-embedding-3 models and Ollama
    shorten an embedding); else the whole vector, at unit length when `normalize`. A
    zero vector stays zero."""
    if dimensions is not None:
        values = values[:dimensions]
        normalize = True
    if normalize:
        norm = float(np.linalg.norm(values))
        if norm > 0.0:
            values = values / norm
    return values


@dataclass(frozen=True)
class Vector:
    values: list[float]
    # Tokens the input took (BOS included).
    tokens: int


@dataclass
class _Work:
    inputs: list[list[int]]
    normalize: bool
    dimensions: int | None
    deliver: Callable[[list[Vector] | BaseException], None]
    # Set when the caller has gone: the work stops at its next chunk.
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Filled input by input by the embedding thread.
    vectors: list[Vector] = field(default_factory=list)


class _Cancelled(Exception):
    pass


_STOP = object()


class Embedder:
    """Mean-pooled embeddings of texts; `embed` from the event loop, `close` from any thread."""

    def __init__(
        self,
        *,
        model: Any,
        vocab: llama.Vocab,
        context_length: int,
        threads: int,
        max_inputs: int = MAX_INPUTS,
        max_total_tokens: int = MAX_TOTAL_TOKENS,
        skip_output_head: bool = True,
    ) -> None:
        self._model = model
        self._vocab = vocab
        self.context_length = context_length
        self.max_total_tokens = max_total_tokens
        self._threads = threads
        self.dimensions = int(lc.llama_model_n_embd(model))
        self.max_inputs = min(max_inputs, max_inputs_for(self.dimensions))
        self._inbox: queue.Queue[_Work | object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="embed", daemon=True)
        self._lock = threading.Lock()
        self._closed = False
        self._started = False
        # Held here for the context's lifetime: llama.cpp keeps only a pointer to it.
        self._head_skip = _HeadSkip.create() if skip_output_head else _HeadSkip(None)
        self._unfinished = 0  # inputs accepted and not yet embedded (under _lock)

    @property
    def skips_output_head(self) -> bool:
        return self._head_skip.callback is not None

    @property
    def heads_skipped(self) -> int:
        """Decodes that stopped before the output head (read after `close`)."""
        return self._head_skip.stops

    @property
    def unfinished_inputs(self) -> int:
        """Inputs accepted and not yet embedded, over all requests."""
        with self._lock:
            return self._unfinished

    async def embed(
        self,
        texts: Sequence[str],
        *,
        normalize: bool,
        dimensions: int | None = None,
        context_limit: int | None = None,
    ) -> list[Vector]:
        """One vector per text, in order (see `shaped` for `normalize` and
        `dimensions`); ContextLengthExceeded names the first text too long for the
        context, or for the smaller one the request asked for (`context_limit`)."""
        if dimensions is not None and not 1 <= dimensions <= self.dimensions:
            raise errors.InvalidRequest(
                f"'dimensions' is {dimensions}; this model's embeddings have "
                f"{self.dimensions} values, so give 1 to {self.dimensions}, or none for all.",
                metadata={errors.FIELD_KEY: "dimensions", "dimensions": str(self.dimensions)},
            )
        if len(texts) > self.max_inputs:
            raise errors.InvalidRequest(
                f"The request has {len(texts)} inputs; at most {self.max_inputs} are embedded "
                f"per request (with this model's {self.dimensions}-dimension vectors, that many "
                "fill one response). Split it into several requests.",
                metadata={errors.FIELD_KEY: "inputs", "inputs": str(len(texts))},
            )
        for i, item in enumerate(texts):
            # Checked on the text: an empty one still tokenizes to BOS.
            if not item:
                raise errors.InvalidRequest(f"Input {i} is empty.")
        # An input too long on its own is named first: more requests would not help it.
        limit = text.context_limit(self.context_length, context_limit)
        inputs = await asyncio.to_thread(self._tokenize, texts, limit)
        total = sum(len(tokens) for tokens in inputs)
        if total > self.max_total_tokens:
            raise errors.InvalidRequest(
                f"The inputs are {total} tokens together; at most {self.max_total_tokens} are "
                "embedded per request. Split it into several requests.",
                metadata={errors.FIELD_KEY: "inputs", "prompt_tokens": str(total)},
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
            work = _Work(inputs, normalize, dimensions, deliver)
            self._unfinished += len(inputs)
            self._inbox.put(work)
        try:
            return await done
        except asyncio.CancelledError:
            # The caller left: a long batch must not hold up the requests behind it.
            work.cancelled.set()
            raise

    def close(self) -> None:
        """Finish the input being computed, refuse the rest, free the context (blocks)."""
        with self._lock:
            self._closed = True
            started = self._started
            self._inbox.put(_STOP)
        if started:
            self._thread.join()

    def _tokenize(self, texts: Sequence[str], limit: int) -> list[list[int]]:
        """Each text's tokens, BOS first; ContextLengthExceeded names the first text
        longer than `limit` (the context, or less). Tokenizing costs about 1 us a byte
        and is not stopped by a caller who leaves, so a text too long in bytes to fit is
        refused before it is tokenized, its `prompt_tokens` a lower bound (as a
        generation's prompt is)."""
        inputs = []
        for i, item in enumerate(texts):
            if len(item) > UNTOKENIZED_CHECK_CHARS:
                least = text.fewest_tokens(item, self._vocab.longest_piece)
                if least > limit:
                    raise self._too_long(i, least, limit=limit, at_least=True)
            tokens = self._vocab.tokenize(item, add_bos=True, parse_special=False)
            if len(tokens) > limit:
                raise self._too_long(i, len(tokens), limit=limit, at_least=False)
            inputs.append(tokens)
        return inputs

    def _too_long(
        self, index: int, tokens: int, *, limit: int, at_least: bool
    ) -> errors.ContextLengthExceeded:
        metadata = {
            "prompt_tokens": str(tokens),
            "context_length": str(limit),
            "input": str(index),
        }
        if at_least:
            metadata[errors.PROMPT_TOKENS_AT_LEAST_KEY] = "true"
        some = "at least " if at_least else ""
        if limit < self.context_length:
            metadata[errors.CONTEXT_LIMIT_KEY] = str(limit)
            why = f"the request asked for a context of {limit} tokens (context_limit)"
        else:
            why = f"this model embeds at most {limit} tokens per input"
        return errors.ContextLengthExceeded(
            f"Input {index} is {some}{tokens} tokens long, but {why}. Shorten or split it.",
            metadata=metadata,
        )

    # --- embedding thread only below ---

    def _run(self) -> None:
        ctx: Any = None
        batch: Any = None
        turns: deque[_Work] = deque()
        try:
            while True:
                if self._take(turns, block=not turns):
                    return
                work = turns.popleft()
                try:
                    if ctx is None:
                        ctx = self._open()
                        batch = lc.llama_batch_init(CHUNK, 0, 1)
                    tokens = work.inputs[len(work.vectors)]
                    work.vectors.append(
                        self._one(
                            ctx,
                            batch,
                            tokens,
                            work.normalize,
                            dimensions=work.dimensions,
                            cancelled=work.cancelled,
                        )
                    )
                except _Cancelled:
                    log.info("embed_cancelled", inputs=len(work.inputs))
                    self._forget(work)
                except Exception as exc:
                    log.exception("embed_failed")
                    self._forget(work)
                    work.deliver(errors.BlazarError(f"Embedding failed: {exc}"))
                else:
                    with self._lock:
                        self._unfinished -= 1
                    if len(work.vectors) == len(work.inputs):
                        work.deliver(work.vectors)
                    else:
                        turns.append(work)  # its next input after the others' next ones
        finally:
            # Whatever ended this thread, later calls must be refused, not queued unread.
            with self._lock:
                self._closed = True
            if batch is not None:
                lc.llama_batch_free(batch)
            if ctx is not None:
                lc.llama_free(ctx)
            self._take(turns, block=False)
            for work in turns:
                self._forget(work)
                work.deliver(errors.Unavailable("The engine is draining."))

    def _forget(self, work: _Work) -> None:
        with self._lock:
            self._unfinished -= len(work.inputs) - len(work.vectors)

    def _take(self, turns: deque[_Work], *, block: bool) -> bool:
        """Move queued work to the back of `turns`; True once `close` was called."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return False
            if not isinstance(item, _Work):
                return True
            turns.append(item)
            block = False

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
        if self._head_skip.callback is not None:
            params.cb_eval = self._head_skip.callback
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            raise llama.LlamaError("could not create the embedding context")
        log.info(
            "embedding_context",
            context_length=self.context_length,
            dims=self.dimensions,
            skips_output_head=self.skips_output_head,
        )
        return ctx

    def _one(
        self,
        ctx: Any,
        batch: Any,
        tokens: list[int],
        normalize: bool,
        *,
        dimensions: int | None,
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
        values = shaped(total / len(tokens), normalize=normalize, dimensions=dimensions)
        return Vector(values=values.tolist(), tokens=len(tokens))


class _HeadSkip:
    """A graph-evaluation callback that ends a decode once the embeddings are computed.

    llama.cpp asks the callback, node by node, whether it wants to see a node; it then
    computes up to that node, shows it, and stops the graph if the callback returns
    False. Asking for the embeddings node and returning False there skips the output
    head. Found by name, so a llama.cpp or architecture without that node simply
    computes the whole graph: slower, never different. Returning False ends only the
    current split of ggml's scheduler: on CPU the graph is one split, but with layers
    on a GPU later splits (the head among them) may still run, and `stops` then
    overstates what was saved.
    """

    def __init__(self, callback: Any) -> None:
        self.callback = callback
        self.stops = 0  # written by the embedding thread only

    @classmethod
    def create(cls) -> _HeadSkip:
        skip = cls(None)
        name_of = _tensor_name_function()
        if name_of is None:
            return skip

        def stop_after_embeddings(tensor: int, ask: bool, _user_data: int) -> bool:
            is_embeddings = name_of(tensor) == _EMBEDDINGS_NODE
            if ask:
                return is_embeddings
            if is_embeddings:
                skip.stops += 1
            return not is_embeddings

        skip.callback = lc.ggml_backend_sched_eval_callback(stop_after_embeddings)
        return skip


def _tensor_name_function() -> Callable[[int], bytes | None] | None:
    """ggml's `ggml_get_name`, from the ggml library llama-cpp-python loaded; None if absent."""
    lib_dir = Path(lc.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        path = lib_dir / name
        if not path.exists():
            continue
        try:
            get_name = ctypes.CDLL(str(path)).ggml_get_name
        except (OSError, AttributeError):
            continue
        get_name.restype = ctypes.c_char_p
        get_name.argtypes = [ctypes.c_void_p]
        return get_name
    log.warning("ggml_get_name_unavailable", lib_dir=str(lib_dir))
    return None


def _settle(future: asyncio.Future[list[Vector]], result: list[Vector] | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
