"""Upstream Lanes' pure pieces: the OpenAI translation both ways, error mapping, the
probe's status and events, and the route an upstream Lane makes."""

from __future__ import annotations

import asyncio
import email.utils
import json
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2 as pb
from blazar.api import errors, kinds, manifests
from blazar.api.kinds import Kind
from blazar.api.meta import ObjectMeta
from blazar.controller import upstream_plan
from blazar.controller.lane import LaneReconciler
from blazar.dataplane import routing
from blazar.enginehost import upstream
from blazar.enginehost import upstream_convert as convert
from blazar.enginehost.upstream import Probe
from blazar.store.memory import MemoryStore
from tests.unit.helpers import Clock
from tests.unit.test_controller import MODEL, FakeProcesses, apply, cond

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def chat_request(**sampling: Any) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(
            messages=[
                pb.Message(role="user", content="hi", name="ann"),
                pb.Message(
                    role="assistant",
                    tool_calls=[pb.ToolCall(id="c1", name="f", arguments='{"a":1}')],
                ),
                pb.Message(role="tool", content="2", tool_call_id="c1", name="f"),
            ],
            tools=[pb.Tool(name="f", description="d", parameters='{"type":"object"}')],
            tool_choice=pb.ToolChoice(mode=pb.ToolChoice.MODE_NAMED, name="f"),
            parallel_tool_calls=False,
        ),
        sampling=pb.Sampling(**sampling),
    )


def test_a_chat_request_becomes_an_openai_body() -> None:
    request = chat_request(
        temperature=0.5, max_tokens=7, stop=["x"], seed=3, top_k=5, logprobs=True, top_logprobs=2
    )
    request.sampling.logit_bias[12] = -100.0
    route, body = convert.request_body(request, model="up")
    assert route == "chat/completions"
    assert body["model"] == "up" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [
        {"role": "user", "content": "hi", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
            ],
        },
        {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "f"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False
    assert body["temperature"] == 0.5 and body["max_tokens"] == 7 and body["seed"] == 3
    assert body["stop"] == ["x"] and body["top_k"] == 5
    assert body["logit_bias"] == {"12": -100.0}
    assert body["logprobs"] is True and body["top_logprobs"] == 2
    assert "top_p" not in body  # unset stays unset: the upstream's default


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (pb.Constraint(json_object=True), {"type": "json_object"}),
        (
            pb.Constraint(json_schema='{"type":"string"}'),
            {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": {"type": "string"}, "strict": True},
            },
        ),
    ],
)
def test_structured_output_passes_as_response_format(
    constraint: pb.Constraint, expected: dict[str, Any]
) -> None:
    request = engine_pb2.GenerateRequest(prompt="p", constraint=constraint)
    route, body = convert.request_body(request, model="m")
    assert route == "completions" and body["prompt"] == "p"
    assert body["response_format"] == expected


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            engine_pb2.GenerateRequest(prompt="p", constraint=pb.Constraint(grammar="root ::= x")),
            "constraint",
        ),
        (
            engine_pb2.GenerateRequest(prompt="p", sampling=pb.Sampling(prompt_logprobs=True)),
            "prompt_logprobs",
        ),
        (
            engine_pb2.GenerateRequest(prompt="p", constraint=pb.Constraint(json_schema="{")),
            "constraint",
        ),
        # Blazar cannot bound what the upstream counts.
        (
            engine_pb2.GenerateRequest(prompt="p", sampling=pb.Sampling(context_limit=16)),
            "context_limit",
        ),
        # A name the mode would drop (the engine refuses it too: `tools.parse`).
        (
            engine_pb2.GenerateRequest(
                chat=engine_pb2.ChatInput(
                    messages=[pb.Message(role="user", content="hi")],
                    tools=[pb.Tool(name="f")],
                    tool_choice=pb.ToolChoice(mode=pb.ToolChoice.MODE_AUTO, name="f"),
                )
            ),
            "tool_choice",
        ),
        # OpenAI-compatible servers do not agree on how a prefill is asked for.
        (
            engine_pb2.GenerateRequest(
                chat=engine_pb2.ChatInput(
                    messages=[
                        pb.Message(role="user", content="hi"),
                        pb.Message(role="assistant", content="Sure"),
                    ],
                    continue_final_message=True,
                )
            ),
            "continue_final_message",
        ),
    ],
)
def test_what_cannot_pass_is_refused(request_: engine_pb2.GenerateRequest, field: str) -> None:
    refused = convert.refusal(request_)
    assert isinstance(refused, errors.InvalidRequest)
    assert refused.metadata[errors.FIELD_KEY] == field
    with pytest.raises(errors.InvalidRequest):
        convert.request_body(request_, model="m")


