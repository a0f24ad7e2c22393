"""One admitted request's stream from its replica's engine.

`Attempts.stream` relays the engine's chunks, completing the Final with what only the
data plane knows (the Lane, the replica, the time to first token from arrival, the
wait in admission's queue, the prediction, the wait for a sleeping Lane), records the
first token and the end with the Lane's dispatcher, counts the request on its replica
(`inflight`, which routing reads as load) and charges its tenant (the Final's usage,
or what it was sent when it left before the Final). A replica that
refuses with UNAVAILABLE before its first chunk yields a final None: the caller hands
the request back to admission (nothing was generated, so this is safe). So does a run
taken back (`runs.Run.withdraw`) before its first chunk, its replica having missed a
health check: its call is cancelled, and it waits for a replica that answers rather
than for one that may never answer again. Taken back after a chunk came in meanwhile,
it fails as one whose engine was lost.

An upstream Lane's one replica is its upstream server: the stream comes from
`blazar.enginehost.upstream` as canonical chunks, and its failures (Blazar errors,
not gRPC's) are the caller's answer at once: handed back, the request would only go
to the same server again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol, TypeAlias

import grpc
import structlog

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.dataplane import access, dispatcher, metrics, routing, runs
from blazar.enginehost import client
from blazar.enginehost.client import EnginePool
from blazar.enginehost.upstream import UpstreamPool
from blazar.rpc import status

log = structlog.get_logger(__name__)

# grpc ships no type information; its servicer context is dynamically typed.
Context: TypeAlias = Any

# Initial metadata of Chat and Complete, sent before the first chunk: where the request
# runs, for callers (the HTTP shim's headers) that cannot wait for Final.routing.
LANE_KEY = "blazar-lane"
REPLICA_KEY = "blazar-replica"
# Admission's prediction of the time to first token (milliseconds from arrival), when
# it had one.
PREDICTED_TTFT_KEY = "blazar-predicted-ttft-ms"
# The prompt tokens the replica's cache held, and the prompt's tokens in all, when its
# engine said so with its first chunk (an upstream does not): a dialect whose stream
# starts with the prompt's usage (Anthropic's message_start) has it before the end.
PREFIX_REUSED_KEY = "blazar-prefix-reused"
PROMPT_TOKENS_KEY = "blazar-prompt-tokens"


class Attempts:
    """Streams admitted requests from engines; `inflight` counts them by replica."""

    def __init__(
        self, *, pool: EnginePool, access: access.Access, upstreams: UpstreamPool | None = None
    ) -> None:
        self._pool = pool
        self._upstreams = upstreams if upstreams is not None else UpstreamPool()
        self._access = access
        # By (lane, replica index): requests streaming from it now.
        self.inflight: Counter[tuple[str, int]] = Counter()

    async def stream(
        self,
        route: routing.Route,
        run: runs.Run,
        generate: engine_pb2.GenerateRequest,
        context: Context,
        *,
        lane: dispatcher.LaneDispatcher,
        caller: access.Caller,
        through: Sequence[str] = (),
    ) -> AsyncGenerator[inference_pb2.Chunk | None, None]:
        """One replica's stream; a final None asks the caller to requeue the request.
        `through`: the daemons the request went through (`blazar.api.via`), for an
        upstream Lane's server."""
        replica, ticket = run.replica, run.ticket
        if run.withdrawn:  # taken back before its relay got here
            yield None
            return
        key = (replica.lane, replica.index)
        self.inflight[key] += 1
        metrics.IN_FLIGHT.labels(route.lane).inc()
        call = self._open(route, replica, generate, through)
        run.cancel = call.cancel
        first_at: float | None = None
        tokens = 0
        sent = False
        finished: inference_pb2.Final | None = None
        # Whether the request's outcome is settled here (counted, or handed back for a
        # retry); a stream left before that was cancelled by its caller.
        settled = False
        retried = False

        async def fail(err: errors.BlazarError) -> None:
            """End the call with `err`, counted and logged as the request's failure."""
            metrics.observe_failure(route.lane, err.reason, tokens=tokens)
            log.info(
                "request.failed",
                request_id=generate.request_id,
                lane=route.lane,
                tenant=ticket.tenant,
                reason=err.reason,
            )
            await status.abort(context, err)

        def summary(event: str, **extra: object) -> None:
            """The request's one summary line: done, or cancelled by its caller."""
            log.info(
                event,
                request_id=generate.request_id,
                lane=route.lane,
                replica=replica.index,
                policy=ticket.policy.name,
                tenant=ticket.tenant,
                tokens=tokens,
                queued_s=round(ticket.waited_s, 3),
                seconds=round(time.monotonic() - ticket.arrived, 3),
                **extra,
            )

        try:
            async for chunk in call:
                if not sent:
                    # With the first chunk in, the engine's initial metadata is too.
                    told = await call.initial_metadata()
                    run.prefix_reused = client.prefix_reused(told)
                    run.prompt_tokens = client.prompt_tokens(told)
                if chunk.HasField("delta"):
                    if first_at is None:
                        first_at = time.monotonic()
                        lane.first_token(run, first_at - ticket.arrived)
                    tokens += chunk.delta.tokens
                    run.generated = tokens
                else:
                    final = chunk.final
                    final.model = route.lane
                    final.routing.lane = route.lane
                    final.routing.replica = replica.index
                    if first_at is None:
                        lane.first_token(run, time.monotonic() - ticket.arrived)
                    end = first_at or time.monotonic()
                    final.timings.ttft_ms = (end - ticket.arrived) * 1000.0
                    # The wait in admission's queue, before the engine's own.
                    final.timings.queue_ms += ticket.waited_s * 1000.0
                    if run.predicted_ttft_s is not None:
                        final.timings.predicted_ttft_ms = run.predicted_ttft_s * 1000.0
                    final.timings.load_ms = run.load_s * 1000.0
                    metrics.observe_final(route.lane, final, policy=ticket.policy.name)
                    self._access.charge(
                        caller,
                        prompt_tokens=final.usage.prompt_tokens,
                        output_tokens=final.usage.completion_tokens,
                    )
                    finished = final
                    settled = True
                sent = True
                yield chunk
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not run.taken_back() or (task is not None and task.cancelling()):
                raise  # its caller left
            settled = True
            if not sent:
                retried = True
                yield None
                return
            await fail(
                errors.Unavailable(
                    f"Replica {replica.index} of Lane '{route.lane}' stopped answering its "
                    "health checks before this request finished; retry."
                )
            )
        except (grpc.aio.AioRpcError, errors.BlazarError) as exc:
            settled = True
            # A BlazarError is an upstream's failure: its only replica is the one that
            # failed, so handing the request back would send it there again at once.
            failure = exc if isinstance(exc, errors.BlazarError) else status.from_rpc_error(exc)
            if (
                isinstance(exc, grpc.aio.AioRpcError)
                and not sent
                and isinstance(failure, errors.Unavailable)
            ):
                retried = True
                yield None
                return
            if isinstance(exc, grpc.aio.AioRpcError) and status.lost_peer(exc):
                # gRPC's own words ("Stream removed (Socket closed)") mean nothing to the
                # caller, so they go to the log only; the engine died mid-answer, and
                # another try may well succeed.
                log.info("request.engine_lost", lane=route.lane, error=exc.details())
                failure = errors.Unavailable(
                    f"Lost the engine of replica {replica.index} of Lane '{route.lane}' "
                    "before this request finished; retry."
                )
            await fail(failure)
        finally:
            call.cancel()  # no-op when finished; frees the engine slot when the caller left
            if not settled:
                cut = status.cut_by_deadline(context)
                outcome = metrics.DEADLINE_EXCEEDED if cut else metrics.CANCELLED
                metrics.observe_failure(route.lane, outcome, tokens=tokens)
                # The caller left before the Final that charges it: the tokens it was
                # sent were generated all the same (else leaving a stream one chunk
                # early escapes tokensPerMinute). Its prompt, once prefilled, as
                # admission estimated it: the engine counts it only in the Final.
                prompt = lane.measurements.prompt_tokens(run.prompt_chars) if first_at else 0
                self._access.charge(caller, prompt_tokens=prompt, output_tokens=tokens)
                # Its summary line: `request.done` below is not reached (the caller's
                # leaving ends this generator).
                summary("request.cancelled", deadline_exceeded=cut)
            if not retried:
                lane.end(run, finished)
            metrics.IN_FLIGHT.labels(route.lane).dec()
            self.inflight[key] -= 1
            if self.inflight[key] <= 0:
                del self.inflight[key]
        summary("request.done")

    def _open(
        self,
        route: routing.Route,
        replica: routing.Replica,
        generate: engine_pb2.GenerateRequest,
        through: Sequence[str],
    ) -> Call:
        """The generation's call: on the replica's engine, or on the Lane's upstream."""
        if route.upstream is not None:
            upstream = self._upstreams.client(route.upstream)
            return upstream.generate(generate, model=route.model, through=through)
        return self._pool.client(replica.socket, process=replica.pid).generate(generate)


class Call(Protocol):
    """A generation under way: an engine's Generate call or an upstream's stream."""

    def __aiter__(self) -> AsyncIterator[inference_pb2.Chunk]: ...

    async def initial_metadata(self) -> Any: ...

    def cancel(self) -> bool: ...


def initial_metadata(run: runs.Run) -> tuple[tuple[str, str], ...]:
    """Where the request runs, what its replica's cache held of its prompt and how long
    the prompt is, and when admission expected its first token."""
    metadata = [(LANE_KEY, run.replica.lane), (REPLICA_KEY, str(run.replica.index))]
    if run.prefix_reused is not None:
        metadata.append((PREFIX_REUSED_KEY, str(run.prefix_reused)))
    if run.prompt_tokens is not None:
        metadata.append((PROMPT_TOKENS_KEY, str(run.prompt_tokens)))
    if run.predicted_ttft_s is not None:
        metadata.append((PREDICTED_TTFT_KEY, str(round(run.predicted_ttft_s * 1000))))
    return tuple(metadata)
