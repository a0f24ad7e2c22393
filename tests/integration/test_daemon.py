"""End to end through a real daemon: manifests -> controller -> engine processes ->
gRPC -> OpenAI shim, driven by the real CLI and the official `openai` client."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from blazar._proto.v1 import control_pb2
from blazar.controller import fit
from blazar.enginehost import supervisor
from tests.integration import pinning
from tests.integration.harness import (
    Daemon,
    default_fleet,
    local_fleet,
    pid_alive,
    short_home,
    wait_for,
)
from tests.integration.observers import Follower, StoreWatch, rss_bytes

pytestmark = pytest.mark.slow

# Output no budget finishes: a thousand strings of a thousand characters (the schema
# converter spells out at most 1,000 of anything, so the length alone cannot do it).
ENDLESS = {"type": "array", "minItems": 1000, "items": {"type": "string", "minLength": 1000}}


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    """The default fleet (manifests/), watched, on free ports, with its own home."""
    with default_fleet() as d:
        yield d


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{d.http}/v1", api_key="unused", max_retries=0)


def bias(tokens: dict[int, float]) -> dict[str, int]:
    """A logit bias as the OpenAI client sends it."""
    return {str(t): int(b) for t, b in tokens.items()}


def test_models_lists_the_default_lane(daemon: Daemon) -> None:
    ids = [m.id for m in client(daemon).models.list().data]
    assert "gemma3" in ids
    assert "gemma3-270m" in ids  # an alias


def test_openai_client_streams_a_chat_completion(daemon: Daemon, model_path: Path) -> None:
    # Pinned on every CPU: no end-of-generation, and printable ASCII (a grammar, as
    # llama.cpp's server takes it), so 40 tokens stream, each with text of its own.
    stream = client(daemon).chat.completions.create(
        model="gemma3",
        messages=[{"role": "user", "content": "Write a short poem about the sea."}],
        max_tokens=40,
        temperature=0,
        logit_bias=bias(pinning.no_end_of_generation(model_path)),
        extra_body={"grammar": "root ::= [ -~\\n]+"},
        stream=True,
    )
    contents, finishes = [], []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                contents.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert len(contents) >= 8, contents
    assert finishes == ["length"]


def test_responses_carry_llama_cpp_timings(daemon: Daemon, model_path: Path) -> None:
    """llama.cpp server's `timings`, with the default lane's n-gram speculation counts.
    The completion is forced to copy digits from the prompt, one token each (see
    tests/integration/test_engine_speculation.py), so prompt lookup drafts, and its
    drafts are accepted, on every CPU."""
    digits = pinning.digit_string(64, seed=15)
    response = client(daemon).completions.create(
        model="gemma3",
        prompt=f"Digits: {digits}\nThe same digits again: ",
        max_tokens=32,
        temperature=0,
        logit_bias=bias(pinning.sole_spelling_bias(model_path, "0123456789")),
        extra_body={"grammar": pinning.exactly(digits)},
    )
    assert response.choices[0].text == digits[:32]
    assert response.usage is not None and response.model_extra is not None
    timings = response.model_extra["timings"]
    assert timings["predicted_n"] == response.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == response.usage.prompt_tokens
    assert timings["prompt_ms"] > 0 and timings["predicted_per_second"] > 0
    assert 0 < timings["draft_n_accepted"] <= timings["draft_n"]


def test_engine_health_is_on_metrics(daemon: Daemon) -> None:
    """Slots, cached tokens, KV size and memory of each ready replica, polled."""
    client(daemon).completions.create(model="gemma3", prompt="Once upon", max_tokens=4)
    labels = 'lane="gemma3",replica="0"'

    def cached_tokens() -> float | None:
        for line in httpx.get(f"http://{daemon.http}/metrics", trust_env=False).text.splitlines():
            if line.startswith(f"blazar_engine_cached_tokens{{{labels}}}"):
                return float(line.split()[-1]) or None
        return None

    wait_for(cached_tokens, timeout=20.0, what="engine health on /metrics")
    text = httpx.get(f"http://{daemon.http}/metrics", trust_env=False).text
    assert f'blazar_engine_slots{{{labels},state="free"}}' in text
    assert f"blazar_engine_kv_bytes{{{labels}}}" in text
    assert f"blazar_engine_memory_bytes{{{labels}}}" in text


def test_unknown_model_and_malformed_json_do_not_disturb_others(
    daemon: Daemon, model_path: Path
) -> None:
    result: dict[str, object] = {}
    no_eog = bias(pinning.no_end_of_generation(model_path))

    def good_stream() -> None:
        stream = client(daemon).completions.create(
            model="gemma3",
            prompt="Once upon a time",
            max_tokens=24,
            temperature=0,
            logit_bias=no_eog,  # it runs to its 24 tokens
            stream=True,
        )
        result["text"] = "".join(c.choices[0].text for c in stream if c.choices)

    worker = threading.Thread(target=good_stream)
    worker.start()
    with pytest.raises(openai.NotFoundError) as missing:
        client(daemon).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.status_code == 404
    body = missing.value.body
    assert isinstance(body, dict) and body.get("code") == "model_not_found"
    bad = httpx.post(
        f"http://{daemon.http}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400
    assert "error" in bad.json()
    worker.join(timeout=60)
    assert isinstance(result.get("text"), str) and result["text"]


def replicas_of(daemon: Daemon, lane: str) -> list[tuple[int, int]]:
    """Each replica's engine pid and restart count: a request that crashed an engine
    changes one or the other."""
    statuses = daemon.get("lane", lane)["status"]["replicaStatuses"]
    return [(int(r["pid"]), int(r.get("restarts", 0))) for r in statuses]


def test_a_session_key_over_256_bytes_is_400_and_the_daemon_serves_on(daemon: Daemon) -> None:
    """Session keys are bounded (issue 19): 257 bytes in the `x-blazar-session` header
    is a 400 in OpenAI's envelope. OpenAI's `user` sets no such bound, so 2 MiB of it
    is served, keyed by its digest (`blazar.api.sessions`), never held whole."""
    before = replicas_of(daemon, "gemma3")
    body = {"model": "gemma3", "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=f"http://{daemon.http}", timeout=60) as http:
        refused = http.post("/v1/completions", json=body, headers={"x-blazar-session": "s" * 257})
        assert refused.status_code == 400, refused.text[:2000]
        assert len(refused.content) < 20_000, len(refused.content)
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error", error
        assert "at most 256" in error["message"], error
        for extra, headers in [
            ({"user": "u" * (2 << 20)}, {}),
            ({}, {"x-blazar-session": "s" * 256}),
        ]:
            served = http.post("/v1/completions", json={**body, **extra}, headers=headers)
            assert served.status_code == 200, served.text[:2000]
    assert replicas_of(daemon, "gemma3") == before


def test_a_grammar_nested_60000_deep_is_400_and_no_engine_restarts(daemon: Daemon) -> None:
    """A GBNF grammar of 60,000 nested groups (120 KB) used to send llama.cpp's
    parser into a recursion that killed the engine (issue 19); over HTTP it is a 400,
    and the Lane's engine keeps its pid and restart count."""
    before = replicas_of(daemon, "gemma3")
    grammar = "root ::= " + "(" * 60_000 + '"a"' + ")" * 60_000
    body = {"model": "gemma3", "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=f"http://{daemon.http}", timeout=60) as http:
        refused = http.post("/v1/completions", json={**body, "grammar": grammar})
        assert refused.status_code == 400, refused.text[:2000]
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert "grammar" in error["message"].lower(), error
        assert len(refused.content) < 20_000, len(refused.content)
        served = http.post("/v1/completions", json=body)
        assert served.status_code == 200, served.text
    assert replicas_of(daemon, "gemma3") == before


def policy_yaml(name: str, priority: int) -> str:
    return (
        "apiVersion: blazar.dev/v1alpha1\nkind: SLOPolicy\n"
        f"metadata: {{name: {name}}}\nspec: {{priority: {priority}}}\n"
    )


def test_watched_directory_owns_and_prunes_what_it_applied(daemon: Daemon, tmp_path: Path) -> None:
    """Issue 20, acceptance 4: creating, editing and deleting a file each reach the
    store within 1 s; the delete prunes only that file's objects (not another file's,
    not one applied by hand); a broken file changes nothing and says where it is."""
    assert daemon.watch is not None
    extra, other = daemon.watch / "extra.yaml", daemon.watch / "other.yaml"
    hand = tmp_path / "hand.yaml"
    hand.write_text(policy_yaml("by-hand", 3))
    assert daemon.cli("apply", "-f", str(hand)).returncode == 0
    other.write_text(policy_yaml("other", 4))
    watch = StoreWatch(daemon, "SLOPolicy")
    stub = watch.stub

    def policies() -> dict[str, dict[str, Any]]:
        listed = stub.List(control_pb2.ListRequest(kind="SLOPolicy"), timeout=30)
        objs = [json.loads(o) for o in listed.objects_json]
        return {o["metadata"]["name"]: o for o in objs}

    def events(kind: str = "", name: str = "") -> list[control_pb2.Event]:
        request = control_pb2.EventsRequest(kind=kind, name=name)
        return list(stub.Events(request, timeout=30).events)

    figures: dict[str, float] = {}
    try:
        wait_for(lambda: watch.after(0, "ADDED", "other"), timeout=10, what="other.yaml")

        def converge(step: str, event: str, name: str, change: Callable[[], None],
                     generation: int = 0) -> None:  # fmt: skip
            start = time.monotonic()
            change()
            figures[step] = wait_for(
                lambda: watch.after(start, event, name, generation),
                timeout=10,
                what=f"{step} of {name}",
                step=0.01,
            )

        converge("create", "ADDED", "extra", lambda: extra.write_text(policy_yaml("extra", 7)))
        got = policies()["extra"]
        assert got["metadata"]["annotations"] == {"blazar.dev/source": "extra.yaml"}
        assert policies()["by-hand"]["metadata"]["annotations"] == {}
        converge("edit", "MODIFIED", "extra",
                 lambda: extra.write_text(policy_yaml("extra", 9)), generation=2)  # fmt: skip
        assert policies()["extra"]["spec"]["priority"] == 9

        # A broken file: nothing is applied or pruned, and an event names file and field.
        def written() -> dict[str, tuple[Any, ...]]:
            return {
                name: (o["metadata"]["generation"], o["metadata"].get("annotations"), o["spec"])
                for name, o in policies().items()
            }  # fmt: skip

        before = written()
        other.write_text(policy_yaml("other", 5).replace("priority: 5", "priority: 5, colour: 1"))
        extra.unlink()  # would be pruned, were the batch accepted
        wait_for(
            lambda: any(
                "SLOPolicy/other (other.yaml#1): spec.colour" in e.message
                for e in events("Manifest")
            ),
            timeout=10,
            what="the rejection event",
        )
        assert written() == before

        # Fixed: the batch goes through, and the deleted file's objects go, only them.
        converge("delete", "DELETED", "extra", lambda: other.write_text(policy_yaml("other", 4)))
        assert {"other", "by-hand"} <= set(policies()) and "extra" not in policies()
        assert [e.reason for e in events("SLOPolicy", "extra")][-1:] == ["Pruned"]
        assert stub.Get(control_pb2.GetRequest(kind="Lane", name="gemma3"), timeout=30)
    finally:
        for path in (extra, other):
            path.unlink(missing_ok=True)
        for name in ("extra", "other", "by-hand"):
            with contextlib.suppress(grpc.RpcError):  # pruned already
                stub.Delete(control_pb2.DeleteRequest(kind="SLOPolicy", name=name), timeout=30)
        watch.close()
    print(f"\nwatched directory, file change to store: {figures}")
    assert all(seconds < 1.0 for seconds in figures.values()), figures


def test_logs_print_follow_and_rotate_an_engines_output(daemon: Daemon) -> None:
    """`blazar logs lane/NAME` reads the replica's captured output over Control; -f
    follows it, through a rotation too; the file stays under its cap (owner only)."""
    log = daemon.home / "logs" / "gemma3-0.log"
    printed = daemon.cli("logs", "lane/gemma3")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout and log.read_text(errors="replace").startswith(printed.stdout)

    follower = Follower(daemon, "logs", "lanes/gemma3", "--replica", "0", "-f")
    marker = f"marker {time.monotonic()}\n".encode()
    with log.open("ab") as f:  # what the engine would write next
        f.write(marker)
    wait_for(lambda: marker in follower.out, timeout=10, what="the followed line")
    # Past the cap, the file is copied to .1 and cut; -f goes on from its new start.
    with log.open("ab") as f:
        f.write(b"x" * (10 * 1024 * 1024) + b"\n")
    wait_for(lambda: log.stat().st_size < 1024 * 1024, timeout=10, what="the rotation")
    rotated = log.with_name(log.name + ".1")
    assert rotated.stat().st_size > 10 * 1024 * 1024
    assert {p.stat().st_mode & 0o777 for p in (log, rotated)} == {0o600}
    after = f"after rotation {time.monotonic()}\n".encode()
    with log.open("ab") as f:
        f.write(after)
    wait_for(lambda: after in follower.out, timeout=20, what="the line after the rotation")
    assert follower.interrupt() == (130, b"")

    missing = daemon.cli("logs", "lane/gemma3", "--replica", "7")
    assert missing.returncode == 1 and "no log of replica 7" in missing.stderr
    assert daemon.cli("logs", "lane/no-such-lane").returncode == 1
    assert "Lanes' engines" in daemon.cli("logs", "model/gemma3-270m").stderr


def test_top_shows_slots_queue_throughput_and_memory(daemon: Daemon, model_path: Path) -> None:
    """`blazar top`: slots and memory from the engines' Health (polled every 5 s),
    queue and tokens per second from the data plane, for the default Lane."""
    no_eog = bias(pinning.no_end_of_generation(model_path))
    for _ in range(2):  # 16 tokens each, pinned: no end of generation
        done = client(daemon).completions.create(
            model="gemma3", prompt="Count:", max_tokens=16, temperature=0, logit_bias=no_eog
        )
        assert done.usage is not None and done.usage.completion_tokens == 16

    def row() -> dict[str, Any] | None:
        out = daemon.cli("top", "-o", "json")
        assert out.returncode == 0, out.stderr
        rows = {r["lane"]: r for r in json.loads(out.stdout)}
        return rows["gemma3"] if rows["gemma3"]["replicasReporting"] else None

    top = wait_for(row, timeout=15, what="the engines' Health round")
    assert top["slotsTotal"] == 6 and 0 <= top["slotsBusy"] <= 6  # manifests/: 1 x 6
    assert (top["queued"], top["running"]) == (0, 0)
    # At least the last request's 16 tokens, within the 10 s window (more if others
    # finished in it too).
    assert top["tokensPerSecond"] >= 16 / 10
    (pid,) = daemon.pids("gemma3")
    assert 0.5 < top["memoryBytes"] / rss_bytes(pid) < 2.0
    table = daemon.cli("top").stdout.splitlines()
    assert table[0].split()[:3] == ["LANE", "REPLICAS", "SLOTS"]
    (line,) = [line.split() for line in table if line.startswith("gemma3 ")]
    # The next Health round may have come (or timed out) since: its figures, or dashes.
    assert len(line) == 7 and line[2] in {*(f"{n}/6" for n in range(7)), "-"}, table


def test_second_lane_apply_get_delete(daemon: Daemon, tmp_path: Path) -> None:
    manifest = tmp_path / "second.yaml"
    manifest.write_text(
        textwrap.dedent(
            """
            apiVersion: blazar.dev/v1alpha1
            kind: Lane
            metadata: {name: second}
            spec: {model: gemma3-270m, replicas: 2, slots: 1, contextPerSlot: 512}
            """
        )
    )
    applied = daemon.cli("apply", "-f", str(manifest))
    assert applied.returncode == 0, applied.stderr
    assert "lane/second created" in applied.stdout
    daemon.wait_condition("lane", "second", "Ready", timeout=180)
    table = daemon.cli("get", "lanes")
    row = next(line for line in table.stdout.splitlines() if line.startswith("second "))
    assert "2/2" in row and "Ready" in row
    pids = daemon.pids("second")
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)

    deleted = daemon.cli("delete", "lane", "second")
    assert deleted.returncode == 0, deleted.stderr
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="replicas to exit")
    assert daemon.cli("get", "lane", "second").returncode != 0


