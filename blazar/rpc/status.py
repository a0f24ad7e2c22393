"""Carry `blazar.api.errors.BlazarError` across gRPC and back.

On the wire an error is a status code (from `BlazarError.code`), the message as the
status details, and trailing metadata in two forms that say the same thing:

- `grpc-status-details-bin`: a serialized `google.rpc.Status` (the same code and
  message) whose details hold one `google.rpc.ErrorInfo` with the error's `reason`,
  domain `blazar.dev` and its `metadata` (for example `retry_after_ms`). This is what
  gRPC's rich-error idiom reads in any language (`status.FromError(err).Details()` in
  Go, `tonic_types::StatusExt` in Rust, `grpcio-status`'s `rpc_status.from_call`).
  Only an error with a message of some 2 KB or more lacks it (see `DETAILS_LIMIT`).
- `blazar-reason` plus one `blazar-<key>` entry per metadata item (for example
  `blazar-retry_after_ms`), for clients that read plain trailers. An item whose value
  is not printable ASCII (say a model name the caller typed) is only in the ErrorInfo:
  gRPC refuses such a trailer and would turn the whole error into INTERNAL.

Reading back prefers the ErrorInfo, then the `blazar-*` trailers. A status with
neither came from gRPC itself and is read by its code, with one exception: gRPC
refuses a message over a size limit with RESOURCE_EXHAUSTED, which would read as
`Overloaded` (retry later), though retrying cannot help. That refusal is the caller's
request being too large (`RequestTooLarge`) or the answer it asked for
(`InvalidRequest`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NoReturn, cast

import grpc
from google.protobuf import message as protobuf_message
from google.rpc import error_details_pb2, status_pb2

from blazar.api import errors

REASON_KEY = "blazar-reason"
DETAILS_KEY = "grpc-status-details-bin"
DOMAIN = "blazar.dev"
_PREFIX = "blazar-"


# The largest `grpc-status-details-bin` sent, in bytes before base64. The Status repeats
# the message, so the details more than double the trailers, and a gRPC client drops
# trailers past 8 KiB at random (its soft limit; all of them past 16 KiB) as
# RESOURCE_EXHAUSTED. A message that long (a manifest with dozens of errors) goes without
# the details, as it went before they were sent; every other error has them.
DETAILS_LIMIT = 2048

# The longest status message sent, in bytes as gRPC writes it: percent-encoded in the
# `grpc-message` trailer, where a byte other than printable ASCII (or "%") takes three.
# Past the client's trailer limits the whole status is lost as RESOURCE_EXHAUSTED: an
# error quoting a 100 kB value the caller sent (a tool's name, a schema's property)
# reached HTTP clients as a 429 to retry. Up to this, a manifest's dozens of errors go
# whole; a longer message keeps its start and its end (`wire_message`).
MESSAGE_LIMIT = 7_000
_PLAIN_BYTES = bytes(b for b in range(0x20, 0x7F) if b != ord("%"))


def trailing_metadata(err: errors.BlazarError) -> tuple[tuple[str, str | bytes], ...]:
    items: list[tuple[str, str | bytes]] = [(REASON_KEY, err.reason)]
    items += [(_PREFIX + k.lower(), v) for k, v in sorted(err.metadata.items()) if _sendable(v)]
    details = rpc_status(err).SerializeToString()
    if len(details) <= DETAILS_LIMIT:
        items.append((DETAILS_KEY, details))
    return tuple(items)


def _sendable(value: str) -> bool:
    """Whether gRPC takes value in a text trailer: printable ASCII only."""
    return all(" " <= c <= "~" for c in value)


def wire_message(message: str) -> str:
    """`message` as an error sends it: whole up to MESSAGE_LIMIT wire bytes, else its
    start and end with what lies between left out."""
    if _wire_length(message) <= MESSAGE_LIMIT:
        return message
    half = (MESSAGE_LIMIT - 100) // 2
    head = _within(message, half)
    tail = _within(message[::-1], half)[::-1]
    left_out = len(message) - len(head) - len(tail)
    return f"{head} [... {left_out} characters left out ...] {tail}"


def _wire_length(text: str) -> int:
    data = text.encode("utf-8", "replace")
    return len(data) + 2 * len(data.translate(None, _PLAIN_BYTES))


def _within(text: str, budget: int) -> str:
    """The longest start of text whose wire length is at most budget."""
    used = 0
    for i, char in enumerate(text):
        used += _wire_length(char)
        if used > budget:
            return text[:i]
    return text


def rpc_status(err: errors.BlazarError) -> status_pb2.Status:
    """The `google.rpc.Status` of err: its code and message, and one ErrorInfo."""
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=err.metadata)
    status = status_pb2.Status(code=grpc_code(err).value[0], message=wire_message(err.message))
    status.details.add().Pack(info)
    return status


def grpc_code(err: errors.BlazarError) -> grpc.StatusCode:
    return grpc.StatusCode[err.code]


async def abort(context: grpc.aio.ServicerContext[Any, Any], err: errors.BlazarError) -> NoReturn:
    """End the RPC with err's status; never returns (`context.abort` raises)."""
    await context.abort(grpc_code(err), wire_message(err.message), trailing_metadata(err))


