"""Residency under a memory budget end to end (issue 20, acceptance 3), and Ollama's
keep_alive with the official client.

One daemon with `--memory-budget` at 1.5 times the ledger's own estimate of one Lane,
so it holds one of the two Lanes of the bundled model, and a small `--min-residency`:
alternating requests to both are all served (each wakes its Lane by putting the other
to sleep), a Lane with a request in flight is never stopped (the other Lane's request
waits for it to end), and no Lane is put to sleep sooner than the minimum residency
after it started (the events' timestamps). Then keep_alive 0 sleeps the Lane after the
request, the unload idiom answers `done_reason: "unload"`, and a positive keep_alive
keeps a Lane awake past its idle.sleepAfter.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from blazar.api.kinds import LaneSpec
from blazar.api.replicas import LaunchSpec
from blazar.controller import fit, modelfile
from tests.integration.harness import Daemon, pid_alive, short_home, wait_for

pytestmark = pytest.mark.slow

LANES = ("left", "right")
LANE_SPEC = {"model": "local", "slots": 1, "contextPerSlot": 512, "threads": 2}
MIN_RESIDENCY_S = 2.0
# The held request's length: long enough that the other Lane's request waits behind it.
HELD_TOKENS = 96
# A policy whose requests wait no longer than this for a slot (or a swap).
BRIEF_WAIT_MS = 300


def estimate(model_path: Path) -> int:
    """The fit ledger's estimate of one replica of either Lane."""
    info = modelfile.read_gguf(model_path)
    shape = fit.ModelShape.of_parameters(info.parameters, size_bytes=model_path.stat().st_size)
    assert shape is not None
    spec = LaneSpec.model_validate(LANE_SPEC)
    launch = LaunchSpec.of_lane(spec, model_path=str(model_path), default_threads=2)
    return fit.estimate(launch, shape).total


def fleet_text(model_path: Path, *, right_idle: str = "") -> str:
    docs = [
        {"apiVersion": "blazar.dev/v1alpha1", "kind": "Model", "metadata": {"name": "local"},
         "spec": {"source": {"path": str(model_path)}}},
    ]  # fmt: skip
    docs.append(
        {"apiVersion": "blazar.dev/v1alpha1", "kind": "SLOPolicy", "metadata": {"name": "brief"},
         "spec": {"maxQueueWaitMs": BRIEF_WAIT_MS, "onOverload": "queue"}}
    )  # fmt: skip
    for lane in LANES:
        spec: dict[str, Any] = dict(LANE_SPEC)
        if lane == "right" and right_idle:
            spec["idle"] = {"sleepAfter": right_idle}
        docs.append(
            {"apiVersion": "blazar.dev/v1alpha1", "kind": "Lane", "metadata": {"name": lane},
             "spec": spec}
        )  # fmt: skip
    return "\n---\n".join(json.dumps(doc) for doc in docs) + "\n"


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    home = short_home()
    fleet = home / "fleet"
    fleet.mkdir()
    (fleet / "fleet.yaml").write_text(fleet_text(model_path))
    budget = estimate(model_path) * 3 // 2
    d = Daemon(
        home=home,
        watch=fleet,
        serve_args=["--memory-budget", str(budget), "--min-residency", f"{MIN_RESIDENCY_S:g}s"],
    ).start()
    try:
        wait_for(lambda: resident(d), timeout=240, what="one Lane serving", step=0.2)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def resident(d: Daemon) -> list[str]:
    """The Lanes with a serving replica."""
    out = []
    for lane in LANES:
        cond = d.condition("lane", lane, "Available")
        if cond is not None and cond["status"] == "True":
            out.append(lane)
    return out


def openai_client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{d.http}/v1", api_key="unused", max_retries=0)


def complete(d: Daemon, lane: str) -> Any:
    return openai_client(d).completions.create(
        model=lane, prompt="Once upon", max_tokens=2, timeout=120
    )


def lane_events(d: Daemon, lane: str) -> list[dict[str, Any]]:
    out = d.cli("events", "--for", f"lane/{lane}", "-o", "json")
    assert out.returncode == 0, out.stderr
    events: list[dict[str, Any]] = json.loads(out.stdout)
    return events


def at(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["time"])


