"""HTTP routes of the Ollama dialect: parse, convert, call the daemon, render."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import context, inference, relay, request_body, streaming
from blazar.shim.ollama import convert, listing, options, protocol, render

_log = structlog.get_logger("blazar.shim.ollama")


def routes() -> list[Route]:
    # A GET route answers HEAD too (Starlette), as Ollama's `/`, version and tags do.
    management = [
        Route(f"/api/{name}", _guarded(_refuse_management), methods=[method])
        for name, method in (
            ("pull", "POST"),
            ("push", "POST"),
            ("create", "POST"),
            ("copy", "POST"),
            ("delete", "DELETE"),
        )
    ]
    return [
        Route("/", running, methods=["GET"]),
        Route("/api/version", _guarded(version), methods=["GET"]),
        Route("/api/chat", _guarded(chat), methods=["POST"]),
        Route("/api/generate", _guarded(generate), methods=["POST"]),
        Route("/api/embed", _guarded(embed), methods=["POST"]),
        Route("/api/embeddings", _guarded(embeddings), methods=["POST"]),
        Route("/api/tags", _guarded(tags), methods=["GET"]),
        Route("/api/show", _guarded(show), methods=["POST"]),
        Route("/api/ps", _guarded(ps), methods=["GET"]),
        *management,
    ]


async def running(request: Request) -> Response:
    """What Ollama answers at `/`; clients probe it to find a server."""
    return PlainTextResponse("Ollama is running")


async def version(request: Request) -> Response:
    """The Ollama version whose API Blazar speaks (`protocol.API_VERSION`), as clients
    read this route; `blazar version` tells Blazar's own."""
    body: protocol.VersionResponse = {"version": protocol.API_VERSION}
    return JSONResponse(body)


async def chat(request: Request) -> Response:
    return await _generate(request, "chat")


async def generate(request: Request) -> Response:
    return await _generate(request, "generate")


async def _generate(request: Request, kind: render.Kind) -> Response:
    """/api/chat and /api/generate: a preload, or a generation through Chat or Complete;
    either way the request is converted first, so a preload's fields are checked too."""
    ctx = context.of(request)
    try:
        body: protocol.ChatRequest | protocol.GenerateRequest
        if kind == "chat":
            body = await request_body.parse(request, protocol.ChatRequest)
        else:
            body = await request_body.parse(request, protocol.GenerateRequest)
        canonical_request: inference_pb2.ChatRequest | inference_pb2.CompleteRequest
        if isinstance(body, protocol.ChatRequest):
            canonical_request = convert.chat_request(
                body,
                session=ctx.session,
                slo=ctx.slo,
                tool_choice=ctx.tool_choice,
                parallel_tool_calls=ctx.parallel_tool_calls,
            )
        else:
            canonical_request = convert.generate_request(
                body,
                session=ctx.session,
                slo=ctx.slo,
                tool_choice=ctx.tool_choice,
                parallel_tool_calls=ctx.parallel_tool_calls,
            )
        if canonical_request.sampling.HasField("context_limit"):
            info = await _model_info(request, body.model)
            options.bound_context(canonical_request.sampling, info)
        # A preload is checked as the generation would be (as Ollama checks its options,
        # format and capabilities before it loads): what it asks for is done or refused.
        if convert.is_load(body):
            convert.check_load(body)
            return await _loaded(request, kind, body.model, keep_alive=body.keep_alive)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err)
    client = inference.client_of(request)
    metadata = ctx.grpc_metadata()
    if isinstance(canonical_request, inference_pb2.CompleteRequest):
        stream = client.complete(canonical_request, metadata=metadata)
    else:
        stream = client.chat(canonical_request, metadata=metadata)
    return await _generation(request, stream, kind, body)


async def _generation(
    request: Request,
    stream: inference.ChunkStream,
    kind: render.Kind,
    body: protocol.ChatRequest | protocol.GenerateRequest,
) -> Response:
    with_logprobs = bool(body.logprobs)
    # Ollama streams unless the request says `"stream": false`.
    if body.stream is False:
        try:
            collected, headers = await relay.collect(request, stream)
            rendered = render.answer(
                kind,
                collected,
                model=body.model,
                created_at=_now(),
                with_logprobs=with_logprobs,
            )
        except streaming.ClientDisconnected:
            return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
        except errors.BlazarError as err:
            return error(err)
        return JSONResponse(rendered, headers=headers)
    try:
        first, headers = await relay.first_chunk(request, stream)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err)
    lines = render.Lines(kind, model=body.model, clock=_now, logprobs=with_logprobs)
    return streaming.LineStream(_lines(stream, lines, first), headers=headers)


