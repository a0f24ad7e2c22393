"""Admission gates end to end (issue 17, refusals): while the one slot of Lane `solo`
is busy and its policy may queue nothing, every request is refused. The daemon
publishes that gate and the HTTP shim answers the flood itself: 429 with Retry-After
in the OpenAI and Anthropic dialects, each counted once in /metrics, most of them
without reaching admission (whose own refusals log `admission.refused`). Once the
slot frees, the gate opens and the next request is served. The official `openai` and
`ollama` clients, streaming or not, raise the refusal in their dialect's shape.
Under a second policy that queues (`patient`), a gRPC caller whose deadline the wait
would pass is refused at once with DEADLINE_EXCEEDED, while an HTTP request (no
deadline) waits and is served; and a stream its gRPC deadline cuts off is counted as
such, not as its caller leaving.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import ollama
import openai
import pytest

from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from tests.integration.harness import Daemon, short_home, wait_for

pytestmark = pytest.mark.slow

LANE = "solo"
POLICY = "nowait"
# Queues as many as the default bound allows, for the caller's deadline to decide.
PATIENT = "patient"
FLOOD = 12


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    home = short_home()
    fleet = home / "fleet"
    fleet.mkdir()
    (fleet / "fleet.yaml").write_text(
        "apiVersion: blazar.dev/v1alpha1\n"
        "kind: Model\n"
        "metadata: {name: gemma}\n"
        f"spec: {{source: {{path: {json.dumps(str(model_path))}}}}}\n"
        "---\n"
        "apiVersion: blazar.dev/v1alpha1\n"
        "kind: SLOPolicy\n"
        f"metadata: {{name: {POLICY}}}\n"
        "spec: {maxQueueDepth: 0, onOverload: queue}\n"
        "---\n"
        "apiVersion: blazar.dev/v1alpha1\n"
        "kind: SLOPolicy\n"
        f"metadata: {{name: {PATIENT}}}\n"
        "spec: {onOverload: queue}\n"
        "---\n"
        "apiVersion: blazar.dev/v1alpha1\n"
        "kind: Lane\n"
        f"metadata: {{name: {LANE}}}\n"
        f"spec: {{model: gemma, slots: 1, threads: 1, contextPerSlot: 512, sloPolicy: {POLICY}}}\n"
    )
    daemon = Daemon(home=home, watch=fleet).start()
    try:
        daemon.wait_condition("lane", LANE, "Ready", timeout=180)
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(home, ignore_errors=True)


def rejections(metrics: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        mine = line.startswith("blazar_admission_rejections_total{") and f'lane="{LANE}"' in line
        if mine and f'policy="{POLICY}"' in line:
            assert 'reason="QUEUE_FULL"' in line, line
            total += float(line.rsplit(" ", 1)[1])
    return total


def deadline_rejections(metrics: str) -> float:
    for line in metrics.splitlines():
        mine = line.startswith("blazar_admission_rejections_total{") and f'lane="{LANE}"' in line
        if mine and f'policy="{PATIENT}"' in line and 'reason="DEADLINE_EXCEEDED"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def refused_outcomes(metrics: str) -> float:
    for line in metrics.splitlines():
        mine = line.startswith("blazar_requests_total{") and f'lane="{LANE}"' in line
        if mine and 'outcome="queue_full"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


OPENAI = ("/v1/completions", {"model": LANE, "prompt": "Hello", "max_tokens": 4})
ANTHROPIC = (
    "/v1/messages",
    {"model": LANE, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]},
)


@contextlib.contextmanager
def the_slot_held(base: str, no_eog: dict[int, float]) -> Iterator[None]:
    """The one slot busy with a generation that runs to its max_tokens, stopped (by
    leaving its stream) on the way out."""
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        body = {
            "model": LANE,
            "prompt": "Once upon a time",
            "max_tokens": 400,
            "stream": True,
            "logit_bias": {str(k): v for k, v in no_eog.items()},
        }
        with (
            httpx.Client(base_url=base, timeout=120, trust_env=False) as c,
            c.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            for _ in response.iter_lines():
                holding.set()
                if release.is_set():
                    return  # leaving the stream cancels the generation

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(60)
        yield
    finally:
        release.set()
        holder.join(timeout=120)


def test_a_busy_slot_is_refused_in_the_shim_and_opens_when_it_frees(
    daemon: Daemon, no_eog: dict[int, float]
) -> None:
    base = f"http://{daemon.http}"
    http = httpx.Client(base_url=base, timeout=60, trust_env=False)
    metrics_before = http.get("/metrics").text
    refused_logged = len(daemon.events("admission.refused"))

    with the_slot_held(base, no_eog):

        def refused(path: str, body: dict[str, Any]) -> httpx.Response:
            response = http.post(path, json=body)
            assert response.status_code == 429, response.text
            return response

        # The gate closes once the slot is taken (the daemon's first refusals may
        # come before the shim hears of it).
        answers: list[httpx.Response] = []
        for i in range(FLOOD):
            answers.append(refused(*(OPENAI if i % 2 == 0 else ANTHROPIC)))
        for response in answers:
            assert int(response.headers["retry-after"]) >= 1
        openai_body = answers[0].json()
        assert openai_body["error"]["type"] == "rate_limit_error"
        assert openai_body["error"]["code"] == "queue_full"
        assert "maxQueueDepth" in openai_body["error"]["message"]
        anthropic_body = answers[1].json()
        assert anthropic_body["type"] == "error"
        assert anthropic_body["error"]["type"] == "rate_limit_error"

        metrics = http.get("/metrics").text
        # Every refusal counted once, wherever it was decided.
        assert rejections(metrics) - rejections(metrics_before) == FLOOD
        assert refused_outcomes(metrics) - refused_outcomes(metrics_before) == FLOOD
        # Most never reached admission (which logs each refusal it decides).
        by_admission = len(daemon.events("admission.refused")) - refused_logged
        assert by_admission < FLOOD // 2, by_admission

    # The slot frees: the gate opens and a request is served.
    def served() -> httpx.Response | None:
        path, body = OPENAI
        response = http.post(path, json=body)
        return response if response.status_code == 200 else None

    wait_for(served, timeout=30, what="a request served after the flood", step=0.1)
    http.close()


def test_the_official_clients_raise_a_refusal_in_their_dialects_shape(
    daemon: Daemon, no_eog: dict[int, float]
) -> None:
    """The OpenAI client on chat completions and responses, and the Ollama client on
    chat, whole and streamed: a 429 before any chunk, which each client raises as its own error (a
    refusal of the shim's gate or of admission, whichever comes first)."""
    base = f"http://{daemon.http}"
    hi: Any = [{"role": "user", "content": "Hello"}]
    chat_of_openai = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    chat_of_ollama = ollama.Client(host=base)
    try:
        with the_slot_held(base, no_eog):
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as refused:
                    chat_of_openai.chat.completions.create(
                        model=LANE, messages=hi, max_tokens=4, stream=stream
                    )
                assert refused.value.code == "queue_full", stream
                headers = refused.value.response.headers
                assert int(headers["retry-after"]) >= 1
                # The hint to the millisecond, which the client reads first.
                assert 0 <= int(headers["retry-after-ms"]) <= 1000 * int(headers["retry-after"])
                assert f"SLOPolicy '{POLICY}'" in refused.value.message
                with pytest.raises(openai.RateLimitError) as responses_refused:
                    chat_of_openai.responses.create(
                        model=LANE, input="Hello", max_output_tokens=16, store=False, stream=stream
                    )
                assert responses_refused.value.code == "queue_full", stream
                with pytest.raises(ollama.ResponseError) as told:
                    answer = chat_of_ollama.chat(
                        model=LANE, messages=hi, options={"num_predict": 4}, stream=stream
                    )
                    if stream:
                        list(answer)
                assert told.value.status_code == 429, stream
                assert f"SLOPolicy '{POLICY}'" in told.value.error
            # The client hides headers; Ollama's 429 carries Retry-After as well.
            raw = httpx.post(f"{base}/api/chat", json={"model": LANE, "messages": hi}, timeout=30)
            assert raw.status_code == 429 and int(raw.headers["retry-after"]) >= 1
            assert set(raw.json()) == {"error"}
    finally:
        chat_of_openai.close()
        chat_of_ollama._client.close()


def complete(max_tokens: int) -> inference_pb2.CompleteRequest:
    """A Complete under PATIENT that runs to `max_tokens` whatever the model writes."""
    sampling = inference_pb2.Sampling(max_tokens=max_tokens, ignore_eos=True)
    return inference_pb2.CompleteRequest(
        model=LANE, prompt="Once upon a time", slo=PATIENT, sampling=sampling
    )


def outcomes(metrics: str, outcome: str) -> float:
    for line in metrics.splitlines():
        mine = line.startswith("blazar_requests_total{") and f'lane="{LANE}"' in line
        if mine and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_grpc_deadline_the_wait_would_pass_is_refused_at_once_http_waits(
    daemon: Daemon,
) -> None:
    """The slot held by a generation of 400 tokens (its policy's requests run to their
    max_tokens, as the first one here measures): a gRPC caller with 2 s left is refused
    at arrival by admission (its message, not gRPC's own), before its deadline, and
    counted; an HTTP request of the same policy queued before it (HTTP sends no
    deadline) waits, and is served once the slot frees."""
    stub = inference_pb2_grpc.InferenceStub(channel := grpc.insecure_channel(daemon.grpc))
    http = httpx.Client(base_url=f"http://{daemon.http}", timeout=120, trust_env=False)

    def queued() -> bool:
        wanted = f'blazar_queue_depth{{lane="{LANE}",policy="{PATIENT}"}} 1.0'
        return wanted in http.get("/metrics").text

    answered: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: answered.append(
            http.post(
                "/v1/completions",
                json={"model": LANE, "prompt": "Hello", "max_tokens": 4},
                headers={"x-blazar-slo": PATIENT},
            )
        )
    )
    holder: Any = None
    try:
        list(stub.Complete(complete(8), timeout=60))  # its policy runs to max_tokens
        holder = stub.Complete(complete(400), timeout=120)
        next(holder)
        waiter.start()
        wait_for(queued, timeout=30, what="the HTTP request queued", step=0.05)
        before = deadline_rejections(http.get("/metrics").text)

        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Complete(complete(4), timeout=2.0))
        elapsed = time.monotonic() - began
        error = refused.value
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.details()
        told = re.search(r"past the caller's deadline of ([0-9.]+) s", error.details() or "")
        assert told is not None and abs(float(told[1]) - 2.0) < 0.1, error.details()
        assert ("blazar-reason", "DEADLINE_EXCEEDED") in (error.trailing_metadata() or ())
        assert elapsed < 2.0, elapsed
        assert deadline_rejections(http.get("/metrics").text) == before + 1
        assert waiter.is_alive() and not answered, "the HTTP request must wait"
        holder.cancel()
        waiter.join(timeout=60)
        assert [r.status_code for r in answered] == [200]
    finally:
        if holder is not None:
            holder.cancel()
        if waiter.is_alive():
            waiter.join(timeout=60)
        http.close()
        channel.close()


