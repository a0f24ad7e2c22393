"""Fixtures of the unit layer."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

# How long a grpc.aio poller thread may take to end once its last owner is gone.
_POLLER_EXIT_S = 2.0

# The test that ran last, to name when its grpc.aio state outlives it.
_previous: list[str] = ["(none)"]


def _grpc_aio_pollers() -> list[threading.Thread]:
    """The threads of grpc.aio's process-wide completion-queue poller (grpcio names no
    API for it; its thread runs `PollerCompletionQueue._poll_wrapper`)."""
    return [t for t in threading.enumerate() if t.name.endswith("(_poll_wrapper)")]


@pytest.fixture(scope="session", autouse=True)
def _collections_see_only_what_tests_make() -> None:
    """Freeze what imports and collection made (modules, classes, test items): the
    collections below then scan only what tests made since, milliseconds instead of
    tens (frozen objects are never collected; they live as long as the session)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _grpc_aio_starts_afresh(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with no grpc.aio state of an earlier test, so that the earlier
    test's event loops (closed by now) are never reached from this test's.

    grpc.aio keeps one poller for the process while any channel, server, call or server
    RPC of it is alive, and every loop that used it stays bound to it: an operation of a
    closed loop that completes later is dispatched from the next loop that reads the
    poller, by `call_soon_threadsafe` on the closed loop, and anyio raises that "Event
    loop is closed" in whatever test runs then. grpc's own abort tracebacks (server and
    client) hold calls in garbage cycles, which kept the poller alive past their test
    until the collector happened to run: collect them here, before this test's loop
    exists (at the end of the earlier test its fixture values are still held). With the
    last owner gone, grpc shuts the poller down, and Core finishes the closed loops'
    pending operations into that queue, which nobody reads. grpc.aio objects still
    reachable (a channel or server never closed, or kept by a module) fail the test,
    naming the one before it.
    """
    if _grpc_aio_pollers():
        gc.collect()
        for thread in _grpc_aio_pollers():
            thread.join(timeout=_POLLER_EXIT_S)
        assert not _grpc_aio_pollers(), (
            f"grpc.aio state of an earlier test ({_previous[0]}) is still alive: close "
            "every channel and stop every server on the test's own event loop"
        )
    yield
    _previous[0] = request.node.nodeid
