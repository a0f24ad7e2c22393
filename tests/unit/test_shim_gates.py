"""The shim's admission gates: which requests a closed gate refuses without a round
trip, and that such a refusal is the daemon's own, rendered and counted the same."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import prometheus_client
import pytest
from starlette.requests import Request

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, gate_tags
from blazar.rpc import refusals
from blazar.shim import gates, inference, relay
from tests.unit.fake_inference import Daemon, asgi_shim, delta, fake_daemon, final, poll

FULL = errors.QueueFull.of(
    lane="lane-a", policy="interactive", max_queue_depth=4, retry_after_s=2.5
)
LATE = errors.SloUnattainable.of(
    lane="lane-a",
    policy="interactive",
    predicted_ttft_s=3.0,
    ttft_target_s=2.0,
    retry_after_s=1.0,
)


def gate(
    err: errors.BlazarError = FULL,
    *,
    lane: str = "lane-a",
    models: tuple[str, ...] = ("lane-a", "tiny"),
    policy: str = "interactive",
    lane_policy: bool = True,
    closed_for_ms: int | None = None,
    chars_per_token: float = 4.0,
    context_tokens: int = 100,
    after: tuple[int, int] = (0, 0),
    most: tuple[int, int, int] = (0, 0, 0),
    most_prompt: int | None = None,
) -> inference_pb2.AdmissionGate:
    found = inference_pb2.AdmissionGate(
        lane=lane,
        models=models,
        policy=policy,
        lane_policy=lane_policy,
        reason=err.reason,
        message=err.message,
        metadata=err.metadata,
        chars_per_token=chars_per_token,
        context_tokens=context_tokens,
        after_requests=after[0],
        after_max_tokens=after[1],
        after_most_max_tokens=most[0],
        after_least_prompt_tokens=most[1],
        after_most_prompt_tokens=most[2],
    )
    if closed_for_ms is not None:
        found.closed_for_ms = closed_for_ms
    if most_prompt is not None:
        found.most_prompt_tokens = most_prompt
    return found


def message(
    *closed: inference_pb2.AdmissionGate, refresh_ms: int = 500, seen: dict[str, int] | None = None
) -> inference_pb2.AdmissionGates:
    return inference_pb2.AdmissionGates(closed=closed, refresh_ms=refresh_ms, seen=seen or {})


def complete(
    model: str = "tiny",
    *,
    prompt: str = "Hi",
    slo: str = "",
    session: str = "",
    max_tokens: int | None = None,
) -> inference_pb2.CompleteRequest:
    request = inference_pb2.CompleteRequest(model=model, prompt=prompt, slo=slo, session=session)
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    return request


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def following(*closed: inference_pb2.AdmissionGate) -> tuple[gates.AdmissionGates, Clock]:
    clock = Clock()
    found = gates.AdmissionGates(clock=clock, watcher="w1")
    found.apply(message(*closed))
    return found, clock


def refusal(
    found: gates.AdmissionGates, request: gates.Generation, *, via: str = ""
) -> errors.BlazarError | None:
    """The gates' refusal of `request`; None when it goes on to the daemon (tagged)."""
    decided = found.admit(request, via=via)
    if isinstance(decided, errors.BlazarError):
        return decided
    assert decided.watcher == found.watcher
    return None


def rejections(lane: str, policy: str, reason: str) -> float:
    value = prometheus_client.REGISTRY.get_sample_value(
        "blazar_admission_rejections_total", {"lane": lane, "policy": policy, "reason": reason}
    )
    return value or 0.0


def outcomes(lane: str, outcome: str) -> float:
    value = prometheus_client.REGISTRY.get_sample_value(
        "blazar_requests_total", {"lane": lane, "outcome": outcome}
    )
    return value or 0.0


# --- which requests a closed gate refuses -----------------------------------------


