"""blazar_queue_wait_seconds observes each request's wait in admission's queue once:
a start that failed before its first chunk and came back to the queue (a replica lost)
is the same request, not another wait. And a replica that refused a start but stays
(the same process) is asked again once its time out passes."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from prometheus_client import REGISTRY

from blazar.dataplane import admission, runs
from blazar.dataplane.dispatcher import LaneDispatcher
from blazar.dataplane.runs import Run
from tests.dispatching import one_slot_route
from tests.unit.test_dispatcher_lateness import InstantParker

POLICY = admission.Policy(name="queue-wait-once", priority=0, max_queue_depth=8)


def waits() -> float:
    labels = {"lane": "l", "policy": POLICY.name}
    return REGISTRY.get_sample_value("blazar_queue_wait_seconds_count", labels) or 0.0


def test_a_start_that_failed_and_came_back_is_one_wait() -> None:
    async def body() -> None:
        route = one_slot_route()
        lane = LaneDispatcher(route, parker=InstantParker())
        try:
            before = waits()
            t = admission.Ticket("t", POLICY, time.monotonic(), prompt_tokens=10, max_tokens=10)
            run = await lane.admit(t, request_id="t", prompt_chars=40)
            assert isinstance(run, Run)
            assert waits() == before + 1
            # The replica refused it before its first chunk; the restarted process
            # (another pid) takes it again.
            retry = asyncio.create_task(lane.retry(run))
            await asyncio.sleep(0.05)
            restarted = dataclasses.replace(route.replicas[0], pid=2)
            lane.update(dataclasses.replace(route, replicas=(restarted,)))
            again = await asyncio.wait_for(retry, 2.0)
            assert again.replica.pid == 2
            assert waits() == before + 1
            lane.end(again, None)
        finally:
            await lane.close()

    asyncio.run(body())


def test_a_replica_that_refused_and_stays_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured: a daemon out of file descriptors could not open a socket to its one
    engine, which stayed healthy (same pid): the request went back to the queue and the
    replica out of the view for as long as it lived, so every later request waited
    for nothing. It comes back after `runs.EXCLUDED_S`, with nothing else happening."""
    monkeypatch.setattr(runs, "EXCLUDED_S", 0.2)

    async def body() -> None:
        route = one_slot_route()
        lane = LaneDispatcher(route, parker=InstantParker())
        try:
            t = admission.Ticket("t", POLICY, time.monotonic(), prompt_tokens=10, max_tokens=10)
            run = await lane.admit(t, request_id="t", prompt_chars=40)
            assert isinstance(run, Run)
            started = time.monotonic()
            again = await asyncio.wait_for(lane.retry(run), 2.0)
            assert again.replica == route.replicas[0]  # the same process
            assert time.monotonic() - started >= 0.2
            lane.end(again, None)
        finally:
            await lane.close()

    asyncio.run(body())
