"""/metrics says what each Lane's replicas are doing, as the controller writes it: a
crash loop or a Lane with nothing serving can be alerted on."""

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
