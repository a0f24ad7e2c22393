"""A request's session key: the replica its follow-ups prefer while it is healthy
(`blazar.dataplane.routing`). Blazar's own `x-blazar-session` header and the gRPC
`session` field carry it as given, up to `MAX_SESSION_BYTES` (the data plane refuses a
longer one: it keeps a name per session). A dialect's own field stands in when
neither is sent (OpenAI's `prompt_cache_key`, `user`, `safety_identifier`;
Anthropic's `metadata.user_id`), and those fields have no such bound in their own
APIs, so a longer value is keyed by its digest instead of refused: the key only has to
be the same for the same value.

Pure.
"""

from __future__ import annotations

import hashlib

MAX_SESSION_BYTES = 256


def of_field(value: str | None) -> str:
    """The session key a dialect's field `value` gives ("" for none)."""
    if not value:
        return ""
    if len(value.encode()) <= MAX_SESSION_BYTES:
        return value
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()
