"""The shim's HTTP connections: httptools parses them, and a request must arrive in time.

uvicorn's protocols wait for a request's headers and body as long as the client likes:
21 of 21 connections that sent their headers or body a byte at a time stayed open
indefinitely, each holding a socket and its buffers (a slowloris). Here a request must
be read whole, headers and body, within `READ_DEADLINE_S` of its first byte (of the
connection's opening, for a connection's first request); a connection that misses it
is closed. A request that arrives pipelined behind one still being answered waits, as
it is not read meanwhile: its time starts when that answer ends. Between requests,
uvicorn's keep-alive timeout closes an idle connection. What follows the read (the
answer, a stream of any length) is not bounded in time here.

An answer must be taken, though: a client that stops reading (a full TCP window, the
connection kept open) held its connection, and what the answer had buffered, for as
long as it liked, whatever the keep-alive timeout (an unread 2 MiB embeddings answer
stayed in the daemon's memory with its socket; a thousand of them would have taken
every connection `LIMIT_CONCURRENCY` allows). So while an answer waits for the client
(the transport's buffer past its high-water mark), the client must take at least
`MIN_DRAIN_BYTES` of it (or all that waits, if less) in every `WRITE_STALL_S`, else
the connection is aborted; the app then sees the client gone, as on any disconnect.

A request's target and header lines together are at most `MAX_HEAD_BYTES`, else the
answer is 400 and the connection closes, as with uvicorn's h11 protocol: httptools
itself sets no bound, and gathers a header line in memory however long it grows. A
head still arriving is refused once its bytes pass that plus `_HEAD_SLACK` (room for
the request line and separators), so that it never holds more. The refusal is JSON in
the envelope of the dialect the request's path speaks (`dialects`), as far as the
path has arrived: Ollama's `{"error": ...}` under `/api/`, Anthropic's under
`/v1/messages`, OpenAI's elsewhere. So is the 400 for a request httptools cannot parse
at all (a control character in a header, which llhttp refuses), where uvicorn would
answer in plain text.

httptools (llhttp, in C) rather than h11, uvicorn's pure-Python default: it parses a
request and frames an answer for less of the daemon's CPU, which on a small host the
engines' decode threads would otherwise have had.

`LIMIT_CONCURRENCY` bounds open connections (and requests): past it uvicorn answers
503 at once instead of taking more file descriptors.
"""

from __future__ import annotations

import asyncio
import http
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from blazar.api import errors
from blazar.shim import context, dialects

# Loopback and a LAN deliver a 4 MiB body (the largest accepted) in well under this.
READ_DEADLINE_S = 8.0
LIMIT_CONCURRENCY = 1024
# uvicorn's bound on an h11 request's head (h11_max_incomplete_event_size's default).
MAX_HEAD_BYTES = 16 * 1024
_HEAD_SLACK = 1024
# A client must take this much of an answer waiting for it in each window: ~2 KiB/s.
WRITE_STALL_S = 30.0
MIN_DRAIN_BYTES = 64 * 1024
HEAD_TOO_LARGE = f"The request's target and headers are over {MAX_HEAD_BYTES} bytes."
# httptools says no more than that it could not parse: the message names what may be
# wrong (a bad Content-Length, chunk size or version fails the same way).
NOT_HTTP = (
    "The request is not valid HTTP/1.1 and could not be read: its request line, a header "
    "(a control character in a value, say) or its body's framing breaks the protocol."
)


class HeadTooLarge(Exception):
    """Raised in httptools' callback to stop its parser; uvicorn then answers 400."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on reading each request, and a
    bound on each request's head."""

    _deadline: asyncio.TimerHandle | None = None
    # Bytes of the head being read; None while no head is (headers complete, or idle).
    _head: int | None = None
    # A request has begun and is not yet read whole.
    _reading = False
    # A request was read whole during the chunk being parsed.
    _ended_in_chunk = False
    _head_too_large = False
    # While writing is paused: the check of the client's progress, and the bytes
    # waiting when the window began.
    _stall: asyncio.TimerHandle | None = None
    _waiting = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unwatch()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._watch()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unwatch()

    def _watch(self) -> None:
        self._waiting = self.transport.get_write_buffer_size()
        self._stall = self.loop.call_later(WRITE_STALL_S, self._check_progress)

    def _unwatch(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _check_progress(self) -> None:
        self._stall = None
        waiting = self.transport.get_write_buffer_size()
        if not stalled(before=self._waiting, after=waiting):
            if waiting:
                self._watch()
            return
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self._ended_in_chunk = False
        super().data_received(data)
        # A head still open after the chunk holds all of it, save what precedes the
        # head's first byte: nothing but blank lines, unless a request ended in this
        # chunk (pipelined), whose bytes are then not counted; the next chunk's are.
        if self._head is None or self._ended_in_chunk or self.transport.is_closing():
            return
        self._head += len(data)
        if self._head > MAX_HEAD_BYTES + _HEAD_SLACK:
            self._head = None
            self._head_too_large = True
            self.send_400_response(HEAD_TOO_LARGE)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request httptools cannot parse (or one whose head is
        too large), in the JSON envelope of the dialect its path speaks rather than
        uvicorn's plain text."""
        why = HEAD_TOO_LARGE if self._head_too_large else NOT_HTTP
        # uvicorn clears `url` as each request begins: never an earlier request's path.
        path = getattr(self, "url", b"").split(b"?", 1)[0].decode("latin-1")
        refusal = dialects.refusal(
            path, errors.InvalidRequest(why), request_id=context.new_request_id()
        )
        body = json.dumps(refusal.body).encode()
        content = [
            b"HTTP/1.1 %d %s\r\n"
            % (refusal.status, http.HTTPStatus(refusal.status).phrase.encode())
        ]
        for name, value in self.server_state.default_headers:
            content += [name, b": ", value, b"\r\n"]
        for key, text in refusal.headers.items():
            content += [key.encode("latin-1"), b": ", text.encode("latin-1"), b"\r\n"]
        content += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
            b"\r\n",
            body,
        ]
        self.transport.write(b"".join(content))
        self.transport.close()

    # httptools' parser callbacks.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = 0
        self._reading = True
        if self.cycle is None or self.cycle.response_complete:
            self._arm()

    def on_headers_complete(self) -> None:
        self._head = None
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise HeadTooLarge
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = False
        self._ended_in_chunk = True
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._reading and not self.transport.is_closing():
            self._arm()  # a pipelined request, read from now on

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


def stalled(*, before: int, after: int) -> bool:
    """Whether a client that had `before` bytes of an answer waiting for it, and
    `after` one `WRITE_STALL_S` later, took too little of it."""
    return after > 0 and before - after < min(MIN_DRAIN_BYTES, before)
