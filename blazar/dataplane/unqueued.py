"""The Inference calls that do not queue in admission: Embed, Tokenize and KeepAlive
(Ollama's load and unload).

`Unqueued` is mixed into `inference.InferenceService`: its methods read the service's
route table, activity ledger and engine pool, and use its checks (`_permit`,
`_policy`, `_count`) and refusal (`_refuse`), declared in `provided`; the split is
only of the text.

Such a call goes straight to a serving replica. A Lane with none waits for one, as a
generation would in its queue (`routing.waits`: it sleeps and wakes for the call, or a
replica is starting), up to WAKE_TIMEOUT_S. Embedding and tokenizing are safe to
repeat, so a replica process that turns one away (draining, or it died under the
call) is left out, and the call goes to another ready replica or waits for one (the
same replica restarted) up to REPLICA_RETURN_S. So is one that goes silent under the
call (it missed a health check: `routing.Route.unanswering`), without waiting for it
to be killed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeAlias, TypeVar

import grpc
import structlog

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.dataplane import access, metrics, provided, routing
from blazar.enginehost.activity import Activity
from blazar.enginehost.client import EngineClient, EnginePool
from blazar.rpc import status

log = structlog.get_logger("blazar.dataplane.inference")

# grpc.aio's servicer context.
Context: TypeAlias = Any

# A call that does not queue in admission waits this long for a sleeping Lane to wake
# or a starting replica to serve, looking this often.
WAKE_TIMEOUT_S = 120.0
WAKE_POLL_S = 0.05
# Such a call whose replica turned it away (its process died, or it is draining) waits
# this long for another to serve it: a restarted process is ready in about 2 s.
REPLICA_RETURN_S = 30.0
# How often a call under way looks whether its replica went silent (missed a health
# check), to take it elsewhere.
SILENCE_POLL_S = 0.25

_Answer = TypeVar("_Answer")


class Unqueued(provided.Provided):
    """Embed, Tokenize and KeepAlive of `InferenceService` (see the module docstring)."""

    _activity: Activity
    _pool: EnginePool
    _access: access.Access

    async def KeepAlive(
        self, request: inference_pb2.KeepAliveRequest, context: Context
    ) -> inference_pb2.KeepAliveResponse:
        """Load or unload a Lane as a request with this keep_alive_s that generated
        nothing would: 0 releases it (`Activity.release`); otherwise a sleeping Lane is
        woken and waited for (`_awake`), and the keep is told as a request's end."""
        caller = access.current()
        await self._permit(request.model, context, caller)
        # Admits nothing, but a policy named here is checked as on every route.
        await self._policy(request.model, "", context, caller)
        keep_alive_s = request.keep_alive_s if request.HasField("keep_alive_s") else None
        await self._keep_alive(request.model, keep_alive_s, context, caller)
        await self._count(request.model, context, caller)
        route = routing.resolve(self.table, request.model)
        if keep_alive_s == 0:
            self._activity.release(route.lane)
            log.info("lane.unload", lane=route.lane)
            return inference_pb2.KeepAliveResponse(lane=route.lane)
        load_ms = 0.0
        refused = None if route.replicas or routing.waits(route) else routing.closed(route)
        if refused is not None:
            # Paused, or no replica can start until its operator acts (Model not ready,
            # never fits in memory): "loaded" would be a lie that its chats then refute.
            await self._refuse(context, refused, caller)
        if routing.waits(route):
            started = time.monotonic()
            route, _ = await self._awake(request.model, context, caller)
            load_ms = (time.monotonic() - started) * 1000
        self._activity.begin(route.lane)
        self._activity.end(route.lane, keep_alive_s=keep_alive_s)
        return inference_pb2.KeepAliveResponse(lane=route.lane, load_ms=load_ms)

    async def Embed(
        self, request: inference_pb2.EmbedRequest, context: Context
    ) -> inference_pb2.EmbedResponse:
        """Embedding is safe to repeat: see `_on_replicas`.

        No prefix routing: an engine embeds in a context of its own that keeps no
        cache between inputs, and fills no slot's cache either."""
        caller = access.current()
        await self._permit(request.model, context, caller)
        await self._policy(request.model, "", context, caller)
        keep_alive_s = request.keep_alive_s if request.HasField("keep_alive_s") else None
        await self._keep_alive(request.model, keep_alive_s, context, caller)
        await self._count(request.model, context, caller)
        route, replica = await self._awake(request.model, context, caller)
        # Counted like a generation: it keeps its Lane awake, and says how long after.
        self._activity.begin(route.lane)
        served = False
        try:
            route, replica, response = await self._on_replicas(
                request.model, route, replica, lambda client: client.embed(request)
            )
            served = True
        except errors.BlazarError as err:
            metrics.observe_embedding_failure(route.lane, err.reason)
            await self._refuse(context, err, caller)
        except asyncio.CancelledError:
            cut = status.cut_by_deadline(context)
            outcome = metrics.DEADLINE_EXCEEDED if cut else metrics.CANCELLED
            metrics.observe_embedding_failure(route.lane, outcome)
            raise
        finally:
            # As a generation's: a refused embedding says nothing of the Lane's idleness.
            self._activity.end(route.lane, keep_alive_s=keep_alive_s if served else None)
        metrics.observe_embedding(route.lane, response.prompt_tokens)
        self._access.charge(caller, prompt_tokens=response.prompt_tokens, output_tokens=0)
        response.model = route.lane
        response.routing.lane = route.lane
        response.routing.replica = replica.index
        return response

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: Context
    ) -> inference_pb2.TokenizeResponse:
        caller = access.current()
        await self._permit(request.model, context, caller)
        await self._policy(request.model, request.chat.slo, context, caller)
        await self._count(request.model, context, caller)
        route, replica = await self._awake(request.model, context, caller)
        try:
            route, _, response = await self._on_replicas(
                request.model, route, replica, lambda client: client.tokenize(request)
            )
        except errors.BlazarError as err:
            await self._refuse(context, err, caller)
        response.model = route.lane
        return response

    async def _awake(
        self, model: str, context: Context, caller: access.Caller
    ) -> tuple[routing.Route, routing.Replica]:
        """The Lane and a serving replica for a call of `caller` that does not queue in
        admission (embeddings, tokenizing): a sleeping Lane is woken, and it or a
        starting replica waited for, up to WAKE_TIMEOUT_S."""
        named = self.table.by_name.get(model)
        if named is not None and named.upstream is not None:
            # Whether or not the upstream answers now: it never will be asked.
            await status.abort(
                context,
                errors.InvalidRequest(
                    f"The model '{named.lane}' is served by an upstream server; embeddings "
                    "and tokenizing are not passed to upstream servers.",
                    metadata={"lane": named.lane},
                ),
            )
        route, replica, _ = await self._route(model, context, caller=caller)
        if replica is not None:
            return route, replica
        self._activity.begin(route.lane)
        try:
            if route.wakes:
                self._activity.want(route.lane)
            deadline = time.monotonic() + WAKE_TIMEOUT_S
            while time.monotonic() < deadline:
                stranded = routing.unservable(route) or routing.backing_off(route, time.time())
                if stranded is not None:
                    # Its Model is not ready, or it can never fit: no wake will come; or
                    # its replica crashed again and waits out its back-off.
                    await self._refuse(context, stranded, caller)
                await asyncio.sleep(WAKE_POLL_S)
                route, replica, _ = await self._route(model, context, caller=caller)
                if replica is not None:
                    return route, replica
        finally:
            self._activity.end(route.lane)
        await self._refuse(
            context,
            errors.Unavailable(
                f"Lane '{route.lane}' had no ready replica, and none was ready within "
                f"{WAKE_TIMEOUT_S:g} s; see `blazar describe lane {route.lane}`.",
                metadata={"lane": route.lane},
            ),
            caller,
        )

    async def _on_replicas(
        self,
        model: str,
        route: routing.Route,
        replica: routing.Replica,
        call: Callable[[EngineClient], Awaitable[_Answer]],
    ) -> tuple[routing.Route, routing.Replica, _Answer]:
        """Run `call`, which is safe to repeat (embedding, tokenizing), on `replica`; the
        route and replica it ran on and its answer. A replica process that turns it away with
        UNAVAILABLE (draining, or it just died) is left out, and the call goes to another
        ready one, or waits up to REPLICA_RETURN_S for one: the same replica restarted
        (a new process) serves it, as a generation that had not started waits in its
        queue. Raises the engine's own refusal, or why no replica served it."""
        refused: set[tuple[int, int | None]] = set()
        while True:
            client = self._pool.client(replica.socket, process=replica.pid)
            answer = asyncio.ensure_future(call(client))
            try:
                while not answer.done():
                    await asyncio.wait({answer}, timeout=SILENCE_POLL_S)
                    if not answer.done() and self._silent(route.lane, replica):
                        answer.cancel()
                        raise errors.Unavailable("it stopped answering its health checks")
                return route, replica, answer.result()
            except (grpc.aio.AioRpcError, errors.Unavailable) as exc:
                err = exc if isinstance(exc, errors.Unavailable) else status.from_rpc_error(exc)
                if not isinstance(err, errors.Unavailable):
                    raise err from None
                refused.add((replica.index, replica.pid))
                log.info(
                    "call.replica_refused", lane=route.lane, replica=replica.index, error=str(err)
                )
                route, replica = await self._replica_back(model, route, refused)
            finally:
                answer.cancel()  # a no-op once done; else the caller left

    def _silent(self, lane: str, replica: routing.Replica) -> bool:
        """Whether `replica` (as its process) missed a health check, by the table now."""
        route = self.table.by_name.get(lane)
        return route is not None and any(
            (r.index, r.pid) == (replica.index, replica.pid) for r in route.unanswering
        )

    async def _replica_back(
        self, model: str, route: routing.Route, refused: Collection[tuple[int, int | None]]
    ) -> tuple[routing.Route, routing.Replica]:
        """A ready replica of the Lane `model` names that is none of the processes in
        `refused` (index, pid), waited for up to REPLICA_RETURN_S. Raises why there is
        none: the Lane was deleted or paused, or can start no replica, or none came."""
        deadline = time.monotonic() + REPLICA_RETURN_S
        woken = False
        while True:
            route = routing.resolve(self.table, model)
            exclude = {r.index for r in route.replicas if (r.index, r.pid) in refused}
            if len(exclude) < len(route.replicas):
                return route, self._pick(route, exclude=exclude)
            if (why := routing.closed(route)) is not None:
                raise why
            if route.wakes and not route.replicas and not woken:
                # It went to sleep meanwhile: asked to wake once, as `_awake` asks (each
                # ask has the controller look at the Lane again).
                self._activity.want(route.lane)
                woken = True
            if time.monotonic() >= deadline:
                raise errors.Unavailable(
                    f"The model '{route.lane}' lost its replica during the call, and none "
                    f"was ready again within {REPLICA_RETURN_S:g} s; see `blazar describe "
                    f"lane {route.lane}`.",
                    metadata={"lane": route.lane},
                )
            await asyncio.sleep(WAKE_POLL_S)
