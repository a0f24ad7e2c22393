"""Which dialect a path speaks, for the answers given before a route has read the
request or where none matches: Starlette's 404 and 405, the guards' refusals (keys,
browsers, loops), and a request head too large to read (`connections`).

Ollama's paths are under `/api/` and `/` (its "Ollama is running"); Anthropic's under
`/v1/messages`; every other path is OpenAI's, but for `/v1/models`, which both OpenAI's
and Anthropic's clients ask: there the `anthropic-version` header, which every
Anthropic client sends, picks Anthropic's Models API (`models_routes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from blazar.api import errors
from blazar.shim import relay
from blazar.shim.anthropic import routes as anthropic_routes
from blazar.shim.anthropic.convert import envelope as anthropic_envelope
from blazar.shim.ollama import render as ollama_render
from blazar.shim.openai import routes as openai_routes
from blazar.shim.openai.convert import envelope as openai_envelope

Dialect = Literal["openai", "ollama", "anthropic"]


def of(path: str) -> Dialect:
    if path == "/" or path.startswith("/api/"):
        return "ollama"
    if anthropic_routes.owns(path):
        return "anthropic"
    return "openai"


# The header every Anthropic client sends, and no OpenAI client does.
ANTHROPIC_VERSION_HEADER = "anthropic-version"


def models_routes() -> list[Route]:
    """`GET /v1/models` and `/v1/models/{model}`: Anthropic's Models API for a request
    with `anthropic-version`, OpenAI's otherwise."""
    openai_list, openai_one = openai_routes.model_handlers()
    anthropic_list, anthropic_one = anthropic_routes.model_handlers()
    return [
        Route("/v1/models", _by_header(openai_list, anthropic_list), methods=["GET"]),
        # `path`: an alias may contain a slash (`google/gemma-3`).
        Route("/v1/models/{model:path}", _by_header(openai_one, anthropic_one), methods=["GET"]),
    ]


def _by_header(openai: relay.Handler, anthropic: relay.Handler) -> relay.Handler:
    async def handler(request: Request) -> Response:
        if ANTHROPIC_VERSION_HEADER in request.headers:
            return await anthropic(request)
        return await openai(request)

    handler.__name__ = openai.__name__
    return handler


@dataclass(frozen=True)
class Refusal:
    status: int
    body: Any
    headers: dict[str, str]


def refusal(path: str, err: errors.BlazarError, *, request_id: str) -> Refusal:
    """`err` as the dialect of `path` words it: status, JSON body, headers."""
    dialect = of(path)
    if dialect == "ollama":
        o = ollama_render.error_response(err)
        return Refusal(o.status, o.body, o.headers)
    if dialect == "anthropic":
        a = anthropic_envelope.error_response(err, request_id=request_id)
        headers = {**a.headers, anthropic_routes.REQUEST_ID_HEADER: request_id}
        return Refusal(a.status, a.body, headers)
    r = openai_envelope.error_response(err)
    return Refusal(r.status, r.body, r.headers)
