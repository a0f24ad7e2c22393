"""Engines' private directories (`blazar.enginehost.rundir`): a directory is used only
when it is a real directory of this user with mode 0700; anything else in its place
is left alone and a fresh one made, and the log says why."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import structlog

from blazar.enginehost import rundir

UID = os.getuid()


def _stat(mode: int, uid: int = UID) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("st", "expected"),
    [
        (_stat(stat.S_IFDIR | 0o700), None),
        (_stat(stat.S_IFLNK | 0o777), "it is a symbolic link"),
        (_stat(stat.S_IFREG | 0o700), "it is not a directory"),
        (_stat(stat.S_IFDIR | 0o700, uid=UID + 1), f"it belongs to uid {UID + 1}, not {UID}"),
        (_stat(stat.S_IFDIR | 0o755), "its mode is 0755, not 0700"),
        (_stat(stat.S_IFDIR | 0o1777), "its mode is 1777, not 0700"),
        (_stat(stat.S_IFDIR | 0o600), "its mode is 0600, not 0700"),
    ],
)
def test_problem(st: os.stat_result, expected: str | None) -> None:
    assert rundir.problem(st, uid=UID) == expected


def _fresh_beside(path: Path, got: Path) -> None:
    assert got != path and got.parent == path.parent
    assert got.name.startswith(path.name + "-")
    st = os.lstat(got)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == UID and not any(got.iterdir())


def test_a_missing_directory_is_made_0700(tmp_path: Path) -> None:
    path = tmp_path / "blazar-x"
    old = os.umask(0o022)
    try:
        assert rundir.private(path) == path
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700


def test_a_good_directory_is_reused_with_what_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "blazar-x"
    path.mkdir(mode=0o700)
    (path / "cpu-share").write_bytes(b"kept")
    assert rundir.private(path) == path
    assert (path / "cpu-share").read_bytes() == b"kept"


def test_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    """Another user makes /tmp/blazar-<uid> a link to a directory of theirs: it is
    neither used nor changed."""
    target = tmp_path / "theirs"
    target.mkdir(mode=0o700)
    path = tmp_path / "blazar-x"
    path.symlink_to(target)
    with structlog.testing.capture_logs() as logs:
        got = rundir.private(path)
    _fresh_beside(path, got)
    assert path.is_symlink() and not any(target.iterdir())
    assert logs == [
        {
            "event": "rundir.refused",
            "log_level": "warning",
            "path": str(path),
            "reason": "it is a symbolic link",
            "using": str(got),
        }
    ]


def test_a_directory_others_may_enter_is_not_used(tmp_path: Path) -> None:
    path = tmp_path / "blazar-x"
    path.mkdir()
    path.chmod(0o755)
    got = rundir.private(path)
    _fresh_beside(path, got)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o755  # left as it was


def test_another_users_directory_is_not_used(tmp_path: Path) -> None:
    """Without root no test can own a directory as someone else; to a daemon of
    another uid this one is someone else's."""
    path = tmp_path / "blazar-x"
    path.mkdir(mode=0o700)
    with structlog.testing.capture_logs() as logs:
        got = rundir.private(path, uid=UID + 1)
    assert got != path and got.parent == path.parent
    assert logs[0]["reason"] == f"it belongs to uid {UID}, not {UID + 1}"


def test_a_file_in_the_way_is_not_used(tmp_path: Path) -> None:
    path = tmp_path / "blazar-x"
    path.write_text("")
    _fresh_beside(path, rundir.private(path))


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary directory, for this test only."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return tmp


def test_the_runtime_root_is_xdg_runtime_dir_when_usable(
    tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    xdg = tmp_path / "run-user"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert rundir.runtime_root() == xdg / "blazar"
    assert rundir.cpu_share_path(rundir.runtime_root()) == xdg / "blazar" / "cpu-share"
    assert not any(tmp.iterdir())


@pytest.mark.parametrize("xdg", ["open", "relative", "missing"])
def test_else_a_directory_of_the_user_in_the_temporary_directory(
    tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, xdg: str
) -> None:
    if xdg == "open":
        (tmp_path / "xdg").mkdir()
        (tmp_path / "xdg").chmod(0o755)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    elif xdg == "relative":
        monkeypatch.setenv("XDG_RUNTIME_DIR", "run/user")
    root = rundir.runtime_root()
    assert root == tmp / f"blazar-{UID}"
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700


def test_a_long_homes_sockets_go_to_the_runtime_root(tmp: Path, tmp_path: Path) -> None:
    short = Path(tempfile.mkdtemp(prefix="bz-", dir="/tmp"))
    try:
        assert rundir.socket_dir(short, root=tmp) == short / "run"
    finally:
        shutil.rmtree(short)
    long = tmp_path / ("x" * 90)
    got = rundir.socket_dir(long, root=tmp)
    assert got.parent == tmp and got.name.startswith("run-")
    assert stat.S_IMODE(os.lstat(got).st_mode) == 0o700
    assert rundir.socket_dir(long, root=tmp) == got  # the same home, the same directory
    assert not long.exists()


def test_a_homes_run_directory_that_is_refused_gives_way_to_the_runtime_root(
    tmp: Path,
) -> None:
    home = Path(tempfile.mkdtemp(prefix="bz-", dir="/tmp"))
    try:
        (home / "run").mkdir()
        (home / "run").chmod(0o755)
        got = rundir.socket_dir(home, root=tmp)
        assert got.parent == tmp and got.name.startswith("run-")
    finally:
        shutil.rmtree(home)
