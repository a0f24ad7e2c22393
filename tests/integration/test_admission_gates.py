"""Admission gates end to end (issue 17, refusals): while the one slot of Lane `solo`
is busy and its policy may queue nothing, every request is refused. The daemon
publishes that gate and the HTTP shim answers the flood itself: 429 with Retry-After
in the OpenAI and Anthropic dialects, each counted once in /metrics, most of them
without reaching admission (whose own refusals log `admission.refused`). Once the
slot frees, the gate opens and the next request is served.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import Daemon, short_home, wait_for

pytestmark = pytest.mark.slow

LANE = "solo"
POLICY = "nowait"
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
        if line.startswith("blazar_admission_rejections_total{") and f'lane="{LANE}"' in line:
            assert f'policy="{POLICY}"' in line and 'reason="QUEUE_FULL"' in line, line
            total += float(line.rsplit(" ", 1)[1])
    return total


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


def test_a_busy_slot_is_refused_in_the_shim_and_opens_when_it_frees(
    daemon: Daemon, no_eog: dict[int, float]
) -> None:
    base = f"http://{daemon.http}"
    http = httpx.Client(base_url=base, timeout=60, trust_env=False)
    metrics_before = http.get("/metrics").text
    refused_logged = len(daemon.events("admission.refused"))

    # Hold the one slot: a generation that runs to its max_tokens, stopped by hand.
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
    finally:
        release.set()
        holder.join(timeout=120)

    # The slot frees: the gate opens and a request is served.
    def served() -> httpx.Response | None:
        path, body = OPENAI
        response = http.post(path, json=body)
        return response if response.status_code == 200 else None

    wait_for(served, timeout=30, what="a request served after the flood", step=0.1)
    http.close()
