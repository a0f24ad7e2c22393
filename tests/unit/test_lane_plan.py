"""The Lane planner and status as tables: observed replicas + now -> actions, status."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from blazar.api import conditions
from blazar.api.kinds import LaneMemory, LaneStatus
from blazar.api.meta import ConditionStatus
from blazar.api.replicas import LaunchSpec, ReplicaObservation, ReplicaState
from blazar.controller import lane_plan
from blazar.controller.lane_plan import ModelReadiness, Start, Stop
from tests import launches

NOW = datetime(2026, 1, 1, tzinfo=UTC)
LAUNCH = launches.spec("/m.gguf", slots=4, context_per_slot=2048, threads=2)
OLD = launches.spec("/m.gguf", slots=2, context_per_slot=2048, threads=2)


def obs(
    index: int,
    state: ReplicaState = ReplicaState.READY,
    *,
    restarts: int = 0,
    exited_ago: float | None = None,
    ran: float | None = None,
    launch: LaunchSpec = LAUNCH,
) -> ReplicaObservation:
    exited_at = None if exited_ago is None else NOW - timedelta(seconds=exited_ago)
    return ReplicaObservation(
        lane="l",
        index=index,
        state=state,
        revision=launch.revision,
        socket=f"/run/l-{index}.sock",
        pid=100 + index,
        restarts=restarts,
        started_at=None if exited_at is None or ran is None else exited_at - timedelta(seconds=ran),
        exited_at=exited_at,
        exit_code=None if exited_ago is None else -9,
    )


@pytest.mark.parametrize(
    ("desired", "launch", "observed", "actions", "requeue"),
    [
        pytest.param(2, LAUNCH, [], [Start(0, LAUNCH, False), Start(1, LAUNCH, False)], None, id="scale-up-from-nothing"),
        pytest.param(1, LAUNCH, [obs(0)], [], None, id="converged"),
        pytest.param(1, LAUNCH, [obs(0), obs(1)], [Stop(1, "ScaledDown")], None, id="scale-down"),
        pytest.param(0, None, [obs(0)], [Stop(0, "ScaledDown")], None, id="scale-to-zero-without-model"),
        pytest.param(1, None, [obs(0)], [], None, id="model-not-ready-keeps-running"),
        pytest.param(1, None, [], [], None, id="model-not-ready-starts-nothing"),
        pytest.param(1, None, [obs(0), obs(1)], [Stop(1, "ScaledDown")], None, id="model-not-ready-scales-down"),
        # The Model changed mid-rollout: the surge is the only replica serving, so it stays.
        pytest.param(1, None, [obs(0, ReplicaState.STARTING), obs(1)], [], None, id="model-not-ready-keeps-the-serving-surge"),
        pytest.param(1, None, [obs(0, ReplicaState.FAILED, exited_ago=9), obs(1)], [], None, id="model-not-ready-keeps-the-surge-for-a-failed-index"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.FAILED, exited_ago=0.01)], [Start(0, LAUNCH, True)], None, id="first-crash-restarts-at-once"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.FAILED, restarts=1, exited_ago=0.2)], [], 0.8, id="crash-waits-backoff"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.FAILED, restarts=1, exited_ago=1.5)], [Start(0, LAUNCH, True, backoff_s=1.0)], None, id="crash-restarts-after-backoff"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.FAILED, restarts=4, exited_ago=5)], [], 3.0, id="backoff-grows"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.FAILED, restarts=4, exited_ago=5, ran=599)], [], 3.0, id="backoff-grows-after-a-short-run"),
        # As the kubelet: 10 minutes of running resets the back-off (not the restart count).
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.FAILED, restarts=3, exited_ago=1.5, ran=600)], [Start(0, LAUNCH, True)], None, id="backoff-resets-after-a-long-run"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.FAILED, restarts=6, exited_ago=0.01, ran=3600)], [Start(0, LAUNCH, True)], None, id="long-run-restarts-at-once"),
        # A rolling update: a surge replica first, the old one stopped once it is ready,
        # and a look again once that stop is done, to start its index at the new revision.
        pytest.param(1, LAUNCH, [obs(0, launch=OLD)], [Start(1, LAUNCH, False)], None, id="spec-change-starts-a-surge"),
        pytest.param(1, LAUNCH, [obs(0, launch=OLD), obs(1, ReplicaState.STARTING)], [], None, id="surge-starting"),
        pytest.param(1, LAUNCH, [obs(0, launch=OLD), obs(1)], [Stop(0, "SpecChanged")], "again", id="surge-ready-old-stops"),
        pytest.param(1, LAUNCH, [obs(1)], [Start(0, LAUNCH, False)], None, id="surge-serves-while-index-restarts"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.STARTING), obs(1)], [], None, id="surge-kept-until-settled"),
        pytest.param(2, LAUNCH, [obs(0, launch=OLD), obs(1, launch=OLD), obs(2)], [Stop(0, "SpecChanged")], "again", id="one-old-at-a-time"),
        pytest.param(2, LAUNCH, [obs(0, ReplicaState.STARTING), obs(1, launch=OLD), obs(2)], [], None, id="next-old-waits-for-capacity"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.STARTING, launch=OLD)], [Stop(0, "SpecChanged")], "again", id="old-starting-replaced-at-once"),
        pytest.param(1, LAUNCH, [obs(0, launch=OLD), obs(1, launch=OLD)], [Stop(1, "SpecChanged")], "again", id="surge-index-busy"),
        pytest.param(1, LAUNCH, [obs(0, launch=OLD), obs(1, ReplicaState.FAILED, restarts=4, exited_ago=1)], [], 7.0, id="failing-surge-old-keeps-serving"),
        pytest.param(1, LAUNCH, [obs(0, launch=OLD), obs(1, ReplicaState.FAILED, exited_ago=2)], [Start(1, LAUNCH, True)], None, id="failed-surge-restarts"),
        pytest.param(1, LAUNCH, [obs(0, ReplicaState.DRAINING, launch=OLD)], [], None, id="draining-left-alone"),
    ],
)  # fmt: skip
def test_plan_replicas(
    desired: int,
    launch: LaunchSpec | None,
    observed: list[ReplicaObservation],
    actions: list[lane_plan.Action],
    requeue: float | str | None,
) -> None:
    plan = lane_plan.plan_replicas(desired=desired, launch=launch, observed=observed, now=NOW)
    assert plan.actions == actions
    # "again": look again as soon as the pass's stops are done, with no timer.
    assert plan.again == (requeue == "again")
    timer = None if requeue in (None, "again") else requeue
    assert plan.requeue_after == (None if timer is None else pytest.approx(timer))


@pytest.mark.parametrize("desired", [1, 2, 3])
def test_a_rolling_update_never_serves_with_fewer_ready_replicas(desired: int) -> None:
    """Walk a rollout pass by pass: each Start is ready by the next pass, each Stop is
    gone at once. Ready replicas never drop below `desired`, at most one runs beyond
    it, and the end is `desired` ready replicas of the new revision."""
    world = {i: obs(i, launch=OLD) for i in range(desired)}
    for _ in range(4 * desired + 4):
        plan = lane_plan.plan_replicas(
            desired=desired, launch=LAUNCH, observed=list(world.values()), now=NOW
        )
        for action in plan.actions:
            if isinstance(action, Stop):
                del world[action.index]
            else:
                world[action.index] = obs(action.index, ReplicaState.STARTING)
            ready = sum(1 for o in world.values() if o.state == ReplicaState.READY)
            assert ready >= desired, (action, world)
            assert max(world) <= desired  # the surge's index at most
        if not plan.actions and all(o.state == ReplicaState.READY for o in world.values()):
            break
        world = {i: replace(o, state=ReplicaState.READY) for i, o in world.items()}
    assert sorted(world) == list(range(desired))
    assert {o.revision for o in world.values()} == {LAUNCH.revision}
    assert all(o.state == ReplicaState.READY for o in world.values())


SPECS = [launches.spec("/m.gguf", slots=s, context_per_slot=2048, threads=2) for s in (1, 2, 3)]


@pytest.mark.parametrize("seed", range(40))
def test_spec_changes_mid_rollout_never_serve_with_fewer_ready_replicas(seed: int) -> None:
    """Random spec changes at random points of a rollout, replicas becoming ready at
    random: once `desired` replicas are ready, never fewer (nothing crashes here), and
    the Lane ends on the last spec. At times the Model is not ready (an edit being
    resolved), so the planner has no launch spec."""
    rng = random.Random(seed)
    desired = rng.choice([1, 2, 3])
    world = {i: obs(i, launch=SPECS[0]) for i in range(desired)}
    launch = SPECS[0]
    for step in range(60):
        if step < 30 and rng.random() < 0.3:
            launch = rng.choice(SPECS)
        pending = step < 30 and rng.random() < 0.2
        plan = lane_plan.plan_replicas(
            desired=desired,
            launch=None if pending else launch,
            observed=list(world.values()),
            now=NOW,
        )
        for action in plan.actions:
            if isinstance(action, Stop):
                del world[action.index]
            else:
                world[action.index] = obs(action.index, ReplicaState.STARTING, launch=launch)
            ready = sum(1 for o in world.values() if o.state == ReplicaState.READY)
            assert ready >= desired, (step, action, world)
        world = {
            i: replace(o, state=ReplicaState.READY) if rng.random() < 0.5 else o
            for i, o in world.items()
        }
    plan = lane_plan.plan_replicas(
        desired=desired, launch=launch, observed=list(world.values()), now=NOW
    )
    assert plan.actions == []
    assert sorted(world) == list(range(desired)), world
    assert {o.revision for o in world.values()} == {launch.revision}


@pytest.mark.parametrize(
    ("restarts", "delay"), [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (7, 60.0), (100, 60.0)]
)
def test_crash_backoff_is_exponential_and_capped(restarts: int, delay: float) -> None:
    """The first restart at once (a one-off crash), then 1 s doubling to 60 s."""
    assert lane_plan.crash_backoff(restarts) == delay


@pytest.mark.parametrize(
    ("start", "message"),
    [
        (Start(0, LAUNCH, True), "Restarting crashed replica 0 at once."),
        (
            Start(1, LAUNCH, True, backoff_s=2.0),
            "Restarting crashed replica 1 after a 2 s back-off.",
        ),
    ],
)
def test_restart_event_says_how_long_it_backed_off(start: Start, message: str) -> None:
    """The BackOff event said "Restarting crashed replica 0." every time, the first
    restart (at once, docs/lanes.md says) too: it says whether and how long it waited."""
    assert lane_plan.restart_message(start) == message


@pytest.mark.parametrize(
    ("replica", "due_in"),
    [
        pytest.param(obs(0, ReplicaState.FAILED, restarts=3, exited_ago=1.5), 2.5, id="in-back-off"),
        pytest.param(obs(0, ReplicaState.FAILED, exited_ago=1.5), -1.5, id="first-crash-at-once"),
        pytest.param(obs(0, ReplicaState.FAILED, restarts=3, exited_ago=1, ran=600), -1, id="long-run-resets"),
        pytest.param(obs(0), None, id="ready"),
    ],
)  # fmt: skip
def test_a_failed_replicas_status_says_when_it_is_restarted(
    replica: ReplicaObservation, due_in: float | None
) -> None:
    """`restartAt` is what `plan_replicas` waits for: its exit plus the back-off."""
    (status,) = lane_plan.replica_statuses([replica])
    due = None if due_in is None else NOW + timedelta(seconds=due_in)
    assert status.restart_at == due
    if due is not None and due > NOW:
        plan = lane_plan.plan_replicas(desired=1, launch=LAUNCH, observed=[replica], now=NOW)
        assert plan.actions == [] and plan.requeue_after == due_in


def test_restart_now_skips_a_failed_replicas_back_off() -> None:
    """A change of the Lane's health checks restarts a replica in back-off at once (the
    crash may have been the checks'); without it, it waits."""
    failed = obs(0, ReplicaState.FAILED, restarts=3, exited_ago=1.5)
    waiting = lane_plan.plan_replicas(desired=1, launch=LAUNCH, observed=[failed], now=NOW)
    assert waiting.actions == [] and waiting.requeue_after == 2.5
    now = lane_plan.plan_replicas(
        desired=1, launch=LAUNCH, observed=[failed], now=NOW, restart_now=True
    )
    assert now.actions == [Start(0, LAUNCH, restart=True, backoff_s=0.0)]
    # A replica that serves is left alone.
    ready = lane_plan.plan_replicas(
        desired=1, launch=LAUNCH, observed=[obs(0)], now=NOW, restart_now=True
    )
    assert ready.actions == []


