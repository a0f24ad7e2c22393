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


@pytest.mark.parametrize(
    ("argv", "prune"),
    [([], True), (["--prune"], True), (["--prune=false"], False), (["--prune", "true"], True)],
)
def test_serve_prunes_unless_told_not_to(argv: list[str], prune: bool) -> None:
    assert main.build_parser().parse_args(["serve", *argv]).prune is prune


def test_serve_refuses_a_prune_value_it_does_not_know(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main.build_parser().parse_args(["serve", "--prune=maybe"])
    assert exit_.value.code == 2
    assert "expected true or false, not 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--memory-budget", "8GB"], '--memory-budget: "8GB" is not a size'),
        (["--memory-budget", "0"], "--memory-budget: the budget must be more than 0 bytes"),
        (["--min-residency", "soon"], '--min-residency: "soon" is not a duration'),
    ],
)
def test_serve_refuses_a_budget_or_residency_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    home = tmp_path / "home"
    assert main.main(["serve", "--home", str(home), *argv]) == 1
    assert says in capsys.readouterr().err
    assert not home.exists()