def engines(daemon: Daemon, lane: str) -> set[int]:
    """The daemon's live engine workers for lane, by their launch document's name
    (`<lane>-<index>.launch.json`), whatever its status says."""
    assert daemon.process is not None
    pid = daemon.process.pid
    found = set()
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        launch = re.compile(rf"/{re.escape(lane)}-\d+\.launch\.json".encode())
        if pid_alive(int(child)) and any(launch.search(a) for a in argv):
            found.add(int(child))
    return found


def test_a_lane_that_does_not_fit_starts_nothing_until_its_ask_is_lowered(
    daemon: Daemon, tmp_path: Path
) -> None:
    manifest = tmp_path / "big.yaml"
    lane = (
        "apiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {{name: big}}\n"
        "spec: {{model: gemma3-270m, slots: {slots}, contextPerSlot: {context}, "
        "kvCache: {{typeK: {kv}, typeV: {kv}}}}}\n"
    )
    # Past the 32,768 tokens the bundled model was trained on: nothing starts, and why
    # is said in the Lane's ModelReady and a Warning event.
    manifest.write_text(lane.format(slots=1, context=2**20, kv="f16"))
    assert daemon.cli("apply", "-f", str(manifest)).returncode == 0
    beyond = daemon.wait_condition("lane", "big", "ModelReady", "False", timeout=60)
    assert beyond["reason"] == "ContextBeyondTraining"
    assert "contextPerSlot 1048576 is more than the 32768 tokens" in beyond["message"]
    assert engines(daemon, "big") == set()
    # Within the API's bounds and the model's training, and 77 GB of f32 KV cache for
    # the bundled model: more than this host has (the message's figures say so).
    manifest.write_text(lane.format(slots=64, context=32768, kv="f32"))
    assert daemon.cli("apply", "-f", str(manifest)).returncode == 0
    cond = daemon.wait_condition("lane", "big", "Schedulable", "False", timeout=60)
    assert cond["reason"] == "InsufficientMemory"
    status = daemon.get("lane", "big")["status"]
    need, free = status["memory"]["estimateBytes"], status["memory"]["freeBytes"]
    assert need > free
    assert need > 70 * 10**9
    assert cond["message"].startswith(f"Replica 0 needs {fit.human(need)} ({need} bytes) but ")
    assert f"but {fit.human(free)} ({free} bytes) is free" in cond["message"]
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    never = "so it can never fit as it is" in cond["message"]
    assert never == (need > total)  # more than MemTotal
    assert status.get("replicaStatuses", []) == []
    assert engines(daemon, "big") == set()  # no engine process for it
    described = daemon.cli("describe", "lane", "big").stdout
    assert "InsufficientMemory" in described.split("Events:")[1]
    assert "ContextBeyondTraining" in described.split("Events:")[1]
    assert "Per replica:" in described

    manifest.write_text(lane.format(slots=1, context=512, kv="f16"))
    assert daemon.cli("apply", "-f", str(manifest)).returncode == 0
    daemon.wait_condition("lane", "big", "Ready", timeout=180)
    cond = daemon.condition("lane", "big", "Schedulable")
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "MemoryFits")
    (pid,) = daemon.pids("big")
    assert engines(daemon, "big") == {pid}
    wide = daemon.cli("get", "lanes", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-2:] == ["MEMORY", "FREE"]
    row = next(line for line in wide if line.startswith("big "))
    assert row.split()[-2].endswith("MiB")  # one small replica: hundreds of MiB
    assert daemon.cli("delete", "lane", "big").returncode == 0
    wait_for(lambda: not pid_alive(pid), timeout=30, what="the replica to exit")


