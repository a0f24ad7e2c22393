"""Pure routing: model names and aliases to Lanes, Lanes to ready replicas.

The table is rebuilt from the stored Lanes whenever one changes; picking a replica
is a function of the table, the data plane's in-flight counts, how much of the
prompt each replica's cache holds (`blazar.dataplane.prefixes`) and, for a request
with a session key, the replica that session used last (`Sessions`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from blazar.api import conditions, errors, modelnames
from blazar.api.kinds import Lane, Upstream
from blazar.api.replicas import ReplicaState


@dataclass(frozen=True)
class Replica:
    lane: str
    index: int
    socket: str
    # The engine process: a restarted replica keeps its index and socket, not its cache.
    pid: int | None = None
    # The slots its engine runs with, when its status says (`slots_of`).
    slots: int | None = None
    # The tokens each of its slots holds, when its status says (`context_of`).
    context_per_slot: int | None = None


@dataclass(frozen=True)
class Route:
    lane: str
    model: str
    aliases: tuple[str, ...]
    replicas: tuple[Replica, ...]
    created: int
    context_length: int
    # Parallel sequences per replica (the Lane's slots).
    slots: int = 1
    # Replicas the Lane asks for (its spec.replicas); 0 pauses it.
    desired: int = 1
    # The Lane's SLOPolicy (spec.sloPolicy), for requests that name none.
    slo_policy: str | None = None
    # Host memory each replica may hold parked generations in (kvCache.maxParkedMiB).
    max_parked_bytes: int = 0
    # Without a serving replica, a request waits and wakes it: idle.sleepAfter is set,
    # the Lane sleeps (or is waking: a keep_alive or the memory budget put it to
    # sleep), or it waits for memory that idle Lanes hold.
    wakes: bool = False
    # It sleeps now (its status says so), or waits for memory that a request for it
    # would free: either way on demand, not a Lane that failed to start.
    sleeping: bool = False
    # A replica of it is starting (spawned, loading its model): a first start, a restart
    # after a crash, a rollout's new replica.
    starting: bool = False
    # When the first of its failed replicas is restarted, its crash back-off over (epoch
    # seconds; None: none waits for a restart).
    restart_at: float | None = None
    # Why no new replica can start, from the Lane's ModelReady condition when it is
    # False (`Model "m" does not exist.`); empty when the Model is ready. An upstream
    # Lane's: why its upstream does not answer (its Available condition).
    model_problem: str = ""
    # Why no replica can ever start as the Lane is, from its Schedulable condition
    # when it needs more than the host has or the whole memory budget; else empty.
    memory_problem: str = ""
    # idle.sleepAfter in seconds (None: none), and preload: what puts it to sleep.
    sleep_after_s: float | None = None
    preload: bool = False
    # engine: upstream: the server its one replica (index 0, ready while the upstream
    # answers its probe) sends requests to; None for a Lane of local engines.
    upstream: Upstream | None = None
    # The Lane its requests predicted to miss their TTFT target may run on instead
    # (spec.spillover); it may name no Lane of the table (`spillover_of`).
    spillover: str | None = None
    # Ready replicas that missed their last health check (`ReplicaStatus.missed_probes`):
    # no request goes to them, and those they hold without a first token are handed
    # back to the queue, until a probe passes (they are in `replicas` again) or they are
    # killed and restarted. A request for a Lane that has only these waits.
    unanswering: tuple[Replica, ...] = ()
    # Its SpecPair's disableAboveBatch: with more sequences than this decoding on a
    # replica, no sequence drafts there, so each decode step yields one token. None: no
    # SpecPair named (or none stored), and then no drafts either way.
    draft_batch_max: int | None = None


@dataclass(frozen=True)
class RouteTable:
    routes: tuple[Route, ...] = ()
    by_name: Mapping[str, Route] = field(default_factory=dict)


def build_table(
    lanes: Sequence[Lane], *, draft_batch_max: Mapping[str, int] | None = None
) -> RouteTable:
    """Lane names first, then aliases by claim: a Lane's own name always wins over
    another Lane's alias, and of Lanes claiming one alias the oldest (its
    creationTimestamp; then name order) wins, as Gateway API settles two Routes that
    claim one hostname, so a Lane applied later never takes an alias a running Lane
    serves. `draft_batch_max`: each stored SpecPair's disableAboveBatch, by name."""
    limits = draft_batch_max or {}
    routes = []
    for lane in sorted(lanes, key=lambda item: item.metadata.name):
        running = [
            (Replica(lane.metadata.name, r.index, r.socket, r.pid, r.slots, r.context_per_slot), r)
            for r in lane.status.replica_statuses
            if r.state == ReplicaState.READY.value and r.socket
        ]
        ready = tuple(replica for replica, r in running if not r.missed_probes)
        unanswering = tuple(replica for replica, r in running if r.missed_probes)
        created = lane.metadata.creation_timestamp
        route = Route(
            lane=lane.metadata.name,
            model=lane.spec.model,
            aliases=tuple(lane.spec.aliases),
            replicas=ready,
            unanswering=unanswering,
            created=int(created.timestamp()) if created else 0,
            context_length=lane.spec.context_per_slot,
            slots=lane.spec.slots,
            desired=lane.spec.replicas,
            slo_policy=lane.spec.slo_policy,
            spillover=lane.spec.spillover,
            draft_batch_max=limits.get(lane.spec.speculation or ""),
            max_parked_bytes=lane.spec.kv_cache.max_parked_mib << 20,
            # A Lane whose Model is not ready starts nothing: a request is refused
            # with why (`unservable`), and waking it only recorded Waking and Sleeping
            # events, two for every request.
            wakes=_wakes(lane) and not _model_problem(lane),
            sleep_after_s=lane.spec.idle.sleep_after_s if lane.spec.idle is not None else None,
            preload=lane.spec.preload,
            # On demand, unless it cannot start at all (then it is not asleep: broken).
            sleeping=(lane.status.sleeping or _waits_for_memory(lane))
            and not _memory_problem(lane)
            and lane.spec.replicas > 0,
            starting=any(
                r.state == ReplicaState.STARTING.value for r in lane.status.replica_statuses
            ),
            restart_at=min(
                (r.restart_at.timestamp() for r in lane.status.replica_statuses if r.restart_at),
                default=None,
            ),
            model_problem=_model_problem(lane),
            memory_problem=_memory_problem(lane),
        )
        if lane.spec.engine == "upstream" and lane.spec.upstream is not None:
            # Admission counts the upstream's parallel requests as slots; nothing parks
            # there (no KV is reachable), and it never sleeps.
            route = dataclasses.replace(
                route,
                slots=lane.spec.upstream.max_concurrency,
                desired=1,
                max_parked_bytes=0,
                wakes=False,
                sleeping=False,
                starting=False,
                restart_at=None,
                model_problem=_upstream_problem(lane),
                upstream=lane.spec.upstream,
                draft_batch_max=None,
            )
        routes.append(route)
    by_name: dict[str, Route] = {route.lane: route for route in routes}
    claims = {lane.metadata.name: _claimed(lane) for lane in lanes}
    for route in sorted(routes, key=lambda r: (claims[r.lane], r.lane)):
        for alias in route.aliases:
            by_name.setdefault(alias, route)
    return RouteTable(routes=tuple(routes), by_name=by_name)


