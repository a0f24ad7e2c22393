"""grpc.aio work of one test's event loop never reaches the next test's loop.

grpc.aio keeps one process-wide completion-queue poller while any of its channels,
servers or calls is alive, and every event loop that used it stays bound to it. A
completion of a loop that has closed is then dispatched from whichever loop reads the
poller next, with `call_soon_threadsafe` on the closed loop: "Event loop is closed",
raised into an unrelated test by anyio's runner. Garbage cycles (grpc's own abort
tracebacks hold calls and server RPC states) kept the poller alive past a test at
random, until the collector ran; tests/unit/conftest.py collects them before each test.

The first test leaves exactly that: a channel in a garbage cycle, with a core operation
that completes after its loop closed (a connectivity watch with a deadline stands in
for a call finishing late, at a time the test can name). The second, run after it
(pytest keeps a file's order), must not see it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

pytestmark = pytest.mark.anyio

# When the watch of the first test ends, after its loop closed.
WATCH_S = 0.2
# Nothing ever connects (an IDLE channel's watch asks for no connection).
TARGET = "127.0.0.1:9"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_channel_left_in_a_cycle_with_an_operation_pending() -> None:
    channel = grpc.aio.insecure_channel(TARGET)
    # grpc.aio's watch has no deadline of its own; its Cython channel's does.
    watch = channel._channel.watch_connectivity_state(
        grpc.ChannelConnectivity.IDLE.value[0], time.time() + WATCH_S
    )
    task = asyncio.ensure_future(watch)
    await asyncio.sleep(0)
    assert not task.done()
    cycle: list[Any] = [channel]
    cycle.append(cycle)
    # Leaving cancels the task, not the core watch; the cycle outlives the loop.


async def test_the_next_loop_sees_no_completion_of_the_closed_one() -> None:
    async with grpc.aio.insecure_channel(TARGET):
        # Bound to the poller until past the first test's deadline (nothing to poll
        # for: the completion is not observable but as this failure): one dispatched
        # to the closed loop would fail this test (anyio raises it here).
        await asyncio.sleep(WATCH_S * 2.5)
