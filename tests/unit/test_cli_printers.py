"""The CLI's renderers (`blazar.cli.printers`): pure, on objects as the daemon sends them."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from blazar.cli import printers
from tests.unit.helpers import T0

CREATED = "2026-01-01T00:00:00Z"


def model(name: str = "m", **status: object) -> printers.ObjectJson:
    return {
        "apiVersion": "blazar.dev/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name, "creationTimestamp": CREATED},
        "spec": {"source": {"path": "/m.gguf"}},
        "status": dict(status),
    }


@pytest.mark.parametrize(
    ("timestamp", "later", "shown"),
    [
        (None, 0, "<unknown>"),
        (CREATED, 0, "0s"),
        (CREATED, 59, "59s"),
        (CREATED, 60, "1m"),
        (CREATED, 3 * 3600 + 5, "3h"),
        (CREATED, 2 * 86400, "2d"),
        ("2026-01-01T00:00:00", 42, "42s"),  # no zone: UTC
        (CREATED, -5, "0s"),  # a clock behind the daemon's
    ],
)
def test_age(timestamp: str | None, later: float, shown: str) -> None:
    assert printers.age(timestamp, T0 + timedelta(seconds=later)) == shown


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (None, ""),
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (1536, "1.5KiB"),
        (253 * 2**20 + 2**19, "253.5MiB"),
        (3 * 2**30, "3.0GiB"),
        (2048 * 2**30, "2048.0GiB"),  # GiB is the largest unit
    ],
)
def test_model_size_column(size: int | None, shown: str) -> None:
    obj = model() if size is None else model(sizeBytes=size)
    header, row = printers.table("Model", [obj], now=T0).splitlines()
    assert header.split() == ["NAME", "STATUS", "ARCH", "SIZE", "AGE"]
    # ARCH is empty, as is SIZE when the status has no size yet.
    assert row.split() == ["m", "Pending", *([shown] if shown else []), "0s"]


@pytest.mark.parametrize(
    ("conditions", "word"),
    [
        ([], "Pending"),
        ([{"type": "ModelReady", "status": "True", "reason": "Resolved"}], "Ready"),
        ([{"type": "ModelReady", "status": "False", "reason": "FileMissing"}], "FileMissing"),
        ([{"type": "ModelReady", "status": "False"}], "NotReady"),
        (
            [
                {"type": "Ready", "status": "True", "reason": "Serving"},
                {"type": "Degraded", "status": "True", "reason": "CrashLoopBackOff"},
            ],
            "CrashLoopBackOff",
        ),
    ],
)
def test_status_word(conditions: list[dict[str, str]], word: str) -> None:
    assert printers.status_word(model(conditions=conditions)) == word


def test_as_json_is_the_object_alone_or_a_list() -> None:
    assert json.loads(printers.as_json([model()]))["kind"] == "Model"
    listed = json.loads(printers.as_json([model("a"), model("b")]))
    assert listed["kind"] == "List"
    assert [o["metadata"]["name"] for o in listed["items"]] == ["a", "b"]


def test_events_table() -> None:
    event: printers.EventJson = {
        "time": "2026-01-01T00:00:00+00:00",
        "type": "Warning",
        "reason": "ManifestRejected",
        "kind": "Manifest",
        "name": "apply",
        "message": "Lane/l: spec.model: not found",
    }
    assert printers.events_table([], now=T0) == "No events."
    header, row = printers.events_table([event], now=T0 + timedelta(minutes=5)).splitlines()
    assert header.split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert row.split()[:4] == ["5m", "Warning", "ManifestRejected", "Manifest/apply"]


def test_describe_shows_status_conditions_and_events() -> None:
    obj = model(
        observedGeneration=1,
        sizeBytes=10,
        conditions=[{"type": "ModelReady", "status": "True", "reason": "Resolved"}],
    )
    obj["metadata"]["generation"] = 1
    page = printers.describe(obj, [], now=T0 + timedelta(seconds=3)).splitlines()
    assert page[:5] == [
        "Name:         m",
        "Kind:         Model",
        "Labels:       <none>",
        f"Created:      {CREATED} (3s ago)",
        "Generation:   1   Observed: 1",
    ]
    assert "Status:" in page and "  sizeBytes: 10" in page
    assert page[page.index("Conditions:") + 2].split() == ["ModelReady", "True", "Resolved"]
    assert page[-2:] == ["Events:", "  <none>"]
