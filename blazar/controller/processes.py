"""The narrow interface through which the controller acts on engine processes.

The daemon wires in `blazar.engine.supervisor.Supervisor`; unit tests use a fake that
records calls and lets the test move replicas between states.
"""

from __future__ import annotations

from typing import Protocol

from blazar.api.replicas import LaunchSpec, ReplicaObservation


class Processes(Protocol):
    def observe(self, lane: str) -> list[ReplicaObservation]:
        """Every replica the supervisor holds for lane, running or failed."""
        ...

    def lanes(self) -> set[str]:
        """Names of lanes that have at least one replica."""
        ...

    async def start(self, lane: str, index: int, launch: LaunchSpec) -> None:
        """Spawn replica index (replacing a failed one); returns once spawned, not ready."""
        ...

    async def stop(self, lane: str, index: int) -> None:
        """Drain, SIGTERM, wait for the grace period, SIGKILL the group; then forget it."""
        ...