def test_a_chat_stream_becomes_chunks() -> None:
    t = convert.StreamTranslator()
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}
                        ]
                    },
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 9,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
    ]
    chunks = [c for e in events for c in t.feed(e)]
    assert [c.delta.text for c in chunks] == ["Hel", ""]
    assert chunks[1].delta.tool_calls[0] == pb.ToolCallDelta(
        index=0, id="c", name="f", arguments="{"
    )
    final = t.finish(prefill_s=0.25, decode_s=0.5).final
    assert (final.timings.prefill_ms, final.timings.decode_ms) == (250.0, 500.0)
    assert final.timings.decode_tokens_per_second == 4.0  # 2 tokens after the first
    assert final.finish_reason == pb.FINISH_REASON_TOOL_CALLS and final.tool_calls == 1
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (9, 3)
    assert final.usage.cached_tokens == 4 == final.routing.prefix_tokens_reused


def test_a_completion_stream_with_logprobs_and_no_usage() -> None:
    t = convert.StreamTranslator()
    chunks = t.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "ab",
                    "logprobs": {
                        "tokens": ["a", "b"],
                        "token_logprobs": [-0.5, -1.0],
                        "top_logprobs": [{"a": -0.5}, {"b": -1.0}],
                    },
                    "finish_reason": "length",
                }
            ]
        }
    )
    assert chunks[0].delta.tokens == 2
    assert [lp.logprob for lp in chunks[0].delta.logprobs] == [-0.5, -1.0]
    final = t.finish().final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 2  # counted when the upstream reports none


@pytest.mark.parametrize("count", [-5, 2**31, 1e300, "many", True, None])
def test_usage_that_is_no_count_is_not_taken(count: object) -> None:
    # A negative count reached the daemon's Prometheus counters, which raised: the
    # request failed with a 500 after the upstream had answered it whole.
    t = convert.StreamTranslator()
    t.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": count, "completion_tokens": count}
    t.feed({"choices": [], "usage": {**usage, "prompt_tokens_details": {"cached_tokens": count}}})
    final = t.finish().final
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (0, 1)
    assert final.usage.cached_tokens == 0 == final.routing.prefix_tokens_reused


def test_an_error_event_mid_stream_is_unavailable() -> None:
    with pytest.raises(errors.Unavailable, match="boom"):
        convert.StreamTranslator().feed({"error": {"message": "boom"}})


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, errors.InvalidRequest),
        (422, errors.InvalidRequest),
        (401, errors.Unavailable),
        (404, errors.Unavailable),
        (429, errors.Overloaded),
        (500, errors.Unavailable),
        (503, errors.Unavailable),
    ],
)
def test_http_errors(status: int, kind: type[errors.BlazarError]) -> None:
    err = convert.http_error(status, json.dumps({"error": {"message": "why"}}), retry_after_ms=2000)
    assert type(err) is kind
    assert "why" in err.message and str(status) in err.message
    # The hint of a 429 and a 503 passes on; no other status's means waiting helps.
    hinted = {errors.RETRY_AFTER_KEY: "2000"} if status in (429, 503) else {}
    assert err.metadata == hinted


RETRY_NOW = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("header", "millis"),
    [
        (None, None),
        ("2", 2000),
        (" 7 ", 7000),
        ("0", 0),
        ("99999999999999999999", convert.MAX_RETRY_AFTER_S * 1000),
        # HTTP-dates: IMF-fixdate, and the obsolete RFC 850 and asctime forms.
        ("Wed, 02 Dec 2026 12:00:30 GMT", 30_000),
        ("Wednesday, 02-Dec-26 12:01:00 GMT", 60_000),
        ("Wed Dec  2 12:00:05 2026", 5_000),
        ("Wed, 02 Dec 2026 11:59:00 GMT", 0),  # past
        ("Thu, 03 Dec 2026 12:00:00 GMT", convert.MAX_RETRY_AFTER_S * 1000),
        ("soon", None),
        ("-5", None),
        ("1.5", None),
        ("", None),
        ("\u0662", None),  # a digit, but not an ASCII one
    ],
)
def test_retry_after_is_seconds_or_an_http_date(header: str | None, millis: int | None) -> None:
    assert convert.retry_after_ms(header, now=RETRY_NOW) == millis


def test_an_upstreams_retry_after_date_is_the_callers_hint() -> None:
    """A 503 (and a 429) whose Retry-After is an HTTP-date keeps its hint."""
    later = email.utils.format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)

    def answer(request: httpx.Request) -> httpx.Response:
        status = 503 if json.loads(request.content)["messages"][0]["content"] == "a" else 429
        return httpx.Response(
            status, json={"error": {"message": "busy"}}, headers={"retry-after": later}
        )

    client = upstream.UpstreamClient(spec_of(), transport=httpx.MockTransport(answer))

    async def run(text: str) -> errors.BlazarError:
        request = engine_pb2.GenerateRequest(
            chat=engine_pb2.ChatInput(messages=[pb.Message(role="user", content=text)])
        )
        try:
            async for _ in client.generate(request, model="g"):
                pass
        except errors.BlazarError as err:
            return err
        raise AssertionError("no error")

    async def main() -> list[errors.BlazarError]:
        try:
            return [await run("a"), await run("b")]
        finally:
            await client.close()

    unavailable, overloaded = asyncio.run(main())
    assert isinstance(unavailable, errors.Unavailable)
    assert isinstance(overloaded, errors.Overloaded)
    for err in (unavailable, overloaded):
        # The date has whole seconds: up to one less, and a slow test's few more.
        assert 100_000 <= int(err.metadata[errors.RETRY_AFTER_KEY]) <= 120_000


