"""The Store contract, run against MemoryStore and SQLiteStore alike."""

from __future__ import annotations

import json
import resource
import sqlite3
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pydantic_core
import pytest
import structlog

from blazar.api import conditions, errors, kinds, manifests
from blazar.api.kinds import Kind
from blazar.api.meta import ConditionStatus, ObjectMeta
from blazar.store import sqlite
from blazar.store.base import (
    ApplyAction,
    ApplyOutcome,
    Store,
    WatchEvent,
    WatchType,
    decide_apply,
    decide_precondition,
)
from blazar.store.memory import MemoryStore
from blazar.store.sqlite import SQLiteStore
from tests.unit.helpers import T0, Clock

MakeStore = Callable[..., Store]


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeStore]:
    opened: list[Store] = []

    def make(**kwargs: object) -> Store:
        store: Store
        if request.param == "memory":
            store = MemoryStore(**kwargs)  # type: ignore[arg-type]
        else:
            store = SQLiteStore(tmp_path / "state" / "blazar.db", **kwargs)  # type: ignore[arg-type]
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(make_store: MakeStore, clock: Clock) -> Store:
    return make_store(clock=clock)


@pytest.fixture
def seen(store: Store) -> list[WatchEvent]:
    events: list[WatchEvent] = []
    store.subscribe(events.append)
    return events


