"""HTTP routes of the OpenAI dialect: parse, convert, call the daemon, render."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import context, inference, relay, request_body, streaming
from blazar.shim.openai import protocol
from blazar.shim.openai.convert import envelope, render, requests
from blazar.shim.openai.responses import routes as responses_routes

_log = structlog.get_logger("blazar.shim.openai")

_DONE = b"data: [DONE]\n\n"

Renderer: TypeAlias = render.ChatStream | render.CompletionStream


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", _guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", _guarded(completions), methods=["POST"]),
        Route("/v1/embeddings", _guarded(embeddings), methods=["POST"]),
        *responses_routes.routes(),
    ]


def model_handlers() -> tuple[relay.Handler, relay.Handler]:
    """`/v1/models` and `/v1/models/{model}` as OpenAI's, mounted by
    `blazar.shim.dialects.models_routes` (Anthropic's clients use the same paths)."""
    return _guarded(list_models), _guarded(retrieve_model)


async def chat_completions(request: Request) -> Response:
    ctx = context.of(request)
    try:
        body = await request_body.parse(request, protocol.ChatCompletionRequest)
        canonical = requests.chat_request(body, session=ctx.session, slo=ctx.slo)
    except errors.BlazarError as err:
        return error(err)
    blame = requests.blame_of(body)
    meta = render.ResponseMeta(
        id=f"chatcmpl-{ctx.request_id}", created=int(time.time()), model=body.model
    )
    stream = inference.client_of(request).chat(canonical, metadata=ctx.grpc_metadata())
    logprobs = bool(body.logprobs)
    if body.stream:
        renderer = render.ChatStream(
            meta, include_usage=requests.include_usage(body), logprobs=logprobs
        )
        return await _stream(request, stream, renderer, blame=blame)
    return await _collect(
        request,
        stream,
        lambda answer: answer.chat_completion(meta, logprobs=logprobs),
        blame=blame,
    )


async def completions(request: Request) -> Response:
    ctx = context.of(request)
    try:
        body = await request_body.parse(request, protocol.CompletionRequest)
        canonical = requests.complete_request(body, session=ctx.session, slo=ctx.slo)
    except errors.BlazarError as err:
        return error(err, blame=envelope.COMPLETION_BLAME)
    blame = requests.blame_of(body)
    meta = render.ResponseMeta(
        id=f"cmpl-{ctx.request_id}", created=int(time.time()), model=body.model
    )
    stream = inference.client_of(request).complete(canonical, metadata=ctx.grpc_metadata())
    logprobs = body.logprobs is not None
    echo = requests.prompt_text(body) if body.echo else None
    if body.stream:
        renderer = render.CompletionStream(
            meta, include_usage=requests.include_usage(body), logprobs=logprobs, echo=echo
        )
        return await _stream(request, stream, renderer, blame=blame)
    return await _collect(
        request,
        stream,
        lambda answer: answer.completion(meta, logprobs=logprobs, echo=echo),
        blame=blame,
    )


async def embeddings(request: Request) -> Response:
    ctx = context.of(request)
    try:
        body = await request_body.parse(request, protocol.EmbeddingRequest)
        canonical = requests.embed_request(body)
        client = inference.client_of(request)
        response = await streaming.until_disconnected(
            request, client.embed(canonical, metadata=ctx.grpc_metadata())
        )
        rendered = render.embedding_list(
            response,
            model=body.model,
            encoding_format=body.encoding_format,
        )
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err, blame=envelope.EMBEDDING_BLAME)
    return JSONResponse(rendered, headers=inference.embedding_headers(response))


async def list_models(request: Request) -> Response:
    ctx = context.of(request)
    try:
        response = await inference.client_of(request).list_models(metadata=ctx.grpc_metadata())
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(render.model_list(response))


async def retrieve_model(request: Request) -> Response:
    """One entry of /v1/models (the `openai` client's `models.retrieve`)."""
    ctx = context.of(request)
    try:
        response = await inference.client_of(request).list_models(metadata=ctx.grpc_metadata())
        found = render.model(response, request.path_params["model"])
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(found)


async def no_route(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such path) and 405 (wrong method) in OpenAI's envelope."""
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    headers = exc.headers if isinstance(exc, HTTPException) else None
    where = f"{request.method} {request.url.path}"
    if status == 405 and headers and "allow" in {k.lower() for k in headers}:
        allowed = next(v for k, v in headers.items() if k.lower() == "allow")
        message = f"Method not allowed ({where}); use {allowed}."
    else:
        message = f"Invalid URL ({where})."
    body: protocol.ErrorBody = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    }
    return JSONResponse(body, status_code=status, headers=headers)


def error(err: errors.BlazarError, *, blame: envelope.Blame = envelope.CHAT_BLAME) -> Response:
    rendered = envelope.error_response(err, blame=blame)
    return JSONResponse(rendered.body, status_code=rendered.status, headers=rendered.headers)


async def _stream(
    request: Request,
    stream: inference.ChunkStream,
    renderer: Renderer,
    *,
    blame: envelope.Blame,
) -> Response:
    """Answer with SSE once the first chunk is in (see `relay.first_chunk`)."""
    try:
        first, headers = await relay.first_chunk(request, stream)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err, blame=blame)
    return streaming.EventStream(_events(stream, renderer, first, blame=blame), headers=headers)


async def _events(
    stream: inference.ChunkStream,
    renderer: Renderer,
    first: inference_pb2.Chunk | None,
    *,
    blame: envelope.Blame,
) -> AsyncIterator[bytes]:
    def failure(err: errors.BlazarError) -> list[_Event]:
        # Headers are gone; OpenAI's clients read an `error` key in a data event.
        return [envelope.error_response(err, blame=blame).body]

    events: AsyncIterator[_Event] = relay.rendered(
        stream, renderer, first, opening=renderer.opening(), failure=failure
    )
    async for obj in events:
        yield _sse(obj)
    yield _DONE


async def _collect(
    request: Request,
    stream: inference.ChunkStream,
    body_of: Callable[[render.Answer], protocol.ChatCompletion | protocol.Completion],
    *,
    blame: envelope.Blame,
) -> Response:
    try:
        collected, headers = await relay.collect(request, stream)
        answer = render.Answer(
            collected.parts,
            collected.logprobs,
            collected.final,
            collected.calls,
            text_logprobs=collected.text_logprobs,
        )
        body = body_of(answer)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err, blame=blame)
    return JSONResponse(body, headers=headers)


_Event: TypeAlias = protocol.ChatCompletionChunk | protocol.Completion | protocol.ErrorBody


def _sse(obj: _Event) -> bytes:
    return streaming.sse_event(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


def _guarded(handler: relay.Handler) -> relay.Handler:
    """Render a bug as a 500 in OpenAI's envelope instead of Starlette's plain text."""
    return relay.guarded(handler, render=error)