@pytest.mark.parametrize(
    ("failures", "seconds"),
    [
        (0, upstream_plan.PROBE_PERIOD_S),
        (1, 5.0),
        (2, 10.0),
        (3, upstream_plan.MAX_PROBE_INTERVAL_S),
    ],
)
def test_probe_backs_off_up_to_its_bound(failures: int, seconds: float) -> None:
    assert upstream_plan.next_probe_s(failures) == seconds


def test_probe_status_and_events() -> None:
    first = kinds.LaneStatus()
    up = upstream_plan.upstream_status(
        previous=first, generation=2, url="http://u/v1", ok=True, message="answers", now=NOW
    )
    assert upstream_plan.transition(first, ok=True, message="answers") == upstream_plan.Event(
        "Normal", "UpstreamAvailable", "answers"
    )
    assert {c.type: (c.status.value, c.reason) for c in up.conditions} == {
        "Available": ("True", "UpstreamAnswering"),
        "Ready": ("True", "UpstreamAnswering"),
        "Degraded": ("False", "ProbeSucceeded"),
    }
    assert up.ready_replicas == 1 and up.replica_statuses[0].state == "Ready"
    assert up.replica_statuses[0].socket == "http://u/v1"
    # The same answer again: no event, no change.
    assert upstream_plan.transition(up, ok=True, message="answers") is None
    same = upstream_plan.upstream_status(
        previous=up,
        generation=2,
        url="http://u/v1",
        ok=True,
        message="answers",
        now=NOW + timedelta(seconds=5),
    )
    assert same == up
    down = upstream_plan.upstream_status(
        previous=up, generation=2, url="http://u/v1", ok=False, message="refused", now=NOW
    )
    assert upstream_plan.transition(up, ok=False, message="refused") == upstream_plan.Event(
        "Warning", "UpstreamUnavailable", "refused"
    )
    available = next(c for c in down.conditions if c.type == "Available")
    assert (available.status.value, available.message) == ("False", "refused")
    assert down.ready_replicas == 0 and down.replica_statuses[0].state == "Failed"


def test_stale_local_conditions_are_dropped() -> None:
    previous = kinds.LaneStatus.model_validate(
        {
            "conditions": [
                {
                    "type": "ModelReady",
                    "status": "False",
                    "reason": "X",
                    "message": "m",
                    "lastTransitionTime": NOW.isoformat(),
                    "observedGeneration": 1,
                }
            ]
        }
    )
    status = upstream_plan.upstream_status(
        previous=previous, generation=1, url="http://u", ok=True, message="ok", now=NOW
    )
    assert "ModelReady" not in {c.type for c in status.conditions}


def upstream_lane(ok: bool) -> kinds.Lane:
    spec = kinds.LaneSpec.model_validate(
        {
            "engine": "upstream",
            "upstream": {"url": "http://u/v1", "model": "g", "maxConcurrency": 3},
        }
    )
    status = upstream_plan.upstream_status(
        previous=kinds.LaneStatus(),
        generation=1,
        url="http://u/v1",
        ok=ok,
        message="refused.",
        now=NOW,
    )
    return kinds.Lane(metadata=ObjectMeta(name="r"), spec=spec, status=status)


def test_an_upstream_lane_routes_to_its_one_replica_while_it_answers() -> None:
    route = routing.build_table([upstream_lane(True)]).by_name["r"]
    assert route.model == "g" and route.slots == 3 and route.max_parked_bytes == 0
    assert route.upstream is not None and route.upstream.url == "http://u/v1"
    assert routing.pick_replica(route, {}, now=0.0).index == 0
    down = routing.build_table([upstream_lane(False)]).by_name["r"]
    assert down.replicas == ()
    with pytest.raises(errors.Unavailable, match="upstream server that does not answer: refused"):
        routing.pick_replica(down, {}, now=0.0)


UPSTREAM_LANE = """
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: l}
spec: {engine: upstream, upstream: {url: "http://u:1/v1", model: g}}
"""


