"""`python -m blazar.engine --launch FILE`: run one engine worker from its launch document.

The document (`blazar.api.replicas.EngineLaunch`, JSON) is the worker's whole
configuration; the supervisor writes it into the run directory. `--launch -` reads it
from standard input.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
from collections.abc import Sequence
from pathlib import Path

import pydantic

from blazar.api.replicas import EngineLaunch


def parse_args(argv: Sequence[str] | None = None) -> EngineLaunch:
    p = argparse.ArgumentParser(
        prog="python -m blazar.engine",
        description="Serve one llama.cpp model as a blazar.engine.v1.Engine on a Unix socket.",
    )
    p.add_argument(
        "--launch",
        required=True,
        metavar="FILE",
        help="the launch document (JSON, blazar.api.replicas.EngineLaunch); - for stdin",
    )
    a = p.parse_args(argv)
    try:
        data = sys.stdin.buffer.read() if a.launch == "-" else Path(a.launch).read_bytes()
    except OSError as exc:
        p.error(f"--launch: {exc}")
    try:
        return EngineLaunch.from_json(data)
    except pydantic.ValidationError as exc:
        p.error(f"--launch: not a valid launch document: {exc}")


if __name__ == "__main__":
    # A crash in native code (llama.cpp, gRPC) leaves its Python stacks in the worker's
    # log, which `enginehost.forensics` reads for the replica's Failed message.
    faulthandler.enable()
    from blazar.engine import worker  # after parsing: it loads llama.cpp

    sys.exit(worker.main(parse_args()))
