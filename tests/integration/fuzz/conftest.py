"""The daemon the fuzz runs share (`serving`), started once for the package."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.fuzz import serving
from tests.integration.harness import Daemon, local_fleet, short_home


@pytest.fixture(scope="package")
def daemon(model_path: Path) -> Iterator[Daemon]:
    home = short_home()
    fleet = local_fleet(
        home,
        model_path,
        lane=serving.LANE,
        spec=(
            f"replicas: 1, slots: {serving.SLOTS}, threads: {serving.THREADS}, "
            f"contextPerSlot: {serving.CONTEXT_PER_SLOT}"
        ),
    )
    d = Daemon(home=home, watch=fleet).start()
    try:
        d.wait_condition("lane", serving.LANE, "Ready", timeout=240)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)