def test_the_reconciler_probes_and_reports_without_a_process() -> None:
    """State, not calls: no process starts; conditions, replica and events follow the
    probe's answer; the next look is the period, or the back-off while it fails."""
    clock = Clock()
    store = MemoryStore()
    procs = FakeProcesses(clock)
    answers: list[Probe] = []

    class Probes:
        async def probe(self, spec: kinds.Upstream) -> Probe:
            assert spec.url == "http://u:1/v1"
            return answers.pop(0)

        async def retain(self, specs: Iterable[kinds.Upstream]) -> None:
            pass

    rec = LaneReconciler(store=store, processes=procs, clock=clock, probes=Probes())
    apply(store, UPSTREAM_LANE)

    def look(answer: Probe) -> float | None:
        answers.append(answer)
        return asyncio.run(rec.reconcile("l")).requeue_after

    assert look(Probe(True, "answers.")) == upstream_plan.PROBE_PERIOD_S
    assert procs.observe("l") == [] and procs.started == []
    assert cond(store, "Available") == ("True", "UpstreamAnswering")
    assert look(Probe(False, "cannot connect.")) == upstream_plan.PROBE_PERIOD_S
    assert cond(store, "Available") == ("False", "UpstreamUnavailable")
    assert cond(store, "Ready") == ("False", "UpstreamUnavailable")
    assert look(Probe(False, "cannot connect.")) == 2 * upstream_plan.PROBE_PERIOD_S
    assert look(Probe(True, "answers.")) == upstream_plan.PROBE_PERIOD_S
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, kinds.Lane) and lane.status.ready_replicas == 1
    reasons = [e.reason for e in store.events(kind="Lane", name="l")]
    assert reasons == ["UpstreamAvailable", "UpstreamUnavailable", "UpstreamAvailable"]


def test_an_upstream_lane_whose_slo_policy_is_deleted_says_so() -> None:
    """As a local Lane does (DESIGN §3: references that disappear show as conditions):
    an upstream Lane whose SLOPolicy is deleted admits first come first served, and
    said nothing, its status rebuilt from each probe. Now `ResolvedRefs` is False (one
    Warning over several probes), and True once the policy is back."""
    clock = Clock()
    store = MemoryStore()
    procs = FakeProcesses(clock)

    class Probes:
        async def probe(self, spec: kinds.Upstream) -> Probe:
            return Probe(True, "answers.")

        async def retain(self, specs: Iterable[kinds.Upstream]) -> None:
            pass

    rec = LaneReconciler(store=store, processes=procs, clock=clock, probes=Probes())
    policy = (
        "apiVersion: blazar.dev/v1alpha1\nkind: SLOPolicy\nmetadata: {name: p}\n"
        "spec: {priority: 100, ttftTargetMs: 2000}\n"
    )
    apply(store, policy + "---\n" + UPSTREAM_LANE.replace("model: g}", "model: g}, sloPolicy: p"))
    asyncio.run(rec.reconcile("l"))
    store.delete(Kind.SLO_POLICY, "p")
    for _ in range(3):
        asyncio.run(rec.reconcile("l"))
    assert cond(store, "ResolvedRefs") == ("False", "RefNotFound")
    assert cond(store, "Available") == ("True", "UpstreamAnswering")
    reasons = [e.reason for e in store.events(kind="Lane", name="l")]
    assert reasons.count("RefNotFound") == 1
    apply(store, policy)
    asyncio.run(rec.reconcile("l"))
    assert cond(store, "ResolvedRefs") == ("True", "AllRefsResolved")


def test_the_controller_retires_the_probe_clients_of_specs_no_lane_has() -> None:
    """State: the probe pool holds a client for each upstream a Lane is probed at; one
    whose url was edited, that became an engine Lane, or that was deleted, has its
    client closed (before, each edit left a client and its connections open for good)."""
    clock = Clock()
    store = MemoryStore()
    procs = FakeProcesses(clock)
    pool = upstream.UpstreamPool(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, json={"data": []}))
    )
    rec = LaneReconciler(store=store, processes=procs, clock=clock, probes=pool)

    def lane(name: str, url: str) -> str:
        return (
            f"apiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {{name: {name}}}\n"
            f"spec: {{engine: upstream, upstream: {{url: '{url}', model: g}}}}\n"
        )

    def held() -> set[str]:
        return {client.spec.url for client in pool._clients.values()}

    async def main() -> None:
        apply(store, lane("a", "http://one/v1") + "---\n" + lane("b", "http://one/v1"))
        await rec.reconcile("a")
        await rec.reconcile("b")
        first = pool.client(spec_of(url="http://one/v1", model="g"))
        assert held() == {"http://one/v1"}
        apply(store, lane("a", "http://two/v1"))
        await rec.reconcile("a")
        assert held() == {"http://one/v1", "http://two/v1"}  # b still probes one
        assert not first._http.is_closed
        store.delete(Kind.LANE, "b")
        await rec.reconcile("b")
        assert held() == {"http://two/v1"} and first._http.is_closed
        second = pool.client(spec_of(url="http://two/v1", model="g"))
        engine_lane = "apiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {name: a}\n"
        apply(store, MODEL + "---\n" + engine_lane + "spec: {model: m}\n")
        await rec.reconcile("a")
        assert held() == set() and second._http.is_closed
        await pool.close()

    asyncio.run(main())


