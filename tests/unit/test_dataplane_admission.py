"""The data plane's admission task (`blazar.dataplane.dispatcher`) against fake engines
on real Unix sockets, Blazar's own boundary: what each engine is asked, in what order,
and what a refused caller gets. Lanes have one replica of one slot unless said."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import prometheus_client
import pytest

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc
from blazar._proto.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from blazar.api import errors
from blazar.api.kinds import (
    Kind,
    KVCache,
    Lane,
    LaneSpec,
    LaneStatus,
    ReplicaStatus,
    SLOPolicy,
    SLOPolicySpec,
)
from blazar.api.meta import Condition, ConditionStatus, ObjectMeta
from blazar.dataplane import server
from blazar.rpc import limits, status
from blazar.store.memory import MemoryStore
from tests.unit.test_dataplane_relay import engines

# What the fake engine reports for every request: 100 prompt tokens prefilled in 10 ms,
# 11 tokens generated, the 10 after the first in 1 s of decode (0.1 s a step).
MEASURED = inference_pb2.Final(
    finish_reason=inference_pb2.FINISH_REASON_STOP,
    usage=inference_pb2.Usage(prompt_tokens=100, completion_tokens=11),
    timings=inference_pb2.Timings(prefill_ms=10.0, decode_ms=1000.0),
)


class HoldingEngine(engine_pb2_grpc.EngineServicer):
    """Answers one delta, then holds a prompt starting with "hold" until released.
    Parks and resumes by request id, as a real engine does, and records the orders."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.ids: dict[str, str] = {}
        self.orders: list[tuple[str, str]] = []
        self.server: grpc.aio.Server | None = None
        self._gates: dict[str, asyncio.Event] = {}

    async def Park(self, request: Any, context: Any) -> engine_pb2.ParkResponse:
        self.orders.append(("park", request.request_id))
        return engine_pb2.ParkResponse(slot=0, tokens=10, parked_bytes=1000)

    async def Resume(self, request: Any, context: Any) -> engine_pb2.ResumeResponse:
        self.orders.append(("resume", request.request_id))
        return engine_pb2.ResumeResponse(slot=0, restored_bytes=1000)

    def gate(self, prompt: str) -> asyncio.Event:
        return self._gates.setdefault(prompt, asyncio.Event())

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
        self.seen.append(request.prompt)
        self.ids[request.prompt] = request.request_id
        yield inference_pb2.Chunk(delta=inference_pb2.Delta(text="x", tokens=1))
        if request.prompt.startswith("hold"):
            await self.gate(request.prompt).wait()
        final = inference_pb2.Final()
        final.CopyFrom(MEASURED)
        yield inference_pb2.Chunk(final=final)


def policy(name: str, **spec: Any) -> SLOPolicy:
    return SLOPolicy(metadata=ObjectMeta(name=name), spec=SLOPolicySpec(**spec))


