"""The fleet belongs to its owner (issue 19): without an auth file, Control is served on
a Unix socket only the daemon's owner can reach, never over TCP, and the daemon listens
on loopback only.

A daemon with an empty fleet is enough: Control answers without any engine.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import REPO, Daemon, running, short_home

pytestmark = pytest.mark.slow

# Imports first, as the owner (the interpreter lives where others may not read), then
# the user is dropped and the CLI runs as it.
AS_ANOTHER_USER = textwrap.dedent(
    """\
    import os, sys
    from blazar.cli import main
    import blazar.rpc.status, grpc._channel  # what an error path imports late
    uid = int(sys.argv[1])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    sys.exit(main.main(sys.argv[2:]))
    """
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    home = short_home()
    try:
        with running(home) as d:
            yield d
    finally:
        shutil.rmtree(home, ignore_errors=True)


def cli_as(uid: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", AS_ANOTHER_USER, str(uid), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the CLI as another user")
def test_another_user_is_refused_by_control(daemon: Daemon) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    # On the owner's socket: the home (0700) and the socket (0600) keep it out.
    by_socket = cli_as(nobody, "--server", daemon.control, "get", "lanes")
    assert by_socket.returncode == 1
    assert by_socket.stderr.startswith("error: cannot reach the Blazar daemon at unix:"), (
        by_socket.stderr
    )
    assert "Permission denied" in by_socket.stderr
    # Over TCP, which any local user reaches: Control needs an admin key, and this
    # daemon has no keys at all.
    by_tcp = cli_as(nobody, "--server", daemon.grpc, "delete", "slopolicy", "x")
    assert by_tcp.returncode == 1
    assert by_tcp.stderr.startswith("Error from server (AdminRequired):"), by_tcp.stderr
    # The same commands as the owner pass.
    owner = cli_as(os.getuid(), "--server", daemon.control, "get", "lanes")
    assert owner.returncode == 0, owner.stderr


def test_the_cli_finds_the_socket_in_blazar_home(daemon: Daemon) -> None:
    env = {**os.environ, "BLAZAR_HOME": str(daemon.home)}
    env.pop("BLAZAR_GRPC_ADDR", None)
    done = subprocess.run(
        [sys.executable, "-m", "blazar.cli", "events"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("flag", ["--http", "--grpc"])
def test_serve_without_keys_refuses_other_hosts_in_one_line(tmp_path: Path, flag: str) -> None:
    argv = [sys.executable, "-m", "blazar.cli", "serve", "--home", str(tmp_path / "home"),
            "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", flag, "0.0.0.0:0"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {flag} 0.0.0.0:0 is reachable from other hosts")
    assert "--auth-file" in done.stderr
    assert not (tmp_path / "home").exists()
