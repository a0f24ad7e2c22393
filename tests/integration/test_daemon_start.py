"""What `blazar serve` refuses at start, in one line and exit status 1, leaving the
home as it found it. No model is needed: these daemons serve an empty fleet."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from blazar.store.sqlite import SQLiteStore
from tests.integration.harness import REPO, short_home


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
    assert out.stderr == f"error: cannot listen on {taken} ({which}): address already in use\n"
    assert contents(home) == before
