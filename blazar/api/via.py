"""Which Blazar daemons a request passed through, so that one that comes back is refused.

An upstream Lane whose `upstream.url` leads back to its own daemon (a copied example's
`http://127.0.0.1:8420/v1`), directly or through other daemons whose upstream Lanes
lead back (A -> B -> A), would send each request round again, until every slot waits
on the next hop and the first-byte timeout ends them all with a message that names no
cause. So every request an upstream client sends carries `x-blazar-via`: the ids of
the daemons it went through, the sender's own last. The HTTP shim refuses one that
names its own daemon (HTTP 508, Loop Detected) and passes the list on to the data
plane (gRPC metadata under the same key), whose upstream client appends its own id:
the request that comes back, however long the way round, names the daemon it reaches.

The list is bounded: at most MAX_HOPS ids of at most MAX_ID_CHARS, and a daemon
refuses to forward a request that already went through MAX_HOPS (so no chain, loop
or not, goes on without end). A header that is not such a list is the caller's
mistake (INVALID_ARGUMENT naming the header); only Blazar daemons send it.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence

from blazar.api import errors

HEADER = "x-blazar-via"

# This process's id: random per daemon start, never a secret (it only names a hop).
DAEMON_ID = secrets.token_hex(8)

LOOP_STATUS = 508

# The most daemons a request may pass through, and the longest id the header may name
# (this module makes ids of 16 hex digits; a later version may make longer ones).
MAX_HOPS = 16
MAX_ID_CHARS = 64
_ID = re.compile(r"[A-Za-z0-9_-]+")


def hops(header: str | None) -> tuple[str, ...]:
    """The daemon ids an `x-blazar-via` header lists, in order (none when not sent);
    InvalidRequest naming the header when it is not a list of ids within the bounds."""
    if header is None or not header.strip():
        return ()
    ids = tuple(part.strip() for part in header.split(","))
    if len(ids) > MAX_HOPS:
        raise _invalid(f"it lists {len(ids)} daemons, more than the {MAX_HOPS} allowed")
    for one in ids:
        if not _ID.fullmatch(one) or len(one) > MAX_ID_CHARS:
            raise _invalid(
                f"{one[:MAX_ID_CHARS]!r} is not a daemon id (1 to {MAX_ID_CHARS} letters, "
                "digits, '-' or '_')"
            )
    return ids


def came_back(ids: Sequence[str], *, daemon_id: str = DAEMON_ID) -> bool:
    """Whether a request that went through the daemons `ids` passed through this one."""
    return daemon_id in ids


def forwarded(ids: Sequence[str], *, daemon_id: str = DAEMON_ID) -> str:
    """The header a request that went through `ids` carries when this daemon sends it
    upstream; UNAVAILABLE when it went through MAX_HOPS daemons already."""
    if len(ids) >= MAX_HOPS:
        raise errors.Unavailable(
            f"This request already went through {len(ids)} Blazar daemons, each sending it "
            f"to the next one's upstream Lane; a daemon sends on none that went through "
            f"{MAX_HOPS}. Shorten the chain of upstream.url."
        )
    return ", ".join((*ids, daemon_id))


def _invalid(why: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"Invalid '{HEADER}' header: {why}. Only Blazar daemons send it, as a "
        "comma-separated list of the daemons a request went through."
    )


LOOP_MESSAGE = (
    "This request came back to a Blazar daemon it had already passed through: an "
    "upstream Lane's upstream.url leads to this daemon itself, directly or through "
    "other daemons whose upstream Lanes lead back. Point it at another server."
)
