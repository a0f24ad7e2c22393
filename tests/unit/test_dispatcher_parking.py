"""A preemption as the Lane's dispatcher carries it out: the park takes time, and that
time is measured as itself, never as the urgent request's start overhead."""

from __future__ import annotations

import asyncio
import time

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.dataplane import admission, routing
from blazar.dataplane.dispatcher import LaneDispatcher
from blazar.dataplane.parking import Parked

PARK_S = 0.2
BATCH = admission.Policy(name="batch", priority=0, max_queue_depth=8)
URGENT = admission.Policy(
    name="urgent", priority=100, ttft_target_s=2.0, max_queue_depth=8, reject_early=True
)
# One request measured: a 100-token prompt in 10 ms, ten decode steps in a second, all
# of its budget generated.
MEASURED = inference_pb2.Final(
    usage=inference_pb2.Usage(prompt_tokens=100, completion_tokens=11),
    timings=inference_pb2.Timings(prefill_ms=10.0, decode_ms=1000.0),
)


class SlowParker:
    """Parks after `PARK_S`, as an engine does between two decode steps."""

    def __init__(self) -> None:
        self.parked: list[str] = []

    async def park(self, replica: routing.Replica, request_id: str) -> Parked | None:
        await asyncio.sleep(PARK_S)
        self.parked.append(request_id)
        return Parked(parked_bytes=1000, tokens=10)

    async def resume(self, replica: routing.Replica, request_id: str) -> bool:
        return True


def route() -> routing.Route:
    replica = routing.Replica("l", 0, "unix:///nowhere", pid=1)
    return routing.Route(
        lane="l",
        model="m",
        aliases=(),
        replicas=(replica,),
        created=0,
        context_length=1024,
        slots=1,
        max_parked_bytes=1 << 20,
    )


def ticket(id: str, policy: admission.Policy) -> admission.Ticket:
    return admission.Ticket(id, policy, time.monotonic(), prompt_tokens=10, max_tokens=1000)


def test_the_urgent_request_starts_after_the_park_and_the_park_is_measured() -> None:
    async def run() -> tuple[float, float, float, admission.ReplicaView]:
        parker = SlowParker()
        dispatcher = LaneDispatcher(route(), parker=parker)
        # Batch requests run to their budget: this one holds its slot for 100 s.
        dispatcher.measurements.record(
            0, MEASURED, prompt_chars=400, policy=BATCH.name, max_tokens=11
        )
        try:
            await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
            asked = time.monotonic()
            urgent = await dispatcher.admit(
                ticket("urgent", URGENT), request_id="u", prompt_chars=40
            )
            assert parker.parked == ["b"]
            view = dispatcher.measurements.replica_view(0, slots=1, running=())
            return asked, urgent.started_at, time.monotonic(), view
        finally:
            await dispatcher.close()

    asked, started_at, answered, view = asyncio.run(run())
    # Started when the slot was free (after the park), not when the park was asked for:
    # its first token's overhead will not count the park.
    assert asked + PARK_S <= started_at <= answered
    # The park is a figure of its own, which the forecast adds to a preempting start.
    assert view.park_s == pytest.approx(PARK_S, abs=0.1)
