"""Keeps the store in step with a directory of manifests (GitOps).

Every manifest under the directory is applied at start (`sync`, which the daemon calls
before its controllers run, so that they never start engines from a stale stored spec)
and again, as one batch, each time a file in it changes (`watch`). A bad batch is
rejected whole (and recorded as an event); what is running keeps running.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog
import watchfiles

from blazar.api import errors, manifests
from blazar.store import apply
from blazar.store.base import ApplyAction, Store

log = structlog.get_logger(__name__)

_SUFFIXES = (".yaml", ".yml", ".json")


def sync(store: Store, directory: Path) -> bool:
    """Apply the directory once; True when it was accepted."""
    try:
        docs, unreadable = _load(directory)
        outcomes = apply.apply_documents(
            store, docs, unreadable=unreadable, source=f"gitops:{directory}"
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
    changed = [
        f"{o.object.kind}/{o.object.metadata.name} {o.action.value}"
        for o in outcomes
        if o.action != ApplyAction.UNCHANGED
    ]
    log.info("gitops.applied", directory=str(directory), changed=changed)
    return True


def _load(
    directory: Path,
) -> tuple[list[tuple[str, dict[str, Any]]], tuple[errors.FieldError, ...]]:
    """The directory's documents, or else what kept them from being read (for
    `apply_documents` to reject, and record, with the batch)."""
    try:
        return manifests.load_path(directory), ()
    except errors.ManifestInvalid as err:
        return [], err.errors


def _is_manifest(change: watchfiles.Change, path: str) -> bool:
    return path.endswith(_SUFFIXES) and not Path(path).name.startswith(".")


async def watch(store: Store, directory: Path, stop: asyncio.Event) -> None:
    """Apply the directory on every change until `stop`; `sync` it first yourself."""
    async for _ in watchfiles.awatch(
        directory, stop_event=stop, debounce=200, step=50, watch_filter=_is_manifest
    ):
        sync(store, directory)
