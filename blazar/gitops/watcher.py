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
While the watch runs, a file of zero bytes prunes what it held only once it has stayed
so for `ZERO_BYTE_SETTLE_S`: it may be in the middle of being rewritten. Nor is a
directory applied while git is rewriting it (`GIT_LOCK_WAIT_S`): what git has written so
far is no revision of the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import stat
import time
from collections.abc import Iterable, Mapping
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


# How long a watched file of zero bytes keeps what it held from being pruned. A shell's
# `>` and editors that save in place truncate a file before they write it; a write
# that comes later than the watch's debounce (`blazar get lanes -o yaml > fleet.yaml`
# starts a Python process first) would otherwise prune what the file held, stopping
# its engines (and deleting persisted KV caches), then create it all again.
ZERO_BYTE_SETTLE_S = 5.0


# How long the git work tree holding the watched directory may be busy (`git_busy`)
# before the directory is applied anyway. git holds `index.lock` while it rewrites the
# work tree (checkout, reset --hard, stash, merge and so pull), removing files before it
# writes the new ones: a batch read in between prunes a Lane whose file was renamed, or
# moved to another file, stopping its engine, and creates it again a moment later. A
# rebase (or `am`, or a cherry-pick or revert of several commits) rewrites it once per
# commit, each step a tree nobody asked for. A lock held longer than this was left by a
# git that died (git itself then refuses to run); a rebase that long has stopped for
# its user (a conflict, an `edit`), whose tree is theirs to apply.
GIT_LOCK_WAIT_S = 10.0
# What git keeps in its directory while it is busy: the index lock, then the state of
# a rebase, an `am`, or a sequence of cherry-picks or reverts.
_GIT_BUSY = ("index.lock", "rebase-merge", "rebase-apply", "sequencer")


def owned(obj: Resource) -> bool:
    """Whether the watched directory applied `obj` (and may prune it)."""
    return SOURCE_ANNOTATION in obj.metadata.annotations


def zero_byte_since(
    zero_byte: Iterable[str], since: Mapping[str, float], now: float
) -> dict[str, float]:
    """Each file of zero bytes now, with when it was first seen so: in `since` (the
    last read's answer), else `now`."""
    return {file: since.get(file, now) for file in zero_byte}


def settling(since: Mapping[str, float], now: float) -> frozenset[str]:
    """The zero-byte files (`zero_byte_since`) whose objects are not pruned yet."""
    return frozenset(f for f, t in since.items() if now - t < ZERO_BYTE_SETTLE_S)


def waiting_for_git(locked_since: float | None, now: float) -> bool:
    """Whether a git work tree locked since `locked_since` (None: not locked) is still
    being rewritten, so that the directory is not applied yet."""
    return locked_since is not None and now - locked_since < GIT_LOCK_WAIT_S


def git_dir(directory: Path) -> Path | None:
    """The git directory of the work tree that holds `directory` (its root or any
    folder in it), or None outside one. A linked worktree's or a submodule's `.git` is a
    file naming its git directory."""
    try:
        folder = directory.resolve()
    except OSError:
        return None
    for candidate in (folder, *folder.parents):
        dot_git = candidate / ".git"
        try:
            if dot_git.is_dir():
                return dot_git
            if dot_git.is_file():
                named = dot_git.read_text(encoding="utf-8").strip()
                if not named.startswith("gitdir:"):
                    return None
                return candidate / named.removeprefix("gitdir:").strip()
        except (OSError, UnicodeDecodeError):
            return None
    return None


def git_busy(directory: Path) -> str | None:
    """What says git is busy with the work tree that holds `directory` (`_GIT_BUSY`:
    `index.lock`, `rebase-merge`, ...), or None when it is not."""
    found = git_dir(directory)
    if found is None:
        return None
    return next((name for name in _GIT_BUSY if (found / name).exists()), None)


def sync(store: Store, directory: Path, *, prune: bool = True) -> bool:
    """Apply the directory once; True when it was accepted."""
    try:
        loaded = load(directory)
    except Exception:
        log.exception("gitops.failed", directory=str(directory))
        return False
    try:
        return apply_loaded(store, directory, loaded, prune=prune)
    except errors.Unavailable as err:
        log.warning("gitops.retry", directory=str(directory), error=err.message)
        return False


def apply_loaded(
    store: Store,
    directory: Path,
    loaded: Loaded,
    *,
    prune: bool = True,
    keep: frozenset[str] = frozenset(),
) -> bool:
    """Apply what `load` read of the directory as one batch; True when it was accepted.
    What came from the files in `keep` is not pruned.

    Unavailable (the store cannot take a write now: a full disk, a lock) is raised, for
    the caller to try again: unlike a rejected manifest, it says nothing of the files.
    """

    def prunable(obj: Resource) -> bool:
        return owned(obj) and obj.metadata.annotations[SOURCE_ANNOTATION] not in keep

    try:
        outcomes = apply.apply_documents(
            store,
            loaded.docs,
            unreadable=loaded.unreadable,
            source=f"gitops:{directory}",
            prune=prunable if prune else None,
            # The directory is the desired state: a version copied into a file (from
            # `get -o yaml`) is no precondition, or the file would conflict after its
            # own second edit.
            resource_versions=apply.ResourceVersions.IGNORED,
        )
    except errors.ManifestInvalid as err:
        log.warning(
            "gitops.rejected", directory=str(directory), errors=[str(e) for e in err.errors]
        )
        return False
    except errors.Unavailable:
        raise
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
    # Those of `empty` that are zero bytes long.
    zero_byte: tuple[str, ...] = ()
    # Every manifest file read (or tried), relative to the directory.
    files: tuple[str, ...] = ()


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
    zero_byte: list[str] = []
    files: list[str] = []
    for file in manifests.manifest_files(directory):
        relative = file.relative_to(directory).as_posix()
        files.append(relative)
        try:
            text = file.read_text(encoding="utf-8")
            found = manifests.parse_documents(text, source=relative)
        except errors.ManifestInvalid as err:
            problems += err.errors
            continue
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(errors.FieldError(relative, f"cannot read: {exc}"))
            continue
        if not found:
            empty.append(relative)
        if not text:
            zero_byte.append(relative)
        docs += [(location, _annotated(doc, relative)) for location, doc in found]
    return Loaded(docs, tuple(problems), tuple(empty), tuple(zero_byte), tuple(files))


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