def from_rpc_error(exc: grpc.RpcError) -> errors.BlazarError:
    """Rebuild the BlazarError a peer sent; transport failures become Unavailable."""
    code: grpc.StatusCode = exc.code()
    message: str = exc.details() or code.name
    meta = dict(_trailers(exc))
    if (info := _error_info(meta.get(DETAILS_KEY), code)) is not None:
        return errors.from_reason(info.reason, message, dict(info.metadata), code=code.name)
    texts = {k: v if isinstance(v, str) else v.decode() for k, v in meta.items() if _is_text(k)}
    reason = texts.pop(REASON_KEY, "")
    metadata = {k[len(_PREFIX) :]: v for k, v in texts.items() if k.startswith(_PREFIX)}
    if reason:
        return errors.from_reason(reason, message, metadata, code=code.name)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and (too_large := _too_large(message)):
        return too_large
    return _BY_CODE.get(code, errors.BlazarError)(message)


def lost_peer(exc: grpc.RpcError) -> bool:
    """Whether gRPC itself reports the peer gone (UNAVAILABLE carrying nothing the peer
    sent, such as "Stream removed (Socket closed)"): a crashed or killed process, not
    an error it chose to return."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    keys = {k for k, _ in _trailers(exc)}
    return DETAILS_KEY not in keys and REASON_KEY not in keys


def _trailers(exc: grpc.RpcError) -> list[tuple[str, str | bytes]]:
    """exc's trailing metadata as (key, value) pairs; a value is bytes for `-bin` keys.

    Both of gRPC's forms (sync: a tuple of `_Metadatum` namedtuples; grpc.aio: an
    `aio.Metadata`) iterate as pairs. typeshed declares the sync form only, and its
    `_Metadatum` as a plain class with `value: bytes`, hence the cast.
    """
    pairs = cast(Iterable[tuple[str, str | bytes]], exc.trailing_metadata() or ())
    return [(str(k), v) for k, v in pairs]


def _is_text(key: str) -> bool:
    # A `-bin` value is arbitrary bytes, and decoding it as text could fail.
    return not key.endswith("-bin")


def _error_info(
    raw: str | bytes | None, code: grpc.StatusCode
) -> error_details_pb2.ErrorInfo | None:
    """Blazar's ErrorInfo in a `grpc-status-details-bin` value; None if there is none.

    A Status whose code is not the RPC's describes some other status (gRPC requires them
    to agree), and an ErrorInfo of another domain carries another service's reasons.
    """
    if not isinstance(raw, bytes):
        return None
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw)
    except protobuf_message.DecodeError:
        return None
    if status.code != code.value[0]:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == DOMAIN:
            return info
    return None


# How gRPC words its size refusals, e.g. "SERVER: Received message larger than max
# (5600017 vs. 4194304)"; a client-side refusal may be wrapped in "Stream removed (...)".
_TOO_LARGE = re.compile(
    r"(?P<side>SERVER|CLIENT): (?P<way>Received|Sent) message larger than max "
    r"\((?P<size>\d+) vs\. (?P<limit>\d+)\)"
)


def _too_large(details: str) -> errors.InvalidRequest | None:
    """The InvalidRequest a gRPC message-size refusal means; None for any other details."""
    found = _TOO_LARGE.search(details)
    if found is None:
        return None
    size, limit = int(found["size"]), int(found["limit"])
    # A server receiving, or a client sending, refuses the request; the other two the answer.
    if (found["side"] == "SERVER") == (found["way"] == "Received"):
        return request_too_large(size, limit=limit)
    return errors.InvalidRequest(
        f"The response is larger than the server accepts: {size} bytes, and the limit is "
        f"{byte_count(limit)}. Ask for less in one request (fewer inputs or tokens).",
        metadata={"response_bytes": str(size), "limit_bytes": str(limit)},
    )


def request_too_large(
    size: int | None,
    *,
    limit: int,
    what: str = "request",
    hint: str = "Send a shorter prompt or fewer inputs.",
) -> errors.RequestTooLarge:
    """The one wording of every refusal of a request by its size, wherever it is measured.

    `size` is None when only a lower bound is known (a body stopped once past `limit`);
    `hint` says what to send instead.
    """
    metadata = {"limit_bytes": str(limit)}
    if size is not None:
        metadata["request_bytes"] = str(size)
    return errors.RequestTooLarge(
        f"The {what} is larger than the server accepts: "
        f"{size if size is not None else f'more than {limit}'} bytes, and the limit is "
        f"{byte_count(limit)}. {hint}",
        metadata=metadata,
    )


def byte_count(n: int) -> str:
    """`4194304 bytes (4 MiB)`; the MiB only when it is whole."""
    mib = f" ({n >> 20} MiB)" if n and n % 2**20 == 0 else ""
    return f"{n} bytes{mib}"


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


# gRPC's deadline timer and `time_remaining()` read different clocks: a call cut off at
# its deadline has been seen to have some 6 ms "remaining".
DEADLINE_SLACK_S = 0.05


def cut_by_deadline(context: Any) -> bool:
    """Whether a server call being cancelled was cut off by its deadline (its caller
    sees DEADLINE_EXCEEDED), not left by its caller: the deadline it came with has
    passed, within DEADLINE_SLACK_S."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S
