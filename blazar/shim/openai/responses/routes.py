"""The HTTP routes of the Responses API: parse, convert, call the daemon, render.

`POST /v1/responses` generates; `POST /v1/responses/input_tokens` counts a response's
prompt through Tokenize. Blazar stores no responses, so the routes that read one back
(retrieve, delete, cancel, its input items) answer a 404 that says so, in OpenAI's
envelope, rather than an unknown route; so does `POST /v1/responses/compact`, which
would otherwise meet the stored-response route's 405.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import context, inference, relay, request_body, streaming
from blazar.shim.openai.responses import protocol, render, requests

_log = structlog.get_logger("blazar.shim.openai")


def routes() -> list[Route]:
    # `input_tokens` and `compact` first: `{response_id}` would match them too.
    return [
        Route("/v1/responses", relay.guarded(create, render=error), methods=["POST"]),
        Route(
            "/v1/responses/input_tokens",
            relay.guarded(input_tokens, render=error),
            methods=["POST"],
        ),
        Route(
            "/v1/responses/compact",
            relay.guarded(_not_compacted, render=error),
            methods=["POST"],
        ),
        Route(
            "/v1/responses/{response_id}",
            relay.guarded(_not_stored("retrieve", "delete"), render=error),
            methods=["GET", "DELETE"],
        ),
        Route(
            "/v1/responses/{response_id}/cancel",
            relay.guarded(_not_stored("cancel"), render=error),
            methods=["POST"],
        ),
        Route(
            "/v1/responses/{response_id}/input_items",
            relay.guarded(_not_stored("list the input items of"), render=error),
            methods=["GET"],
        ),
    ]


async def create(request: Request) -> Response:
    ctx = context.of(request)
    try:
        body = await request_body.parse(request, protocol.ResponseCreateRequest)
        chat = requests.chat_request(body, session=ctx.session, slo=ctx.slo)
    except errors.BlazarError as err:
        return error(err)
    meta = render.ResponseMeta(key=ctx.request_id, created_at=int(time.time()))
    started = render.template(body, meta)
    logprobs = requests.wants_logprobs(body)
    stream = inference.client_of(request).chat(chat, metadata=ctx.grpc_metadata())
    if body.stream:
        renderer = render.ResponseStream(started, meta, logprobs=logprobs)
        try:
            first, headers = await relay.first_chunk(request, stream)
        except streaming.ClientDisconnected:
            return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
        except errors.BlazarError as err:
            return error(err)
        return streaming.EventStream(_events(stream, renderer, first), headers=headers)
    try:
        collected, headers = await relay.collect(request, stream)
        answer = render.Answer(
            collected.parts,
            collected.logprobs,
            collected.final,
            collected.calls,
            text_logprobs=collected.text_logprobs,
        )
        rendered = answer.response(started, meta, logprobs=logprobs)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(rendered, headers=headers)


async def input_tokens(request: Request) -> Response:
    """The prompt's tokens as the model's tokenizer counts the rendered chat (Tokenize),
    what `usage.input_tokens` of the same request would say."""
    ctx = context.of(request)
    try:
        body = await request_body.parse(request, protocol.InputTokensRequest)
        tokenize = requests.count_request(body)
        response = await streaming.until_disconnected(
            request, inference.client_of(request).tokenize(tokenize, metadata=ctx.grpc_metadata())
        )
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(render.input_token_count(response))


def _not_stored(*actions: str) -> relay.Handler:
    """A route over a stored response: `actions` by method (GET, then DELETE)."""

    async def not_stored(request: Request) -> Response:
        action = actions[-1] if request.method == "DELETE" else actions[0]
        return error(render.not_stored(request.path_params["response_id"], action=action))

    return not_stored


async def _not_compacted(request: Request) -> Response:
    return error(render.not_compacted())


def error(err: errors.BlazarError) -> Response:
    rendered = render.error_response(err)
    return JSONResponse(rendered.body, status_code=rendered.status, headers=rendered.headers)


async def _events(
    stream: inference.ChunkStream,
    renderer: render.ResponseStream,
    first: inference_pb2.Chunk | None,
) -> AsyncIterator[bytes]:
    async for event in relay.rendered(
        stream, renderer, first, opening=renderer.opening(), failure=renderer.failure
    ):
        yield _sse(event)


def _sse(event: protocol.Event) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return streaming.sse_event(data, event=event["type"])
