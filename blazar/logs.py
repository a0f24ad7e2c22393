"""structlog configuration, done once per process.

Human-readable lines on a terminal, one JSON object per line otherwise. Context such
as `request_id`, `lane` and `reconcile_id` is bound with structlog's contextvars.
Every string in a record is clipped as an echoed value is (`clip`): a caller's
3 MB model name must not become a 3 MB log line.
A line that cannot be written (a full disk or a read-only home under an engine's log
file, a closed pipe under the daemon's) is dropped: logging never fails the work it
describes, and the next line is written once the stream takes it again.
`native_stderr_muted` silences what native code prints straight to file descriptor 2
(llama.cpp's grammar parser writes a caller's whole grammar there) without losing the
log lines other threads write meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import TextIO, cast

import structlog

from blazar.api import clip

LEVELS = ("debug", "info", "warning", "error", "critical")


def level_number(level: str | None = None) -> int:
    """`level`, else `$BLAZAR_LOG_LEVEL`, else info, as logging's number; ValueError
    for a name that is none of `LEVELS` (`warn` too, as logging reads it)."""
    name = (level or os.environ.get("BLAZAR_LOG_LEVEL", "").strip() or "info").upper()
    numeric = logging.getLevelNamesMapping().get(name)
    if numeric is None or name == "NOTSET":
        raise ValueError(f"{name.lower()!r} is not a log level; use one of {', '.join(LEVELS)}")
    return numeric


def configure(*, json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog and the stdlib root logger. `json=None` decides by isatty.
    A level that does not read is taken for info: `serve` refuses it first
    (`level_number`), and an engine inherits the daemon's."""
    if json is None:
        json = not sys.stderr.isatty()
    try:
        numeric = level_number(level)
    except ValueError:
        numeric = logging.INFO
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    # Lossy writes and flushes, all that structlog and logging use of a TextIO.
    stream = cast(TextIO, Lossy(sys.stderr))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            clip_values,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    # What libraries log through the standard library (uvicorn's "Invalid HTTP request
    # received.", asyncio, grpc's Python side) is rendered as Blazar's own lines are:
    # logging's default "WARNING:name:message" broke a JSON log's one object per line.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                clip_values,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    for earlier in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(earlier)  # configured again (a test): one line per record
    setattr(handler, _OURS, True)
    root.addHandler(handler)
    root.setLevel(max(numeric, logging.WARNING))


_OURS = "_blazar_logs"


def clip_values(
    _logger: object, _method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """Every string of a record, the event included, at most about `clip.FIELD_CHARS`
    characters (head and tail kept); a formatted traceback gets `clip.MESSAGE_CHARS`,
    where its last lines, the error, survive."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            limit = clip.MESSAGE_CHARS if key == "exception" else clip.FIELD_CHARS
            event_dict[key] = clip.clip(value, limit)
    return event_dict


class _Mute:
    """Who has file descriptor 2 pointed at /dev/null, and the lines other threads
    wrote meanwhile. `lock` is held only for a write or a switch of the descriptor,
    never while native code runs: that code may log through `Lossy` itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sections = threading.Lock()  # one muted section at a time
        self.owner: int | None = None
        self.held: list[tuple[TextIO, str]] = []


_mute = _Mute()


@contextlib.contextmanager
def native_stderr_muted() -> Iterator[None]:
    """File descriptor 2 points at /dev/null while the block runs, for native calls
    that print a caller's input there (llama.cpp's grammar parser prints the whole
    grammar it refuses). What this thread logs meanwhile is dropped with it; what
    other threads log through `Lossy` is held and written after. Native output of
    other threads in that window is lost, so keep the block to one short call."""
    with _mute.sections:
        with _mute.lock:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            try:
                saved = os.dup(2)
                devnull = os.open(os.devnull, os.O_WRONLY)
            except OSError:
                saved = devnull = -1
            if saved >= 0:
                os.dup2(devnull, 2)
                os.close(devnull)
                _mute.owner = threading.get_ident()
        try:
            yield
        finally:
            with _mute.lock:
                if saved >= 0:
                    with contextlib.suppress(OSError, ValueError):
                        sys.stderr.flush()  # this thread's own lines go to /dev/null
                    os.dup2(saved, 2)
                    os.close(saved)
                _mute.owner = None
                held, _mute.held = _mute.held, []
                for stream, text in held:
                    with contextlib.suppress(OSError, ValueError):
                        stream.write(text)
                        stream.flush()


class Lossy:
    """A text stream whose writes that fail (OSError) are dropped, not raised; while
    another thread has native stderr muted, its writes are held until the mute ends."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with _mute.lock:
            if _mute.owner is not None and _mute.owner != threading.get_ident():
                _mute.held.append((self._stream, text))
                return len(text)
            try:
                return self._stream.write(text)
            except OSError:
                return 0

    def flush(self) -> None:
        with _mute.lock, contextlib.suppress(OSError):
            self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()
