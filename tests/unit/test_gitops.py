"""GitOps `sync`: a directory of manifests applied as one batch, against a MemoryStore."""

from __future__ import annotations

from pathlib import Path

from blazar.gitops import watcher
from blazar.store.memory import MemoryStore

MODEL = """
apiVersion: blazar.dev/v1alpha1
kind: Model
metadata: {name: m}
spec: {source: {path: /m.gguf}}
"""
LANE = """
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: l}
spec: {model: m}
"""


def test_sync_applies_every_manifest_of_the_directory(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "lanes").mkdir()
    (tmp_path / "lanes" / "l.yml").write_text(LANE)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    assert [(o.kind, o.metadata.name) for o in store.list()] == [("Lane", "l"), ("Model", "m")]


def test_sync_rejects_a_bad_directory_whole(tmp_path: Path) -> None:
    store = MemoryStore()
    (tmp_path / "model.yaml").write_text(MODEL)
    assert watcher.sync(store, tmp_path)
    before = store.resource_version
    (tmp_path / "lane.yaml").write_text(LANE.replace("model: m", "model: missing"))
    (tmp_path / "model.yaml").write_text(MODEL.replace("/m.gguf", "/other.gguf"))
    assert not watcher.sync(store, tmp_path)
    assert store.resource_version == before  # the valid Model change was not applied either
    (event,) = store.events()
    assert (event.reason, event.name) == ("ManifestRejected", f"gitops:{tmp_path}")
    assert "Lane/l: spec.model" in event.message


def test_sync_records_a_file_it_cannot_parse(tmp_path: Path) -> None:
    store = MemoryStore()
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "broken.yaml").write_text("kind: [unclosed\n")
    assert not watcher.sync(store, tmp_path)
    assert store.list() == []
    (event,) = store.events()
    assert event.reason == "ManifestRejected"
    assert f"{tmp_path / 'broken.yaml'}#1: invalid YAML" in event.message
