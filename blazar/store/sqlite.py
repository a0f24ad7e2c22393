"""The daemon's durable `Store`: one SQLite file under `$BLAZAR_HOME`.

Objects are rows of JSON (`manifests.to_dict`), keyed by (kind, name); the store-wide
resourceVersion lives in a one-row table so it keeps rising across restarts; events
are an append-only table pruned to the newest `max_events`. WAL with
synchronous=NORMAL: a crash may lose the last commits but never corrupts the file,
and desired state is re-applied from manifests anyway.

A file that is not a readable store (a corrupted page, a truncated copy, another
program's file) does not stop the daemon: it is moved aside, named with the time, a new
store is started, and `recovered_from` says where the old one went, for the daemon to
report. A store that only cannot be opened now (a full disk, an I/O error, a lock
another program holds) is kept as it is and refused with Unavailable: moving it aside
would start the daemon on an empty fleet, and lose what was applied once the disk is
back. A store a newer Blazar wrote (its `user_version` above `SCHEMA_VERSION`) is
refused the same way, and left untouched: this version would write rows in a layout
the newer one may not read, and reset the marker that tells it so.
A row that is not JSON is skipped with a warning, as one that no longer validates is.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from blazar.api import errors
from blazar.api.kinds import Kind
from blazar.store.base import (
    MAX_EVENTS,
    Event,
    TransactionalStore,
    Write,
    utcnow,
)

# The layout of the tables below, kept in SQLite's `user_version`. A change that an
# older version could not read or write correctly raises it.
SCHEMA_VERSION = 1

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS objects (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (kind, name)
);
CREATE TABLE IF NOT EXISTS counters (
    key TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO counters (key, value) VALUES ('resource_version', 0);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    time TEXT NOT NULL,
    type TEXT NOT NULL,
    reason TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    message TEXT NOT NULL,
    uid TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_by_object ON events (kind, name, id);
PRAGMA user_version = {SCHEMA_VERSION};
"""


class SQLiteStore(TransactionalStore):
    def __init__(
        self,
        path: Path,
        *,
        clock: Callable[[], datetime] = utcnow,
        max_events: int = MAX_EVENTS,
    ) -> None:
        super().__init__(clock=clock, max_events=max_events)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.recovered_from: Path | None = None
        self._path = path
        try:
            self._db, self._version = _open(path)
        except sqlite3.DatabaseError as exc:
            if not is_not_a_store(exc):
                raise errors.Unavailable(f"cannot open the store {path}: {exc}") from None
            self.recovered_from = _move_aside(path, clock())
            self._db, self._version = _open(path)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, all or nothing. A write SQLite cannot make (a full
        disk, an I/O error, a lock another program holds, a file damaged under the
        daemon) leaves nothing behind and is raised as Unavailable, which each caller
        reports in its own terms."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                # SQLite rolls some failures back by itself (an I/O error at COMMIT).
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        except sqlite3.DatabaseError as exc:
            if not _about_the_file(exc):
                raise
            raise errors.Unavailable(f"cannot write the store {self._path}: {exc}") from None

    def _read(self, sql: str, parameters: tuple[Any, ...]) -> builtins.list[Any]:
        """The rows of one query. A read SQLite cannot make (an I/O error, a file gone
        or damaged under the daemon) is raised as Unavailable, as a failed write is."""
        try:
            return self._db.execute(sql, parameters).fetchall()
        except sqlite3.DatabaseError as exc:
            if not _about_the_file(exc):
                raise
            raise errors.Unavailable(f"cannot read the store {self._path}: {exc}") from None

    def _load(self, kind: Kind | None, name: str | None) -> builtins.list[dict[str, Any]]:
        # As bytes: a row that is not UTF-8 would otherwise fail inside fetchall, and
        # take every other row down with it.
        rows = self._read(
            "SELECT CAST(kind AS BLOB), CAST(name AS BLOB), CAST(data AS BLOB) FROM objects "
            "WHERE (?1 IS NULL OR kind = ?1) AND (?2 IS NULL OR name = ?2)",
            (kind, name),
        )
        found: builtins.list[dict[str, Any]] = []
        for row_kind, row_name, data in rows:
            try:
                found.append(json.loads(data.decode("utf-8")))
            except (ValueError, RecursionError) as exc:
                self._skip_row(
                    kind=row_kind.decode("utf-8", "replace"),
                    name=row_name.decode("utf-8", "replace"),
                    error=f"not JSON: {exc}",
                )
        return found

    def _commit(self, writes: Sequence[Write], resource_version: int) -> None:
        with self._transaction() as db:
            for kind, name, data in writes:
                if data is None:
                    db.execute("DELETE FROM objects WHERE kind = ? AND name = ?", (kind, name))
                else:
                    db.execute(
                        "INSERT INTO objects (kind, name, data) VALUES (?, ?, ?) "
                        "ON CONFLICT (kind, name) DO UPDATE SET data = excluded.data",
                        (kind, name, json.dumps(data, separators=(",", ":"))),
                    )
            db.execute(
                "UPDATE counters SET value = ? WHERE key = 'resource_version'",
                (resource_version,),
            )
        self._version = resource_version

    def _stored_resource_version(self) -> int:
        return self._version

    def _append_event(self, event: Event) -> None:
        with self._transaction() as db:
            cursor = db.execute(
                "INSERT INTO events (time, type, reason, kind, name, message, uid) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    event.time.isoformat(),
                    event.type,
                    event.reason,
                    event.kind,
                    event.name,
                    event.message,
                    event.uid,
                ),
            )
            # Ids only grow (the oldest rows are the ones deleted), so the newest
            # max_events are exactly those above this bound.
            db.execute(
                "DELETE FROM events WHERE id <= ?", ((cursor.lastrowid or 0) - self._max_events,)
            )

    def _load_events(self, kind: str | None, name: str | None, limit: int) -> builtins.list[Event]:
        rows = self._read(
            "SELECT time, type, reason, kind, name, message, uid FROM events "
            "WHERE (?1 IS NULL OR kind = ?1) AND (?2 IS NULL OR name = ?2) "
            "ORDER BY id DESC LIMIT ?3",
            (kind, name, limit),
        )
        return [
            Event(
                time=datetime.fromisoformat(time),
                type=type_,
                reason=reason,
                kind=kind_,
                name=name_,
                message=message,
                uid=uid,
            )
            for time, type_, reason, kind_, name_, message, uid in reversed(rows)
        ]

    def close(self) -> None:
        with self._lock:
            self._db.close()


