"""Parking and resuming a running generation on its engine, on admission's word.

`Parker` is what a Lane's dispatcher calls to carry out an `admission.Preempt` and a
`Dispatch(resume=True)`; `EngineParker` does it through the engines' own Park and
Resume calls, `NoParking` refuses every park (tests, and engines that cannot).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog

from blazar.dataplane import routing
from blazar.enginehost.client import EnginePool

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Parked:
    """What an engine said when it parked a generation."""

    # Host memory holding its KV cache; 0 when only its tokens were kept.
    parked_bytes: int
    # Tokens its cache held.
    tokens: int
    # Seconds the engine took to copy the cache out: its own measure, which leaves out
    # the wait for the step it was running when the Park came.
    copy_s: float = 0.0


class Parker(Protocol):
    """Parks and resumes a running generation on its engine, on admission's word."""

    async def park(self, replica: routing.Replica, request_id: str) -> Parked | None:
        """Park the generation; None when the engine cannot (it keeps running)."""
        ...

    async def resume(self, replica: routing.Replica, request_id: str) -> bool:
        """Resume a parked generation in a free slot; False when the engine cannot."""
        ...


class NoParking:
    """A parker that refuses every park: the generation keeps running."""

    async def park(self, replica: routing.Replica, request_id: str) -> Parked | None:
        return None

    async def resume(self, replica: routing.Replica, request_id: str) -> bool:
        return False


# A Park waits for the engine's current step (a long prompt chunk can take seconds)
# while the Lane's queue waits, so it is bounded: an engine that does not answer in
# time (hung: its liveness probe will restart it) costs the queue at most this, and the
# urgent request waits for a slot instead. The engine still carries out a Park whose
# caller gave up, once its step ends: the parker then asks a Resume right after it (the
# engine takes orders in the order they came), so that the generation it was told
# runs does not stay parked with nobody to resume it. A Resume runs beside the queue
# (it waits for the slot admission freed); given up on, it still happens when the slot
# frees.
PARK_TIMEOUT_S = 3.0
RESUME_TIMEOUT_S = 30.0


class EngineParker:
    """Parks and resumes through the engines' own Park and Resume calls."""

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool
        # Resumes undoing Parks given up on, kept until done.
        self._undoing: set[asyncio.Task[bool]] = set()

    async def park(self, replica: routing.Replica, request_id: str) -> Parked | None:
        client = self._pool.client(replica.socket, process=replica.pid)
        try:
            answer = await client.park(request_id, timeout=PARK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # Gone, finished meanwhile, or not running yet: nothing was parked. Or
            # given up on: the engine may park it yet, and is told to resume it after.
            log.info("admission.park_failed", request_id=request_id, error=exc.details())
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                undo = asyncio.get_running_loop().create_task(
                    self.resume(replica, request_id, undoing=True)
                )
                self._undoing.add(undo)
                undo.add_done_callback(self._undoing.discard)
            return None
        return Parked(
            parked_bytes=answer.parked_bytes, tokens=answer.tokens, copy_s=answer.park_ms / 1000
        )

    async def resume(
        self, replica: routing.Replica, request_id: str, *, undoing: bool = False
    ) -> bool:
        """`undoing`: the Resume that follows a Park given up on, which finds nothing
        parked whenever that Park never reached the engine."""
        client = self._pool.client(replica.socket, process=replica.pid)
        try:
            await client.resume(request_id, timeout=RESUME_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # A replica that drains or went away takes no resume, and the parked
            # generation ends with it: expected in a drain or a restart, not a warning;
            # nor is an undo that found nothing to resume, nor a generation the engine
            # no longer holds (its caller left while the Resume was on its way; the
            # dispatcher warns when nobody left: `admission.resume_lost`).
            expected = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
            told = log.info if exc.code() in expected or undoing else log.warning
            told("admission.resume_failed", request_id=request_id, error=exc.details())
            return False
        return True
