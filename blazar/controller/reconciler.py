"""What every reconciler returns, and the errors that steer retries (after kopf)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from blazar.api.kinds import Kind


@dataclass(frozen=True)
class Result:
    """`requeue_after` seconds: look again later even if nothing changes (polling)."""

    requeue_after: float | None = None


# The longest an object waits to be reconciled again after the store could not take
# its status or give a read (`errors.Unavailable`: a full disk, a file made read-only);
# other failures back off up to the work queue's bound.
STORE_RETRY_S = 5.0


class TemporaryError(Exception):
    """Retry after `delay` seconds instead of the work queue's backoff."""

    def __init__(self, message: str, *, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


class Reconciler(Protocol):
    kind: Kind

    async def reconcile(self, name: str) -> Result:
        """Converge one object of `kind` to its spec; read everything, write status."""
        ...
