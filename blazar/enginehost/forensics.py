"""Why an engine worker exited, read from its exit status and the end of its log.

Pure: the supervisor reads the log's tail and passes it in.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
from typing import Any

# How much of a worker's log is read to explain its exit, and how much is kept.
LOG_TAIL_BYTES = 16_384
_REASON_CHARS = 300
# "ValueError: ...", "llama_cpp.LlamaError: ...": the last line of a traceback.
_TRACEBACK_LAST = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")
# Python's fault handler (the worker enables it) on a fatal signal: this line, then each
# thread's Python stack, innermost call first, the crashing thread's as "Current thread".
_FATAL = "Fatal Python error:"
_FRAME = re.compile(r'^File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


def exit_reason(log_tail: str, code: int | None) -> str:
    """Why a worker exited, for its Failed status and the crash event.

    A SIGKILL or SIGTERM is named alone: the worker cannot log it (the OOM killer's
    SIGKILL, say), and an error it logged earlier did not end it. Otherwise the latest
    explanation in the log wins: an error record (`"level": "error"` or worse in the
    worker's JSON log, with its message), a Python traceback's last line or a ggml
    assertion; a fatal signal's dump by Python's fault handler, with the Python call it
    came in; then the last line. Another signal (llama.cpp aborts on a failed
    GGML_ASSERT) is named before that explanation.
    """
    signal_name = ""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            signal_name = signal.Signals(-code).name
    if signal_name in ("SIGKILL", "SIGTERM"):
        return f"killed by {signal_name}"
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    reason = next(
        (
            found + (_crashed_in(lines[at + 1 :]) if found.startswith(_FATAL) else "")
            for at in reversed(range(len(lines)))
            if (found := _explanation(lines[at]))
        ),
        lines[-1] if lines else "",
    )
    if signal_name:
        reason = f"killed by {signal_name}" + (f": {reason}" if reason else "")
    return reason[:_REASON_CHARS]


def _explanation(line: str) -> str:
    """What a log line says went wrong, if it says so; else ""."""
    record = _json_record(line)
    if record is not None:
        if record.get("level") not in ("error", "critical"):
            return ""
        event = str(record.get("event", "error"))
        detail = str(record.get("error") or record.get("exception") or "").strip()
        return f"{event}: {detail.splitlines()[-1]}" if detail else event
    explains = _TRACEBACK_LAST.match(line) or "GGML_ASSERT" in line or line.startswith(_FATAL)
    return line if explains else ""


def _crashed_in(dump: list[str]) -> str:
    """Where the crashing thread was, from the fault handler's dump after its first line:
    " in FUNCTION (DIR/FILE:LINE)" of its innermost Python call; "" if the dump has none
    (the crash came in a thread that runs no Python)."""
    for at, line in enumerate(dump[:-1]):
        if line.startswith("Current thread") and (frame := _FRAME.match(dump[at + 1])):
            where = "/".join(frame["file"].split("/")[-2:])
            return f" in {frame['function']} ({where}:{frame['line']})"
    return ""


def _json_record(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