@pytest.mark.parametrize(
    ("closed", "asked", "via", "refused"),
    [
        # The Lane's own policy: a request naming none, or naming it, by any name of
        # the Lane.
        (gate(), complete("tiny"), "", True),
        (gate(), complete("lane-a"), "", True),
        (gate(), complete("tiny", slo="interactive"), "", True),
        # Another model, another policy: the daemon decides.
        (gate(), complete("other"), "", False),
        (gate(), complete("tiny", slo="batch"), "", False),
        # A policy the requests of this Lane have named, not the Lane's own: only
        # requests that name it.
        (gate(lane_policy=False), complete("tiny"), "", False),
        (gate(lane_policy=False), complete("tiny", slo="interactive"), "", True),
        # The built-in FIFO is the Lane's when it has none; no request can name it.
        (gate(policy="builtin:fifo"), complete("tiny"), "", True),
        (gate(policy="builtin:fifo"), complete("tiny", slo="builtin:fifo"), "", False),
        # A session, or a request from another daemon: the daemon decides.
        (gate(), complete("tiny", session="s1"), "", False),
        (gate(), complete("tiny"), "daemon-b", False),
        # SLO_UNATTAINABLE: only requests that fit the Lane's context as admission
        # estimates it (2 chars / 4 per token -> 1 token, + max_tokens).
        (gate(LATE), complete("tiny", max_tokens=99), "", True),
        (gate(LATE), complete("tiny", max_tokens=100), "", False),
        (gate(LATE), complete("tiny", prompt="x" * 400), "", False),
        (gate(LATE), complete("tiny", prompt="x" * 396), "", True),
        # ... which QUEUE_FULL refuses whatever their size, as admission does.
        (gate(FULL), complete("tiny", prompt="x" * 4000), "", True),
        # SLO_UNATTAINABLE with the longest prompt its retry hint holds for: a longer
        # one goes on, for the daemon to tell it that no wait helps (25 chars -> 7).
        (gate(LATE, most_prompt=6), complete("tiny", prompt="x" * 24), "", True),
        (gate(LATE, most_prompt=6), complete("tiny", prompt="x" * 25), "", False),
    ],
)
def test_which_requests_a_closed_gate_refuses(
    closed: inference_pb2.AdmissionGate,
    asked: inference_pb2.CompleteRequest,
    via: str,
    refused: bool,
) -> None:
    found, _ = following(closed)
    err = refusal(found, asked, via=via)
    if not refused:
        assert err is None
        return
    assert err is not None
    assert err.reason == closed.reason
    assert err.message == closed.message
    assert dict(err.metadata) == dict(closed.metadata)
    assert err.code == "RESOURCE_EXHAUSTED"


def test_a_chat_is_measured_by_its_messages() -> None:
    found, _ = following(gate(LATE, context_tokens=10))
    short = inference_pb2.ChatRequest(
        model="tiny", messages=[inference_pb2.Message(role="user", content="x" * 16)] * 2
    )
    assert refusal(found, short) is not None  # 8 tokens + 1
    longer = inference_pb2.ChatRequest(
        model="tiny", messages=[inference_pb2.Message(role="user", content="x" * 20)] * 2
    )
    assert refusal(found, longer) is None  # 10 tokens + 1


def test_a_gate_holds_for_its_closed_for_ms() -> None:
    found, clock = following(gate(LATE, closed_for_ms=300))
    assert refusal(found, complete()) is not None
    clock.now += 0.299
    assert refusal(found, complete()) is not None
    clock.now += 0.001
    assert refusal(found, complete()) is None


def test_gates_go_stale_when_the_stream_is_silent() -> None:
    """Three refresh intervals without a message: the daemon decides again."""
    found, clock = following(gate())
    clock.now += 1.5
    assert refusal(found, complete()) is not None
    clock.now += 0.001
    assert refusal(found, complete()) is None
    # A heartbeat (the same gates) makes them hold again.
    found.apply(message(gate()))
    assert refusal(found, complete()) is not None


def test_each_message_is_the_whole_set() -> None:
    found, _ = following(gate())
    found.apply(message())
    assert refusal(found, complete()) is None
    assert found.listed() == []


def test_a_lost_stream_opens_every_gate() -> None:
    found, _ = following(gate())
    found.lost()
    assert refusal(found, complete()) is None


def test_a_filling_gate_closes_once_its_requests_went_on() -> None:
    """Two idle slots, taken by requests of 50 tokens or more: the third is refused."""
    found, _ = following(gate(LATE, after=(2, 50)))
    assert refusal(found, complete(max_tokens=60)) is None
    assert refusal(found, complete(max_tokens=50)) is None
    assert refusal(found, complete(max_tokens=1)) is not None  # any size, once filled
    assert refusal(found, complete(max_tokens=99)) is not None
    # A message whose gates include both starts the count again.
    found.apply(message(gate(LATE, after=(2, 50)), seen={"lane-a": 2}))
    assert refusal(found, complete(max_tokens=60)) is None


