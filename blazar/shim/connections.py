"""The shim's HTTP connections: a request must arrive in time.

uvicorn's h11 protocol waits for a request's headers and body as long as the client
likes: 21 of 21 connections that sent their headers or body a byte at a time stayed
open indefinitely, each holding a socket and its buffers (a slowloris). Here a request
must be read whole, headers and body, within `READ_DEADLINE_S` of its first byte (of
the connection's opening, for a connection's first request); a connection that misses
it is closed. Between requests, uvicorn's keep-alive timeout closes an idle connection.
What follows the read (the answer, a stream of any length) is not bounded here.

`LIMIT_CONCURRENCY` bounds open connections (and requests): past it uvicorn answers
503 at once instead of taking more file descriptors.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# Loopback and a LAN deliver a 4 MiB body (the largest accepted) in well under this.
READ_DEADLINE_S = 8.0
LIMIT_CONCURRENCY = 1024


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Armed while part of a request is in and the rest is not: its headers begun
        (data buffered while idle), or its body still coming."""
        state = self.conn.their_state
        pending, _closed = self.conn.trailing_data
        reading = state is h11.SEND_BODY or (state is h11.IDLE and bool(pending))
        if reading:
            self._arm()
        elif state is not h11.IDLE:
            self._disarm()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(READ_DEADLINE_S, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()
