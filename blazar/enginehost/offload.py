"""Whether a Lane's `gpuLayers` can act on this host, asked of its llama.cpp build once.

llama.cpp built for the CPU only takes `n_gpu_layers` and runs every layer on the CPU
all the same (llama-server just logs a warning). A field Blazar accepts must act, so a
Lane that asks for offloaded layers on such a host is refused at apply (the store's
admission), naming the field, rather than stored and run as if it had none.

The daemon never loads llama.cpp (an engine's crash must not be its crash): the
question goes to `python -m blazar.engine.probe` in a process of its own (about 0.2 s,
on the event loop: an apply that sets gpuLayers waits for it), on the first Lane that
asks for layers. A yes or no is kept for the daemon's life: a llama-cpp-python
reinstalled under a running daemon is asked again at its next start. A probe that
fails answers nothing and is asked again at the next such Lane.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence

import structlog

from blazar.api.errors import FieldError
from blazar.api.kinds import Lane, Resource

log = structlog.get_logger("blazar.enginehost.offload")

PROBE_TIMEOUT_S = 60.0


def probe() -> bool | None:
    """Whether this host's llama.cpp can offload layers; None when the probe fails (it
    is then not refused here: an engine that cannot load llama.cpp says why itself)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "blazar.engine.probe"],
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=True,
        )
        return bool(json.loads(done.stdout)["gpuOffload"])
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as exc:
        log.warning("offload.probe_failed", error=str(exc))
        return None


class GpuOffload:
    """The store's admission of `spec.gpuLayers` (`problems`)."""

    def __init__(self, ask: Callable[[], bool | None] = probe) -> None:
        self._ask = ask
        self._known: bool | None = None

    def supported(self) -> bool | None:
        if self._known is None:
            self._known = self._ask()
        return self._known

    def problems(self, objects: Sequence[Resource]) -> list[FieldError]:
        """Each Lane that asks for offloaded layers on a host that cannot offload; the
        build is asked only when one does."""
        # An upstream Lane's gpuLayers is refused by validation, before admission.
        asking = [obj for obj in objects if isinstance(obj, Lane) and obj.spec.gpu_layers > 0]
        if not asking or self.supported() is not False:
            return []
        return [
            FieldError(
                f"Lane/{lane.metadata.name}: spec.gpuLayers",
                f"{lane.spec.gpu_layers} layers asked, but this host's llama.cpp "
                "(llama-cpp-python) is built for the CPU only: no layer can leave the CPU. "
                "Leave gpuLayers out (0) to run on the CPU, or install a llama-cpp-python "
                "built for your GPU and restart the daemon",
            )
            for lane in asking
        ]