async def _lines(
    stream: inference.ChunkStream, lines: render.Lines, first: inference_pb2.Chunk | None
) -> AsyncIterator[bytes]:
    def failure(err: errors.BlazarError) -> list[Any]:
        # Headers are gone; Ollama's clients raise on a line with an `error` key.
        return [render.error_response(err).body]

    async for obj in relay.rendered(stream, lines, first, failure=failure):
        yield _ndjson(obj)


async def _loaded(
    request: Request, kind: render.Kind, model: str, *, keep_alive: protocol.KeepAlive
) -> Response:
    """A preload (a sleeping Lane wakes, and the keep_alive holds as a request's would)
    or, with keep_alive 0, an unload (the Lane sleeps once idle)."""
    unload = await _load(request, model, keep_alive=keep_alive)
    return JSONResponse(render.loaded(kind, model=model, created_at=_now(), unload=unload))


async def _load(request: Request, model: str, *, keep_alive: protocol.KeepAlive) -> bool:
    """Load the model's Lane, or with keep_alive 0 unload it (True then), as a request
    with nothing to do does in Ollama."""
    call = inference_pb2.KeepAliveRequest(model=model)
    convert.keep_alive(call, keep_alive)
    ctx = context.of(request)
    await streaming.until_disconnected(
        request, inference.client_of(request).keep_alive(call, metadata=ctx.grpc_metadata())
    )
    return call.HasField("keep_alive_s") and call.keep_alive_s == 0


async def _model_info(request: Request, model: str) -> inference_pb2.ModelInfo:
    ctx = context.of(request)
    listed = await inference.client_of(request).list_models(metadata=ctx.grpc_metadata())
    return listing.model_info(listed, model)


async def embed(request: Request) -> Response:
    return await _embed(request, protocol.EmbedRequest)


async def embeddings(request: Request) -> Response:
    return await _embed(request, protocol.EmbeddingsRequest)


async def _embed(
    request: Request, model: type[protocol.EmbedRequest] | type[protocol.EmbeddingsRequest]
) -> Response:
    """/api/embed, and the older /api/embeddings. Nothing to embed is Ollama's preload
    for embedding models: the Lane loads (or unloads, with keep_alive 0) and the answer
    is empty."""
    started = time.monotonic()
    ctx = context.of(request)
    try:
        body = await request_body.parse(request, model)
        if isinstance(body, protocol.EmbedRequest):
            canonical_request = convert.embed_request(body)
        else:
            canonical_request = convert.embeddings_request(body)
        if canonical_request.HasField("context_limit"):
            info = await _model_info(request, body.model)
            options.bound_context(canonical_request, info)
        if isinstance(body, protocol.EmbeddingsRequest):
            nothing = not body.prompt
        else:
            nothing = not canonical_request.inputs
        if nothing:
            await _load(request, body.model, keep_alive=body.keep_alive)
            response = inference_pb2.EmbedResponse()
        else:
            response = await streaming.until_disconnected(
                request,
                inference.client_of(request).embed(canonical_request, metadata=ctx.grpc_metadata()),
            )
        if isinstance(body, protocol.EmbedRequest):
            rendered: protocol.EmbedResponse | protocol.EmbeddingsResponse = render.embed_response(
                response, model=body.model, total_s=time.monotonic() - started
            )
        else:
            rendered = render.embeddings_response(response)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(rendered, headers=inference.embedding_headers(response))


async def tags(request: Request) -> Response:
    ctx = context.of(request)
    try:
        listed = await inference.client_of(request).list_models(metadata=ctx.grpc_metadata())
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(listing.tags(listed))


async def show(request: Request) -> Response:
    try:
        body = await request_body.parse(request, protocol.ShowRequest)
        info = await _model_info(request, listing.show_name(body))
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(listing.show(info))


async def ps(request: Request) -> Response:
    ctx = context.of(request)
    try:
        listed = await inference.client_of(request).list_models(metadata=ctx.grpc_metadata())
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(listing.ps(listed, now=datetime.now(UTC)))


async def no_route(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such path) and 405 (wrong method) in Ollama's envelope."""
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    headers = exc.headers if isinstance(exc, HTTPException) else None
    where = f"{request.method} {request.url.path}"
    message = f"Method not allowed ({where})." if status == 405 else f"Not found ({where})."
    body: protocol.ErrorBody = {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


async def _refuse_management(request: Request) -> Response:
    return error(listing.management_refused(f"{request.method} {request.url.path}"))


def error(err: errors.BlazarError) -> Response:
    rendered = render.error_response(err)
    return JSONResponse(rendered.body, status_code=rendered.status, headers=rendered.headers)


def _now() -> str:
    return render.timestamp(datetime.now(UTC))


def _ndjson(obj: render.Line | protocol.ErrorBody) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _guarded(handler: relay.Handler) -> relay.Handler:
    """Render a bug as a 500 in Ollama's envelope instead of Starlette's plain text."""
    return relay.guarded(handler, render=error)
