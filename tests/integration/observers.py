"""Watching a test daemon from the test: its store's changes over Control, a CLI
command that keeps printing, a process's resident memory."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from blazar._proto.v1 import control_pb2, control_pb2_grpc
from tests.integration.harness import Daemon


class StoreWatch:
    """The daemon's Control `Watch` of one kind, read by a thread: (arrival time on the
    monotonic clock, type, object) for every change, to time what a file change does."""

    def __init__(self, daemon: Daemon, kind: str) -> None:
        self._channel = grpc.insecure_channel(daemon.control)
        # For the test's own reads too: in process, not a CLI start each (seconds here).
        self.stub = control_pb2_grpc.ControlStub(self._channel)
        self._stream = self.stub.Watch(control_pb2.WatchRequest(kind=kind))
        self.seen: list[tuple[float, str, dict[str, Any]]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled by `close`
            for event in self._stream:
                self.seen.append((time.monotonic(), event.type, json.loads(event.object_json)))

    def after(self, since: float, kind: str, name: str, generation: int = 0) -> float | None:
        """Seconds from `since` to the first `kind` event for `name` after it (and at
        `generation` or above, when given)."""
        for at, type_, obj in list(self.seen):
            meta = obj["metadata"]
            if (at >= since and type_ == kind and meta["name"] == name
                    and meta.get("generation", 0) >= generation):  # fmt: skip
                return at - since
        return None

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(timeout=10)
        self._channel.close()


class Follower:
    """A CLI command that keeps printing (`logs -f`), its output gathered by a thread."""

    def __init__(self, daemon: Daemon, *args: str) -> None:
        argv = [sys.executable, "-m", "blazar.cli", "--server", daemon.control, *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out = bytearray()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while data := self.proc.stdout.read1(65536):
            self.out += data

    def interrupt(self) -> tuple[int, bytes]:
        """Ctrl-C: its exit status and what it wrote to stderr."""
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=30)
        finally:
            self.proc.kill()
            self.proc.wait()
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