@pytest.mark.parametrize(
    "sent",
    [
        # One with a smaller max_tokens may free its slot in time.
        [complete(max_tokens=60), complete(max_tokens=49)],
        # One without max_tokens: the shim cannot tell.
        [complete(max_tokens=60), complete()],
        # One of another policy on the Lane.
        [complete(max_tokens=60), complete(slo="batch", max_tokens=60)],
    ],
)
def test_a_filling_gate_stays_open_unless_its_requests_went_on(
    sent: list[inference_pb2.CompleteRequest],
) -> None:
    found, _ = following(gate(LATE, after=(2, 50)))
    for request in sent:
        assert refusal(found, request) is None
    assert refusal(found, complete(max_tokens=60)) is None


def test_a_gate_filling_past_the_idle_slots_counts_requests_of_its_sizes() -> None:
    """Closed after three requests of exactly 64 tokens, with prompts of 5 to 10
    tokens as admission estimates them (4 characters a token here): the fourth is
    refused if its own prompt has 5 tokens or more."""
    found, _ = following(gate(LATE, after=(3, 64), most=(64, 5, 10)))
    for chars in (17, 40, 30):
        assert refusal(found, complete(prompt="x" * chars, max_tokens=64)) is None
    assert refusal(found, complete(prompt="x" * 200, max_tokens=1)) is not None
    assert refusal(found, complete(prompt="x" * 17, max_tokens=64)) is not None
    # A shorter one may start sooner than the target: it goes on to the daemon.
    assert refusal(found, complete(prompt="x" * 16, max_tokens=64)) is None


@pytest.mark.parametrize(
    "odd",
    [
        # More tokens than the gate was sized for: it may be refused itself, and then
        # it does not wait ahead of the next.
        complete(prompt="x" * 40, max_tokens=65),
        # A longer prompt, likewise (41 characters: 11 tokens).
        complete(prompt="x" * 41, max_tokens=64),
        # A shorter prompt (16 characters: 4 tokens): the next may start sooner.
        complete(prompt="x" * 16, max_tokens=64),
        # Fewer tokens: the slot it takes frees sooner.
        complete(prompt="x" * 40, max_tokens=63),
        # No max_tokens: the shim cannot tell.
        complete(prompt="x" * 40),
    ],
)
def test_a_gate_filling_past_the_idle_slots_stays_open_for_other_sizes(
    odd: inference_pb2.CompleteRequest,
) -> None:
    found, _ = following(gate(LATE, after=(3, 64), most=(64, 5, 10)))
    like = complete(prompt="x" * 40, max_tokens=64)
    for request in (like, odd, like):
        assert refusal(found, request) is None
    assert refusal(found, like) is None


def test_requests_the_gates_do_not_include_yet_count_toward_the_next_gate() -> None:
    """Under a burst, the next message is computed before the requests sent on have
    reached admission: they still count, and only those its `seen` includes drop out."""
    found, _ = following(gate(LATE, after=(3, 50)))
    for _ in range(2):
        assert refusal(found, complete(max_tokens=60)) is None  # tags 1 and 2
    # Computed before either arrived (the same gate, nothing seen): the third goes on,
    # the fourth would wait past the target.
    found.apply(message(gate(LATE, after=(3, 50))))
    assert refusal(found, complete(max_tokens=60)) is None  # tag 3
    assert refusal(found, complete(max_tokens=60)) is not None
    # Admission took in tags 1 and 2 (two slots taken, one idle): tag 3 is on its way.
    found.apply(message(gate(LATE, after=(1, 50)), seen={"lane-a": 2}))
    assert refusal(found, complete(max_tokens=60)) is not None
    # What another Lane took in says nothing of this one's.
    found.apply(message(gate(LATE, after=(1, 50)), seen={"other": 9}))
    assert refusal(found, complete(max_tokens=60)) is not None
    # Tag 3 taken in too: the next one goes on.
    found.apply(message(gate(LATE, after=(1, 50)), seen={"lane-a": 3}))
    assert refusal(found, complete(max_tokens=60)) is None


