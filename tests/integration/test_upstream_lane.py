"""Upstream Lanes end to end: a fronting daemon whose Lane `remote` has no engine of its
own (`engine: upstream`) sends its requests to a second, real Blazar daemon serving the
bundled model, through that daemon's OpenAI API.

The official `openai`, `anthropic` and `ollama` clients talk to the fronting daemon,
streaming and not; its admission (an SLOPolicy with no queue over an upstream of one
parallel request) and its metrics apply. Then the upstream stops: the Lane turns
Available=False within a probe period and every dialect answers 503; the upstream
starts again on the same port and the Lane serves again by itself.

Outputs are held by structured output (a JSON string longer than the budget can write)
so each generation runs to its small budget; nothing asserts what the model writes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import ollama
import openai
import pytest

from blazar.controller import upstream_plan
from tests.integration.harness import REPO, Daemon, short_home, wait_for

pytestmark = pytest.mark.slow

LANE = "remote"
BUDGET = 4
# A JSON string no budget here finishes: the upstream's grammar keeps the model going.
RUNS_TO_BUDGET: dict[str, Any] = {"type": "string", "minLength": 1000}
RESPONSE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "s", "schema": RUNS_TO_BUDGET},
}
MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]


def fleet(upstream_http: str) -> str:
    return (
        "apiVersion: blazar.dev/v1alpha1\nkind: SLOPolicy\nmetadata: {name: strict}\n"
        "spec: {maxQueueDepth: 0}\n---\n"
        "apiVersion: blazar.dev/v1alpha1\nkind: Lane\n"
        f"metadata: {{name: {LANE}}}\n"
        "spec:\n  engine: upstream\n  sloPolicy: strict\n  aliases: [remote-gemma]\n"
        f"  upstream: {{url: 'http://{upstream_http}/v1', model: gemma3, maxConcurrency: 1}}\n"
    )


class Upstream:
    """The upstream daemon: the default fleet, restartable on the same HTTP port."""

    def __init__(self) -> None:
        self.home = short_home()
        shutil.copytree(REPO / "manifests", self.home / "fleet")
        self.daemon = Daemon(home=self.home, watch=self.home / "fleet")

    def start(self) -> None:
        self.daemon.start()
        self.daemon.serve_args = ["--http", self.daemon.http]  # the same port next time
        self.daemon.wait_condition("lane", "gemma3", "Ready", timeout=240)


@pytest.fixture(scope="module")
def pair(model_path: Path) -> Iterator[tuple[Upstream, Daemon]]:
    upstream = Upstream()
    upstream.start()
    home = short_home()
    (home / "fleet").mkdir()
    (home / "fleet" / "fleet.yaml").write_text(fleet(upstream.daemon.http))
    front = Daemon(home=home, watch=home / "fleet")
    try:
        front.start()
        front.wait_condition("lane", LANE, "Available", timeout=30)
        yield upstream, front
    finally:
        front.stop()
        upstream.daemon.stop()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(upstream.home, ignore_errors=True)


def test_openai_client_streaming_and_not(pair: tuple[Upstream, Daemon]) -> None:
    _, front = pair
    client = openai.OpenAI(base_url=f"http://{front.http}/v1", api_key="none")
    answer = client.chat.completions.create(
        model=LANE, messages=MESSAGES, max_tokens=BUDGET, response_format=RESPONSE_FORMAT
    )
    assert answer.model == LANE
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == BUDGET
    assert answer.usage.prompt_tokens > 1
    stream = client.chat.completions.create(
        model="remote-gemma",
        messages=MESSAGES,
        max_tokens=BUDGET,
        response_format=RESPONSE_FORMAT,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == BUDGET
    # A GBNF grammar has no field in OpenAI's API: refused before admission.
    refused = httpx.post(
        f"http://{front.http}/v1/chat/completions",
        json={"model": LANE, "messages": MESSAGES, "grammar": 'root ::= "a"'},
        timeout=30,
    )
    assert refused.status_code == 400, refused.text
    assert "grammar" in refused.json()["error"]["message"]
    # Nor are embeddings passed on.
    with pytest.raises(openai.BadRequestError, match="upstream"):
        client.embeddings.create(model=LANE, input="x")
    client.close()


def test_a_forced_tool_call_passes_both_ways(pair: tuple[Upstream, Daemon]) -> None:
    """tool_choice required goes to the upstream, whose grammar forces the call; its
    streamed call comes back as one whole call, streaming and not."""
    _, front = pair
    client = openai.OpenAI(base_url=f"http://{front.http}/v1", api_key="none")
    tools: list[Any] = [
        {
            "type": "function",
            "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    answer = client.chat.completions.create(
        model=LANE,
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert call.function.name == "ping"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {}  # type: ignore[union-attr]
    client.close()


def test_anthropic_client_streaming_and_not(pair: tuple[Upstream, Daemon]) -> None:
    _, front = pair
    client = anthropic.Anthropic(base_url=f"http://{front.http}", api_key="none")
    message = client.messages.create(model=LANE, max_tokens=BUDGET, messages=MESSAGES)
    assert message.model == LANE
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= message.usage.output_tokens <= BUDGET
    # The upstream's cached tokens come back as Anthropic counts them: apart.
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 1
    with client.messages.stream(model=LANE, max_tokens=BUDGET, messages=MESSAGES) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= final.usage.output_tokens <= BUDGET
    client.close()


def test_ollama_client_streaming_and_not(pair: tuple[Upstream, Daemon]) -> None:
    _, front = pair
    client = ollama.Client(host=f"http://{front.http}")
    options = {"num_predict": BUDGET}
    answer = client.chat(model=LANE, messages=MESSAGES, options=options, format=RUNS_TO_BUDGET)
    assert answer.done is True and answer.done_reason == "length"
    assert answer.eval_count == BUDGET
    # Measured at the fronting daemon: from sending to the first token, then to the end.
    assert answer.prompt_eval_duration and answer.prompt_eval_duration > 0
    assert answer.eval_duration and answer.eval_duration > 0
    parts = list(
        client.chat(
            model=LANE, messages=MESSAGES, options=options, format=RUNS_TO_BUDGET, stream=True
        )
    )
    assert parts[-1].done is True and parts[-1].done_reason == "length"
    assert parts[-1].eval_count == BUDGET
    client._client.close()


def test_admission_refuses_past_the_upstreams_concurrency(pair: tuple[Upstream, Daemon]) -> None:
    """maxConcurrency 1 is the Lane's one slot and the policy queues nothing: while a
    request runs upstream, a second one is 429; the metrics count both."""
    _, front = pair
    url = f"http://{front.http}/v1/chat/completions"
    body = {
        "model": LANE,
        "messages": MESSAGES,
        # Far more than it runs for: left, it would hold the upstream's slot for
        # tens of seconds, so the caller leaving must be what frees it.
        "max_tokens": 1500,
        "response_format": RESPONSE_FORMAT,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        second = http.post(url, json={**body, "stream": False, "max_tokens": 2})
        assert second.status_code == 429, second.text
        assert "retry-after" in second.headers
        assert in_flight(pair[0].daemon, "gemma3") == 1.0
    # The caller that left cancelled the upstream's generation too (its connection was
    # closed), rather than leaving it to run to its budget.
    upstream = pair[0].daemon
    cancelled = 'blazar_requests_total{lane="gemma3",outcome="cancelled"}'
    wait_for(
        lambda: cancelled in httpx.get(f"http://{upstream.http}/metrics", timeout=10).text,
        timeout=30,
        what="the upstream's generation cancelled",
    )
    assert in_flight(upstream, "gemma3") == 0.0 and in_flight(front, LANE) == 0.0
    metrics = httpx.get(f"http://{front.http}/metrics", timeout=10).text
    assert f'blazar_requests_total{{lane="{LANE}",outcome="ok"}}' in metrics
    assert f'blazar_requests_total{{lane="{LANE}",outcome="cancelled"}}' in metrics
    refused = (
        f'blazar_admission_rejections_total{{lane="{LANE}",policy="strict",reason="QUEUE_FULL"}}'
    )
    assert refused in metrics


def upstream_lane(name: str, http: str, model: str) -> str:
    return (
        "apiVersion: blazar.dev/v1alpha1\nkind: Lane\n"
        f"metadata: {{name: {name}}}\n"
        f"spec: {{engine: upstream, upstream: {{url: 'http://{http}/v1', model: {model}}}}}\n"
    )


def available(daemon: Daemon, lane: str) -> bool:
    try:
        cond = daemon.condition("lane", lane, "Available")
    except grpc.RpcError:  # its manifest is not applied yet
        return False
    return cond is not None and cond["status"] == "True"


def test_a_request_sent_round_two_daemons_is_refused(pair: tuple[Upstream, Daemon]) -> None:
    """A -> B -> A: the front's Lane `circle` sends to the upstream daemon's Lane `back`,
    which sends to the front's `circle` again. Each daemon adds itself to
    `x-blazar-via`, so the front, reached a second time, answers 508, and the caller
    reads why at once (not a first-byte timeout, nor a queue filled by the loop)."""
    upstream, front = pair
    assert front.watch is not None
    mine, theirs = front.watch / "circle.yaml", upstream.home / "fleet" / "back.yaml"
    mine.write_text(upstream_lane("circle", upstream.daemon.http, "back"))
    theirs.write_text(upstream_lane("back", front.http, "circle"))
    try:
        for daemon, lane in ((front, "circle"), (upstream.daemon, "back")):
            wait_for(
                lambda: available(daemon, lane),  # noqa: B023 (called at once)
                timeout=30,
                what=f"Lane {lane} available",
                step=0.2,
            )
        answer = httpx.post(
            f"http://{front.http}/v1/chat/completions",
            json={"model": "circle", "messages": MESSAGES, "max_tokens": 2},
            timeout=60,
        )
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert "HTTP 508" in message and "came back to a Blazar daemon" in message, message
    finally:
        mine.unlink()
        theirs.unlink()


def in_flight(daemon: Daemon, lane: str) -> float:
    metrics = httpx.get(f"http://{daemon.http}/metrics", timeout=10).text
    series = f'blazar_requests_in_flight{{lane="{lane}"}} '
    line = next((x for x in metrics.splitlines() if x.startswith(series)), series + "0")
    return float(line.split()[-1])


def refusals(front: Daemon) -> dict[str, int]:
    base = f"http://{front.http}"
    small = {"model": LANE, "max_tokens": 2}
    return {
        "openai": httpx.post(
            f"{base}/v1/chat/completions", json={**small, "messages": MESSAGES}, timeout=30
        ).status_code,
        "anthropic": httpx.post(
            f"{base}/v1/messages", json={**small, "messages": MESSAGES}, timeout=30
        ).status_code,
        "ollama": httpx.post(
            f"{base}/api/chat",
            json={"model": LANE, "messages": MESSAGES, "options": {"num_predict": 2}},
            timeout=30,
        ).status_code,
    }


def test_a_stopped_upstream_is_unavailable_then_serves_again(
    pair: tuple[Upstream, Daemon],
) -> None:
    upstream, front = pair
    upstream.daemon.stop()
    stopped = datetime.now(UTC)
    down = front.wait_condition("lane", LANE, "Available", "False", timeout=30)
    # Within one probe period of the upstream's port closing, by the condition's own
    # time (not by when the CLI, polling on a busy host, saw it); a second of slack
    # for the work queue's timer.
    noticed = (datetime.fromisoformat(down["lastTransitionTime"]) - stopped).total_seconds()
    assert noticed <= upstream_plan.PROBE_PERIOD_S + 1.0, noticed
    assert down["reason"] == "UpstreamUnavailable"
    assert "cannot connect" in down["message"]
    codes = refusals(front)
    # UNAVAILABLE in each dialect's terms (Anthropic's: 529 overloaded_error).
    assert codes == {"openai": 503, "anthropic": 529, "ollama": 503}, codes
    # What an upstream is never asked is the caller's mistake whether or not it answers.
    grammar = httpx.post(
        f"http://{front.http}/v1/chat/completions",
        json={"model": LANE, "messages": MESSAGES, "grammar": 'root ::= "a"'},
        timeout=30,
    )
    assert grammar.status_code == 400, grammar.text
    events = front.cli("events")
    assert "UpstreamUnavailable" in events.stdout

    upstream.start()
    wait_for(
        lambda: front.condition("lane", LANE, "Available")["status"] == "True",  # type: ignore[index]
        timeout=upstream_plan.MAX_PROBE_INTERVAL_S + 10,
        what="the upstream Lane available again",
        step=0.2,
    )
    answer = httpx.post(
        f"http://{front.http}/v1/chat/completions",
        json={"model": LANE, "messages": MESSAGES, "max_tokens": 2},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert json.loads(answer.text)["usage"]["completion_tokens"] >= 1
