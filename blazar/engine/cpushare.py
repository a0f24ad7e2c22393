"""The CPU threads of each decode step, shared with the other engines of the host.

llama.cpp's CPU backend runs a step on `threads` OpenMP threads that meet at a barrier
after every operation, and libgomp lets a thread that has nothing to do spin for a
while (GOMP_SPINCOUNT, 300,000 by default) before it sleeps. Alone, that spin is what
keeps a step fast: between two steps the decode thread samples and hands the token on,
and a worker that fell asleep in that gap costs about 1.5 ms to wake (measured on a
2-core KVM guest: a 1.5 ms gap between one-token steps cost 11.0-11.5 ms per step at
1,000 spins against 9.3-10.4 at the default). But two busy engines whose threads add up
to more than the cores spin against each other and stall at every barrier: two
one-stream engines of 2 threads on 2 cores decoded 0.5-8.7 tok/s each at the default
spin and 29-35 at 1,000 spins, against 73-79 each when each computed on one thread
(and 103-116 for one engine alone on both cores). See docs/BENCHMARKS.md, "OpenMP
spinning" and "Engines sharing the cores".

So engines keep libgomp's spin and share the cores instead: every engine of the user
on this host (the daemon's supervisor names one file per user in the system's temporary
directory: the launch document's `cpu_share`) holds a cell of that small file with its
pid and the threads it wants while it has work (0 while idle).
Before a step an engine reads the other cells and computes with `share(...)` threads:
all it wants while the busy engines fit the cores, its proportional part (at least one)
while they do not. A cell of a process that is gone counts as idle, so a killed engine
never holds cores it no longer uses.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
from pathlib import Path

# One cell per engine: pid, threads wanted while busy (0: idle). Little-endian int64s,
# so the threads field is one aligned 8-byte store.
_CELL = struct.Struct("<qq")
_THREADS = struct.Struct("<q")
CELLS = 64
SIZE = CELLS * _CELL.size


def share(wanted: int, others: int, cores: int) -> int:
    """Threads for an engine that wants `wanted` while busy engines elsewhere on the host
    want `others` in all: everything while the total fits `cores`, else its proportional
    part of the cores, never below one."""
    if others <= 0 or wanted + others <= cores:
        return wanted
    return max(1, cores * wanted // (wanted + others))


def host_cores() -> int:
    """The cores this process may run on (its affinity): what `CpuShare` shares when
    the launch document does not say (`blazar.enginehost.cores.count`)."""
    return len(os.sched_getaffinity(0)) or 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    return True


class CpuShare:
    """This engine's cell in the host's table; `busy` before each step, `idle` before
    waiting for work. Only the decode thread calls them."""

    def __init__(self, path: Path, *, cores: int | None = None) -> None:
        self.cores = cores or host_cores()
        self._pid = os.getpid()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_uid != os.getuid():
                raise PermissionError(f"{path} belongs to another user")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size < SIZE:
                    os.ftruncate(fd, SIZE)
                self._map = mmap.mmap(fd, SIZE)
                self._offset = self._claim()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._announced = 0

    def _claim(self) -> int:
        """The offset of a cell that is free, this process's, or a dead process's
        (under the file lock, so two engines starting at once take different cells)."""
        for i, (pid, _) in enumerate(_CELL.iter_unpack(self._map)):
            if pid in (0, self._pid) or not _alive(pid):
                offset = i * _CELL.size
                _CELL.pack_into(self._map, offset, self._pid, 0)
                return offset
        raise RuntimeError(f"no free cell among {CELLS} in the CPU share table")

    def others(self) -> int:
        """Threads the other busy engines of the host want."""
        total = 0
        for i, (pid, threads) in enumerate(_CELL.iter_unpack(self._map)):
            if threads > 0 and i * _CELL.size != self._offset and _alive(pid):
                total += threads
        return total

    def busy(self, wanted: int) -> int:
        """Say this engine computes and wants `wanted` threads; the threads it gets."""
        if self._announced != wanted:
            _THREADS.pack_into(self._map, self._offset + 8, wanted)
            self._announced = wanted
        return share(wanted, self.others(), self.cores)

    def idle(self) -> None:
        """Say this engine waits for work: its threads are the others' to use."""
        if self._announced:
            _THREADS.pack_into(self._map, self._offset + 8, 0)
            self._announced = 0

    def close(self) -> None:
        """Leave the table (the cell becomes free)."""
        with contextlib.suppress(ValueError):
            _CELL.pack_into(self._map, self._offset, 0, 0)
            self._map.close()
