"""Pure routing: model names and aliases to Lanes, Lanes to ready replicas.

The table is rebuilt from the stored Lanes whenever one changes; picking a replica
is a function of the table, the data plane's in-flight counts and, for a request with
a session key, the replica that session used last (`Sessions`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from blazar.api import errors
from blazar.api.kinds import Lane
from blazar.api.replicas import ReplicaState


@dataclass(frozen=True)
class Replica:
    lane: str
    index: int
    socket: str


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


@dataclass(frozen=True)
class RouteTable:
    routes: tuple[Route, ...] = ()
    by_name: Mapping[str, Route] = field(default_factory=dict)


def build_table(lanes: Sequence[Lane]) -> RouteTable:
    """Lane names first, then aliases in lane-name order: a Lane's own name always
    wins over another Lane's alias, and the first alias claim wins over later ones."""
    routes = []
    for lane in sorted(lanes, key=lambda item: item.metadata.name):
        ready = tuple(
            Replica(lane.metadata.name, r.index, r.socket)
            for r in lane.status.replica_statuses
            if r.state == ReplicaState.READY.value and r.socket
        )
        created = lane.metadata.creation_timestamp
        routes.append(
            Route(
                lane=lane.metadata.name,
                model=lane.spec.model,
                aliases=tuple(lane.spec.aliases),
                replicas=ready,
                created=int(created.timestamp()) if created else 0,
                context_length=lane.spec.context_per_slot,
                slots=lane.spec.slots,
                desired=lane.spec.replicas,
            )
        )
    by_name: dict[str, Route] = {route.lane: route for route in routes}
    for route in routes:
        for alias in route.aliases:
            by_name.setdefault(alias, route)
    return RouteTable(routes=tuple(routes), by_name=by_name)


def resolve(table: RouteTable, name: str) -> Route:
    if not name:
        raise errors.InvalidRequest(
            "The request names no model; set `model`.", metadata={errors.FIELD_KEY: "model"}
        )
    route = table.by_name.get(name)
    if route is None:
        raise errors.ModelNotFound.of(name)
    return route


def pick_replica(
    route: Route,
    inflight: Mapping[tuple[str, int], int],
    *,
    exclude: Collection[int] = (),
    prefer: int | None = None,
) -> Replica:
    """The ready replica with the fewest requests in flight (lowest index on ties),
    leaving out the indexes in `exclude` (replicas that already refused this request).

    `prefer` (the replica a session used last, whose cache holds its conversation) wins
    while it has a free slot or is as idle as any other: a conversation goes back to
    its cached prefix, but does not queue there while another replica has room.
    """
    candidates = [r for r in route.replicas if r.index not in exclude]
    if not candidates and route.desired == 0 and not route.replicas:
        raise errors.Unavailable(
            f"The model '{route.lane}' is scaled to zero: Lane '{route.lane}' has "
            "replicas: 0. Scale it up to serve it.",
            metadata={"lane": route.lane},
        )
    if not candidates:
        raise errors.Unavailable(
            f"The model '{route.lane}' has no ready replica yet; retry shortly.",
            metadata={"lane": route.lane},
        )

    def load(replica: Replica) -> int:
        return inflight.get((replica.lane, replica.index), 0)

    least = min(candidates, key=lambda r: (load(r), r.index))
    for replica in candidates:
        if replica.index == prefer and (
            load(replica) < route.slots or load(replica) <= load(least)
        ):
            return replica
    return least


class Sessions:
    """Which replica each session of each lane used last (the most recent `capacity`)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._capacity = capacity
        self._last: OrderedDict[tuple[str, str], int] = OrderedDict()

    def replica_of(self, lane: str, session: str) -> int | None:
        return self._last.get((lane, session)) if session else None

    def record(self, lane: str, session: str, replica: int) -> None:
        if not session:
            return
        self._last[(lane, session)] = replica
        self._last.move_to_end((lane, session))
        while len(self._last) > self._capacity:
            self._last.popitem(last=False)
