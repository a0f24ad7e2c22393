"""The machine's model cache, shared by every BLAZAR_HOME: packaged models assembled
once and kept by content, and the sha256 of model files remembered across restarts.

Under its root (`$BLAZAR_MODEL_CACHE`, else `$XDG_CACHE_HOME/blazar/models`, else
`~/.cache/blazar/models`):

    sha256/<digest>/<file>               a packaged model, by the digest its package declares
    package/<name>/<version>/<file>      one whose package declares no digest
    digests.json                         the digest memo

A home gets its own path to a cached model with `place`: a hard link (no copy, no
time), else a reflink, else a copy, so the home stays whole when the cache is
cleared. Cached files are read-only, so that a process writing into a home's link
cannot change the file every other home links to without first changing its mode.

`Digests.sha256` hashes a file once and remembers its digest with the file's device,
inode, size and modification time; a file rewritten (new size or mtime) or replaced
(new inode) is hashed again, and a hard link of a hashed file shares its entry. The
memo is a JSON file written whole and then renamed into place: two daemons writing
it at once can lose an entry, which costs one more hash, never a wrong digest.

Every function here does blocking IO: callers run them in a worker thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

MEMO_FILE = "digests.json"
_MEMO_VERSION = 1
# ioctl(FICLONE): share the source's blocks (btrfs, XFS, bcachefs); EOPNOTSUPP elsewhere.
_FICLONE = 0x40049409


def default_root() -> Path:
    env = os.environ.get("BLAZAR_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    # The XDG base directory specification: unset, empty or relative means the default.
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return cache / "blazar" / "models"


@dataclass(frozen=True)
class _Identity:
    """What must not change for a remembered digest to still hold."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, stat: os.stat_result) -> _Identity:
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)

    @property
    def key(self) -> str:
        return f"{self.device}:{self.inode}"


def hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(4 << 20):
            digest.update(block)
    return digest.hexdigest()


class Digests:
    """sha256 of files, each hashed once while it stays the same file (module docstring).

    With `memo=None` the digests are remembered in this process only.
    """

    def __init__(self, memo: Path | None) -> None:
        self._memo = memo
        self._lock = threading.Lock()
        # This process's view, also what is known without a memo file.
        self._known: dict[str, dict[str, Any]] = {}
        self.hashed = 0  # files hashed by this object: what tests and logs look at

    def sha256(self, path: Path) -> str:
        before = _Identity.of(path.stat())
        entry = self._lookup(before)
        if entry is not None:
            return str(entry["sha256"])
        digest = hash_file(path)
        self.hashed += 1
        # A file written while it was read is not remembered: its digest may be of neither.
        if _Identity.of(path.stat()) == before:
            self._record(before, path, digest)
        return digest

    def _lookup(self, identity: _Identity) -> dict[str, Any] | None:
        with self._lock:
            entry = self._known.get(identity.key)
            if entry is None or not _matches(entry, identity):
                entry = self._read().get(identity.key)
            if entry is None or not _matches(entry, identity):
                return None
            self._known[identity.key] = entry
            return entry

    def _record(self, identity: _Identity, path: Path, digest: str) -> None:
        entry = {
            "path": str(path.absolute()),
            "size": identity.size,
            "mtime_ns": identity.mtime_ns,
            "sha256": digest,
        }
        with self._lock:
            self._known[identity.key] = entry
            if self._memo is None:
                return
            files = {k: v for k, v in self._read().items() if _still_there(k, v)}
            files[identity.key] = entry
            with contextlib.suppress(OSError):  # a memo that cannot be written costs a hash
                self._memo.parent.mkdir(parents=True, exist_ok=True)
                staged = self._memo.with_name(
                    f".{self._memo.name}.{os.getpid()}.{threading.get_ident()}"
                )
                staged.write_text(json.dumps({"version": _MEMO_VERSION, "files": files}))
                os.replace(staged, self._memo)

    def _read(self) -> dict[str, dict[str, Any]]:
        if self._memo is None:
            return {}
        try:
            data = json.loads(self._memo.read_text())
            files = data["files"] if data.get("version") == _MEMO_VERSION else {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}  # missing, or not ours: start over
        return files if isinstance(files, dict) else {}