def test_retains_that_overlap_retire_each_client_once() -> None:
    """The data plane starts a retain per table refresh: two may overlap, each
    awaiting a client's close (which waits on its connections); neither may find the
    other's client gone from the pool (a KeyError in a task nobody awaits)."""

    class Slow(upstream.UpstreamClient):
        closed = 0

        async def close(self) -> None:
            await asyncio.sleep(0)  # as a client with open connections does
            Slow.closed += 1
            await super().close()

    pool = upstream.UpstreamPool()
    for url in ("http://a/v1", "http://b/v1"):
        pool._clients[spec_of(url=url).model_dump_json()] = Slow(spec_of(url=url))

    async def main() -> None:
        await asyncio.gather(pool.retain([]), pool.retain([]))

    asyncio.run(main())
    assert Slow.closed == 2 and pool._clients == {}


def test_an_upstream_lane_as_get_prints_it_applies_again() -> None:
    """`get -o yaml` prints every default (slots, kvCache, ...): equal to the
    defaults, they pass; the stored model name is upstream.model's."""
    docs = manifests.parse_documents(UPSTREAM_LANE, source="a.yaml")
    [lane] = manifests.validate_objects(docs, exists=lambda kind, name: False)
    assert isinstance(lane, kinds.Lane) and lane.spec.model == "g"
    printed = manifests.to_dict(lane)
    assert printed["spec"]["slots"] == 4 and printed["spec"]["model"] == "g"
    [again] = manifests.validate_objects([("b.yaml#1", printed)], exists=lambda k, n: False)
    assert again == lane


def sse(*events: dict[str, Any]) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )


def spec_of(**fields: Any) -> kinds.Upstream:
    return kinds.Upstream.model_validate({"url": "http://u:1/v1", "model": "g", **fields})


