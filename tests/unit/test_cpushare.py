"""The host's CPU share table: how many threads an engine's step gets beside the others."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from blazar.engine import cpushare
from blazar.engine.cpushare import CpuShare

CELL = struct.Struct("<qq")


@pytest.mark.parametrize(
    ("wanted", "others", "cores", "threads"),
    [
        (2, 0, 2, 2),  # alone: everything it asks for
        (2, 2, 2, 1),  # two engines of 2 threads on 2 cores: one each
        (2, 1, 2, 1),
        (1, 2, 2, 1),  # never below one
        (4, 4, 8, 4),  # they fit: nobody gives anything up
        (4, 4, 4, 2),
        (6, 2, 4, 3),  # proportional to what each asks for
        (2, 4, 2, 1),
        (8, 0, 2, 8),  # more than the cores when alone is the operator's choice
    ],
)
def test_share(wanted: int, others: int, cores: int, threads: int) -> None:
    assert cpushare.share(wanted, others, cores) == threads


def write_cell(path: Path, index: int, pid: int, threads: int) -> None:
    with path.open("r+b") as f:
        f.seek(index * CELL.size)
        f.write(CELL.pack(pid, threads))


def cells(path: Path) -> list[tuple[int, int]]:
    return [c for c in CELL.iter_unpack(path.read_bytes()) if c != (0, 0)]


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    return int(proc.stdout)


def test_an_engine_alone_computes_on_all_it_wants(tmp_path: Path) -> None:
    table = CpuShare(tmp_path / "cpu", cores=2)
    assert table.busy(2) == 2
    assert cells(tmp_path / "cpu") == [(os.getpid(), 2)]
    table.idle()
    assert cells(tmp_path / "cpu") == [(os.getpid(), 0)]
    table.close()
    assert cells(tmp_path / "cpu") == []


def test_a_busy_engine_elsewhere_takes_its_share(tmp_path: Path) -> None:
    path = tmp_path / "cpu"
    table = CpuShare(path, cores=2)
    parent = os.getppid()  # a live process that is not this one
    write_cell(path, 5, parent, 2)
    assert table.busy(2) == 1
    write_cell(path, 5, parent, 0)  # it went idle
    assert table.busy(2) == 2
    table.close()


def test_a_dead_engine_holds_no_cores_and_its_cell_is_taken_again(tmp_path: Path) -> None:
    path = tmp_path / "cpu"
    path.write_bytes(bytes(cpushare.SIZE))
    gone = dead_pid()
    write_cell(path, 0, gone, 2)
    table = CpuShare(path, cores=2)
    assert cells(path) == [(os.getpid(), 0)]  # cell 0, reclaimed
    write_cell(path, 1, gone, 2)
    assert table.busy(2) == 2
    table.close()


def test_two_engine_processes_take_different_cells_and_share(tmp_path: Path) -> None:
    path = tmp_path / "cpu"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from blazar.engine.cpushare import CpuShare
            table = CpuShare(Path({str(path)!r}), cores=2)
            print(table.busy(2), flush=True)
            sys.stdin.read()  # busy until the test closes stdin
            table.close()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "2"  # alone when it started
        table = CpuShare(path, cores=2)
        assert table.busy(2) == 1
        assert sorted(pid for pid, _ in cells(path)) == sorted([child.pid, os.getpid()])
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert table.busy(2) == 2  # it left
    table.close()


def test_the_table_refuses_a_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / "cpu").symlink_to(target)
    with pytest.raises(OSError):
        CpuShare(tmp_path / "cpu")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away takes root")
def test_a_table_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cpu"
    path.write_bytes(bytes(cpushare.SIZE))
    os.chown(path, 4242, 4242)
    with pytest.raises(PermissionError):
        CpuShare(path)
