"""`$BLAZAR_HOME/daemon.json`, which `serve` writes once listening: a text file of one
JSON line, which every reader still parses."""

from __future__ import annotations

import errno
import json
import os
import re
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


def test_a_home_turned_read_only_keeps_its_lock_file_and_releases_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's way out must not fail on a file it cannot remove."""

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    with homelock.exclusive(tmp_path):
        monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.undo()
    assert (tmp_path / homelock.LOCK_FILE).exists()
    with homelock.exclusive(tmp_path):  # the next daemon takes the file over
        pass


@pytest.mark.parametrize(
    ("http", "grpc", "exposed"),
    [
        ("127.0.0.1:0", "127.0.0.1:0", None),
        ("[::1]:0", "localhost:0", None),
        (":0", "127.0.0.2:0", None),  # an empty host is 127.0.0.1; all of 127/8 is loopback
        ("0.0.0.0:0", "127.0.0.1:0", "--http 0.0.0.0:0"),
        ("127.0.0.1:0", "[::]:0", "--grpc [::]:0"),
        ("127.0.0.1:0", "192.0.2.7:0", "--grpc 192.0.2.7:0"),
    ],
)
def test_without_keys_only_loopback_is_served(
    tmp_path: Path, http: str, grpc: str, exposed: str | None
) -> None:
    """DESIGN §6: with no keys configured the daemon only binds loopback."""
    options = daemon.Options(home=tmp_path, http=http, grpc=grpc)
    if exposed is None:
        daemon.check_exposure(options)
    else:
        with pytest.raises(errors.InvalidRequest, match=f"^{re.escape(exposed)} is reachable"):
            daemon.check_exposure(options)
    # With an auth file, its keys guard whatever address is named.
    daemon.check_exposure(daemon.Options(home=tmp_path, http=http, grpc=grpc, auth_file=tmp_path))


@pytest.mark.parametrize(
    ("flag", "address"),
    [
        ("127.0.0.1:8421", "127.0.0.1:8421"),
        ("localhost:0", "localhost:0"),
        (":8421", "127.0.0.1:8421"),
        # The shim dialled "::1:PORT", which gRPC cannot resolve: every request was a 503.
        ("[::1]:8421", "[::1]:8421"),
        ("[::]:0", "[::]:0"),
    ],
)
def test_an_address_read_from_a_flag_is_written_back_dialable(flag: str, address: str) -> None:
    """What the shim dials and daemon.json says: brackets kept around an IPv6 host."""
    assert daemon.join_address(*daemon.split_address(flag)) == address
