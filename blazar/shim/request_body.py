"""Read and parse an HTTP request body, refusing one over the shim's size limit before
it is all in, and parsing a large one off the event loop.

Without a limit a client can make the daemon buffer any number of bytes (a 1 GB POST
is held in memory whole before JSON parsing even starts). The limit sits above what the
daemon's gRPC API takes (`blazar.rpc.limits.MAX_REQUEST_BYTES`) by the room JSON needs
over protobuf (escapes, field names, token ids as decimal text), so any body the data
plane would accept passes here, and that one check names the precise limit for the
rest.

Parsing a body of several MiB (json, then pydantic, then the Unicode check) takes
seconds when it is built to be slow, such as millions of tiny arrays, and on the
event loop that would stall every stream the shim relays. Bodies over
`PARSE_INLINE_BYTES` are parsed in a worker thread: the parser still holds the GIL,
but the event loop gets its turn at every switch interval. There is one such thread,
so large bodies are parsed one at a time: each can take hundreds of MiB while it is
parsed, and asyncio's default pool would parse a dozen at once (and keep the threads
the daemon uses for its own file work busy).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import TypeVar

import pydantic
from starlette.requests import Request

from blazar.rpc import limits, status
from blazar.shim import validation

M = TypeVar("M", bound=pydantic.BaseModel)

MAX_BODY_BYTES = 4 * limits.MAX_REQUEST_BYTES
PARSE_INLINE_BYTES = 256 * 2**10

_LARGE_BODY_PARSER = concurrent.futures.ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="large-body-parser"
)


async def read(request: Request, *, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body; RequestTooLarge as soon as it is known to exceed `limit` bytes.

    A declared Content-Length over the limit is refused before anything is read; a
    chunked or understated body is refused once `limit` bytes have arrived.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise status.request_too_large(int(declared), limit=limit, what="request body")
    parts: list[bytes] = []
    received = 0
    async for part in request.stream():
        received += len(part)
        if received > limit:
            raise status.request_too_large(None, limit=limit, what="request body")
        parts.append(part)
    return b"".join(parts)


async def parse(request: Request, model: type[M]) -> M:
    """The body read (see `read`) and validated against `model` (see
    `validation.parse_body`); a large body is parsed in a worker thread."""
    raw = await read(request)
    if len(raw) <= PARSE_INLINE_BYTES:
        return validation.parse_body(model, raw)
    work = functools.partial(validation.parse_body, model, raw)
    return await asyncio.get_running_loop().run_in_executor(_LARGE_BODY_PARSER, work)
