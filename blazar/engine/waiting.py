"""The decode loop's waiting line: jobs and Park/Resume orders handed over from other
threads, and the jobs waiting for a slot in order of arrival.

Other threads only `put` into the inbox; everything else runs on the decode thread,
which drains the inbox between steps (`collect`) and blocks on it when it has nothing
to do.
"""

from __future__ import annotations

import collections
import queue

from blazar.api import errors
from blazar.engine import generation, jobs, parking

_STOP = object()
# Wakes a loop blocked with nothing running (a parked job was cancelled).
_WAKE = object()


class WaitingLine:
    """Jobs waiting for a slot, oldest first, and the orders that came in."""

    def __init__(self) -> None:
        self._inbox: queue.Queue[jobs.Job | parking.Order | object] = queue.Queue()
        self._waiting: collections.deque[jobs.Job] = collections.deque()
        self._orders: list[parking.Order] = []

    # --- any thread ---

    def put(self, item: jobs.Job | parking.Order) -> None:
        self._inbox.put(item)

    def wake(self) -> None:
        """Make a blocked `collect` look again (a job was cancelled)."""
        self._inbox.put(_WAKE)

    def stop(self) -> None:
        """Make `collect` answer False."""
        self._inbox.put(_STOP)

    # --- decode thread ---

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def holds(self, request_id: str) -> bool:
        return any(job.request_id == request_id for job in self._waiting)

    def collect(self, *, block: bool) -> bool:
        """Move what came in to the waiting line (jobs in arrival order) and the orders;
        block until something comes if `block`. False once stopped."""
        added = False
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                break
            block = False
            if item is _STOP:
                return False
            if isinstance(item, parking.Park | parking.Resume | parking.ResumeAll):
                self._orders.append(item)
            elif isinstance(item, jobs.Job):
                self._waiting.append(item)
                added = True
        if added:
            # Jobs are submitted when prepared, which can reorder them (see Job.arrived).
            self._waiting = collections.deque(sorted(self._waiting, key=lambda j: j.arrived))
        return True

    def take_orders(self) -> list[parking.Order]:
        orders, self._orders = self._orders, []
        return orders

    def pop(self) -> jobs.Job:
        return self._waiting.popleft()

    def end_cancelled(self) -> None:
        """Tell each waiting job that was cancelled (a drain cancels queued jobs too)
        that it ended, now rather than when a slot frees: its caller waits for a final
        event, and CANCELLED makes the service answer with a retryable status."""
        if not any(job.cancelled for job in self._waiting):
            return
        kept: collections.deque[jobs.Job] = collections.deque()
        for job in self._waiting:
            if job.cancelled:
                job.deliver(generation.cancelled_before_start(job))
            else:
                kept.append(job)
        self._waiting = kept

    def close(self) -> None:
        """The engine stops: end every waiting job and answer every order."""
        stopped = errors.Unavailable("The engine stopped.")
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, jobs.Job):
                self._waiting.append(item)
            elif isinstance(item, parking.Park | parking.Resume):
                item.reply(stopped)
        for order in self.take_orders():
            if not isinstance(order, parking.ResumeAll):
                order.reply(stopped)
        # As for a running job cut off by the stop: CANCELLED, which the service
        # answers with a retryable UNAVAILABLE.
        while self._waiting:
            job = self._waiting.popleft()
            job.deliver(generation.cancelled_before_start(job))