def lane(
    name: str = "gemma",
    *,
    replicas: int = 1,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> kinds.Lane:
    return kinds.Lane(
        metadata=ObjectMeta(name=name, labels=labels or {}, annotations=annotations or {}),
        spec=kinds.LaneSpec(model="gemma3-270m", replicas=replicas),
    )


def model(name: str = "gemma3-270m", **labels: str) -> kinds.Model:
    return kinds.Model(
        metadata=ObjectMeta(name=name, labels=labels),
        spec=kinds.ModelSpec(source=kinds.ModelSource(path="/m.gguf")),
    )


def ready_status(generation: int = 1) -> kinds.LaneStatus:
    return kinds.LaneStatus(
        observed_generation=generation,
        ready_replicas=1,
        conditions=conditions.set_condition(
            [],
            type="Ready",
            status=ConditionStatus.TRUE,
            reason="ReplicasReady",
            message="1 of 1 replicas ready.",
            observed_generation=generation,
            now=T0,
        ),
    )


def actions(outcomes: list[ApplyOutcome]) -> list[str]:
    return [o.action for o in outcomes]


# --- apply -----------------------------------------------------------------------


def test_create_sets_server_metadata(store: Store, seen: list[WatchEvent]) -> None:
    [outcome] = store.apply_all([lane()])
    assert outcome.action is ApplyAction.CREATED
    meta = outcome.object.metadata
    assert meta.generation == 1
    assert meta.resource_version == 1 == store.resource_version
    assert meta.creation_timestamp == T0
    assert meta.uid and len(meta.uid) == 36
    assert store.get(Kind.LANE, "gemma") == outcome.object
    assert [(e.type, e.resource_version) for e in seen] == [(WatchType.ADDED, 1)]


def test_configure_and_unchanged(store: Store, clock: Clock, seen: list[WatchEvent]) -> None:
    [created] = store.apply_all([lane()])
    clock.tick()
    assert actions(store.apply_all([lane()])) == [ApplyAction.UNCHANGED]
    assert store.resource_version == 1

    [spec_change] = store.apply_all([lane(replicas=2)])
    assert spec_change.action is ApplyAction.CONFIGURED
    assert (
        spec_change.object.metadata.generation,
        spec_change.object.metadata.resource_version,
    ) == (
        2,
        2,
    )
    [label_change] = store.apply_all([lane(replicas=2, labels={"team": "a"})])
    assert label_change.action is ApplyAction.CONFIGURED
    assert (
        label_change.object.metadata.generation,
        label_change.object.metadata.resource_version,
    ) == (
        2,
        3,
    )
    [annotation_change] = store.apply_all(
        [lane(replicas=2, labels={"team": "a"}, annotations={"note": "x"})]
    )
    assert annotation_change.object.metadata.generation == 2
    stored = store.get(Kind.LANE, "gemma")
    assert stored is not None
    # Identity and creation time never move.
    assert stored.metadata.uid == created.object.metadata.uid
    assert stored.metadata.creation_timestamp == T0
    assert [e.type for e in seen] == [WatchType.ADDED] + [WatchType.MODIFIED] * 3
    assert [e.resource_version for e in seen] == [1, 2, 3, 4]


def test_apply_ignores_client_server_metadata_and_status(store: Store) -> None:
    [created] = store.apply_all([lane()])
    store.update_status(Kind.LANE, "gemma", ready_status())
    forged = lane(replicas=3).model_copy(
        update={
            "metadata": ObjectMeta(name="gemma", uid="forged", generation=40, resource_version=99),
            "status": kinds.LaneStatus(replicas=7),
        }
    )
    [outcome] = store.apply_all([forged])
    assert outcome.object.metadata.uid == created.object.metadata.uid
    assert outcome.object.metadata.generation == 2
    assert outcome.object.status == ready_status()


def test_batch_is_applied_in_order(store: Store, seen: list[WatchEvent]) -> None:
    outcomes = store.apply_all([model(), lane("a"), lane("a", replicas=2), lane("b")])
    assert actions(outcomes) == ["created", "created", "configured", "created"]
    assert [o.object.metadata.resource_version for o in outcomes] == [1, 2, 3, 4]
    got = store.get(Kind.LANE, "a")
    assert got is not None and got.metadata.generation == 2
    assert [e.type for e in seen] == ["ADDED", "ADDED", "MODIFIED", "ADDED"]


def test_dry_run_computes_outcomes_and_writes_nothing(store: Store, seen: list[WatchEvent]) -> None:
    store.apply_all([lane()])
    seen.clear()
    outcomes = store.apply_all([lane(replicas=5), lane("new"), model()], dry_run=True)
    assert actions(outcomes) == ["configured", "created", "created"]
    assert outcomes[0].object.metadata.generation == 2
    assert store.resource_version == 1
    assert seen == []
    got = store.get(Kind.LANE, "gemma")
    assert isinstance(got, kinds.Lane) and got.spec.replicas == 1
    assert [kinds.key(o) for o in store.list()] == [(Kind.LANE, "gemma")]


def test_apply_all_is_atomic(store: Store, seen: list[WatchEvent]) -> None:
    # A spec that cannot be serialised fails the batch before anything is written.
    broken = kinds.Lane.model_construct(
        api_version="blazar.dev/v1alpha1",
        kind="Lane",
        metadata=ObjectMeta(name="broken"),
        spec=kinds.LaneSpec.model_construct(model=object()),
        status=kinds.LaneStatus(),
    )
    for dry_run in (False, True):
        with pytest.raises(pydantic_core.PydanticSerializationError):
            store.apply_all([model(), broken], dry_run=dry_run)
    assert store.list() == []
    assert store.resource_version == 0
    assert seen == []


def test_decide_apply_is_pure() -> None:
    outcome = decide_apply(lane(), None, now=T0, resource_version=7, uid="u")
    assert outcome.action is ApplyAction.CREATED
    assert outcome.object.metadata.uid == "u"
    again = decide_apply(lane(), outcome.object, now=T0, resource_version=8, uid="v")
    assert again.action is ApplyAction.UNCHANGED
    assert again.object is outcome.object


# --- status ----------------------------------------------------------------------


def test_status_path(store: Store, seen: list[WatchEvent]) -> None:
    store.apply_all([lane()])
    updated = store.update_status(Kind.LANE, "gemma", ready_status())
    assert updated is not None
    assert isinstance(updated, kinds.Lane)
    assert updated.status == ready_status()
    assert (updated.metadata.generation, updated.metadata.resource_version) == (1, 2)
    assert seen[-1].type is WatchType.MODIFIED and seen[-1].resource_version == 2
    # Equal status: no write, no event.
    same = store.update_status(Kind.LANE, "gemma", ready_status())
    assert same is not None and same.metadata.resource_version == 2
    assert len(seen) == 2
    # Spec apply keeps status.
    [outcome] = store.apply_all([lane(replicas=2)])
    assert outcome.object.status == ready_status()
    got = store.get(Kind.LANE, "gemma")
    assert got is not None and got.status == ready_status()


def test_status_of_missing_object_is_none(store: Store, seen: list[WatchEvent]) -> None:
    assert store.update_status(Kind.LANE, "gone", ready_status()) is None
    assert seen == []
    assert store.resource_version == 0


def test_status_of_wrong_kind_is_refused(store: Store) -> None:
    store.apply_all([model()])
    with pytest.raises(errors.InvalidRequest, match="ModelStatus"):
        store.update_status(Kind.MODEL, "gemma3-270m", ready_status())


# --- read, delete ----------------------------------------------------------------


def test_list_sorted_with_label_selector(store: Store) -> None:
    store.apply_all(
        [
            lane("b", labels={"team": "x"}),
            model("m2", team="x", tier="gold"),
            lane("a", labels={"team": "y"}),
            model("m1"),
        ]
    )
    assert [kinds.key(o) for o in store.list()] == [
        (Kind.LANE, "a"),
        (Kind.LANE, "b"),
        (Kind.MODEL, "m1"),
        (Kind.MODEL, "m2"),
    ]
    assert [o.metadata.name for o in store.list(Kind.MODEL)] == ["m1", "m2"]
    assert store.list(Kind.SPEC_PAIR) == []
    assert store.get(Kind.MODEL, "nope") is None


def test_reads_return_copies(store: Store) -> None:
    store.apply_all([lane(labels={"a": "1"})])
    got = store.get(Kind.LANE, "gemma")
    assert got is not None
    got.metadata.labels["a"] = "changed"
    again = store.get(Kind.LANE, "gemma")
    assert again is not None and again.metadata.labels == {"a": "1"}


def test_delete(store: Store, seen: list[WatchEvent]) -> None:
    store.apply_all([lane(), model()])
    deleted = store.delete(Kind.LANE, "gemma")
    assert deleted is not None and deleted.metadata.name == "gemma"
    assert store.get(Kind.LANE, "gemma") is None
    assert store.delete(Kind.LANE, "gemma") is None
    assert [(e.type, e.resource_version) for e in seen][-1] == (WatchType.DELETED, 3)
    assert len(seen) == 3
    # Re-creating gets a new identity.
    [again] = store.apply_all([lane()])
    assert again.action is ApplyAction.CREATED
    assert again.object.metadata.uid != deleted.metadata.uid


# --- watch -----------------------------------------------------------------------


def test_unsubscribe_and_failing_callbacks(store: Store) -> None:
    first: list[WatchEvent] = []
    last: list[WatchEvent] = []

    def explode(event: WatchEvent) -> None:
        raise RuntimeError("subscriber bug")

    store.subscribe(first.append)
    store.subscribe(explode)
    unsubscribe = store.subscribe(last.append)
    [outcome] = store.apply_all([lane()])
    assert outcome.action is ApplyAction.CREATED
    assert store.get(Kind.LANE, "gemma") is not None
    assert len(first) == len(last) == 1
    unsubscribe()
    unsubscribe()  # idempotent
    store.apply_all([lane(replicas=2)])
    assert (len(first), len(last)) == (2, 1)


def test_callbacks_may_read_the_store(store: Store) -> None:
    read: list[int | None] = []

    def on_event(event: WatchEvent) -> None:
        got = store.get(Kind.LANE, event.object.metadata.name)
        read.append(got.metadata.resource_version if got else None)

    store.subscribe(on_event)
    store.apply_all([lane()])
    store.delete(Kind.LANE, "gemma")
    assert read == [1, None]


def test_concurrent_writers_get_distinct_versions(store: Store) -> None:
    versions: list[int] = []
    store.subscribe(lambda e: versions.append(e.resource_version))

    def write(i: int) -> None:
        for n in range(10):
            store.apply_all([lane(f"l{i}-{n}")])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert versions == list(range(1, 41))
    assert len(store.list(Kind.LANE)) == 40


# --- events ----------------------------------------------------------------------


def test_events_order_filter_and_limit(store: Store, clock: Clock) -> None:
    for i in range(5):
        clock.tick()
        store.record_event(
            kind="Lane", name=f"l{i % 2}", type="Normal", reason="Scaled", message=f"m{i}"
        )
    event = store.record_event(
        kind="Model", name="m", type="Warning", reason="ChecksumMismatch", message="bad"
    )
    assert (event.time, event.type) == (T0 + timedelta(seconds=5), "Warning")
    assert [e.message for e in store.events()] == ["m0", "m1", "m2", "m3", "m4", "bad"]
    assert [e.message for e in store.events(limit=2)] == ["m4", "bad"]
    assert [e.message for e in store.events(kind="Lane", name="l0")] == ["m0", "m2", "m4"]
    assert [e.message for e in store.events(kind="Lane", limit=1)] == ["m4"]
    assert store.events(limit=0) == []
    assert store.events()[0].time == T0 + timedelta(seconds=1)
    with pytest.raises(errors.InvalidRequest):
        store.record_event(kind="Lane", name="x", type="Error", reason="R", message="m")


def test_events_keep_the_uid_of_their_object(store: Store) -> None:
    store.record_event(kind="Lane", name="l", type="Normal", reason="A", message="a", uid="u1")
    store.record_event(kind="Lane", name="l", type="Normal", reason="B", message="b")
    assert [(e.reason, e.uid) for e in store.events()] == [("A", "u1"), ("B", "")]


def test_a_store_whose_events_have_no_uid_column_gains_it(tmp_path: Path, clock: Clock) -> None:
    """A home written before events kept their object's uid: its events stay, with
    none, and new ones keep theirs."""
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE events (id INTEGER PRIMARY KEY, time TEXT NOT NULL, "
            "type TEXT NOT NULL, reason TEXT NOT NULL, kind TEXT NOT NULL, "
            "name TEXT NOT NULL, message TEXT NOT NULL)"
        )
        db.execute(
            "INSERT INTO events (time, type, reason, kind, name, message) "
            "VALUES (?, 'Normal', 'Old', 'Lane', 'l', 'before')",
            (T0.isoformat(),),
        )
    db.close()
    store = SQLiteStore(path, clock=clock)
    try:
        store.record_event(kind="Lane", name="l", type="Normal", reason="New", message="m", uid="u")
        assert [(e.reason, e.uid) for e in store.events()] == [("Old", ""), ("New", "u")]
    finally:
        store.close()


def test_events_are_pruned_oldest_first(make_store: MakeStore) -> None:
    store = make_store(max_events=3)
    for i in range(5):
        store.record_event(kind="Lane", name="l", type="Normal", reason="R", message=str(i))
    assert [e.message for e in store.events()] == ["2", "3", "4"]


# --- persistence -----------------------------------------------------------------


def test_sqlite_survives_reopen(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "deep" / "dir" / "blazar.db"
    store = SQLiteStore(path, clock=clock)
    store.apply_all([lane(), model()])
    store.update_status(Kind.LANE, "gemma", ready_status())
    store.record_event(kind="Lane", name="gemma", type="Normal", reason="Started", message="ok")
    store.delete(Kind.MODEL, "gemma3-270m")
    before = store.list()
    store.close()

    reopened = SQLiteStore(path, clock=clock)
    try:
        assert reopened.list() == before
        assert reopened.resource_version == 4
        assert [e.reason for e in reopened.events()] == ["Started"]
        assert reopened.events()[0].time == T0
        [outcome] = reopened.apply_all([lane(replicas=3)])
        assert outcome.object.metadata.resource_version == 5
        assert outcome.object.metadata.generation == 2
        assert outcome.object.status == ready_status()
    finally:
        reopened.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        [(data,)] = db.execute("SELECT data FROM objects").fetchall()
    assert json.loads(data) == manifests.to_dict(outcome.object)


def test_sqlite_commit_rolls_back_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "blazar.db"
    store = SQLiteStore(path)
    good = manifests.to_dict(lane("a"))
    # The second row fails to encode inside the transaction, after the first is written.
    with pytest.raises(TypeError):
        store._commit(
            [(Kind.LANE, "a", good), (Kind.LANE, "b", {"bad": object()})], resource_version=2
        )
    assert store.list() == []
    assert store.resource_version == 0
    store.close()
    reopened = SQLiteStore(path)
    assert (reopened.list(), reopened.resource_version) == ([], 0)
    reopened.close()


def test_an_invalid_row_is_skipped_and_replaced_by_the_next_apply(tmp_path: Path) -> None:
    """A row written by another version (or damaged) must not stop the daemon or hide
    the others."""
    path = tmp_path / "blazar.db"
    store = SQLiteStore(path)
    store.apply_all([lane("a"), lane("b")])
    store.close()
    with sqlite3.connect(path) as db:
        broken = {**manifests.to_dict(lane("b")), "spec": {"replicas": "many"}}
        db.execute("UPDATE objects SET data = ? WHERE name = 'b'", (json.dumps(broken),))
    reopened = SQLiteStore(path)
    try:
        assert [o.metadata.name for o in reopened.list()] == ["a"]
        assert reopened.get(Kind.LANE, "b") is None
        [(key, why)] = reopened.unreadable_rows().items()
        assert key == ("Lane", "b") and "replicas" in why, why
        [outcome] = reopened.apply_all([lane("b", replicas=2)])
        assert outcome.object.spec.replicas == 2
        assert [o.metadata.name for o in reopened.list()] == ["a", "b"]
        assert reopened.unreadable_rows() == {}  # replaced: readable again
    finally:
        reopened.close()


@pytest.mark.parametrize(
    "data",
    [b"{not json", b"\xff\xfe{}", b"[" * 100_000, b'{"kind": "Lane"'],
    ids=["not-json", "not-utf8", "too-deep", "truncated"],
)
def test_a_row_that_is_not_json_is_skipped_with_a_warning(tmp_path: Path, data: bytes) -> None:
    """A row that cannot even be decoded is skipped and reported as an invalid one is;
    it must not stop the daemon from starting or hide the other rows."""
    path = tmp_path / "blazar.db"
    store = SQLiteStore(path)
    store.apply_all([lane("a"), lane("b")])
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE objects SET data = CAST(? AS TEXT) WHERE name = 'b'", (data,))
    reopened = SQLiteStore(path)
    try:
        with structlog.testing.capture_logs() as logs:
            assert [o.metadata.name for o in reopened.list()] == ["a"]
            assert reopened.get(Kind.LANE, "b") is None
        assert [(e["event"], e["kind"], e["name"]) for e in logs] == [
            ("store.row_invalid", "Lane", "b")
        ] * 2
        assert all(e["error"].startswith("not JSON") for e in logs), logs
        assert list(reopened.unreadable_rows()) == [("Lane", "b")]
        [outcome] = reopened.apply_all([lane("b", replicas=2)])
        assert outcome.object.spec.replicas == 2
        assert [o.metadata.name for o in reopened.list()] == ["a", "b"]
    finally:
        reopened.close()


def test_a_file_that_is_not_a_store_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "blazar.db"
    path.write_bytes(b"\x00garbage" * 512)
    store = SQLiteStore(path)
    try:
        assert store.recovered_from is not None
        assert store.recovered_from.read_bytes() == b"\x00garbage" * 512
        assert store.list() == [] and store.resource_version == 0
    finally:
        store.close()
    again = SQLiteStore(path)
    assert again.recovered_from is None
    again.close()


@pytest.mark.parametrize(
    ("code", "not_a_store"),
    [
        (sqlite3.SQLITE_NOTADB, True),
        (sqlite3.SQLITE_CORRUPT, True),
        (sqlite3.SQLITE_IOERR, False),
        (sqlite3.SQLITE_FULL, False),
        (sqlite3.SQLITE_BUSY, False),
        (sqlite3.SQLITE_LOCKED, False),
        (sqlite3.SQLITE_READONLY, False),
        (sqlite3.SQLITE_CANTOPEN, False),
        (sqlite3.SQLITE_PERM, False),
    ],
)
def test_only_corruption_says_a_file_is_not_a_store(code: int, not_a_store: bool) -> None:
    exc = sqlite3.DatabaseError("from SQLite")
    exc.sqlite_errorcode = code | (3 << 8)  # an extended code: the primary is its low byte
    assert sqlite.is_not_a_store(exc) is not_a_store


def test_a_store_that_cannot_be_written_is_refused_and_kept(tmp_path: Path) -> None:
    """A full disk (here the file size limit) at start says nothing of the store: it is
    not moved aside for a new, empty one, which would lose the fleet once space is back."""
    path = tmp_path / "blazar.db"
    store = SQLiteStore(path)
    store.apply_all([lane("a")])
    store.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        with pytest.raises(errors.Unavailable, match="cannot open the store"):
            SQLiteStore(path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert [p.name for p in tmp_path.iterdir() if "corrupt" in p.name] == []
    again = SQLiteStore(path)
    try:
        assert again.recovered_from is None
        assert [o.metadata.name for o in again.list()] == ["a"]
    finally:
        again.close()


def test_a_store_a_newer_version_wrote_is_refused_and_kept(tmp_path: Path) -> None:
    """A downgrade over a home a newer Blazar used: its store is neither opened (this
    version would write rows it cannot lay out as the newer one reads them) nor marked
    as this version's, nor moved aside; the newer version opens it as it left it."""
    path = tmp_path / "state.db"
    store = SQLiteStore(path)
    store.apply_all([lane("a")])
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 1000")
    db.close()
    with pytest.raises(errors.Unavailable, match=r"a newer Blazar wrote it \(schema 1000;"):
        SQLiteStore(path)
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (1000,)
        assert db.execute("SELECT name FROM objects").fetchall() == [("a",)]
    db.close()
    assert [p.name for p in tmp_path.iterdir() if "corrupt" in p.name] == []


def test_a_write_the_disk_refuses_is_unavailable_and_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "blazar.db"
    store = SQLiteStore(path)
    try:
        store.apply_all([lane("a")])
        before = store.resource_version
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (path.with_name("blazar.db-wal").stat().st_size, hard)
        )
        try:
            with pytest.raises(errors.Unavailable, match="cannot write the store"):
                store.apply_all([lane("a", replicas=2), lane("b")])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert store.resource_version == before
        assert [(o.metadata.name, o.spec.replicas) for o in store.list()] == [("a", 1)]
        # Once there is room again, the same store takes writes.
        store.apply_all([lane("b")])
        assert [o.metadata.name for o in store.list()] == ["a", "b"]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("exc", "about_the_file"),
    [
        (sqlite3.DatabaseError("database disk image is malformed"), True),
        (sqlite3.OperationalError("disk I/O error"), True),
        (sqlite3.IntegrityError("UNIQUE constraint failed"), False),
        (sqlite3.ProgrammingError("Incorrect number of bindings"), False),
    ],
)
def test_only_failures_of_the_file_are_unavailable(
    exc: sqlite3.DatabaseError, about_the_file: bool
) -> None:
    """A statement's own mistake stays a bug (INTERNAL), never 'cannot read the store'."""
    assert sqlite._about_the_file(exc) is about_the_file


def test_an_event_the_disk_refuses_is_dropped_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "blazar.db"
    store = SQLiteStore(path)
    try:
        store.record_event(kind="Lane", name="a", type="Normal", reason="Kept", message="1")
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (path.with_name("blazar.db-wal").stat().st_size, hard)
        )
        try:
            event = store.record_event(
                kind="Lane", name="a", type="Warning", reason="Dropped", message="x" * 50_000
            )
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert event.reason == "Dropped"
        assert [e.reason for e in store.events()] == ["Kept"]
        store.record_event(kind="Lane", name="a", type="Normal", reason="Again", message="2")
        assert [e.reason for e in store.events()] == ["Kept", "Again"]
    finally:
        store.close()


