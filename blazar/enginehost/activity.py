"""What each Lane's callers are doing, for the controller's idle decision.

The data plane writes (`begin`/`end` around every request, `want` when a request
waits for a Lane without a serving replica); the controller reads (`idle_since`,
`in_flight`) and is woken by `want`, so that a Lane put to sleep by `idle.sleepAfter`
starts again for the request that waits. One ledger per daemon, in its event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Activity:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._in_flight: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._wanted: set[str] = set()
        self._on_change: list[Callable[[str], None]] = []

    def begin(self, lane: str) -> None:
        """A request for `lane` arrived."""
        self._in_flight[lane] = self._in_flight.get(lane, 0) + 1
        self._last[lane] = self._clock()

    def end(self, lane: str) -> None:
        """A request for `lane` ended, however."""
        left = self._in_flight.get(lane, 0) - 1
        if left > 0:
            self._in_flight[lane] = left
        self._last[lane] = self._clock()
        if left <= 0:
            self._in_flight.pop(lane, None)
            self._wanted.discard(lane)
            self._changed(lane)  # idle from now: the controller times its sleep

    def want(self, lane: str) -> None:
        """A request waits for `lane`, which has no serving replica: wake it."""
        self._wanted.add(lane)
        self._changed(lane)

    def on_change(self, callback: Callable[[str], None]) -> None:
        """Call `callback(lane)` when a Lane is wanted or falls idle."""
        self._on_change.append(callback)

    def _changed(self, lane: str) -> None:
        for callback in self._on_change:
            callback(lane)

    def in_flight(self, lane: str) -> int:
        return self._in_flight.get(lane, 0)

    def wanted(self, lane: str) -> bool:
        return lane in self._wanted

    def idle_s(self, lane: str) -> float:
        """Seconds since the Lane's last request ended (or the daemon started)."""
        return max(0.0, self._clock() - self._last.get(lane, self._started))