def folders(files: Iterable[str]) -> frozenset[str]:
    """Each folder (relative to the directory, `/`-separated) that holds, at any depth,
    one of `files` (relative to the directory)."""
    return frozenset(
        "/".join(parts[:i])
        for parts in (file.split("/") for file in files)
        for i in range(1, len(parts))
    )


def relevant(
    relative: tuple[str, ...] | None,
    *,
    change: watchfiles.Change,
    is_dir: bool,
    held: frozenset[str],
) -> bool:
    """Whether a change the watch saw may change what the directory holds: a manifest
    file's, a folder's moved in (whose files make no event of their own), or a folder's
    moved away or deleted that held manifests (`held`, from `folders`). `relative` is the
    changed path's parts under the directory (None: not under it, as far as can be
    told); nothing hidden (`.git`, an editor's `.x.yaml.swp`) is."""
    if relative is None or not relative or any(part.startswith(".") for part in relative):
        return False
    if relative[-1].endswith(manifests.MANIFEST_SUFFIXES):
        return True
    if change is watchfiles.Change.deleted:
        return "/".join(relative) in held
    return is_dir


def _held(directory: Path) -> frozenset[str]:
    """The folders of `directory` that hold manifests now (`folders`)."""
    try:
        found = manifests.manifest_files(directory)
    except OSError:
        return frozenset()
    return folders(file.relative_to(directory).as_posix() for file in found)


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

    What a file of zero bytes held is pruned once it has stayed so for
    `ZERO_BYTE_SETTLE_S` (within a `poll` more): a file being rewritten is truncated
    first. A directory in a git work tree whose index git has locked is applied once
    git is done (within a `poll`), or once `GIT_LOCK_WAIT_S` has passed.
    """
    watching = _identity(directory)
    # Read before the current watch began: read once more when it has.
    reread = False
    # Files of zero bytes, since when; and when the first of them may prune.
    zero_byte: dict[str, float] = {}
    recheck_at: float | None = None
    # Since when git has held the work tree's index lock, as last seen.
    git_locked_since: float | None = None
    # The folders that held manifests at the last read: moved away, they are a change.
    held: frozenset[str] = frozenset()

    def under(path: str) -> tuple[str, ...] | None:
        """`path`'s parts under the directory, as named or (a symlink) as resolved."""
        changed = Path(path)
        if changed.is_relative_to(directory):
            return changed.relative_to(directory).parts
        with contextlib.suppress(OSError, RuntimeError):
            if changed.is_relative_to(root := directory.resolve()):
                return changed.relative_to(root).parts
        return None

    def watched(change: watchfiles.Change, path: str) -> bool:
        return relevant(under(path), change=change, is_dir=Path(path).is_dir(), held=held)

    async def apply_directory() -> bool:
        """Read and apply the directory; False when git is rewriting it or the store
        could not take it, to be tried again at the next tick rather than at the next
        change."""
        nonlocal zero_byte, recheck_at, git_locked_since, held
        busy = await asyncio.to_thread(git_busy, directory)
        locked = busy is not None
        now = time.monotonic()
        git_locked_since = (
            (now if git_locked_since is None else git_locked_since) if locked else None
        )
        if waiting_for_git(git_locked_since, now):
            log.info("gitops.deferred", directory=str(directory), reason=f"git is busy ({busy})")
            return False
        if locked:
            log.warning(
                "gitops.git_lock_ignored",
                directory=str(directory),
                reason=f"git busy ({busy}) over {GIT_LOCK_WAIT_S:g} s: a git that died, or "
                "a rebase stopped for its user",
            )
        try:
            loaded = await asyncio.to_thread(load, directory)
        except Exception:
            log.exception("gitops.failed", directory=str(directory))
            return True
        held = folders(loaded.files)
        now = time.monotonic()
        zero_byte = zero_byte_since(loaded.zero_byte, zero_byte, now)
        keep = settling(zero_byte, now) if prune else frozenset()
        recheck_at = min((zero_byte[f] for f in keep), default=None)
        if recheck_at is not None:
            recheck_at += ZERO_BYTE_SETTLE_S
            log.info(
                "gitops.prune_deferred",
                directory=str(directory),
                files=sorted(keep),
                reason="zero bytes: maybe being rewritten",
            )
        try:
            apply_loaded(store, directory, loaded, prune=prune, keep=keep)
        except errors.Unavailable as err:
            log.warning("gitops.retry", directory=str(directory), error=err.message)
            return False
        return True

    def settled() -> bool:
        return recheck_at is not None and time.monotonic() >= recheck_at

    held = await asyncio.to_thread(_held, directory)
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
            watch_filter=watched,
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
                    if changed or reread or settled():
                        reread = not await apply_directory()
        except OSError:
            # Gone between the look and the watch's start: waited for as above.
            log.warning("gitops.watch_failed", directory=str(directory), exc_info=True)
            watching = None
