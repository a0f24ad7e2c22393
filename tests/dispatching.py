"""A Lane's route for tests that drive one `LaneDispatcher` without engines."""

from __future__ import annotations

from blazar.dataplane import routing


def one_slot_route() -> routing.Route:
    """Lane `l`: one ready replica of one slot, which may park up to 1 MiB."""
    replica = routing.Replica("l", 0, "unix:///nowhere", pid=1)
    return routing.Route(
        lane="l",
        model="m",
        aliases=(),
        replicas=(replica,),
        created=0,
        context_length=1024,
        slots=1,
        max_parked_bytes=1 << 20,
    )