def test_requests_sent_before_a_gate_was_listed_count_toward_it() -> None:
    found, _ = following()
    assert refusal(found, complete(max_tokens=60)) is None  # no gate: tag 1 goes on
    found.apply(message(gate(LATE, after=(1, 50))))
    assert refusal(found, complete(max_tokens=60)) is not None
    found.apply(message(gate(LATE, after=(1, 50)), seen={"lane-a": 1}))
    assert refusal(found, complete(max_tokens=60)) is None


def test_requests_on_their_way_count_again_once_the_stream_is_back() -> None:
    found, _ = following(gate(LATE, after=(2, 50)))
    for _ in range(2):
        assert refusal(found, complete(max_tokens=60)) is None
    found.lost()
    assert refusal(found, complete(max_tokens=60)) is None  # no gates: tag 3 goes on
    found.apply(message(gate(LATE, after=(2, 50)), seen={"lane-a": 1}))
    assert refusal(found, complete(max_tokens=60)) is not None  # tags 2 and 3


def test_a_request_whose_call_ended_counts_no_more() -> None:
    """Ended before the gates included it (refused before admission, or done): it
    holds no slot they do not know of."""
    found, _ = following(gate(LATE, after=(2, 50)))
    first = found.admit(complete(max_tokens=60))
    assert isinstance(first, gate_tags.Tag)
    assert refusal(found, complete(max_tokens=60)) is None
    assert refusal(found, complete(max_tokens=60)) is not None
    found.settled(first)
    assert refusal(found, complete(max_tokens=60)) is None
    # Another watcher's tag is not this one's to settle.
    found.settled(gate_tags.Tag("someone-else", 2))
    assert refusal(found, complete(max_tokens=60)) is not None


def test_a_request_the_gates_never_include_counts_for_two_refresh_intervals() -> None:
    """One the daemon refused before admission (a bad key, say) never arrives there:
    after twice the refresh interval (500 ms here) it counts no more."""
    found, clock = following(gate(LATE, after=(1, 50)))
    assert refusal(found, complete(max_tokens=60)) is None
    clock.now += 0.5
    found.apply(message(gate(LATE, after=(1, 50))))  # a heartbeat that does not see it
    clock.now += 0.5
    assert refusal(found, complete(max_tokens=60)) is not None  # 1.0 s: still counted
    clock.now += 0.001
    assert refusal(found, complete(max_tokens=60)) is None


def test_tags_name_the_watcher_and_rise() -> None:
    found, _ = following()
    tags = [found.admit(complete()) for _ in range(3)]
    assert tags == [gate_tags.Tag("w1", n) for n in (1, 2, 3)]
    assert tags[0].metadata() == ("x-blazar-gate-seq", "w1:1")
    # A random id by default, one per set of gates.
    assert gates.AdmissionGates().watcher != gates.AdmissionGates().watcher


@pytest.mark.anyio
@pytest.mark.parametrize("wait", [relay.first_chunk, relay.collect])
async def test_a_gate_refusal_is_raised_without_waiting_on_the_client(wait: Any) -> None:
    """A refused generation has no call to race against a disconnect: the relay raises
    its refusal before reading the client's side, so a flood of them is answered in
    one pass of the event loop."""
    read: list[bool] = []

    async def receive() -> Any:
        read.append(True)
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(errors.SloUnattainable):
        await wait(request, inference.ChunkStream.refused(LATE))
    assert read == []


def test_requests_with_a_session_fill_the_slots_too() -> None:
    """A request the gate does not refuse (a session) still takes a slot."""
    found, _ = following(gate(LATE, after=(2, 50)))
    assert refusal(found, complete(max_tokens=60, session="s")) is None
    assert refusal(found, complete(max_tokens=60, session="t")) is None
    assert refusal(found, complete(max_tokens=60)) is not None


def test_a_refusal_counts_once_as_the_daemons() -> None:
    found, _ = following(gate(lane="lane-count"))
    before = rejections("lane-count", "interactive", "QUEUE_FULL")
    requests_before = outcomes("lane-count", "queue_full")
    gated_before = refusals.gated("interactive").get("QUEUE_FULL", 0)
    assert refusal(found, complete()) is not None
    assert rejections("lane-count", "interactive", "QUEUE_FULL") == before + 1
    assert outcomes("lane-count", "queue_full") == requests_before + 1
    assert refusals.gated("interactive")["QUEUE_FULL"] == gated_before + 1
    # Not refused: not counted.
    assert refusal(found, complete("other")) is None
    assert rejections("lane-count", "interactive", "QUEUE_FULL") == before + 1