def test_the_client_sends_the_key_streams_and_maps_errors(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against httpx's mock transport: the key from its file on every request, the
    body on the chat route, the stream back as chunks; an error answer mapped."""
    key = tmp_path / "key"
    key.write_text("sk-secret\n")
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "g"}]})
        body = json.loads(request.content)
        if body["messages"][0]["content"] == "busy":
            return httpx.Response(
                429, json={"error": {"message": "full"}}, headers={"retry-after": "3"}
            )
        return httpx.Response(
            200,
            content=sse(
                {"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
            ),
        )

    client = upstream.UpstreamClient(
        spec_of(apiKeyFrom="file:key"), keys=tmp_path, transport=httpx.MockTransport(answer)
    )

    def chat(text: str) -> engine_pb2.GenerateRequest:
        return engine_pb2.GenerateRequest(
            chat=engine_pb2.ChatInput(messages=[pb.Message(role="user", content=text)])
        )

    async def run() -> tuple[upstream.Probe, list[pb.Chunk]]:
        probe = await client.probe()
        chunks = [c async for c in client.generate(chat("hi"), model="g")]
        with pytest.raises(errors.Overloaded, match="full") as refused:
            async for _ in client.generate(chat("busy"), model="g"):
                pass
        assert refused.value.metadata[errors.RETRY_AFTER_KEY] == "3000"
        await client.close()
        return probe, chunks

    probe, chunks = asyncio.run(run())
    assert probe == upstream.Probe(True, "http://u:1/v1 answers and serves g.")
    assert [c.delta.text for c in chunks[:-1]] == ["ok"]
    assert chunks[-1].final.usage.prompt_tokens == 5
    assert {r.headers["authorization"] for r in seen} == {"Bearer sk-secret"}
    assert [r.url.path for r in seen] == ["/v1/models"] + ["/v1/chat/completions"] * 2


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"apiKeyFrom": "env:BLAZAR_TEST_NO_SUCH_KEY"},
            "environment variable BLAZAR_TEST_NO_SUCH_KEY",
        ),
        ({"apiKeyFrom": "file:no-such-key"}, "key file /nonexistent/keys/no-such-key cannot"),
        (
            {"url": "https://u/v1", "tls": {"caFile": "/nonexistent/ca.pem"}},
            "caFile /nonexistent/ca.pem",
        ),
    ],
)
def test_a_key_or_ca_that_cannot_be_read_fails_the_probe_and_requests(
    fields: dict[str, Any], problem: str
) -> None:
    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing is sent")

    client = upstream.UpstreamClient(
        spec_of(**fields), keys=Path("/nonexistent/keys"), transport=httpx.MockTransport(never)
    )

    async def run() -> upstream.Probe:
        probe = await client.probe()
        with pytest.raises(errors.Unavailable, match=problem):
            async for _ in client.generate(engine_pb2.GenerateRequest(prompt="p"), model="g"):
                pass
        await client.close()
        return probe

    probe = asyncio.run(run())
    assert not probe.ok and problem in probe.message


def test_a_refused_connection_is_unavailable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = upstream.UpstreamClient(spec_of(), transport=httpx.MockTransport(refuse))

    async def run() -> upstream.Probe:
        probe = await client.probe()
        with pytest.raises(errors.Unavailable, match="cannot connect"):
            async for _ in client.generate(engine_pb2.GenerateRequest(prompt="p"), model="g"):
                pass
        await client.close()
        return probe

    probe = asyncio.run(run())
    assert not probe.ok and "cannot connect" in probe.message


@pytest.mark.parametrize(
    "source",
    # Whoever applies the manifest names the url the key goes to: no other secret of the
    # daemon may be named (its environment, its files).
    ["env:AWS_SECRET_ACCESS_KEY", "env:HOME", "file:/etc/passwd", "file:../state.db", "file:.x"],
)
def test_a_key_from_outside_blazars_own_is_refused_at_apply(source: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="env:BLAZAR_NAME"):
        spec_of(apiKeyFrom=source)


def test_a_file_key_without_a_keys_directory_is_unavailable() -> None:
    with pytest.raises(errors.Unavailable, match="this daemon has none"):
        upstream.api_key(spec_of(apiKeyFrom="file:vllm.key"), None)


def stream_from(
    response: httpx.Response,
    *,
    spec: kinds.Upstream | None = None,
    sampling: pb.Sampling | None = None,
    received: list[pb.Chunk] | None = None,
) -> list[pb.Chunk]:
    """What a chat through a client (of `spec`) whose upstream gives `response` yields,
    each chunk also put in `received` as it comes (for a stream that then fails); a
    stream that never ends fails the test in 5 s rather than hang it."""
    client = upstream.UpstreamClient(
        spec or spec_of(), transport=httpx.MockTransport(lambda _: response)
    )
    chunks = [] if received is None else received

    async def run() -> None:
        try:
            request = engine_pb2.GenerateRequest(
                chat=engine_pb2.ChatInput(messages=[pb.Message(role="user", content="hi")])
            )
            if sampling is not None:
                request.sampling.CopyFrom(sampling)
            async for chunk in client.generate(request, model="g"):
                chunks.append(chunk)
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(run(), timeout=5))
    return chunks


TEXT = {"choices": [{"index": 0, "delta": {"content": "a"}}]}
STOP = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
SSE_HEADERS = {"content-type": "text/event-stream"}


def test_an_upstream_that_streams_past_max_tokens_is_cut_there() -> None:
    # One that ignored max_tokens streamed on (here: without end) and the caller's
    # request, and the Lane's slot, with it.
    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield f"data: {json.dumps(TEXT)}\n\n".encode()
            await asyncio.sleep(0)  # a test that fails times out rather than spins

    chunks = stream_from(
        httpx.Response(200, headers=SSE_HEADERS, content=endless()),
        sampling=pb.Sampling(max_tokens=3),
    )
    assert [c.delta.text for c in chunks[:-1]] == ["a", "a", "a"]
    final = chunks[-1].final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 3


def test_keep_alive_comments_alone_are_silence() -> None:
    # An upstream that sent a token, then only comments, held the stream forever:
    # each comment reset the read timeout.
    async def drip() -> AsyncIterator[bytes]:
        yield f"data: {json.dumps(TEXT)}\n\n".encode()
        while True:
            yield b": ping\n\n"
            await asyncio.sleep(0.01)

    received: list[pb.Chunk] = []
    with pytest.raises(errors.Unavailable, match="only keep-alive comments"):
        stream_from(
            httpx.Response(200, headers=SSE_HEADERS, content=drip()),
            spec=spec_of(timeouts={"firstByte": "200ms"}),
            received=received,
        )
    assert [c.delta.text for c in received] == ["a"]


def test_an_answer_is_whole_at_its_usage_after_its_finish_reason() -> None:
    # An upstream that sent its finish reason and usage, then neither [DONE] nor the
    # end of its body, had the whole answer fail at the first-byte timeout.
    async def then_nothing() -> AsyncIterator[bytes]:
        usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
        for event in (TEXT, STOP, usage):
            yield f"data: {json.dumps(event)}\n\n".encode()
        await asyncio.sleep(3600)

    chunks = stream_from(httpx.Response(200, headers=SSE_HEADERS, content=then_nothing()))
    assert [c.delta.text for c in chunks[:-1]] == ["a"]
    final = chunks[-1].final
    assert final.finish_reason == pb.FINISH_REASON_STOP
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (4, 1)


def test_an_answer_of_exactly_max_tokens_is_whole() -> None:
    t = convert.StreamTranslator(max_tokens=2)
    chunks = [c for e in (TEXT, TEXT, STOP) for c in t.feed(e)]
    assert len(chunks) == 2 and not t.overran
    assert t.finish().final.finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("response", "said"),
    [
        # The upstream stopped after some text (its body ended with its connection).
        (
            httpx.Response(200, headers=SSE_HEADERS, content=b"data: " + json.dumps(TEXT).encode()),
            "ended mid-answer",
        ),
        # Not a stream at all: a web page, or a non-streamed answer.
        (
            httpx.Response(200, headers={"content-type": "text/html"}, content=b"<html></html>"),
            "content-type text/html",
        ),
        (
            httpx.Response(200, json={"choices": [{"message": {"content": "hi"}}]}),
            "no server-sent event",
        ),
    ],
)
def test_an_answer_that_is_not_whole_is_unavailable(response: httpx.Response, said: str) -> None:
    """Never rendered as a whole answer that stopped: the caller would take a cut or
    empty text for the model's."""
    with pytest.raises(errors.Unavailable, match=said):
        stream_from(response)


def test_a_finish_reason_without_done_is_a_whole_answer() -> None:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (TEXT, STOP))
    chunks = stream_from(httpx.Response(200, headers=SSE_HEADERS, content=body))
    assert [c.delta.text for c in chunks[:-1]] == ["a"]
    assert chunks[-1].final.finish_reason == pb.FINISH_REASON_STOP


