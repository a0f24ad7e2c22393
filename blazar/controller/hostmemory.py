"""Effects for the fit ledger: the host's available memory and a process's resident
memory, read from /proc (Linux).

`MemAvailable` is the kernel's estimate of what can be allocated without swapping:
free memory plus page cache and reclaimable slabs it could drop. The Lane reconciler
reads it through `HostMemory` so that tests give it any figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

PROC = Path("/proc")


@dataclass(frozen=True)
class Resident:
    """A process's resident memory (VmRSS) and its anonymous part (RssAnon), in bytes."""

    total: int
    anonymous: int


class HostMemory(Protocol):
    def available(self) -> int | None:
        """Bytes the host can still allocate (MemAvailable); None when unknown."""
        ...

    def total(self) -> int | None:
        """The host's memory (MemTotal); None when unknown."""
        ...

    def resident(self, pid: int) -> Resident | None:
        """The resident memory of pid; None when it is gone or unreadable."""
        ...


def _kib_fields(text: str, names: tuple[str, ...]) -> dict[str, int]:
    """`Name:   1234 kB` lines of a /proc file, in bytes."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in names:
            out[name] = int(rest.split()[0]) * 1024
    return out


class ProcMemory:
    """`HostMemory` from /proc/meminfo and /proc/PID/status."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc

    def available(self) -> int | None:
        try:
            text = (self._proc / "meminfo").read_text()
        except OSError:
            return None  # no /proc (not Linux), or not mounted
        fields = _kib_fields(text, ("MemAvailable", "MemFree"))
        # Kernels before 3.14 have no MemAvailable; MemFree is the lower bound.
        return fields.get("MemAvailable", fields.get("MemFree"))

    def total(self) -> int | None:
        try:
            text = (self._proc / "meminfo").read_text()
        except OSError:
            return None
        return _kib_fields(text, ("MemTotal",)).get("MemTotal")

    def resident(self, pid: int) -> Resident | None:
        try:
            text = (self._proc / str(pid) / "status").read_text()
        except OSError:
            return None
        fields = _kib_fields(text, ("VmRSS", "RssAnon"))
        if "VmRSS" not in fields:  # a zombie has no memory lines
            return None
        return Resident(total=fields["VmRSS"], anonymous=fields.get("RssAnon", 0))
