"""Engine health on /metrics: each ready replica's Health, polled into gauges.

The supervisor knows which replicas are ready and where their sockets are; every
`interval` seconds the monitor asks each of them for its Health and publishes what
an operator needs to see a lane's state without a debugger: slots busy and free,
tokens held in the KV cache, the KV cache's size, the worker's resident memory, and
whether its speculation still works (a failed drafter leaves a slower replica).
A replica that stops being ready, or does not answer in time, loses its series
rather than keeping a stale value.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from prometheus_client import Gauge

from blazar._proto.engine.v1 import engine_pb2
from blazar.api.replicas import ReplicaObservation, ReplicaState
from blazar.enginehost.client import EngineClient, EnginePool

log = structlog.get_logger("blazar.enginehost.monitor")

DEFAULT_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 2.0

SLOTS = Gauge(
    "blazar_engine_slots",
    "Slots of a ready engine replica, by state.",
    ["lane", "replica", "state"],
)
CACHED_TOKENS = Gauge(
    "blazar_engine_cached_tokens",
    "Tokens held in a ready replica's KV cache, all slots together.",
    ["lane", "replica"],
)
KV_BYTES = Gauge(
    "blazar_engine_kv_bytes", "KV cache allocated by a ready replica.", ["lane", "replica"]
)
SPECULATION_FAILED = Gauge(
    "blazar_engine_speculation_failed",
    "1 when a ready replica's drafter failed and it decodes without speculation from "
    "then on, 0 while speculation works; only replicas with a SpecPair.",
    ["lane", "replica"],
)
MEMORY_BYTES = Gauge(
    "blazar_engine_memory_bytes",
    "Resident memory of a ready replica's worker process.",
    ["lane", "replica"],
)


@dataclass(frozen=True)
class Sample:
    """One replica's Health, as published."""

    lane: str
    replica: int
    busy: int
    free: int
    cached_tokens: int
    kv_bytes: int
    memory_bytes: int
    # None: the replica has no SpecPair.
    speculation_failed: bool | None = None

    @classmethod
    def of(cls, lane: str, replica: int, health: engine_pb2.HealthResponse) -> Sample:
        busy = sum(1 for s in health.slots if s.busy)
        return cls(
            lane=lane,
            replica=replica,
            busy=busy,
            free=len(health.slots) - busy,
            cached_tokens=sum(s.cached_tokens for s in health.slots),
            kv_bytes=health.kv_bytes,
            memory_bytes=health.memory_bytes,
            speculation_failed=(
                bool(health.speculation.failure) if health.speculation.kind else None
            ),
        )


@dataclass
class Publisher:
    """Sets the gauges to a round of samples and removes the series of replicas that
    are no longer in it."""

    _shown: set[tuple[str, str]] = field(default_factory=set)

    def publish(self, samples: Iterable[Sample]) -> None:
        shown: set[tuple[str, str]] = set()
        for s in samples:
            labels = (s.lane, str(s.replica))
            SLOTS.labels(*labels, "busy").set(s.busy)
            SLOTS.labels(*labels, "free").set(s.free)
            CACHED_TOKENS.labels(*labels).set(s.cached_tokens)
            KV_BYTES.labels(*labels).set(s.kv_bytes)
            MEMORY_BYTES.labels(*labels).set(s.memory_bytes)
            if s.speculation_failed is None:
                with contextlib.suppress(KeyError):
                    SPECULATION_FAILED.remove(*labels)
            else:
                SPECULATION_FAILED.labels(*labels).set(int(s.speculation_failed))
            shown.add(labels)
        for labels in self._shown - shown:
            for state in ("busy", "free"):
                with contextlib.suppress(KeyError):
                    SLOTS.remove(*labels, state)
            for gauge in (CACHED_TOKENS, KV_BYTES, MEMORY_BYTES, SPECULATION_FAILED):
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)
        self._shown = shown


async def health_of(
    client: EngineClient, *, timeout: float = HEALTH_TIMEOUT_S
) -> engine_pb2.HealthResponse | None:
    """A replica's Health, or None when it does not answer in time."""
    try:
        return await client.health(timeout=timeout)
    except grpc.RpcError:
        return None


@dataclass
class HealthMonitor:
    """Polls the ready replicas `observe` returns and publishes their Health."""

    observe: Callable[[], Sequence[ReplicaObservation]]
    interval: float = DEFAULT_INTERVAL_S
    # A replica that takes longer to answer is left out of this round.
    timeout: float = HEALTH_TIMEOUT_S
    publisher: Publisher = field(default_factory=Publisher)
    # One client per ready replica, kept from round to round.
    pool: EnginePool = field(default_factory=EnginePool)
    # The last round's samples (`blazar top` reads them).
    latest: list[Sample] = field(default_factory=list)

    async def poll_once(self) -> list[Sample]:
        ready = [r for r in self.observe() if r.state is ReplicaState.READY]
        await self.pool.retain(r.socket for r in ready)
        answers = await asyncio.gather(
            *(health_of(self.pool.client(r.socket), timeout=self.timeout) for r in ready)
        )
        samples = [
            Sample.of(r.lane, r.index, health)
            for r, health in zip(ready, answers, strict=True)
            if health is not None
        ]
        self.publisher.publish(samples)
        self.latest = samples
        return samples

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop` is set; then remove every series."""
        try:
            while not stop.is_set():
                try:
                    await self.poll_once()
                except Exception:
                    log.exception("engine_health_poll_failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
        finally:
            self.latest = []
            self.publisher.publish(())
            await self.pool.close()
