"""The public gRPC API from another language: `examples/node-client` (Node.js with
@grpc/grpc-js, loading `proto/` at run time) against a real daemon serving the bundled
model. It lists the models, streams a chat and makes one forced tool call.

Node.js and npm are required, not optional: without them this test fails, saying so.
The example's dependencies are installed once with `npm ci` into its own node_modules
(ignored by git), from its committed package-lock.json, and not again while the lock
is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from typing import Any

import jsonschema
import pytest

from tests.integration.harness import REPO, TOOLS_LANE, Daemon

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "node-client"
LANE = TOOLS_LANE
# Written into node_modules after a successful `npm ci`: the lock it installed.
STAMP = ".blazar-installed-lock-sha256"


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"`{name}` is not on PATH: the Node.js client example (examples/node-client) "
            "needs Node.js 18 or later and npm. Install them (Debian/Ubuntu: "
            "`apt-get install nodejs npm`) and run the tests again.",
            pytrace=False,
        )
    return found


@pytest.fixture(scope="module")
def node_client() -> str:
    """The path of `node`, once the example's dependencies match its lock file."""
    node = _tool("node")
    npm = _tool("npm")
    lock = hashlib.sha256((EXAMPLE / "package-lock.json").read_bytes()).hexdigest()
    stamp = EXAMPLE / "node_modules" / STAMP
    if not (stamp.exists() and stamp.read_text().strip() == lock):
        # `npm ci` installs exactly the lock (removing node_modules first) or fails when
        # package.json and the lock disagree. No install scripts: none is needed.
        done = subprocess.run(
            [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
            cwd=EXAMPLE,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
        stamp.write_text(lock + "\n")
    return node


@pytest.fixture(scope="module")
def daemon(tools_daemon: Daemon) -> Daemon:
    return tools_daemon


def run_example(
    node_client: str, daemon: Daemon, *, model: str | None = None
) -> tuple[subprocess.CompletedProcess[str], str]:
    """chat.js against the daemon (on `model`, else the first ready one, with no API
    key), and a report of what it wrote for a failing assertion."""
    env = {**os.environ, "BLAZAR_GRPC_ADDR": daemon.grpc}
    env.pop("BLAZAR_MODEL", None)
    env.pop("BLAZAR_API_KEY", None)
    if model is not None:
        env["BLAZAR_MODEL"] = model
    run = subprocess.run(
        [node_client, "chat.js"], cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=240
    )
    return run, f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"


def test_the_node_client_streams_a_chat_and_a_forced_tool_call(
    node_client: str, daemon: Daemon
) -> None:
    run, report = run_example(node_client, daemon)
    assert run.returncode == 0, report
    assert re.search(rf"^  {LANE}  \(lane {LANE}, ready\)$", run.stdout, re.M), report
    deltas = re.findall(r"^streamed (\d+) deltas, finish (\S+),", run.stdout, re.M)
    assert deltas and int(deltas[-1][0]) >= 1, report
    calls = re.findall(r"^tool call: (\S+) (.*)$", run.stdout, re.M)
    assert len(calls) == 1, report
    name, arguments = calls[0]
    tool: dict[str, Any] = json.loads((EXAMPLE / "tool.json").read_text())
    assert name == tool["name"], report
    jsonschema.validate(json.loads(arguments), tool["parameters"])


def test_the_node_client_reads_the_reason_and_its_numbers_from_the_error_details(
    node_client: str, daemon: Daemon
) -> None:
    """A refusal reaches the Node client whole: the ErrorInfo in
    `grpc-status-details-bin`, decoded in JS, gives the reason and its metadata."""
    run, report = run_example(node_client, daemon, model="no-such-model")
    assert run.returncode == 1, report
    assert (
        "error: gRPC NOT_FOUND (MODEL_NOT_FOUND; model=no-such-model): "
        "The model 'no-such-model' does not exist." in run.stderr
    ), report
