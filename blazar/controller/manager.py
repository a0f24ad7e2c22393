"""Runs the reconcilers: store changes and supervisor notices in, work queue, workers out.

Each store change enqueues the object's own key plus the keys of objects that depend
on it (a Model change wakes the Lanes that serve it), and nothing else: a change to one
object of 200 reconciles that one. Workers take keys one at a time; the queue
guarantees a key is never reconciled twice at once and folds repeated adds of a key
that waits into one pass.

Level-triggered: every stored object is reconciled at start and again every
`resync_s` (a periodic resync, as controller-runtime's SyncPeriod), so drift that no
event reports (a file under a Model changed, a pass that failed quietly) is caught.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable, Iterable

import structlog

from blazar.api import errors
from blazar.api.kinds import Kind, Lane, SpecPair, references
from blazar.controller import metrics
from blazar.controller.reconciler import STORE_RETRY_S, Reconciler, TemporaryError
from blazar.controller.workqueue import WorkQueue
from blazar.store.base import Store, WatchEvent, WatchType

log = structlog.get_logger(__name__)

Key = tuple[Kind, str]

# Seconds between periodic resyncs of every stored object.
RESYNC_S = 300.0
# The kinds whose status a Lane's reconcile reads (a Model's readiness and path): a
# status write wakes their Lanes. Another kind's status (an SLOPolicy's ResolvedRefs)
# wakes nothing.
STATUS_READ_BY_LANES = frozenset({Kind.MODEL})


class References:
    """Which Lanes name each object, directly or through their SpecPair (its Models):
    kept up to date from store events, so that a change to one object finds the Lanes
    to wake without reading every Lane (with 200 objects applied at once, listing them
    per event made settling quadratic)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._of: dict[str, set[Key]] = {}
        self._naming: dict[Key, set[str]] = collections.defaultdict(set)

    @classmethod
    def of_store(cls, store: Store) -> References:
        refs = cls(store)
        for lane in store.list(Kind.LANE):
            assert isinstance(lane, Lane)
            refs.lane_changed(lane)
        return refs

    def dependents(self, kind: Kind, name: str) -> list[Key]:
        """Keys to reconcile when (kind, name) changes: itself and the Lanes naming it."""
        lanes = [] if kind == Kind.LANE else sorted(self._naming.get((kind, name), ()))
        return [(kind, name), *((Kind.LANE, lane) for lane in lanes)]

    def changed(self, event: WatchEvent) -> None:
        """Follow a store event: a Lane's own references, or a SpecPair's (which the
        Lanes using it name through it)."""
        obj, deleted = event.object, event.type == WatchType.DELETED
        if isinstance(obj, Lane):
            if deleted:
                self._drop(obj.metadata.name)
            elif not event.status_only:
                self.lane_changed(obj)
        elif isinstance(obj, SpecPair) and not event.status_only:
            for lane_name in list(self._naming.get((Kind.SPEC_PAIR, obj.metadata.name), ())):
                lane = self._store.get(Kind.LANE, lane_name)
                if isinstance(lane, Lane):
                    self.lane_changed(lane)

    def lane_changed(self, lane: Lane) -> None:
        name = lane.metadata.name
        self._drop(name)
        keys = {(k, n) for _, k, n in references(lane)}
        if lane.spec.speculation is not None:
            pair = self._store.get(Kind.SPEC_PAIR, lane.spec.speculation)
            if pair is not None:
                keys |= {(k, n) for _, k, n in references(pair)}
        self._of[name] = keys
        for key in keys:
            self._naming[key].add(name)

    def _drop(self, lane: str) -> None:
        for key in self._of.pop(lane, set()):
            names = self._naming.get(key)
            if names is not None:
                names.discard(lane)
                if not names:
                    del self._naming[key]


