"""Carry `blazar.api.errors.BlazarError` across gRPC and back.

On the wire an error is a status code (from `BlazarError.code`), the message as the
status details, and trailing metadata: `blazar-reason` plus one `blazar-<key>` entry
per metadata item (for example `blazar-retry_after_ms`).
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from blazar.api import errors

REASON_KEY = "blazar-reason"
_PREFIX = "blazar-"


def trailing_metadata(err: errors.BlazarError) -> tuple[tuple[str, str], ...]:
    items = [(REASON_KEY, err.reason)]
    items += [(_PREFIX + k.lower(), v) for k, v in sorted(err.metadata.items())]
    return tuple(items)


def grpc_code(err: errors.BlazarError) -> grpc.StatusCode:
    return grpc.StatusCode[err.code]


async def abort(context: Any, err: errors.BlazarError) -> NoReturn:
    """End the RPC with err's status; never returns."""
    context.set_trailing_metadata(trailing_metadata(err))
    await context.abort(grpc_code(err), err.message)
    raise AssertionError("unreachable")  # context.abort always raises


def from_rpc_error(exc: grpc.RpcError) -> errors.BlazarError:
    """Rebuild the BlazarError a peer sent; transport failures become Unavailable."""
    code: grpc.StatusCode = exc.code()
    message: str = exc.details() or code.name
    trailers = exc.trailing_metadata() or ()
    meta = {str(k): v if isinstance(v, str) else v.decode() for k, v in trailers}
    reason = meta.pop(REASON_KEY, "")
    metadata = {k[len(_PREFIX) :]: v for k, v in meta.items() if k.startswith(_PREFIX)}
    if reason:
        return errors.from_reason(reason, message, metadata)
    return _BY_CODE.get(code, errors.BlazarError)(message)


# What a bare status (no blazar-reason, e.g. from gRPC itself) means.
_BY_CODE: dict[grpc.StatusCode, type[errors.BlazarError]] = {
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.NOT_FOUND: errors.ObjectNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.Overloaded,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
}
