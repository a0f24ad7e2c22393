"""Spill-over: a generation its Lane's admission predicts would miss its TTFT target
goes to the Lane's spillover Lane (`spec.spillover`) if that one predicts it meets it.

`Spilling` is mixed into `inference.InferenceService` through `relaying.Relaying`,
whose admitted path asks it: its methods read the service's route table, admission
tasks, prefix indexes and sessions, and use its replica pick (`_pick`) and cache
estimate (`_cached_tokens`), declared in `provided`; the split is only of the text.
`_spill_target` says whether a request may spill and where; `_spill` offers it there,
and carries out its own Lane's decision (`admission.Spill.local`) when that Lane
refuses it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import structlog

from blazar._proto.engine.v1 import engine_pb2
from blazar.api import errors
from blazar.dataplane import (
    access,
    admission,
    budget,
    dispatcher,
    fleet,
    metrics,
    provided,
    routing,
    runs,
)
from blazar.enginehost import upstream_convert

# The servicer's logger: these lines were its own before the split.
log = structlog.get_logger("blazar.dataplane.inference")


class Spilling(provided.Provided):
    """The spill-over of `InferenceService`'s generations (see the module docstring)."""

    _dispatchers: dispatcher.Dispatchers
    _fleet: fleet.FleetView
    _sessions: routing.Sessions

    # The spill-over.

    def _spill_target(
        self, route: routing.Route, caller: access.Caller, generate: engine_pb2.GenerateRequest
    ) -> routing.Route | None:
        """The Lane a request on `route` may spill over to: its spillover Lane, if it
        exists (else the local decision stands), the caller may use it, and, for an
        upstream Lane, the request is one an upstream can be asked."""
        to = routing.spillover_of(self.table, route)
        if to is None or to.desired == 0 or self._dispatchers.of(to.lane) is None:
            return None
        if not caller.may_use((to.lane, *to.aliases)):
            return None
        if to.upstream is not None and upstream_convert.refusal(generate) is not None:
            return None
        return to

    async def _spill(
        self,
        spill: admission.Spill,
        *,
        route: routing.Route,
        lane: dispatcher.LaneDispatcher,
        to: routing.Route,
        generate: engine_pb2.GenerateRequest,
        request_id: str,
        prompt_chars: int,
        session: str,
        blocks: tuple[int, ...],
        hashes: Callable[[int], tuple[int, ...]] | None,
    ) -> tuple[routing.Route, dispatcher.LaneDispatcher, runs.Run, tuple[int, ...]]:
        """Offer a ticket its Lane handed back to the spillover Lane `to` (admitted
        there only if it meets its target, and never spilled again): its run there,
        preferring the replica of `to` routing picks (its session's, else the one
        whose cache holds most of the prompt), with the prompt's hashes for `to`'s
        index; else its Lane's own decision (`Spill.local`): the refusal, with the
        smaller retry-after of the two Lanes, or (onOverload: queue) a wait on its Lane
        (and `blocks`, its own Lane's hashes)."""
        other = self._dispatchers.of(to.lane)
        ticket = spill.ticket
        elsewhere: errors.BlazarError | None = None
        if other is not None:
            prompt_tokens, max_tokens, needs = budget.estimate(other, to, generate, prompt_chars)
            if needs <= to.context_length:
                # Hashed again: each Lane's index hashes as many blocks as it holds.
                index = self._fleet.prefixes(to.lane)
                there = hashes(index.capacity) if hashes is not None and index else ()
                picked = self._pick(to, session=session, hashes=there) if to.replicas else None
                offered = dataclasses.replace(
                    ticket,
                    spilled_from=route.lane,
                    prompt_tokens=prompt_tokens,
                    max_tokens=max_tokens,
                    context_tokens=needs,
                    prefer=(
                        picked.index
                        if picked is not None
                        else self._sessions.replica_of(to.lane, session)
                    ),
                    cached_tokens=self._cached_tokens(to.lane, other, picked, there),
                )
                try:
                    started = await other.admit(
                        offered, request_id=request_id, prompt_chars=prompt_chars
                    )
                except errors.BlazarError as err:
                    elsewhere = err
                else:
                    assert isinstance(started, runs.Run)  # it spills no further
                    metrics.SPILLOVERS.labels(route.lane, to.lane).inc()
                    log.info(
                        "request.spilled",
                        request_id=request_id,
                        lane=route.lane,
                        to=to.lane,
                        predicted_ttft_s=(
                            None
                            if started.predicted_ttft_s is None
                            else round(started.predicted_ttft_s, 3)
                        ),
                    )
                    return to, other, started, there
        local = spill.local
        if isinstance(local, admission.Refuse):
            refusal = local
            hint = elsewhere.metadata.get(errors.RETRY_AFTER_KEY) if elsewhere else None
            if hint is not None and hint.isdigit():
                # The spillover Lane may take it later, even one too long for this Lane.
                hinted = int(hint) / 1000
                retry = hinted if local.retry_after_s is None else min(local.retry_after_s, hinted)
                refusal = dataclasses.replace(local, retry_after_s=retry, prefill_s=None)
            lane.refused(refusal, request_id=request_id)
            raise refusal.error(route.lane)
        # onOverload: queue: it waits here after all.
        started = await lane.admit(ticket, request_id=request_id, prompt_chars=prompt_chars)
        assert isinstance(started, runs.Run)
        return route, lane, started, blocks
