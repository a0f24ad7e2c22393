"""Chat and Complete's path: a generation from its checks through its Lane's admission
queue to an engine's stream, handed back to the queue when its replica turns it away
before its first chunk (`dispatcher`), and offered to the Lane's spillover Lane when its
Lane predicts it would miss its target (`spillover`).

`Relaying` is mixed into `inference.InferenceService`: its methods read the service's
route table, admission tasks, activity ledger and sessions, and use its checks
(`_permit`, `_policy`, `_keep_alive`, `_count`), routing (`_route`, `_served`) and
refusal (`_refuse`), declared in `provided`; the split is only of the text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias

import structlog

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors, gate_tags, sessions, via
from blazar.dataplane import (
    access,
    admission,
    attempt,
    budget,
    dispatcher,
    metrics,
    prefixes,
    routing,
    spillover,
)
from blazar.enginehost import upstream_convert
from blazar.enginehost.activity import Activity
from blazar.rpc import status

# The servicer's logger: these lines were its own before the split.
log = structlog.get_logger("blazar.dataplane.inference")

# grpc ships no type information; its servicer context is dynamically typed.
Context: TypeAlias = Any


class Relaying(spillover.Spilling):
    """Chat and Complete's path through `InferenceService` (see the module docstring)."""

    _activity: Activity
    _attempts: attempt.Attempts

    # The path.

    async def _relay(
        self,
        model: str,
        generate: engine_pb2.GenerateRequest,
        context: Context,
        *,
        slo: str,
        prompt_chars: int,
        session: str = "",
        hashes: Callable[[int], tuple[int, ...]] | None = None,
        keep_alive_s: float | None = None,
    ) -> AsyncIterator[inference_pb2.Chunk]:
        """Admit the request on its Lane's queue, then stream the engine's answer;
        its end tells the Lane's activity what `keep_alive_s` asks (`Activity.end`).

        The replica routing prefers (session, cached prefix, load) is the ticket's
        `prefer`; admission starts it on a free slot, that one's first. A replica that
        refuses with UNAVAILABLE before its first chunk (draining, or its process just
        died) hands the request back to the queue, where it waits for another start
        (`dispatcher`); nothing was generated, so this is safe. The replica is announced
        in the initial metadata with the first chunk, once no other replica can take
        over."""
        arrived = time.monotonic()
        caller_deadline = _caller_deadline(context, arrived)
        request_id = _request_id(context)
        generate.request_id = request_id
        structlog.contextvars.bind_contextvars(request_id=request_id)
        caller = access.current()
        await self._permit(model, context, caller)
        try:
            _check_session(session)
            through = _through(context)
        except errors.BlazarError as err:
            log.info("request.rejected", model=model, reason=err.reason)
            await status.abort(context, err)
        # Before a replica is picked: a policy that does not exist is the caller's
        # mistake whatever state the Lane is in.
        policy = await self._policy(model, slo, context, caller)
        await self._keep_alive(model, keep_alive_s, context, caller)
        named = self.table.by_name.get(model)
        if named is not None and named.upstream is not None:
            # Before admission, whether or not the upstream answers now: what it cannot
            # be asked takes no slot.
            refused = upstream_convert.refusal(generate)
            if refused is not None:
                log.info("request.rejected", model=model, reason=refused.reason)
                await status.abort(context, refused)
        await self._count(model, context, caller)
        # Whose cached prompts it may share (`access.Caller.cache_scope`): an engine
        # reuses a slot's cache only within one scope, and the prefix index and the
        # sessions routing reads are kept per scope, so that no tenant learns another's
        # prompt or session from its cached tokens, its speed or the replica it gets.
        scope = caller.cache_scope
        generate.cache_scope = scope
        session = _scoped_session(session, scope)
        hashes = _scoped_hashes(hashes, scope)
        route, replica, blocks = await self._route(
            model, context, session=session, hashes=hashes, caller=caller, generation=True
        )
        lane = self._dispatchers.of(route.lane)
        # A malformed tag is ignored: it only helps a gate watcher count.
        tag = gate_tags.of_metadata(context.invocation_metadata() or ())
        # Told to sleep (keep_alive 0, Ollama's unload) and not asleep yet: its replicas
        # may be stopping under this request, which then waits for the Lane to wake.
        released = self._activity.keep(route.lane).release
        self._activity.begin(route.lane)
        served = False
        try:
            async for chunk in self._admitted(
                route, replica, blocks, lane, generate, context,
                arrived=arrived, request_id=request_id, caller=caller, policy=policy,
                prompt_chars=prompt_chars, session=session, through=through, hashes=hashes,
                tag=tag, waking=released, caller_deadline=caller_deadline,
            ):  # fmt: skip
                served = True
                yield chunk
        finally:
            # A request refused before its first chunk (admission's 429, the engine's
            # 400 for a prompt over the context) leaves the Lane's idleness as it was:
            # its keep_alive is said only by a request that was served.
            self._activity.end(route.lane, keep_alive_s=keep_alive_s if served else None)

    async def _admitted(
        self,
        route: routing.Route,
        replica: routing.Replica | None,
        blocks: tuple[int, ...],
        lane: dispatcher.LaneDispatcher | None,
        generate: engine_pb2.GenerateRequest,
        context: Context,
        *,
        arrived: float,
        request_id: str,
        caller: access.Caller,
        policy: admission.Policy,
        prompt_chars: int,
        session: str,
        through: tuple[str, ...],
        hashes: Callable[[int], tuple[int, ...]] | None,
        tag: gate_tags.Tag | None = None,
        waking: bool = False,
        caller_deadline: float = math.inf,
    ) -> AsyncIterator[inference_pb2.Chunk]:
        """The request through its Lane's admission queue and on to an engine (or an
        upstream server, told the daemons the request went through: `through`). The
        prompt's block hashes (`blocks`, else `hashes`) are learnt by the index of the
        Lane that runs it: the spillover Lane's when it spilled. Its gate watcher's
        `tag` is noted by the Lane it named (not a spillover Lane's: the watcher counts
        it there). `waking`: the Lane was told to sleep and may be stopping its
        replicas; the request wakes it as it would a sleeping one. `caller_deadline`:
        when the caller stops waiting (`_caller_deadline`), which admission reads."""
        try:
            if lane is None:
                raise routing.not_ready(route, time.time())
        except errors.BlazarError as err:
            log.info("request.rejected", model=route.lane, reason=err.reason)
            metrics.observe_failure(route.lane, err.reason)
            await self._refuse(context, err, caller)
        if policy.tpot_target_s is not None:
            # The engine paces prompt chunks beside this stream to keep it.
            generate.tpot_target_ms = max(1, round(policy.tpot_target_s * 1000))
        prompt_tokens, max_tokens, needs = budget.estimate(lane, route, generate, prompt_chars)
        if needs > budget.context(route, generate.sampling):
            # Likely too long for a slot, by the estimate: the engine, which counts the
            # tokens, answers that (INVALID_ARGUMENT naming both lengths); a refusal to
            # retry later for a missed target would only send the caller round again.
            policy = dataclasses.replace(policy, reject_early=False)
        if replica is None or waking:
            # The Lane sleeps, or is falling asleep (a replica that stops under the
            # request hands it back to the queue, and only the controller starts
            # another): wake it. Or its replica is starting. Its start is not the
            # request's to be refused for (the Lane was configured to sleep, or is
            # coming up); the wait bound still holds.
            if route.wakes or waking:
                self._activity.want(route.lane)
            policy = dataclasses.replace(policy, reject_early=False)
        ticket = admission.Ticket(
            id=uuid.uuid4().hex,
            policy=policy,
            arrived=arrived,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            prefer=replica.index if replica is not None else None,
            cached_tokens=self._cached_tokens(route.lane, lane, replica, blocks),
            tenant=caller.name,
            weight=caller.weight,
            context_tokens=needs,
            caller_deadline=caller_deadline,
        )
        waiting = True
        announced = False
        spill_to = self._spill_target(route, caller, generate)
        spilled: str | None = None
        try:
            started = await lane.admit(
                ticket,
                request_id=request_id,
                prompt_chars=prompt_chars,
                spill=spill_to is not None,
                tag=tag,
            )
            if isinstance(started, admission.Spill):
                assert spill_to is not None
                route, lane, run, blocks = await self._spill(
                    started, route=route, lane=lane, to=spill_to, generate=generate,
                    request_id=request_id, prompt_chars=prompt_chars, session=session,
                    blocks=blocks, hashes=hashes,
                )  # fmt: skip
                if route is spill_to:
                    # In flight there too, for its idle.sleepAfter (its own Lane's
                    # activity ends with the relay).
                    self._activity.begin(spill_to.lane)
                    spilled = spill_to.lane
            else:
                run = started
            if replica is None:
                run.load_s = max(0.0, run.started_at - arrived)
            while True:
                waiting = False
                retry = False
                # aclosing: a caller that leaves mid-stream must cancel the engine call
                # now (freeing its slot), not whenever the inner generator is collected.
                stream = self._attempts.stream(
                    route, run, generate, context, lane=lane, caller=caller, through=through
                )
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        if chunk is None:
                            retry = True
                            continue
                        if not announced:
                            announced = True
                            self._served(run.replica, blocks)
                            self._sessions.record(route.lane, session, run.replica.index)
                            await context.send_initial_metadata(attempt.initial_metadata(run))
                        yield chunk
                if not retry:
                    return
                log.info(
                    "request.requeued",
                    request_id=request_id,
                    lane=route.lane,
                    replica=run.replica.index,
                )
                waiting = True
                run = await lane.retry(run)
        except errors.BlazarError as err:
            metrics.observe_failure(route.lane, err.reason)
            if caller.tenant is not None:
                metrics.observe_tenant_refusal(caller.name, err.reason)
            # Part of it served: it counts, whatever ended it.
            await self._refuse(context, err, None if announced else caller)
        except asyncio.CancelledError:
            # A caller that leaves mid-stream is counted, and logged, by its attempt.
            if waiting:
                cut = status.cut_by_deadline(context)
                outcome = metrics.DEADLINE_EXCEEDED if cut else metrics.CANCELLED
                metrics.observe_failure(route.lane, outcome)
                log.info(
                    "request.cancelled",
                    request_id=request_id,
                    lane=route.lane,
                    policy=ticket.policy.name,
                    tenant=ticket.tenant,
                    tokens=0,
                    queued=True,
                    seconds=round(time.monotonic() - ticket.arrived, 3),
                    deadline_exceeded=cut,
                )
            raise
        finally:
            if spilled is not None:
                self._activity.end(spilled)


