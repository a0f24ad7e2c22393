"""`blazar serve` refuses what it cannot do before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from blazar.cli import main


def test_serve_refuses_a_watch_directory_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    missing = tmp_path / "nope"
    code = main.main(["serve", "--home", str(home), "--watch", str(missing)])
    assert code == 1
    assert f"--watch: '{missing}' is not a directory" in capsys.readouterr().err
    assert not home.exists()  # nothing was started or written