def test_a_spec_change_drops_no_request(daemon: Daemon, tmp_path: Path) -> None:
    """DESIGN §4: a rolling update starts the new replica, waits for it, then drains
    the old one. Requests sent one after another all the way through all succeed,
    also when the spec changes again in the middle of the rollout."""
    manifest = tmp_path / "rolling.yaml"
    lane = "apiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {{name: rolling}}\n"
    lane += "spec: {{model: gemma3-270m, replicas: 1, slots: {slots}, contextPerSlot: 512}}\n"
    manifest.write_text(lane.format(slots=1))
    assert daemon.cli("apply", "-f", str(manifest)).returncode == 0
    daemon.wait_condition("lane", "rolling", "Ready", timeout=180)
    before = set(daemon.pids("rolling"))
    answers: list[int] = []
    failures: list[str] = []
    done = threading.Event()

    def send() -> None:
        with httpx.Client(base_url=f"http://{daemon.http}", timeout=60, trust_env=False) as http:
            while not done.is_set():
                body = {"model": "rolling", "prompt": "Hello", "max_tokens": 2}
                reply = http.post("/v1/completions", json=body)
                if reply.status_code == 200:
                    answers.append(len(answers))
                else:
                    failures.append(f"{reply.status_code} {reply.text[:200]}")

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_for(lambda: len(answers) >= 3, timeout=60, what="requests before the update")
        manifest.write_text(lane.format(slots=2))
        assert daemon.cli("apply", "-f", str(manifest)).returncode == 0

        def surge_serving() -> bool:
            replicas = daemon.get("lane", "rolling")["status"].get("replicaStatuses", [])
            return any(r["index"] == 1 and r["state"] == "Ready" for r in replicas)

        wait_for(surge_serving, timeout=180, what="the surge replica to serve")
        manifest.write_text(lane.format(slots=3))
        assert daemon.cli("apply", "-f", str(manifest)).returncode == 0

        def rolled() -> bool:
            status = daemon.get("lane", "rolling")["status"]
            replicas = status.get("replicaStatuses", [])
            pids = {r.get("pid") for r in replicas}
            return (
                status.get("observedGeneration") == 3
                and [r["index"] for r in replicas] == [0]
                and replicas[0]["state"] == "Ready"
                and not pids & before
            )

        wait_for(rolled, timeout=180, what="the rolling update to finish")
        served = len(answers)
        wait_for(lambda: len(answers) >= served + 3, timeout=60, what="requests after it")
    finally:
        done.set()
        sender.join(timeout=90)
        daemon.cli("delete", "lane", "rolling")
    assert failures == []
    events = daemon.cli("events").stdout
    assert "Starting replica 1" in events  # the surge