def test_a_lane_in_flight_is_never_stopped_and_the_other_waits_for_it(
    daemon: Daemon, no_eog: dict[int, float]
) -> None:
    (held,) = resident(daemon)
    other = next(lane for lane in LANES if lane != held)
    pids = daemon.pids(held)
    stream = openai_client(daemon).completions.create(
        model=held,
        prompt="Once upon",
        max_tokens=HELD_TOKENS,
        logit_bias={str(t): b for t, b in no_eog.items()},
        stream=True,
        stream_options={"include_usage": True},
        timeout=120,
    )
    chunks = iter(stream)
    next(chunks)  # generating now
    answers: dict[str, Any] = {}

    def other_request() -> None:
        answers["sent"] = time.monotonic()
        answers["other"] = complete(daemon, other)
        answers["at"] = time.monotonic()

    # A request that may wait only briefly is refused once its bound passes (no Lane
    # can be put to sleep for it while the held one runs), as admission refuses any.
    with pytest.raises(openai.RateLimitError) as brief:
        openai_client(daemon).completions.create(
            model=other, prompt="Once upon", max_tokens=2, timeout=120,
            extra_headers={"x-blazar-slo": "brief"},
        )  # fmt: skip
    assert brief.value.code == "queue_timeout"
    waiter = threading.Thread(target=other_request)
    waiter.start()
    finish, usage = None, None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
        # While the held request runs, its engine runs and the other Lane has none.
        assert all(pid_alive(pid) for pid in pids)
    held_ended = time.monotonic()
    waiter.join(timeout=120)
    # The held request ran to its end: its Lane was not stopped under it.
    assert finish == "length" and usage is not None
    assert usage.completion_tokens == HELD_TOKENS
    # The other request came while the held one ran, waited for it, and was served
    # after (not refused).
    assert answers["sent"] < held_ended
    served = answers["other"]
    assert served.usage.completion_tokens >= 1
    assert answers["at"] > held_ended
    assert served.model_extra["timings"]["load_ms"] > 0
    print(
        f"held {HELD_TOKENS} tokens; the other waited {served.model_extra['timings']['load_ms']:.0f} ms"
    )
    assert resident(daemon) == [other]
    assert not any(pid_alive(pid) for pid in pids)
    evicted = [e for e in lane_events(daemon, held) if e["reason"] == "Evicted"]
    assert evicted and f'"{other}"' in evicted[-1]["message"]


def test_alternating_requests_are_all_served_and_swaps_respect_the_minimum_residency(
    daemon: Daemon,
) -> None:
    (first,) = resident(daemon)
    second = next(lane for lane in LANES if lane != first)
    waits = []
    for lane in (second, first, second, first):
        answer = complete(daemon, lane)
        assert answer.usage is not None and answer.usage.completion_tokens >= 1
        # Each request woke its Lane (the other held the budget).
        assert answer.model_extra is not None and answer.model_extra["timings"]["load_ms"] > 0
        waits.append(round(answer.model_extra["timings"]["load_ms"]))
    print(f"waits for the swap (ms): {waits}")
    swaps = 0
    for lane in LANES:
        started: datetime | None = None
        for event in lane_events(daemon, lane):
            if event["reason"] == "ReplicaStarting":
                started = at(event)
            elif event["reason"] == "Evicted":
                swaps += 1
                assert started is not None
                resident_s = (at(event) - started).total_seconds()
                assert resident_s >= MIN_RESIDENCY_S - 0.05, (lane, resident_s)
    assert swaps >= 5  # the held test's one and these four
    assert len(resident(daemon)) == 1


def test_ollama_keep_alive_0_and_the_unload_idiom_sleep_the_lane(daemon: Daemon) -> None:
    client = ollama.Client(host=f"http://{daemon.http}")
    (lane,) = resident(daemon)
    pids = daemon.pids(lane)
    answer = client.generate(model=lane, prompt="Once upon", options={"num_predict": 2},
                             keep_alive=0)  # fmt: skip
    assert answer.done
    wait_for(
        lambda: not any(pid_alive(p) for p in pids), timeout=15, what="keep_alive 0 to stop it"
    )
    available = daemon.condition("lane", lane, "Available")
    assert available is not None and available["reason"] == "Sleeping"
    assert "keep_alive" in available["message"]
    # The next request wakes it; then Ollama's unload idiom sleeps it again.
    woken = client.generate(model=lane, prompt="Once upon", options={"num_predict": 2})
    assert (woken.load_duration or 0) > 0
    pids = daemon.pids(lane)
    unloaded = client.generate(model=lane, keep_alive=0)
    assert (unloaded.done, unloaded.done_reason, unloaded.response) == (True, "unload", "")
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=15, what="the unload to stop it")


def test_ollama_keep_alive_keeps_a_lane_awake_past_its_sleep_after(
    daemon: Daemon, model_path: Path
) -> None:
    assert daemon.watch is not None
    (daemon.watch / "fleet.yaml").write_text(fleet_text(model_path, right_idle="1s"))
    wait_for(
        lambda: daemon.get("lane", "right")["spec"].get("idle"),
        timeout=15,
        what="idle.sleepAfter applied",
    )
    client = ollama.Client(host=f"http://{daemon.http}")
    # Past sleepAfter (1 s) by more than the assertion's half-second slack: a keep_alive
    # ignored shows as a sleep at about 1 s, short of keep_s - 0.5.
    keep_s = 2.5
    client.generate(model="right", prompt="Once upon", options={"num_predict": 2},
                    keep_alive=f"{keep_s:g}s")  # fmt: skip
    ended = time.monotonic()
    pids = daemon.pids("right")
    assert pids and all(pid_alive(p) for p in pids)
    wait_for(
        lambda: not any(pid_alive(p) for p in pids), timeout=keep_s + 10, what="sleep", step=0.1
    )
    slept = time.monotonic() - ended
    # Not after idle.sleepAfter (1 s) but after the request's keep_alive.
    assert slept >= keep_s - 0.5, slept
    print(f"right slept {slept:.1f} s after a request with keep_alive {keep_s:g}s")