# --- over HTTP: the daemon's refusal, in each dialect ---------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def shim(daemon: Daemon) -> AbstractAsyncContextManager[tuple[httpx.AsyncClient, Any]]:
    return asgi_shim(daemon.target)


DIALECTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stream": True}),
    (
        "/v1/messages",
        {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
    ),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}),
    ("/api/generate", {"model": "tiny", "prompt": "Hi"}),
    ("/v1/responses", {"model": "tiny", "input": "Hi"}),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "stream": True}),
]


def _comparable(response: httpx.Response) -> tuple[int, str | None, Any]:
    body = response.json()
    if isinstance(body, dict):
        body.pop("request_id", None)
    return response.status_code, response.headers.get("retry-after"), body


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body"), DIALECTS)
async def test_a_closed_gate_answers_what_the_daemon_would(path: str, body: dict[str, Any]) -> None:
    """The same request, refused by the daemon and then by a closed gate carrying its
    refusal: the same status, Retry-After and body; the second never reaches it."""
    async with fake_daemon() as daemon, shim(daemon) as (client, app):
        daemon.fake.scripts["tiny"] = [FULL]
        from_daemon = await client.post(path, json=body)
        assert from_daemon.status_code == 429
        assert len(daemon.fake.requests) == 1
        daemon.fake.admission.put_nowait(message(gate()))
        await poll(lambda: app.state.gates.listed() != [], what="the gate to close")
        from_gate = await client.post(path, json=body)
        assert _comparable(from_gate) == _comparable(from_daemon)
        assert len(daemon.fake.requests) == 1
        # A malformed request still gets its 400 first.
        bad = await client.post(path, json={**body, "model": 7})
        assert bad.status_code == 400
        # The gate opens: the next request goes to the daemon again.
        daemon.fake.admission.put_nowait(message())
        await poll(lambda: app.state.gates.listed() == [], what="the gate to open")
        await client.post(path, json=body)
        assert len(daemon.fake.requests) == 2


@pytest.mark.anyio
async def test_every_generation_goes_on_tagged_for_the_watcher_the_stream_names() -> None:
    async with fake_daemon() as daemon, shim(daemon) as (client, app):
        daemon.fake.scripts["tiny"] = [FULL]
        await poll(lambda: daemon.fake.watchers != [], what="the stream to open")
        watcher = app.state.gates.watcher
        assert daemon.fake.watchers == [watcher]
        for path, body in DIALECTS:
            await client.post(path, json=body)
        # Not the other calls: they fill no slot.
        await client.post("/v1/embeddings", json={"model": "tiny", "input": "Hi"})
        tags = [m.get("x-blazar-gate-seq") for m in daemon.fake.metadata]
        assert tags == [f"{watcher}:{n}" for n in range(1, len(DIALECTS) + 1)] + [None]


@pytest.mark.anyio
async def test_a_generation_whose_call_ended_fills_no_gate() -> None:
    """A filling gate for one more request: each one that went on and ended (here
    before any message included it) leaves it open for the next."""
    async with fake_daemon() as daemon, shim(daemon) as (client, app):
        daemon.fake.scripts["tiny"] = [delta("x"), final()]
        daemon.fake.admission.put_nowait(message(gate(LATE, after=(1, 50))))
        await poll(lambda: app.state.gates.listed() != [], what="the gate to be listed")
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 60}
        for _ in range(3):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert len(daemon.fake.requests) == 3


@pytest.mark.anyio
async def test_the_shim_follows_the_stream_again_after_it_ends() -> None:
    async with fake_daemon() as daemon, shim(daemon) as (_client, app):
        daemon.fake.admission.put_nowait(message(gate()))
        await poll(lambda: app.state.gates.listed() != [], what="the gate to close")
        daemon.fake.admission.put_nowait(None)  # the daemon ends the stream
        await poll(lambda: app.state.gates.listed() == [], what="the gates to be dropped")
        daemon.fake.admission.put_nowait(message(gate()))
        await poll(lambda: app.state.gates.listed() != [], what="the stream to be followed again")


def test_gates_of_no_message_refuse_nothing() -> None:
    assert refusal(gates.AdmissionGates(), complete()) is None
