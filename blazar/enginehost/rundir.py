"""The private directories engines run in: where their sockets and launch documents
live (`socket_dir`) and the table through which the user's engines share the cores
(`cpu_share_path`).

Sockets live in `$BLAZAR_HOME/run` (the home is 0700). A Unix socket's path is at most
107 bytes, so for a long home they move to a directory of this user's runtime root:

- `$XDG_RUNTIME_DIR/blazar` when `$XDG_RUNTIME_DIR` is set and usable (an absolute
  path to a real directory of this user, mode 0700: what systemd makes per login);
- else `blazar-<uid>` in the system's temporary directory.

The CPU-share table (`blazar.engine.cpushare`) is one file in that root, shared by
every engine of the user on the host, whichever daemon started it.

In a shared directory such as /tmp anyone may create a name first. So a directory is
used only when it is a real directory (not a symlink), this user's, and mode 0700;
one made here is made so (mkdir 0700, then checked, since the umask or a racing
creator could differ). When an existing one fails the check, it is left alone and a
fresh one is made with `mkdtemp` (0700, a name nobody could guess), and the log says
why: engines still start, though two daemons' engines may then not share cores.
`problem` is the check itself, pure.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# Room left in a socket path for the socket's own name (`<lane>-<n>.sock`).
_SOCKET_NAME_ROOM = 40
_MAX_UNIX_PATH = 100
CPU_SHARE_FILE = "cpu-share"


def problem(st: os.stat_result, *, uid: int) -> str | None:
    """Why a directory with this lstat() may not hold this user's sockets; None: it may."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not {uid}"
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        return f"its mode is {mode:04o}, not 0700"
    return None


def _claim(path: Path, uid: int) -> str | None:
    """Make `path` (0700) unless it exists; why it may not be used, or None."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    try:
        return problem(os.lstat(path), uid=uid)
    except OSError as exc:
        return exc.strerror or str(exc)


def private(path: Path, *, uid: int | None = None) -> Path:
    """`path` made (0700) or reused when it passes `problem`; else a fresh directory
    beside it made with mkdtemp, and a warning in the log."""
    uid = os.getuid() if uid is None else uid
    why = _claim(path, uid)
    if why is None:
        return path
    fresh = Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=path.parent))
    log.warning("rundir.refused", path=str(path), reason=why, using=str(fresh))
    return fresh


def runtime_root() -> Path:
    """This user's private runtime directory (see the module docstring). Asked once
    per supervisor: a fresh one (when the usual one is refused) differs every time."""
    uid = os.getuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        try:
            usable = problem(os.lstat(xdg), uid=uid) is None
        except OSError:
            usable = False
        if usable:
            return private(Path(xdg) / "blazar", uid=uid)
    return private(Path(tempfile.gettempdir()) / f"blazar-{uid}", uid=uid)


def socket_dir(home: Path, *, root: Path) -> Path:
    """Where worker sockets live: `$BLAZAR_HOME/run`, or, when that is too long for
    AF_UNIX or refused (`problem`), a directory named after the home in `root`
    (`runtime_root()`). Made and checked (`private`)."""
    run = home / "run"
    if len(os.fsencode(run)) + _SOCKET_NAME_ROOM <= _MAX_UNIX_PATH:
        why = _claim(run, os.getuid())
        if why is None:
            return run
        # Not a longer name beside it, which might not leave room for the sockets.
        log.warning("rundir.refused", path=str(run), reason=why, using=str(root))
    digest = hashlib.sha256(os.fsencode(home)).hexdigest()[:12]
    return private(root / f"run-{digest}")


def cpu_share_path(root: Path) -> Path:
    """The table through which the user's engines share the host's cores: one per user
    and host, in `root` (`runtime_root()`), so that the engines of two daemons share."""
    return root / CPU_SHARE_FILE