def test_a_line_without_end_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream, "MAX_EVENT_BYTES", 1000)
    body = b"data: " + b"x" * 5000
    with pytest.raises(errors.Unavailable, match="line of more than 1000 bytes"):
        stream_from(httpx.Response(200, headers=SSE_HEADERS, content=body))


def test_lines_split_on_crlf_and_across_reads() -> None:
    parts = [b"data: " + json.dumps(TEXT).encode()[:5], json.dumps(TEXT).encode()[5:] + b"\r\n\r"]
    parts += [b"\ndata: " + json.dumps(STOP).encode() + b"\r\n\r\ndata: [DONE]"]

    async def body() -> Any:
        for part in parts:
            yield part

    chunks = stream_from(httpx.Response(200, headers=SSE_HEADERS, content=body()))
    assert [c.delta.text for c in chunks[:-1]] == ["a"]


@pytest.mark.parametrize(
    "event",
    [
        [1, 2],
        "text",
        {"choices": 5},
        {"choices": [{"index": 0, "delta": {"content": 5}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "f"}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": ["call"]}}]},
        {"choices": [{"index": 0, "text": "a", "logprobs": {"content": [{"logprob": "x"}]}}]},
    ],
)
def test_an_event_not_shaped_as_openais_is_unavailable(event: Any) -> None:
    """A server that is not OpenAI-compatible (or a broken one) is the Lane's problem,
    UNAVAILABLE, never an INTERNAL error of Blazar's."""
    with pytest.raises(errors.Unavailable, match="not shaped as OpenAI's"):
        convert.StreamTranslator().feed(event)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        # Each was stored, and then never worked: the probe failed on the leading
        # blank; the port made every reconcile raise (no condition, requests told to
        # "retry shortly" for ever); a zero timeout timed every connection out at once.
        ({"url": " http://u:1/v1"}, "space or a control character"),
        ({"url": "http://u:1/v1\n"}, "space or a control character"),
        ({"url": "http://u:99999/v1"}, "no valid port"),
        ({"url": "http://u:0/v1"}, "no valid port"),
        ({"url": "http://u:x/v1"}, "no valid port"),
        ({"timeouts": {"connect": "0s"}}, "longer than 0"),
        ({"timeouts": {"firstByte": "0"}}, "longer than 0"),
    ],
)
def test_an_upstream_that_could_never_be_reached_is_refused_at_apply(
    fields: dict[str, Any], said: str
) -> None:
    with pytest.raises(pydantic.ValidationError, match=said):
        spec_of(**fields)


def test_a_stored_upstream_loads_as_it_was() -> None:
    stored = {"url": "http://u:1/v1", "model": "g", "timeouts": {"connect": "0s"}}
    spec = kinds.Upstream.model_validate(stored, context={kinds.STORED: True})
    assert spec.timeouts.connect == "0s"


def probed_once(client: upstream.UpstreamClient) -> upstream.Probe:
    """One probe of `client`, which is closed after it."""

    async def run() -> upstream.Probe:
        try:
            return await client.probe()
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize(
    "response",
    [
        # A url that reaches a web page (an SPA answers 200 to every path) or another API.
        httpx.Response(200, headers={"content-type": "text/html"}, content=b"<html></html>"),
        httpx.Response(200, json=["gemma"]),
        httpx.Response(200, json={"models": [{"name": "gemma"}]}),
    ],
)
def test_a_probe_answered_without_a_model_list_fails(response: httpx.Response) -> None:
    """Else the Lane would be Ready while every request it sends fails."""
    client = upstream.UpstreamClient(spec_of(), transport=httpx.MockTransport(lambda _: response))

    probe = probed_once(client)
    assert not probe.ok and "not with OpenAI's model list" in probe.message


