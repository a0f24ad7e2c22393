"""How `blazar.api.errors` map onto HTTP, where every dialect agrees (DESIGN §10).

Pure. Dialects choose their own envelopes and may deviate per status (Anthropic
answers 529 for overload); the status table and the Retry-After rule are shared.
"""

from __future__ import annotations

import math

from blazar.api import errors

# Keyed by the gRPC code name so that error classes added later, and a newer peer's
# reasons this shim does not know (`errors.from_reason` keeps their code), map as
# google.rpc's HTTP mapping has them rather than as 500.
_STATUS_BY_CODE: dict[str, int] = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}

# Without the daemon's hint (`errors.RETRY_AFTER_KEY`): a second, the smallest whole one.
DEFAULT_RETRY_AFTER_S = 1


# Where a reason is more specific than its gRPC code.
_STATUS_BY_REASON: dict[str, int] = {
    errors.RequestTooLarge.reason: 413,
    errors.UnsupportedMediaType.reason: 415,
}


def http_status(err: errors.BlazarError) -> int:
    return _STATUS_BY_REASON.get(err.reason) or _STATUS_BY_CODE.get(err.code, 500)


def retry_after_seconds(err: errors.BlazarError) -> int:
    """Whole seconds for a `Retry-After` header: the daemon's hint rounded up, at least 1."""
    raw = err.metadata.get(errors.RETRY_AFTER_KEY)
    if raw is not None:
        try:
            millis = float(raw)
        except ValueError:
            millis = math.nan
        if math.isfinite(millis):
            return max(1, math.ceil(millis / 1000))
    return DEFAULT_RETRY_AFTER_S


def retry_after_millis(err: errors.BlazarError) -> int | None:
    """The daemon's hint in whole milliseconds, rounded up (None: it gave none)."""
    try:
        millis = float(err.metadata.get(errors.RETRY_AFTER_KEY, "nan"))
    except ValueError:
        return None
    return max(0, math.ceil(millis)) if math.isfinite(millis) else None


def headers(err: errors.BlazarError) -> dict[str, str]:
    """The headers every dialect's error response carries: `Retry-After` on a 429, and
    on a 503 that carries the daemon's hint (an upstream server's own Retry-After).
    Beside it, `retry-after-ms` with the hint to the millisecond when there is one: the
    OpenAI and Anthropic clients read it before `Retry-After`, whose whole seconds
    would make a client told "0.2 s" wait a second. An error that no wait cures
    (`errors.RETRYABLE_KEY`) has no Retry-After but `x-should-retry: false`, which keeps
    the OpenAI and Anthropic clients from retrying a 429 on their own."""
    if err.metadata.get(errors.RETRYABLE_KEY) == "false":
        return {"x-should-retry": "false"}
    status = http_status(err)
    if status == 429 or (status == 503 and errors.RETRY_AFTER_KEY in err.metadata):
        out = {"retry-after": str(retry_after_seconds(err))}
        if (millis := retry_after_millis(err)) is not None:
            out["retry-after-ms"] = str(millis)
        return out
    return {}
