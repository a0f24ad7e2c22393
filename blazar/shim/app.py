"""The shim's Starlette application: dialect routes plus Blazar's own probes.

`create_app` is what the daemon serves with uvicorn inside its event loop. The one
`grpc.aio` channel to the daemon is opened in the lifespan (it must be created on
the serving loop) and closed on shutdown; over TLS when the daemon's gRPC listener
speaks it (`inference_credentials`, from `blazar.rpc.tls`).

Keys are the data plane's to check: every route forwards the caller's
(`context.RequestContext.grpc_metadata`) and renders a refusal in its dialect, and
`keys.KeyGuard` asks the data plane's check (`require_key`) before any route runs, so
that a route that makes no call refuses a keyless caller too. Open without a key
(`keys.OPEN_PATHS`): `/healthz`, `/readyz` (it lists models with the daemon's probe
key, good for nothing else), `/metrics` (counters by Lane, policy and tenant name; no
prompts, no keys), Ollama's `/` and `/api/version`. `browsers.BrowserGuard` refuses
other origins' pages and bodies that are not JSON before that, and `loops.LoopGuard` a
request that came back to this daemon from one of its own upstream Lanes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager

import grpc
import prometheus_client
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from blazar.api import errors
from blazar.shim import browsers, context, dialects, gates, inference, keys, loops
from blazar.shim.anthropic import routes as anthropic_routes
from blazar.shim.ollama import routes as ollama_routes
from blazar.shim.openai import routes as openai_routes


def create_app(
    *,
    inference_target: str,
    probe_key: str | None = None,
    allow_origins: Collection[str] = (),
    inference_credentials: grpc.ChannelCredentials | None = None,
    channel_options: Sequence[tuple[str, str]] = (),
    require_key: keys.Require | None = None,
) -> Starlette:
    """The HTTP shim for the daemon whose `blazar.v1.Inference` listens at inference_target;
    `probe_key` is the daemon's key for `/readyz` (see `blazar.dataplane.access`), and
    `require_key` its check of a caller's key (`access.Access.require_key`)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if inference_credentials is not None:
            channel = grpc.aio.secure_channel(
                inference_target, inference_credentials, options=channel_options
            )
        else:
            channel = grpc.aio.insecure_channel(inference_target, options=channel_options)
        admission = gates.AdmissionGates()
        client = inference.InferenceClient(channel, gates=admission)
        app.state.inference = client
        app.state.gates = admission
        app.state.probe_metadata = (("authorization", f"Bearer {probe_key}"),) if probe_key else ()
        try:
            async with gates.following(admission, client.watch_admission):
                yield
        finally:
            # Cancels RPCs still open; uvicorn has already drained HTTP connections.
            await channel.close()

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *openai_routes.routes(),
            *dialects.models_routes(),
            *ollama_routes.routes(),
            *anthropic_routes.routes(),
        ],
        middleware=[
            Middleware(context.RequestIdMiddleware),
            Middleware(loops.LoopGuard, render=_error),
            Middleware(browsers.BrowserGuard, allow_origins=allow_origins, render=_error),
            Middleware(keys.KeyGuard, require=require_key, render=_error),
        ],
        exception_handlers={404: _no_route, 405: _no_route},
        lifespan=lifespan,
    )


async def _no_route(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such path) and 405 (wrong method) in the envelope of the
    dialect the path belongs to (`dialects`)."""
    dialect = dialects.of(request.url.path)
    if dialect == "ollama":
        return await ollama_routes.no_route(request, exc)
    if dialect == "anthropic":
        return await anthropic_routes.no_route(request, exc)
    return await openai_routes.no_route(request, exc)


async def _error(request: Request, err: errors.BlazarError) -> Response:
    """err in the envelope of the dialect the path belongs to (`dialects`)."""
    refusal = dialects.refusal(request.url.path, err, request_id=context.of(request).request_id)
    return JSONResponse(refusal.body, status_code=refusal.status, headers=refusal.headers)


async def healthz(request: Request) -> Response:
    """200 while the daemon's gRPC health service reports SERVING, else 503."""
    if await inference.client_of(request).serving():
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


async def readyz(request: Request) -> Response:
    """200 when the daemon serves and every model it lists has a ready replica; 503 with
    the names that are not ready otherwise (a load balancer's readiness probe). A Lane
    scaled to zero is paused on purpose and does not count, nor does a sleeping one
    (idle.sleepAfter, keep_alive, the memory budget: the next request wakes it) or one
    waiting under the memory budget for memory that idle Lanes hold (the same)."""
    client = inference.client_of(request)
    if not await client.serving():
        return JSONResponse({"status": "unavailable"}, status_code=503)
    try:
        listed = await client.list_models(metadata=request.app.state.probe_metadata)
    except errors.BlazarError:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    waiting = sorted(
        {m.lane for m in listed.models if not m.ready and m.replicas > 0 and not m.sleeping}
    )
    if waiting:
        return JSONResponse({"status": "not ready", "lanes": waiting}, status_code=503)
    return JSONResponse({"status": "ready"})


async def metrics(request: Request) -> Response:
    """Prometheus exposition of this process's registry: the shim runs inside the
    daemon, so this is the data plane's metrics."""
    return Response(
        prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST
    )