def test_each_replicas_status_says_the_slots_its_engine_runs_with() -> None:
    """A rollout of a `slots` change: the old replica runs the old number until it
    stops, and routing reads it from here (`routing.slots_of`)."""
    old, new = replace(obs(0), slots=1), replace(obs(1), slots=2)
    assert [s.slots for s in lane_plan.replica_statuses([old, new])] == [1, 2]


def test_each_replicas_status_says_the_context_its_engine_holds() -> None:
    """A rollout of a `contextPerSlot` change: the old replica holds the old size until
    it stops, and routing reads it from here (`routing.context_of`)."""
    old, new = replace(obs(0), context_per_slot=512), replace(obs(1), context_per_slot=2048)
    assert [s.context_per_slot for s in lane_plan.replica_statuses([old, new])] == [512, 2048]


READY_MODEL = ModelReadiness(True, "ModelReady", "ok")


def status_of(
    observed: list[ReplicaObservation],
    desired: int = 1,
    model: ModelReadiness = READY_MODEL,
    previous: LaneStatus | None = None,
) -> dict[str, tuple[str, str]]:
    status = lane_plan.lane_status(
        previous=previous or LaneStatus(),
        generation=3,
        desired=desired,
        model=model,
        observed=observed,
        now=NOW,
        revision=LAUNCH.revision,
    )
    assert status.observed_generation == 3
    assert all(c.observed_generation == 3 for c in status.conditions)
    return {c.type: (c.status.value, c.reason) for c in status.conditions}


