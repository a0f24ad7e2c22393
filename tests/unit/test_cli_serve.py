"""`blazar serve` refuses what it cannot do before it starts anything."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from blazar.cli import daemon, main


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
        # A value with a minus sign reaches the flag's check (argparse would take it
        # for an option and say only "expected one argument").
        (["--min-residency", "-1s"], "--min-residency: a duration cannot be negative (-1s)"),
        (["--min-residency=-1s"], "--min-residency: a duration cannot be negative (-1s)"),
        (["--min-residency", "-.5s"], "--min-residency: a duration cannot be negative"),
        (["--memory-budget", "-1Gi"], "--memory-budget: the budget must be more than 0 bytes"),
    ],
)
def test_serve_refuses_a_budget_or_residency_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    home = tmp_path / "home"
    assert main.main(["serve", "--home", str(home), *argv]) == 1
    assert says in capsys.readouterr().err
    assert not home.exists()


@pytest.mark.parametrize("level", ["verbose", "warnings", "notset"])
def test_serve_refuses_a_log_level_it_does_not_know(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    level: str,
) -> None:
    # It was taken for info without a word: a daemon asked for warnings only, or for
    # debug under a misspelling, logged something else and never said so.
    monkeypatch.setenv("BLAZAR_LOG_LEVEL", level)
    monkeypatch.setattr(main.eventloop, "run", lambda _: None)  # never a daemon here
    monkeypatch.setattr(daemon, "run", lambda _: None)
    home = tmp_path / "home"
    assert main.main(["serve", "--home", str(home)]) == 1
    err = capsys.readouterr().err
    assert f"BLAZAR_LOG_LEVEL: '{level}' is not a log level; use one of debug," in err
    assert not home.exists()


@pytest.mark.parametrize(
    ("argv", "attached"),
    [
        (["serve", "--min-residency", "-1s"], ["serve", "--min-residency=-1s"]),
        (["serve", "--min-residency", "30s"], ["serve", "--min-residency", "30s"]),
        # Another option after the flag stays an option (argparse says it lacks a value).
        (["serve", "--min-residency", "--prune"], ["serve", "--min-residency", "--prune"]),
        (["serve", "--min-residency"], ["serve", "--min-residency"]),
        (
            ["get", "lanes", "--", "--min-residency", "-1s"],
            ["get", "lanes", "--", "--min-residency", "-1s"],
        ),
    ],
)
def test_a_signed_value_is_attached_to_its_flag(argv: list[str], attached: list[str]) -> None:
    assert main.attach_signed_values(argv) == attached


def _serve_options(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str]
) -> daemon.Options:
    """The Options `blazar serve ARGV` would start the daemon with, under ENV."""
    for name in ("BLAZAR_HTTP_ADDR", "BLAZAR_GRPC_ADDR", "BLAZAR_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started: list[daemon.Options] = []
    monkeypatch.setattr(daemon, "run", started.append)
    monkeypatch.setattr(main.eventloop, "run", lambda _: None)
    monkeypatch.setattr(main.logs, "configure", lambda **_: None)
    assert main.main(["serve", *argv]) == 0
    (options,) = started
    return options


@pytest.mark.parametrize(
    ("argv", "env", "http", "grpc"),
    [
        ([], {}, "127.0.0.1:8420", "127.0.0.1:8421"),
        (
            [],
            {"BLAZAR_HTTP_ADDR": "127.0.0.1:9420", "BLAZAR_GRPC_ADDR": "127.0.0.1:9421"},
            "127.0.0.1:9420",
            "127.0.0.1:9421",
        ),
        (
            ["--http", "127.0.0.1:7420", "--grpc", "127.0.0.1:7421"],
            {"BLAZAR_HTTP_ADDR": "127.0.0.1:9420", "BLAZAR_GRPC_ADDR": "127.0.0.1:9421"},
            "127.0.0.1:7420",
            "127.0.0.1:7421",
        ),
    ],
)
def test_serve_addresses_are_the_flag_then_the_environment_then_the_default(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], http: str, grpc: str
) -> None:
    """DESIGN §9 and the Defaults table in docs/defaults.md."""
    options = _serve_options(monkeypatch, argv, env)
    assert (options.http, options.grpc) == (http, grpc)


def test_serve_home_is_the_flag_then_blazar_home_then_xdg_data_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert _serve_options(monkeypatch, [], {}).home == tmp_path / "user/.local/share/blazar"
    xdg = {"XDG_DATA_HOME": str(tmp_path / "data")}
    assert _serve_options(monkeypatch, [], xdg).home == tmp_path / "data/blazar"
    env = {**xdg, "BLAZAR_HOME": str(tmp_path / "env")}
    assert _serve_options(monkeypatch, [], env).home == tmp_path / "env"
    flag = ["--home", str(tmp_path / "flag")]
    assert _serve_options(monkeypatch, flag, env).home == tmp_path / "flag"


@pytest.mark.parametrize("xdg", ["", "relative/data"])
def test_an_empty_or_relative_xdg_data_home_is_ignored(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str
) -> None:
    """As the XDG base directory specification says (and `rundir` reads XDG_RUNTIME_DIR):
    otherwise the home would be `./blazar` under whatever directory serve, or the CLI
    looking for its socket, was started in."""
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    options = _serve_options(monkeypatch, [], {"XDG_DATA_HOME": xdg})
    assert options.home == tmp_path / "user/.local/share/blazar"


def test_the_shim_leaves_the_daemons_signal_handlers_alone() -> None:
    """The daemon owns SIGTERM and SIGINT (a second one hurries the stop). uvicorn's own
    capture would replace its handlers while the shim serves, then raise each signal
    again once the shim stopped: a single SIGTERM would read as two."""
    shim = daemon._shim(
        "127.0.0.1:1",
        probe_key="k",
        allow_origins=(),
        certificate=None,
        require_key=lambda _: None,
    )
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with shim.capture_signals():
        assert {sig: signal.getsignal(sig) for sig in before} == before
