"""A work queue keyed by (kind, name), after client-go's workqueue.

Guarantees: a key is never processed by two workers at once; adding a key that is
already waiting is a no-op (de-duplication); adding a key that is being processed
marks it dirty so it runs once more after `done`. Failed keys come back after an
exponential backoff (`add_rate_limited`), reset by `forget`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self, *, base_delay: float = 0.5, max_delay: float = 60.0) -> None:
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._waiting: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._failures: dict[K, int] = {}
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._shut_down = False

    def add(self, key: K) -> None:
        """Queue key now unless it is already waiting; cancels a pending delayed add."""
        if self._shut_down:
            return
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if key in self._processing:
            self._dirty.add(key)
            return
        if key in self._waiting:
            return
        self._waiting.add(key)
        self._queue.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        """Queue key after delay seconds; an earlier pending add wins."""
        if self._shut_down:
            return
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        existing = self._timers.get(key)
        if existing is not None and existing.when() <= loop.time() + delay:
            return
        if existing is not None:
            existing.cancel()
        self._timers[key] = loop.call_later(delay, self._fire, key)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def add_rate_limited(self, key: K, *, max_delay: float | None = None) -> float:
        """Requeue a failed key after exponential backoff, at most `max_delay` (the
        queue's own bound when None); returns the delay used."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        bound = self._max_delay if max_delay is None else min(max_delay, self._max_delay)
        delay = min(self._base_delay * 2.0**failures, bound)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset key's backoff after a success."""
        self._failures.pop(key, None)

    async def get(self) -> K:
        key = await self._queue.get()
        self._waiting.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def shut_down(self) -> None:
        self._shut_down = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def __len__(self) -> int:
        return len(self._waiting)
