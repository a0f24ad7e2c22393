"""`blazar.eventloop`: the daemon and engine workers run on uvloop where it is
installed, on asyncio's own loop where it is not."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from blazar import eventloop


async def running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def test_runs_on_uvloop_where_it_is_installed() -> None:
    assert isinstance(eventloop.run(running_loop()), uvloop.Loop)


def test_runs_on_asyncio_s_loop_where_uvloop_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    loop = eventloop.run(running_loop())
    assert not isinstance(loop, uvloop.Loop)
    assert isinstance(loop, asyncio.BaseEventLoop)
    assert loop.is_closed()
