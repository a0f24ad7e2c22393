"""How the CLI shows an error the daemon sent: `Error from server (Reason): message`,
with the reason the server gave, whatever the CLI knows of it."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import grpc
import pytest

from blazar.api import errors
from blazar.cli import client, main
from tests.rpc_errors import FakeRpcError

BAD = errors.ManifestInvalid(
    [
        errors.FieldError("Lane/broken: spec.replicas", "Input should be a valid integer"),
        errors.FieldError("Lane/broken: spec.colour", "Extra inputs are not permitted"),
    ]
)

STALE = errors.Conflict.stale(kind="Lane", name="x", expected=12, current=14)


class FromTheFuture(errors.BlazarError):
    """A reason this CLI has no class for (a newer daemon's)."""

    code = "FAILED_PRECONDITION"
    reason = "LANE_FROZEN"


@pytest.mark.parametrize(
    ("sent", "cls"),
    [
        (BAD, errors.ManifestInvalid),
        (errors.ModelNotFound.of("nope"), errors.ModelNotFound),
        (FromTheFuture("Lane x is frozen.", metadata={"lane": "x"}), errors.BlazarError),
        (
            errors.QueueFull.of(lane="x", policy="p", max_queue_depth=2, retry_after_s=1.0),
            errors.QueueFull,
        ),
        (
            errors.QueueTimeout.of(
                lane="x", policy="p", waited_s=2.0, max_queue_wait_s=2.0, retry_after_s=1.0
            ),
            errors.QueueTimeout,
        ),
        (
            errors.SloUnattainable.of(
                lane="x", policy="p", predicted_ttft_s=3.0, ttft_target_s=2.0, retry_after_s=1.0
            ),
            errors.SloUnattainable,
        ),
        (STALE, errors.Conflict),
    ],
)
def test_from_reason_rebuilds_class_reason_message_and_metadata(
    sent: errors.BlazarError, cls: type[errors.BlazarError]
) -> None:
    got = errors.from_reason(sent.reason, sent.message, sent.metadata, code=sent.code)
    assert type(got) is cls
    assert (got.reason, got.message, got.metadata) == (sent.reason, sent.message, sent.metadata)
    assert got.code == sent.code


def test_a_received_manifest_error_has_no_field_errors_but_its_message() -> None:
    got = errors.from_reason(BAD.reason, BAD.message, {})
    assert isinstance(got, errors.ManifestInvalid)
    assert got.errors == ()
    assert "spec.colour: Extra inputs are not permitted" in got.message


@pytest.mark.parametrize(
    ("sent", "printed"),
    [
        (
            BAD,
            "Error from server (InvalidManifest): 2 error(s) in manifest:\n"
            "Lane/broken: spec.replicas: Input should be a valid integer\n"
            "Lane/broken: spec.colour: Extra inputs are not permitted\n",
        ),
        (
            errors.ObjectNotFound('Lane "x" not found.'),
            'Error from server (NotFound): Lane "x" not found.\n',
        ),
        (FromTheFuture("Lane x is frozen."), "Error from server (LaneFrozen): Lane x is frozen.\n"),
        # As kubectl shows a stale apply.
        (
            STALE,
            "Error from server (Conflict): Lane/x has been modified since resourceVersion 12 "
            "(now 14); get it again, apply your change to it, and apply that.\n",
        ),
        # No key over TCP: how this command line sends one.
        (
            errors.Unauthenticated("No API key.", metadata={"credential": "missing"}),
            "Error from server (Unauthenticated): No API key.\n"
            "(send one with --api-key KEY, or set BLAZAR_API_KEY)\n",
        ),
        # Unavailable the daemon itself sent (its store cannot be written): it was
        # reached, so it is not told as "cannot reach the daemon".
        (
            errors.Unavailable("cannot write the store /h/state.db: disk I/O error"),
            "Error from server (Unavailable): cannot write the store /h/state.db: disk I/O error\n",
        ),
        # A key no tenant holds: nothing to add.
        (
            errors.Unauthenticated("Unknown API key.", metadata={"credential": "unknown"}),
            "Error from server (Unauthenticated): Unknown API key.\n",
        ),
    ],
)
def test_cli_prints_the_reason_the_server_sent(
    sent: errors.BlazarError, printed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def fails(args: argparse.Namespace) -> int:
        raise FakeRpcError(sent)

    assert main._run(argparse.Namespace(func=fails, server=None)) == 1
    assert capsys.readouterr().err == printed


class NoDaemon(grpc.RpcError):
    """What gRPC raises when nothing answers at the address: no trailers of a daemon."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses"

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return ()


def test_cli_says_it_cannot_reach_a_daemon_that_did_not_answer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def fails(args: argparse.Namespace) -> int:
        raise NoDaemon()

    sock = tmp_path / "control.sock"
    sock.touch()  # left by a daemon that died
    args = argparse.Namespace(func=fails, server=f"unix:{sock}", tls_ca=None)
    assert main._run(args) == 1
    assert capsys.readouterr().err == (
        f"error: cannot reach the Blazar daemon at unix:{sock}: "
        "failed to connect to all addresses\n"
    )


def test_cli_says_no_daemon_serves_a_home_without_a_control_socket(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first CLI call of a new user whose daemon runs with another BLAZAR_HOME (or
    none runs) printed gRPC's "connect failed: addr: unix:... error: No such file or
    directory" and nothing about homes."""
    monkeypatch.setenv("BLAZAR_HOME", str(tmp_path / "home"))
    assert main.main(["get", "lanes"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: cannot reach the Blazar daemon at unix:{tmp_path}/home/control.sock: "
        f"no daemon serves the home {tmp_path}/home (it has no control.sock)."
    ), err
    assert "BLAZAR_HOME" in err and "--server" in err and "blazar serve" in err


def test_request_timeout_gives_up_on_a_daemon_that_never_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A listener that takes the connection and never speaks (a stopped daemon): with
    --request-timeout the command ends in time, saying so; kubectl's default (0) waits."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        started = time.monotonic()
        status = main.main(
            ["--server", f"127.0.0.1:{port}", "--request-timeout", "500ms", "get", "lanes"]
        )
        took = time.monotonic() - started
    assert status == 1
    assert capsys.readouterr().err == (
        f"error: the Blazar daemon at 127.0.0.1:{port} did not answer within 0.5s "
        "(--request-timeout)\n"
    )
    assert took < 5.0, took


@pytest.mark.parametrize(
    ("given", "seconds"),
    # A bare number is seconds, as client-go's ParseTimeout reads it.
    [(None, None), ("0", None), ("5s", 5.0), ("2m", 120.0), ("5", 5.0), (" 30 ", 30.0)],
)
def test_request_timeout_reads_kubectls_durations(given: str | None, seconds: float | None) -> None:
    assert client.request_timeout(argparse.Namespace(request_timeout=given)) == seconds


@pytest.mark.parametrize("given", ["-5", "-1s", "soon", "1.5", "٣"])
def test_request_timeout_refuses_what_is_not_a_duration(given: str) -> None:
    with pytest.raises(errors.InvalidRequest, match="--request-timeout"):
        client.request_timeout(argparse.Namespace(request_timeout=given))


@pytest.mark.parametrize(
    "server", ["127.0.0.1:", "127.0.0.1", "localhost:0", ":8421", "[::1]:99999", "h:٣"]
)
def test_a_server_that_is_not_an_address_is_refused_before_any_call(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """gRPC would dial port 443 for "HOST:" or "HOST" and say only that it cannot
    connect; the flag is refused, named, before any call is made."""
    assert main.main(["--server", server, "--request-timeout", "1s", "get", "lanes"]) == 1
    err = capsys.readouterr().err
    assert f"--server: '{server}' is not HOST:PORT" in err, err


@pytest.mark.parametrize(
    "server", ["127.0.0.1:8421", "[::1]:8421", "unix:/h/control.sock", "dns:///h:8421"]
)
def test_a_server_address_is_taken_as_given(server: str) -> None:
    assert client.target(argparse.Namespace(server=server)) == server


@pytest.mark.parametrize(
    "argv",
    [
        ["--server", "127.0.0.1:1", "serve"],
        ["--api-key", "k", "auth", "key"],
        ["--request-timeout", "5s", "export", "kubernetes", "-f", "examples/fleet"],
    ],
)
def test_daemon_flags_on_a_command_that_calls_no_daemon_are_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Taken and ignored, they would mislead (`--server` on `serve` is not its address)."""
    assert main.main(argv) == 2
    assert "for commands that call a running daemon" in capsys.readouterr().err


def test_cli_gives_no_tls_hint_when_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    """The hint is for a plain client meeting a TLS daemon; nothing at the port is not that."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    assert main.main(["--server", f"127.0.0.1:{port}", "get", "lanes"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the Blazar daemon at 127.0.0.1:{port}: ")
    assert "Connection refused" in err and "--tls-ca" not in err
