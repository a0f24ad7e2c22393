"""What the data plane reads of the store, kept current: the route table, one prefix
index per Lane, and the SLOPolicies by name.

Every request reads them, so they are held here and rebuilt when the store says an
object they come from changed (a Lane or a SpecPair: the table and the indexes; an
SLOPolicy: the policies), never read from the store request by request. A Lane's
prefix index lives as long as the Lane and its capacity: a replica that leaves the
table (not ready, restarted, gone) is forgotten by it, and a new capacity (slots or
context changed) starts it afresh. A Lane whose spillover names no Lane is told once
as a Warning event each time it starts to dangle (it is no apply error: the Lane may
come later). So is a Lane whose alias routes to another Lane (that Lane's name, or
an alias an older Lane claims): requests for it go there, which nothing else would
tell its operator.

The data plane's other owners hear of each new table through `on_table` (its
admission dispatchers, its upstream clients).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import structlog

from blazar.api.kinds import Kind, Lane, SLOPolicy, SLOPolicySpec, SpecPair
from blazar.dataplane import metrics, prefixes, routing
from blazar.store.base import Store, WatchEvent

log = structlog.get_logger(__name__)


class FleetView:
    def __init__(self, store: Store, *, on_table: Callable[[routing.RouteTable], None]) -> None:
        """Read `store` now, then follow it; `on_table` is called with each table built
        (the first one too), after the indexes are rebuilt for it."""
        self._store = store
        self._on_table = on_table
        self.table = routing.RouteTable()
        self._prefixes: dict[str, prefixes.PrefixIndex] = {}
        self._policies: dict[str, SLOPolicySpec] = {}
        # Lanes whose spillover names no Lane, as last reported.
        self._dangling: dict[str, str] = {}
        # (Lane, alias) routed to another Lane, with that Lane, as last reported.
        self._shadowed: dict[tuple[str, str], str] = {}
        self.refresh()
        self._refresh_policies()
        self._unsubscribe = store.subscribe(self._on_store_event)

    def close(self) -> None:
        """Stop following the store."""
        self._unsubscribe()

    def prefixes(self, lane: str) -> prefixes.PrefixIndex | None:
        """The prefix index of `lane`; None for a name the table does not hold."""
        return self._prefixes.get(lane)

    def policy(self, name: str) -> SLOPolicySpec | None:
        return self._policies.get(name)

    @property
    def policies(self) -> Mapping[str, SLOPolicySpec]:
        """Every stored SLOPolicy's spec, by name."""
        return self._policies

    def refresh(self) -> None:
        """Build the table and the indexes from the store's Lanes and SpecPairs."""
        lanes = [lane for lane in self._store.list(Kind.LANE) if isinstance(lane, Lane)]
        pairs = {
            pair.metadata.name: pair.spec.disable_above_batch
            for pair in self._store.list(Kind.SPEC_PAIR)
            if isinstance(pair, SpecPair)
        }
        old = {route.lane: route for route in self.table.routes}
        self.table = routing.build_table(lanes, draft_batch_max=pairs)
        metrics.observe_lanes(lanes)
        indexes: dict[str, prefixes.PrefixIndex] = {}
        for route in self.table.routes:
            size = prefixes.capacity(slots=route.slots, context_per_slot=route.context_length)
            index = self._prefixes.get(route.lane)
            if index is None or index.capacity != size:
                index = prefixes.PrefixIndex(size)
            for replica in routing.departed(old.get(route.lane), route):
                index.forget(replica)
            indexes[route.lane] = index
        self._prefixes = indexes
        self._on_table(self.table)
        self._report_dangling()
        self._report_shadowed()

    def _report_dangling(self) -> None:
        """A Warning event `SpilloverNotFound` on each Lane whose spillover has just
        come to name no Lane: its requests stay where they are meanwhile, so the
        operator is told here."""
        dangling = routing.dangling_spillovers(self.table)
        for lane, target in sorted(dangling.items()):
            if self._dangling.get(lane) == target:
                continue
            log.warning("lane.spillover_missing", lane=lane, spillover=target)
            self._store.record_event(
                kind=Kind.LANE.value,
                name=lane,
                type="Warning",
                reason="SpilloverNotFound",
                message=(
                    f"spec.spillover names Lane '{target}', which does not exist: requests "
                    "predicted to miss their target are queued or refused on this Lane, as "
                    "without spillover, until it does."
                ),
            )
        self._dangling = dangling

    def _report_shadowed(self) -> None:
        """A Warning event `AliasConflict` on each Lane with an alias that has just come
        to route to another Lane: its callers reach that Lane instead, without a word."""
        shadowed = routing.shadowed_aliases(self.table)
        for (lane, alias), owner in sorted(shadowed.items()):
            if self._shadowed.get((lane, alias)) == owner:
                continue
            log.warning("lane.alias_conflict", lane=lane, alias=alias, served_by=owner)
            self._store.record_event(
                kind=Kind.LANE.value,
                name=lane,
                type="Warning",
                reason="AliasConflict",
                message=(
                    f"spec.aliases names '{alias}', which Lane '{owner}' answers to (its "
                    "name, or an alias it claimed first: the oldest Lane's claim wins): "
                    f"requests for '{alias}' go there, not to this Lane."
                ),
            )
        self._shadowed = shadowed

    def _refresh_policies(self) -> None:
        self._policies = {
            p.metadata.name: p.spec
            for p in self._store.list(Kind.SLO_POLICY)
            if isinstance(p, SLOPolicy)
        }

    def _on_store_event(self, event: WatchEvent) -> None:
        if event.object.kind == Kind.LANE.value or (
            event.object.kind == Kind.SPEC_PAIR.value and not event.status_only
        ):
            self.refresh()
        elif event.object.kind == Kind.SLO_POLICY.value and not event.status_only:
            self._refresh_policies()