def _scoped_session(session: str, scope: str) -> str:
    """The key routing remembers a session by: one scope's session names are not
    another's (`Caller.cache_scope`; "" shares one namespace, as without an auth file)."""
    return f"{len(scope)}:{scope}{session}" if scope and session else session


def _scoped_hashes(
    hashes: Callable[[int], tuple[int, ...]] | None, scope: str
) -> Callable[[int], tuple[int, ...]] | None:
    """A prompt's block hashes as the prefix index keeps them for `scope`
    (`prefixes.scoped`): one scope's prompts never match another's."""
    if hashes is None or not scope:
        return hashes
    unscoped = hashes
    return lambda limit: prefixes.scoped(unscoped(limit), scope)


# A session key names a conversation; a longer one is a mistake or an attack on memory.
def _check_session(session: str) -> None:
    size = len(session.encode())
    if size > sessions.MAX_SESSION_BYTES:
        raise errors.InvalidRequest(
            f"The session key is {size:,} bytes; at most {sessions.MAX_SESSION_BYTES} are "
            "accepted.",
            metadata={errors.FIELD_KEY: "session"},
        )


def _through(context: Context) -> tuple[str, ...]:
    """The daemons the request went through (metadata `x-blazar-via`, which the HTTP
    shim passes on); INVALID_ARGUMENT when it is not a list of daemon ids."""
    for key, value in context.invocation_metadata() or ():
        if key == via.HEADER:
            return via.hops(str(value))
    return ()


def _caller_deadline(context: Context, now: float) -> float:
    """When the caller stops waiting, on the clock of `now` (monotonic): its gRPC
    deadline (`timeout=` in grpcio, `deadline` in grpc-js); inf when it set none, as
    the HTTP shim does (HTTP has none)."""
    remaining = context.time_remaining()
    return math.inf if remaining is None else now + max(0.0, remaining)


def _request_id(context: Context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            return str(value)
    return uuid.uuid4().hex
