"""Engine log rotation (copy and truncate) keeps each replica's output under its cap."""

from __future__ import annotations

from pathlib import Path

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
