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
    [
        (grpc.StatusCode.UNAVAILABLE, "info"),
        (grpc.StatusCode.NOT_FOUND, "info"),
        (grpc.StatusCode.INTERNAL, "warning"),
    ],
)
def test_a_resume_a_draining_engine_refuses_is_no_warning(
    code: grpc.StatusCode, level: str
) -> None:
    """In a drain or a restart the engine takes no resume, and its parked generation
    ends with it; one whose caller left meanwhile is no longer held (NOT_FOUND; the
    dispatcher warns when nobody left): expected, so told at info; any other refusal is
    a warning."""

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


class SlowParkEngine(engine_pb2_grpc.EngineServicer):
    """Answers a Park only after its step, as an engine in a long prompt chunk does; the
    calls it took, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def Park(self, request: Any, context: Any) -> engine_pb2.ParkResponse:
        self.calls.append(("park", request.request_id))
        await asyncio.sleep(0.5)
        return engine_pb2.ParkResponse(slot=0, tokens=10, parked_bytes=100)

    async def Resume(self, request: Any, context: Any) -> engine_pb2.ResumeResponse:
        self.calls.append(("resume", request.request_id))
        return engine_pb2.ResumeResponse()


def test_a_park_given_up_on_is_followed_by_a_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine carries out a Park whose caller gave up (its answer is dropped):
    admission counts the generation as running, so the engine is told to resume it
    after, else it would stay parked with nobody to resume it and its stream hang."""
    monkeypatch.setattr(parking, "PARK_TIMEOUT_S", 0.1)
    engine = SlowParkEngine()

    async def run() -> parking.Parked | None:
        async with engines(engine) as sockets:  # type: ignore[arg-type]
            pool = EnginePool()
            replica = routing.Replica(lane="l", index=0, socket=sockets[0], pid=1)
            parked = await parking.EngineParker(pool).park(replica, "r1")
            for _ in range(50):
                if len(engine.calls) == 2:
                    break
                await asyncio.sleep(0.02)
            await pool.close()
            return parked

    assert asyncio.run(run()) is None
    assert engine.calls == [("park", "r1"), ("resume", "r1")]


class NeverParkedEngine(SlowParkEngine):
    """Its Park never happened (the engine stopped before it arrived): nothing to resume."""

    async def Resume(self, request: Any, context: Any) -> engine_pb2.ResumeResponse:
        self.calls.append(("resume", request.request_id))
        await context.abort(grpc.StatusCode.NOT_FOUND, "No parked generation r1.")
        raise AssertionError("unreachable")


def test_an_undo_that_finds_nothing_parked_is_no_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parking, "PARK_TIMEOUT_S", 0.1)
    engine = NeverParkedEngine()

    async def run() -> None:
        async with engines(engine) as sockets:  # type: ignore[arg-type]
            pool = EnginePool()
            replica = routing.Replica(lane="l", index=0, socket=sockets[0], pid=1)
            await parking.EngineParker(pool).park(replica, "r1")
            for _ in range(50):
                if len(engine.calls) == 2:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # the undo's answer is logged
            await pool.close()

    with capture_logs() as logs:
        asyncio.run(run())
    [failed] = [e for e in logs if e["event"] == "admission.resume_failed"]
    assert failed["log_level"] == "info"
