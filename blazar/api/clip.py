"""Bounds on text that Blazar echoes back or keeps about what a caller sent.

A caller's value can be megabytes (a model name, an apiVersion, a session key); an
error that quotes it, an event that stores it, a log line that shows it must not be.
Pure.
"""

from __future__ import annotations

import re

# An error's message, whole: long enough for a batch of manifest errors.
MESSAGE_CHARS = 16_384
# One problem in a manifest, or one metadata value of an error.
FIELD_CHARS = 1_024
# An event's message, as Kubernetes bounds its events' (1,024 bytes).
EVENT_CHARS = 1_024
# An event's reason and its object's kind and name (Kubernetes names: 253).
NAME_CHARS = 253


def clip(text: str, limit: int) -> str:
    """`text`, or about `limit` characters of it: its start and its end (where an error
    says what to do), and how many characters between them were left out. Half of a
    surrogate pair (a caller's JSON escape, `\\ud800`, decodes to one) is written as
    its escape: a message that no UTF-8 encoder takes could not be sent or stored."""
    text = _encodable(text)
    if len(text) <= limit:
        return text
    tail = limit // 4
    head = limit - tail
    end = text[len(text) - tail :]
    return f"{text[:head]} [... {len(text) - head - tail} characters left out ...] {end}"


def one_line(text: str) -> str:
    """`text` with every line break and other control character written as its escape
    (`\\n`, `\\x1c`, `\\u2028`): a caller's key quoted in a list of errors, one a line,
    cannot start a line of its own."""
    if not _BREAKS.search(text):
        return text
    return _BREAKS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


# C0 and C1 control characters (line feed, the separators 0x1c-0x1e, NEL) and the
# Unicode line and paragraph separators: what `str.splitlines` or a terminal breaks on.
_BREAKS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