@pytest.mark.parametrize(
    ("observed", "desired", "model", "expect"),
    [
        pytest.param([obs(0)], 1, READY_MODEL, {"Ready": ("True", "AllReplicasReady"), "Available": ("True", "MinimumReplicasAvailable"), "Degraded": ("False", "ReplicasHealthy"), "Progressing": ("True", "ReplicasConverged")}, id="ready"),
        pytest.param([obs(0, ReplicaState.STARTING)], 1, READY_MODEL, {"Ready": ("False", "ReplicasNotReady"), "Available": ("False", "NoReplicaReady"), "Progressing": ("True", "ReplicasUpdating")}, id="starting"),
        pytest.param([obs(0, ReplicaState.FAILED, restarts=2, exited_ago=0.1)], 1, READY_MODEL, {"Ready": ("False", "ReplicasNotReady"), "Degraded": ("True", "CrashLoopBackOff")}, id="crash-loop"),
        pytest.param([obs(0, ReplicaState.STARTING, restarts=1)], 1, READY_MODEL, {"Degraded": ("True", "CrashLoopBackOff")}, id="restarting-still-degraded"),
        pytest.param([obs(0, restarts=1)], 1, READY_MODEL, {"Ready": ("True", "AllReplicasReady"), "Degraded": ("False", "ReplicasHealthy")}, id="recovered"),
        pytest.param([], 1, ModelReadiness(False, "ChecksumMismatch", "bad"), {"Ready": ("False", "ModelNotReady"), "ModelReady": ("False", "ChecksumMismatch")}, id="model-bad"),
        pytest.param([], 0, READY_MODEL, {"Ready": ("True", "ScaledToZero"), "Available": ("True", "ScaledToZero"), "Progressing": ("True", "ReplicasConverged")}, id="zero"),
        pytest.param([obs(0)], 0, READY_MODEL, {"Available": ("True", "MinimumReplicasAvailable"), "Ready": ("False", "ScalingDown")}, id="scaling-to-zero"),
        # A replica beyond `desired` of the spec's own revision, the Lane not rolling:
        # scaled down (replicas 2 -> 1), nothing replaced.
        pytest.param([obs(0), obs(1)], 1, READY_MODEL, {"Available": ("True", "MinimumReplicasAvailable"), "Ready": ("False", "ScalingDown"), "Progressing": ("True", "ReplicasUpdating")}, id="scaling-down"),
        pytest.param([obs(0, launch=OLD)], 1, READY_MODEL, {"Available": ("True", "MinimumReplicasAvailable"), "Ready": ("False", "RollingUpdate"), "Progressing": ("True", "ReplicasUpdating")}, id="spec-changed"),
        pytest.param([obs(0, launch=OLD), obs(1, ReplicaState.FAILED, restarts=5, exited_ago=1)], 1, READY_MODEL, {"Available": ("True", "MinimumReplicasAvailable"), "Ready": ("False", "ReplicasNotReady"), "Degraded": ("True", "CrashLoopBackOff")}, id="failing-surge-is-degraded"),
    ],
)  # fmt: skip
def test_lane_status(
    observed: list[ReplicaObservation],
    desired: int,
    model: ModelReadiness,
    expect: dict[str, tuple[str, str]],
) -> None:
    got = status_of(observed, desired, model)
    assert {k: got[k] for k in expect} == expect


