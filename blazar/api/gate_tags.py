"""The tag a watcher of admission gates puts on each request it sends on, so that the
gates it hears say which of those requests admission had taken in already.

A watcher (`WatchAdmission`; Blazar's HTTP shim is one) picks a random id, names it
when it opens the stream, and tags every Chat and Complete call it makes with gRPC
metadata `x-blazar-gate-seq: <watcher>:<n>`, n rising with each call. Admission notes,
per Lane, the highest n of each watcher it has taken in; each message of the stream
says it for the gates it lists (`AdmissionGates.seen`), so the watcher counts toward a
filling gate exactly the requests it sent that the gates do not include yet
(`blazar.shim.gates`). A tag is only a hint for that count: a malformed one is ignored,
never a reason to fail the request.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

HEADER = "x-blazar-gate-seq"

MAX_WATCHER_CHARS = 64
_WATCHER = re.compile(r"[A-Za-z0-9_-]+")
# n travels as a uint64 (`AdmissionGates.seen`).
MAX_N = 2**64 - 1


@dataclass(frozen=True)
class Tag:
    """One request's tag: its watcher's id and its place in that watcher's order."""

    watcher: str
    n: int

    def metadata(self) -> tuple[str, str]:
        """The gRPC metadata item that carries it."""
        return (HEADER, f"{self.watcher}:{self.n}")


def new_watcher() -> str:
    """A fresh watcher id: random, so that two watchers do not share one."""
    return secrets.token_hex(8)


def valid_watcher(watcher: str) -> bool:
    """Whether `watcher` is an id (1 to MAX_WATCHER_CHARS letters, digits, '-', '_')."""
    return len(watcher) <= MAX_WATCHER_CHARS and _WATCHER.fullmatch(watcher) is not None


def parse(value: str | bytes) -> Tag | None:
    """The tag `value` spells (`<watcher>:<n>`); None when it spells none."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    watcher, colon, digits = value.rpartition(":")
    if not colon or not valid_watcher(watcher):
        return None
    if not digits.isascii() or not digits.isdigit() or len(digits) > len(str(MAX_N)):
        return None
    n = int(digits)
    return Tag(watcher, n) if n <= MAX_N else None


def of_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> Tag | None:
    """The tag a call's metadata carries; None when it carries none, or a malformed one."""
    for key, value in metadata:
        if key == HEADER:
            return parse(value)
    return None
