"""What the daemon's and the workers' log lines may hold."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator

import pytest
import structlog

from blazar import logs
from blazar.api import clip


@pytest.fixture
def configured() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        structlog.reset_defaults()
        root.handlers[:], root.level = handlers, level


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "console"])
def test_a_huge_value_is_logged_clipped_with_its_head_and_tail(
    configured: None, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    logs.configure(json=as_json, level="INFO")
    huge = "H" + "m" * 3_000_000 + "T"
    log = structlog.get_logger("test")
    log.warning("e" * 3_000_000, model=huge, lane="small", n=7)
    try:
        raise ValueError("x" * 3_000_000)
    except ValueError:
        log.exception("failed", model=huge)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2, lines
    bound = 2 * clip.MESSAGE_CHARS + 2 * clip.FIELD_CHARS + 1_000
    assert all(len(line) < bound for line in lines), [len(line) for line in lines]
    text = "\n".join(lines)
    assert "Hmmm" in text and "mmmT" in text
    assert "characters left out" in text and "small" in text
    if as_json:
        first, second = (json.loads(line) for line in lines[:2])
        assert first["n"] == 7 and first["lane"] == "small"
        assert len(first["event"]) < clip.FIELD_CHARS + 100
        assert len(first["model"]) < clip.FIELD_CHARS + 100
        assert second["exception"].startswith("Traceback") and len(second["exception"]) < (
            clip.MESSAGE_CHARS + 100
        )
        assert "ValueError: xxx" in second["exception"]


class _Disk:
    """A stderr on a disk that can be full."""

    def __init__(self) -> None:
        self.full = False
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")

    def isatty(self) -> bool:
        return False


def test_a_line_the_disk_cannot_take_is_dropped_and_the_next_is_written_once_it_can(
    configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An engine's log is a file under the home: a full disk must not fail the request
    # whose summary line it is (it did, with "Unexpected OSError").
    disk = _Disk()
    monkeypatch.setattr(sys, "stderr", disk)
    logs.configure(json=True, level="INFO")
    log = structlog.get_logger("test")
    disk.full = True
    log.info("generate", tokens=8)
    logging.getLogger("stdlib").warning("also dropped")
    disk.full = False
    log.info("generate", tokens=9)
    assert [json.loads(line)["tokens"] for line in "".join(disk.lines).splitlines()] == [9]


def test_native_stderr_is_muted_and_other_threads_lines_are_written_after(
    configured: None, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama.cpp's grammar parser prints a grammar it refuses, whole, to fd 2: the
    # engine's log. The caller's text must not reach it; the engine's own lines must.
    monkeypatch.setattr(sys, "stderr", open(2, "w", buffering=1, closefd=False))  # noqa: SIM115
    logs.configure(json=True, level="INFO")
    log = structlog.get_logger("test")
    muted, logged = threading.Event(), threading.Event()

    def other_thread() -> None:
        assert muted.wait(5)
        log.info("decode_step", n=1)
        logged.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with logs.native_stderr_muted():
        os.write(2, b'parse: error parsing grammar\n\nroot ::= "secret-1"\n')
        log.warning("llama_cpp", message="secret-2")  # native code's own callback line
        muted.set()
        assert logged.wait(5), "a line logged by another thread waited for the mute to end"
        os.write(2, b"secret-3\n")
    thread.join()
    log.info("after", n=2)
    err = capfd.readouterr().err
    assert "secret" not in err, err
    assert [json.loads(line)["event"] for line in err.splitlines()] == ["decode_step", "after"]


def test_a_json_log_is_one_object_per_line_also_for_libraries_newlines_and_non_ascii(
    configured: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # uvicorn's "Invalid HTTP request received." came out as "WARNING:  Invalid HTTP
    # request received.", asyncio's and grpc's as "WARNING:name:message": no JSON.
    logs.configure(json=True, level="INFO")
    structlog.get_logger("test").warning("two\nlines", value="naïve ☃\r\n\u2028")
    logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    try:
        raise RuntimeError("bad\nthing")
    except RuntimeError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
    logging.getLogger("grpc").info("below the standard library's warning floor")
    lines = capsys.readouterr().err.splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["event"], r["level"]) for r in records] == [
        ("two\nlines", "warning"),
        ("Invalid HTTP request received.", "warning"),
        ("Task exception was never retrieved", "error"),
    ]
    assert records[0]["value"] == "naïve ☃\r\n\u2028"
    assert records[1]["logger"] == "uvicorn.error" and "timestamp" in records[1]
    assert "RuntimeError: bad\nthing" in records[2]["exception"]


@pytest.mark.parametrize(
    ("env", "level"),
    [
        (None, logging.INFO),
        ("", logging.INFO),
        (" debug ", logging.DEBUG),
        ("WARN", logging.WARNING),
    ],
)
def test_the_log_level_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: str | None, level: int
) -> None:
    if env is None:
        monkeypatch.delenv("BLAZAR_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("BLAZAR_LOG_LEVEL", env)
    assert logs.level_number() == level
