"""The bundled model through real daemons sharing one machine's model cache: assembled
and hashed once, then neither again, by a restart on the same home or by a new home."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import REPO, Daemon, short_home

pytestmark = pytest.mark.slow


@pytest.fixture
def root() -> Iterator[Path]:
    root = short_home()
    fleet = root / "fleet"
    fleet.mkdir()
    shutil.copy(REPO / "manifests" / "models.yaml", fleet)  # the bundled Model, no Lane
    yield root
    shutil.rmtree(root, ignore_errors=True)


def start(root: Path, home: str) -> tuple[Daemon, int]:
    """A daemon on root/home, its model ready; and where this start's log begins."""
    d = Daemon(
        home=root / home,
        watch=root / "fleet",
        environ={"BLAZAR_MODEL_CACHE": str(root / "cache")},
    )
    (root / home).mkdir(exist_ok=True)
    since = d.log_path.stat().st_size if d.log_path.exists() else 0
    d.start()
    try:
        d.wait_condition("model", "gemma3-270m", "ModelReady", timeout=120)
    except BaseException:
        d.stop()
        raise
    return d, since


def counts(d: Daemon, since: int) -> list[tuple[int, int]]:
    """(files hashed, files assembled) for each time this start inspected the model."""
    return [
        (e["files_hashed"], e["files_assembled"]) for e in d.events("model.inspected", since=since)
    ]


def test_the_bundled_model_is_assembled_and_hashed_once_per_machine(root: Path) -> None:
    first, since = start(root, "h1")
    try:
        assert counts(first, since) == [(1, 1)]
    finally:
        first.stop()
    (cached,) = (root / "cache" / "sha256").glob("*/gemma-3-270m-q4_k_m.gguf")

    again, since = start(root, "h1")  # a restart on the same home: the status is enough
    try:
        assert counts(again, since) == []
    finally:
        again.stop()

    other, since = start(root, "h2")  # a new home: linked, and its digest remembered
    try:
        assert counts(other, since) == [(0, 0)]
        path = Path(other.get("model", "gemma3-270m")["status"]["path"])
        assert path.is_relative_to(root / "h2")
        assert path.stat().st_ino == cached.stat().st_ino
    finally:
        other.stop()
