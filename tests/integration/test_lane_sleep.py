"""Scale to zero end to end (issue 20, acceptance 2): a Lane with
`idle.sleepAfter: 5s` has no engine process 6 s after its last request; the next
request is served, not refused, and its timings show the wake-up; an embedding request
wakes it too.

The acceptance's 5 s is the first test's Lane; the others use a second Lane that
naps a second after its last request, so that each does not wait out 5 s again."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from blazar._proto.v1 import control_pb2
from blazar.cli.client import ControlClient
from tests.integration.harness import Daemon, local_fleet, pid_alive, short_home, wait_for

pytestmark = pytest.mark.slow

LANE = "sleepy"
SLEEP_AFTER_S = 5
NAP = "nap"
NAP_AFTER_S = 1
LANE_SPEC = "slots: 1, contextPerSlot: 512, threads: 2"


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    home = short_home()
    fleet = local_fleet(
        home, model_path, lane=LANE, spec=f"{LANE_SPEC}, idle: {{sleepAfter: {SLEEP_AFTER_S}s}}"
    )
    with (fleet / "fleet.yaml").open("a") as f:
        f.write(
            "---\napiVersion: blazar.dev/v1alpha1\nkind: Lane\n"
            f"metadata: {{name: {NAP}}}\n"
            f"spec: {{model: local, {LANE_SPEC}, idle: {{sleepAfter: {NAP_AFTER_S}s}}}}\n"
        )
    d = Daemon(home=home, watch=fleet).start()
    try:
        for lane in (LANE, NAP):
            d.wait_condition("lane", lane, "Ready", timeout=240)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def complete(d: Daemon) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"http://{d.http}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model=LANE, prompt="Once upon", max_tokens=2, timeout=120)


def test_an_idle_lane_sleeps_and_the_next_request_wakes_it(daemon: Daemon) -> None:
    first = complete(daemon)
    ended = time.monotonic()
    assert first.usage is not None and first.usage.completion_tokens >= 1
    pids = daemon.pids(LANE)
    assert pids and all(pid_alive(pid) for pid in pids)
    # No engine process 6 s after the last request.
    wait_for(
        lambda: not any(pid_alive(pid) for pid in pids),
        timeout=SLEEP_AFTER_S + 1 - (time.monotonic() - ended),
        what="the engine to stop",
        step=0.1,
    )
    slept = time.monotonic() - ended
    assert slept >= SLEEP_AFTER_S - 0.5  # not before its time (the request's end is ours)
    status = daemon.get("lane", LANE)["status"]
    assert status.get("sleeping") is True
    assert daemon.condition("lane", LANE, "Available")["reason"] == "Sleeping"
    # Asleep is not unready: a load balancer keeps sending (the request wakes it).
    assert httpx.get(f"http://{daemon.http}/readyz", trust_env=False).status_code == 200
    # The next request is served, and says how long it waited for the wake-up.
    woken = complete(daemon)
    assert woken.usage is not None and woken.usage.completion_tokens >= 1
    assert woken.model_extra is not None
    load_ms = woken.model_extra["timings"]["load_ms"]
    assert load_ms > 0
    assert daemon.pids(LANE) and not set(daemon.pids(LANE)) & set(pids)
    # A request to a Lane awake carries no wake-up.
    again = complete(daemon)
    assert again.model_extra is not None and "load_ms" not in again.model_extra["timings"]
    print(f"slept {slept:.1f} s after the last request; woke in {load_ms:.0f} ms")


def wakings(d: Daemon, lane: str) -> int:
    with ControlClient(d.control) as control:
        listed = control.events(control_pb2.EventsRequest(kind="Lane", name=lane))
    return sum(e.reason == "Waking" for e in listed.events)


def asleep(d: Daemon, lane: str) -> bool:
    return d.get("lane", lane)["status"].get("sleeping") is True and not d.pids(lane)


def test_an_embedding_request_wakes_a_sleeping_lane(daemon: Daemon) -> None:
    wait_for(lambda: asleep(daemon, NAP), timeout=NAP_AFTER_S + 10, what="the nap")
    woken_before = wakings(daemon, NAP)
    client = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused", max_retries=0)
    embedded = client.embeddings.create(model=NAP, input="wake up", timeout=120)
    assert len(embedded.data[0].embedding) > 0
    assert wakings(daemon, NAP) == woken_before + 1


def test_a_sleeping_lane_scaled_to_zero_refuses_at_once(daemon: Daemon) -> None:
    """Asleep, then scaled to `replicas: 0` in the watched directory: the Lane says
    ScaledToZero (not Sleeping), a request is refused at once with the scaled-to-zero
    error (it waited for a wake that never came, then failed), and no Waking event is
    written. Last in the module: it leaves the Lane at zero replicas."""

    daemon.wait_condition("lane", NAP, "Available", "False", timeout=NAP_AFTER_S + 30)
    available = daemon.condition("lane", NAP, "Available")
    assert available is not None and available["reason"] == "Sleeping"
    woken_before = wakings(daemon, NAP)
    assert daemon.watch is not None
    fleet = daemon.watch / "fleet.yaml"
    nap = f"metadata: {{name: {NAP}}}\nspec: {{model: local, "
    fleet.write_text(fleet.read_text().replace(nap, nap + "replicas: 0, "))
    wait_for(
        lambda: (daemon.condition("lane", NAP, "Available") or {}).get("reason") == "ScaledToZero",
        timeout=30,
        what="the Lane to say ScaledToZero",
        step=0.2,
    )
    assert daemon.get("lane", NAP)["status"].get("sleeping") is not True
    started = time.monotonic()
    answer = httpx.post(
        f"http://{daemon.http}/v1/completions",
        json={"model": NAP, "prompt": "Once upon", "max_tokens": 2},
        timeout=60,
        trust_env=False,
    )
    took = time.monotonic() - started
    assert answer.status_code == 503, answer.text
    assert "scaled to zero" in answer.json()["error"]["message"]
    assert took < 2.0, took
    assert wakings(daemon, NAP) == woken_before
