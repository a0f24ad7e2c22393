"""Routing across replicas end to end (issue 17, acceptance 5): a Lane of two real
engine replicas, two conversations with different long prefixes; every follow-up lands
on the replica whose cache holds its conversation, and reuses it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import Daemon, local_fleet, short_home, wait_for

pytestmark = pytest.mark.slow

LANE = "pair"


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    home = short_home()
    fleet = local_fleet(
        home,
        model_path,
        lane=LANE,
        spec="replicas: 2, slots: 2, contextPerSlot: 2048, threads: 1",
    )
    d = Daemon(home=home, watch=fleet).start()
    try:
        d.wait_condition("lane", LANE, "Ready", timeout=240)

        def both_ready() -> bool:
            replicas = d.get("lane", LANE)["status"].get("replicaStatuses", [])
            return sum(r["state"] == "Ready" for r in replicas) == 2

        wait_for(both_ready, timeout=240, what="both replicas to be ready", step=0.5)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def document(name: str) -> str:
    """About 1,000 tokens of text that no other name's document shares a prefix with."""
    return f"The {name} archive. " + " ".join(
        f"Entry {i} of the {name} archive records that crate {i * 7 % 101} left dock "
        f"{i % 9 + 1} on day {i % 28 + 1}."
        for i in range(50)
    )


@dataclass
class Answer:
    replica: int
    reused: int
    cached_tokens: int
    prompt_tokens: int
    content: str


def chat(http: httpx.Client, messages: list[dict[str, str]], *, session: str | None) -> Answer:
    headers = {"x-blazar-session": session} if session else {}
    body: dict[str, Any] = {
        "model": LANE,
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
    }
    reply = http.post("/v1/chat/completions", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    usage = data["usage"]
    return Answer(
        replica=int(reply.headers["x-blazar-replica"]),
        reused=int(reply.headers["x-blazar-prefix-reused"]),
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens=usage["prompt_tokens"],
        content=data["choices"][0]["message"]["content"],
    )


def test_follow_ups_land_on_the_replica_that_holds_their_prefix(daemon: Daemon) -> None:
    with httpx.Client(base_url=f"http://{daemon.http}", timeout=120, trust_env=False) as http:
        turns = {
            name: [
                {"role": "system", "content": document(name)},
                {"role": "user", "content": "Which crate left first?"},
            ]
            for name in ("north", "south")
        }
        first = {name: chat(http, turns[name], session=name) for name in turns}
        # Both replicas idle after the first conversation: the second one goes to the
        # replica whose cache holds less, so each cache holds one conversation.
        assert {a.replica for a in first.values()} == {0, 1}, first
        assert all(a.prompt_tokens > 900 for a in first.values()), first

        for name in turns:
            turns[name] += [
                {"role": "assistant", "content": first[name].content},
                {"role": "user", "content": "And which one left last?"},
            ]
        # With the session key, and again without one: the prefix alone routes it.
        for session in ("yes", None):
            for name in turns:
                follow_up = chat(http, turns[name], session=name if session else None)
                assert follow_up.replica == first[name].replica, (name, session, follow_up)
                assert follow_up.cached_tokens > 900, (name, session, follow_up)
                assert follow_up.reused == follow_up.cached_tokens
