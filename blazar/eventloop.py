"""The event loop Blazar's processes run on: uvloop where it is installed.

The daemon (`blazar serve`) and each engine worker run one asyncio event loop. On
uvloop (libuv) the daemon's share of a streamed token and of a refused request costs
less CPU than on asyncio's own loop, and on this project's 2-core hosts every
millisecond the daemon runs beside a decode slows that decode. uvloop is a dependency
on Linux and macOS only; where it is absent (Windows, or a stripped install) the
processes run on asyncio's default loop, which serves the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor; None (asyncio's default loop) where uvloop is absent."""
    try:
        import uvloop
    except ImportError:
        return None
    new_event_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_factory` chooses."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
