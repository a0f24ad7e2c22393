"""SLO spillover between Lanes (issue 21) in the data plane, against fake engines on
real Unix sockets: Lane "l" names Lane "w" as its spillover; each has one replica of
one slot. Which engine is asked, what the caller is told, and what is counted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import prometheus_client

from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import errors, tenants
from blazar.api.kinds import Kind, Lane, LaneSpec, LaneStatus, ReplicaStatus, SLOPolicy
from blazar.api.meta import ObjectMeta
from blazar.dataplane import access, prefixes, routing, server
from blazar.store.memory import MemoryStore
from tests.unit.test_dataplane_admission import HoldingEngine, outcome, policy
from tests.unit.test_dataplane_relay import engines, wait_until

# A 200 ms target: a slot held by a request with ~10 tokens of 0.1 s left misses it
# (the fake engines measure 0.1 s a decode step), an idle slot meets it.
TIGHT = policy("tight", ttft_target_ms=200)
# The same target under onOverload: queue.
PATIENT = policy("patient", ttft_target_ms=200, on_overload="queue")
# Queued ahead of everything else: it pushes a Lane's forecast later.
FIRST = policy("first", priority=10, on_overload="queue")


def lane(name: str, socket: str, *, spillover: str | None) -> Lane:
    return Lane(
        metadata=ObjectMeta(name=name),
        spec=LaneSpec(model="m", replicas=1, slots=1, spillover=spillover),
        status=LaneStatus(
            replica_statuses=[ReplicaStatus(index=0, state="Ready", socket=socket, pid=1)]
        ),
    )


@dataclass
class Plane:
    stub: inference_pb2_grpc.InferenceStub
    store: MemoryStore
    engines: dict[str, HoldingEngine]
    sockets: list[str]

    def respill(self, name: str, spillover: str | None) -> None:
        """Apply Lane `name` again, spilling to `spillover` (its status stays)."""
        index = ["l", "w"].index(name)
        self.store.apply_all([lane(name, self.sockets[index], spillover=spillover)])

    # The key every call presents (None: no auth).
    key: str | None = None

    def start(self, lane: str, prompt: str, slo: str = "") -> grpc.aio.UnaryStreamCall[Any, Any]:
        request = inference_pb2.CompleteRequest(model=lane, prompt=prompt, slo=slo)
        metadata = (("authorization", f"Bearer {self.key}"),) if self.key else ()
        return self.stub.Complete(request, metadata=metadata)

    async def started(self, lane: str, prompt: str, slo: str = "") -> Any:
        """A call whose engine has it (its first delta is in)."""
        call = self.start(lane, prompt, slo)
        assert (await call.read()).delta.text == "x"
        return call

    async def warm(self, lane: str) -> None:
        """One request through the Lane, so that it has measured its decode step."""
        assert await outcome(await self.started(lane, f"warm-{lane}")) is None

    def release(self) -> None:
        for engine in self.engines.values():
            for prompt in list(engine.ids):
                engine.gate(prompt).set()


@contextlib.asynccontextmanager
async def plane(
    *policies: SLOPolicy,
    spillover: str | None = "w",
    back: str | None = None,
    auth: access.Access | None = None,
) -> AsyncIterator[Plane]:
    """Lanes "l" (spilling to `spillover`) and "w" (spilling to `back`)."""
    local, wide = HoldingEngine(), HoldingEngine()
    async with engines(local, wide) as sockets:  # type: ignore[arg-type]  # duck-typed servicer
        store = MemoryStore()
        lanes = [lane("l", sockets[0], spillover=spillover), lane("w", sockets[1], spillover=back)]
        store.apply_all([*policies, *lanes])
        for item in lanes:
            store.update_status(Kind.LANE, item.metadata.name, item.status)
        data_plane = await server.start(store=store, address="127.0.0.1:0", access=auth)
        p: Plane | None = None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{data_plane.port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                p = Plane(stub, store, {"l": local, "w": wide}, sockets)
                yield p
        finally:
            if p is not None:
                p.release()
            await data_plane.stop(grace=0)


def sample(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def spillovers(lane: str = "l", to: str = "w") -> float:
    return sample("blazar_spillovers_total", lane=lane, to=to)


def rejections(lane: str, policy: str) -> float:
    return sample(
        "blazar_admission_rejections_total", lane=lane, policy=policy, reason="SLO_UNATTAINABLE"
    )


async def urgent_beside_hold(p: Plane) -> errors.BlazarError | None:
    """What a tight request on "l" gets while "hold" holds its one slot (then released)."""
    held = await p.started("l", "hold")
    refused = await outcome(p.start("l", "urgent", slo="tight"))
    p.release()
    assert await outcome(held) is None
    return refused


async def finals(call: grpc.aio.UnaryStreamCall[Any, Any]) -> inference_pb2.Final:
    final = None
    while (chunk := await call.read()) is not grpc.aio.EOF:
        if chunk.HasField("final"):
            final = chunk.final
    assert final is not None
    return final


def test_a_request_that_would_miss_runs_on_the_spillover_lane_and_says_where() -> None:
    before = (spillovers(), rejections("l", "tight"))

    async def run() -> tuple[inference_pb2.Final, dict[str, str], list[str], list[str]]:
        async with plane(TIGHT) as p:
            await p.warm("l")
            held = await p.started("l", "hold", slo="tight")
            call = p.start("l", "urgent", slo="tight")
            metadata = {k: str(v) for k, v in await call.initial_metadata()}
            final = await finals(call)
            p.engines["l"].gate("hold").set()
            assert await outcome(held) is None
            return final, metadata, p.engines["l"].seen, p.engines["w"].seen

    final, metadata, on_l, on_w = asyncio.run(run())
    assert (final.routing.lane, metadata["blazar-lane"]) == ("w", "w")
    assert (on_l, on_w) == (["warm-l", "hold"], ["urgent"])
    assert (spillovers(), rejections("l", "tight")) == (before[0] + 1, before[1])


def test_a_request_that_meets_its_target_locally_stays_local() -> None:
    before = spillovers()

    async def run() -> tuple[inference_pb2.Final, list[str]]:
        async with plane(TIGHT) as p:
            await p.warm("l")
            final = await finals(p.start("l", "fits", slo="tight"))
            return final, p.engines["w"].seen

    final, on_w = asyncio.run(run())
    assert (final.routing.lane, on_w, spillovers()) == ("l", [], before)


def test_refused_by_both_the_caller_gets_the_local_refusal_with_the_smaller_retry() -> None:
    """Both Lanes busy, "l" with more ahead; "w" names "l" back (no cycle follows)."""
    before = (spillovers(), rejections("l", "tight"), rejections("w", "tight"))

    async def run() -> tuple[errors.BlazarError | None, errors.BlazarError | None, list[str]]:
        async with plane(TIGHT, FIRST, back="l") as p:
            for name in ("l", "w"):
                await p.warm(name)
            held = [await p.started(name, f"hold-{name}") for name in ("l", "w")]
            # Ahead of any tight request on "l": its forecast is a decode longer.
            ahead = p.start("l", "ahead", slo="first")
            await wait_until(lambda: sample("blazar_queue_depth", lane="l", policy="first") == 1,
                             "the request ahead to wait")  # fmt: skip
            both = await outcome(p.start("l", "urgent-a", slo="tight"))
            # The same request with no spillover Lane: the local refusal alone.
            p.respill("l", None)
            # A prompt of the same length: the same estimate of its tokens.
            alone = await outcome(p.start("l", "urgent-b", slo="tight"))
            p.release()
            assert [await outcome(c) for c in (*held, ahead)] == [None, None, None]
            return both, alone, p.engines["w"].seen

    both, alone, on_w = asyncio.run(run())
    assert isinstance(both, errors.SloUnattainable) and isinstance(alone, errors.SloUnattainable)
    assert both.metadata["lane"] == "l"
    assert int(both.metadata[errors.RETRY_AFTER_KEY]) < int(alone.metadata[errors.RETRY_AFTER_KEY])
    assert on_w == ["warm-w", "hold-w"]
    # Counted once, where the caller was refused.
    assert spillovers() == before[0]
    assert (rejections("l", "tight"), rejections("w", "tight")) == (before[1] + 2, before[2])


def test_a_queued_request_waits_locally_when_the_spillover_lane_would_miss_too() -> None:
    """onOverload: queue: offered to "w", which cannot meet the target either; the local
    decision stands, and it waits on "l" for its slot."""
    before = spillovers()

    async def run() -> tuple[inference_pb2.Final, list[str], list[str]]:
        async with plane(PATIENT) as p:
            for name in ("l", "w"):
                await p.warm(name)
            held = [await p.started(name, f"hold-{name}") for name in ("l", "w")]
            call = p.start("l", "patient", slo="patient")
            await wait_until(
                lambda: sample("blazar_queue_depth", lane="l", policy="patient") == 1,
                "it to wait on l",
            )
            p.release()
            final = await finals(call)
            assert [await outcome(c) for c in held] == [None, None]
            return final, p.engines["l"].seen, p.engines["w"].seen

    final, on_l, on_w = asyncio.run(run())
    assert final.routing.lane == "l"
    assert (on_l, on_w) == (["warm-l", "hold-l", "patient"], ["warm-w", "hold-w"])
    assert spillovers() == before


def test_a_missing_spillover_lane_leaves_the_local_decision_and_says_so() -> None:
    async def run() -> tuple[errors.BlazarError | None, list[tuple[str, str, str]], list[str]]:
        async with plane(TIGHT, spillover="nosuch") as p:
            await p.warm("l")
            refused = await urgent_beside_hold(p)
            # Said once, however often the table is rebuilt; again once it dangles anew.
            p.respill("l", "w")
            p.respill("l", "nosuch")
            events = [(e.type, e.reason, e.message) for e in p.store.events(kind="Lane", name="l")]
            return refused, events, p.engines["w"].seen

    refused, events, on_w = asyncio.run(run())
    assert isinstance(refused, errors.SloUnattainable) and refused.metadata["lane"] == "l"
    assert on_w == []
    missing = [e for e in events if e[1] == "SpilloverNotFound"]
    assert len(missing) == 2, events
    assert missing[0][0] == "Warning" and "'nosuch'" in missing[0][2]


def test_a_tenant_spills_only_to_a_lane_it_may_use() -> None:
    """Tenant "narrow" may use "l" only: its request stays, and is refused there."""
    auth = tenants.parse(
        f'tenants: [{{name: narrow, keys: ["{tenants.digest("bz-narrow")}"], lanes: [l], sloPolicies: ["*"]}}]',
        source="test",
    )
    before = spillovers()

    async def run() -> tuple[errors.BlazarError | None, list[str]]:
        async with plane(TIGHT, auth=access.Access(tenants=auth)) as p:
            p.key = "bz-narrow"
            await p.warm("l")
            return await urgent_beside_hold(p), p.engines["w"].seen

    refused, on_w = asyncio.run(run())
    assert isinstance(refused, errors.SloUnattainable) and refused.metadata["lane"] == "l"
    assert (on_w, spillovers()) == ([], before)


def test_the_spillover_lane_learns_the_prompts_it_ran() -> None:
    """Lane "w" has two replicas. A request spilled from "l" runs on w's replica 1 (0
    is busy); w's prefix index learns its prompt there, so a follow-up sent to "w"
    goes back to replica 1, and so does one that spills again. Before, neither Lane
    learnt a spilled prompt, and both follow-ups went to replica 0."""
    prompt = "p" * prefixes.BLOCK_CHARS * 3 * routing.MIN_PREFIX_BLOCKS

    async def run() -> list[tuple[str, int]]:
        local, wide = HoldingEngine(), [HoldingEngine(), HoldingEngine()]
        async with engines(local, *wide) as sockets:  # type: ignore[arg-type]
            store = MemoryStore()
            statuses = [
                ReplicaStatus(index=i, state="Ready", socket=s, pid=1)
                for i, s in enumerate(sockets[1:])
            ]
            lanes = [
                lane("l", sockets[0], spillover="w"),
                Lane(
                    metadata=ObjectMeta(name="w"),
                    spec=LaneSpec(model="m", replicas=2, slots=1),
                    status=LaneStatus(replica_statuses=statuses),
                ),
            ]
            store.apply_all([TIGHT, *lanes])
            for item in lanes:
                store.update_status(Kind.LANE, item.metadata.name, item.status)
            data_plane = await server.start(store=store, address="127.0.0.1:0", access=None)
            p: Plane | None = None
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{data_plane.port}") as channel:
                    stub = inference_pb2_grpc.InferenceStub(channel)
                    p = Plane(stub, store, {"l": local, "w0": wide[0], "w1": wide[1]}, sockets)
                    await p.warm("l")
                    held = [await p.started("l", "hold-l"), await p.started("w", "hold-w")]
                    assert wide[0].seen == ["hold-w"]
                    where = [await finals(p.start("l", prompt, slo="tight"))]
                    p.release()
                    for call in held:
                        assert await outcome(call) is None
                    where.append(await finals(p.start("w", prompt + " and more")))
                    held = [await p.started("l", "hold-l again")]
                    where.append(await finals(p.start("l", prompt + " again", slo="tight")))
                    p.release()
                    assert await outcome(held[0]) is None
                    return [(f.routing.lane, f.routing.replica) for f in where]
            finally:
                if p is not None:
                    p.release()
                await data_plane.stop(grace=0)

    assert asyncio.run(run()) == [("w", 1), ("w", 1), ("w", 1)]


def test_a_spillover_lane_scaled_to_zero_while_it_drains_leaves_the_local_decision() -> None:
    """ "w" scaled to `replicas: 0`, its replica still listed while it drains: nothing
    spills there (a draining engine takes no new work), and the caller gets its own
    Lane's refusal, not "w"'s scaled-to-zero error."""
    before = spillovers()

    async def run() -> tuple[errors.BlazarError | None, list[str]]:
        async with plane(TIGHT) as p:
            for name in ("l", "w"):
                await p.warm(name)
            paused = lane("w", p.sockets[1], spillover=None)
            paused.spec.replicas = 0
            p.store.apply_all([paused])
            await asyncio.sleep(0.2)
            return await urgent_beside_hold(p), p.engines["w"].seen

    refused, on_w = asyncio.run(run())
    assert isinstance(refused, errors.SloUnattainable), refused
    assert refused.metadata["lane"] == "l"
    assert (on_w, spillovers()) == (["warm-w"], before)
