"""What the daemon's and the workers' log lines may hold."""

from __future__ import annotations

import json
import logging
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
