"""kubectl's other habits against a real daemon with no engines (cheap to start):
`diff -f`, `get -w` and `events --for`, through the real CLI over the Control socket.

The tests set up and check through one in-process Control channel (`Control`): a CLI
start costs a second on a busy host, so only the command under test runs as one."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from blazar._proto.v1 import control_pb2, control_pb2_grpc
from tests.integration.harness import REPO, Daemon, short_home, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    home = short_home()
    d = Daemon(home=home).start()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


class Control:
    """Apply, get and delete without a CLI start."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = control_pb2_grpc.ControlStub(channel)

    def apply(self, manifest: Path) -> None:
        docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
        self.stub.Apply(control_pb2.ApplyRequest(objects_json=[json.dumps(d) for d in docs]))

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        try:
            got = self.stub.Get(control_pb2.GetRequest(kind=kind, name=name), timeout=30)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND, err
            return None
        found: dict[str, Any] = json.loads(got.object_json)
        return found

    def delete(self, kind: str, name: str) -> None:
        with contextlib.suppress(grpc.RpcError):
            self.stub.Delete(control_pb2.DeleteRequest(kind=kind, name=name), timeout=30)

    def events(self, kind: str, name: str) -> list[control_pb2.Event]:
        request = control_pb2.EventsRequest(kind=kind, name=name)
        return list(self.stub.Events(request, timeout=30).events)


@pytest.fixture(scope="module")
def control(daemon: Daemon) -> Iterator[Control]:
    with grpc.insecure_channel(daemon.control) as channel:
        yield Control(channel)


def policy(name: str, priority: int, **labels: str) -> str:
    return (
        "apiVersion: blazar.dev/v1alpha1\nkind: SLOPolicy\n"
        f"metadata: {{name: {name}, labels: {json.dumps(labels)}}}\n"
        f"spec: {{priority: {priority}}}\n"
    )


def changed_lines(diff: str) -> list[str]:
    return [
        line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("---", "+++")
    ]


def test_diff_shows_what_apply_would_change_and_exits_as_kubectl(
    daemon: Daemon, control: Control, tmp_path: Path
) -> None:
    manifest = tmp_path / "p.yaml"
    manifest.write_text(policy("diffed", 3))
    new = daemon.cli("diff", "-f", str(manifest))
    assert new.returncode == 1, new.stderr
    assert "+++ applied/slopolicy/diffed" in new.stdout
    assert "+kind: SLOPolicy" in changed_lines(new.stdout)
    assert control.get("SLOPolicy", "diffed") is None  # diff wrote nothing

    control.apply(manifest)
    same = daemon.cli("diff", "-f", str(manifest))
    assert (same.returncode, same.stdout) == (0, "")

    manifest.write_text(policy("diffed", 5, team="a"))
    edited = daemon.cli("diff", "-f", str(manifest))
    assert edited.returncode == 1, edited.stderr
    assert changed_lines(edited.stdout) == [
        "+  labels:",
        "+    team: a",
        "-  priority: 3",
        "+  priority: 5",
    ]
    assert (control.get("SLOPolicy", "diffed") or {})["spec"]["priority"] == 3

    manifest.write_text(policy("diffed", 5).replace("priority: 5", "priority: 5, colour: 1"))
    bad = daemon.cli("diff", "-f", str(manifest))
    assert bad.returncode == 2
    assert "spec.colour" in bad.stderr
    assert daemon.cli("diff", "-f", str(tmp_path / "missing.yaml")).returncode == 2
    control.delete("SLOPolicy", "diffed")


