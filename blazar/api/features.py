"""Which Blazar this is, and the request features a client must not send a daemon that
does not act on them.

proto3 drops a field its server does not know without a word, and a daemon that
predates a meaning of a field it does know (an Apply's `metadata.resourceVersion`
precondition) ignores it as quietly. After `pip install -U blazar` the CLI is new at
once while the daemon keeps running the old code until it is restarted: `blazar logs
--tail 5` would print the whole log, and an apply meant to fail on a concurrent change
would overwrite it. So the daemon names the features it has (`Control.Version`), and
the CLI refuses to send one the daemon lacks, saying why. A daemon that predates
`Version` has none of them.

Each feature is named once here: the daemon answers `SERVED`, the CLI asks for one by
its constant. A feature added later is a new constant in `SERVED`.
"""

from __future__ import annotations

import importlib.metadata

# `LogsRequest.tail_lines` (`blazar logs --tail N`).
LOGS_TAIL = "logs.tail_lines"
# An Apply that fails (ABORTED, CONFLICT) when an object is not at the
# `metadata.resourceVersion` its document sets.
APPLY_PRECONDITION = "apply.resource_version"

SERVED: tuple[str, ...] = (LOGS_TAIL, APPLY_PRECONDITION)


def version() -> str:
    """This blazar package's version ("0.0.0" when it runs from a tree not installed)."""
    try:
        return importlib.metadata.version("blazar")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"
