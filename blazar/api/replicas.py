"""What the controller and the engine supervisor say to each other about replicas.

Pure data: the controller decides from `ReplicaObservation`s and asks for replicas to
run a `LaunchSpec`; the supervisor owns the processes and hands each worker its
`EngineLaunch` document.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from enum import StrEnum
from typing import Literal

import pydantic

from blazar.api import kinds

# How launch documents are read: a field this version does not know is refused, not
# ignored (pydantic reads this from a stdlib dataclass's `__pydantic_config__`).
_STRICT = pydantic.ConfigDict(extra="forbid")


class ReplicaState(StrEnum):
    STARTING = "Starting"
    READY = "Ready"
    DRAINING = "Draining"
    STOPPING = "Stopping"
    FAILED = "Failed"


@dataclass(frozen=True)
class SpeculationLaunch:
    """A SpecPair resolved for one engine: what drafts, and when to switch it off."""

    __pydantic_config__ = _STRICT

    kind: Literal["ngram", "model"]
    max_draft_tokens: int
    disable_above_batch: int
    min_acceptance_rate: float
    # n-gram drafting: the length of the suffix looked up in the sequence.
    ngram_size: int | None = None
    # Draft-model drafting: the draft GGUF, and its modification time as its Model's
    # controller last read it (`LaunchSpec.model_mtime_ns`).
    draft_model_path: str | None = None
    draft_model_mtime_ns: int | None = None

    @classmethod
    def of_pair(
        cls,
        pair: kinds.SpecPairSpec,
        *,
        draft_model_path: str | None = None,
        draft_model_mtime_ns: int | None = None,
    ) -> SpeculationLaunch:
        """A SpecPair's settings as written (the API holds their defaults); a `model`
        pair with its draft Model's resolved file."""
        draft = pair.draft
        if isinstance(draft, kinds.NgramDraft):
            return cls(
                kind="ngram",
                max_draft_tokens=draft.max_draft_tokens,
                disable_above_batch=pair.disable_above_batch,
                min_acceptance_rate=pair.min_acceptance_rate,
                ngram_size=draft.ngram_size,
            )
        return cls(
            kind="model",
            max_draft_tokens=draft.max_draft_tokens,
            disable_above_batch=pair.disable_above_batch,
            min_acceptance_rate=pair.min_acceptance_rate,
            draft_model_path=draft_model_path,
            draft_model_mtime_ns=draft_model_mtime_ns,
        )


@dataclass(frozen=True)
class LaunchSpec:
    """Everything an engine replica is started with, as the worker reads it.

    The controller builds it from the Lane and its Model and SpecPair (which hold the
    defaults); the worker takes every setting from it and nowhere else. Two replicas
    with equal specs are interchangeable; a different `revision` means the replica
    must be replaced.
    """

    __pydantic_config__ = _STRICT

    model_path: str
    slots: int
    context_per_slot: int
    threads: int
    gpu_layers: int
    # KV cache element types (llama.cpp names: f16, q8_0, ...).
    type_k: str
    type_v: str
    # Save slot KV state on graceful stop and restore it on start (per replica dir).
    kv_persist: bool
    flash_attention: Literal["auto", "on", "off"]
    # Host memory for parked generations' KV caches, in MiB (kvCache.maxParkedMiB).
    max_parked_mib: int
    # Overrides the GGUF's template: a name (`text.NAMED_TEMPLATES`) or Jinja source.
    chat_template: str | None = None
    speculation: SpeculationLaunch | None = None
    # The model file's modification time as the Model's controller last read it: a
    # file replaced under the same path is another revision, so the Lane rolls onto it
    # rather than serve the old weights until its replicas happen to restart.
    model_mtime_ns: int | None = None

    @property
    def revision(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @classmethod
    def of_lane(
        cls,
        lane: kinds.LaneSpec,
        *,
        model_path: str,
        default_threads: int,
        chat_template: str | None = None,
        speculation: SpeculationLaunch | None = None,
        model_mtime_ns: int | None = None,
    ) -> LaunchSpec:
        """What a Lane's replicas run: its settings as written (the API holds their
        defaults), its Model's resolved file and template, its resolved SpecPair."""
        return cls(
            model_path=model_path,
            slots=lane.slots,
            context_per_slot=lane.context_per_slot,
            threads=lane.threads or default_threads,
            gpu_layers=lane.gpu_layers,
            type_k=lane.kv_cache.type_k,
            type_v=lane.kv_cache.type_v,
            kv_persist=lane.kv_cache.persist,
            flash_attention=lane.flash_attention,
            max_parked_mib=lane.kv_cache.max_parked_mib,
            chat_template=chat_template,
            speculation=speculation,
            model_mtime_ns=model_mtime_ns,
        )


@dataclass(frozen=True)
class EngineLaunch:
    """The launch document of one engine process: its replica's `LaunchSpec` and where
    this process lives. The supervisor writes it into the run directory; the worker
    (`python -m blazar.engine --launch FILE`) reads it and nothing else."""

    __pydantic_config__ = _STRICT

    spec: LaunchSpec
    # Unix socket the worker serves `blazar.engine.v1.Engine` on.
    socket: str
    # How long in-flight requests may finish after SIGTERM before they are cancelled.
    drain_grace_seconds: float
    # Where slot caches are saved and restored; None: not persisted (spec.kv_persist
    # off, or the directory could not be made).
    kv_dir: str | None = None
    # The worker exits at once if this is not its parent (it died before the start).
    parent_pid: int | None = None
    # One JSON object per log line (the supervisor reads them to explain an exit).
    log_json: bool = False
    # The table through which the engines of one daemon share the host's cores
    # (`blazar.engine.cpushare`); None: the worker always computes on spec.threads.
    cpu_share: str | None = None
    # The CPUs that table shares (`blazar.enginehost.cores.count`: affinity and cgroup
    # quota); None: the worker counts its own affinity.
    host_cpus: int | None = None

    def to_json(self) -> bytes:
        return _ENGINE_LAUNCH.dump_json(self, indent=2)

    @classmethod
    def from_json(cls, data: bytes | str) -> EngineLaunch:
        """Parse and validate a launch document; pydantic.ValidationError when invalid."""
        return _ENGINE_LAUNCH.validate_json(data, strict=True)


_ENGINE_LAUNCH = pydantic.TypeAdapter(EngineLaunch)


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
    # Why the last run exited, kept while its replacement runs (as `exit_code`).
    exit_reason: str = ""
    message: str = ""
    # The slots its engine was launched with: during a rollout of a `slots` change the
    # Lane's spec already says the new number while an old replica still runs the old.
    slots: int | None = None
    # The same of its context per slot: the Lane's may say more (or less) than it holds.
    context_per_slot: int | None = None
    # Liveness probes of a Ready replica missed in a row (0: its last one passed). One
    # miss takes it out of routing until a probe passes again, as a failed readiness
    # probe takes a Pod out of its Service; `supervisor.LIVENESS_FAILURES` kill it.
    missed_probes: int = 0
