"""The admission of manifests (`blazar.store.apply`), against a MemoryStore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from blazar.api import errors, kinds
from blazar.api.kinds import Kind
from blazar.store import apply
from blazar.store.memory import MemoryStore
from blazar.store.sqlite import SQLiteStore

MODEL: dict[str, Any] = {
    "apiVersion": "blazar.dev/v1alpha1",
    "kind": "Model",
    "metadata": {"name": "m"},
    "spec": {"source": {"path": "/m.gguf"}},
}
LANE: dict[str, Any] = {
    "apiVersion": "blazar.dev/v1alpha1",
    "kind": "Lane",
    "metadata": {"name": "l"},
    "spec": {"model": "m"},
}


def located(*docs: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"fleet.yaml#{i}", doc) for i, doc in enumerate(docs, start=1)]


def test_a_batch_is_written_and_a_reapply_changes_nothing() -> None:
    store = MemoryStore()
    first = apply.apply_documents(store, located(MODEL, LANE))
    assert [(o.object.kind, o.action.value) for o in first] == [
        ("Model", "created"),
        ("Lane", "created"),
    ]
    again = apply.apply_documents(store, located(MODEL, LANE))
    assert [o.action.value for o in again] == ["unchanged", "unchanged"]
    assert [o.metadata.name for o in store.list()] == ["l", "m"]
    assert store.events() == []


def test_a_reference_may_be_met_by_the_store() -> None:
    store = MemoryStore()
    apply.apply_documents(store, located(MODEL))
    (outcome,) = apply.apply_documents(store, located(LANE))
    assert outcome.action.value == "created"


def test_a_bad_batch_writes_nothing_and_is_one_warning_event() -> None:
    store = MemoryStore()
    bad_lane = {**LANE, "spec": {"model": "missing", "replicas": "x"}}
    with pytest.raises(errors.ManifestInvalid) as rejected:
        apply.apply_documents(store, located(MODEL, bad_lane), source="gitops:fleet")
    paths = [e.path for e in rejected.value.errors]
    assert paths == ["Lane/l: spec.replicas", "Lane/l: spec.model"]
    assert store.list() == []
    (event,) = store.events()
    assert (event.kind, event.name, event.type, event.reason) == (
        "Manifest",
        "gitops:fleet",
        "Warning",
        "ManifestRejected",
    )
    assert "spec.replicas" in event.message and "spec.model" in event.message


def test_the_event_names_the_second_of_two_same_objects_as_the_duplicate() -> None:
    store = MemoryStore()
    with pytest.raises(errors.ManifestInvalid):
        apply.apply_documents(store, located(MODEL, MODEL), source="cli")
    (event,) = store.events()
    assert event.message == (
        "Model/m (fleet.yaml#2): metadata.name: duplicate Model (first defined in fleet.yaml#1)"
    )


def test_a_dry_run_reports_and_writes_nothing() -> None:
    store = MemoryStore()
    outcomes = apply.apply_documents(store, located(MODEL, LANE), dry_run=True)
    assert [o.action.value for o in outcomes] == ["created", "created"]
    assert store.list() == []
    assert store.resource_version == 0


def test_a_rejected_dry_run_records_no_event() -> None:
    store = MemoryStore()
    with pytest.raises(errors.ManifestInvalid):
        apply.apply_documents(store, located(LANE), dry_run=True)
    assert store.events() == []


def test_an_unreadable_document_rejects_the_batch_and_is_recorded() -> None:
    store = MemoryStore()
    unreadable = [errors.FieldError("object#2", "not valid JSON: Expecting value")]
    with pytest.raises(errors.ManifestInvalid) as rejected:
        apply.apply_documents(store, located(MODEL), unreadable=unreadable, source="cli")
    assert list(rejected.value.errors) == unreadable
    assert store.list() == []
    (event,) = store.events()
    assert (event.name, event.reason) == ("cli", "ManifestRejected")
    assert event.message == "object#2: not valid JSON: Expecting value"


def test_an_unreadable_document_in_a_dry_run_records_nothing() -> None:
    store = MemoryStore()
    unreadable = [errors.FieldError("object#1", "not valid JSON")]
    with pytest.raises(errors.ManifestInvalid):
        apply.apply_documents(store, [], unreadable=unreadable, dry_run=True)
    assert store.events() == []


def test_a_huge_rejected_value_is_neither_stored_nor_echoed_whole(tmp_path: Path) -> None:
    """Three manifests with a 1 MiB apiVersion each grew state.db from 0.3 to 3.5 MB
    (the rejection event quoted them); the error sent back quoted them too."""
    store = SQLiteStore(tmp_path / "state.db")
    try:
        apply.apply_documents(store, located(MODEL))
        before = (tmp_path / "state.db").stat().st_size
        huge = {**LANE, "apiVersion": "v" * 2**20}
        for _ in range(3):
            with pytest.raises(errors.ManifestInvalid) as caught:
                apply.apply_documents(store, located(huge))
            assert len(caught.value.message) < 4_096
        events = store.events(kind="Manifest")
        assert len(events) == 3 and all(len(e.message) <= 1_100 for e in events)
        assert (tmp_path / "state.db").stat().st_size - before < 10_000
    finally:
        store.close()


# --- metadata.resourceVersion: a precondition on the interactive path ----------------


def versioned(doc: dict[str, Any], version: object) -> dict[str, Any]:
    return {**doc, "metadata": {**doc["metadata"], "resourceVersion": version}}


def changed_by_someone_else() -> MemoryStore:
    """A store where Lane/l was read at version 2 and then changed (now at 3)."""
    store = MemoryStore()
    apply.apply_documents(store, located(MODEL, LANE))
    apply.apply_documents(store, located({**LANE, "spec": {"model": "m", "replicas": 3}}))
    return store


@pytest.mark.parametrize("version", [None, "", 0, "0"])
def test_no_resource_version_means_the_last_apply_wins(version: object) -> None:
    store = changed_by_someone_else()
    mine = versioned({**LANE, "spec": {"model": "m", "replicas": 2}}, version)
    (outcome,) = apply.apply_documents(store, located(mine))
    assert outcome.action.value == "configured"


@pytest.mark.parametrize("version", [2, "2"])
def test_a_stale_resource_version_is_a_conflict_and_no_event(version: object) -> None:
    store = changed_by_someone_else()
    mine = versioned({**LANE, "spec": {"model": "m", "replicas": 2}}, version)
    with pytest.raises(errors.Conflict) as refused:
        apply.apply_documents(store, located(mine))
    assert refused.value.message.startswith(
        "Lane/l has been modified since resourceVersion 2 (now 3)"
    )
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, kinds.Lane) and lane.spec.replicas == 3
    # The manifest is sound, only out of date: not a ManifestRejected.
    assert store.events() == []


@pytest.mark.parametrize("version", [3, "3"])
def test_the_current_resource_version_applies(version: object) -> None:
    store = changed_by_someone_else()
    mine = versioned({**LANE, "spec": {"model": "m", "replicas": 2}}, version)
    (outcome,) = apply.apply_documents(store, located(mine))
    assert outcome.action.value == "configured"
    assert outcome.object.metadata.resource_version == 4


@pytest.mark.parametrize("version", [-1, "abc", 1.5, True, "12 ", [3]])
def test_a_resource_version_that_is_no_version_is_a_manifest_error(version: object) -> None:
    store = MemoryStore()
    bad_lane = {**versioned(LANE, version), "spec": {"model": "m", "replicas": "x"}}
    with pytest.raises(errors.ManifestInvalid) as rejected:
        apply.apply_documents(store, located(MODEL, bad_lane))
    # Reported with the object's other errors, in one round.
    assert [e.path for e in rejected.value.errors] == [
        "Lane/l: spec.replicas",
        "Lane/l: metadata.resourceVersion",
    ]
    assert store.list() == []


def test_the_watched_directory_takes_no_precondition() -> None:
    store = changed_by_someone_else()
    stale = versioned({**LANE, "spec": {"model": "m", "replicas": 2}}, 1)
    (outcome,) = apply.apply_documents(
        store, located(stale), resource_versions=apply.ResourceVersions.IGNORED
    )
    assert outcome.action.value == "configured"