def test_a_deadline_that_cuts_a_stream_is_counted_and_logged_as_such(daemon: Daemon) -> None:
    """A generation whose gRPC deadline passes mid-stream ends there: counted as
    outcome `deadline_exceeded`, not `cancelled` (its caller did not leave), and its
    `request.cancelled` line says so; the slot it held serves the next request."""
    channel = grpc.insecure_channel(daemon.grpc)
    stub = inference_pb2_grpc.InferenceStub(channel)
    http = httpx.Client(base_url=f"http://{daemon.http}", timeout=60, trust_env=False)
    try:
        before = outcomes(http.get("/metrics").text, "deadline_exceeded")
        logged = len(daemon.events("request.cancelled"))
        with pytest.raises(grpc.RpcError) as cut:
            list(stub.Complete(complete(400), timeout=1.5))
        assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        def counted() -> bool:
            return outcomes(http.get("/metrics").text, "deadline_exceeded") == before + 1

        wait_for(counted, timeout=10, what="the cut stream counted", step=0.05)
        (line,) = daemon.events("request.cancelled")[logged:]
        assert line["deadline_exceeded"] is True and line["lane"] == LANE, line
        served = list(stub.Complete(complete(2), timeout=60))
        assert served[-1].HasField("final")
    finally:
        http.close()
        channel.close()
