"""Helpers the unit tests share: a hand-moved clock, a Model marked ready, and what
ListModels says of the bundled model's file."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from blazar._proto.v1 import inference_pb2
from blazar.api import conditions
from blazar.api.kinds import Kind, ModelStatus
from blazar.api.meta import ConditionStatus
from blazar.store.base import Store

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class Clock:
    """A clock the test moves by hand, for code that takes `Callable[[], datetime]`."""

    now: datetime = T0

    def __call__(self) -> datetime:
        return self.now

    def tick(self, seconds: float = 1) -> None:
        self.now += timedelta(seconds=seconds)


def mark_model_ready(
    store: Store,
    name: str,
    *,
    path: str,
    now: datetime,
    parameters: dict[str, str] | None = None,
    size_bytes: int | None = None,
    context_length: int | None = None,
    mtime_ns: int | None = None,
) -> None:
    """Give the stored Model `name` the status its controller gives a resolved file,
    observed at the Model's current generation (with `parameters` read from its
    header, for the fit ledger)."""
    model = store.get(Kind.MODEL, name)
    assert model is not None
    generation = model.metadata.generation or 0
    ready = conditions.set_condition(
        [], type="ModelReady", status=ConditionStatus.TRUE, reason="Resolved", message="ok",
        observed_generation=generation, now=now,
    )  # fmt: skip
    store.update_status(
        Kind.MODEL,
        name,
        ModelStatus(
            observed_generation=generation,
            conditions=ready,
            path=path,
            parameters=parameters or {},
            size_bytes=size_bytes,
            context_length=context_length,
            mtime_ns=mtime_ns,
        ),
    )


# What ListModels says of a Gemma 3 270M Q4_K_M file the controller inspected.
MODEL_FILE = inference_pb2.ModelFile(
    size_bytes=253_000_000,
    sha256="ab" * 32,
    modified=1_767_225_600,
    architecture="gemma3",
    name="Gemma 3 270m",
    parameter_size="268M",
    quantization="Q4_K_M",
    trained_context_length=32768,
    embedding_length=640,
    block_count=18,
    head_count=4,
    head_count_kv=1,
    has_chat_template=True,
)
