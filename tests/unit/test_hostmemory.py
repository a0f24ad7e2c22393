"""Reading the host's and a process's memory from /proc (a written tree, and the real one)."""

from __future__ import annotations

import os
from pathlib import Path

from blazar.controller.hostmemory import ProcMemory, Resident

MEMINFO = """MemTotal:       24684084 kB
MemFree:        22724164 kB
MemAvailable:   23901260 kB
Buffers:          104180 kB
"""
STATUS = """Name:\tpython
State:\tS (sleeping)
VmPeak:\t 1200000 kB
VmRSS:\t  520900 kB
RssAnon:\t  248900 kB
RssFile:\t  272000 kB
"""


def test_available_is_mem_available_and_total_mem_total(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text(MEMINFO)
    assert ProcMemory(tmp_path).available() == 23901260 * 1024
    assert ProcMemory(tmp_path).total() == 24684084 * 1024


def test_an_old_kernel_without_mem_available_gives_mem_free(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text(MEMINFO.replace("MemAvailable", "Other"))
    assert ProcMemory(tmp_path).available() == 22724164 * 1024


def test_resident_reads_vmrss_and_its_anonymous_part(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(STATUS)
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "status").write_text("Name:\tzombie\nState:\tZ (zombie)\n")
    memory = ProcMemory(tmp_path)
    assert memory.resident(42) == Resident(total=520900 * 1024, anonymous=248900 * 1024)
    assert memory.resident(43) is None  # a zombie has no memory lines
    assert memory.resident(44) is None  # gone


def test_the_real_proc() -> None:
    memory = ProcMemory()
    available, total = memory.available(), memory.total()
    assert available is not None and total is not None and 0 < available <= total
    mine = memory.resident(os.getpid())
    assert mine is not None and 0 < mine.anonymous < mine.total


def test_no_proc_is_unknown(tmp_path: Path) -> None:
    assert ProcMemory(tmp_path / "absent").available() is None
    assert ProcMemory(tmp_path / "absent").total() is None
    (tmp_path / "meminfo").write_text("Buffers: 1 kB\n")
    assert ProcMemory(tmp_path).available() is None
