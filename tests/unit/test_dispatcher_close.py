"""Closing a Lane's dispatcher ends its admission task, whatever is queued."""

from __future__ import annotations

import asyncio
import time

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
