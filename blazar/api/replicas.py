"""What the controller and the engine supervisor say to each other about replicas.

Pure data: the controller decides from `ReplicaObservation`s and asks for replicas to
run a `LaunchSpec`; the supervisor (blazar.engine.supervisor) owns the processes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from enum import StrEnum


class ReplicaState(StrEnum):
    STARTING = "Starting"
    READY = "Ready"
    DRAINING = "Draining"
    STOPPING = "Stopping"
    FAILED = "Failed"


@dataclass(frozen=True)
class SpeculationLaunch:
    """A SpecPair resolved for one engine: what drafts, and when to switch it off."""

    kind: str  # "ngram" or "model"
    max_draft_tokens: int
    disable_above_batch: int
    min_acceptance_rate: float
    ngram_size: int = 3
    draft_model_path: str | None = None


@dataclass(frozen=True)
class LaunchSpec:
    """Everything an engine replica is started with. Two replicas with equal specs are
    interchangeable; a different `revision` means the replica must be replaced."""

    model_path: str
    slots: int
    context_per_slot: int
    threads: int
    gpu_layers: int
    chat_template: str | None = None
    type_k: str = "f16"
    type_v: str = "f16"
    # Save slot KV state on graceful stop and restore it on start (per replica dir).
    kv_persist: bool = False
    speculation: SpeculationLaunch | None = None

    @property
    def revision(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


@dataclass(frozen=True)
class ReplicaObservation:
    """A replica as the supervisor last saw it."""

    lane: str
    index: int
    state: ReplicaState
    revision: str
    socket: str
    pid: int | None = None
    restarts: int = 0
    started_at: datetime | None = None
    exited_at: datetime | None = None
    exit_code: int | None = None
    message: str = ""
