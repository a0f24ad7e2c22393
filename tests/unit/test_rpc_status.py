"""`blazar.rpc.status`: a BlazarError carried as a gRPC status, and read back as the
BlazarError it means."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from blazar.api import errors
from blazar.rpc import limits, status


class FakeRpcError(grpc.RpcError):
    """What a grpc call raises: a code, details and trailing metadata."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailers: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailers


# The standard trailer of gRPC's rich error model, spelled out rather than taken from the
# module under test.
DETAILS_KEY = "grpc-status-details-bin"


def sent(err: errors.BlazarError) -> FakeRpcError:
    """What a client receives for err: its code, message and trailers."""
    return FakeRpcError(status.grpc_code(err), err.message, status.trailing_metadata(err))


def plain_trailers(err: errors.BlazarError) -> tuple[tuple[str, str | bytes], ...]:
    """err's `blazar-*` trailers alone."""
    return tuple((k, v) for k, v in status.trailing_metadata(err) if k != DETAILS_KEY)


def decode_details(trailers: Any) -> tuple[status_pb2.Status, list[error_details_pb2.ErrorInfo]]:
    """The Status in `grpc-status-details-bin` and its ErrorInfos, read with the standard
    types alone, as a client in another language reads them."""
    raw = dict(trailers)[DETAILS_KEY]
    rpc_status = status_pb2.Status.FromString(raw)
    infos = []
    for detail in rpc_status.details:
        info = error_details_pb2.ErrorInfo()
        assert detail.Unpack(info), detail.type_url
        infos.append(info)
    return rpc_status, infos


def case(err: errors.BlazarError, id: str = "") -> Any:
    return pytest.param(err, id=id or type(err).__name__)


SENT_ERRORS = [
    case(errors.ContextLengthExceeded.of(prompt_tokens=2100, max_tokens=16, context_length=2048)),
    case(errors.Overloaded("Try again soon.", metadata={"retry_after_ms": "2500"})),
    case(errors.ModelNotFound.of("nope")),
    # The caller's own text, which gRPC takes in no text trailer; the ErrorInfo has it.
    case(errors.ModelNotFound.of("gémma\n"), "ModelNotFound-not-ascii"),
    case(errors.InvalidRequest("Bad schema.", metadata={errors.FIELD_KEY: "constraint"})),
    case(limits.request_too_large(5600017)),
    case(errors.Unavailable("No replica is ready.", metadata={"lane": "gemma3"})),
    case(errors.BlazarError("Something broke.", metadata={"replica": "0"})),
]


@pytest.mark.parametrize("err", SENT_ERRORS)
def test_status_details_carry_error_info(err: errors.BlazarError) -> None:
    rpc_status, infos = decode_details(status.trailing_metadata(err))
    assert rpc_status.code == status.grpc_code(err).value[0]
    assert rpc_status.message == err.message
    assert [(i.reason, i.domain, dict(i.metadata)) for i in infos] == [
        (err.reason, "blazar.dev", err.metadata)
    ]


def test_context_length_error_info_has_the_numbers() -> None:
    err = errors.ContextLengthExceeded.of(prompt_tokens=2100, max_tokens=16, context_length=2048)
    rpc_status, [info] = decode_details(status.trailing_metadata(err))
    assert rpc_status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert info.reason == "CONTEXT_LENGTH_EXCEEDED"
    assert dict(info.metadata) == {
        "prompt_tokens": "2100",
        "max_tokens": "16",
        "context_length": "2048",
    }
    # The plain trailers stay, for clients that read them.
    trailers = dict(status.trailing_metadata(err))
    assert trailers["blazar-reason"] == "CONTEXT_LENGTH_EXCEEDED"
    assert trailers["blazar-context_length"] == "2048"


@pytest.mark.parametrize("err", SENT_ERRORS)
def test_round_trip(err: errors.BlazarError) -> None:
    full = sent(err)
    # A peer that sends only the standard details (any gRPC server with rich errors).
    details_only = FakeRpcError(
        full.code(),
        full.details(),
        tuple((k, v) for k, v in full.trailing_metadata() if k == DETAILS_KEY),
    )
    for received in (full, details_only):
        back = status.from_rpc_error(received)
        assert type(back) is type(err)
        assert (back.code, back.reason) == (err.code, err.reason)
        assert (back.message, back.metadata) == (err.message, err.metadata)


def wire_bytes(trailers: Any) -> int:
    """The trailers' size as gRPC counts it against its limits, -bin values in base64."""
    return sum(
        len(k) + (len(base64.b64encode(v)) if isinstance(v, bytes) else len(v.encode()))
        for k, v in trailers
    )


@pytest.mark.parametrize("length", [100, 1_500, 2_500, 4_000, 7_000])
def test_trailers_stay_under_grpcs_soft_limit(length: int) -> None:
    """gRPC's client starts dropping trailers past 8 KiB. The status message alone fits
    up to that (a manifest with many errors is this long); the details, which repeat the
    message, must not push it over."""
    err = errors.InvalidRequest("y" * length, metadata={errors.FIELD_KEY: "messages"})
    trailers = status.trailing_metadata(err)
    assert len(err.message) + wire_bytes(trailers) < 8 * 1024 - 500
    if length <= 1_500:  # any ordinary error has its ErrorInfo
        decode_details(trailers)
    back = status.from_rpc_error(FakeRpcError(INVALID, err.message, trailers))
    assert (back.code, back.reason, back.message) == (err.code, err.reason, err.message)


