"""The admission of manifests: the one way desired state is written.

`apply_documents` validates every document of a batch (schema, then references
against the batch and the store), then has the store decide and write all of it or
nothing (`Store.apply_all`). A rejected batch changes no object and is recorded as a
Warning event `ManifestRejected` on the pseudo-kind `Manifest`, named after its
source; so is one with a document its caller could not even parse (bad JSON or
YAML), which the caller hands over as `unreadable`. The Control API's `Apply` and
the GitOps watcher both come here, so a manifest is judged the same whichever way
it arrives.

With `prune` (GitOps), the objects it says the batch's source owns and the batch no
longer holds are deleted in the same commit (`Store.apply_all`); a batch may not
name them, for they are about to go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blazar.api import errors, manifests
from blazar.api.errors import FieldError
from blazar.api.kinds import Kind
from blazar.store.base import ApplyOutcome, Owns, Store


def apply_documents(
    store: Store,
    docs: Sequence[tuple[str, dict[str, Any]]],
    *,
    unreadable: Sequence[FieldError] = (),
    dry_run: bool = False,
    source: str = "apply",
    prune: Owns | None = None,
) -> list[ApplyOutcome]:
    """Validate and apply docs, (location, mapping) pairs, as one batch; raise
    ManifestInvalid and write nothing (except a Warning event) when any is wrong.

    `unreadable` are the batch's documents that could not be parsed; with any, the
    batch is rejected for those alone (what they held could have been referenced).
    The Warning event names, beside each object's error, the document it came from.
    """

    def exists(kind: Kind, name: str) -> bool:
        # Asked only of objects the batch does not declare: one the source owns is pruned.
        found = store.get(kind, name)
        return found is not None and (prune is None or not prune(found))

    try:
        if unreadable:
            raise errors.ManifestInvalid(unreadable)
        objects = manifests.validate_objects(docs, exists=exists)
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
    return store.apply_all(objects, dry_run=dry_run, prune=prune)
