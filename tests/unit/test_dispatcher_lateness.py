"""Which first tokens measure the forecast's lateness, as the Lane's dispatcher keeps it:
those of requests admission had wait for a busy slot that then freed, and nothing else
(not an idle slot's, not a preemption's, not one that later work overtook)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.dataplane import admission, routing
from blazar.dataplane.dispatcher import LaneDispatcher
from blazar.dataplane.measurements import LATENESS_MAX
from blazar.dataplane.parking import Parked
from blazar.dataplane.runs import Run
from tests.dispatching import one_slot_route

BATCH = admission.Policy(name="batch", priority=0, max_queue_depth=8)
URGENT = admission.Policy(
    name="urgent", priority=100, ttft_target_s=2.0, max_queue_depth=8, reject_early=False
)
# One batch request measured: a 100-token prompt in 10 ms, 0.1 s a token, all of its
# budget generated. A batch request allowed 1,000 tokens holds its slot for 100 s.
MEASURED = inference_pb2.Final(
    usage=inference_pb2.Usage(prompt_tokens=100, completion_tokens=11),
    timings=inference_pb2.Timings(prefill_ms=10.0, decode_ms=1000.0),
)


class InstantParker:
    """Parks and resumes at once."""

    async def park(self, replica: routing.Replica, request_id: str) -> Parked | None:
        return Parked(parked_bytes=1000, tokens=10)

    async def resume(self, replica: routing.Replica, request_id: str) -> bool:
        return True


def ticket(id: str, policy: admission.Policy, *, max_tokens: int = 1000) -> admission.Ticket:
    return admission.Ticket(id, policy, time.monotonic(), prompt_tokens=10, max_tokens=max_tokens)


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 2.0
    while not condition():
        assert time.monotonic() < deadline, f"not within 2 s: {what}"
        await asyncio.sleep(0.005)


def scenario(body: Callable[[LaneDispatcher], Awaitable[None]]) -> LaneDispatcher:
    async def run() -> LaneDispatcher:
        dispatcher = LaneDispatcher(one_slot_route(), parker=InstantParker())
        dispatcher.measurements.record(
            0, MEASURED, prompt_chars=400, policy=BATCH.name, max_tokens=11
        )
        try:
            await body(dispatcher)
        finally:
            await dispatcher.close()
        return dispatcher

    return asyncio.run(run())


async def admitted(dispatcher: LaneDispatcher, t: admission.Ticket) -> Run:
    run = await dispatcher.admit(t, request_id=t.id, prompt_chars=40)
    assert isinstance(run, Run)
    return run


def test_a_request_that_waited_for_a_busy_slot_measures_the_forecast() -> None:
    async def body(dispatcher: LaneDispatcher) -> None:
        first = await admitted(dispatcher, ticket("a", BATCH))
        # An idle slot: it never waited on the forecast.
        assert first.wait_forecast_s is None
        dispatcher.first_token(first, 0.05)
        waiting = asyncio.create_task(admitted(dispatcher, ticket("b", BATCH)))
        await until(lambda: dispatcher.queued() == {"batch": 1}, "b queued")
        dispatcher.end(first, None)
        second = await waiting
        assert second.predicted_ttft_s is not None and second.predicted_ttft_s > 90
        assert second.wait_forecast_s == second.predicted_ttft_s
        dispatcher.first_token(second, 1.5 * second.predicted_ttft_s)

    dispatcher = scenario(body)
    assert dispatcher.measurements.lateness == pytest.approx(1.5)
    assert dispatcher._view().lateness == pytest.approx(1.5)


def test_work_that_overtook_a_waiting_request_is_not_the_forecasts_error() -> None:
    """c waits 100 s behind a; an urgent request arrives, parks a and runs first, and a
    resumes before c: c's first token comes late for work its forecast could not see.
    The urgent request started by parking: it never waited on the forecast either."""

    async def body(dispatcher: LaneDispatcher) -> None:
        first = await admitted(dispatcher, ticket("a", BATCH))
        waiting = asyncio.create_task(admitted(dispatcher, ticket("c", BATCH)))
        await until(lambda: dispatcher.queued() == {"batch": 1}, "c queued")
        urgent = await admitted(dispatcher, ticket("u", URGENT, max_tokens=10))
        assert urgent.wait_forecast_s is None
        dispatcher.first_token(urgent, 0.05)
        dispatcher.end(urgent, None)
        await until(lambda: dispatcher.running() == 1, "a resumed")
        dispatcher.end(first, None)
        late = await waiting
        assert late.predicted_ttft_s is not None
        assert late.wait_forecast_s is None
        dispatcher.first_token(late, 3 * late.predicted_ttft_s)

    assert scenario(body).measurements.lateness == 1.0


def test_a_request_that_waited_then_preempted_did_not_wait_on_the_forecast() -> None:
    """u is forecast to meet its target by waiting 1.2 s for the batch run's slot; then
    waits measure twice as late as forecast, and u parks the batch run instead. Its
    first token, soon after the park, says nothing of a wait (counting it would pull
    the lateness down because it preempted)."""

    async def body(dispatcher: LaneDispatcher) -> None:
        await admitted(dispatcher, ticket("a", BATCH, max_tokens=12))
        waiting = asyncio.create_task(admitted(dispatcher, ticket("u", URGENT, max_tokens=10)))
        await until(lambda: dispatcher.queued() == {"urgent": 1}, "u queued")
        dispatcher.measurements.record_wait(predicted_s=1.0, measured_s=2.0)
        dispatcher.update(one_slot_route())  # any event: admission decides again
        urgent = await asyncio.wait_for(waiting, 1.0)
        assert urgent.wait_forecast_s is None
        dispatcher.first_token(urgent, 0.01)

    assert scenario(body).measurements.lateness == pytest.approx(2.0)


def test_a_request_parked_before_its_first_token_no_longer_measures_the_forecast() -> None:
    """b waited for a's slot and started; parked for an urgent request before its first
    token, that token will come late by the park, not by the forecast."""

    async def body(dispatcher: LaneDispatcher) -> None:
        first = await admitted(dispatcher, ticket("a", BATCH))
        waiting = asyncio.create_task(admitted(dispatcher, ticket("b", BATCH)))
        await until(lambda: dispatcher.queued() == {"batch": 1}, "b queued")
        dispatcher.end(first, None)
        second = await waiting
        assert second.wait_forecast_s is not None
        await admitted(dispatcher, ticket("u", URGENT, max_tokens=10))
        assert second.parked_at is not None
        assert second.wait_forecast_s is None

    scenario(body)


def test_a_waiting_request_refused_as_late_measures_the_forecast_too() -> None:
    """w (same priority as the batch run: nothing to park) is forecast to meet its 2 s
    target by waiting for a's slot; then the batch policy measures ten times slower, and
    w is refused as predicted to miss. The forecast it waited on was that much late:
    the lateness counts it, as it counts the waits that end in a first token."""
    rejecting = admission.Policy(
        name="rejecting", priority=0, ttft_target_s=2.0, max_queue_depth=8, reject_early=True
    )

    async def body(dispatcher: LaneDispatcher) -> None:
        await admitted(dispatcher, ticket("a", BATCH, max_tokens=11))
        waiting = asyncio.create_task(admitted(dispatcher, ticket("w", rejecting, max_tokens=5)))
        await until(lambda: dispatcher.queued() == {"rejecting": 1}, "w queued")
        for _ in range(20):
            slow = inference_pb2.Final(
                usage=inference_pb2.Usage(prompt_tokens=100, completion_tokens=11),
                timings=inference_pb2.Timings(prefill_ms=10.0, decode_ms=10_000.0),
            )
            dispatcher.measurements.record(0, slow, prompt_chars=400, policy=BATCH.name)
        dispatcher.update(one_slot_route())  # any event: admission decides again
        with pytest.raises(errors.SloUnattainable):
            await asyncio.wait_for(waiting, 1.0)

    # About 1 s forecast at its arrival, several seconds at its refusal: past the bound.
    assert scenario(body).measurements.lateness == LATENESS_MAX
