"""The fit ledger's arithmetic: what one replica of a Lane needs in memory, and whether
the next replica fits in what the host has left.

Pure: no IO, no clock, no logging. The figures of the model come from its GGUF header
(`modelfile.read_gguf`, kept in the Model's status); the host's come from
`hostmemory` in the Lane reconciler, which acts on the decision.

One replica is one engine process (`blazar.engine.llama.open_model`). It needs:

- **weights**: the GGUF's tensor data, which llama.cpp maps from the file; every page
  is touched by the first decode (the output projection reads the whole vocabulary).
  On x86 with AVX2, llama.cpp 0.3.36 also copies the matrices of some types into
  interleaved layouts for its CPU kernels ("CPU_REPACK" in its load log): Q4_0, Q4_K and
  IQ4_NL matrices, the output projection among them (a tied one is the token
  embedding, kept mapped for the lookups as well). The copy is anonymous memory beside
  the mapped pages the load has read: 12.7 MiB of the bundled model (its Q4_K
  matrices), 143.8 MiB of its Q4_0 draft (every matrix), as the load logs say.
- **KV cache**: `n_layer x cells x n_head_kv x (key_length x bytes(typeK) + value_length
  x bytes(typeV))`. The engine keeps one stream per slot (`kv_unified` off) and
  full-size sliding-window caches (`swa_full`, which speculative rollback and prefix
  reuse need), so a Gemma 3 SWA layer holds as many cells as a global one; llama.cpp
  0.3.36 pads the context (`slots x contextPerSlot`) to a multiple of 256 cells and
  splits it evenly between the streams. llama.cpp clears the cache when it creates it,
  so all of it is resident from the start.
- **compute buffers**: the logits of the rows one step may ask for (`output_rows x
  n_vocab` floats, in the graph and again in the context's output buffer, which grows
  to that size when a step asks for that many rows), plus the activations of one
  512-token micro-batch (`N_UBATCH x n_embd` floats, four of them live at once), plus,
  without flash attention, the attention scores of a micro-batch against one slot's
  cells (`cells_per_slot x N_UBATCH x n_head` floats). Measured on the bundled model
  (llama.cpp's `compute buffer size` lines, slots 1 to 16, contexts 512 to 16384, flash
  attention auto and off): 66.6 to 83.5 MiB with flash attention, 201.8 MiB without it
  at 16,384 cells a slot; the rule gives 70.0 to 85.0 and 198.0 for that buffer, and
  counts the output buffer's logits rows (65 to 80 MiB) on top.
- **draft model** (a SpecPair of kind `model`): its own weights, f16 KV cache of the
  target's cells and compute buffer, in the same process; its output buffer holds one
  row per slot (a draft step asks for no more).
- **runtime**: the engine process itself (Python, gRPC, numpy, llama.cpp's code and
  tokenizer tables), measured as `RUNTIME_BYTES`.

A replica's host memory for parked generations (`kvCache.maxParkedMiB`) is a bound on
what preemption may copy, not memory the engine holds, and is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from blazar.api.replicas import LaunchSpec

MIB = 1024 * 1024
# ggml types whose matrices llama.cpp's CPU backend repacks (x86 with AVX2 and up, as
# its load log showed here). A build without these kernels copies nothing, and the
# estimate errs by the copies on the safe side.
GGML_Q4_0, GGML_Q4_K, GGML_IQ4_NL = 2, 12, 20
REPACKED_TYPES = frozenset({GGML_Q4_0, GGML_Q4_K, GGML_IQ4_NL})
# Bytes per KV cache element by llama.cpp type name (block size / elements per block).
CACHE_TYPE_BYTES: Mapping[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "iq4_nl": 18 / 32,
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
}
# llama.cpp pads a context to this many cells.
CONTEXT_PAD = 256
# Tokens per micro-batch (`blazar.engine.llama.N_BATCH`: the engine sets n_ubatch to it).
N_UBATCH = 512
# Logits rows per step beyond one per slot and draft (`llama.EXTRA_OUTPUT_ROWS`).
EXTRA_OUTPUT_ROWS = 64
# Activations of one micro-batch kept at once: the residual stream, its norm, and the
# two inputs of the operation at hand.
LIVE_ACTIVATIONS = 4
FLOAT_BYTES = 4
# The engine process without its model: Python with gRPC, numpy and llama-cpp-python
# loaded, llama.cpp's tokenizer caches, thread stacks. Measured on the bundled model:
# resident memory under load less the other terms was 120.0, 125.1 and 135.5 MiB at
# 1x1024, 4x2048 and 8x8192 (bench/memory_fit.py), rounded up from the median.
RUNTIME_BYTES = 128 * MIB


@dataclass(frozen=True)
class ModelShape:
    """The figures of a GGUF the estimate needs."""

    tensor_bytes: int
    n_layer: int
    n_head: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_embd: int
    n_vocab: int
    # Copies of matrices llama.cpp repacks for its CPU kernels (`repacked_bytes`).
    repacked_bytes: int = 0

    @classmethod
    def of_parameters(cls, params: Mapping[str, str], *, size_bytes: int) -> ModelShape | None:
        """From a Model's `status.parameters` (`modelfile.read_gguf`); None when a figure
        is missing. A status written before `tensor_bytes` was kept falls back to the
        file's size, a few MB more (the header)."""
        try:
            n_embd = int(params["embedding_length"])
            n_head = int(params["attention.head_count"])
            head = n_embd // max(n_head, 1)
            return cls(
                tensor_bytes=int(params.get("tensor_bytes", size_bytes)),
                n_layer=int(params["block_count"]),
                n_head=n_head,
                n_head_kv=int(params.get("attention.head_count_kv", n_head)),
                key_length=int(params.get("attention.key_length", head)),
                value_length=int(params.get("attention.value_length", head)),
                n_embd=n_embd,
                n_vocab=int(params["vocab_size"]),
                repacked_bytes=int(params.get("repacked_bytes", 0)),
            )
        except (KeyError, ValueError):
            return None