def test_a_store_damaged_while_open_refuses_reads_and_writes_as_unavailable(
    tmp_path: Path,
) -> None:
    """Damage found after the start is kept, not moved aside: the caller is told the
    store cannot be read, in its own terms, rather than an unexpected error."""
    path = tmp_path / "blazar.db"
    store = SQLiteStore(path)
    try:
        store.apply_all([lane(f"lane-{i}") for i in range(200)])
        # Another connection's commit makes this one drop its page cache and read
        # the file again, as it would after any change it did not make itself.
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("UPDATE counters SET value = value")
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        other.close()
        pages = path.stat().st_size // 4096
        with path.open("r+b") as f:
            f.seek(4096)  # every page but the header's
            f.write(b"garbage!" * 512 * (pages - 1))
        with pytest.raises(errors.Unavailable, match=r"cannot read the store .*malformed"):
            store.list()
        with pytest.raises(errors.Unavailable, match="cannot read the store"):
            store.events()
        with pytest.raises(errors.Unavailable, match=r"cannot (read|write) the store"):
            store.apply_all([lane("new")])
    finally:
        store.close()
    assert [p.name for p in tmp_path.iterdir() if "corrupt" in p.name] == []


def test_a_store_with_a_damaged_page_is_moved_aside(tmp_path: Path) -> None:
    """SQLite opens it; its quick_check finds the damage, which is the file's content."""
    path = tmp_path / "blazar.db"
    store = SQLiteStore(path)
    store.apply_all([lane(f"lane-{i}") for i in range(200)])
    store.close()
    with path.open("r+b") as f:
        f.seek(2 * 4096)  # page 3: a b-tree page, past the header SQLite checks on open
        f.write(b"garbage!" * 512)
    again = SQLiteStore(path)
    try:
        assert again.recovered_from is not None and again.list() == []
    finally:
        again.close()