def _claimed(lane: Lane) -> float:
    """When `lane` claimed its aliases: its creation (before any, when unstored)."""
    created = lane.metadata.creation_timestamp
    return created.timestamp() if created is not None else -math.inf


def slots_of(route: Route, replica: Replica) -> int:
    """The slots `replica` runs with: its own, else the Lane's. They differ while a
    rollout of a `slots` change runs, and an old replica given the new number would be
    sent work it has no slot for, to wait blind inside an engine about to drain."""
    return route.slots if replica.slots is None else replica.slots


def context_of(route: Route, replica: Replica) -> int:
    """The tokens a slot of `replica` holds: its own context per slot, else the Lane's.
    They differ while a rollout of a `contextPerSlot` change runs: a request that fits
    the Lane's new size may not fit an old replica's, whose engine would refuse it."""
    return route.context_length if replica.context_per_slot is None else replica.context_per_slot


def _wakes(lane: Lane) -> bool:
    if lane.spec.replicas == 0:
        return False  # paused: a request is refused at once (`pick_replica`), not woken
    if lane.spec.idle is not None and lane.spec.idle.sleep_after is not None:
        return True
    return lane.status.sleeping or _waits_for_memory(lane)


def _waits_for_memory(lane: Lane) -> bool:
    """Whether the Lane waits for memory that other Lanes hold: a request for it puts
    idle ones to sleep (under a memory budget, the Lanes of a fleet that does not fit
    at once take turns so)."""
    cond = conditions.get_condition(lane.status.conditions, "Schedulable")
    never = lane.status.memory is not None and lane.status.memory.never_fits
    return (
        cond is not None
        and cond.status == "False"
        and cond.reason == "InsufficientMemory"
        and not never
    )


