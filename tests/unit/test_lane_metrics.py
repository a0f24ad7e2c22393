"""What the data plane's view of the fleet tells an operator of each Lane: /metrics says
what its replicas are doing, as the controller writes it (a crash loop or a Lane with
nothing serving can be alerted on), and events say when its names route elsewhere."""

from __future__ import annotations

from prometheus_client import REGISTRY

from blazar.api.kinds import Kind, LaneStatus, ReplicaStatus
from blazar.dataplane.fleet import FleetView
from blazar.store.memory import MemoryStore
from tests.unit.helpers import Clock
from tests.unit.test_controller import MODEL, apply

LANE = """
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: metered}
spec: {model: m, replicas: 2}
"""


def replicas(state: str) -> float | None:
    return REGISTRY.get_sample_value("blazar_lane_replicas", {"lane": "metered", "state": state})


def restarts(replica: int) -> float | None:
    labels = {"lane": "metered", "replica": str(replica)}
    return REGISTRY.get_sample_value("blazar_replica_restarts", labels)


def test_a_lanes_replicas_and_restarts_follow_its_status_and_leave_with_it() -> None:
    store = MemoryStore(clock=Clock())
    fleet = FleetView(store, on_table=lambda _: None)
    try:
        apply(store, MODEL)
        apply(store, LANE)
        assert (replicas("ready"), replicas("failed")) == (0.0, 0.0)
        status = LaneStatus(
            replica_statuses=[
                ReplicaStatus(index=0, state="Ready", restarts=0),
                ReplicaStatus(index=1, state="Failed", restarts=3),
            ]
        )
        store.update_status(Kind.LANE, "metered", status)
        assert (replicas("ready"), replicas("failed"), replicas("starting")) == (1.0, 1.0, 0.0)
        assert (restarts(0), restarts(1)) == (0.0, 3.0)
        store.update_status(
            Kind.LANE,
            "metered",
            LaneStatus(replica_statuses=[ReplicaStatus(index=0, state="Ready", restarts=0)]),
        )
        assert restarts(1) is None  # the replica is gone: so is its series
        store.delete(Kind.LANE, "metered")
        assert replicas("ready") is None and restarts(0) is None
    finally:
        fleet.close()


def lane_with(name: str, *aliases: str) -> str:
    return (
        f"apiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {{name: {name}}}\n"
        f"spec: {{model: m, aliases: [{', '.join(aliases)}]}}\n"
    )


def test_a_lane_whose_alias_another_lane_answers_to_is_told() -> None:
    """A Lane claiming another Lane's name as an alias, or an alias an older Lane
    claims, never gets it: clients are routed elsewhere, and the Lane that lost the name
    gets one Warning `AliasConflict` naming the Lane that answers, each time it starts
    to lose it. A Lane applied later never takes an alias from a running one (a Lane
    `aa` applied with the alias `assistant` took it from Lane `chat` when name order
    decided, and live traffic went to a Lane with no replica)."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    fleet = FleetView(store, on_table=lambda _: None)

    def conflicts(lane: str) -> list[str]:
        return [
            e.message for e in store.events(kind="Lane", name=lane) if e.reason == "AliasConflict"
        ]

    try:
        apply(store, MODEL)
        apply(store, lane_with("chat", "assistant"))
        clock.tick()
        apply(store, lane_with("wide", "chat", "bulk"))
        assert conflicts("chat") == []
        assert len(conflicts("wide")) == 1 and "'chat'" in conflicts("wide")[0]
        apply(store, lane_with("aa", "assistant"))
        assert fleet.table.by_name["assistant"].lane == "chat"
        (lost,) = conflicts("aa")
        assert lost.startswith("spec.aliases names 'assistant', which Lane 'chat' answers to")
        assert conflicts("chat") == [] and len(conflicts("wide")) == 1
        store.update_status(Kind.LANE, "chat", LaneStatus())  # a rebuild: said once
        assert len(conflicts("aa")) == 1
        # The older claim gone, the alias passes to the next oldest, and is said anew
        # when a Lane older than that one claims it back.
        store.delete(Kind.LANE, "chat")
        assert fleet.table.by_name["assistant"].lane == "aa"
        clock.tick()
        apply(store, lane_with("chat", "assistant"))
        assert fleet.table.by_name["assistant"].lane == "aa"
        (taken,) = conflicts("chat")
        assert "which Lane 'aa' answers to" in taken
    finally:
        fleet.close()
