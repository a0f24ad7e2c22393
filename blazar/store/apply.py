"""The admission of manifests: the one way desired state is written.

`apply_documents` validates every document of a batch (schema, then references
against the batch and the store), then has the store decide and write all of it or
nothing (`Store.apply_all`). A rejected batch changes no object and is recorded as a
Warning event `ManifestRejected` on the pseudo-kind `Manifest`, named after its
source; so is one with a document its caller could not even parse (bad JSON or
YAML), which the caller hands over as `unreadable`. The Control API's `Apply` and
the GitOps watcher both come here, so a manifest is judged the same whichever way
it arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blazar.api import errors, manifests
from blazar.api.errors import FieldError
from blazar.store.base import ApplyOutcome, Store


def apply_documents(
    store: Store,
    docs: Sequence[tuple[str, dict[str, Any]]],
    *,
    unreadable: Sequence[FieldError] = (),
    dry_run: bool = False,
    source: str = "apply",
) -> list[ApplyOutcome]:
    """Validate and apply docs, (location, mapping) pairs, as one batch; raise
    ManifestInvalid and write nothing (except a Warning event) when any is wrong.

    `unreadable` are the batch's documents that could not be parsed; with any, the
    batch is rejected for those alone (what they held could have been referenced).
    """
    try:
        if unreadable:
            raise errors.ManifestInvalid(unreadable)
        objects = manifests.validate_objects(
            docs, exists=lambda kind, name: store.get(kind, name) is not None
        )
        if store.admission is not None and (refused := store.admission(objects)):
            raise errors.ManifestInvalid(refused)
    except errors.ManifestInvalid as err:
        if not dry_run:
            store.record_event(
                kind="Manifest",
                name=source,
                type="Warning",
                reason="ManifestRejected",
                message="; ".join(str(e) for e in err.errors),
            )
        raise
    return store.apply_all(objects, dry_run=dry_run)