def _model_problem(lane: Lane) -> str:
    cond = conditions.get_condition(lane.status.conditions, "ModelReady")
    if cond is None or cond.status != "False":
        return ""
    return cond.message or f'Model "{lane.spec.model}" is not ready.'


def _memory_problem(lane: Lane) -> str:
    cond = conditions.get_condition(lane.status.conditions, "Schedulable")
    memory = lane.status.memory
    if cond is None or cond.status != "False" or memory is None or not memory.never_fits:
        return ""
    return cond.message


def _upstream_problem(lane: Lane) -> str:
    cond = conditions.get_condition(lane.status.conditions, "Available")
    if cond is None or cond.status != "False":
        return ""
    return cond.message or "Its upstream does not answer."


def waits(route: Route) -> bool:
    """Whether a request for the Lane, which no replica serves now, waits for one (within
    its policy's bounds) rather than being refused: the Lane wakes for it (it sleeps, or
    waits for memory), or a replica of it is starting, as a request already queued waits
    when its replica dies; or its replicas missed a health check (each answers again
    or is restarted). A Lane whose replica failed and waits out its crash back-off
    refuses at once ("retry shortly"); so does a paused one."""
    return (
        not route.replicas
        and route.desired > 0
        and (route.wakes or route.starting or bool(route.unanswering))
    )


def unservable(route: Route) -> errors.Unavailable | None:
    """Why a Lane with no ready replica will have none until its operator acts (its
    Model is missing or not ready), as the error its requests get; None when a replica
    may yet come (starting, restarting). Not "retry shortly": retrying cannot help.
    A Lane whose replica can never fit in memory as it is says so the same way. An
    upstream Lane's: its upstream does not answer (it may again: the probe says)."""
    if route.replicas or not (route.model_problem or route.memory_problem):
        return None
    if route.upstream is not None:
        return errors.Unavailable(
            f"The model '{route.lane}' is served by an upstream server that does not "
            f"answer: {route.model_problem} Retry later.",
            metadata={"lane": route.lane, "upstream": route.upstream.url},
        )
    if not route.model_problem:
        return errors.Unavailable(
            f"The model '{route.lane}' has no ready replica, and Lane '{route.lane}' can "
            f"start none as it is: {route.memory_problem}",
            metadata={"lane": route.lane, "model": route.model},
        )
    return errors.Unavailable(
        f"The model '{route.lane}' has no ready replica, and Lane '{route.lane}' can start "
        f"none until its Model is ready: {route.model_problem}",
        metadata={"lane": route.lane, "model": route.model},
    )


