"""The narrow interface through which the controller acts on engine processes.

The daemon wires in `blazar.enginehost.supervisor.Supervisor`; unit tests use a fake that
records calls and lets the test move replicas between states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from blazar.api.kinds import Health
from blazar.api.replicas import LaunchSpec, ReplicaObservation


class StartWarning(Protocol):
    """What went wrong starting a replica without keeping it from running; the
    controller records it as a Warning event on the Lane."""

    @property
    def reason(self) -> str: ...

    @property
    def message(self) -> str: ...


class Processes(Protocol):
    def observe(self, lane: str) -> list[ReplicaObservation]:
        """Every replica the supervisor holds for lane, running or failed."""
        ...

    def lanes(self) -> set[str]:
        """Names of lanes that have at least one replica."""
        ...

    def check(self, lane: str, health: Health | None) -> bool:
        """Check lane's replicas as `health` says from now on (None: the defaults),
        those running at their next check: no restart. Whether that changes what the
        lane was told last (not the first time, nor for None)."""
        ...

    async def start(self, lane: str, index: int, launch: LaunchSpec) -> Sequence[StartWarning]:
        """Spawn replica index (replacing a failed one); returns once spawned, not ready.

        A replica the OS refuses to spawn is observed as Failed, like a crash. What is
        lost but does not stop the replica (KV persistence, say) comes back as warnings.
        """
        ...

    async def stop(self, lane: str, index: int) -> None:
        """Drain, SIGTERM, wait for the grace period, SIGKILL the group; then forget it."""
        ...

    async def discard_kv(self, lane: str) -> list[int]:
        """Remove the KV caches saved for a lane's replicas and return their numbers;
        a replica still held (running or failed) keeps its own, and the lane's
        directory goes once it is empty."""
        ...

    def kv_lanes(self) -> list[str]:
        """Lanes with KV caches saved here, held or not."""
        ...
