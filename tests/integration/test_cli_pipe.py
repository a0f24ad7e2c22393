"""The CLI piped into a reader that goes away (`blazar describe lane l | head`): it ends
quietly with 141 (128 + SIGPIPE), as kubectl and other Unix tools do, whatever it was
printing and however far it got."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from blazar.api import manifests
from blazar.dataplane import server
from blazar.store.memory import MemoryStore

REPO = Path(__file__).resolve().parents[2]
SIGPIPE_STATUS = 128 + signal.SIGPIPE


def fleet(store: MemoryStore, models: int) -> None:
    docs = [
        {
            "apiVersion": "blazar.dev/v1alpha1",
            "kind": "Model",
            "metadata": {"name": f"model-{i:04d}", "labels": {"tier": "small"}},
            "spec": {"source": {"path": f"/models/a-rather-long-file-name-{i:04d}.gguf"}},
        }
        for i in range(models)
    ]
    docs.append(
        {
            "apiVersion": "blazar.dev/v1alpha1",
            "kind": "Lane",
            "metadata": {"name": "l"},
            "spec": {"model": "model-0000"},
        }
    )
    store.apply_all(
        manifests.validate_objects([("test", d) for d in docs], exists=lambda k, n: True)
    )
    for i in range(50):
        store.record_event(kind="Lane", name="l", type="Normal", reason="Test", message=f"{i}")


def run_cli(args: list[str], *, port: int, read_first_line: bool) -> tuple[int, bytes]:
    """Run the CLI with its stdout on a pipe whose reader closes early: at once (before
    anything is written), or after the first line."""
    argv = [sys.executable, "-m", "blazar.cli", "--server", f"127.0.0.1:{port}", *args]
    if not read_first_line:
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            done = subprocess.run(
                argv, stdout=write_end, stderr=subprocess.PIPE, cwd=REPO, timeout=60
            )
        finally:
            os.close(write_end)
        return done.returncode, done.stderr
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()
        proc.stdout.close()
        stderr = proc.stderr.read()
        return proc.wait(timeout=60), stderr


@pytest.mark.parametrize(
    ("args", "read_first_line"),
    [
        (["describe", "lane", "l"], False),  # all of it waits in the buffer until exit
        (["get", "models"], False),
        (["events"], False),
        # More than the pipe holds (64 KiB): a print fails.
        (["get", "models", "-o", "yaml"], True),
        (["get", "models", "-o", "json"], True),
    ],
)
def test_a_closed_stdout_ends_the_cli_quietly(args: list[str], read_first_line: bool) -> None:
    async def main() -> tuple[int, bytes]:
        store = MemoryStore()
        fleet(store, models=400)
        plane = await server.start(store=store, address="127.0.0.1:0")
        try:
            return await asyncio.to_thread(
                run_cli, args, port=plane.port, read_first_line=read_first_line
            )
        finally:
            await plane.stop(grace=0)

    code, stderr = asyncio.run(main())
    assert stderr == b""
    assert code == SIGPIPE_STATUS