@dataclass(frozen=True)
class Estimate:
    """What one replica needs, in bytes, by part."""

    weights: int
    kv: int
    compute: int
    draft: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.draft + self.runtime


def repacked_bytes(tensors: Mapping[str, tuple[int, int]]) -> int:
    """Bytes of the matrices llama.cpp copies into repacked layouts, from a GGUF's tensor
    index (name -> (ggml type, bytes)).

    Every matrix of a repacked type, except the token embedding when the model has its
    own output projection: the embedding then serves only lookups, which read the
    mapped file. Without one, the output projection is the embedding, repacked for the
    matrix product (and kept mapped for the lookups)."""
    tied = "output.weight" not in tensors
    return sum(
        size
        for name, (ggml_type, size) in tensors.items()
        if ggml_type in REPACKED_TYPES
        and name.endswith(".weight")
        and (tied or name != "token_embd.weight")
    )


def cells(slots: int, context_per_slot: int) -> int:
    """KV cells of a context of `slots` streams: llama.cpp pads the whole context, then
    gives each stream an equal share."""
    padded = -(-slots * context_per_slot // CONTEXT_PAD) * CONTEXT_PAD
    return (padded // slots) * slots


def kv_bytes(shape: ModelShape, *, cells: int, type_k: str, type_v: str) -> int:
    per_cell = shape.n_head_kv * (
        shape.key_length * CACHE_TYPE_BYTES[type_k] + shape.value_length * CACHE_TYPE_BYTES[type_v]
    )
    return int(shape.n_layer * cells * per_cell)


def output_rows(slots: int, draft_tokens: int) -> int:
    """Rows of logits one step may ask for (`blazar.engine.llama.output_rows`)."""
    return min(N_UBATCH, slots * (1 + draft_tokens) + EXTRA_OUTPUT_ROWS)


def compute_bytes(
    shape: ModelShape,
    *,
    rows: int,
    cells_per_slot: int,
    flash_attention: bool,
    output_rows: int | None = None,
) -> int:
    """The graph's buffer for `rows` logits rows, and the context's output buffer for
    `output_rows` of them (None: as many)."""
    row = shape.n_vocab * FLOAT_BYTES
    activations = LIVE_ACTIVATIONS * N_UBATCH * shape.n_embd * FLOAT_BYTES
    scores = 0 if flash_attention else cells_per_slot * N_UBATCH * shape.n_head * FLOAT_BYTES
    held = rows if output_rows is None else output_rows
    return rows * row + activations + scores + held * row


def estimate(launch: LaunchSpec, shape: ModelShape, *, draft: ModelShape | None = None) -> Estimate:
    """What one replica running `launch` needs; `draft` is the SpecPair's draft model
    (None: none, or n-gram drafting, which needs no model)."""
    total_cells = cells(launch.slots, launch.context_per_slot)
    per_slot = total_cells // launch.slots
    # llama.cpp's flash attention "auto" is on for CPU; "off" is the only way to lose it.
    flash = launch.flash_attention != "off"
    spec = launch.speculation
    drafted = spec.max_draft_tokens if spec is not None else 0
    draft_bytes = 0
    if draft is not None:
        # The draft's own context: the target's cells, f16, no drafts of its own.
        draft_bytes = (
            draft.tensor_bytes
            + draft.repacked_bytes
            + kv_bytes(draft, cells=total_cells, type_k="f16", type_v="f16")
            + compute_bytes(
                draft,
                rows=output_rows(launch.slots, 0),
                cells_per_slot=per_slot,
                flash_attention=flash,
                output_rows=launch.slots,
            )
        )
    return Estimate(
        weights=shape.tensor_bytes + shape.repacked_bytes,
        kv=kv_bytes(shape, cells=total_cells, type_k=launch.type_k, type_v=launch.type_v),
        compute=compute_bytes(
            shape,
            rows=output_rows(launch.slots, drafted),
            cells_per_slot=per_slot,
            flash_attention=flash,
        ),
        draft=draft_bytes,
        runtime=RUNTIME_BYTES,
    )


@dataclass(frozen=True)
class Held:
    """A replica running or starting, as the ledger counts it."""

    estimate: int
    # Its resident memory (VmRSS) and the anonymous part of it (RssAnon); None when it
    # has no process or its /proc entry could not be read.
    resident: int | None = None
    anonymous: int | None = None

    @property
    def outstanding(self) -> int:
        """Bytes this replica holds that MemAvailable still counts as available.

        MemAvailable already leaves out the replica's anonymous pages (KV cache, buffers,
        heap). It still counts its mapped weights (page cache that could be dropped, and
        read back at every step) and what a starting replica has not allocated yet. So a
        replica holds the larger of its estimate and its resident memory, less the
        anonymous part that MemAvailable has taken off already."""
        return max(0, self.charged - (self.anonymous or 0))

    @property
    def charged(self) -> int:
        """Bytes this replica counts against a memory budget: the larger of its estimate
        and its resident memory (a replica that outgrew its estimate is charged what it
        holds)."""
        return max(self.estimate, self.resident or 0)


@dataclass(frozen=True)
class Fit:
    """Whether one more replica needing `need` bytes fits; `free` is what is left: the
    host's free memory, or what the budget has left when that is less."""

    fits: bool
    need: int
    free: int
    available: int
    outstanding: int
    # The host's total memory (MemTotal), when known.
    total: int | None = None
    # The memory budget (`serve --memory-budget`; None: none), and what replicas are
    # charged against it (0 without one).
    budget: int | None = None
    charged: int = 0
    # Of `charged`, what replicas of Lanes with `preload: true` are charged: the budget
    # never puts those to sleep, so it is not free for others while they are loaded.
    pinned: int = 0

    @property
    def over_budget(self) -> bool:
        """Whether it needs more than the whole memory budget."""
        return self.budget is not None and self.need > self.budget

    @property
    def budget_bound(self) -> bool:
        """Whether the budget, not the host, is what leaves too little."""
        return self.budget is not None and self.budget - self.charged == self.free

    @property
    def never(self) -> bool:
        """Whether no freeing of memory could make it fit: it needs more than the host
        has, or than the whole budget."""
        return self.over_budget or (self.total is not None and self.need > self.total)

    @property
    def held_by_preload(self) -> bool:
        """Whether it needs more than the budget leaves beside the preload Lanes: no
        eviction can make it fit while they are loaded."""
        return (
            self.budget is not None
            and not self.over_budget
            and self.need > self.budget - self.pinned
        )

    @property
    def blocked(self) -> bool:
        """Whether it cannot fit as the fleet is, whatever idle Lanes are put to sleep:
        its requests are refused rather than queued for memory that will not come."""
        return self.never or self.held_by_preload


def free_bytes(available: int, held: Iterable[Held]) -> tuple[int, int]:
    """(free, outstanding): MemAvailable less what the replicas hold beyond it."""
    outstanding = sum(h.outstanding for h in held)
    return available - outstanding, outstanding


def decide(
    need: int,
    *,
    available: int,
    held: Sequence[Held],
    total: int | None = None,
    budget: int | None = None,
    pinned: int = 0,
) -> Fit:
    """Whether `need` more bytes fit in what the host has free, and within `budget`
    (None: no budget) less what the replicas in `held` are charged; `pinned`: what
    of that the replicas of preload Lanes are charged."""
    free, outstanding = free_bytes(available, held)
    charged = 0
    if budget is not None:
        charged = sum(h.charged for h in held)
        free = min(free, budget - charged)
    return Fit(
        fits=need <= free,
        need=need,
        free=free,
        available=available,
        outstanding=outstanding,
        total=total,
        budget=budget,
        charged=charged,
        pinned=pinned if budget is not None else 0,
    )


def human(n: int) -> str:
    """Bytes as a person reads them: `1.5 GiB`, `512 MiB`, `-20.0 MiB`."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def shortfall_reason(fit: Fit) -> str:
    """The `Schedulable=False` reason of a replica that does not fit."""
    if fit.over_budget:
        return "ExceedsMemoryBudget"
    return "HeldByPreloadLanes" if fit.held_by_preload else "InsufficientMemory"


def shortfall_message(fit: Fit, *, index: int) -> str:
    if fit.over_budget and fit.budget is not None:
        return (
            f"Replica {index} needs {human(fit.need)} ({fit.need} bytes), more than the "
            f"whole memory budget of {human(fit.budget)} ({fit.budget} bytes; serve "
            "--memory-budget), so it can never fit as it is: lower slots, contextPerSlot "
            "or the cache types, or raise the budget."
        )
    if fit.held_by_preload and fit.budget is not None:
        return (
            f"Replica {index} needs {human(fit.need)} ({fit.need} bytes) but Lanes with "
            f"preload: true hold {human(fit.pinned)} of the memory budget of "
            f"{human(fit.budget)} ({fit.budget} bytes), which leaves "
            f"{human(fit.budget - fit.pinned)}, and the budget never puts them to sleep: "
            "it cannot start while they are loaded. Set preload: false on one of them, "
            "lower slots, contextPerSlot or the cache types, or raise the budget."
        )
    if fit.budget_bound and fit.budget is not None:
        return (
            f"Replica {index} needs {human(fit.need)} ({fit.need} bytes) but {human(fit.free)} "
            f"({fit.free} bytes) of the memory budget of {human(fit.budget)} ({fit.budget} "
            f"bytes) is free: running replicas hold {human(fit.charged)}. A request for this "
            "Lane puts idle Lanes to sleep to make room; it starts by itself once it fits."
        )
    said = (
        f"Replica {index} needs {human(fit.need)} ({fit.need} bytes) but {human(fit.free)} "
        f"({fit.free} bytes) is free: {human(fit.available)} available on the host, less "
        f"{human(fit.outstanding)} held by running replicas beyond that."
    )
    if fit.never and fit.total is not None:
        return (
            f"{said} That is more than the host's {human(fit.total)} in all, so it can never "
            "fit as it is: lower slots, contextPerSlot or the cache types."
        )
    return (
        f"{said} Lower slots, contextPerSlot or replicas, or free memory; the Lane starts "
        "by itself once it fits."
    )


def fits_message(need: int, *, free: int) -> str:
    return (
        f"Each replica needs {human(need)} ({need} bytes); {human(free)} ({free} bytes) "
        "is free for more."
    )
