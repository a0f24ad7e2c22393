"""HTTP routes of the Anthropic dialect: parse, convert, call the daemon, render.

Every response carries Anthropic's `request-id` header (the `anthropic` client reads
it into `_request_id` and its errors' `request_id`): the same id as `x-request-id`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import context, inference, relay, request_body, streaming
from blazar.shim.anthropic import protocol
from blazar.shim.anthropic.convert import envelope, listing, render, requests

_log = structlog.get_logger("blazar.shim.anthropic")

REQUEST_ID_HEADER = "request-id"
# Where Anthropic's routes live; the app's 404/405 answers in this dialect under it.
PREFIX = "/v1/messages"


def routes() -> list[Route]:
    return [
        Route(PREFIX, _guarded(messages), methods=["POST"]),
        Route(f"{PREFIX}/count_tokens", _guarded(count_tokens), methods=["POST"]),
    ]


def model_handlers() -> tuple[relay.Handler, relay.Handler]:
    """The Models API's list and retrieve, for `/v1/models` asked with Anthropic's
    `anthropic-version` header (`blazar.shim.dialects.models_routes`)."""
    return _guarded(list_models), _guarded(retrieve_model)


def owns(path: str) -> bool:
    """Whether an unrouted path is one of this dialect's (`/v1/messages/batches`, ...)."""
    return path == PREFIX or path.startswith(f"{PREFIX}/")


async def messages(request: Request) -> Response:
    ctx = context.of(request)
    try:
        body = await request_body.parse(request, protocol.MessagesRequest)
        chat = requests.messages_request(body, session=ctx.session, slo=ctx.slo)
    except errors.BlazarError as err:
        return error(err, request_id=ctx.request_id)
    meta = render.ResponseMeta(
        id=f"msg_{ctx.request_id}",
        model=body.model,
        max_tokens=body.max_tokens,
        prewarm=requests.prewarms(body),
    )
    stream = inference.client_of(request).chat(chat, metadata=ctx.grpc_metadata())
    if body.stream:
        return await _stream(request, stream, render.Events(meta), request_id=ctx.request_id)
    return await _collect(request, stream, meta, request_id=ctx.request_id)


async def list_models(request: Request) -> Response:
    """Anthropic's `GET /v1/models` (`client.models.list()`), one page of it."""
    ctx = context.of(request)
    try:
        response = await inference.client_of(request).list_models(metadata=ctx.grpc_metadata())
        body = listing.page(response, request.query_params)
    except errors.BlazarError as err:
        return error(err, request_id=ctx.request_id)
    return JSONResponse(body)


async def retrieve_model(request: Request) -> Response:
    """Anthropic's `GET /v1/models/{model_id}` (`client.models.retrieve`)."""
    ctx = context.of(request)
    try:
        response = await inference.client_of(request).list_models(metadata=ctx.grpc_metadata())
        body = listing.find(response, request.path_params["model"])
    except errors.BlazarError as err:
        return error(err, request_id=ctx.request_id)
    return JSONResponse(body)


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the model's tokenizer counts the rendered chat (Tokenize)."""
    ctx = context.of(request)
    try:
        body = await request_body.parse(request, protocol.CountTokensRequest)
        tokenize = requests.count_request(body)
        response = await streaming.until_disconnected(
            request, inference.client_of(request).tokenize(tokenize, metadata=ctx.grpc_metadata())
        )
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err, request_id=ctx.request_id)
    return JSONResponse(render.token_count(response))


async def no_route(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such path) and 405 (wrong method) in Anthropic's envelope."""
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    where = f"{request.method} {request.url.path}"
    if status == 405:
        message = f"Method not allowed ({where})."
        kind = "invalid_request_error"
    else:
        message = f"Not found ({where}): Blazar serves POST {PREFIX} and {PREFIX}/count_tokens."
        kind = "not_found_error"
    request_id = context.of(request).request_id
    body: protocol.ErrorBody = {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": request_id,
    }
    headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(body, status_code=status, headers=headers)


def error(err: errors.BlazarError, *, request_id: str = "") -> Response:
    rendered = envelope.error_response(err, request_id=request_id)
    return JSONResponse(rendered.body, status_code=rendered.status, headers=rendered.headers)


async def _stream(
    request: Request, stream: inference.ChunkStream, events: render.Events, *, request_id: str
) -> Response:
    """Answer with SSE once the first chunk is in (see `relay.first_chunk`)."""
    try:
        first, headers = await relay.first_chunk(request, stream)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err, request_id=request_id)
    opening = events.opening(
        prompt_tokens=_count(headers, inference.PROMPT_TOKENS_HEADER),
        cached_tokens=_count(headers, inference.PREFIX_REUSED_HEADER) or 0,
    )
    body = _events(stream, events, first, opening, request_id=request_id)
    return streaming.EventStream(body, headers=headers)


def _count(headers: dict[str, str], name: str) -> int | None:
    value = headers.get(name, "")
    return int(value) if value.isdigit() else None


async def _events(
    stream: inference.ChunkStream,
    events: render.Events,
    first: inference_pb2.Chunk | None,
    opening: list[protocol.Event],
    *,
    request_id: str,
) -> AsyncIterator[bytes]:
    def failure(err: errors.BlazarError) -> list[protocol.Event]:
        # Headers are gone; Anthropic's clients raise on an `error` event.
        return [envelope.error_response(err, request_id=request_id).body]

    async for event in relay.rendered(stream, events, first, opening=opening, failure=failure):
        yield _sse(event)


async def _collect(
    request: Request, stream: inference.ChunkStream, meta: render.ResponseMeta, *, request_id: str
) -> Response:
    try:
        answer, headers = await relay.collect(request, stream)
        body = render.message(answer, meta)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err, request_id=request_id)
    return JSONResponse(body, headers=headers)


def _sse(event: protocol.Event) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return streaming.sse_event(data, event=event["type"])


def _guarded(handler: relay.Handler) -> relay.Handler:
    """Render a bug as a 500 in Anthropic's envelope instead of Starlette's plain text,
    and put the `request-id` header on every response."""
    guarded = relay.guarded(handler, render=error)

    async def with_request_id(request: Request) -> Response:
        response = await guarded(request)
        response.headers[REQUEST_ID_HEADER] = context.of(request).request_id
        return response

    with_request_id.__name__ = handler.__name__
    return with_request_id