# --- resourceVersion preconditions (optimistic concurrency) ---------------------------


def test_a_precondition_at_the_current_version_applies(store: Store) -> None:
    [created] = store.apply_all([lane()])
    store.update_status(Kind.LANE, "gemma", ready_status())
    current = store.get(Kind.LANE, "gemma")
    assert current is not None and current.metadata.resource_version == 2
    [outcome] = store.apply_all([lane(replicas=2)], preconditions={(Kind.LANE, "gemma"): 2})
    assert outcome.action is ApplyAction.CONFIGURED
    assert outcome.object.metadata.resource_version == 3
    assert created.object.metadata.uid == outcome.object.metadata.uid


def test_a_stale_precondition_refuses_the_apply(store: Store, seen: list[WatchEvent]) -> None:
    store.apply_all([lane()])
    store.apply_all([lane(replicas=3)])  # someone else's change, at version 2
    seen.clear()
    with pytest.raises(errors.Conflict) as refused:
        store.apply_all([lane(replicas=2)], preconditions={(Kind.LANE, "gemma"): 1})
    assert refused.value.code == "ABORTED" and refused.value.reason == "CONFLICT"
    assert refused.value.message == (
        "Lane/gemma has been modified since resourceVersion 1 (now 2); get it again, "
        "apply your change to it, and apply that."
    )
    assert refused.value.metadata == {
        "kind": "Lane",
        "name": "gemma",
        "resource_version": "1",
        "current_resource_version": "2",
    }
    got = store.get(Kind.LANE, "gemma")
    assert isinstance(got, kinds.Lane) and got.spec.replicas == 3
    assert store.resource_version == 2
    assert seen == []