@dataclass
class Plane:
    stub: inference_pb2_grpc.InferenceStub
    engine: HoldingEngine
    control: control_pb2_grpc.ControlStub
    store: MemoryStore

    async def status(self, kind: str, name: str) -> dict[str, Any]:
        got = await self.control.Get(control_pb2.GetRequest(kind=kind, name=name))
        found: dict[str, Any] = json.loads(got.object_json)["status"]
        return found

    def start(self, prompt: str, slo: str = "") -> grpc.aio.UnaryStreamCall[Any, Any]:
        request = inference_pb2.CompleteRequest(model="l", prompt=prompt, slo=slo)
        return self.stub.Complete(request)

    async def until(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 5
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def started(self, prompt: str, slo: str = "") -> grpc.aio.UnaryStreamCall[Any, Any]:
        """A call whose engine has it (its first delta is in)."""
        call = self.start(prompt, slo)
        assert (await call.read()).delta.text == "x"
        return call


@contextlib.asynccontextmanager
async def plane(
    *policies: SLOPolicy,
    lane_policy: str | None = None,
    max_parked_mib: int = 1024,
    max_concurrent_rpcs: int = limits.MAX_CONCURRENT_RPCS,
    slots: int = 1,
) -> AsyncIterator[Plane]:
    engine = HoldingEngine()
    async with engines(engine) as sockets:  # type: ignore[arg-type]  # duck-typed servicer
        store = MemoryStore()
        lane = Lane(
            metadata=ObjectMeta(name="l"),
            spec=LaneSpec(
                model="m",
                replicas=1,
                slots=slots,
                slo_policy=lane_policy,
                kv_cache=KVCache(max_parked_mib=max_parked_mib),
            ),
            status=LaneStatus(
                replica_statuses=[ReplicaStatus(index=0, state="Ready", socket=sockets[0], pid=1)]
            ),
        )
        store.apply_all([*policies, lane])
        store.update_status(Kind.LANE, "l", lane.status)
        data_plane = await server.start(
            store=store, address="127.0.0.1:0", max_concurrent_rpcs=max_concurrent_rpcs
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{data_plane.port}") as channel:
                yield Plane(
                    inference_pb2_grpc.InferenceStub(channel),
                    engine,
                    control_pb2_grpc.ControlStub(channel),
                    store,
                )
        finally:
            await data_plane.stop(grace=0)


async def outcome(call: grpc.aio.UnaryStreamCall[Any, Any]) -> errors.BlazarError | None:
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as exc:
        return status.from_rpc_error(exc)
    return None


def depth(policy: str) -> float:
    labels = {"lane": "l", "policy": policy}
    return prometheus_client.REGISTRY.get_sample_value("blazar_queue_depth", labels) or 0.0


def rejections(policy: str, reason: str) -> float:
    labels = {"lane": "l", "policy": policy, "reason": reason}
    value = prometheus_client.REGISTRY.get_sample_value("blazar_admission_rejections_total", labels)
    return value or 0.0


def test_a_request_waits_for_a_free_slot_in_the_data_plane_not_the_engine() -> None:
    async def run() -> tuple[list[str], list[str], errors.BlazarError | None]:
        async with plane() as p:
            held = await p.started("hold")
            waiting = p.start("next")
            await p.until(lambda: depth("builtin:fifo") == 1, "the queue to hold one")
            seen_while_held = list(p.engine.seen)
            p.engine.gate("hold").set()
            assert await outcome(held) is None
            result = await outcome(waiting)
            return seen_while_held, p.engine.seen, result

    seen_while_held, seen, result = asyncio.run(run())
    assert seen_while_held == ["hold"]
    assert (seen, result, depth("builtin:fifo")) == (["hold", "next"], None, 0)


def test_higher_priority_starts_first_whatever_its_arrival() -> None:
    async def run() -> list[str]:
        low, high = policy("low", on_overload="queue"), policy("high", priority=10)
        async with plane(low, high) as p:
            held = await p.started("hold")
            first = p.start("low", slo="low")
            await p.until(lambda: depth("low") == 1, "low to wait")
            second = p.start("high", slo="high")
            await p.until(lambda: depth("high") == 1, "high to wait")
            p.engine.gate("hold").set()
            results = [await outcome(c) for c in (held, first, second)]
            assert results == [None, None, None]
            return p.engine.seen

    assert asyncio.run(run()) == ["hold", "high", "low"]


def test_a_full_queue_refuses_at_once_with_a_retry_hint() -> None:
    before = rejections("one", "QUEUE_FULL")

    async def run() -> tuple[errors.BlazarError | None, list[str]]:
        async with plane(policy("one", max_queue_depth=1, on_overload="queue")) as p:
            held = await p.started("hold", slo="one")
            waiting = p.start("waits", slo="one")
            await p.until(lambda: depth("one") == 1, "one to wait")
            refused = await outcome(p.start("refused", slo="one"))
            p.engine.gate("hold").set()
            assert [await outcome(c) for c in (held, waiting)] == [None, None]
            return refused, p.engine.seen

    refused, seen = asyncio.run(run())
    assert isinstance(refused, errors.QueueFull)
    assert refused.metadata["policy"] == "one" and refused.metadata["max_queue_depth"] == "1"
    assert int(refused.metadata[errors.RETRY_AFTER_KEY]) >= 1
    assert seen == ["hold", "waits"]
    assert rejections("one", "QUEUE_FULL") == before + 1


def test_the_lanes_policy_applies_when_the_request_names_none() -> None:
    async def run() -> errors.BlazarError | None:
        async with plane(policy("none-waits", max_queue_depth=0), lane_policy="none-waits") as p:
            held = await p.started("hold")
            refused = await outcome(p.start("refused"))
            p.engine.gate("hold").set()
            assert await outcome(held) is None
            return refused

    refused = asyncio.run(run())
    assert isinstance(refused, errors.QueueFull) and refused.metadata["policy"] == "none-waits"


def test_a_request_that_waited_its_bound_is_refused_never_started_late() -> None:
    async def run() -> tuple[errors.BlazarError | None, float, list[str]]:
        async with plane(policy("brief", max_queue_wait_ms=150, on_overload="queue")) as p:
            held = await p.started("hold")
            began = time.monotonic()
            refused = await outcome(p.start("late", slo="brief"))
            waited = time.monotonic() - began
            p.engine.gate("hold").set()
            assert await outcome(held) is None
            return refused, waited, p.engine.seen

    refused, waited, seen = asyncio.run(run())
    assert isinstance(refused, errors.QueueTimeout)
    assert 0.15 <= waited < 2.0
    assert seen == ["hold"]


def test_a_predicted_miss_is_refused_early_from_measured_rates() -> None:
    async def run() -> tuple[errors.BlazarError | None, float]:
        async with plane(policy("tight", ttft_target_ms=200)) as p:
            # Nothing measured yet: nothing to refuse on, it waits and is served.
            held = await p.started("hold")
            unmeasured = p.start("unmeasured", slo="tight")
            await p.until(lambda: depth("tight") == 1, "it to wait")
            p.engine.gate("hold").set()
            assert [await outcome(c) for c in (held, unmeasured)] == [None, None]
            # Measured now: a slot held by a request with ~10 tokens of 0.1 s left.
            held = await p.started("hold-2")
            began = time.monotonic()
            refused = await outcome(p.start("urgent", slo="tight"))
            took = time.monotonic() - began
            p.engine.gate("hold-2").set()
            assert await outcome(held) is None
            return refused, took

    refused, took = asyncio.run(run())
    assert isinstance(refused, errors.SloUnattainable)
    assert int(refused.metadata["predicted_ttft_ms"]) > 200
    assert int(refused.metadata[errors.RETRY_AFTER_KEY]) > 0
    assert took < 1.0


def test_a_prompt_likely_over_the_context_goes_to_the_engine_not_a_429() -> None:
    """By the Lane's measured characters per token the prompt would not fit a slot, and
    its prefill alone would miss the target: the engine, which counts its tokens, is
    the one to answer (a context overflow is a 400 there), not a refusal to retry."""

    async def run() -> tuple[errors.BlazarError | None, list[str]]:
        async with plane(policy("tight", ttft_target_ms=200)) as p:
            await measured(p)  # 4 characters were 100 tokens, prefilled at 10,000 tok/s
            long = "y" * 400  # 10,000 tokens by that ratio: a second of prefill
            return await outcome(p.start(long, slo="tight")), p.engine.seen

    result, seen = asyncio.run(run())
    assert result is None
    assert seen == ["warm", "y" * 400]


def test_a_caller_that_leaves_the_queue_leaves_at_once() -> None:
    async def run() -> list[str]:
        async with plane() as p:
            held = await p.started("hold")
            waiting = p.start("gone")
            await p.until(lambda: depth("builtin:fifo") == 1, "it to wait")
            waiting.cancel()
            await p.until(lambda: depth("builtin:fifo") == 0, "it to leave")
            p.engine.gate("hold").set()
            assert await outcome(held) is None
            return p.engine.seen

    assert asyncio.run(run()) == ["hold"]


def test_an_unknown_policy_is_invalid_and_named() -> None:
    async def run() -> errors.BlazarError | None:
        async with plane() as p:
            return await outcome(p.start("x", slo="nosuch"))

    refused = asyncio.run(run())
    assert isinstance(refused, errors.InvalidRequest)
    assert "'nosuch'" in refused.message and refused.metadata["policy"] == "nosuch"


def test_a_policy_applied_or_deleted_while_serving_is_seen_by_the_next_request() -> None:
    """The data plane keeps SLOPolicies in memory (read by every request): an apply
    and a delete reach it through the store's watch."""

    async def run() -> tuple[errors.BlazarError | None, errors.BlazarError | None]:
        async with plane() as p:
            p.store.apply_all([policy("late", max_queue_depth=0)])
            held = await p.started("hold")
            # The new policy's bound (no one may wait) refuses at once.
            full = await outcome(p.start("x", slo="late"))
            p.engine.gate("hold").set()
            assert await outcome(held) is None
            p.store.delete(Kind.SLO_POLICY, "late")
            return full, await outcome(p.start("y", slo="late"))

    full, gone = asyncio.run(run())
    assert isinstance(full, errors.QueueFull)
    assert isinstance(gone, errors.InvalidRequest) and "'late'" in gone.message


@pytest.mark.parametrize("reason", ["QUEUE_FULL"])
def test_refusals_are_resource_exhausted_on_the_wire(reason: str) -> None:
    async def run() -> grpc.aio.AioRpcError:
        async with plane(policy("zero", max_queue_depth=0)) as p:
            held = await p.started("hold")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await p.start("refused", slo="zero").read()
            p.engine.gate("hold").set()
            assert await outcome(held) is None
            return info.value

    exc = asyncio.run(run())
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = {k: v for k, v in exc.trailing_metadata() or ()}
    assert trailers["blazar-reason"] == reason
    assert int(trailers["blazar-retry_after_ms"]) >= 1
    assert status.DETAILS_KEY in trailers


def test_the_control_api_shows_the_live_queue_and_attainment() -> None:
    async def run() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with plane(policy("generous", ttft_target_ms=60_000)) as p:
            held = await p.started("hold", slo="generous")
            waiting = p.start("next", slo="generous")
            await p.until(lambda: depth("generous") == 1, "it to wait")
            lane = await p.status("lane", "l")
            during = await p.status("slopolicy", "generous")
            p.engine.gate("hold").set()
            assert [await outcome(c) for c in (held, waiting)] == [None, None]
            after = await p.status("slopolicy", "generous")
            return lane, during, after

    lane, during, after = asyncio.run(run())
    (queue,) = lane["admission"]["queue"]
    assert (lane["admission"]["running"], queue["policy"], queue["waiting"]) == (1, "generous", 1)
    assert queue["oldestWaitMs"] >= 0
    assert (during["admission"]["queued"], during["admission"]["firstTokens"]) == (1, 1)
    assert after["admission"] == {
        "queued": 0,
        "firstTokens": 2,
        "refused": {},
        "attainment": 1.0,
    }


def test_a_request_waiting_on_a_deleted_lane_is_told_its_model_is_gone() -> None:
    """NOT_FOUND, not a retryable UNAVAILABLE: a retry would meet no such model either."""

    async def run() -> errors.BlazarError | None:
        async with plane() as p:
            held = await p.started("hold")
            waiting = p.start("orphan")
            await p.until(lambda: depth("builtin:fifo") == 1, "it to wait")
            p.store.delete(Kind.LANE, "l")
            refused = await outcome(waiting)
            p.engine.gate("hold").set()
            await outcome(held)
            return refused

    refused = asyncio.run(run())
    assert isinstance(refused, errors.ModelNotFound)
    assert refused.message == (
        "Lane 'l' was deleted while the request waited: the model 'l' no longer exists."
    )
    # Its gauges are gone from /metrics rather than left at their last value.
    labels = {"lane": "l", "policy": "builtin:fifo"}
    assert prometheus_client.REGISTRY.get_sample_value("blazar_queue_depth", labels) is None
    assert prometheus_client.REGISTRY.get_sample_value("blazar_parked_bytes", {"lane": "l"}) is None


def test_a_request_waiting_on_a_lane_whose_model_is_gone_is_told_so() -> None:
    """The Lane's last replica leaves while its Model is deleted: none will start, so
    what waits is refused naming the Model, not left to wait for nothing."""

    async def run() -> tuple[errors.BlazarError | None, errors.BlazarError | None]:
        async with plane() as p:
            held = await p.started("hold")
            waiting = p.start("orphan")
            await p.until(lambda: depth("builtin:fifo") == 1, "it to wait")
            gone = LaneStatus(
                conditions=[
                    Condition(
                        type="ModelReady",
                        status=ConditionStatus.FALSE,
                        reason="ModelNotFound",
                        message='Model "m" does not exist.',
                        last_transition_time=datetime.now(UTC),
                        observed_generation=1,
                    )
                ]
            )
            p.store.update_status(Kind.LANE, "l", gone)
            refused = await outcome(waiting)
            p.engine.gate("hold").set()
            return refused, await outcome(held)

    refused, held = asyncio.run(run())
    assert isinstance(refused, errors.Unavailable)
    assert refused.message.endswith('until its Model is ready: Model "m" does not exist.')
    assert held is None  # what already ran finishes


def test_a_request_waiting_for_a_start_is_refused_once_the_replica_backs_off() -> None:
    """A request that came while the only replica was starting waits for it, and for
    its restart at once after a crash; once the replica crashed again and waits out its
    back-off (an engine that cannot load its model: it crash-loops for good), it is
    refused with the wait left, as a request arriving then is, not left waiting."""

    def replica(state: str, restart_in_s: float | None = None) -> LaneStatus:
        due = None if restart_in_s is None else datetime.now(UTC) + timedelta(seconds=restart_in_s)
        return LaneStatus(
            replica_statuses=[ReplicaStatus(index=0, state=state, pid=1, restart_at=due)]
        )

    async def run() -> errors.BlazarError | None:
        async with plane() as p:
            p.store.update_status(Kind.LANE, "l", replica("Starting"))
            await asyncio.sleep(0.2)
            waiting = p.start("waits")
            await p.until(lambda: depth("builtin:fifo") == 1, "it to wait")
            # The first crash: restarted at once (its back-off is over), so it waits on.
            p.store.update_status(Kind.LANE, "l", replica("Failed", restart_in_s=-1))
            await asyncio.sleep(0.3)
            assert depth("builtin:fifo") == 1
            p.store.update_status(Kind.LANE, "l", replica("Failed", restart_in_s=30))
            return await asyncio.wait_for(outcome(waiting), 5)

    refused = asyncio.run(run())
    assert isinstance(refused, errors.Unavailable)
    assert "restarted in 30 s, after its crash back-off" in refused.message
    assert 29000 < int(refused.metadata[errors.RETRY_AFTER_KEY]) <= 30000


def test_the_policy_may_come_as_grpc_metadata() -> None:
    async def run() -> errors.BlazarError | None:
        async with plane(policy("zero", max_queue_depth=0)) as p:
            held = await p.started("hold")
            request = inference_pb2.CompleteRequest(model="l", prompt="refused")
            call = p.stub.Complete(request, metadata=(("x-blazar-slo", "zero"),))
            refused = await outcome(call)
            p.engine.gate("hold").set()
            assert await outcome(held) is None
            return refused

    refused = asyncio.run(run())
    assert isinstance(refused, errors.QueueFull) and refused.metadata["policy"] == "zero"


def preemptions(policy: str) -> float:
    labels = {"lane": "l", "policy": policy}
    value = prometheus_client.REGISTRY.get_sample_value("blazar_preemptions_total", labels)
    return value or 0.0


async def measured(p: Plane) -> None:
    """One request through the Lane, so that it has measured its decode step (0.1 s)."""
    assert await outcome(await p.started("warm")) is None


def test_an_urgent_request_parks_lower_priority_work_which_resumes_after_it() -> None:
    """The held low-priority generation would keep the only slot for 100 s; the urgent
    request's 0.5 s target cannot wait for it, so the engine parks the held one, serves
    the urgent one in its slot, then resumes it; both streams end normally."""
    before = preemptions("low")

    async def run() -> tuple[
        list[errors.BlazarError | None], list[str], list[tuple[str, str]], str
    ]:
        low = policy("low", on_overload="queue")
        urgent = policy("urgent", priority=100, ttft_target_ms=500)
        async with plane(low, urgent) as p:
            await measured(p)
            held = await p.started("hold", slo="low")
            fast = p.start("fast", slo="urgent")
            assert await asyncio.wait_for(outcome(fast), 5) is None
            await p.until(lambda: len(p.engine.orders) == 2, "the held one to resume")
            p.engine.gate("hold").set()
            return [await outcome(held)], p.engine.seen, p.engine.orders, p.engine.ids["hold"]

    results, seen, orders, held_id = asyncio.run(run())
    assert results == [None]
    assert seen == ["warm", "hold", "fast"]
    assert orders == [("park", held_id), ("resume", held_id)]
    assert preemptions("low") == before + 1


def test_the_control_api_shows_parked_generations_and_their_memory() -> None:
    """While the urgent request runs in the parked one's slot, the Lane's live status
    counts the parked generation and the bytes its Park answer said it holds."""

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        low = policy("low", on_overload="queue")
        urgent = policy("urgent", priority=100, ttft_target_ms=500)
        async with plane(low, urgent) as p:
            await measured(p)
            held = await p.started("hold", slo="low")
            fast = await p.started("hold-urgent", slo="urgent")
            await p.until(lambda: p.engine.orders == [("park", p.engine.ids["hold"])], "a park")
            during = (await p.status("lane", "l"))["admission"]
            p.engine.gate("hold-urgent").set()
            assert await outcome(fast) is None
            await p.until(lambda: len(p.engine.orders) == 2, "the held one to resume")
            after = (await p.status("lane", "l"))["admission"]
            p.engine.gate("hold").set()
            assert await outcome(held) is None
            return during, after

    during, after = asyncio.run(run())
    assert (during["parked"], during["parkedBytes"], during["running"]) == (1, 1000, 1)
    assert (after["parked"], after["parkedBytes"]) == (0, 0)


def test_no_generation_is_preempted_without_parking_room() -> None:
    """maxParkedMiB 0 turns preemption off: the urgent request waits for the slot and
    the running generation is never interrupted."""

    async def run() -> tuple[list[errors.BlazarError | None], list[str], list[tuple[str, str]]]:
        low = policy("low", on_overload="queue")
        urgent = policy("urgent", priority=100, ttft_target_ms=60_000, on_overload="queue")
        async with plane(low, urgent, max_parked_mib=0) as p:
            await measured(p)
            held = await p.started("hold", slo="low")
            waiting = p.start("urgent", slo="urgent")
            await p.until(lambda: depth("urgent") == 1, "it to wait")
            await asyncio.sleep(0.1)
            assert p.engine.seen == ["warm", "hold"]
            p.engine.gate("hold").set()
            outcomes = [await outcome(c) for c in (held, waiting)]
            return outcomes, p.engine.seen, p.engine.orders

    results, seen, orders = asyncio.run(run())
    assert (results, seen, orders) == ([None, None], ["warm", "hold", "urgent"], [])


def test_a_policy_holds_no_more_slots_than_its_cap_and_leaves_the_rest_free() -> None:
    """maxSlotsPerReplica 1 on a replica of 2 slots: the policy's second request waits
    though a slot is idle (also once a request of another policy has used it and
    ended), another policy's request starts there at once, and the second starts when
    the first ends."""

    async def run() -> tuple[list[str], list[str], list[errors.BlazarError | None]]:
        low = policy("low", on_overload="queue", max_slots_per_replica=1)
        async with plane(low, slots=2) as p:
            held = await p.started("hold", slo="low")
            second = p.start("second", slo="low")
            await p.until(lambda: depth("low") == 1, "the second to wait")
            other = await p.started("other")
            assert await outcome(other) is None
            await asyncio.sleep(0.1)
            seen_while_held = list(p.engine.seen)
            p.engine.gate("hold").set()
            outcomes = [await outcome(c) for c in (held, second)]
            return seen_while_held, p.engine.seen, outcomes

    seen_while_held, seen, outcomes = asyncio.run(run())
    assert seen_while_held == ["hold", "other"]
    assert (seen, outcomes) == (["hold", "other", "second"], [None, None])


def test_calls_past_the_servers_concurrency_bound_are_refused_at_once() -> None:
    """A client that opens calls without end is refused past the bound
    (RESOURCE_EXHAUSTED, grpcio's own), and the calls within it go on."""

    async def run() -> tuple[grpc.StatusCode, errors.BlazarError | None]:
        async with plane(max_concurrent_rpcs=1) as p:
            held = await p.started("hold")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await p.stub.ListModels(inference_pb2.ListModelsRequest(), timeout=5)
            p.engine.gate("hold").set()
            return refused.value.code(), await outcome(held)

    code, held = asyncio.run(run())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert held is None
