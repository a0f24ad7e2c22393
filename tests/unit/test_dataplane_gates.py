"""The data plane's gate publisher: which Lanes and policies it asks, what it lists,
and when watchers hear of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.dataplane import admission, gates, routing

INTERACTIVE = admission.Policy(
    "interactive", priority=100, ttft_target_s=2.0, max_queue_depth=4, reject_early=True
)
BATCH = admission.Policy("batch", max_queue_depth=8)
REPLICA = routing.Replica("lane-a", 0, "/tmp/sock", 1)


def route(lane: str = "lane-a", **changes: object) -> routing.Route:
    base = routing.Route(
        lane=lane,
        model="m",
        aliases=(f"{lane}-alias",),
        replicas=(replace(REPLICA, lane=lane),),
        created=0,
        context_length=512,
        slots=1,
        slo_policy="interactive",
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def table(*routes: routing.Route) -> routing.RouteTable:
    by_name: dict[str, routing.Route] = {}
    for r in routes:
        by_name[r.lane] = r
        for alias in r.aliases:
            by_name.setdefault(alias, r)
    return routing.RouteTable(routes=routes, by_name=by_name)


def refused(policy: admission.Policy, reason: admission.Reason) -> admission.Refuse:
    probe = admission.Ticket(admission.PROBE_ID, policy, 0.0, 1, 1)
    predicted = 2.75 if reason == admission.Reason.SLO_UNATTAINABLE else None
    return admission.Refuse(probe, reason, 0.75, predicted_ttft_s=predicted)


@dataclass
class World:
    """What the publisher reads: the table, stored policies, what Lanes answer."""

    routes: routing.RouteTable = field(default_factory=lambda: table(route()))
    stored: dict[str, admission.Policy] = field(
        default_factory=lambda: {"interactive": INTERACTIVE, "batch": BATCH}
    )
    named: dict[str, list[str]] = field(default_factory=dict)
    answers: dict[tuple[str, str], admission.Refuse | admission.Filling] = field(
        default_factory=dict
    )
    asked: list[tuple[str, tuple[str, ...], bool]] = field(default_factory=list)
    enabled: bool = True
    running: int = 0
    # By Lane, by watcher: the highest tag that arrived.
    seen: dict[str, dict[str, int]] = field(default_factory=dict)
    # The Lanes with work running, waiting or parked.
    busy: set[str] = field(default_factory=set)
    # By policy, the longest prompt a SLO_UNATTAINABLE refusal hints a retry to.
    hinted: dict[str, int] = field(default_factory=dict)

    def source(self, lane: str, policies: list[admission.Policy], spill: bool) -> gates.LaneGates:
        self.asked.append((lane, tuple(p.name for p in policies), spill))
        return gates.LaneGates(
            refusals={p.name: self.answers.get((lane, p.name)) for p in policies},
            chars_per_token=3.5,
            running=self.running,
            seen=dict(self.seen.get(lane, {})),
            hinted_prompts=self.hinted,
        )

    def lane_policy(self, r: routing.Route) -> admission.Policy:
        return self.stored.get(r.slo_policy or "", admission.FIFO_POLICY)

    def publisher(self) -> gates.GatePublisher:
        return gates.GatePublisher(
            table=lambda: self.routes,
            policies=lambda: self.stored,
            lane_policy=self.lane_policy,
            named=lambda lane: self.named.get(lane, []),
            source=self.source,
            enabled=lambda: self.enabled,
            busy=lambda lane: lane in self.busy,
            refresh_s=60.0,
        )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def world() -> Iterator[World]:
    yield World()


async def flushed(publisher: gates.GatePublisher, *lanes: str) -> inference_pb2.AdmissionGates:
    for lane in lanes:
        publisher.mark(lane)
    await asyncio.sleep(0)  # the flush runs once, soon
    return publisher.snapshot()


@pytest.mark.anyio
async def test_a_closed_gate_lists_the_refusal_and_every_name_of_its_lane(world: World) -> None:
    world.answers[("lane-a", "interactive")] = refused(INTERACTIVE, admission.Reason.QUEUE_FULL)
    publisher = world.publisher()
    try:
        snapshot = await flushed(publisher, "lane-a")
    finally:
        await publisher.close()
    [closed] = snapshot.closed
    assert closed.lane == "lane-a"
    assert list(closed.models) == ["lane-a", "lane-a-alias"]
    assert closed.policy == "interactive" and closed.lane_policy
    assert closed.reason == "QUEUE_FULL"
    assert closed.metadata["retry_after_ms"] == "750"
    assert not closed.HasField("closed_for_ms")  # until the next message
    assert closed.context_tokens == 512 and closed.chars_per_token == 3.5


@pytest.mark.anyio
async def test_an_slo_gate_holds_for_what_the_probe_misses_by(world: World) -> None:
    world.answers[("lane-a", "interactive")] = refused(
        INTERACTIVE, admission.Reason.SLO_UNATTAINABLE
    )
    publisher = world.publisher()
    try:
        [closed] = (await flushed(publisher, "lane-a")).closed
    finally:
        await publisher.close()
    assert closed.reason == "SLO_UNATTAINABLE"
    assert closed.closed_for_ms == 750  # predicted 2.75 s against a 2 s target
    assert not closed.HasField("most_prompt_tokens")  # no bound measured: any prompt


@pytest.mark.anyio
async def test_an_slo_gate_holds_only_for_prompts_its_retry_hint_is_true_of(
    world: World,
) -> None:
    """A longer prompt's own prefill misses the target: the Lane tells it that no wait
    helps, so the gate must not answer it with the probe's hint. A QUEUE_FULL gate
    refuses every size."""
    world.answers[("lane-a", "interactive")] = refused(
        INTERACTIVE, admission.Reason.SLO_UNATTAINABLE
    )
    world.answers[("lane-b", "interactive")] = refused(INTERACTIVE, admission.Reason.QUEUE_FULL)
    world.hinted["interactive"] = 1800
    world.routes = table(route("lane-a"), route("lane-b"))
    publisher = world.publisher()
    try:
        closed = {g.lane: g for g in (await flushed(publisher, "lane-a", "lane-b")).closed}
    finally:
        await publisher.close()
    assert closed["lane-a"].most_prompt_tokens == 1800
    assert not closed["lane-b"].HasField("most_prompt_tokens")


@pytest.mark.anyio
async def test_a_filling_gate_says_after_what_it_closes(world: World) -> None:
    late = refused(INTERACTIVE, admission.Reason.SLO_UNATTAINABLE)
    world.answers[("lane-a", "interactive")] = admission.Filling(6, 58, late)
    publisher = world.publisher()
    try:
        [closed] = (await flushed(publisher, "lane-a")).closed
    finally:
        await publisher.close()
    assert (closed.after_requests, closed.after_max_tokens) == (6, 58)
    assert closed.reason == "SLO_UNATTAINABLE"
    # Nothing runs on the Lane: it holds until the next message.
    assert not closed.HasField("closed_for_ms")


@pytest.mark.anyio
async def test_a_filling_gate_on_a_busy_lane_holds_while_the_work_drains(world: World) -> None:
    late = refused(INTERACTIVE, admission.Reason.SLO_UNATTAINABLE)
    world.answers[("lane-a", "interactive")] = admission.Filling(
        2, 58, late, most_max_tokens=58, least_prompt_tokens=5, most_prompt_tokens=20
    )
    world.running = 4
    publisher = world.publisher()
    try:
        [closed] = (await flushed(publisher, "lane-a")).closed
    finally:
        await publisher.close()
    assert closed.closed_for_ms == 750
    assert (closed.after_requests, closed.after_max_tokens) == (2, 58)
    assert closed.after_most_max_tokens == 58
    assert (closed.after_least_prompt_tokens, closed.after_most_prompt_tokens) == (5, 20)


@pytest.mark.anyio
async def test_policies_asked_are_the_lanes_and_those_its_requests_named(world: World) -> None:
    world.named["lane-a"] = ["batch", "interactive", "deleted"]
    world.answers[("lane-a", "batch")] = refused(BATCH, admission.Reason.QUEUE_FULL)
    publisher = world.publisher()
    try:
        snapshot = await flushed(publisher, "lane-a")
    finally:
        await publisher.close()
    assert world.asked == [("lane-a", ("interactive", "batch"), False)]
    [closed] = snapshot.closed
    assert closed.policy == "batch" and not closed.lane_policy


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("changes", "enabled", "asked"),
    [
        # Asleep (no ready replica): a request wakes it; no gate.
        ({"replicas": ()}, True, False),
        # An upstream Lane refuses some requests before admission; no gate.
        ({"upstream": object()}, True, False),
        # Scaled to zero, its replica draining: the Lane refuses every request as
        # scaled to zero (503), which a gate's 429 for the work it drains would hide.
        ({"desired": 0}, True, False),
        # With API keys in force, none at all.
        ({}, False, False),
        # A spillover Lane: asked with spill (admission opens the gate of a targeted
        # policy then).
        ({"spillover": "lane-b"}, True, True),
    ],
)
async def test_lanes_that_are_not_gated(
    world: World, changes: dict[str, object], enabled: bool, asked: bool
) -> None:
    world.routes = table(route(**changes))
    world.enabled = enabled
    world.answers[("lane-a", "interactive")] = refused(INTERACTIVE, admission.Reason.QUEUE_FULL)
    publisher = world.publisher()
    try:
        snapshot = await flushed(publisher, "lane-a")
    finally:
        await publisher.close()
    assert bool(world.asked) == asked
    if asked:
        assert world.asked[0][2] is True
    else:
        assert list(snapshot.closed) == []


@pytest.mark.anyio
async def test_watchers_hear_the_state_then_each_change_only(world: World) -> None:
    publisher = world.publisher()
    watch = publisher.watch()
    try:
        first = await anext(watch)
        assert list(first.closed) == [] and first.refresh_ms == 60000
        world.answers[("lane-a", "interactive")] = refused(INTERACTIVE, admission.Reason.QUEUE_FULL)
        await flushed(publisher, "lane-a")
        changed = await asyncio.wait_for(anext(watch), 1.0)
        assert [g.reason for g in changed.closed] == ["QUEUE_FULL"]
        # The same gates again: nothing to hear.
        await flushed(publisher, "lane-a")
        nothing = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.05)
        assert not nothing.done()
        # A Lane that leaves the table takes its gates along.
        world.routes = table()
        await flushed(publisher, "lane-a")
        assert list((await asyncio.wait_for(nothing, 1.0)).closed) == []
    finally:
        await watch.aclose()
        await publisher.close()


@pytest.mark.anyio
async def test_marks_before_a_flush_make_one_flush(world: World) -> None:
    world.routes = table(route("lane-a"), route("lane-b"))
    publisher = world.publisher()
    try:
        for _ in range(5):
            publisher.mark("lane-a")
        publisher.mark("lane-b")
        await asyncio.sleep(0)
    finally:
        await publisher.close()
    assert sorted(lane for lane, _, _ in world.asked) == ["lane-a", "lane-b"]


async def heard(watch: AsyncIterator[inference_pb2.AdmissionGates]) -> dict[str, int] | None:
    """The `seen` of the next message if one is already due, else None."""
    try:
        return dict((await asyncio.wait_for(anext(watch), 0.05)).seen)
    except TimeoutError:
        return None


@pytest.mark.anyio
async def test_each_watcher_hears_what_its_tags_had_reached_when_the_gates_were_computed(
    world: World,
) -> None:
    world.routes = table(route("lane-a"), route("lane-b"))
    world.answers[("lane-a", "interactive")] = refused(INTERACTIVE, admission.Reason.QUEUE_FULL)
    world.seen = {"lane-a": {"w1": 3, "w2": 9}, "lane-b": {"w1": 4}}
    publisher = world.publisher()
    watches = {name: publisher.watch(name) for name in ("w1", "w2", "")}
    try:
        for watch in watches.values():
            await anext(watch)  # the state before the flush
        await flushed(publisher, "lane-a", "lane-b")
        # Only Lanes with gates listed (lane-b has none); no watcher id, no `seen`.
        assert {name: await heard(w) for name, w in watches.items()} == {
            "w1": {"lane-a": 3},
            "w2": {"lane-a": 9},
            "": {},
        }
        # As of the gates: later arrivals show once the Lane's gates are asked again.
        world.seen["lane-a"]["w1"] = 5
        assert dict(publisher.snapshot("w1").seen) == {"lane-a": 3}
        await flushed(publisher, "lane-a")
        # The same gates: only the watcher whose requests arrived hears of it.
        assert {name: await heard(w) for name, w in watches.items()} == {
            "w1": {"lane-a": 5},
            "w2": None,
            "": None,
        }
        assert dict(publisher.snapshot("w1").seen) == {"lane-a": 5}
    finally:
        for watch in watches.values():
            await watch.aclose()
        await publisher.close()


@pytest.mark.anyio
async def test_a_lane_whose_gates_open_takes_its_seen_along(world: World) -> None:
    world.answers[("lane-a", "interactive")] = refused(INTERACTIVE, admission.Reason.QUEUE_FULL)
    world.seen = {"lane-a": {"w1": 3}}
    publisher = world.publisher()
    try:
        assert dict((await flushed(publisher, "lane-a")).seen) == {}  # shared: no watcher
        assert dict(publisher.snapshot("w1").seen) == {"lane-a": 3}
        del world.answers[("lane-a", "interactive")]
        await flushed(publisher, "lane-a")
        assert dict(publisher.snapshot("w1").seen) == {}
    finally:
        await publisher.close()


@pytest.mark.anyio
async def test_an_idle_lane_is_asked_again_only_when_what_its_gates_read_changes(
    world: World,
) -> None:
    """The heartbeat asks no idle Lane again (a daemon at rest spent its CPU on that):
    only a Lane with work, whose route, keys or policies changed, or that left."""
    world.routes = table(route("lane-a"), route("lane-b"))
    world.answers[("lane-b", "interactive")] = refused(INTERACTIVE, admission.Reason.QUEUE_FULL)
    publisher = world.publisher()
    try:
        assert publisher.stale() == {"lane-a", "lane-b"}  # never computed
        await flushed(publisher, "lane-a", "lane-b")
        assert publisher.stale() == set()
        world.busy.add("lane-a")
        assert publisher.stale() == {"lane-a"}
        world.busy.clear()
        world.stored = {**world.stored, "new": admission.Policy(name="new", priority=1)}
        assert publisher.stale() == {"lane-a", "lane-b"}
        await flushed(publisher, "lane-a", "lane-b")
        world.enabled = False
        assert publisher.stale() == {"lane-a", "lane-b"}
        world.enabled = True
        world.routes = table(route("lane-a", slots=8), route("lane-b"))
        assert publisher.stale() == {"lane-a"}  # keys back as lane-b was computed
        await flushed(publisher, "lane-a", "lane-b")
        world.routes = table(route("lane-a", slots=8))
        assert publisher.stale() == {"lane-b"}  # listed, and gone from the table
        await flushed(publisher, "lane-b")
        assert publisher.stale() == set() and not publisher.snapshot().closed
    finally:
        await publisher.close()
