"""A request that comes right after Ollama's unload idiom, on a daemon of its own (the
unload puts the Lane to sleep, which the modules sharing `default_daemon` do not expect).

`keep_alive: 0` with nothing to generate puts the Lane to sleep at once: its replica is
stopping when the next request arrives, is refused there and handed back to the queue.
That request must wake the Lane as a request for a sleeping one does, and is not refused
for its time-to-first-token target (the Lane was told to sleep: docs/memory.md, scale to zero).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.integration import harness

pytestmark = pytest.mark.slow

LANE = "gemma3"
# Far past the time a wake takes (3-4 s here), far short of "never".
ANSWER_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def daemon() -> Iterator[harness.Daemon]:
    with harness.default_fleet() as d:
        yield d


def unload_then(d: harness.Daemon, prompt: str) -> httpx.Response:
    base = f"http://{d.http}"
    # Serving, so that the unload stops a replica under the request (a test before
    # may have left the Lane asleep or waking).
    d.wait_condition("lane", LANE, "Ready", timeout=120)
    unloaded = httpx.post(f"{base}/api/chat", json={"model": LANE, "keep_alive": 0})
    assert (unloaded.status_code, unloaded.json()["done_reason"]) == (200, "unload")
    return httpx.post(
        f"{base}/api/generate",
        json={"model": LANE, "prompt": prompt, "options": {"num_predict": 2}, "stream": False},
        timeout=ANSWER_WITHIN_S,
    )


def test_a_request_right_after_an_unload_wakes_the_lane(daemon: harness.Daemon) -> None:
    answer = unload_then(daemon, "Once upon")
    assert answer.status_code == 200, answer.text
    assert answer.json()["done"] is True
    assert answer.json()["load_duration"] > 0


def test_a_prompt_too_long_right_after_an_unload_is_refused_not_stranded(
    daemon: harness.Daemon,
) -> None:
    # The refusal needs the engine's count of the prompt, so a replica must start.
    answer = unload_then(daemon, "word " * 3000)
    assert answer.status_code == 400, answer.text
    assert "2048" in answer.json()["error"]
