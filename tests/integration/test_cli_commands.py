"""kubectl's other habits against a real daemon with no engines (cheap to start):
`diff -f`, `get -w` and `events --for`, through the real CLI over the Control socket."""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    daemon: Daemon, tmp_path: Path
) -> None:
    manifest = tmp_path / "p.yaml"
    manifest.write_text(policy("diffed", 3))
    new = daemon.cli("diff", "-f", str(manifest))
    assert new.returncode == 1, new.stderr
    assert "+++ applied/slopolicy/diffed" in new.stdout
    assert "+kind: SLOPolicy" in changed_lines(new.stdout)
    assert daemon.cli("get", "slo", "diffed").returncode != 0  # diff wrote nothing

    assert daemon.cli("apply", "-f", str(manifest)).returncode == 0
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
    assert daemon.get("slo", "diffed")["spec"]["priority"] == 3

    manifest.write_text(policy("diffed", 5).replace("priority: 5", "priority: 5, colour: 1"))
    bad = daemon.cli("diff", "-f", str(manifest))
    assert bad.returncode == 2
    assert "spec.colour" in bad.stderr
    assert daemon.cli("diff", "-f", str(tmp_path / "missing.yaml")).returncode == 2
    daemon.cli("delete", "slo", "diffed")


def test_get_watch_prints_the_list_then_each_change_until_ctrl_c(
    daemon: Daemon, tmp_path: Path
) -> None:
    manifest = tmp_path / "w.yaml"
    manifest.write_text(policy("watched", 1))
    assert daemon.cli("apply", "-f", str(manifest)).returncode == 0
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
        assert lines.get(timeout=30)[0] == "NAME"
        assert lines.get(timeout=30)[0] == "watched"
        manifest.write_text(policy("watched", 2) + "---\n" + policy("second", 1))
        assert daemon.cli("apply", "-f", str(manifest)).returncode == 0
        until(["ADDED", "second"])
        assert daemon.cli("delete", "slo", "second").returncode == 0
        until(["DELETED", "second"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    daemon.cli("delete", "slo", "watched")


def test_events_for_shows_only_that_objects_events(daemon: Daemon, tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "".join(
            "---\napiVersion: blazar.dev/v1alpha1\nkind: Model\n"
            f"metadata: {{name: {name}}}\n"
            f"spec: {{source: {{path: {json.dumps(str(daemon.home / f'{name}.gguf'))}}}}}\n"
            for name in ("absent-a", "absent-b")
        )
    )
    assert daemon.cli("apply", "-f", str(manifest)).returncode == 0

    def events(target: str) -> list[dict[str, str]]:
        out = daemon.cli("events", "--for", target, "-o", "json")
        assert out.returncode == 0, out.stderr
        found: list[dict[str, str]] = json.loads(out.stdout)
        return found

    wait_for(lambda: events("model/absent-b"), timeout=30, what="absent-b's event")
    only_a = wait_for(lambda: events("models/absent-a"), timeout=30, what="absent-a's event")
    assert {(e["kind"], e["name"]) for e in only_a} == {("Model", "absent-a")}
    assert any(e["reason"] == "FileNotFound" for e in only_a)
    assert {e["name"] for e in events("model/absent-b")} == {"absent-b"}

    wrong = daemon.cli("events", "--for", "absent-a")
    assert wrong.returncode == 1 and "KIND/NAME" in wrong.stderr
    both = daemon.cli("events", "model", "--for", "model/absent-a")
    assert both.returncode == 1 and "not both" in both.stderr
    daemon.cli("delete", "-f", str(manifest))