def _matches(entry: dict[str, Any], identity: _Identity) -> bool:
    return (
        isinstance(entry, dict)
        and entry.get("size") == identity.size
        and entry.get("mtime_ns") == identity.mtime_ns
        and isinstance(entry.get("sha256"), str)
    )


def _still_there(key: str, entry: Any) -> bool:
    """Whether an entry still describes the file at its recorded path (else dropped)."""
    try:
        identity = _Identity.of(os.stat(entry["path"]))
    except (OSError, TypeError, KeyError):
        return False
    return identity.key == key and _matches(entry, identity)


class ChecksumMismatch(Exception):
    """A package assembled a file whose sha256 is not the one it declares."""

    def __init__(self, path: Path, digest: str, expected: str) -> None:
        super().__init__(f"{path} has sha256 {digest}, but its package declares {expected}")
        self.digest = digest
        self.expected = expected


class Placement(StrEnum):
    HARDLINK = "hardlink"
    REFLINK = "reflink"
    COPY = "copy"


def place(source: Path, target: Path) -> Placement:
    """Make target a file with source's content, replacing whatever is there atomically:
    a hard link, else (another filesystem, no hard links there) a reflink, else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.part")
    staged.unlink(missing_ok=True)
    try:
        try:
            os.link(source, staged)
            how = Placement.HARDLINK
        except OSError:
            how = _clone_or_copy(source, staged)
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)
    return how


def _clone_or_copy(source: Path, target: Path) -> Placement:
    with source.open("rb") as src, target.open("wb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
            return Placement.REFLINK
        except OSError:
            pass
        shutil.copyfileobj(src, dst, 4 << 20)
    return Placement.COPY


class ModelCache:
    """Packaged models assembled once per machine (module docstring).

    With `root=None` there is no shared cache: packages are assembled straight into
    each home and digests are remembered by this process only.
    """

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self.digests = Digests(root / MEMO_FILE if root is not None else None)
        self.assembled = 0  # files assembled by this object: what tests and logs look at

    def provide(
        self,
        target: Path,
        *,
        name: str,
        version: str | None,
        expected: str | None,
        assemble: Callable[[Path], object],
    ) -> Placement | None:
        """Make target the model file of package `name`: kept when already there with
        the `expected` digest (None), else placed from the cache, assembled there first
        if need be, else (no cache to use) assembled in place (Placement.COPY).

        `assemble(path)` writes the file at a path that does not exist yet. Raises
        ChecksumMismatch when what it wrote is not `expected`; nothing is kept then.
        """
        if target.is_file() and (expected is None or self.digests.sha256(target) == expected):
            return None
        cached = self._cached(target.name, name=name, version=version, expected=expected,
                              assemble=assemble)  # fmt: skip
        if cached is not None:
            return place(cached, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._assemble(target, expected=expected, assemble=assemble)
        return Placement.COPY

    def _cached(
        self,
        filename: str,
        *,
        name: str,
        version: str | None,
        expected: str | None,
        assemble: Callable[[Path], object],
    ) -> Path | None:
        """The package's file in the cache, assembled there first when it is missing or
        its digest is not `expected`. None when there is no cache to use (none given,
        it cannot be written, or nothing to key the file by)."""
        if self.root is None:
            return None
        if expected is not None:
            folder = self.root / "sha256" / expected
        elif version is not None:
            folder = self.root / "package" / name / version
        else:
            return None
        path = folder / filename
        if path.is_file() and (expected is None or self.digests.sha256(path) == expected):
            return path
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        self._assemble(path, expected=expected, assemble=assemble, mode=0o444)
        return path

    def _assemble(
        self,
        path: Path,
        *,
        expected: str | None,
        assemble: Callable[[Path], object],
        mode: int | None = None,
    ) -> None:
        """Assemble into a private file beside path and rename it over path once whole;
        then check it (a reader never sees a part file, and checks what it uses)."""
        staged = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
        staged.unlink(missing_ok=True)
        try:
            assemble(staged)
            self.assembled += 1
            if mode is not None:
                staged.chmod(mode)
            os.replace(staged, path)
        finally:
            staged.unlink(missing_ok=True)
        # Remembered by path and inode: the links made of it are not hashed again.
        if expected is not None and (digest := self.digests.sha256(path)) != expected:
            path.unlink(missing_ok=True)
            raise ChecksumMismatch(path, digest, expected)
