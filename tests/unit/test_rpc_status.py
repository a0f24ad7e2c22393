"""`blazar.rpc.status`: a gRPC status read back as the BlazarError it means."""

from __future__ import annotations

import grpc
import pytest

from blazar.api import errors
from blazar.rpc import limits, status


class FakeRpcError(grpc.RpcError):
    """What a grpc call raises: a code, details and trailing metadata."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
REQUEST_TOO_LARGE = (
    "The request is larger than the server accepts: 5600017 bytes, and the limit is "
    "4194304 bytes (4 MiB). Send a shorter prompt or fewer inputs."
)


@pytest.mark.parametrize(
    ("details", "cls", "message", "metadata"),
    [
        # gRPC's own size refusals: the request (server received, client sent) ...
        (
            "SERVER: Received message larger than max (5600017 vs. 4194304)",
            errors.RequestTooLarge,
            REQUEST_TOO_LARGE,
            {"request_bytes": "5600017", "limit_bytes": "4194304"},
        ),
        (
            "CLIENT: Sent message larger than max (5600017 vs. 4194304)",
            errors.RequestTooLarge,
            REQUEST_TOO_LARGE,
            {"request_bytes": "5600017", "limit_bytes": "4194304"},
        ),
        # ... or the answer (client received, server sent).
        (
            "Stream removed (CLIENT: Received message larger than max (5242885 vs. 4194304))",
            errors.InvalidRequest,
            "The response is larger than the server accepts: 5242885 bytes, and the limit is "
            "4194304 bytes (4 MiB). Ask for less in one request (fewer inputs or tokens).",
            {"response_bytes": "5242885", "limit_bytes": "4194304"},
        ),
        (
            "SERVER: Sent message larger than max (5000 vs. 1000)",
            errors.InvalidRequest,
            "The response is larger than the server accepts: 5000 bytes, and the limit is "
            "1000 bytes. Ask for less in one request (fewer inputs or tokens).",
            {"response_bytes": "5000", "limit_bytes": "1000"},
        ),
        # Any other bare RESOURCE_EXHAUSTED still means "retry later".
        ("Memory quota exceeded", errors.Overloaded, "Memory quota exceeded", {}),
    ],
)
def test_bare_resource_exhausted(
    details: str, cls: type[errors.BlazarError], message: str, metadata: dict[str, str]
) -> None:
    err = status.from_rpc_error(FakeRpcError(EXHAUSTED, details))
    assert type(err) is cls
    assert err.code == cls.code
    assert (err.message, err.metadata) == (message, metadata)


def test_blazar_overloaded_stays_overloaded_whatever_its_message() -> None:
    sent = errors.Overloaded(
        "Received message larger than max (1 vs. 0)", metadata={"retry_after_ms": "10"}
    )
    err = status.from_rpc_error(
        FakeRpcError(EXHAUSTED, sent.message, status.trailing_metadata(sent))
    )
    assert type(err) is errors.Overloaded
    assert err.metadata == {"retry_after_ms": "10"}


@pytest.mark.parametrize(
    ("size", "refused"),
    [(0, False), (limits.MAX_REQUEST_BYTES, False), (limits.MAX_REQUEST_BYTES + 1, True)],
)
def test_request_too_large(size: int, refused: bool) -> None:
    err = limits.request_too_large(size)
    assert (err is not None) == refused
    if err is not None:
        assert type(err) is errors.RequestTooLarge
        assert err.code == "INVALID_ARGUMENT"
        assert err.message == (
            f"The request is larger than the server accepts: {size} bytes, and the limit is "
            "4194304 bytes (4 MiB). Send a shorter prompt or fewer inputs."
        )
