"""The store's contract, and the logic both implementations share.

The store holds desired state (spec, written by `apply`) and observed state (status,
written by the controller through `update_status`), an event log, and a watch: every
committed write is announced to subscribers as ADDED / MODIFIED / DELETED with the
store-wide `resourceVersion` it produced.

`TransactionalStore` implements the whole `Store` protocol on top of a handful of
storage primitives, so the SQLite and in-memory stores differ only in where bytes go.
What `apply` does to one object is decided by the pure `decide_apply`; whether the
resourceVersion its caller expects (a precondition) lets it happen, by the pure
`decide_precondition`; which stored objects a batch prunes, by the pure `decide_prune`.
"""

from __future__ import annotations

import abc
import builtins
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Protocol

import structlog

from blazar.api import clip, errors, kinds, manifests
from blazar.api.errors import FieldError
from blazar.api.kinds import Kind, ObjectStatus, Resource

_log = structlog.get_logger(__name__)

MAX_EVENTS = 10_000
EVENT_TYPES = ("Normal", "Warning")


def utcnow() -> datetime:
    return datetime.now(UTC)


class WatchType(StrEnum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


class ApplyAction(StrEnum):
    CREATED = "created"
    CONFIGURED = "configured"
    UNCHANGED = "unchanged"
    PRUNED = "pruned"


@dataclass(frozen=True)
class ApplyOutcome:
    action: ApplyAction
    object: Resource


@dataclass(frozen=True)
class WatchEvent:
    type: WatchType
    object: Resource
    resource_version: int
    # Only the status changed (a controller wrote it): the spec is as it was.
    status_only: bool = False


@dataclass(frozen=True)
class Event:
    """One line of `blazar events`: something the controller did or refused."""

    time: datetime
    type: str  # "Normal" or "Warning"
    reason: str
    kind: str
    name: str
    message: str
    # The uid of the object it is about, as Kubernetes' involvedObject.uid: a later
    # object of the same name is another object. Empty when the recorder did not know
    # it (and in events stored before it was kept).
    uid: str = ""


# A host's own rules on objects about to be applied, as a Kubernetes validating
# admission webhook has them: the problems it finds, by field path (none: admitted).
Admission = Callable[[Sequence[Resource]], builtins.list[FieldError]]

# Which stored objects a batch's source owns: those of them the batch no longer holds
# are deleted with it (GitOps pruning). None: the batch prunes nothing.
Owns = Callable[[Resource], bool]

# The resourceVersion an apply expects each object it names to be at, by (kind, name):
# Kubernetes' optimistic concurrency. An object not in it is written whatever its version.
Preconditions = Mapping[tuple[Kind, str], int]
NO_PRECONDITIONS: Preconditions = MappingProxyType({})

# Deleted in this order, so that an object goes before those it names (a Lane before
# its Model, SLOPolicy and SpecPair; a SpecPair before its Models): a watcher of the
# store never sees a reference left dangling halfway through a prune.
PRUNE_ORDER: tuple[Kind, ...] = (Kind.LANE, Kind.SPEC_PAIR, Kind.SLO_POLICY, Kind.MODEL)


class Store(Protocol):
    # Consulted by `apply.apply_documents` after the manifests validate (None: none).
    admission: Admission | None

    def apply_all(
        self,
        objs: Sequence[Resource],
        *,
        dry_run: bool = False,
        prune: Owns | None = None,
        preconditions: Preconditions = NO_PRECONDITIONS,
    ) -> builtins.list[ApplyOutcome]:
        """Apply every object, and delete those `prune` owns that the batch does not
        hold (outcome PRUNED), in one commit; or, when an object is not at the version
        `preconditions` expects, raise `errors.Conflict` and write nothing."""
        ...

    def get(self, kind: Kind, name: str) -> Resource | None: ...

    def list(self, kind: Kind | None = None) -> builtins.list[Resource]:
        """Every object of kind (all kinds when None), in (kind, name) order."""
        ...

    def delete(self, kind: Kind, name: str) -> Resource | None: ...

    def update_status(self, kind: Kind, name: str, status: ObjectStatus) -> Resource | None: ...

    def record_event(
        self, *, kind: str, name: str, type: str, reason: str, message: str, uid: str = ""
    ) -> Event:
        """Append an event. Best effort, as Kubernetes' event recorder is: an event the
        store cannot write now is logged and dropped, never raised."""
        ...

    def events(
        self, *, kind: str | None = None, name: str | None = None, limit: int = 200
    ) -> builtins.list[Event]: ...

    def subscribe(self, callback: Callable[[WatchEvent], None]) -> Callable[[], None]: ...

    def list_and_subscribe(
        self, kind: Kind | None, callback: Callable[[WatchEvent], None]
    ) -> tuple[int, builtins.list[Resource], Callable[[], None]]:
        """`list(kind)`, the resourceVersion it is at, and `callback` subscribed in the
        same instant: the callback gets every later change and none the list shows.
        Returns the version, the objects and the unsubscribe."""
        ...

    @property
    def resource_version(self) -> int: ...

    def close(self) -> None: ...


def decide_apply(
    desired: Resource,
    current: Resource | None,
    *,
    now: datetime,
    resource_version: int,
    uid: str,
) -> ApplyOutcome:
    """What applying `desired` over `current` produces; `resource_version` and `uid`
    are used only if the object is written or created.

    Server-set metadata and status always come from `current`: a client re-applying
    the output of `get` cannot move them. `generation` counts spec changes only.
    """
    if current is None:
        meta = desired.metadata.model_copy(
            update={
                "uid": uid,
                "generation": 1,
                "resource_version": resource_version,
                "creation_timestamp": now,
            }
        )
        created = desired.model_copy(
            update={"metadata": meta, "status": kinds.status_class(kinds.key(desired)[0])()}
        )
        return ApplyOutcome(ApplyAction.CREATED, created)
    spec_changed = desired.spec != current.spec
    meta_changed = (desired.metadata.labels, desired.metadata.annotations) != (
        current.metadata.labels,
        current.metadata.annotations,
    )
    if not spec_changed and not meta_changed:
        return ApplyOutcome(ApplyAction.UNCHANGED, current)
    generation = current.metadata.generation or 0
    meta = current.metadata.model_copy(
        update={
            "labels": dict(desired.metadata.labels),
            "annotations": dict(desired.metadata.annotations),
            "generation": generation + 1 if spec_changed else generation,
            "resource_version": resource_version,
        }
    )
    configured = desired.model_copy(update={"metadata": meta, "status": current.status})
    return ApplyOutcome(ApplyAction.CONFIGURED, configured)


def decide_precondition(
    kind: Kind, name: str, expected: int, current: Resource | None
) -> errors.Conflict | None:
    """Why an apply that expects `kind/name` at resourceVersion `expected` must not
    happen, given the stored `current`; None when the object is at that version."""
    if current is None:
        return errors.Conflict.gone(kind=kind.value, name=name, expected=expected)
    now = current.metadata.resource_version or 0
    if now != expected:
        return errors.Conflict.stale(kind=kind.value, name=name, expected=expected, current=now)
    return None


def decide_prune(
    stored: Sequence[Resource], batch: Sequence[Resource], owns: Owns
) -> builtins.list[Resource]:
    """The stored objects `owns` claims that `batch` no longer holds, in `PRUNE_ORDER`
    (then by name)."""
    keep = {kinds.key(o) for o in batch}
    gone = [o for o in stored if kinds.key(o) not in keep and owns(o)]
    return sorted(gone, key=lambda o: (PRUNE_ORDER.index(Kind(o.kind)), o.metadata.name))


# One write inside a commit: the new serialised object, or None to delete.
Write = tuple[Kind, str, dict[str, Any] | None]


class TransactionalStore(abc.ABC):
    """`Store` semantics over storage primitives that subclasses provide.

    One re-entrant lock serialises every operation, and subscribers are called while
    it is held, right after the commit: they see events in resourceVersion order and
    may read the store, but must be quick (hand the event to a queue and return).
    """

    def __init__(
        self, *, clock: Callable[[], datetime] = utcnow, max_events: int = MAX_EVENTS
    ) -> None:
        self._clock = clock
        self._max_events = max_events
        self.admission: Admission | None = None
        self._lock = threading.RLock()
        self._subscribers: builtins.list[Callable[[WatchEvent], None]] = []
        # Rows skipped as unreadable since `unreadable_rows` last looked: (kind, name)
        # to why.
        self._skipped: dict[tuple[str, str], str] = {}

    # --- primitives ------------------------------------------------------------------

    @abc.abstractmethod
    def _load(self, kind: Kind | None, name: str | None) -> builtins.list[dict[str, Any]]:
        """Stored objects of `kind` (all kinds if None), only `name` if given."""

    @abc.abstractmethod
    def _commit(self, writes: Sequence[Write], resource_version: int) -> None:
        """Apply every write and set the store's resourceVersion, all or nothing."""

    @abc.abstractmethod
    def _stored_resource_version(self) -> int: ...

    @abc.abstractmethod
    def _append_event(self, event: Event) -> None:
        """Keep `event`, dropping the oldest beyond `self._max_events`."""

    @abc.abstractmethod
    def _load_events(self, kind: str | None, name: str | None, limit: int) -> builtins.list[Event]:
        """The newest `limit` matching events, oldest first."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # --- the Store protocol ----------------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._stored_resource_version()

    def apply_all(
        self,
        objs: Sequence[Resource],
        *,
        dry_run: bool = False,
        prune: Owns | None = None,
        preconditions: Preconditions = NO_PRECONDITIONS,
    ) -> builtins.list[ApplyOutcome]:
        with self._lock:
            # Checked against what is stored, under the lock that the commit below
            # holds too: no write can come between the check and this batch's own.
            for (kind, name), expected in preconditions.items():
                conflict = decide_precondition(kind, name, expected, self._get(kind, name))
                if conflict is not None:
                    raise conflict
            now = self._clock()
            version = self._stored_resource_version()
            # Deletions first, in their own order: what goes stops serving before what
            # changes is read, and nothing it named is gone before it.
            pruned: builtins.list[ApplyOutcome] = []
            deletes: builtins.list[Write] = []
            for gone in decide_prune(self.list(), objs, prune) if prune is not None else ():
                version += 1
                pruned.append(ApplyOutcome(ApplyAction.PRUNED, gone))
                deletes.append((*kinds.key(gone), None))
            # Later objects in the batch see the earlier ones, as if applied in turn.
            staged: dict[tuple[Kind, str], Resource] = {}
            outcomes: builtins.list[ApplyOutcome] = []
            writes: builtins.list[Write] = []
            for obj in objs:
                key = kinds.key(obj)
                current = staged[key] if key in staged else self._get(*key)
                outcome = decide_apply(
                    obj, current, now=now, resource_version=version + 1, uid=str(uuid.uuid4())
                )
                if outcome.action is not ApplyAction.UNCHANGED:
                    version += 1
                    # Serialise (and read back) everything before the commit starts:
                    # an object that cannot be stored fails the whole batch, dry run
                    # included, with nothing written; and no caller object is shared.
                    data = manifests.to_dict(outcome.object)
                    outcome = ApplyOutcome(outcome.action, manifests.from_dict(data))
                    staged[key] = outcome.object
                    writes.append((*key, data))
                outcomes.append(outcome)
            if dry_run or not (writes or deletes):
                return pruned + outcomes
            self._commit(deletes + writes, version)
            first = version - len(writes) - len(deletes) + 1
            events = [
                WatchEvent(WatchType.DELETED, o.object, first + i) for i, o in enumerate(pruned)
            ] + [
                WatchEvent(
                    WatchType.ADDED if o.action is ApplyAction.CREATED else WatchType.MODIFIED,
                    o.object,
                    o.object.metadata.resource_version or 0,
                )
                for o in outcomes
                if o.action is not ApplyAction.UNCHANGED
            ]
            self._notify(events)
            return pruned + outcomes

    def get(self, kind: Kind, name: str) -> Resource | None:
        with self._lock:
            return self._get(kind, name)

    def list(self, kind: Kind | None = None) -> builtins.list[Resource]:
        with self._lock:
            found = [r for d in self._load(kind, None) if (r := self._resource(d)) is not None]
        return sorted(found, key=kinds.key)

    def delete(self, kind: Kind, name: str) -> Resource | None:
        with self._lock:
            current = self._get(kind, name)
            if current is None:
                return None
            version = self._stored_resource_version() + 1
            self._commit([(kind, name, None)], version)
            self._notify([WatchEvent(WatchType.DELETED, current, version)])
            return current

    def update_status(self, kind: Kind, name: str, status: ObjectStatus) -> Resource | None:
        expected = kinds.status_class(kind)
        if type(status) is not expected:
            raise errors.InvalidRequest(
                f"{kind} status must be a {expected.__name__}, not {type(status).__name__}"
            )
        with self._lock:
            current = self._get(kind, name)
            if current is None or current.status == status:
                return current
            version = self._stored_resource_version() + 1
            meta = current.metadata.model_copy(update={"resource_version": version})
            data = manifests.to_dict(
                current.model_copy(update={"status": status, "metadata": meta})
            )
            self._commit([(kind, name, data)], version)
            # Rebuilt from the stored form so the caller's status object is not shared.
            updated = manifests.from_dict(data)
            self._notify([WatchEvent(WatchType.MODIFIED, updated, version, status_only=True)])
            return updated

    def record_event(
        self, *, kind: str, name: str, type: str, reason: str, message: str, uid: str = ""
    ) -> Event:
        if type not in EVENT_TYPES:
            raise errors.InvalidRequest(f'event type must be "Normal" or "Warning", not "{type}"')
        event = Event(
            time=self._clock(),
            type=type,
            reason=clip.clip(reason, clip.NAME_CHARS),
            kind=clip.clip(kind, clip.NAME_CHARS),
            name=clip.clip(name, clip.NAME_CHARS),
            message=clip.clip(message, clip.EVENT_CHARS),
            uid=clip.clip(uid, clip.NAME_CHARS),
        )
        with self._lock:
            try:
                self._append_event(event)
            except errors.Unavailable as err:
                # An event is a record, not state: one the store cannot take now (a
                # full disk) is dropped and said in the log, so that no reconcile
                # stops at its bookkeeping before the effect it reports.
                _log.warning(
                    "store.event_dropped", kind=kind, name=name, reason=reason, error=str(err)
                )
        return event

    def events(
        self, *, kind: str | None = None, name: str | None = None, limit: int = 200
    ) -> builtins.list[Event]:
        if limit <= 0:
            return []
        with self._lock:
            return self._load_events(kind, name, limit)

    def subscribe(self, callback: Callable[[WatchEvent], None]) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def list_and_subscribe(
        self, kind: Kind | None, callback: Callable[[WatchEvent], None]
    ) -> tuple[int, builtins.list[Resource], Callable[[], None]]:
        # Under the lock that every commit and its notification hold: no change comes
        # between the list and the subscription.
        with self._lock:
            return self._stored_resource_version(), self.list(kind), self.subscribe(callback)

    def unreadable_rows(self) -> dict[tuple[str, str], str]:
        """Every stored row this version cannot read, by (kind, name), with why. Such
        an object is in no list and no get (a version that wrote a field this one does
        not know, say); the daemon says so in events at its start, so that it does not
        vanish with only a log line to tell."""
        with self._lock:
            self._skipped.clear()
            self.list()
            return dict(self._skipped)

    # --- internals -------------------------------------------------------------------

    def _get(self, kind: Kind, name: str) -> Resource | None:
        found = self._load(kind, name)
        return self._resource(found[0]) if found else None

    def _notify(self, events: Sequence[WatchEvent]) -> None:
        # The write is committed; a failing subscriber must not undo it for the others.
        for event in events:
            for callback in builtins.list(self._subscribers):
                try:
                    callback(event)
                except Exception:
                    _log.exception(
                        "watch callback failed",
                        kind=event.object.kind,
                        name=event.object.metadata.name,
                    )

    def _resource(self, data: dict[str, Any]) -> Resource | None:
        """A stored row as its resource; None, and a warning naming it, when the row no
        longer validates (written by another version, or damaged): one bad row must
        not stop the daemon or hide the others. Applying the object again replaces it."""
        try:
            return manifests.from_dict(data)
        except ValueError as exc:
            meta = data.get("metadata") if isinstance(data, dict) else None
            self._skip_row(
                kind=str(data.get("kind", "?")) if isinstance(data, dict) else "?",
                name=str(meta.get("name", "?")) if isinstance(meta, dict) else "?",
                error=str(exc),
            )
            return None

    def _skip_row(self, *, kind: str, name: str, error: str) -> None:
        """Warn of a stored row that is skipped: one that no longer validates, or one a
        backend cannot even decode; `unreadable_rows` reports it too."""
        kind, name, error = kind[:64], name[: clip.NAME_CHARS], clip.clip(error, clip.FIELD_CHARS)
        _log.warning("store.row_invalid", kind=kind, name=name, error=error)
        self._skipped[(kind, name)] = error
