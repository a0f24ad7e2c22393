"""An in-memory `Store` with the same semantics as the SQLite one, for unit tests of
controllers and anything else that needs a store without a file.

Objects are kept in their serialised form, exactly as SQLite keeps them, so both
stores hand out fresh copies and fail in the same way on an object that cannot be
stored.
"""

from __future__ import annotations

import builtins
from collections import deque
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from blazar.api.kinds import Kind
from blazar.store.base import MAX_EVENTS, Event, TransactionalStore, Write, utcnow


class MemoryStore(TransactionalStore):
    def __init__(
        self, *, clock: Callable[[], datetime] = utcnow, max_events: int = MAX_EVENTS
    ) -> None:
        super().__init__(clock=clock, max_events=max_events)
        self._objects: dict[tuple[Kind, str], dict[str, Any]] = {}
        self._version = 0
        self._events: deque[Event] = deque(maxlen=max_events)

    def _load(self, kind: Kind | None, name: str | None) -> builtins.list[dict[str, Any]]:
        return [
            data
            for (k, n), data in self._objects.items()
            if (kind is None or k == kind) and (name is None or n == name)
        ]

    def _commit(self, writes: Sequence[Write], resource_version: int) -> None:
        # Dict assignments cannot fail halfway, so applying in turn is atomic enough.
        for kind, name, data in writes:
            if data is None:
                self._objects.pop((kind, name), None)
            else:
                self._objects[(kind, name)] = data
        self._version = resource_version

    def _stored_resource_version(self) -> int:
        return self._version

    def _append_event(self, event: Event) -> None:
        self._events.append(event)  # the deque's maxlen drops the oldest

    def _load_events(self, kind: str | None, name: str | None, limit: int) -> builtins.list[Event]:
        found = [
            e
            for e in self._events
            if (kind is None or e.kind == kind) and (name is None or e.name == name)
        ]
        return found[-limit:]

    def close(self) -> None:
        pass
