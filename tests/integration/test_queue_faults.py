"""Faults keep the queue (issue 17, acceptance 4): 16 concurrent streams on a Lane of
one replica with 4 slots, its engine `kill -9`'d while 4 generate and 12 wait in the
data plane's admission queue. The 4 that had started end with a retryable error; every
one of the 12 is served in full by the restarted engine, and none gets a 503."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import Daemon, local_fleet, short_home, wait_for

pytestmark = pytest.mark.slow

LANE = "solo"
SLOTS = 4
STREAMS = 16
# Long enough that no started stream can finish before the kill (which follows the 4th
# first token at once), short enough that the 12 left finish in seconds after it.
MAX_TOKENS = 48
# A second Lane of the same daemon, whose replica has never crashed: the restart test's
# (its first crash restarts at once), without a daemon of its own.
FRESH = "fresh"


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    home = short_home()
    fleet = local_fleet(home, model_path, lane=LANE, spec=f"slots: {SLOTS}, contextPerSlot: 512")
    with (fleet / "fleet.yaml").open("a") as f:
        f.write(
            "---\napiVersion: blazar.dev/v1alpha1\nkind: Lane\n"
            f"metadata: {{name: {FRESH}}}\n"
            "spec: {model: local, slots: 2, contextPerSlot: 512}\n"
        )
    d = Daemon(home=home, watch=fleet).start()
    try:
        for lane in (LANE, FRESH):
            d.wait_condition("lane", lane, "Ready", timeout=240)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


@dataclass
class Stream:
    """What one client saw: when its response began, its status, and how it ended."""

    index: int
    status: int | None = None
    began: float | None = None
    tokens: int = 0
    finish: str | None = None
    errors: list[str] = field(default_factory=list)


async def stream(http: httpx.AsyncClient, s: Stream, body: dict[str, object]) -> None:
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        # The shim sends its headers with the first chunk: the request has started.
        s.status, s.began = reply.status_code, time.monotonic()
        if reply.status_code != 200:
            s.errors.append((await reply.aread()).decode(errors="replace"))
            return
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                s.errors.append(event["error"]["message"])
                continue
            for choice in event["choices"]:
                s.finish = choice.get("finish_reason") or s.finish
            if event.get("usage"):
                s.tokens = event["usage"]["completion_tokens"]


def test_requests_not_started_survive_a_killed_engine(daemon: Daemon) -> None:
    (old_pid,) = daemon.pids(LANE)
    body: dict[str, object] = {
        "model": LANE,
        "messages": [{"role": "user", "content": "Count to a hundred."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Every stream runs to max_tokens: none ends early and frees a slot.
        "ignore_eos": True,
    }
    streams = [Stream(i) for i in range(STREAMS)]

    async def run() -> float:
        limits = httpx.Limits(max_connections=STREAMS)
        async with httpx.AsyncClient(
            base_url=f"http://{daemon.http}", timeout=300, trust_env=False, limits=limits
        ) as http:
            tasks = [asyncio.create_task(stream(http, s, body)) for s in streams]
            deadline = time.monotonic() + 120
            while sum(s.began is not None for s in streams) < SLOTS:
                assert time.monotonic() < deadline, [s.errors for s in streams]
                assert not any(t.done() for t in tasks), [s.errors for s in streams]
                await asyncio.sleep(0.005)
            os.kill(old_pid, signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
            return killed

    killed = asyncio.run(run())
    started = [s for s in streams if s.began is not None and s.began <= killed]
    waiting = [s for s in streams if s not in started]
    # The slots were full and nothing could finish: exactly 4 had started, 12 waited.
    assert len(started) == SLOTS and len(waiting) == STREAMS - SLOTS, streams
    # None gets a 503, or any refusal: every response began with 200.
    assert all(s.status == 200 for s in streams), streams
    # Only generations under way end with an error, one that says to retry.
    for s in started:
        assert s.finish is None and s.errors, s
        assert "retry" in s.errors[-1], s
    # Every request that had not started is served in full after the restart.
    for s in waiting:
        assert not s.errors, s
        assert (s.finish, s.tokens) == ("length", MAX_TOKENS), s

    def restarted() -> list[int] | None:
        pids = daemon.pids(LANE)
        return pids if pids and old_pid not in pids else None

    assert wait_for(restarted, timeout=30, what="the restarted replica")


def test_new_requests_during_a_restart_wait_for_it(daemon: Daemon) -> None:
    """Requests that arrive in the second after a `kill -9`, while the replica is being
    restarted, are served by the restart: a first crash restarts at once and requests
    wait for a Starting replica. Before, 37 of 40 such requests got 503 "retry shortly"
    during the 1 s crash back-off."""
    d = daemon
    (pid,) = d.pids(FRESH)
    (replica,) = d.get("lane", FRESH)["status"]["replicaStatuses"]
    assert replica["restarts"] == 0  # its first crash follows
    body = {"model": FRESH, "prompt": "Once upon", "max_tokens": 2, "temperature": 0}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=f"http://{d.http}", timeout=120, trust_env=False
        ) as http:
            os.kill(pid, signal.SIGKILL)
            sent = []
            for _ in range(10):
                sent.append(asyncio.create_task(http.post("/v1/completions", json=body)))
                await asyncio.sleep(0.05)
            return list(await asyncio.gather(*sent))

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers]
    (replica,) = d.get("lane", FRESH)["status"]["replicaStatuses"]
    assert replica["pid"] != pid and replica["restarts"] == 1