def test_bad_manifest_is_rejected_whole(daemon: Daemon, tmp_path: Path) -> None:
    before = daemon.cli("get", "lanes", "-o", "json").stdout
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(
        textwrap.dedent(
            """
            apiVersion: blazar.dev/v1alpha1
            kind: Lane
            metadata: {name: broken}
            spec:
              model: no-such-model
              replicas: two
              colour: blue
            ---
            apiVersion: blazar.dev/v1alpha1
            kind: SLOPolicy
            metadata: {name: fine-but-not-applied}
            spec: {priority: 5}
            """
        )
    )
    out = daemon.cli("apply", "-f", str(manifest))
    assert out.returncode != 0
    assert "spec.colour" in out.stderr and "Extra inputs are not permitted" in out.stderr
    assert "spec.replicas" in out.stderr and "valid integer" in out.stderr
    assert "spec.model" in out.stderr and 'Model "no-such-model" not found' in out.stderr
    assert daemon.cli("get", "lanes", "-o", "json").stdout == before
    assert daemon.cli("get", "slopolicy", "fine-but-not-applied").returncode != 0
    events = daemon.cli("events").stdout
    assert "ManifestRejected" in events


def test_killed_worker_is_restarted(daemon: Daemon) -> None:
    (old_pid,) = daemon.pids("gemma3")
    os.kill(old_pid, signal.SIGKILL)
    daemon.wait_condition("lane", "gemma3", "Degraded", timeout=30)

    def back() -> list[int] | None:
        lane = daemon.get("lane", "gemma3")
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in lane["status"]["conditions"]
        )
        pids = [r["pid"] for r in lane["status"]["replicaStatuses"]]
        return pids if ready and old_pid not in pids else None

    new_pids = wait_for(back, timeout=120, what="a new ready replica", step=0.2)
    assert all(pid_alive(p) for p in new_pids)
    # The killed run's exit stays on show (describe's LAST-EXIT column).
    (replica,) = daemon.get("lane", "gemma3")["status"]["replicaStatuses"]
    assert replica["lastExitCode"] == -signal.SIGKILL
    daemon.wait_condition("lane", "gemma3", "Degraded", status="False", timeout=10)
    events = daemon.cli("events", "lane", "gemma3").stdout
    for reason in ("ReplicaCrashed", "BackOff", "ReplicaReady"):
        assert reason in events, events
    assert "killed by SIGKILL" in events, events
    # The restarted replica serves.
    reply = client(daemon).completions.create(model="gemma3", prompt="Hello", max_tokens=4)
    assert reply.choices[0].text is not None


