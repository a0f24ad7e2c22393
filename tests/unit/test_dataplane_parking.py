"""`parking.EngineParker`: the engines' Park and Resume as admission sees them."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc
from blazar.dataplane import parking, routing
from blazar.enginehost.client import EnginePool
from tests.unit.test_dataplane_relay import engines


class RefusingEngine(engine_pb2_grpc.EngineServicer):
    """Refuses every Resume with `code`, as a draining engine does with UNAVAILABLE."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def Resume(self, request: Any, context: Any) -> engine_pb2.ResumeResponse:
        await context.abort(self.code, "the engine is draining")


@pytest.mark.parametrize(
    ("code", "level"),
    [(grpc.StatusCode.UNAVAILABLE, "info"), (grpc.StatusCode.INTERNAL, "warning")],
)
def test_a_resume_a_draining_engine_refuses_is_no_warning(
    code: grpc.StatusCode, level: str
) -> None:
    """In a drain or a restart the engine takes no resume, and its parked generation
    ends with it: expected, so told at info; any other refusal is a warning."""

    async def run() -> tuple[bool, list[dict[str, Any]]]:
        async with engines(RefusingEngine(code)) as sockets:  # type: ignore[arg-type]
            pool = EnginePool()
            replica = routing.Replica(lane="l", index=0, socket=sockets[0], pid=1)
            with capture_logs() as logs:
                resumed = await parking.EngineParker(pool).resume(replica, "r1")
            await pool.close()
            return resumed, logs

    resumed, logs = asyncio.run(run())
    assert resumed is False
    (line,) = [x for x in logs if x["event"] == "admission.resume_failed"]
    assert line["log_level"] == level and line["request_id"] == "r1"