def test_a_stuck_rollout_says_the_old_replicas_serve() -> None:
    """The new spec's surge crash-loops while the old replica serves: Ready says the
    rollout is stuck, not "1 of 1 replicas are ready" beside Ready False."""
    status = lane_plan.lane_status(
        previous=LaneStatus(),
        generation=3,
        desired=1,
        model=READY_MODEL,
        observed=[obs(0, launch=OLD), obs(1, ReplicaState.FAILED, restarts=5, exited_ago=1)],
        now=NOW,
        revision=LAUNCH.revision,
    )
    ready = conditions.get_condition(status.conditions, "Ready")
    assert ready is not None and ready.status == ConditionStatus.FALSE
    assert "stuck" in ready.message and "1 replica(s) of the previous spec" in ready.message


def test_the_surge_of_a_rollout_is_still_rolling_in_its_last_pass() -> None:
    """Every replica below `desired` runs the new spec and the surge still serves: the
    rollout's last pass, not a scale-down."""
    rolling = lane_plan.lane_status(
        previous=LaneStatus(),
        generation=3,
        desired=1,
        model=READY_MODEL,
        observed=[obs(0, launch=OLD), obs(1)],
        now=NOW,
        revision=LAUNCH.revision,
    )
    got = status_of([obs(0, ReplicaState.STARTING), obs(1)], previous=rolling)
    assert got["Ready"] == ("False", "RollingUpdate")
    assert got["Available"] == ("True", "MinimumReplicasAvailable")
    assert status_of([obs(0), obs(1)], previous=rolling)["Ready"] == ("False", "RollingUpdate")
    assert status_of([obs(0)], previous=rolling)["Ready"] == ("True", "AllReplicasReady")