def test_daemon_kill_leaves_no_orphans_and_restart_reconverges(model_path: Path) -> None:
    home = short_home()
    fleet = local_fleet(
        home, model_path, lane="solo", spec="replicas: 1, slots: 1, contextPerSlot: 512"
    )
    first = Daemon(home=home, watch=fleet).start()
    try:
        first.wait_condition("lane", "solo", "Ready", timeout=180)
        pids = first.pids("solo")
        assert pids
        first.stop(signal.SIGKILL)
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=15, what="orphans to die")

        second = Daemon(home=home).start()  # no --watch: nothing is re-applied
        try:
            second.wait_condition("lane", "solo", "Ready", timeout=180)
            assert not set(second.pids("solo")) & set(pids)
        finally:
            second.stop()

        # Edited while the daemon was down: the engine starts once, from the edit, not
        # first from the stored spec (or the Model's stored status) and then again.
        moved = home / "moved.gguf"
        try:
            os.link(model_path, moved)  # another path to the same weights, no copy
        except OSError:
            shutil.copyfile(model_path, moved)
        manifest = fleet / "fleet.yaml"
        edited = manifest.read_text().replace("512", "1024")
        manifest.write_text(edited.replace(json.dumps(str(model_path)), json.dumps(str(moved))))
        seen = second.log_path.stat().st_size
        third = Daemon(home=home, watch=fleet).start()
        try:
            third.wait_condition("lane", "solo", "Ready", timeout=180)
            assert third.get("lane", "solo")["spec"]["contextPerSlot"] == 1024
            (pid,) = third.pids("solo")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            launch = json.loads(Path(argv[argv.index("--launch") + 1]).read_text())
            assert launch["spec"]["model_path"] == str(moved)
            with third.log_path.open("rb") as f:
                f.seek(seen)
                events = [json.loads(line) for line in f.read().splitlines() if line[:1] == b"{"]
            # One start (a restart of it after an exit, with the same launch, is not a
            # second one: an engine start sometimes dies of SIGSEGV 2 ms after its spawn,
            # unexplained, see the seventeenth session's notes), and nothing replaced.
            starts = [e for e in events if e.get("event") == "replica.start"]
            story = third.replica_story("solo", since=seen)
            assert [e["restart"] for e in starts][:1] == [False], story
            assert not [e for e in starts[1:] if not e["restart"]], story
            assert not [e for e in events if e.get("event") == "replica.stop"], story

            # Its file deleted, the watched directory prunes the Lane, then its Model
            # (one batch), and the engine stops.
            seen = third.log_path.stat().st_size
            started = time.monotonic()
            manifest.unlink()
            wait_for(lambda: not pid_alive(pid), timeout=60, what="the pruned Lane's engine")
            print(f"\npruned Lane's engine gone {time.monotonic() - started:.2f} s after its file")
            (applied,) = [e for e in third.events("gitops.applied", since=seen) if e["changed"]]
            assert applied["changed"] == ["Lane/solo pruned", "Model/local pruned"]
            assert json.loads(third.cli("get", "lanes", "-o", "json").stdout)["items"] == []
        finally:
            third.stop()
    finally:
        first.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_a_deleted_lane_or_model_is_said_so_not_retry(
    daemon: Daemon, model_path: Path, tmp_path: Path
) -> None:
    """Deleting a Model a Lane uses is allowed (GitOps prunes in any order): `describe`
    says the Lane's Model does not exist, and the running replica, which holds the
    weights, serves on. A request waiting on a Lane that is then deleted is told that
    the model no longer exists (404, not a retryable 503). (With no replica left, what
    requests meet is tested in test_dataplane_admission, without an engine to kill.)"""
    manifest = tmp_path / "doomed.yaml"
    manifest.write_text(
        "apiVersion: blazar.dev/v1alpha1\nkind: Model\nmetadata: {name: doomed-weights}\n"
        f"spec: {{source: {{path: {json.dumps(str(model_path))}}}}}\n---\n"
        "apiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {name: doomed}\n"
        "spec: {model: doomed-weights, replicas: 1, slots: 1, contextPerSlot: 512}\n"
    )
    sdk = client(daemon)
    hi: Any = [{"role": "user", "content": "Hi"}]
    # A generation no budget finishes holds the one slot; the next request waits.
    endless: Any = {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": ENDLESS},
    }
    outcome: list[BaseException] = []

    def wait_in_queue() -> None:
        try:
            sdk.chat.completions.create(model="doomed", max_tokens=2, messages=hi)
        except openai.APIError as exc:
            outcome.append(exc)

    try:
        assert daemon.cli("apply", "-f", str(manifest)).returncode == 0
        daemon.wait_condition("lane", "doomed", "Ready", timeout=180)
        assert daemon.cli("delete", "model", "doomed-weights").returncode == 0
        daemon.wait_condition("lane", "doomed", "ModelReady", status="False", timeout=30)
        described = daemon.cli("describe", "lane", "doomed").stdout
        assert 'Model "doomed-weights" does not exist.' in described
        with sdk.chat.completions.create(
            model="doomed", max_tokens=400, messages=hi, stream=True, response_format=endless
        ) as holding:
            next(iter(holding))  # served by the running replica
            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            wait_for(
                lambda: "1 waiting" in daemon.cli("describe", "lane", "doomed").stdout,
                timeout=30,
                what="the request to queue",
            )
            assert daemon.cli("delete", "lane", "doomed").returncode == 0
            waiter.join(timeout=30)
        (refused,) = outcome
        assert isinstance(refused, openai.NotFoundError), refused
        assert refused.code == "model_not_found"
        assert "Lane 'doomed' was deleted while the request waited" in refused.message
    finally:
        sdk.close()
        daemon.cli("delete", "lane", "doomed")


