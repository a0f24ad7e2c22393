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
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from blazar.api.errors import FieldError
from blazar.api.kinds import Lane, Resource


def count() -> int:
    """The CPUs the daemon, and so its engines, may run on (its affinity, as `nproc`
    counts them: a daemon started under `taskset -c 0` has one of a host's many): the
    threads of a Lane that does not set `threads`."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity outside Linux
        return os.cpu_count() or 1


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
