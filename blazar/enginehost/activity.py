"""What each Lane's callers are doing, for the controller's idle decision.

The data plane writes (`begin`/`end` around every request, `want` when a request
waits for a Lane without a serving replica); the controller reads (`idle_since`,
`in_flight`) and is woken by `want`, so that a Lane put to sleep by `idle.sleepAfter`
starts again for the request that waits. One ledger per daemon, in its event loop.

A request may say how long its Lane stays awake after it (Ollama's `keep_alive`, the
canonical requests' `keep_alive_s`), told at its `end`: zero releases the Lane (it
sleeps as soon as no request is in flight), a positive number of seconds keeps it
awake at least that long after that request (the longest such keep holds), a negative
one keeps it awake until a later request says otherwise. `keep` tells the controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Keep:
    """What requests' keep_alive asks of a Lane now (see the module docstring)."""

    # Seconds left of the longest positive keep_alive (0: none left).
    remaining_s: float = 0.0
    # A negative keep_alive was the last said: stay awake.
    forever: bool = False
    # A zero keep_alive was the last said: sleep once idle.
    release: bool = False


class Activity:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._in_flight: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._wanted: set[str] = set()
        self._keep_until: dict[str, float] = {}
        self._forever: set[str] = set()
        self._released: set[str] = set()
        self._on_change: list[Callable[[str], None]] = []

    def begin(self, lane: str) -> None:
        """A request for `lane` arrived."""
        first = lane not in self._in_flight
        self._in_flight[lane] = self._in_flight.get(lane, 0) + 1
        self._last[lane] = self._clock()
        # A release was for the requests before; this one has its own say at its end.
        self._released.discard(lane)
        if first:
            # Busy from now: a Lane the controller has just put to sleep, whose replica
            # still routes (and hands this request back to the queue as it stops), must
            # be woken; nothing else would tell the controller it waits.
            self._changed(lane)

    def end(self, lane: str, *, keep_alive_s: float | None = None) -> None:
        """A request for `lane` ended, however; `keep_alive_s` is what it asked of the
        Lane's idleness (None: nothing)."""
        left = self._in_flight.get(lane, 0) - 1
        if left > 0:
            self._in_flight[lane] = left
        now = self._last[lane] = self._clock()
        if keep_alive_s is not None:
            self._keep(lane, keep_alive_s, now)
        if left <= 0:
            self._in_flight.pop(lane, None)
            self._wanted.discard(lane)
            self._changed(lane)  # idle from now: the controller times its sleep

    def want(self, lane: str) -> None:
        """A request waits for `lane`, which has no serving replica: wake it."""
        self._wanted.add(lane)
        self._changed(lane)

    def release(self, lane: str) -> None:
        """Sleep `lane` as soon as no request is in flight (Ollama's unload: keep_alive 0
        with nothing to generate)."""
        self._keep(lane, 0.0, self._clock())
        self._changed(lane)

    def _keep(self, lane: str, keep_alive_s: float, now: float) -> None:
        self._forever.discard(lane)
        self._released.discard(lane)
        if keep_alive_s < 0:
            self._forever.add(lane)
        elif keep_alive_s == 0:
            self._released.add(lane)
            self._keep_until.pop(lane, None)
        else:
            until = now + keep_alive_s
            self._keep_until[lane] = max(until, self._keep_until.get(lane, until))

    def keep(self, lane: str) -> Keep:
        until = self._keep_until.get(lane)
        remaining = 0.0 if until is None else max(0.0, until - self._clock())
        return Keep(
            remaining_s=remaining, forever=lane in self._forever, release=lane in self._released
        )

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

    def idle_s(self, lane: str, *, age_s: float | None = None) -> float:
        """Seconds since the Lane's last request ended, or since its life began: the
        daemon's start, or its creation `age_s` ago when that is later (a Lane applied
        while the daemon runs, or deleted and applied again under its name, has been
        idle only since then, not since the daemon started)."""
        idle = max(0.0, self._clock() - self._last.get(lane, self._started))
        return idle if age_s is None else min(idle, max(0.0, age_s))


def sleeps_in(
    *, sleep_after_s: float | None, idle_s: float, in_flight: int, keep: Keep
) -> float | None:
    """Seconds until a Lane falls asleep if no request comes, as the controller's sleep
    decision (`lane_plan.sleep_decision`) will put it (a test holds the two together);
    None while nothing will. A request in flight counts as ending now."""
    if keep.forever:
        return None
    if keep.release:
        return 0.0
    if sleep_after_s is None:
        return None
    return max(0.0, sleep_after_s - (0.0 if in_flight else idle_s), keep.remaining_s)
