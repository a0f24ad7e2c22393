"""`blazar diff`'s rendering: only what users write, as a unified diff."""

from __future__ import annotations

from typing import Any

from blazar.cli import diffs


def lane(replicas: int, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "blazar.dev/v1alpha1",
        "kind": "Lane",
        "metadata": {"name": "l", "uid": "u", "resourceVersion": 7, **meta},
        "spec": {"model": "m", "replicas": replicas},
        "status": {"observedGeneration": 1},
    }


def test_no_change_is_no_diff() -> None:
    assert diffs.unified(lane(1), lane(1, resourceVersion=9), label="lane/l") == ""


def test_a_spec_change_shows_its_lines_only() -> None:
    text = diffs.unified(lane(1), lane(2), label="lane/l")
    assert text.startswith("--- live/lane/l\n+++ applied/lane/l\n")
    assert [
        line for line in text.splitlines() if line[:1] in "+-" and line[:3] not in ("---", "+++")
    ] == [
        "-  replicas: 1",
        "+  replicas: 2",
    ]
    assert "uid" not in text and "observedGeneration" not in text


def test_creation_and_deletion_are_whole_objects() -> None:
    created = diffs.unified(None, lane(1, labels={"team": "a"}), label="lane/l")
    assert "+  labels:\n+    team: a\n" in created and "\n-" not in created
    deleted = diffs.unified(lane(1), None, label="lane/l")
    assert "-kind: Lane\n" in deleted and "\n+k" not in deleted
