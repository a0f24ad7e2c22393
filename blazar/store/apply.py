"""The admission of manifests: the one way desired state is written.

`apply_documents` validates every document of a batch (schema, then references
against the batch and the store), then has the store decide and write all of it or
nothing (`Store.apply_all`). A rejected batch changes no object and is recorded as a
Warning event `ManifestRejected` on the pseudo-kind `Manifest`, named after its
source; so is one with a document its caller could not even parse (bad JSON or
YAML), which the caller hands over as `unreadable`. The Control API's `Apply` and
the GitOps watcher both come here, so a manifest is judged the same whichever way
it arrives.

A document's `metadata.resourceVersion` is what `resource_versions` says: on the
interactive path (Control's `Apply`: `blazar apply -f` and any API client) a
precondition, Kubernetes' optimistic concurrency, so that a stale file taken from
`get -o yaml` cannot silently undo a change made since (`errors.Conflict`, nothing
written, no event: the manifest is sound, only out of date); for the watched
directory, which is the desired state itself, nothing.

With `prune` (GitOps), the objects it says the batch's source owns and the batch no
longer holds are deleted in the same commit (`Store.apply_all`); a batch may not
name them, for they are about to go.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from blazar.api import errors, manifests
from blazar.api.errors import FieldError
from blazar.api.kinds import Kind
from blazar.store.base import ApplyOutcome, Owns, Store


class ResourceVersions(StrEnum):
    """What a document's `metadata.resourceVersion` means to the apply of its batch."""

    # The version the object must still be at, or the batch is refused (`Conflict`).
    PRECONDITION = "precondition"
    # Nothing: the batch replaces whatever is stored (the watched directory's files are
    # the desired state, and one taken from `get -o yaml` would conflict after its own
    # second edit).
    IGNORED = "ignored"


def apply_documents(
    store: Store,
    docs: Sequence[tuple[str, dict[str, Any]]],
    *,
    unreadable: Sequence[FieldError] = (),
    dry_run: bool = False,
    source: str = "apply",
    prune: Owns | None = None,
    resource_versions: ResourceVersions = ResourceVersions.PRECONDITION,
) -> list[ApplyOutcome]:
    """Validate and apply docs, (location, mapping) pairs, as one batch; raise
    ManifestInvalid and write nothing (except a Warning event) when any is wrong.

    `unreadable` are the batch's documents that could not be parsed; with any, the
    batch is rejected for those alone (what they held could have been referenced).
    The Warning event names, beside each object's error, the document it came from.
    Raise `errors.Conflict`, writing nothing, when an object is not at the
    resourceVersion its document expects (`ResourceVersions.PRECONDITION`).
    """

    def exists(kind: Kind, name: str) -> bool:
        # Asked only of objects the batch does not declare: one the source owns is pruned.
        found = store.get(kind, name)
        return found is not None and (prune is None or not prune(found))

    try:
        if unreadable:
            raise errors.ManifestInvalid(unreadable)
        preconditions, bad_versions = (
            manifests.resource_versions(docs)
            if resource_versions is ResourceVersions.PRECONDITION
            else ({}, [])
        )
        try:
            objects = manifests.validate_objects(docs, exists=exists)
        except errors.ManifestInvalid as err:
            # Reported with the rest, so the whole batch is fixed in one round.
            raise errors.ManifestInvalid([*err.errors, *bad_versions]) from None
        if bad_versions:
            raise errors.ManifestInvalid(bad_versions)
        if store.admission is not None and (refused := store.admission(objects)):
            raise errors.ManifestInvalid(refused)
    except errors.ManifestInvalid as err:
        if not dry_run:
            store.record_event(
                kind="Manifest",
                name=source,
                type="Warning",
                reason="ManifestRejected",
                message="; ".join(str(e) for e in manifests.locate(err.errors, docs)),
            )
        raise
    return store.apply_all(objects, dry_run=dry_run, prune=prune, preconditions=preconditions)
