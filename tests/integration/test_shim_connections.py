"""Slow clients cannot hold the shim's connections (a slowloris): each request must be
read whole within `connections.READ_DEADLINE_S`, while normal requests are served."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from blazar.shim import connections
from tests.integration.harness import Daemon, short_home


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    home = short_home()
    d = Daemon(home=home).start()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def open_slow(address: str, first: bytes) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    if first:
        sock.sendall(first)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed it (a read sees EOF or a reset) without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_slow_headers_and_bodies_are_closed_while_others_are_served(daemon: Daemon) -> None:
    started = time.monotonic()
    slow = [open_slow(daemon.http, b"") for _ in range(7)]  # says nothing at all
    slow += [open_slow(daemon.http, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
             for _ in range(7)]  # headers never end  # fmt: skip
    slow += [
        open_slow(
            daemon.http,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
        )
        for _ in range(7)
    ]  # the body never ends
    try:
        # A byte now and then does not extend the deadline.
        for _ in range(3):
            time.sleep(1.0)
            for sock in slow[7:14]:
                sock.sendall(b"X")
        # Served meanwhile, on a fresh connection.
        assert httpx.get(f"http://{daemon.http}/healthz", timeout=10).status_code == 200
        deadline = started + connections.READ_DEADLINE_S + 4
        while time.monotonic() < deadline and not all(closed_by_peer(s) for s in slow):
            time.sleep(0.2)
        assert all(closed_by_peer(s) for s in slow)
        assert time.monotonic() - started < 10 + 4
        # A keep-alive connection's second request is read under a fresh deadline.
        with httpx.Client(base_url=f"http://{daemon.http}", timeout=10) as client:
            assert client.get("/healthz").status_code == 200
            time.sleep(1.0)
            assert client.get("/healthz").status_code == 200
    finally:
        for sock in slow:
            sock.close()