def not_ready(route: Route, now: float) -> errors.Unavailable:
    """The error of a request for a Lane with no ready replica that will have one
    without its operator's help: its failed replica waits out its crash back-off
    (`restart_at`), and the refusal's Retry-After is the wait left (then the restarted
    replica is Starting, and a request waits for it: `waits`). Without a known restart,
    "retry shortly" with the default second."""
    if route.restart_at is None or route.restart_at <= now:
        return errors.Unavailable(
            f"The model '{route.lane}' has no ready replica yet; retry shortly.",
            metadata={"lane": route.lane},
        )
    # Whole milliseconds, and the message's seconds from them: the same as Retry-After.
    wait_ms = max(1, round((route.restart_at - now) * 1000))
    return errors.Unavailable(
        f"The model '{route.lane}' has no ready replica: its engine crashed and is "
        f"restarted in {math.ceil(wait_ms / 1000)} s, after its crash back-off; retry then "
        f"(see `blazar describe lane {route.lane}`).",
        metadata={"lane": route.lane, errors.RETRY_AFTER_KEY: str(wait_ms)},
    )


def backing_off(route: Route, now: float) -> errors.Unavailable | None:
    """The refusal of requests that wait for a Lane (queued, or waiting for a starting
    replica) once none of its replicas serves, starts or wakes and a failed one waits
    out its crash back-off: what a request arriving then gets (`not_ready`, with the
    wait left as its hint). Without it a request that came while the replica was
    starting waited, unbounded, through the crash loop of an engine that can never
    load its model. None while a replica serves, or may without a back-off first (the
    first restart after a crash is at once: what waits goes to it)."""
    if route.replicas or route.desired == 0 or waits(route):
        return None
    if route.restart_at is None or route.restart_at <= now:
        return None
    return not_ready(route, now)


def scaled_to_zero(route: Route) -> errors.Unavailable:
    """The error of a request for a Lane of `replicas: 0` (paused: no replica will
    serve it until its operator scales it up), its last replicas drained or not."""
    return errors.Unavailable(
        f"The model '{route.lane}' is scaled to zero: Lane '{route.lane}' has "
        "replicas: 0. Scale it up to serve it.",
        metadata={"lane": route.lane},
    )


def closed(route: Route) -> errors.Unavailable | None:
    """Why a Lane serves nothing until its operator acts: paused (`scaled_to_zero`), or
    no replica can start (`unservable`); None while a replica serves or may yet come."""
    return scaled_to_zero(route) if route.desired == 0 else unservable(route)


def spillover_of(table: RouteTable, route: Route) -> Route | None:
    """The Lane `route` spills over to, by its own name (an alias names no Lane here);
    None when it names none, or one the table does not hold (missing: no spill)."""
    if route.spillover is None or route.spillover == route.lane:
        return None
    found = table.by_name.get(route.spillover)
    return found if found is not None and found.lane == route.spillover else None


def dangling_spillovers(table: RouteTable) -> dict[str, str]:
    """Lanes whose spillover names no Lane of the table, with the name they give."""
    return {
        route.lane: route.spillover
        for route in table.routes
        if route.spillover is not None and spillover_of(table, route) is None
    }


def shadowed_aliases(table: RouteTable) -> dict[tuple[str, str], str]:
    """(Lane, alias) for each alias a Lane claims that routes to another Lane (one of
    that name, or an older claim: `build_table`'s order), with the Lane it routes to."""
    return {
        (route.lane, alias): owner.lane
        for route in table.routes
        for alias in route.aliases
        if (owner := table.by_name[alias]) is not route
    }


def resolve(table: RouteTable, name: str) -> Route:
    if not name:
        raise errors.InvalidRequest(
            "The request names no model; set `model`.", metadata={errors.FIELD_KEY: "model"}
        )
    for candidate in modelnames.lookups(name):
        if (route := table.by_name.get(candidate)) is not None:
            return route
    raise errors.ModelNotFound.of(name)


# How many more leading prompt blocks (of prefixes.BLOCK_CHARS characters, so ~256
# tokens) a replica's cache must hold than the replica load alone would pick, before
# the prefix outweighs load. Below it the saving is a fraction of a prefill, and a
# short prefix every request shares (a system prompt, a template's opening) would pull
# all traffic to whichever replica served it first.
MIN_PREFIX_BLOCKS = 8


