"""`$BLAZAR_HOME/daemon.json`, which `serve` writes once listening: a text file of one
JSON line, which every reader still parses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from blazar.api import errors
from blazar.cli import daemon, homelock

INFO = {"pid": 4242, "grpc": "127.0.0.1:8421", "http": "127.0.0.1:8420", "tls": False}


def test_daemon_json_is_one_line_ended_by_a_newline(tmp_path: Path) -> None:
    daemon.write_info(tmp_path, INFO)
    text = (tmp_path / daemon.INFO_FILE).read_text()
    assert text.endswith("\n") and text.count("\n") == 1
    assert json.loads(text) == INFO
    assert sorted(p.name for p in tmp_path.iterdir()) == [daemon.INFO_FILE]


def test_a_second_daemon_reads_the_holders_pid_from_it(tmp_path: Path) -> None:
    """What `homelock` tells when the lock file holds no pid yet."""
    daemon.write_info(tmp_path, INFO)
    fd = os.open(tmp_path / homelock.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert homelock._holder(tmp_path, fd) == "4242"
    finally:
        os.close(fd)


def test_a_home_whose_lock_cannot_be_opened_is_refused_in_one_line(tmp_path: Path) -> None:
    """A read-only home (or anything in the lock's place) is said, not a traceback."""
    (tmp_path / homelock.LOCK_FILE).mkdir()
    with (
        pytest.raises(errors.Unavailable, match=r"cannot use .* as BLAZAR_HOME: .*daemon\.lock"),
        homelock.exclusive(tmp_path),
    ):
        pass