class Manager:
    def __init__(
        self,
        *,
        store: Store,
        reconcilers: Iterable[Reconciler],
        workers: int = 4,
        leftovers: Callable[[], Iterable[Key]] = tuple,
        resync_s: float | None = RESYNC_S,
    ) -> None:
        """`leftovers` names objects that are no longer stored but may have left
        something behind (a deleted Lane's KV caches): reconciled at start too, so a
        delete that the daemon did not finish before it stopped is finished then.
        `resync_s`: seconds between periodic resyncs (None: none)."""
        self._store = store
        self._leftovers = leftovers
        self._reconcilers = {r.kind: r for r in reconcilers}
        self._references = References(store)
        self._workers = workers
        self._resync_s = resync_s
        # Passes per key since start (read by tests and `blazar top`).
        self.reconciled: collections.Counter[Key] = collections.Counter()
        self.queue: WorkQueue[Key] = WorkQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe: object = None

    def enqueue(self, kind: Kind, name: str) -> None:
        """Thread-safe: ask for (kind, name) and its dependents to be reconciled."""
        if self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._enqueue_now, kind, name)

    def _enqueue_now(self, kind: Kind, name: str, *, itself: bool = True) -> None:
        for key in self._references.dependents(kind, name):
            if key[0] in self._reconcilers and (itself or key != (kind, name)):
                self.queue.add(key)

    def _on_store_event(self, event: WatchEvent) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._changed, event)

    def _changed(self, event: WatchEvent) -> None:
        self._references.changed(event)
        kind, name = Kind(event.object.kind), event.object.metadata.name
        if not event.status_only:
            self._enqueue_now(kind, name)
        elif kind in STATUS_READ_BY_LANES:
            # A status write is a reconciler's own answer: it wakes the objects that
            # read that status, not the object again (what controller-runtime's
            # GenerationChangedPredicate filters).
            self._enqueue_now(kind, name, itself=False)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._unsubscribe = self._store.subscribe(self._on_store_event)
        self._references = References.of_store(self._store)
        # Level-triggered: every stored object is reconciled at start, which is how a
        # restarted daemon brings its Lanes back without anything being re-applied.
        self._enqueue_all()
        self._tasks = [asyncio.create_task(self._work(i)) for i in range(self._workers)]
        if self._resync_s is not None:
            self._tasks.append(asyncio.create_task(self._resync(self._resync_s)))

    def _enqueue_all(self) -> None:
        """Every stored object, and the leftovers (each once: no dependents needed)."""
        keys = [(Kind(obj.kind), obj.metadata.name) for obj in self._store.list()]
        for key in [*keys, *self._leftovers()]:
            if key[0] in self._reconcilers:
                self.queue.add(key)

    async def _resync(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            metrics.RESYNCS.inc()
            log.debug("reconcile.resync")
            try:
                self._enqueue_all()
            except errors.Unavailable as err:
                # The store cannot be read now (a damaged or vanished file): the
                # next resync tries again; what was queued is worked on meanwhile.
                log.warning("reconcile.resync_failed", error=str(err))

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
        self.reconciled[key] += 1
        started = time.perf_counter()
        outcome = "ok"
        try:
            result = await self._reconcilers[kind].reconcile(name)
        except TemporaryError as err:
            outcome = "retry"
            log.warning("reconcile.retry", error=str(err), delay=err.delay)
            self.queue.add_after(key, err.delay)
        except errors.Unavailable as err:
            # The store could not take a write or give a read (a full disk, a file
            # made read-only): nothing is wrong with the object, so it is tried again
            # soon, never left on a back-off that keeps it stale long after the store
            # is back. Said once per try, without a traceback.
            outcome = "retry"
            delay = self.queue.add_rate_limited(key, max_delay=STORE_RETRY_S)
            log.warning("reconcile.retry", error=str(err), delay=delay)
        except Exception:
            outcome = "error"
            delay = self.queue.add_rate_limited(key)
            log.exception("reconcile.failed", retry_in=delay)
        else:
            self.queue.forget(key)
            if result.requeue_after is not None:
                self.queue.add_after(key, result.requeue_after)
        finally:
            metrics.RECONCILES.labels(kind.value, outcome).inc()
            metrics.RECONCILE_SECONDS.labels(kind.value).observe(time.perf_counter() - started)
            structlog.contextvars.unbind_contextvars("reconcile_id", "kind", "name")
