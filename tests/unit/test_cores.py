"""`spec.threads` beyond the host's CPUs is refused at apply, by name, with both
numbers; a Lane within them, or without threads, is admitted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blazar.api import errors
from blazar.api.kinds import Kind, Lane, LaneSpec
from blazar.api.meta import ObjectMeta
from blazar.enginehost import cores
from blazar.store import apply
from blazar.store.memory import MemoryStore


def lane(name: str, threads: int | None) -> Lane:
    return Lane(metadata=ObjectMeta(name=name), spec=LaneSpec(model="m", threads=threads))


@pytest.mark.parametrize(
    ("threads", "refused"),
    [(None, False), (1, False), (2, False), (3, True), (1024, True)],
)
def test_threads_beyond_the_cpus_are_refused(threads: int | None, refused: bool) -> None:
    problems = cores.problems([lane("l", threads)], cpus=2)
    assert [p.path for p in problems] == (["Lane/l: spec.threads"] if refused else [])
    if refused:
        assert f"{threads} threads asked, but this host has 2 CPUs for" in problems[0].message
        assert "at most 2" in problems[0].message


def test_the_default_always_fits() -> None:
    assert cores.problems([lane("l", cores.count())], cpus=cores.count()) == []


def test_an_apply_with_a_refused_lane_writes_nothing() -> None:
    store = MemoryStore()
    store.admission = lambda objects: cores.problems(objects, cpus=2)
    head = {"apiVersion": "blazar.dev/v1alpha1"}
    docs = [
        ("a.yaml#1", {**head, "kind": "Model", "metadata": {"name": "m"},
                      "spec": {"source": {"path": "/m.gguf"}}}),
        ("a.yaml#2", {**head, "kind": "Lane", "metadata": {"name": "ok"},
                      "spec": {"model": "m", "threads": 2}}),
        ("a.yaml#3", {**head, "kind": "Lane", "metadata": {"name": "many"},
                      "spec": {"model": "m", "threads": 1024}}),
    ]  # fmt: skip
    with pytest.raises(errors.ManifestInvalid, match=r"Lane/many: spec.threads"):
        apply.apply_documents(store, docs)
    assert store.list(Kind.LANE) == [] and store.list(Kind.MODEL) == []


def test_the_cpus_are_those_the_daemon_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `taskset -c 0` a many-CPU host gives its engines one: a Lane's default
    threads, and its bound, are that one."""
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(cores.os, "cpu_count", lambda: 64)
    assert cores.count() == 1
    [problem] = cores.problems([lane("l", 2)], cpus=cores.count())
    assert "has 1 CPU for its engines" in problem.message


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000", None), ("100000 100000", 1), ("150000 100000", 2), ("50000 100000", 1),
     ("400000 100000\n", 4), ("", None), ("x 100000", None)],
)  # fmt: skip
def test_cgroup_v2_cpu_max_in_whole_cpus_rounded_up(text: str, cpus: int | None) -> None:
    assert cores.parse_cpu_max(text) == cpus


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_bounds_the_count_the_lowest_along_the_ancestors(
    tmp_path: Path,
) -> None:
    """`docker run --cpus 1` on a host of many CPUs: the affinity has them all, the
    quota one; a parent's lower quota (a systemd slice) bounds its children."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    write(proc, "0::/system.slice/blazar.service\n")
    write(root / "cpu.max", "max 100000\n")
    write(root / "system.slice" / "cpu.max", "300000 100000\n")
    write(root / "system.slice" / "blazar.service" / "cpu.max", "max 100000\n")
    assert cores.quota_cpus(root, proc) == 3
    write(root / "system.slice" / "blazar.service" / "cpu.max", "100000 100000\n")
    assert cores.quota_cpus(root, proc) == 1
    assert cores.count(cgroup_root=root, proc_cgroup=proc) == 1


def test_a_cgroup_v1_quota_and_a_container_whose_path_is_the_hosts(tmp_path: Path) -> None:
    """Inside a container, /proc/self/cgroup may name the host's path while the
    container's own cgroup is mounted at the root."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "200000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cores.quota_cpus(root, proc) == 2
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert cores.quota_cpus(root, proc) is None


def test_no_cgroup_files_leave_the_affinity(tmp_path: Path) -> None:
    assert cores.quota_cpus(tmp_path, tmp_path / "missing") is None
    assert cores.count(cgroup_root=tmp_path, proc_cgroup=tmp_path / "missing") == len(
        os.sched_getaffinity(0)
    )
