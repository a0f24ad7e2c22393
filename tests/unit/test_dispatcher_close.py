"""Closing a Lane's dispatcher ends its admission task, whatever is queued."""

from __future__ import annotations

import asyncio
import time

import pytest

from blazar.api import errors
from blazar.dataplane.dispatcher import LaneDispatcher
from tests.dispatching import one_slot_route
from tests.unit.test_dispatcher_parking import BATCH, URGENT, SlowParker, ticket


def test_close_ends_the_task_when_a_caller_left_just_before() -> None:
    """A caller that leaves puts its cancel on the task's queue; a close right after
    cancels the task while it waits (timed: a ticket with a deadline waits) for that very
    event. Python 3.11's wait_for returned the event and dropped the cancel, so the task
    went on serving and `close` (the daemon's shutdown) waited for ever."""

    async def run() -> float:
        dispatcher = LaneDispatcher(one_slot_route(), parker=SlowParker())
        await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
        # No rate measured: the urgent ticket waits for the slot, with a deadline.
        waiting = asyncio.create_task(
            dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40)
        )
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0)  # the caller's cancel is on the task's queue
        started = time.monotonic()
        await asyncio.wait_for(dispatcher.close(), timeout=5)
        return time.monotonic() - started

    assert asyncio.run(run()) < 1.0


def test_refuse_waiting_refuses_the_queue_at_once_and_what_arrives_after() -> None:
    """At a daemon's shutdown the engines drain and nothing waiting starts any more: a
    waiting request is refused at once, UNAVAILABLE saying to retry (it was held through
    the drain, then cut off by the gRPC server's stop with "Cancelling all calls"), and
    so is a request arriving later; the one running is left to its end."""

    async def run() -> None:
        dispatcher = LaneDispatcher(one_slot_route(), parker=SlowParker())
        running = await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
        waiting = asyncio.create_task(
            dispatcher.admit(ticket("second", BATCH), request_id="s", prompt_chars=40)
        )
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert dispatcher.queued() == {"batch": 1}
        dispatcher.refuse_waiting()
        with pytest.raises(errors.Unavailable, match="shutting down; retry"):
            await asyncio.wait_for(waiting, timeout=1)
        with pytest.raises(errors.Unavailable, match="shutting down; retry"):
            await dispatcher.admit(ticket("late", BATCH), request_id="l", prompt_chars=40)
        await asyncio.sleep(0.05)
        assert dispatcher.queued() == {}
        assert running.ticket.id == "batch"
        dispatcher.end(running, None)
        await asyncio.wait_for(dispatcher.close(), timeout=5)

    asyncio.run(run())
