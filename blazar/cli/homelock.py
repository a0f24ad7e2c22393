"""One daemon per home, and a home that is its owner's alone: the lock `blazar serve`
holds for its whole life, and the tightening of what an earlier daemon left readable.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from blazar.api import errors


def tighten(home: Path) -> None:
    """Take group and other permissions off what this user owns under `home` (written
    by a daemon before homes were private). Symlinks are left alone, not followed."""
    uid = os.getuid()
    for root, dirs, files in os.walk(home):
        for name in [*dirs, *files, ""]:
            path = os.path.join(root, name) if name else root
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if st.st_uid == uid and not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                    os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)


LOCK_FILE = "daemon.lock"


def _holder(home: Path, fd: int) -> str:
    """The pid in the lock file, else in daemon.json, else 'unknown'."""
    written = os.pread(fd, 32, 0).decode(errors="replace").strip()
    if written.isdigit():
        return written
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(int(json.loads((home / "daemon.json").read_text())["pid"]))
    return "unknown"


@contextlib.contextmanager
def exclusive(home: Path) -> Iterator[None]:
    """Hold `$BLAZAR_HOME/daemon.lock` for the daemon's life: one daemon per home, for
    two would run engines on the same sockets and overwrite each other's state.

    An flock, so the OS releases it however the daemon ends (kill -9 included) and a
    dead daemon never blocks the next one. The file holds the holder's pid, for the
    refusal's message. It is removed on the way out, while still locked; a starter
    that opened it before then and locks it after finds it unlinked and starts over.
    """
    path = home / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a read-only home, a directory in its place, ...
            raise errors.Unavailable(
                f"cannot use {home} as BLAZAR_HOME: cannot open {path}: {exc.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(home, fd)
            os.close(fd)
            raise errors.Unavailable(
                f"BLAZAR_HOME {home} is in use by another blazar daemon (pid {pid}); "
                "stop it, or give this one another --home"
            ) from None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        # The lock is the open descriptor's, not the file's: a file left behind (a
        # home turned read-only) is taken over by the next daemon as it is.
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
