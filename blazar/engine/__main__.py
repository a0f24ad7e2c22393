"""`python -m blazar.engine`: parse the command line, run one engine worker."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from blazar.engine import worker


def parse_args(argv: Sequence[str] | None = None) -> worker.WorkerConfig:
    p = argparse.ArgumentParser(
        prog="python -m blazar.engine",
        description="Serve one llama.cpp model as a blazar.engine.v1.Engine on a Unix socket.",
    )
    p.add_argument("--model", required=True, help="path of the GGUF file")
    p.add_argument("--socket", required=True, help="Unix socket path to serve on")
    p.add_argument("--slots", type=int, default=1, help="parallel sequences (default 1)")
    p.add_argument("--context-per-slot", type=int, default=4096, help="context tokens per slot")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for decode and prefill")
    p.add_argument("--gpu-layers", type=int, default=0, help="layers to offload to a GPU")
    p.add_argument("--parent-pid", type=int, default=None, help="exit if this is not our parent")
    p.add_argument(
        "--chat-template", default=None, help="Jinja chat template overriding the GGUF's"
    )
    p.add_argument(
        "--log-json", action="store_true", default=None, help="log one JSON object per line"
    )
    a = p.parse_args(argv)
    for name in ("slots", "context_per_slot", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return worker.WorkerConfig(
        model=a.model,
        socket=a.socket,
        slots=a.slots,
        context_per_slot=a.context_per_slot,
        threads=a.threads,
        gpu_layers=a.gpu_layers,
        parent_pid=a.parent_pid,
        chat_template=a.chat_template,
        log_json=a.log_json,
    )


if __name__ == "__main__":
    sys.exit(worker.main(parse_args()))
