"""Runs the reconcilers: store changes and supervisor notices in, work queue, workers out.

Each store change enqueues the object's own key plus the keys of objects that depend
on it (a Model change wakes the Lanes that serve it). Workers take keys one at a time;
the queue guarantees a key is never reconciled twice at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable

import structlog

from blazar.api.kinds import Kind, Lane, references
from blazar.controller.reconciler import Reconciler, TemporaryError
from blazar.controller.workqueue import WorkQueue
from blazar.store.base import Store, WatchEvent

log = structlog.get_logger(__name__)

Key = tuple[Kind, str]


def dependents(store: Store, kind: Kind, name: str) -> list[Key]:
    """Keys to reconcile when (kind, name) changes: itself and the Lanes referring to it,
    directly or through their SpecPair (its draft Model)."""
    keys: list[Key] = [(kind, name)]
    if kind == Kind.LANE:
        return keys
    for lane in store.list(Kind.LANE):
        assert isinstance(lane, Lane)
        if (kind, name) in _referenced(store, lane):
            keys.append((Kind.LANE, lane.metadata.name))
    return keys


def _referenced(store: Store, lane: Lane) -> set[Key]:
    """What a Lane names, and what its SpecPair names in turn."""
    out = {(k, n) for _, k, n in references(lane)}
    if lane.spec.speculation is not None:
        pair = store.get(Kind.SPEC_PAIR, lane.spec.speculation)
        if pair is not None:
            out |= {(k, n) for _, k, n in references(pair)}
    return out


class Manager:
    def __init__(
        self,
        *,
        store: Store,
        reconcilers: Iterable[Reconciler],
        workers: int = 4,
        leftovers: Callable[[], Iterable[Key]] = tuple,
    ) -> None:
        """`leftovers` names objects that are no longer stored but may have left
        something behind (a deleted Lane's KV caches): reconciled at start too, so a
        delete that the daemon did not finish before it stopped is finished then."""
        self._store = store
        self._leftovers = leftovers
        self._reconcilers = {r.kind: r for r in reconcilers}
        self._workers = workers
        self.queue: WorkQueue[Key] = WorkQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe: object = None

    def enqueue(self, kind: Kind, name: str) -> None:
        """Thread-safe: ask for (kind, name) and its dependents to be reconciled."""
        if self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._enqueue_now, kind, name)

    def _enqueue_now(self, kind: Kind, name: str) -> None:
        for key in dependents(self._store, kind, name):
            if key[0] in self._reconcilers:
                self.queue.add(key)

    def _on_store_event(self, event: WatchEvent) -> None:
        self.enqueue(Kind(event.object.kind), event.object.metadata.name)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._unsubscribe = self._store.subscribe(self._on_store_event)
        # Level-triggered: every stored object is reconciled at start, which is how a
        # restarted daemon brings its Lanes back without anything being re-applied.
        for obj in self._store.list():
            self._enqueue_now(Kind(obj.kind), obj.metadata.name)
        for kind, name in self._leftovers():
            self._enqueue_now(kind, name)
        self._tasks = [asyncio.create_task(self._work(i)) for i in range(self._workers)]

    async def stop(self) -> None:
        unsubscribe = self._unsubscribe
        if callable(unsubscribe):
            unsubscribe()
        self.queue.shut_down()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _work(self, worker: int) -> None:
        while True:
            key = await self.queue.get()
            try:
                await self._reconcile(key)
            finally:
                self.queue.done(key)

    async def _reconcile(self, key: Key) -> None:
        kind, name = key
        reconcile_id = uuid.uuid4().hex[:8]
        structlog.contextvars.bind_contextvars(
            reconcile_id=reconcile_id, kind=kind.value, name=name
        )
        try:
            result = await self._reconcilers[kind].reconcile(name)
        except TemporaryError as err:
            log.warning("reconcile.retry", error=str(err), delay=err.delay)
            self.queue.add_after(key, err.delay)
        except Exception:
            delay = self.queue.add_rate_limited(key)
            log.exception("reconcile.failed", retry_in=delay)
        else:
            self.queue.forget(key)
            if result.requeue_after is not None:
                self.queue.add_after(key, result.requeue_after)
        finally:
            structlog.contextvars.unbind_contextvars("reconcile_id", "kind", "name")