def test_get_watch_prints_the_list_then_each_change_until_ctrl_c(
    daemon: Daemon, control: Control, tmp_path: Path
) -> None:
    manifest = tmp_path / "w.yaml"
    manifest.write_text(policy("watched", 1))
    control.apply(manifest)
    argv = [sys.executable, "-m", "blazar.cli", "--server", daemon.control, "get", "slo", "-w"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    lines: queue.Queue[list[str]] = queue.Queue()
    assert proc.stdout is not None and proc.stderr is not None
    reader = threading.Thread(
        target=lambda: [lines.put(line.split()) for line in proc.stdout or ()], daemon=True
    )
    reader.start()

    def until(first: list[str]) -> None:
        """Read lines until one starts with `first` (the controller's status writes
        are changes too, so others come between)."""
        seen = []
        while (line := lines.get(timeout=30))[: len(first)] != first:
            seen.append(line)
            assert len(seen) < 50, seen

    try:
        assert lines.get(timeout=30)[:2] == ["EVENT", "NAME"]
        assert lines.get(timeout=30)[:2] == ["ADDED", "watched"]
        manifest.write_text(policy("watched", 2) + "---\n" + policy("second", 1))
        control.apply(manifest)
        until(["ADDED", "second"])
        control.delete("SLOPolicy", "second")
        until(["DELETED", "second"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    control.delete("SLOPolicy", "watched")


def test_events_for_shows_only_that_objects_events(
    daemon: Daemon, control: Control, tmp_path: Path
) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "".join(
            "---\napiVersion: blazar.dev/v1alpha1\nkind: Model\n"
            f"metadata: {{name: {name}}}\n"
            f"spec: {{source: {{path: {json.dumps(str(daemon.home / f'{name}.gguf'))}}}}}\n"
            for name in ("absent-a", "absent-b")
        )
    )
    control.apply(manifest)
    for name in ("absent-a", "absent-b"):
        wait_for(lambda: control.events("Model", name), timeout=30, what=f"{name}'s event")  # noqa: B023

    out = daemon.cli("events", "--for", "models/absent-a", "-o", "json")
    assert out.returncode == 0, out.stderr
    only_a = json.loads(out.stdout)
    assert {(e["kind"], e["name"]) for e in only_a} == {("Model", "absent-a")}
    assert any(e["reason"] == "FileNotFound" for e in only_a)
    table = daemon.cli("events", "--for", "model/absent-b").stdout
    assert "Model/absent-b" in table and "absent-a" not in table

    wrong = daemon.cli("events", "--for", "absent-a")
    assert wrong.returncode == 1 and "KIND/NAME" in wrong.stderr
    for name in ("absent-a", "absent-b"):
        control.delete("Model", name)


def test_logs_follow_ends_when_the_lane_is_deleted(
    daemon: Daemon, control: Control, tmp_path: Path
) -> None:
    """`logs -f` over Control, on a Lane whose engine cannot start (its Model's file is
    absent): the replica log is written here as its engine would have written it."""
    manifest = tmp_path / "quiet.yaml"
    manifest.write_text(
        "apiVersion: blazar.dev/v1alpha1\nkind: Model\nmetadata: {name: absent-q}\n"
        f"spec: {{source: {{path: {json.dumps(str(daemon.home / 'absent-q.gguf'))}}}}}\n"
        "---\napiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {name: quiet}\n"
        "spec: {model: absent-q}\n"
    )
    control.apply(manifest)
    log = daemon.home / "logs" / "quiet-0.log"
    log.write_bytes(b"zeroth line\nfirst line\n")
    assert daemon.cli("logs", "lane/quiet", "--tail", "1").stdout == "first line\n"
    # The daemon and this CLI are the same version: it acts on every feature.
    version = daemon.cli("version").stdout.splitlines()
    assert version[1] == version[0].replace("Client", "Server") and len(version) == 2
    missing = daemon.cli("logs", "lane/quiet", "--replica", "1")
    assert missing.returncode == 1
    assert "no log of replica 1 (replicas with logs: 0)" in missing.stderr
    argv = [sys.executable, "-m", "blazar.cli", "--server", daemon.control]
    follow = subprocess.Popen(
        [*argv, "logs", "lane/quiet", "-f", "--tail=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert follow.stdout is not None and follow.stderr is not None
        assert follow.stdout.readline() == b"first line\n"
        with log.open("ab") as f:
            f.write(b"second line\n")
        assert follow.stdout.readline() == b"second line\n"
        control.delete("Lane", "quiet")
        assert follow.wait(timeout=30) == 0
        assert follow.stderr.read() == b""
    finally:
        follow.kill()
        follow.wait()
        control.delete("Model", "absent-q")


def test_gpu_layers_are_refused_at_apply_where_llama_cpp_cannot_offload(
    daemon: Daemon, tmp_path: Path
) -> None:
    """The daemon asks its llama.cpp build (in a process of its own) whether layers can
    leave the CPU: a Lane asking for some is refused by name where they cannot, and
    admitted where they can (this host's answer, asked the same way)."""
    from blazar.enginehost import offload

    manifest = tmp_path / "gpu.yaml"
    manifest.write_text(
        "apiVersion: blazar.dev/v1alpha1\nkind: Model\nmetadata: {name: absent-g}\n"
        f"spec: {{source: {{path: {json.dumps(str(daemon.home / 'absent-g.gguf'))}}}}}\n"
        "---\napiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {name: gpu}\n"
        "spec: {model: absent-g, gpuLayers: 4}\n"
    )
    applied = daemon.cli("apply", "-f", str(manifest), "--dry-run")
    if offload.probe():
        assert applied.returncode == 0, applied.stderr
    else:
        assert applied.returncode == 1
        assert "Lane/gpu (" in applied.stderr
        assert "spec.gpuLayers: 4 layers asked" in applied.stderr
        assert "built for the CPU only" in applied.stderr


def test_threads_beyond_the_hosts_cpus_are_refused_at_apply(
    control: Control, daemon: Daemon
) -> None:
    """llama.cpp would start every thread asked for, and on a host with fewer CPUs they
    only wait for each other: the Lane is refused by name with both numbers, and
    nothing of the apply is stored."""
    cpus = len(os.sched_getaffinity(0))
    model = {
        "apiVersion": "blazar.dev/v1alpha1", "kind": "Model", "metadata": {"name": "absent-t"},
        "spec": {"source": {"path": str(daemon.home / "absent-t.gguf")}},
    }  # fmt: skip
    lane = {
        "apiVersion": "blazar.dev/v1alpha1", "kind": "Lane", "metadata": {"name": "threads"},
        "spec": {"model": "absent-t", "threads": cpus + 1},
    }  # fmt: skip
    request = control_pb2.ApplyRequest(objects_json=[json.dumps(model), json.dumps(lane)])
    with pytest.raises(grpc.RpcError) as refused:
        control.stub.Apply(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        f"Lane/threads: spec.threads: {cpus + 1} threads asked, but this host has {cpus} CPU"
        in (refused.value.details() or "")
    )
    assert control.get("Lane", "threads") is None and control.get("Model", "absent-t") is None
