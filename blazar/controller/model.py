"""The Model reconciler: resolve the source, verify the checksum, read the GGUF header.

Sets status (path, size, digest, architecture, trained context) and the `ModelReady`
condition. Failures that only a spec change can fix (an unsupported source) stop
retrying; a missing file is polled, and so is a ready Model's file and a refused one
(a bad checksum, a GGUF cut short: a stat, read again only once it changes), so one
removed or replaced under a running fleet is seen in seconds, not at the next resync.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import structlog

from blazar.api import conditions
from blazar.api.kinds import Kind, Model, ModelStatus
from blazar.api.meta import ConditionStatus
from blazar.controller import modelcache, modelfile
from blazar.controller.reconciler import Result
from blazar.controller.sources import ModelSources, SourceError
from blazar.store.base import Store

log = structlog.get_logger(__name__)

MISSING_FILE_POLL_S = 10.0
# How often a ready Model's file is looked at again (a stat; read again only if it
# changed). A file removed under a sleeping Lane otherwise stayed Ready for up to the
# 5-minute resync: a request waking the Lane waited out its queue bound behind a
# crash-looping engine, where a Model that is not ready refuses it at once with why.
READY_FILE_POLL_S = 10.0


@dataclass(frozen=True)
class _FileSeen:
    """A file as a stat saw it: another inode, size, modification or change time (a
    chmod that makes it readable) is another file."""

    path: str
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> _FileSeen | None:
        try:
            stat = path.stat()
        except OSError:
            return None
        return cls(str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


class _FileRefused(Exception):
    """The resolved file is there but cannot be served (`error` says why): `file` is
    what it was when read (None if it changed meanwhile)."""

    def __init__(self, error: SourceError, file: _FileSeen | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.file = file


class ModelReconciler:
    kind = Kind.MODEL

    def __init__(
        self,
        *,
        store: Store,
        models_dir: Path,
        clock: Callable[[], datetime],
        cache: modelcache.ModelCache | None = None,
        sources: ModelSources | None = None,
    ) -> None:
        self._store = store
        self._models_dir = models_dir
        # Without one: files under models_dir only.
        self._sources = sources or ModelSources.of([models_dir])
        self._clock = clock
        # Without one, packages are assembled into models_dir, digests kept in memory.
        self._cache = cache or modelcache.ModelCache(None)
        # The file each Model's spec (by generation) was last refused for: it is looked
        # at again once it changes (a copy caught half-written, then finished), and not
        # hashed and parsed again while it does not.
        self._rejected: dict[str, tuple[int, _FileSeen]] = {}

    @staticmethod
    def _unchanged(model: Model) -> bool:
        """Whether the status already describes this spec and this file on disk.

        Then the file is not hashed and parsed again: every status write of its own and
        every restart of the daemon would otherwise re-read hundreds of MB (measured: 2-5 s
        of CPU for the bundled model, competing with the first requests after a restart).
        A file is taken as unchanged while its inode, size and modification time are:
        another file renamed over it with the same size and time (a corrupt or other
        copy made with `cp -p`) kept the status, `Verified` against a sha256 it did
        not have, and its engines' next start loaded it. A status without the inode
        (written before it was kept) is inspected once more; the digest memo spares
        the hashing of a file that did not change.
        """
        status = model.status
        if (
            status.path is None
            or status.mtime_ns is None
            or not model.status_current
            or not conditions.is_true(status.conditions, "ModelReady")
        ):
            return False
        try:
            stat = Path(status.path).stat()
        except OSError:
            return False
        if "repacked_bytes" not in status.parameters:
            return False  # inspected before the fit ledger's figures were kept
        seen = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        return seen == (status.size_bytes, status.mtime_ns, status.inode)

    async def reconcile(self, name: str) -> Result:
        model = self._store.get(Kind.MODEL, name)
        if model is None:
            self._rejected.pop(name, None)
            return Result()
        assert isinstance(model, Model)
        if self._unchanged(model):
            return Result(requeue_after=READY_FILE_POLL_S)
        generation = model.metadata.generation or 0
        rejected = self._rejected.pop(name, None)
        if rejected is not None and rejected == (generation, _FileSeen.of(Path(rejected[1].path))):
            self._rejected[name] = rejected  # the same file, refused: not read again
            return Result(requeue_after=READY_FILE_POLL_S)
        started = time.monotonic()
        try:
            status = await asyncio.to_thread(self._inspect, model)
        except _FileRefused as refused:
            if refused.file is not None:
                self._rejected[name] = (generation, refused.file)
            self._refuse(model, refused.error, retry_in=READY_FILE_POLL_S)
            return Result(requeue_after=READY_FILE_POLL_S)
        except SourceError as err:
            # A file not there, or not (yet) a GGUF file: looking again costs a stat and
            # four bytes (`cp` over a served file empties it first, then writes).
            retry = err.reason in (
                "FileNotFound",
                "PackageNotInstalled",
                "NotGGUF",
                "FileUnreadable",
            )
            retry_in = MISSING_FILE_POLL_S if retry else None
            self._refuse(model, err, retry_in=retry_in)
            return Result(requeue_after=retry_in)
        # How long the file took, and this daemon's files hashed and assembled so far:
        # a slow start says here whether it hashed or assembled hundreds of MB.
        log.info(
            "model.inspected",
            model=name,
            path=status.path,
            seconds=round(time.monotonic() - started, 3),
            files_hashed=self._cache.digests.hashed,
            files_assembled=self._cache.assembled,
        )
        was_ready = conditions.is_true(model.status.conditions, "ModelReady")
        before = model.status
        same_file = (before.path, before.size_bytes, before.mtime_ns) == (
            status.path,
            status.size_bytes,
            status.mtime_ns,
        )
        message = f"{status.architecture} model at {status.path} ({status.size_bytes} bytes)."
        self._set(model, status, True, "Verified" if model.spec.sha256 else "Resolved", message)
        # Said once per file served: when it becomes ready, and when it stays ready on
        # another file (a new path, or the file replaced), which its Lanes roll to.
        if not (was_ready and same_file):
            self._store.record_event(
                kind=Kind.MODEL.value,
                name=name,
                type="Normal",
                reason="ModelReady",
                message=message,
                uid=model.metadata.uid or "",
            )
        return Result(requeue_after=READY_FILE_POLL_S)

    def _refuse(self, model: Model, err: SourceError, *, retry_in: float | None) -> None:
        """ModelReady False for `err`, with a Warning event and log line unless it
        already said so; `retry_in`: when the file is looked at again (None: only at a
        spec change)."""
        generation = model.metadata.generation or 0
        self._set(model, ModelStatus(), False, err.reason, err.message)
        if (model.status.observed_generation, self._reason(model)) != (generation, err.reason):
            # The event is for `describe`; the line for whoever tails the daemon's log.
            log.warning(
                "model.not_ready",
                model=model.metadata.name,
                reason=err.reason,
                message=err.message,
                retry_in_s=retry_in,
            )
            self._store.record_event(
                kind=Kind.MODEL.value,
                name=model.metadata.name,
                type="Warning",
                reason=err.reason,
                message=err.message,
                uid=model.metadata.uid or "",
            )

    def _inspect(self, model: Model) -> ModelStatus:
        """The status of the file the source resolves to; `_FileRefused` when that file
        is there but cannot be served (its content, not its absence, is at fault)."""
        path = modelfile.resolve(
            model.spec.source,
            models_dir=self._models_dir,
            cache=self._cache,
            sources=self._sources,
        )
        seen = _FileSeen.of(path)
        try:
            return self._read(model, path)
        except SourceError as err:
            # Gone or changed while it was read: the next pass reads it again.
            raise _FileRefused(err, seen if _FileSeen.of(path) == seen else None) from err

    def _read(self, model: Model, path: Path) -> ModelStatus:
        digest = self._cache.digests.sha256(path) if model.spec.sha256 else None
        if model.spec.sha256 and digest != model.spec.sha256:
            raise SourceError(
                "ChecksumMismatch",
                f"sha256 of {path} is {digest}, but the spec says {model.spec.sha256}.",
            )
        stat = path.stat()
        info = modelfile.read_gguf(path)
        return ModelStatus(
            path=str(path),
            size_bytes=stat.st_size,
            mtime_ns=stat.st_mtime_ns,
            inode=stat.st_ino,
            sha256=digest,
            architecture=info.architecture,
            context_length=info.context_length,
            parameters=info.parameters,
        )

    @staticmethod
    def _reason(model: Model) -> str | None:
        cond = conditions.get_condition(model.status.conditions, "ModelReady")
        return cond.reason if cond else None

    def _set(self, model: Model, status: ModelStatus, ok: bool, reason: str, message: str) -> None:
        generation = model.metadata.generation or 0
        status.observed_generation = generation
        status.conditions = conditions.set_condition(
            model.status.conditions,
            type="ModelReady",
            status=ConditionStatus.TRUE if ok else ConditionStatus.FALSE,
            reason=reason,
            message=message,
            observed_generation=generation,
            now=self._clock(),
        )
        self._store.update_status(Kind.MODEL, model.metadata.name, status)
