"""`blazar.v1.Inference`: resolve the model, pick a replica, relay the engine's stream.

The route table, one `prefixes.PrefixIndex` per Lane and the SLOPolicies are read
from the store by `fleet.FleetView`, rebuilt whenever they change. A replica's prompt
is recorded in its Lane's index once its engine answers. In-flight counts per
replica, the index's matches and the session's last replica feed
`routing.pick_replica`. The replica chosen goes back to the caller in the initial
metadata (`blazar-lane`, `blazar-replica`) before the first chunk, and in
`Final.routing`. Chat and Complete wait in their Lane's admission queue
(`blazar.dataplane.dispatcher`) under the SLOPolicy they name (`policies`) until a slot
is theirs (`relaying`); engines hold no queue of their own. A request its Lane's admission predicts
would miss its TTFT target goes to the Lane's spillover Lane (`spec.spillover`) if that
one predicts it meets it (`spillover`); the Lane it ran on is what `Final.routing` and
`blazar-lane` say. A spillover naming no Lane is a Warning event on the Lane. Embed,
Tokenize and KeepAlive go straight to a replica (`unqueued`; the policy they name is
checked all the same: it must exist).

Who may ask for what is `access`'s: its interceptor has let the call in and named its
`Caller`; each RPC here asks `Access.permit` once the model name resolves to a Lane
(may the tenant use it), then checks what the request names (its policy, its session
key) and only then counts it against the tenant's rate limits (`Access.count`: a
request refused as the caller's mistake costs nothing), charges the tokens the Final
(or an embedding) reports, and ListModels shows a tenant only the Lanes it may use
(`listing`). Those checks, routing and the admission gates' sources stay here; the
other modules named are mixed into `InferenceService`, each owning its RPCs' path.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any, NoReturn, TypeAlias

import structlog

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import errors, gate_tags
from blazar.api.kinds import Kind, SLOPolicySpec, Upstream
from blazar.dataplane import (
    access,
    admission,
    attempt,
    dispatcher,
    fleet,
    gates,
    listing,
    live,
    metrics,
    parking,
    policies,
    prefixes,
    relaying,
    routing,
)
from blazar.dataplane.unqueued import Unqueued
from blazar.enginehost.activity import Activity
from blazar.enginehost.client import EnginePool
from blazar.enginehost.upstream import UpstreamPool
from blazar.rpc import status
from blazar.store.base import Store

log = structlog.get_logger(__name__)

# grpc ships no type information; its servicer context is dynamically typed.
Context: TypeAlias = Any


class InferenceService(
    relaying.Relaying, listing.Listing, Unqueued, inference_pb2_grpc.InferenceServicer
):
    def __init__(
        self,
        *,
        store: Store,
        pool: EnginePool,
        parker: parking.Parker | None = None,
        access: access.Access | None = None,
        activity: Activity | None = None,
        upstreams: UpstreamPool | None = None,
    ) -> None:
        """On the data plane's event loop (each Lane's admission task runs there).
        `activity`: where requests are counted for idle.sleepAfter, and a sleeping
        Lane is woken. `upstreams`: the clients of upstream Lanes' servers."""
        self._store = store
        self._pool = pool
        self._upstreams = upstreams if upstreams is not None else UpstreamPool()
        self._activity = activity if activity is not None else Activity()
        self._access = access if access is not None else _open_access()
        self._attempts = attempt.Attempts(pool=pool, access=self._access, upstreams=self._upstreams)
        self._sessions = routing.Sessions()
        self._gates = gates.GatePublisher(
            table=lambda: self._fleet.table,
            policies=self._stored_policies,
            lane_policy=self._lane_policy,
            named=self._named_policies,
            source=self._lane_gates,
            enabled=lambda: self._access.tenants is None,
            busy=self._lane_busy,
        )
        self._dispatchers = dispatcher.Dispatchers(
            parker=parker or parking.EngineParker(pool), on_decided=self._gates.mark
        )
        self._loop = asyncio.get_running_loop()
        # Retiring the clients of upstream specs and engine processes no longer in the table.
        self._retiring: set[asyncio.Task[None]] = set()
        self._fleet = fleet.FleetView(store, on_table=self._table_built)

    @property
    def table(self) -> routing.RouteTable:
        return self._fleet.table

    def _table_built(self, table: routing.RouteTable) -> None:
        """A new route table (`fleet.FleetView`): admission follows its Lanes, and the
        clients of upstream specs and of engine processes it no longer holds are retired."""
        self._dispatchers.update(table)
        specs = [route.upstream for route in table.routes if route.upstream is not None]
        serving = [(r.socket, r.pid) for route in table.routes for r in route.replicas]
        self._loop.call_soon_threadsafe(self._retire_clients, specs, serving)

    def _retire_clients(self, specs: list[Upstream], serving: list[tuple[str, int | None]]) -> None:
        """Close the upstream clients no Lane uses any more (a spec changed, a Lane
        went), each once its generations in flight end, and the engine clients of
        processes a restart replaced (on the event loop): else each restart left one
        open until the daemon stopped."""
        for retiring in (self._upstreams.retain(specs), self._pool.retire(serving)):
            task = self._loop.create_task(retiring)
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def refuse_waiting(self) -> None:
        """The server is shutting down: requests waiting in any Lane's queue, and any
        that arrive from now on, are refused as UNAVAILABLE at once; those running go
        on (the engines' drain ends them)."""
        self._dispatchers.refuse_waiting()

    async def close(self) -> None:
        """Stop following the store, and end every Lane's admission task; requests still
        waiting are refused as UNAVAILABLE (the server is shutting down)."""
        self._fleet.close()
        await self._gates.close()
        await self._dispatchers.close()
        await self._upstreams.close()

    def live_status(self, kind: Kind, name: str) -> dict[str, Any]:
        """Admission's live figures for an object's status (`live.status`)."""
        return live.status(self._dispatchers, kind, name)

    async def Chat(
        self, request: inference_pb2.ChatRequest, context: Context
    ) -> AsyncIterator[inference_pb2.Chunk]:
        chat = engine_pb2.ChatInput(
            messages=request.messages,
            tools=request.tools,
            tool_choice=request.tool_choice,
            continue_final_message=request.continue_final_message,
        )
        if request.HasField("parallel_tool_calls"):
            chat.parallel_tool_calls = request.parallel_tool_calls
        generate = engine_pb2.GenerateRequest(
            chat=chat, sampling=request.sampling, constraint=request.constraint
        )

        def hashes(limit: int) -> tuple[int, ...]:
            turns = ((m.role, m.content) for m in request.messages)
            return prefixes.chat_hashes(turns, limit=limit)

        relay = self._relay(
            request.model,
            generate,
            context,
            slo=request.slo,
            prompt_chars=sum(len(m.content) for m in request.messages),
            session=request.session,
            hashes=hashes,
            keep_alive_s=request.keep_alive_s if request.HasField("keep_alive_s") else None,
        )
        async for chunk in relay:
            yield chunk

    async def Complete(
        self, request: inference_pb2.CompleteRequest, context: Context
    ) -> AsyncIterator[inference_pb2.Chunk]:
        generate = engine_pb2.GenerateRequest(
            prompt=request.prompt, sampling=request.sampling, constraint=request.constraint
        )

        def hashes(limit: int) -> tuple[int, ...]:
            return prefixes.prompt_hashes(request.prompt, limit=limit)

        relay = self._relay(
            request.model,
            generate,
            context,
            slo=request.slo,
            prompt_chars=len(request.prompt),
            session=request.session,
            hashes=hashes,
            keep_alive_s=request.keep_alive_s if request.HasField("keep_alive_s") else None,
        )
        async for chunk in relay:
            yield chunk

    async def _permit(self, model: str, context: Context, caller: access.Caller) -> None:
        """Refuse the call unless `caller` may use the Lane `model` names (see
        `Access.permit`). An unknown name is NOT_FOUND first, for any caller; a Lane the
        caller may not use is logged as such, and told as `access.shown` says."""
        try:
            route = routing.resolve(self.table, model)
            self._access.permit(caller, model=model, names=(route.lane, *route.aliases))
        except errors.BlazarError as err:
            log.info("request.rejected", model=model, reason=err.reason, tenant=caller.name)
            await status.abort(context, access.shown(caller, err, model=model))

    async def _count(self, model: str, context: Context, caller: access.Caller) -> None:
        """Count the call against `caller`'s rate limits (`Access.count`): after every
        check of the request itself, before any work."""
        try:
            self._access.count(caller)
        except errors.BlazarError as err:
            log.info("request.rejected", model=model, reason=err.reason, tenant=caller.name)
            await status.abort(context, err)

    async def _refuse(
        self, context: Context, err: errors.BlazarError, caller: access.Caller | None
    ) -> NoReturn:
        """End a call that `_count` counted against `caller` (None: not counted) with
        `err`, before any of it was served: a refusal for the server's state gives the
        count back (`Access.refund`)."""
        if caller is not None:
            self._access.refund(caller, err)
        await status.abort(context, err)

    async def _route(
        self,
        model: str,
        context: Context,
        *,
        session: str = "",
        hashes: Callable[[int], tuple[int, ...]] | None = None,
        caller: access.Caller | None = None,
        generation: bool = False,
    ) -> tuple[routing.Route, routing.Replica | None, tuple[int, ...]]:
        """The request's Lane, its replica (None: it waits, `routing.waits`),
        and its prompt's block hashes (computed here, once the Lane tells how many
        blocks its replicas can hold). A `generation` refused here, on a Lane that
        exists, counts among its Lane's requests (no replica ready: UNAVAILABLE)."""
        route: routing.Route | None = None
        try:
            route = routing.resolve(self.table, model)
            index = self._fleet.prefixes(route.lane)
            blocks = hashes(index.capacity) if hashes is not None and index else ()
            if routing.waits(route):
                return route, None, blocks  # asleep, waking or starting: it waits
            return route, self._pick(route, session=session, hashes=blocks), blocks
        except errors.BlazarError as err:
            log.info("request.rejected", model=model, reason=err.reason)
            if generation and route is not None:
                metrics.observe_failure(route.lane, err.reason)
            await self._refuse(context, err, caller)

    def _pick(
        self,
        route: routing.Route,
        *,
        session: str = "",
        hashes: Sequence[int] = (),
        exclude: Collection[int] = (),
    ) -> routing.Replica:
        index = self._fleet.prefixes(route.lane)
        replica = routing.pick_replica(
            route,
            self._attempts.inflight,
            now=time.time(),
            exclude=exclude,
            prefer=self._sessions.replica_of(route.lane, session),
            matched=index.match(hashes) if index and hashes else None,
            held=index.held() if index else None,
        )
        self._sessions.record(route.lane, session, replica.index)
        return replica

    def _cached_tokens(
        self,
        lane_name: str,
        lane: dispatcher.LaneDispatcher,
        replica: routing.Replica | None,
        hashes: Sequence[int],
    ) -> int:
        """The leading prompt tokens `replica`'s cache holds, by the Lane's prefix index
        (its blocks of the prompt's `hashes`, in tokens at the Lane's measured
        characters a token): admission forecasts the prefill of the rest only."""
        index = self._fleet.prefixes(lane_name)
        if replica is None or index is None or not hashes:
            return 0
        held = index.match(hashes).get(replica.index, 0)
        return lane.measurements.prompt_tokens(held * prefixes.BLOCK_CHARS) if held else 0

    def _served(self, replica: routing.Replica, hashes: Sequence[int]) -> None:
        """The replica's engine has taken the prompt: its cache now holds it. Not
        recorded for a replica that left the table meanwhile (its cache is forgotten)."""
        route = self.table.by_name.get(replica.lane)
        index = self._fleet.prefixes(replica.lane)
        if route is not None and index is not None and replica in route.replicas:
            index.record(replica.index, hashes)

    async def _policy(
        self, model: str, slo: str, context: Context, caller: access.Caller
    ) -> admission.Policy:
        """The policy a request on `model` is admitted under: the one it names (`slo`,
        else metadata `x-blazar-slo`), else its Lane's. Every RPC that takes a model
        asks, admitted or not (Embed, Tokenize), so that a name no SLOPolicy has is the
        same INVALID_ARGUMENT on every route, never silently ignored, and a name the
        caller's tenant may not use the same PERMISSION_DENIED."""
        try:
            named = policies.requested(slo, context.invocation_metadata() or ())
            lane_policy = routing.resolve(self.table, model).slo_policy
            return policies.resolve(
                named, lane_policy=lane_policy, lookup=self._policy_spec, tenant=caller.tenant
            )
        except errors.BlazarError as err:
            if isinstance(err, errors.PolicyNotPermitted):
                metrics.observe_tenant_refusal(caller.name, err.reason)
            # Who, as `_permit` and `_count` log it: a tenant's refusal is told as its own.
            log.info("request.rejected", model=model, reason=err.reason, tenant=caller.name)
            await status.abort(context, err)

    async def _keep_alive(
        self, model: str, keep_alive_s: float | None, context: Context, caller: access.Caller
    ) -> None:
        """Refuse a request that sets keep_alive, which changes how long its Lane stays
        loaded for every tenant, unless the caller's tenant may (`keepAlive`); and one
        whose keep_alive is not a number of seconds (NaN, infinite: a negative value
        is the way to keep a Lane loaded). Before the rate limit counts it, as a policy
        it may not name is."""
        if keep_alive_s is not None and not math.isfinite(keep_alive_s):
            invalid = errors.InvalidRequest(
                f"keep_alive_s is {keep_alive_s}; give a number of seconds (0 releases "
                f"'{model}' once idle, a negative number keeps it loaded).",
                metadata={errors.FIELD_KEY: "keep_alive_s"},
            )
            log.info("request.rejected", model=model, reason=invalid.reason)
            await status.abort(context, invalid)
        if keep_alive_s is None or caller.may_keep_alive():
            return
        err = errors.KeepAliveNotPermitted(
            f"keep_alive sets how long '{model}' stays loaded for every tenant, and this "
            "key's tenant may not set it (its keepAlive is not true in the auth file); "
            "leave it out."
        )
        metrics.observe_tenant_refusal(caller.name, err.reason)
        log.info("request.rejected", model=model, reason=err.reason, tenant=caller.name)
        await status.abort(context, err)

    def _policy_spec(self, name: str) -> SLOPolicySpec | None:
        return self._fleet.policy(name)

    async def WatchAdmission(
        self, request: inference_pb2.WatchAdmissionRequest, context: Context
    ) -> AsyncIterator[inference_pb2.AdmissionGates]:
        if request.watcher and not gate_tags.valid_watcher(request.watcher):
            err = errors.InvalidRequest(
                f"Invalid watcher id {request.watcher[: gate_tags.MAX_WATCHER_CHARS]!r}: use 1 "
                f"to {gate_tags.MAX_WATCHER_CHARS} letters, digits, '-' or '_'.",
                metadata={errors.FIELD_KEY: "watcher"},
            )
            await status.abort(context, err)
        async for message in self._gates.watch(request.watcher):
            yield message

    def _stored_policies(self) -> dict[str, admission.Policy]:
        return {
            name: admission.Policy.of(name, spec) for name, spec in self._fleet.policies.items()
        }

    def _lane_policy(self, route: routing.Route) -> admission.Policy:
        return policies.resolve("", lane_policy=route.slo_policy, lookup=self._policy_spec)

    def _named_policies(self, lane: str) -> list[str]:
        found = self._dispatchers.of(lane)
        return found.named() if found is not None else []

    def _lane_busy(self, lane: str) -> bool:
        found = self._dispatchers.of(lane)
        return found is not None and found.busy()

    def _lane_gates(
        self, lane: str, wanted: list[admission.Policy], spill: bool
    ) -> gates.LaneGates | None:
        found = self._dispatchers.of(lane)
        if found is None:
            return None
        refusals = found.gates(wanted, spill=spill)
        # Only an SLO refusal has a prompt bound: most flushes list none, and the bound
        # reads the Lane's view again.
        unattainable = [
            policy
            for policy in wanted
            if (answer := refusals.get(policy.name)) is not None
            and (answer.refusal if isinstance(answer, admission.Filling) else answer).reason
            == admission.Reason.SLO_UNATTAINABLE
        ]
        return gates.LaneGates(
            refusals=refusals,
            chars_per_token=found.measurements.chars_per_token,
            running=found.running(),
            seen=found.seen(),
            hinted_prompts=found.hinted_prompts(unattainable) if unattainable else {},
        )


def _open_access() -> access.Access:
    return access.Access.open()
