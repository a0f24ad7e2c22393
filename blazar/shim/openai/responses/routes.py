"""The HTTP route of the Responses API: parse, convert, call the daemon, render."""

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
    return [Route("/v1/responses", relay.guarded(create, render=error), methods=["POST"])]


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
            collected.parts, collected.logprobs, collected.final, collected.calls
        )
        rendered = answer.response(started, meta, logprobs=logprobs)
    except streaming.ClientDisconnected:
        return Response(status_code=streaming.CLIENT_CLOSED_REQUEST)
    except errors.BlazarError as err:
        return error(err)
    return JSONResponse(rendered, headers=headers)


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