def test_lane_status_keeps_transition_time_when_unchanged() -> None:
    first = lane_plan.lane_status(
        previous=LaneStatus(),
        generation=1,
        desired=1,
        model=READY_MODEL,
        observed=[obs(0)],
        now=NOW,
    )
    later = NOW + timedelta(minutes=5)
    second = lane_plan.lane_status(
        previous=first, generation=1, desired=1, model=READY_MODEL, observed=[obs(0)], now=later
    )
    assert second == first
    ready = conditions.get_condition(second.conditions, "Ready")
    assert ready is not None and ready.last_transition_time == NOW


SHORT = lane_plan.Placement(
    False, "InsufficientMemory", "Replica 1 needs more.", LaneMemory(estimate_bytes=9)
)


@pytest.mark.parametrize(
    ("placement", "observed", "schedulable", "ready"),
    [
        # Nothing placed yet: Ready says why, in the ledger's words.
        (SHORT, [], ("False", "InsufficientMemory"), ("False", "InsufficientMemory")),
        (SHORT, [obs(0)], ("False", "InsufficientMemory"), ("False", "InsufficientMemory")),
        # Every replica it asks for runs (it fitted before): Ready holds.
        (SHORT, [obs(0), obs(1)], ("False", "InsufficientMemory"), ("True", "AllReplicasReady")),
        (lane_plan.Placement(True, "MemoryFits", "ok."), [obs(0)], ("True", "MemoryFits"),
         ("False", "ReplicasNotReady")),
    ],
)  # fmt: skip
def test_lane_status_shows_the_placement(
    placement: lane_plan.Placement,
    observed: list[ReplicaObservation],
    schedulable: tuple[str, str],
    ready: tuple[str, str],
) -> None:
    status = lane_plan.lane_status(
        previous=LaneStatus(), generation=1, desired=2, model=READY_MODEL, observed=observed,
        now=NOW, revision=LAUNCH.revision, placement=placement,
    )  # fmt: skip
    conds = {c.type: (c.status.value, c.reason) for c in status.conditions}
    assert (conds["Schedulable"], conds["Ready"]) == (schedulable, ready)
    assert status.memory == placement.memory


