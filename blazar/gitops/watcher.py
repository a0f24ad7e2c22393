"""Keeps the store in step with a directory of manifests (GitOps).

Every manifest under the directory is applied at start (`sync`, which the daemon calls
before its controllers run, so that they never start engines from a stale stored spec)
and again, as one batch, each time a file in it changes (`watch`). A bad batch is
rejected whole (and recorded as an event naming each bad document's file and field);
what is running keeps running, and nothing is pruned.

The directory owns what it applies: each object carries the annotation
`blazar.dev/source` with the file it came from, relative to the directory. With
pruning on (the default), an owned object that no file holds any more (its file
deleted, or it removed from its file) is deleted by the same batch, Lanes before the
Models they use. Objects without the annotation (applied by hand with `blazar apply`)
are never pruned. Each pruned object gets a `Pruned` event saying where it came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import stat
from pathlib import Path
from typing import Any

import structlog
import watchfiles

from blazar.api import errors, manifests
from blazar.api.kinds import Resource
from blazar.store import apply
from blazar.store.base import ApplyAction, Store

log = structlog.get_logger(__name__)

# The annotation that says which file of the watched directory an object came from.
SOURCE_ANNOTATION = "blazar.dev/source"


def owned(obj: Resource) -> bool:
    """Whether the watched directory applied `obj` (and may prune it)."""
    return SOURCE_ANNOTATION in obj.metadata.annotations


def sync(store: Store, directory: Path, *, prune: bool = True) -> bool:
    """Apply the directory once; True when it was accepted."""
    try:
        loaded = load(directory)
    except Exception:
        log.exception("gitops.failed", directory=str(directory))
        return False
    return apply_loaded(store, directory, loaded, prune=prune)


def apply_loaded(store: Store, directory: Path, loaded: Loaded, *, prune: bool = True) -> bool:
    """Apply what `load` read of the directory as one batch; True when it was accepted."""
    try:
        outcomes = apply.apply_documents(
            store,
            loaded.docs,
            unreadable=loaded.unreadable,
            source=f"gitops:{directory}",
            prune=owned if prune else None,
        )
    except errors.ManifestInvalid as err:
        log.warning(
            "gitops.rejected", directory=str(directory), errors=[str(e) for e in err.errors]
        )
        return False
    except Exception:
        # Whatever a manifest breaks, the daemon and what it runs stay up.
        log.exception("gitops.failed", directory=str(directory))
        return False
    for o in outcomes:
        if o.action is ApplyAction.PRUNED:
            source = o.object.metadata.annotations.get(SOURCE_ANNOTATION, "?")
            store.record_event(
                kind=o.object.kind,
                name=o.object.metadata.name,
                type="Normal",
                reason="Pruned",
                message=f"Deleted: no file of {directory} holds it any more (it came from "
                f"{source}).",
            )
    changed = [
        f"{o.object.kind}/{o.object.metadata.name} {o.action.value}"
        for o in outcomes
        if o.action != ApplyAction.UNCHANGED
    ]
    log.info("gitops.applied", directory=str(directory), changed=changed, empty=loaded.empty)
    return True


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What `load` read of the directory."""

    docs: list[tuple[str, dict[str, Any]]]
    # What kept documents from being read, for `apply_documents` to reject with the batch.
    unreadable: tuple[errors.FieldError, ...]
    # Files that hold no object (empty, or only comments and `---`): no error, for a
    # file may be emptied on purpose, and they hold nothing to apply (what they held
    # before is pruned like an object removed from its file).
    empty: tuple[str, ...]


def load(directory: Path) -> Loaded:
    """The directory's documents, each located by its file relative to `directory` and
    annotated with it, or else what kept them from being read (for `apply_documents`
    to reject, and record, with the batch)."""
    if not directory.is_dir():
        # Gone or unmounted: never read as "every file deleted", which would prune all.
        return Loaded([], (errors.FieldError(str(directory), "not a directory"),), ())
    docs: list[tuple[str, dict[str, Any]]] = []
    problems: list[errors.FieldError] = []
    empty: list[str] = []
    for file in manifests.manifest_files(directory):
        relative = file.relative_to(directory).as_posix()
        try:
            found = manifests.parse_documents(file.read_text(encoding="utf-8"), source=relative)
        except errors.ManifestInvalid as err:
            problems += err.errors
            continue
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(errors.FieldError(relative, f"cannot read: {exc}"))
            continue
        if not found:
            empty.append(relative)
        docs += [(location, _annotated(doc, relative)) for location, doc in found]
    return Loaded(docs, tuple(problems), tuple(empty))


def _annotated(doc: dict[str, Any], relative: str) -> dict[str, Any]:
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict):
        return doc  # validation reports it
    annotations = metadata.get("annotations")
    if annotations is None:
        annotations = {}
    if not isinstance(annotations, dict):
        return doc
    return {
        **doc,
        "metadata": {**metadata, "annotations": {**annotations, SOURCE_ANNOTATION: relative}},
    }


def _is_manifest(change: watchfiles.Change, path: str) -> bool:
    return path.endswith(manifests.MANIFEST_SUFFIXES) and not Path(path).name.startswith(".")


def _identity(directory: Path) -> tuple[int, int] | None:
    """The directory the path names now (device and inode, through any symlink), or
    None when there is none."""
    try:
        found = directory.stat()
    except OSError:
        return None
    return (found.st_dev, found.st_ino) if stat.S_ISDIR(found.st_mode) else None


async def watch(
    store: Store, directory: Path, stop: asyncio.Event, *, prune: bool = True, poll: float = 1.0
) -> None:
    """Apply the directory on every change until `stop`; `sync` it first yourself.

    The directory is read and parsed on a worker thread: a huge file (YAML parses at a
    few MB a second) must not hold up the event loop that serves every request. Only
    the batch's apply, which writes the store, runs on the loop.

    A watch follows the directory it started on, not its path. Every `poll` seconds the
    path is looked at again: one re-pointed to another directory (a symlink swapped,
    as git-sync publishes each revision) or replaced by a rename is applied and
    watched from then on; one gone is applied once (an error, which prunes nothing)
    and waited for. A directory applied before its watch began is read again at the
    watch's first tick, so that an edit made in between is not missed.
    """
    watching = _identity(directory)
    # Read before the current watch began: read once more when it has.
    reread = False

    async def apply_directory() -> None:
        try:
            loaded = await asyncio.to_thread(load, directory)
        except Exception:
            log.exception("gitops.failed", directory=str(directory))
            return
        apply_loaded(store, directory, loaded, prune=prune)

    while not stop.is_set():
        if watching is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll)
            if (now := _identity(directory)) is not None:
                log.info("gitops.directory_back", directory=str(directory))
                watching = now
                await apply_directory()
                reread = True
            continue
        changes = watchfiles.awatch(
            directory,
            stop_event=stop,
            debounce=200,
            step=50,
            watch_filter=_is_manifest,
            rust_timeout=round(poll * 1000),
            yield_on_timeout=True,
        )
        try:
            async with contextlib.aclosing(changes):
                async for changed in changes:
                    now = _identity(directory)
                    if now != watching:
                        log.info(
                            "gitops.directory_replaced", directory=str(directory), found=bool(now)
                        )
                        watching = now
                        await apply_directory()
                        reread = True
                        break  # watch what the path names now
                    if changed or reread:
                        reread = False
                        await apply_directory()
        except OSError:
            # Gone between the look and the watch's start: waited for as above.
            log.warning("gitops.watch_failed", directory=str(directory), exc_info=True)
            watching = None