def test_a_retired_client_closes_once_its_streams_end() -> None:
    """A spec no Lane uses any more (edited, or its Lane deleted): the pool retires its
    client, which lets the generation streaming through it finish, then closes; a new
    spec gets a client of its own; an idle retired client closes at once."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            content=sse(
                {"choices": [{"index": 0, "delta": {"content": "a"}}]},
                {"choices": [{"index": 0, "delta": {"content": "b"}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            ),
        )

    old, new = spec_of(), spec_of(model="h")
    pool = upstream.UpstreamPool()
    transport = httpx.MockTransport(answer)
    # The pool's clients, against the mock transport.
    pool._clients[old.model_dump_json()] = upstream.UpstreamClient(old, transport=transport)
    streaming = pool.client(old)

    async def run() -> tuple[list[str], bool, bool]:
        call = streaming.generate(chat_request(), model="g")
        chunks = aiter(call)
        texts = [(await anext(chunks)).delta.text]
        await pool.retain([new])
        open_while_streaming = not streaming._http.is_closed
        texts += [c.delta.text async for c in chunks if c.HasField("delta")]
        idle = pool.client(new)
        await pool.retain([])
        return texts, open_while_streaming, idle._http.is_closed

    texts, open_while_streaming, idle_closed = asyncio.run(run())
    assert texts == ["a", "b"]
    assert open_while_streaming and streaming._http.is_closed
    assert idle_closed
    assert pool.client(old) is not streaming  # a spec in use again gets a new client


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(401, json={"error": {"message": "Invalid API key sk-secret"}}),
        httpx.Response(
            200,
            content=b'data: {"error": {"message": "key sk-secret revoked"}}\n\n',
            headers=SSE_HEADERS,
        ),
        httpx.Response(200, content=b"data: sk-secret?\n\n", headers=SSE_HEADERS),
    ],
)
def test_an_upstream_that_quotes_the_key_has_it_redacted(
    tmp_path: Path, answer: httpx.Response
) -> None:
    """What an upstream says reaches callers, statuses, events and logs: a server that
    quotes the key it was sent (as some do when they refuse it) must not show it there."""
    (tmp_path / "key").write_text("sk-secret\n")

    def respond(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(401, json={"error": {"message": "Invalid API key sk-secret"}})
        return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)

    client = upstream.UpstreamClient(
        spec_of(apiKeyFrom="file:key"), keys=tmp_path, transport=httpx.MockTransport(respond)
    )

    async def run() -> tuple[upstream.Probe, errors.BlazarError]:
        probe = await client.probe()
        with pytest.raises(errors.Unavailable) as failed:
            async for _ in client.generate(engine_pb2.GenerateRequest(prompt="p"), model="g"):
                pass
        await client.close()
        return probe, failed.value

    probe, failed = asyncio.run(run())
    assert not probe.ok
    for said in (probe.message, failed.message, str(failed)):
        assert "sk-secret" not in said and convert.REDACTED in said


def test_a_probe_that_times_out_names_its_own_bound() -> None:
    """The probe waits PROBE_READ_TIMEOUT_S, not the Lane's firstByte: a message naming
    firstByte would have an operator raise it, to no effect."""

    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    client = upstream.UpstreamClient(
        spec_of(timeouts={"firstByte": "60s"}), transport=httpx.MockTransport(hang)
    )

    probe = probed_once(client)
    assert not probe.ok
    assert probe.message == "GET http://u:1/v1/models failed: no answer within 5 s."


@pytest.mark.parametrize("status", [200, 500])
def test_an_upstreams_endless_answer_is_read_only_as_far_as_needed(status: int) -> None:
    """An error page, or a model list, of any size: the daemon reads a bounded head of
    it, never the whole (which could be larger than its memory)."""
    sent: list[int] = []

    class Endless(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for _ in range(10_000):
                sent.append(1)
                yield b"e" * 1024

    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, stream=Endless())

    client = upstream.UpstreamClient(spec_of(), transport=httpx.MockTransport(respond))

    async def run() -> tuple[upstream.Probe, list[int]]:
        probe = await client.probe()
        read_by_probe = len(sent)
        sent.clear()
        if status != 200:
            with pytest.raises(errors.Unavailable, match="HTTP 500: eee"):
                async for _ in client.generate(engine_pb2.GenerateRequest(prompt="p"), model="g"):
                    pass
        await client.close()
        return probe, [read_by_probe, len(sent)]

    probe, read = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert not probe.ok
    bound = (upstream.MAX_EVENT_BYTES if status == 200 else upstream.MAX_ERROR_BYTES) // 1024
    assert read[0] <= bound + 1
    assert read[1] <= upstream.MAX_ERROR_BYTES // 1024 + 1