@pytest.mark.parametrize(
    ("observed", "desired", "degraded"),
    [
        # A spec change whose new replica does not fit beside the old one: the rollout
        # is stuck, the old replica serves on.
        ([obs(0, launch=OLD)], 1, ("True", "InsufficientMemory")),
        # Not a rollout: a Lane short of a replica it never had is not degraded.
        ([obs(0)], 2, ("False", "ReplicasHealthy")),
    ],
)
def test_a_rollout_whose_next_replica_cannot_be_placed_is_degraded(
    observed: list[ReplicaObservation], desired: int, degraded: tuple[str, str]
) -> None:
    status = lane_plan.lane_status(
        previous=LaneStatus(), generation=1, desired=desired, model=READY_MODEL,
        observed=observed, now=NOW, revision=LAUNCH.revision, placement=SHORT,
    )  # fmt: skip
    found = conditions.get_condition(status.conditions, "Degraded")
    assert found is not None and (found.status.value, found.reason) == degraded
    if degraded[0] == "True":
        assert SHORT.message in found.message and "old replicas keep serving" in found.message
        available = conditions.get_condition(status.conditions, "Available")
        assert available is not None and available.status.value == "True"


def test_lane_status_without_a_placement_keeps_the_last() -> None:
    first = lane_plan.lane_status(
        previous=LaneStatus(), generation=1, desired=1, model=READY_MODEL, observed=[],
        now=NOW, placement=SHORT,
    )  # fmt: skip
    later = lane_plan.lane_status(
        previous=first, generation=2, desired=1, model=ModelReadiness(False, "ModelPending", "."),
        observed=[], now=NOW,
    )  # fmt: skip
    assert later.memory == SHORT.memory
    cond = conditions.get_condition(later.conditions, "Schedulable")
    assert cond is not None and cond.reason == "InsufficientMemory"


@pytest.mark.parametrize(
    ("observed", "actions", "states"),
    [
        pytest.param([obs(0), obs(1)], [Stop(0, "SpecChanged")], ["Draining", "Ready"], id="stopped-ready-drains"),
        pytest.param([obs(0, ReplicaState.STARTING)], [Stop(0, "SpecChanged")], ["Starting"], id="starting-stays"),
        pytest.param([obs(0, ReplicaState.FAILED, exited_ago=1)], [Stop(0, "ScaledDown")], ["Failed"], id="failed-stays"),
        pytest.param([obs(0)], [Start(1, LAUNCH, False)], ["Ready"], id="a-start-changes-nothing"),
        pytest.param([obs(0)], [], ["Ready"], id="no-actions"),
    ],
)  # fmt: skip
def test_stopping_marks_the_serving_replicas_a_stop_drains(
    observed: list[ReplicaObservation], actions: list[lane_plan.Action], states: list[str]
) -> None:
    assert [o.state.value for o in lane_plan.stopping(observed, actions)] == states
