"""Which Blazar daemon a request passed through, so that one that comes back is refused.

An upstream Lane whose `upstream.url` leads back to its own daemon (a copied example's
`http://127.0.0.1:8420/v1`) would send each request to itself, and each of those on
again, until every slot waits on the next hop and the first-byte timeout ends them all
with a message that names no cause. So every request an upstream client sends carries
`x-blazar-via: <this daemon's id>`, and the HTTP shim refuses one that carries its own
id (HTTP 508, Loop Detected): the probe then fails saying why, and the Lane is not
Available.
"""

from __future__ import annotations

import secrets

HEADER = "x-blazar-via"

# This process's id: random per daemon start, never a secret (it only names a hop).
DAEMON_ID = secrets.token_hex(8)

LOOP_STATUS = 508


def came_back(header: str | None, *, daemon_id: str = DAEMON_ID) -> bool:
    """Whether a request whose `x-blazar-via` says `header` passed through this daemon."""
    return header is not None and daemon_id in (part.strip() for part in header.split(","))


LOOP_MESSAGE = (
    "This request came back to the Blazar daemon that sent it upstream: an upstream "
    "Lane's upstream.url leads to this daemon itself. Point it at another server."
)