def pick_replica(
    route: Route,
    inflight: Mapping[tuple[str, int], int],
    *,
    now: float,
    exclude: Collection[int] = (),
    prefer: int | None = None,
    matched: Mapping[int, int] | None = None,
    held: Mapping[int, int] | None = None,
) -> Replica:
    """The ready replica for a request, leaving out the indexes in `exclude` (replicas
    that already refused it). Load is a replica's requests in flight, those waiting in
    its engine included; a replica "has room" while it has a free slot or is no busier
    than the least loaded replica. In order:

    1. The session's replica (`prefer`, the one this session used last, whose cache
       holds its conversation) while it has room: a conversation goes back to its
       cached prefix, but does not queue there while another replica has room.
    2. The replica with room whose cache holds the longest prefix of the prompt
       (`matched`: leading blocks per replica index, from `PrefixIndex.match`), if that
       is at least MIN_PREFIX_BLOCKS more than what the replica of rule 3 holds. A
       prefix both hold, or a few blocks more, does not outweigh load. Ties: rule 3's
       order.
    3. The least loaded replica; on equal load the one whose cache holds the fewest
       blocks (`held`), so that new conversations spread over the replicas' caches
       instead of evicting each other on one; then the lowest index.

    A Lane scaled to zero has none (`scaled_to_zero`), draining replicas listed or not;
    one whose replicas all failed none until a restart (`not_ready`, at wall clock `now`).
    """
    candidates = [r for r in route.replicas if r.index not in exclude]
    # Paused: its replicas are stopped, or draining (listed until they stop), and a
    # draining engine takes no new work.
    if (route.desired == 0 or not candidates) and (why := closed(route)) is not None:
        raise why
    if not candidates:
        raise not_ready(route, now)
    matched = matched or {}
    held = held or {}

    def load(replica: Replica) -> int:
        return inflight.get((replica.lane, replica.index), 0)

    def by_load(replica: Replica) -> tuple[int, int, int]:
        return (load(replica), held.get(replica.index, 0), replica.index)

    least = min(candidates, key=by_load)
    roomy = [r for r in candidates if load(r) < slots_of(route, r) or load(r) <= load(least)]
    for replica in roomy:
        if replica.index == prefer:
            return replica
    cached = min(roomy, key=lambda r: (-matched.get(r.index, 0), *by_load(r)))
    if matched.get(cached.index, 0) - matched.get(least.index, 0) >= MIN_PREFIX_BLOCKS:
        return cached
    return least


def departed(old: Route | None, new: Route | None) -> frozenset[int]:
    """Replicas of `old` that `new` no longer routes to as the same engine process:
    gone, no longer ready, or restarted (another socket or process). Their caches are
    lost to routing."""
    if old is None:
        return frozenset()
    kept = {(r.index, r.socket, r.pid) for r in new.replicas} if new is not None else set()
    return frozenset(r.index for r in old.replicas if (r.index, r.socket, r.pid) not in kept)


class Sessions:
    """Which replica each session of each lane used last (the most recent `capacity`).

    A session key is the caller's opaque string, as long as a request allows; one over
    `_KEY_CHARS` is kept as a digest, so that the memory held stays bounded by
    `capacity`, not by what callers send.
    """

    def __init__(self, capacity: int = 10_000) -> None:
        self._capacity = capacity
        self._last: OrderedDict[tuple[str, str], int] = OrderedDict()

    def replica_of(self, lane: str, session: str) -> int | None:
        return self._last.get((lane, _session_key(session))) if session else None

    def record(self, lane: str, session: str, replica: int) -> None:
        if not session:
            return
        key = (lane, _session_key(session))
        self._last[key] = replica
        self._last.move_to_end(key)
        while len(self._last) > self._capacity:
            self._last.popitem(last=False)


_KEY_CHARS = 64


def _session_key(session: str) -> str:
    if len(session) <= _KEY_CHARS:
        return session
    digest = hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16)
    # Longer than any key kept as given, so the two kinds never meet.
    return "#" * (_KEY_CHARS + 1) + digest.hexdigest()
