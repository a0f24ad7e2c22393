"""Routing as tables: lanes -> names, names -> lanes, lanes -> replicas."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from blazar.api import errors
from blazar.api.kinds import Idle, Lane, LaneSpec, LaneStatus, ReplicaStatus
from blazar.api.meta import Condition, ConditionStatus, ObjectMeta
from blazar.dataplane import routing


def lane(
    name: str,
    *aliases: str,
    ready: tuple[int, ...] = (0,),
    starting: tuple[int, ...] = (),
    desired: int = 1,
) -> Lane:
    replicas = [ReplicaStatus(index=i, state="Ready", socket=f"/s/{name}-{i}") for i in ready]
    replicas += [
        ReplicaStatus(index=i, state="Starting", socket=f"/s/{name}-{i}") for i in starting
    ]
    return Lane(
        metadata=ObjectMeta(name=name),
        spec=LaneSpec(model="m", aliases=list(aliases), replicas=desired),
        status=LaneStatus(replica_statuses=replicas),
    )


TABLE = routing.build_table(
    [lane("b", "shared", "bee"), lane("a", "shared", "b"), lane("c", ready=(), starting=(0,))]
)


@pytest.mark.parametrize(
    ("name", "lane_name"),
    [("a", "a"), ("b", "b"), ("bee", "b"), ("shared", "a"), ("c", "c")],
)
def test_resolve(name: str, lane_name: str) -> None:
    assert routing.resolve(TABLE, name).lane == lane_name


def test_a_name_tagged_latest_finds_the_untagged_lane_as_ollama_reads_it() -> None:
    """Ollama reads `gemma3` and `gemma3:latest` as one model; an alias that carries
    the tag itself is found exactly first, and only `:latest` is folded."""
    table = routing.build_table([lane("gemma3"), lane("other", "tagged:latest")])
    assert routing.resolve(table, "gemma3:latest").lane == "gemma3"
    assert routing.resolve(table, "tagged:latest").lane == "other"
    for missing in ("gemma3:270m", ":latest", "gemma3:LATEST", "tagged"):
        with pytest.raises(errors.ModelNotFound) as exc:
            routing.resolve(table, missing)
        assert exc.value.metadata == {"model": missing}


def test_of_lanes_claiming_one_alias_the_oldest_wins_then_name_order() -> None:
    def created(name: str, second: int, *aliases: str) -> Lane:
        made = lane(name, *aliases)
        made.metadata.creation_timestamp = datetime(2026, 1, 1, 0, 0, second, tzinfo=UTC)
        return made

    table = routing.build_table(
        [created("a", 9, "shared"), created("z", 1, "shared", "late"), created("m", 9, "late")]
    )
    assert routing.resolve(table, "shared").lane == "z"  # older than "a"
    assert routing.resolve(table, "late").lane == "z"
    assert routing.shadowed_aliases(table) == {("a", "shared"): "z", ("m", "late"): "z"}
    tie = routing.build_table([created("b", 5, "x"), created("a", 5, "x")])
    assert routing.resolve(tie, "x").lane == "a"


def test_shadowed_aliases_name_the_lane_that_answers() -> None:
    # "shared": "a" claims it first; "b" is Lane b's own name; "bee" is b's alone.
    assert routing.shadowed_aliases(TABLE) == {("b", "shared"): "a", ("a", "b"): "b"}
    assert routing.shadowed_aliases(routing.build_table([lane("x", "x", "y")])) == {}


def test_unknown_name_is_model_not_found() -> None:
    with pytest.raises(errors.ModelNotFound) as exc:
        routing.resolve(TABLE, "zzz")
    assert exc.value.metadata == {"model": "zzz"}


def test_an_absurdly_long_model_name_is_echoed_cut_short() -> None:
    with pytest.raises(errors.ModelNotFound) as exc:
        routing.resolve(TABLE, "x" * 20_000)
    assert exc.value.metadata == {"model": "x" * 200 + "..."}
    assert len(exc.value.message) < 300


def test_no_model_name_is_an_invalid_request() -> None:
    with pytest.raises(errors.InvalidRequest) as exc:
        routing.resolve(TABLE, "")
    assert exc.value.metadata == {errors.FIELD_KEY: "model"}


def test_lane_without_ready_replica_is_unavailable() -> None:
    with pytest.raises(errors.Unavailable) as exc:
        routing.pick_replica(routing.resolve(TABLE, "c"), {}, now=0.0)
    assert "retry shortly" in exc.value.message


def test_a_request_waits_for_a_starting_replica_not_for_a_failed_one() -> None:
    """A replica on its way (first start, restart after a crash, a rollout's new one):
    the request waits for it. One that failed and waits out its back-off, or a paused
    Lane: refused at once, as `pick_replica` says."""
    failed = lane("f", ready=())
    failed.status.replica_statuses = [ReplicaStatus(index=0, state="Failed", socket="/s/f-0")]
    paused = lane("p", ready=(), starting=(0,), desired=0)
    table = routing.build_table([lane("c", ready=(), starting=(0,)), failed, paused, lane("r")])
    waits = {name: routing.waits(routing.resolve(table, name)) for name in "cfpr"}
    assert waits == {"c": True, "f": False, "p": False, "r": False}


def test_a_failed_replica_in_back_off_is_refused_with_the_wait_left() -> None:
    """Its restart is due at `restartAt`: the refusal says so and carries the wait as
    its Retry-After hint (rounded up), not a bare "retry shortly"; once the restart is
    due (or unknown) the bare refusal with the default second comes back."""
    due = datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC)
    failed = lane("f", ready=())
    failed.status.replica_statuses = [
        ReplicaStatus(index=0, state="Failed", socket="/s/f-0", restart_at=due),
        ReplicaStatus(index=1, state="Failed", socket="/s/f-1", restart_at=due.replace(second=30)),
    ]
    route = routing.resolve(routing.build_table([failed]), "f")
    assert route.restart_at == due.timestamp()
    with pytest.raises(errors.Unavailable) as exc:
        routing.pick_replica(route, {}, now=due.timestamp() - 3.2)
    assert exc.value.metadata[errors.RETRY_AFTER_KEY] == "3200"
    assert "restarted in 4 s" in exc.value.message
    with pytest.raises(errors.Unavailable) as late:
        routing.pick_replica(route, {}, now=due.timestamp() + 0.5)
    assert errors.RETRY_AFTER_KEY not in late.value.metadata
    assert "retry shortly" in late.value.message


def test_what_waits_is_refused_only_while_every_replica_backs_off() -> None:
    """`backing_off`: a Lane with a replica serving, starting or due for its restart
    keeps what waits for it; one whose failed replicas all wait out a back-off refuses
    it with the wait left."""
    due = datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC)
    now = due.timestamp() - 3.2

    def with_failed(name: str, **kwargs: Any) -> Lane:
        found = lane(name, **kwargs)
        failed = ReplicaStatus(index=9, state="Failed", socket=f"/s/{name}-9", restart_at=due)
        found.status.replica_statuses.append(failed)
        return found

    table = routing.build_table(
        [
            with_failed("b", ready=()),
            with_failed("r", ready=(0,)),
            with_failed("s", ready=(), starting=(0,)),
            with_failed("p", ready=(), desired=0),
        ]
    )
    refused = {n: routing.backing_off(routing.resolve(table, n), now) for n in "brsp"}
    assert {n: e is not None for n, e in refused.items()} == {
        "b": True, "r": False, "s": False, "p": False,
    }  # fmt: skip
    assert refused["b"] is not None and refused["b"].metadata[errors.RETRY_AFTER_KEY] == "3200"
    assert routing.backing_off(routing.resolve(table, "b"), due.timestamp() + 0.5) is None


def _model_missing(name: str, *, ready: tuple[int, ...]) -> Lane:
    missing = lane(name, ready=ready)
    missing.status.conditions = [
        Condition(
            type="ModelReady",
            status=ConditionStatus.FALSE,
            reason="ModelNotFound",
            message='Model "m" does not exist.',
            last_transition_time=datetime(2026, 1, 1, tzinfo=UTC),
            observed_generation=1,
        )
    ]
    return missing


def test_a_lane_whose_model_is_gone_says_so_not_retry_shortly() -> None:
    table = routing.build_table([_model_missing("x", ready=())])
    with pytest.raises(errors.Unavailable) as exc:
        routing.pick_replica(routing.resolve(table, "x"), {}, now=0.0)
    assert exc.value.message == (
        "The model 'x' has no ready replica, and Lane 'x' can start none until its Model "
        'is ready: Model "m" does not exist.'
    )
    assert exc.value.metadata == {"lane": "x", "model": "m"}


def test_a_sleeping_lane_whose_model_is_not_ready_is_not_woken() -> None:
    """No replica can start until its Model is ready: a request is refused saying so
    (`unservable`) and does not wake it; each one recorded Waking, then Sleeping."""
    broken, asleep = _model_missing("x", ready=()), lane("y", ready=())
    for sleeper in (broken, asleep):
        sleeper.spec.idle = Idle(sleep_after="5s")
        sleeper.status.sleeping = True
    table = routing.build_table([broken, asleep])
    x, y = routing.resolve(table, "x"), routing.resolve(table, "y")
    assert (x.wakes, routing.waits(x), routing.unservable(x) is not None) == (False, False, True)
    assert (y.wakes, routing.waits(y), routing.unservable(y) is not None) == (True, True, False)


def test_a_lane_whose_model_is_gone_still_serves_from_its_running_replica() -> None:
    """GitOps prunes in any order: the engine already holds the weights."""
    table = routing.build_table([_model_missing("x", ready=(0,))])
    assert routing.pick_replica(routing.resolve(table, "x"), {}, now=0.0).index == 0


def test_lane_scaled_to_zero_says_so() -> None:
    paused = routing.build_table([lane("z", ready=(), desired=0)])
    with pytest.raises(errors.Unavailable) as exc:
        routing.pick_replica(routing.resolve(paused, "z"), {}, now=0.0)
    assert "scaled to zero" in exc.value.message
    assert exc.value.metadata == {"lane": "z"}


def test_lane_scaled_to_zero_takes_no_work_on_a_replica_that_still_drains() -> None:
    draining = routing.build_table([lane("z", ready=(0,), desired=0)])
    with pytest.raises(errors.Unavailable) as exc:
        routing.pick_replica(routing.resolve(draining, "z"), {}, now=0.0)
    assert "scaled to zero" in exc.value.message


@pytest.mark.parametrize(
    ("inflight", "index"),
    [({}, 0), ({("x", 0): 1}, 1), ({("x", 0): 1, ("x", 1): 1}, 0), ({("x", 0): 3, ("x", 1): 2}, 1)],
)
def test_pick_least_loaded_then_lowest_index(
    inflight: dict[tuple[str, int], int], index: int
) -> None:
    route = routing.resolve(routing.build_table([lane("x", ready=(0, 1))]), "x")
    assert routing.pick_replica(route, inflight, now=0.0).index == index


@pytest.mark.parametrize(("exclude", "index"), [((), 0), ((0,), 1), ((1,), 0)])
def test_pick_leaves_out_refused_replicas(exclude: tuple[int, ...], index: int) -> None:
    route = routing.resolve(routing.build_table([lane("x", ready=(0, 1))]), "x")
    assert routing.pick_replica(route, {}, now=0.0, exclude=exclude).index == index


def test_every_replica_refused_is_unavailable() -> None:
    route = routing.resolve(routing.build_table([lane("x", ready=(0, 1))]), "x")
    with pytest.raises(errors.Unavailable):
        routing.pick_replica(route, {}, now=0.0, exclude=(0, 1))


@pytest.mark.parametrize(
    ("inflight", "prefer", "index"),
    [
        ({}, 1, 1),  # the session's replica, though 0 is as idle
        ({("x", 1): 3}, 1, 1),  # busier, but with a free slot (4 slots)
        ({("x", 1): 4}, 1, 0),  # full while 0 is idle: do not queue there
        ({("x", 0): 5, ("x", 1): 4}, 1, 1),  # full, yet the least loaded anyway
        ({}, 7, 0),  # a replica that is gone
        ({}, None, 0),
    ],
)
def test_pick_prefers_the_session_replica_while_it_has_room(
    inflight: dict[tuple[str, int], int], prefer: int | None, index: int
) -> None:
    route = routing.resolve(routing.build_table([lane("x", ready=(0, 1))]), "x")
    assert route.slots == 4
    assert routing.pick_replica(route, inflight, now=0.0, prefer=prefer).index == index


N = routing.MIN_PREFIX_BLOCKS


@pytest.mark.parametrize(
    ("inflight", "matched", "held", "prefer", "index"),
    [
        # Rule 2: the replica holding the longest prefix, though busier (4 slots).
        ({}, {1: N}, {}, None, 1),
        ({("x", 1): 3}, {1: N}, {}, None, 1),
        ({("x", 1): 3}, {0: 2, 1: N + 2}, {}, None, 1),
        # ... unless that is under N blocks more than the least loaded replica holds:
        ({}, {1: N - 1}, {}, None, 0),
        ({}, {0: 2, 1: N + 1}, {}, None, 0),
        ({("x", 0): 1}, {0: 30, 1: 30}, {}, None, 1),  # both hold it: load decides
        # ... or it has no room.
        ({("x", 1): 4}, {1: 50}, {}, None, 0),
        ({("x", 0): 5, ("x", 1): 4, ("x", 2): 4}, {2: 50}, {}, None, 2),  # full, but least loaded
        # Among replicas with room, the longest prefix.
        ({("x", 0): 4, ("x", 2): 4}, {0: 50, 1: 20, 2: 40}, {}, None, 1),
        ({}, {0: 20, 1: 50, 2: 50}, {}, None, 1),  # ties: rule 3's order
        ({("x", 1): 1}, {0: 20, 1: 50, 2: 50}, {}, None, 2),
        # Rule 1 first: the session's replica while it has room.
        ({}, {1: 50}, {}, 0, 0),
        ({("x", 0): 4}, {1: 50}, {}, 0, 1),
        ({("x", 0): 4}, {0: 50}, {}, 0, 1),  # full: not even for its prefix
        # Rule 3: least loaded, then fewest cached blocks, then lowest index.
        ({}, {}, {0: 10, 1: 3, 2: 3}, None, 1),
        ({("x", 1): 1}, {}, {0: 10, 1: 3, 2: 3}, None, 2),
        ({("x", 1): 1, ("x", 2): 1}, {}, {0: 10}, None, 0),
        ({}, {0: N - 1}, {0: N - 1}, None, 1),  # a short match counts for nothing
    ],
)
def test_pick_by_session_then_cached_prefix_then_load(
    inflight: dict[tuple[str, int], int],
    matched: dict[int, int],
    held: dict[int, int],
    prefer: int | None,
    index: int,
) -> None:
    route = routing.resolve(routing.build_table([lane("x", ready=(0, 1, 2))]), "x")
    assert route.slots == 4
    picked = routing.pick_replica(
        route, inflight, now=0.0, prefer=prefer, matched=matched, held=held
    )
    assert picked.index == index


def test_pick_never_goes_to_a_refused_replica_for_its_prefix() -> None:
    route = routing.resolve(routing.build_table([lane("x", ready=(0, 1))]), "x")
    assert routing.pick_replica(route, {}, now=0.0, exclude=(1,), matched={1: 50}).index == 0


def replicas(*spec: tuple[int, str, int | None]) -> routing.Route:
    return routing.Route(
        lane="x",
        model="m",
        aliases=(),
        replicas=tuple(routing.Replica("x", i, s, pid) for i, s, pid in spec),
        created=0,
        context_length=512,
    )


@pytest.mark.parametrize(
    ("old", "new", "gone"),
    [
        (None, replicas((0, "/a", 1)), set()),
        (replicas((0, "/a", 1)), replicas((0, "/a", 1)), set()),
        (replicas((0, "/a", 1), (1, "/b", 2)), replicas((1, "/b", 2)), {0}),  # not ready
        (replicas((0, "/a", 1)), replicas((0, "/a", 3)), {0}),  # restarted
        (replicas((0, "/a", 1)), replicas((0, "/c", 1)), {0}),  # another socket
        (replicas((0, "/a", 1)), replicas(), {0}),
        (replicas((0, "/a", 1)), None, {0}),  # the Lane is gone
    ],
)
def test_departed_replicas_are_those_no_longer_routed_to_as_the_same_process(
    old: routing.Route | None, new: routing.Route | None, gone: set[int]
) -> None:
    assert routing.departed(old, new) == gone


def test_the_table_knows_each_replica_process() -> None:
    ready = ReplicaStatus(index=0, state="Ready", socket="/s", pid=42)
    table = routing.build_table(
        [
            Lane(
                metadata=ObjectMeta(name="x"),
                spec=LaneSpec(model="m"),
                status=LaneStatus(replica_statuses=[ready]),
            )
        ]
    )
    assert routing.resolve(table, "x").replicas == (routing.Replica("x", 0, "/s", 42),)


def _rolling(spec: LaneSpec, launched: list[dict[str, Any]]) -> routing.Route:
    """Lane "x" of `spec` mid-rollout: a ready replica launched with each of `launched`,
    then one whose status says nothing of its launch (the Lane's, then)."""
    statuses = [
        ReplicaStatus(index=i, state="Ready", socket=f"/{i}", pid=i + 1, **given)
        for i, given in enumerate([*launched, {}])
    ]
    lane = Lane(
        metadata=ObjectMeta(name="x"), spec=spec, status=LaneStatus(replica_statuses=statuses)
    )
    return routing.resolve(routing.build_table([lane]), "x")


def test_a_replica_of_an_earlier_slots_keeps_its_own_during_a_rollout() -> None:
    """The Lane now says 2 slots; replica 0 still runs its engine's 1 (it drains once
    the new one is ready), replica 1 the new 2. A status that does not say (an
    upstream Lane's, or one written before it was recorded) is the Lane's."""
    route = _rolling(LaneSpec(model="m", slots=2, replicas=2), [{"slots": 1}, {"slots": 2}])
    assert [routing.slots_of(route, r) for r in route.replicas] == [1, 2, 2]
    # Replica 0's one slot is busy: a session that used it last goes where there is room.
    busy = {("x", 0): 1, ("x", 2): 1}
    assert routing.pick_replica(route, busy, now=0.0, prefer=0).index == 1


def test_a_replica_of_an_earlier_context_keeps_its_own_during_a_rollout() -> None:
    """The Lane now says 2048 tokens a slot; replica 0's engine still holds 512 (it
    drains once the new one is ready). A status that does not say is the Lane's."""
    route = _rolling(
        LaneSpec(model="m", context_per_slot=2048, replicas=2),
        [{"context_per_slot": 512}, {"context_per_slot": 2048}],
    )
    assert [routing.context_of(route, r) for r in route.replicas] == [512, 2048, 2048]


def test_pick_never_prefers_a_refused_replica() -> None:
    route = routing.resolve(routing.build_table([lane("x", ready=(0, 1))]), "x")
    assert routing.pick_replica(route, {}, now=0.0, exclude=(1,), prefer=1).index == 0


def test_sessions_remember_the_latest_replica_of_the_most_recent_sessions() -> None:
    sessions = routing.Sessions(capacity=2)
    sessions.record("x", "a", 0)
    sessions.record("x", "b", 1)
    sessions.record("x", "a", 1)  # a moved, and is now the most recent
    sessions.record("x", "c", 0)  # b, the least recent, is forgotten
    sessions.record("x", "", 1)  # no session key: nothing to remember
    assert [sessions.replica_of("x", k) for k in ("a", "b", "c", "")] == [1, None, 0, None]
    assert sessions.replica_of("y", "a") is None


def test_a_long_session_key_is_remembered_by_its_digest() -> None:
    sessions = routing.Sessions()
    long_a, long_b = "a" * 1_000_000, "a" * 999_999 + "b"
    sessions.record("x", long_a, 1)
    sessions.record("x", long_b, 2)
    sessions.record("x", "a" * 64, 3)
    assert [sessions.replica_of("x", k) for k in (long_a, long_b, "a" * 64)] == [1, 2, 3]
    assert max(len(session) for _, session in sessions._last) < 200


def test_a_route_knows_the_batch_above_which_its_specpair_stops_drafting() -> None:
    """From the SpecPair the Lane names, as stored; none named or none stored: None."""
    drafting = lane("d")
    drafting.spec.speculation = "ngram"
    dangling = lane("e")
    dangling.spec.speculation = "gone"
    table = routing.build_table(
        [drafting, dangling, lane("f")], draft_batch_max={"ngram": 4, "other": 2}
    )
    assert {r.lane: r.draft_batch_max for r in table.routes} == {"d": 4, "e": None, "f": None}


def test_a_lane_scaled_to_zero_is_refused_at_once_not_woken() -> None:
    """A Lane of `replicas: 0` that sleeps on idle (or slept before it was scaled to
    zero) is paused: a request gets the scaled-to-zero error now, not a wait for a wake
    that scaling to zero rules out."""
    paused = lane("p", ready=(), desired=0)
    paused.spec.idle = Idle(sleep_after="5m")
    paused.status.sleeping = True
    (route,) = routing.build_table([paused]).routes
    assert (route.wakes, route.sleeping) == (False, False)
    with pytest.raises(errors.Unavailable, match="scaled to zero"):
        routing.pick_replica(route, {}, now=0.0)
