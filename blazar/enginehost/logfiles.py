"""Engine replicas' captured output: where it is, how it is kept small, how it is read.

Each replica's stdout and stderr go to `$BLAZAR_HOME/logs/<lane>-<index>.log`, opened
for appending by every run of it. The engine writes to the file directly (its output
never waits on the daemon); the daemon rotates it by copy and truncate, as logrotate's
`copytruncate` does: a file past `MAX_BYTES` is copied to `.1` (older copies move to
`.2`, ..., `.KEEP`; the oldest is dropped) and cut to nothing, and the engine's next
write, in append mode, lands at its new start. So a chatty or crash-looping engine
holds at most (KEEP + 1) x MAX_BYTES (plus what it writes between two checks) of the
disk. Everything here is the owner's alone (0600).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO

MAX_BYTES = 10 * 1024 * 1024
KEEP = 3
# How much of a log is read at a time when looking for its last lines from the end.
_TAIL_BLOCK_BYTES = 64 * 1024


def path(log_dir: Path, lane: str, index: int) -> Path:
    return log_dir / f"{lane}-{index}.log"


def generation(current: Path, n: int) -> Path:
    """The n-th rotated copy of `current` (1: the newest)."""
    return current.with_name(f"{current.name}.{n}")


def rotate_if_full(current: Path, *, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> bool:
    """Rotate `current` if it holds `max_bytes` or more; True when it did."""
    try:
        if current.stat().st_size < max_bytes:
            return False
    except FileNotFoundError:
        return False
    with contextlib.suppress(FileNotFoundError):
        generation(current, keep).unlink()
    for n in range(keep - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            generation(current, n).replace(generation(current, n + 1))
    if keep > 0:
        fd = os.open(generation(current, 1), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(current, "rb") as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst)
    with open(current, "r+b") as f:
        f.truncate(0)
    return True


def replicas(log_dir: Path, lane: str) -> list[int]:
    """The replica indices of `lane` that have a log."""
    found = []
    for file in log_dir.glob(f"{lane}-*.log"):
        index = file.name[len(lane) + 1 : -len(".log")]
        if index.isdigit():
            found.append(int(index))
    return sorted(found)


def tail_start(f: BinaryIO, lines: int) -> int:
    """Where the last `lines` lines of the open log `f` begin (its start when it has no
    more; its end for 0). A last line without its newline counts as a line. Reads
    backwards from the end, a block at a time: a 10 MB log's last lines cost a block."""
    end = pos = f.seek(0, os.SEEK_END)
    if lines <= 0 or end == 0:
        return end
    f.seek(end - 1)
    # Newlines to pass, from the end: the one that ends the last line is not one.
    wanted = lines + (f.read(1) == b"\n")
    while pos > 0:
        start = max(0, pos - _TAIL_BLOCK_BYTES)
        f.seek(start)
        block = f.read(pos - start)
        at = len(block)
        while (at := block.rfind(b"\n", 0, at)) >= 0:
            wanted -= 1
            if wanted == 0:
                return start + at + 1
        pos = start
    return 0