# SQLite's primary result codes for a file whose content is not a store it can read.
# Every other code (IOERR, FULL, BUSY, LOCKED, READONLY, CANTOPEN, PERM, ...) is about
# the file's circumstances, not its content.
_NOT_A_STORE = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})


def _about_the_file(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite raised `exc` about the file (its disk, its lock, its content)
    rather than about a statement (a constraint, a misuse), which stays a bug."""
    return type(exc) in (sqlite3.DatabaseError, sqlite3.OperationalError)


class _CheckFailed(sqlite3.DatabaseError):
    """`PRAGMA quick_check` found the file damaged."""


def is_not_a_store(exc: sqlite3.DatabaseError) -> bool:
    """Whether `exc`, raised opening a store, says the file holds no readable store
    (so it may be moved aside), rather than that it cannot be opened now."""
    if isinstance(exc, _CheckFailed):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in _NOT_A_STORE


def _open(path: Path) -> tuple[sqlite3.Connection, int]:
    """The store's connection and resourceVersion; sqlite3.DatabaseError when the file
    is not a store it can read, Unavailable when a newer version wrote it."""
    # One connection shared by every thread; the base class's lock serialises use.
    # Autocommit mode, so transactions are exactly the explicit ones below.
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        # Before anything is written: the schema below would reset a newer marker.
        (schema,) = db.execute("PRAGMA user_version").fetchone()
        if schema > SCHEMA_VERSION:
            raise errors.Unavailable(
                f"cannot open the store {path}: a newer Blazar wrote it (schema {schema}; "
                f"this version reads schema {SCHEMA_VERSION}); run that version, or "
                "another --home"
            )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        columns = {row[1] for row in db.execute("PRAGMA table_info(events)")}
        if "uid" not in columns:  # a store written before events kept their object's uid
            db.execute("ALTER TABLE events ADD COLUMN uid TEXT NOT NULL DEFAULT ''")
        (ok,) = db.execute("PRAGMA quick_check").fetchone()
        if ok != "ok":
            raise _CheckFailed(f"quick_check: {ok}")
        row = db.execute("SELECT value FROM counters WHERE key = 'resource_version'").fetchone()
        return db, int(row[0])
    except BaseException:
        db.close()
        raise


def _move_aside(path: Path, now: datetime) -> Path:
    """Rename the store (and its WAL files) to `<name>.corrupt-<time>`; the new name."""
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        source = path.with_name(path.name + suffix)
        if source.exists():
            source.rename(aside.with_name(aside.name + suffix))
    return aside
