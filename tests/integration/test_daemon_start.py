"""What `blazar serve` refuses at start, in one line and exit status 1, leaving the
home as it found it. No model is needed: these daemons serve an empty fleet."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from blazar.store.sqlite import SQLiteStore
from tests.integration.harness import REPO, Daemon, short_home


def serve(home: Path, *, http: str, grpc: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "blazar.cli", "serve", "--home", str(home),
         "--http", http, "--grpc", grpc],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip


def contents(home: Path) -> list[str] | None:
    return sorted(p.name for p in home.iterdir()) if home.exists() else None


@pytest.fixture
def taken() -> Iterator[str]:
    """An address some other program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(params=["existing", "missing"])
def home(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A home with a previous daemon's state in it, or none yet."""
    root = short_home()
    home = root / "home"
    if request.param == "existing":
        home.mkdir()
        SQLiteStore(home / "state.db").close()
    yield home
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("which", ["HTTP", "gRPC"])
def test_a_taken_port_is_one_line_and_changes_nothing(taken: str, home: Path, which: str) -> None:
    before = contents(home)
    free = "127.0.0.1:0"
    out = serve(
        home, http=taken if which == "HTTP" else free, grpc=taken if which == "gRPC" else free
    )
    assert (out.returncode, out.stdout) == (1, "")
    flag, variable = {
        "HTTP": ("--http", "BLAZAR_HTTP_ADDR"),
        "gRPC": ("--grpc", "BLAZAR_GRPC_ADDR"),
    }[which]
    assert out.stderr == (
        f"error: cannot listen on {taken} ({which}): address already in use; "
        f"give another address with {flag} HOST:PORT or {variable}\n"
    )
    assert contents(home) == before


def serve_briefly(home: Path) -> tuple[int, str]:
    """Run a second `serve` on home; one that starts (the defect) is stopped, not left."""
    argv = [sys.executable, "-m", "blazar.cli", "serve", "--home", str(home),
            "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]  # fmt: skip
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, cwd=REPO) as proc:
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
            raise AssertionError("a second daemon on the same home started") from None
    return proc.returncode, err


def snapshot(home: Path) -> dict[str, bytes]:
    return {str(p.relative_to(home)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(home.rglob("*")) if p.name != "daemon.log"}  # fmt: skip


def test_a_second_daemon_on_the_same_home_is_refused_and_touches_nothing() -> None:
    home = short_home()
    first = Daemon(home=home).start()
    try:
        pid = json.loads((home / "daemon.json").read_text())["pid"]
        before = snapshot(home)
        code, err = serve_briefly(home)
        assert code == 1
        assert err == (
            f"error: BLAZAR_HOME {home} is in use by another blazar daemon (pid {pid}); "
            "stop it, or give this one another --home\n"
        )
        assert snapshot(home) == before
        assert first.cli("get", "lanes").returncode == 0  # the first one still serves
    finally:
        first.stop()
        shutil.rmtree(home, ignore_errors=True)
    assert first.process is not None and first.process.returncode == 0


def test_a_killed_daemon_does_not_hold_its_home() -> None:
    home = short_home()
    try:
        first = Daemon(home=home).start()
        first.stop(signal.SIGKILL)
        second = Daemon(home=home).start()
        try:
            assert second.process is not None
            assert (home / "daemon.lock").read_text() == f"{second.process.pid}\n"
        finally:
            assert second.stop() == 0
        assert not (home / "daemon.lock").exists()  # removed on a clean exit
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_home_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("not a directory")
    done = serve(home, http="127.0.0.1:0", grpc="127.0.0.1:0")
    assert done.returncode == 1
    assert done.stderr == f"error: cannot use {home} as BLAZAR_HOME: File exists\n"
    assert home.read_text() == "not a directory"


def test_sighup_stops_the_daemon_as_sigterm_does() -> None:
    """SIGHUP's default action killed the daemon at once, without draining."""
    home = short_home()
    try:
        daemon = Daemon(home=home).start()
        assert daemon.stop(signal.SIGHUP) == 0
        assert not (home / "daemon.json").exists()  # removed by the orderly shutdown
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_corrupt_store_is_moved_aside_and_the_daemon_starts() -> None:
    home = short_home()
    try:
        home.mkdir(exist_ok=True)
        (home / "state.db").write_bytes(b"this is not a SQLite database" * 100)
        daemon = Daemon(home=home).start()
        try:
            assert daemon.cli("get", "lanes").returncode == 0
            events = daemon.cli("events")
            assert "StoreRecovered" in events.stdout, events.stdout + events.stderr
        finally:
            assert daemon.stop() == 0
        (aside,) = home.glob("state.db.corrupt-*")
        assert aside.read_bytes().startswith(b"this is not a SQLite database")
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_row_that_is_not_json_is_skipped_and_the_daemon_starts() -> None:
    home = short_home()
    try:
        home.mkdir(exist_ok=True)
        SQLiteStore(home / "state.db").close()
        with sqlite3.connect(home / "state.db") as db:
            db.execute("INSERT INTO objects VALUES ('Model', 'broken', '{this is not JSON')")
        daemon = Daemon(home=home).start()
        try:
            listed = daemon.cli("get", "models")
            assert listed.returncode == 0 and "broken" not in listed.stdout, listed
            warnings = daemon.events("store.row_invalid")
            assert warnings, daemon.log()
            assert {(w["kind"], w["name"]) for w in warnings} == {("Model", "broken")}
            # Said where `blazar events` shows it, not only in the daemon's log.
            events = daemon.cli("events", "--for", "model/broken")
            assert "StoredObjectUnreadable" in events.stdout, events
        finally:
            assert daemon.stop() == 0
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_home_and_what_the_daemon_writes_are_the_owners_alone() -> None:
    """State files hold the fleet and saved KV caches hold prompts' tokens: 0700/0600,
    and a home left readable by an earlier daemon is tightened."""
    home = short_home()
    try:
        home.mkdir(exist_ok=True)
        home.chmod(0o755)
        old = home / "state.db"
        SQLiteStore(old).close()
        old.chmod(0o644)
        daemon = Daemon(home=home).start()
        try:
            modes = {
                str(p.relative_to(home)): p.stat().st_mode & 0o777
                for p in [home, *home.rglob("*")]
                if not p.is_symlink()
            }
        finally:
            assert daemon.stop() == 0
        assert modes["."] == 0o700
        assert modes["state.db"] == 0o600
        assert all(mode & 0o077 == 0 for mode in modes.values()), modes
    finally:
        shutil.rmtree(home, ignore_errors=True)
