"""The CPUs this host gives its engines, and the store's admission of `spec.threads`.

llama.cpp takes any thread count: a step runs on that many OpenMP threads, which meet
at a barrier after every operation and spin while they wait, so threads beyond the
host's CPUs only wait for each other and take the CPUs from every other engine. Measured
on the 2-CPU test host: a Lane of `threads: 1024` (the bound validation takes) ran
1,033 OS threads, decoded 0.6-0.8 tokens/s, and held the host's load average above 200,
slowing the other engines' decode as much. So a Lane that asks for more threads than
the host has CPUs is refused at apply, naming the field and both numbers, as Kubernetes
leaves a Pod that requests more CPU than a node has unschedulable. The bound is the
CPU count a Lane without `threads` computes on (`count`: the daemon's affinity), so
the default always fits.
A Lane stored before this check keeps running as it did.

The CPUs counted are the fewer of two: the daemon's affinity (`taskset`, a cpuset), and
its cgroup's CPU quota rounded up (`docker run --cpus 1`, a systemd `CPUQuota=`, a
Kubernetes CPU limit: cgroup v2's `cpu.max`, v1's `cpu.cfs_quota_us` over
`cpu.cfs_period_us`, the lowest along the cgroup's ancestors), as Go's runtime and the
JVM count them. A quota leaves every CPU in the affinity, but the kernel stops the
whole group once it used its share of a period, so threads beyond it spin at barriers
for CPUs that are not theirs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from blazar.api.errors import FieldError
from blazar.api.kinds import Lane, Resource

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def count(*, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The CPUs the daemon, and so its engines, may run on: the threads of a Lane that
    does not set `threads` (see the module docstring)."""
    try:
        cpus = len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity outside Linux
        cpus = os.cpu_count() or 1
    quota = quota_cpus(cgroup_root, proc_cgroup)
    return cpus if quota is None else max(1, min(cpus, quota))


def quota_cpus(cgroup_root: Path, proc_cgroup: Path) -> int | None:
    """The daemon's cgroup CPU quota in whole CPUs, rounded up (None: none set, or no
    cgroup file readable)."""
    try:
        memberships = proc_cgroup.read_text()
    except OSError:
        return None
    quotas = [cpus for directory in _cpu_directories(cgroup_root, memberships)
              if (cpus := _quota_in(directory)) is not None]  # fmt: skip
    return min(quotas, default=None)


def parse_cpu_max(text: str) -> int | None:
    """cgroup v2's `cpu.max` ("QUOTA PERIOD", QUOTA "max" when unlimited) in whole CPUs."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _cpus(fields[0], fields[1])


def _cpus(quota: str, period: str) -> int | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:  # v1 says -1 for no quota
        return None
    return max(1, math.ceil(q / p))


def _quota_in(directory: Path) -> int | None:
    try:
        if (directory / "cpu.max").exists():
            return parse_cpu_max((directory / "cpu.max").read_text())
        return _cpus(
            (directory / "cpu.cfs_quota_us").read_text().strip(),
            (directory / "cpu.cfs_period_us").read_text().strip(),
        )
    except OSError:
        return None


def _cpu_directories(root: Path, memberships: str) -> Iterator[Path]:
    """The directories of the CPU controller's cgroup of this process and its ancestors,
    from `/proc/self/cgroup` ("ID:CONTROLLERS:PATH" lines; v2's is "0::PATH"). Inside
    a container the path may be the host's while the container's own cgroup is mounted
    at the root: a path that does not exist under the mount is read as the root."""
    for line in memberships.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        mount = _mount(root, fields[1])
        if mount is None:
            continue
        parts = [p for p in fields[2].strip().split("/") if p]
        if not mount.joinpath(*parts).is_dir():
            parts = []
        for depth in range(len(parts), -1, -1):
            yield mount.joinpath(*parts[:depth])


def _mount(root: Path, controllers: str) -> Path | None:
    """Where the hierarchy of `controllers` (v1: "cpu,cpuacct"; v2: "") is mounted, if it
    is the CPU controller's."""
    if controllers == "":
        return root
    if "cpu" not in controllers.split(","):
        return None
    return next(
        (root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()),
        None,
    )


def problems(objects: Sequence[Resource], *, cpus: int) -> list[FieldError]:
    """Each Lane that asks for more threads than `cpus`."""
    return [
        FieldError(
            f"Lane/{obj.metadata.name}: spec.threads",
            f"{obj.spec.threads} threads asked, but this host has {cpus} "
            f"CPU{'' if cpus == 1 else 's'} for its engines: threads "
            "beyond them only wait for each other and slow every engine. Set threads to "
            f"at most {cpus}, or leave it out to use them all",
        )
        for obj in objects
        if isinstance(obj, Lane) and obj.spec.threads is not None and obj.spec.threads > cpus
    ]