def test_without_a_precondition_the_last_apply_wins(store: Store) -> None:
    store.apply_all([lane()])
    store.apply_all([lane(replicas=3)])
    [outcome] = store.apply_all([lane(replicas=2)])
    assert outcome.action is ApplyAction.CONFIGURED
    got = store.get(Kind.LANE, "gemma")
    assert isinstance(got, kinds.Lane) and got.spec.replicas == 2


def test_a_precondition_on_an_object_that_does_not_exist_refuses_it(store: Store) -> None:
    with pytest.raises(errors.Conflict) as refused:
        store.apply_all([lane()], preconditions={(Kind.LANE, "gemma"): 4})
    assert "Lane/gemma does not exist" in refused.value.message
    assert "remove metadata.resourceVersion to create it" in refused.value.message
    assert refused.value.metadata == {"kind": "Lane", "name": "gemma", "resource_version": "4"}
    assert store.list() == [] and store.resource_version == 0


@pytest.mark.parametrize("dry_run", [False, True])
def test_one_stale_precondition_refuses_the_whole_batch(
    store: Store, seen: list[WatchEvent], dry_run: bool
) -> None:
    store.apply_all([model(), lane("a"), lane("b")])  # versions 1, 2, 3
    store.apply_all([lane("b", replicas=4)])  # b now at 4
    seen.clear()
    batch = [model(tier="x"), lane("a", replicas=2), lane("b", replicas=2), lane("c")]
    with pytest.raises(errors.Conflict) as refused:
        store.apply_all(
            batch,
            dry_run=dry_run,
            preconditions={(Kind.LANE, "a"): 2, (Kind.LANE, "b"): 3},
        )
    assert refused.value.metadata["name"] == "b"
    assert store.resource_version == 4
    assert [kinds.key(o) for o in store.list()] == [
        (Kind.LANE, "a"),
        (Kind.LANE, "b"),
        (Kind.MODEL, "gemma3-270m"),
    ]
    a, b, m = (
        store.get(Kind.LANE, "a"),
        store.get(Kind.LANE, "b"),
        store.get(Kind.MODEL, "gemma3-270m"),
    )
    assert isinstance(a, kinds.Lane) and a.spec.replicas == 1
    assert isinstance(b, kinds.Lane) and b.spec.replicas == 4
    assert m is not None and m.metadata.labels == {}
    assert seen == []


@pytest.mark.parametrize(
    ("expected", "current", "refused"),
    [
        (5, 5, None),
        (4, 5, "Lane/gemma has been modified since resourceVersion 4 (now 5)"),
        (6, 5, "Lane/gemma has been modified since resourceVersion 6 (now 5)"),
        (5, None, "Lane/gemma does not exist"),
    ],
)
def test_decide_precondition_is_pure(
    expected: int, current: int | None, refused: str | None
) -> None:
    stored = (
        None
        if current is None
        else lane().model_copy(
            update={"metadata": ObjectMeta(name="gemma", resource_version=current)}
        )
    )
    conflict = decide_precondition(Kind.LANE, "gemma", expected, stored)
    if refused is None:
        assert conflict is None
    else:
        assert conflict is not None and conflict.message.startswith(refused)
