"""Which dialect a path speaks, for the answers given before a route has read the
request or where none matches: Starlette's 404 and 405, the guards' refusals (keys,
browsers, loops), and a request head too large to read (`connections`).

Ollama's paths are under `/api/` and `/` (its "Ollama is running"); Anthropic's under
`/v1/messages`; every other path is OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from blazar.api import errors
from blazar.shim.anthropic import routes as anthropic_routes
from blazar.shim.anthropic.convert import envelope as anthropic_envelope
from blazar.shim.ollama import render as ollama_render
from blazar.shim.openai.convert import envelope as openai_envelope

Dialect = Literal["openai", "ollama", "anthropic"]


def of(path: str) -> Dialect:
    if path == "/" or path.startswith("/api/"):
        return "ollama"
    if anthropic_routes.owns(path):
        return "anthropic"
    return "openai"


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
