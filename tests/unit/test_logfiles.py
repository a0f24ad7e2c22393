"""Engine log rotation (copy and truncate) keeps each replica's output under its cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from blazar.enginehost import logfiles


def test_a_small_log_is_left_alone(tmp_path: Path) -> None:
    log = logfiles.path(tmp_path, "l", 0)
    log.write_bytes(b"x" * 99)
    assert not logfiles.rotate_if_full(log, max_bytes=100, keep=2)
    assert log.read_bytes() == b"x" * 99
    assert not logfiles.rotate_if_full(tmp_path / "absent.log", max_bytes=1)


def test_rotation_keeps_a_bounded_number_of_generations(tmp_path: Path) -> None:
    log = logfiles.path(tmp_path, "l", 1)
    log.touch(mode=0o600)
    with log.open("ab") as engine:  # the engine's file, opened for appending, as spawned
        for n in range(4):
            engine.write(bytes([65 + n]) * 100)
            engine.flush()
            assert logfiles.rotate_if_full(log, max_bytes=100, keep=2)
            assert log.stat().st_size == 0
        engine.write(b"next")
        engine.flush()
    # The engine's next write lands at the start of the cut file, not past a hole.
    assert log.read_bytes() == b"next"
    assert logfiles.generation(log, 1).read_bytes() == b"D" * 100
    assert logfiles.generation(log, 2).read_bytes() == b"C" * 100
    assert not logfiles.generation(log, 3).exists()
    for file in (log, logfiles.generation(log, 1), logfiles.generation(log, 2)):
        assert file.stat().st_mode & 0o777 == 0o600


def test_replicas_are_the_indices_with_a_log(tmp_path: Path) -> None:
    for name in ("l-0.log", "l-2.log", "l-2.log.1", "l-x.log", "other-1.log", "l-extra-1.log"):
        (tmp_path / name).touch()
    assert logfiles.replicas(tmp_path, "l") == [0, 2]


@pytest.mark.parametrize(
    ("content", "lines", "tail"),
    [
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc\n", 1, b"c\n"),
        (b"a\nb\nc", 1, b"c"),  # a last line without its newline is a line
        (b"a\nb\nc", 2, b"b\nc"),
        (b"a\nb\nc\n", 3, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 10, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 0, b""),
        (b"", 5, b""),
        (b"\n\n\n", 2, b"\n\n"),
        (b"no newline at all", 1, b"no newline at all"),
    ],
)
def test_tail_start_is_where_the_last_lines_begin(
    tmp_path: Path, content: bytes, lines: int, tail: bytes
) -> None:
    log = tmp_path / "x.log"
    log.write_bytes(content)
    with log.open("rb") as f:
        assert content[logfiles.tail_start(f, lines) :] == tail


def test_tail_start_reads_blocks_back_from_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines longer than a block, and a block edge right after a newline."""
    monkeypatch.setattr(logfiles, "_TAIL_BLOCK_BYTES", 4)
    content = b"".join(f"{i}:{'x' * (i % 7)}\n".encode() for i in range(50))
    log = tmp_path / "x.log"
    log.write_bytes(content)
    with log.open("rb") as f:
        for n in range(52):
            got = content[logfiles.tail_start(f, n) :]
            assert got == b"".join(content.splitlines(keepends=True)[-n:] if n else []), n
