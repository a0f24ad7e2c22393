"""The HTTP listener `blazar serve` binds: what its accepted connections inherit."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import uvloop

from blazar.api import errors
from blazar.cli import daemon


@pytest.mark.parametrize("loop_factory", [None, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_connections_the_shim_accepts_have_nagle_off(
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> None:
    """asyncio sets TCP_NODELAY only on sockets whose proto says TCP. The listener was
    made with proto 0, so Nagle's algorithm stayed on: a response's body waited for the
    client's delayed ACK of its head, 44-48 ms per request on a kept-alive connection
    (measured: 3 ms after)."""

    async def accepted_nodelay() -> int:
        sock = daemon._listen("127.0.0.1:0", what="HTTP")
        port = sock.getsockname()[1]
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("socket")
            seen.set_result(peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(seen, 5)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(accepted_nodelay()) != 0


@pytest.mark.parametrize(
    ("flag", "address"),
    [
        ("--http", "127.0.0.1:"),
        ("--http", "nohost"),
        ("--grpc", "127.0.0.1:x"),
        ("--grpc", "[::1]:99999"),
    ],
)
def test_serve_refuses_an_address_that_is_not_host_port_in_one_line(
    flag: str, address: str, tmp_path: Path
) -> None:
    """`serve --http 127.0.0.1:` ended in a ValueError traceback, and a port over 65535 in
    bind's OverflowError: each is a one-line error naming the flag."""
    addresses = {"--http": "127.0.0.1:0", "--grpc": "127.0.0.1:0", flag: address}
    options = daemon.Options(home=tmp_path, http=addresses["--http"], grpc=addresses["--grpc"])
    with pytest.raises(errors.InvalidRequest, match=f"^{flag} '.*' is not HOST:PORT"):
        daemon.check_addresses(options)


@pytest.mark.parametrize(
    ("what", "flag", "variable"),
    [("HTTP", "--http", "BLAZAR_HTTP_ADDR"), ("gRPC", "--grpc", "BLAZAR_GRPC_ADDR")],
)
def test_a_taken_address_says_how_to_choose_another(what: str, flag: str, variable: str) -> None:
    """`make up` with another program on 8420 stopped with "cannot listen on
    127.0.0.1:8420 (HTTP): address already in use" and nothing more: `make up` takes no
    flags, and the way to move it (BLAZAR_HTTP_ADDR) was only in docs/defaults.md."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = f"127.0.0.1:{other.getsockname()[1]}"
        with pytest.raises(errors.Unavailable) as caught:
            daemon._listen(taken, what=what).close()
    assert str(caught.value) == (
        f"cannot listen on {taken} ({what}): address already in use; "
        f"give another address with {flag} HOST:PORT or {variable}"
    )