def test_a_second_signal_stops_at_once_cutting_streams_with_an_error(model_path: Path) -> None:
    """SIGTERM drains through the engines' 10 s stop grace; Ctrl-C again (a second
    signal) kills the engines at once, and a stream still running ends with the
    dialect's error, never a normal finish."""
    home = short_home()
    fleet = local_fleet(
        home, model_path, lane="cut", spec="replicas: 1, slots: 1, contextPerSlot: 512"
    )
    daemon = Daemon(home=home, watch=fleet).start()
    try:
        daemon.wait_condition("lane", "cut", "Ready", timeout=180)
        pids = daemon.pids("cut")
        assert daemon.process is not None
        chunks = client(daemon).chat.completions.create(
            model="cut",
            messages=[{"role": "user", "content": "Tell a long story."}],
            max_tokens=480,
            logit_bias={"1": -100, "106": -100},  # no end of turn: it runs for its budget
            stream=True,
        )
        finishes: list[str | None] = []
        with pytest.raises(openai.APIError, match="before this request finished"):
            for n, chunk in enumerate(chunks):
                if n == 2:
                    seen = daemon.log_path.stat().st_size
                    daemon.process.send_signal(signal.SIGTERM)
                    # The second signal once the first is being handled (not a fixed
                    # half second): both at once could be read as one.
                    wait_for(
                        lambda since=seen: daemon.events("daemon.stopping", since=since),
                        timeout=10,
                        what="the first signal's stop to begin",
                        step=0.02,
                    )
                    started = time.monotonic()
                    daemon.process.send_signal(signal.SIGINT)
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
        # Cut at once, not at the end of the drain's grace (which a first signal alone
        # also reaches, with the same error).
        cut_s = time.monotonic() - started
        assert cut_s < supervisor.STOP_GRACE_S / 2, cut_s
        assert finishes == []
        assert daemon.process.wait(timeout=5) == 0
        print(f"\nstopped {time.monotonic() - started:.2f} s after the second signal")
        assert not any(pid_alive(p) for p in pids)
        assert not (home / "daemon.json").exists()
    finally:
        daemon.stop()
        shutil.rmtree(home, ignore_errors=True)