def test_error_info_is_preferred_over_blazar_trailers() -> None:
    info_says = errors.ContextLengthExceeded.of(prompt_tokens=9, max_tokens=1, context_length=8)
    trailers_say = errors.InvalidRequest(info_says.message, metadata={"x": "1"})
    details = dict(status.trailing_metadata(info_says))[DETAILS_KEY]
    trailers = (*plain_trailers(trailers_say), (DETAILS_KEY, details))
    back = status.from_rpc_error(
        FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, info_says.message, trailers)
    )
    assert type(back) is errors.ContextLengthExceeded
    assert back.metadata == info_says.metadata


def details_of(code: grpc.StatusCode, *infos: error_details_pb2.ErrorInfo) -> bytes:
    rpc_status = status_pb2.Status(code=code.value[0], message="m")
    for info in infos:
        rpc_status.details.add().Pack(info)
    return rpc_status.SerializeToString()


INVALID = grpc.StatusCode.INVALID_ARGUMENT
ELSEWHERE = error_details_pb2.ErrorInfo(reason="API_KEY_INVALID", domain="googleapis.com")


@pytest.mark.parametrize(
    "details",
    [
        pytest.param(b"\xff\xfe not a Status", id="not-a-status"),
        pytest.param(details_of(INVALID), id="no-error-info"),
        pytest.param(details_of(INVALID, ELSEWHERE), id="another-domain"),
        pytest.param(
            details_of(grpc.StatusCode.NOT_FOUND, error_details_pb2.ErrorInfo(
                reason="MODEL_NOT_FOUND", domain="blazar.dev"
            )),
            id="another-code",
        ),
    ],
)  # fmt: skip
def test_unusable_details_fall_back_to_blazar_trailers(details: bytes) -> None:
    err = errors.ContextLengthExceeded.of(prompt_tokens=9, max_tokens=1, context_length=8)
    trailers = (*plain_trailers(err), (DETAILS_KEY, details))
    back = status.from_rpc_error(FakeRpcError(INVALID, err.message, trailers))
    assert type(back) is errors.ContextLengthExceeded
    assert back.metadata == err.metadata


@contextlib.asynccontextmanager
async def aborting_server(err: errors.BlazarError) -> AsyncIterator[grpc.aio.Channel]:
    """A real gRPC server whose every unary call ends in `status.abort(err)`."""

    async def handle(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        await status.abort(context, err)

    handler = grpc.method_handlers_generic_handler(
        "test.Fails", {"Call": grpc.unary_unary_rpc_method_handler(handle)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(0)


@pytest.mark.parametrize("err", SENT_ERRORS)
def test_abort_sends_error_info_over_real_grpc(err: errors.BlazarError) -> None:
    async def call() -> grpc.aio.AioRpcError:
        async with aborting_server(err) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/test.Fails/Call")(b"")
            return info.value

    exc = asyncio.run(call())
    assert exc.code() == status.grpc_code(err)
    assert exc.details() == err.message
    rpc_status, [error_info] = decode_details(exc.trailing_metadata())
    assert (rpc_status.code, rpc_status.message) == (exc.code().value[0], exc.details())
    assert (error_info.reason, error_info.domain) == (err.reason, "blazar.dev")
    assert dict(error_info.metadata) == err.metadata
    assert dict(exc.trailing_metadata())["blazar-reason"] == err.reason
    back = status.from_rpc_error(exc)
    assert (type(back), back.message, back.metadata) == (type(err), err.message, err.metadata)


@pytest.mark.parametrize("filler", ["x", "\u00e9", "\U0001f642", "%"])
def test_a_message_quoting_a_huge_value_arrives_shortened_with_its_code(filler: str) -> None:
    """Found by fuzzing: an InvalidRequest quoting a 100 kB tool name was lost in gRPC's
    trailer limit as RESOURCE_EXHAUSTED, which HTTP clients got as a 429 to retry."""
    message = f"Invalid tool name '{filler * 100_000}': use letters and digits."
    err = errors.InvalidRequest(message, metadata={errors.FIELD_KEY: "tools[0].name"})

    async def call() -> grpc.aio.AioRpcError:
        async with aborting_server(err) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/test.Fails/Call")(b"")
            return info.value

    exc = asyncio.run(call())
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    sent = exc.details() or ""
    assert sent.startswith("Invalid tool name '" + filler * 10)
    assert sent.endswith(filler * 10 + "': use letters and digits.")
    assert "characters left out" in sent
    assert status._wire_length(sent) <= status.MESSAGE_LIMIT
    back = status.from_rpc_error(exc)
    assert type(back) is errors.InvalidRequest and back.message == sent


def test_a_message_within_the_limit_is_sent_whole() -> None:
    message = "y" * status.MESSAGE_LIMIT
    assert status.wire_message(message) == message
    assert status.wire_message(message + "y") != message + "y"


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
    err = status.from_rpc_error(
        sent(
            errors.Overloaded(
                "Received message larger than max (1 vs. 0)", metadata={"retry_after_ms": "10"}
            )
        )
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


class Remaining:
    """A servicer context as `cut_by_deadline` reads it: its time_remaining()."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize(
    ("remaining", "cut"),
    [
        (None, False),  # no deadline: a cancel is its caller leaving
        (30.0, False),
        (0.5, False),
        # gRPC's timer fires when its other clock says a few ms are left.
        (0.006, True),
        (0.0, True),
    ],
)
def test_a_cancel_at_the_deadline_is_told_from_a_caller_leaving(
    remaining: float | None, cut: bool
) -> None:
    assert status.cut_by_deadline(Remaining(remaining)) is cut
