"""The one typed client of an upstream Lane's OpenAI-compatible server.

An `UpstreamClient` holds one `httpx.AsyncClient` (its connection pool) per upstream
spec; `UpstreamPool` keeps one per spec for the data plane and the controller, so a
connection is reused across requests. `generate` streams canonical chunks as an
engine's Generate call does (async-iterable, `cancel()` closes the connection so the
upstream frees its slot); `probe` asks the upstream's `/models`.

The API key is read at each use from where `upstream.apiKeyFrom` says (`env:NAME`,
`file:PATH`) and is never logged nor put in an error, not even when the upstream
quotes it in what it answers. Failures are Blazar's errors
(`blazar.api.errors`), mapped by `upstream_convert.http_error`: a refused connection
or a timeout is UNAVAILABLE, and so is an answer that is not whole (not an event
stream, an event not shaped as OpenAI's, a line over MAX_EVENT_BYTES, or an end with
neither a finish reason nor `[DONE]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors, via
from blazar.api.kinds import Upstream
from blazar.enginehost import upstream_convert

# Sending the body (small) and waiting for a free connection of the pool.
WRITE_TIMEOUT_S = 30.0
POOL_TIMEOUT_S = 30.0
# The most of an upstream's error answer read into a message.
MAX_ERROR_BYTES = 4096
# A probe's wait for the answer once connected: a model list is quick, and a probe
# that hangs holds one of the controller's workers.
PROBE_READ_TIMEOUT_S = 5.0
# The longest line of an upstream's event stream: far above any one event (a token's
# text, tool-call delta or logprobs), as large as a whole request may be.
MAX_EVENT_BYTES = 4 * 2**20


def api_key(spec: Upstream, keys: Path | None) -> str | None:
    """The key `apiKeyFrom` points at, read now (a `file:` one from the `keys`
    directory); UNAVAILABLE (naming where, never the key) when it is not there."""
    source = spec.api_key_from
    if source is None:
        return None
    where, _, name = source.partition(":")
    if where == "env":
        value = os.environ.get(name)
        if not value:
            raise errors.Unavailable(
                f"The upstream's API key is read from the environment variable {name}, "
                "which the daemon does not have."
            )
        return value
    if keys is None:
        raise errors.Unavailable(
            f"The upstream's API key is the file {name} of the keys directory, and this "
            "daemon has none."
        )
    path = keys / name  # a plain name (apply checks it): nothing outside `keys`
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise errors.Unavailable(
            f"The upstream's API key file {path} cannot be read: {exc.strerror}."
        ) from None


@dataclass(frozen=True)
class Probe:
    """What the upstream answered its probe: `ok` when it served its model list."""

    ok: bool
    message: str


class UpstreamClient:
    """One upstream server, reached at its OpenAI base URL."""

    def __init__(
        self,
        spec: Upstream,
        *,
        keys: Path | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`keys`: the directory `file:` keys are read from (None: none can be);
        `transport`: httpx's, for tests (None: the network)."""
        self.spec = spec
        self._keys = keys
        timeouts = spec.timeouts
        verify: ssl.SSLContext | bool = True
        # Why no request can be sent (the CA file is unreadable), as probes and
        # requests report it; empty when the client works.
        self.problem = ""
        if spec.tls is not None and spec.tls.ca_file:
            try:
                verify = ssl.create_default_context(cafile=spec.tls.ca_file)
            except (OSError, ssl.SSLError) as exc:
                self.problem = (
                    f"The upstream's tls.caFile {spec.tls.ca_file} cannot be used: "
                    f"{getattr(exc, 'strerror', None) or exc}."
                )
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(
                connect=timeouts.connect_s,
                read=timeouts.first_byte_s,
                write=WRITE_TIMEOUT_S,
                pool=POOL_TIMEOUT_S,
            ),
            verify=verify,
            limits=httpx.Limits(max_connections=spec.max_concurrency + 2),
        )
        # Generations streaming through it now; a retired client (its spec changed or
        # its Lane went) closes when the last one ends, so none is cut off.
        self._streaming = 0
        self._retired = False

    def _key(self) -> str | None:
        """The key to send, read now; UNAVAILABLE when no request can be sent."""
        if self.problem:
            raise errors.Unavailable(self.problem)
        return api_key(self.spec, self._keys)

    def _headers(self, key: str | None, through: Sequence[str] = ()) -> dict[str, str]:
        """`through`: the daemons the request went through before this one."""
        # A request that comes back to a daemon it went through is refused there.
        headers = {via.HEADER: via.forwarded(through)}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def probe(self) -> Probe:
        url = f"{self.spec.url}/models"
        try:
            timeout = httpx.Timeout(
                connect=self.spec.timeouts.connect_s,
                read=PROBE_READ_TIMEOUT_S,
                write=PROBE_READ_TIMEOUT_S,
                pool=PROBE_READ_TIMEOUT_S,
            )
            key = self._key()
            request = self._http.stream("GET", url, headers=self._headers(key), timeout=timeout)
            async with request as response:
                ok = response.status_code == 200
                body = await _head(response, MAX_EVENT_BYTES if ok else MAX_ERROR_BYTES)
        except errors.BlazarError as err:
            return Probe(False, err.message)
        except httpx.ReadTimeout:
            # The probe's own bound, not the Lane's firstByte: naming that one would
            # have an operator raise it to no effect.
            return Probe(False, f"GET {url} failed: no answer within {PROBE_READ_TIMEOUT_S:g} s.")
        except httpx.HTTPError as exc:
            return Probe(False, f"GET {url} failed: {_describe(exc)}.")
        if not ok:
            text = body.decode(errors="replace")
            refused = upstream_convert.http_error(response.status_code, text)
            said = upstream_convert.redacted(refused, key).message
            return Probe(False, f"GET {url}: {said}")
        listed = _model_ids(body)
        if listed is None:
            kind = response.headers.get("content-type") or "no content-type"
            return Probe(
                False,
                f"GET {url} answered HTTP 200 but not with OpenAI's model list ({kind}): "
                "is upstream.url an OpenAI-compatible base URL, /v1 included?",
            )
        model = self.spec.model
        if model and listed and model not in listed:
            return Probe(True, f"{self.spec.url} answers; it does not list model {model}.")
        return Probe(True, f"{self.spec.url} answers and serves {model or 'its models'}.")

    def generate(
        self, request: engine_pb2.GenerateRequest, *, model: str, through: Sequence[str] = ()
    ) -> UpstreamCall:
        """Start a generation of `model` for a request that went through the daemons
        `through` (`blazar.api.via`; this one is added); iterate the call for its
        chunks, cancel it to stop. Raises INVALID_ARGUMENT for what the upstream cannot
        be asked for; a request that went through too many daemons fails as it streams."""
        route, body = upstream_convert.request_body(request, model=model)
        return UpstreamCall(self, f"{self.spec.url}/{route}", body, through=through)

    async def _stream(
        self, url: str, body: dict[str, object], through: Sequence[str]
    ) -> AsyncGenerator[inference_pb2.Chunk, None]:
        self._streaming += 1
        try:
            # Closed with this one (a caller that leaves ends the upstream's generation).
            async with contextlib.aclosing(self._translated(url, body, through)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._streaming -= 1
            if self._retired and not self._streaming:
                await self.close()

    async def _translated(
        self, url: str, body: dict[str, object], through: Sequence[str]
    ) -> AsyncGenerator[inference_pb2.Chunk, None]:
        limit = body.get("max_tokens")
        translator = upstream_convert.StreamTranslator(
            max_tokens=limit if isinstance(limit, int) else None
        )
        sent = time.monotonic()
        first: float | None = None
        key = self._key()
        headers = self._headers(key, through)
        try:
            async with self._http.stream("POST", url, json=body, headers=headers) as answer:
                if answer.status_code != 200:
                    text = (await _head(answer, MAX_ERROR_BYTES)).decode(errors="replace")
                    hint = upstream_convert.retry_after_ms(
                        answer.headers.get("retry-after"), now=datetime.datetime.now(datetime.UTC)
                    )
                    raise upstream_convert.http_error(answer.status_code, text, retry_after_ms=hint)
                done = False
                # The last event (or the request): keep-alive comments are bytes, which
                # reset httpx's read timeout, but no answer; an upstream that sends
                # nothing else is as silent as one that sends nothing.
                heard = sent
                async for line in _lines(answer):
                    if not line.startswith("data:"):
                        if time.monotonic() - heard > self.spec.timeouts.first_byte_s:
                            raise errors.Unavailable(
                                f"The upstream server {url}: no event within the first-byte "
                                "timeout (only keep-alive comments)."
                            )
                        continue
                    heard = time.monotonic()
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise errors.Unavailable(
                            f"The upstream server sent an event that is not JSON: {data[:200]}"
                        ) from None
                    for chunk in translator.feed(event):
                        if first is None:
                            first = time.monotonic()
                        yield chunk
                    if translator.overran:
                        break  # leaving closes the connection: the upstream stops
                    if translator.finish_reason is not None and translator.usage:
                        # The usage (asked for with include_usage) comes last, after the
                        # finish reason: the answer is whole, whatever follows or not.
                        break
                cut = translator.incomplete(
                    done=done, content_type=answer.headers.get("content-type", "")
                )
                if cut is not None:
                    raise cut
        except httpx.HTTPError as exc:
            raise errors.Unavailable(f"The upstream server {url}: {_describe(exc)}.") from None
        except errors.BlazarError as err:
            # What the upstream said (its error answer or event) may quote the key.
            clean = upstream_convert.redacted(err, key)
            if clean is err:
                raise
            raise clean from None
        end = time.monotonic()
        yield translator.finish(
            prefill_s=(first or end) - sent, decode_s=end - first if first is not None else 0.0
        )

    async def retire(self) -> None:
        """No longer in use: close now, or when the generations streaming end."""
        self._retired = True
        if not self._streaming:
            await self.close()

    async def close(self) -> None:
        await self._http.aclose()


class UpstreamCall:
    """One generation on an upstream, shaped as an engine's Generate call."""

    def __init__(
        self,
        client: UpstreamClient,
        url: str,
        body: dict[str, object],
        *,
        through: Sequence[str] = (),
    ) -> None:
        self._stream = client._stream(url, body, through)
        self._closing: asyncio.Task[None] | None = None

    def __aiter__(self) -> AsyncIterator[inference_pb2.Chunk]:
        return self._stream

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        """None: an upstream says what its cache held only in its usage, at the end."""
        return ()

    def cancel(self) -> bool:
        """Close the upstream's connection (it frees its slot); a no-op once ended."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close())
        return True

    async def _close(self) -> None:
        await self._stream.aclose()


async def _head(answer: httpx.Response, limit: int) -> bytes:
    """The first `limit` bytes of `answer`'s body, the rest left unread (the connection
    closes with the answer): an upstream's error page or model list of any size would
    otherwise be held whole by the daemon."""
    head = bytearray()
    async for data in answer.aiter_bytes():
        head += data
        if len(head) >= limit:
            break
    return bytes(head[:limit])


def _model_ids(answer: bytes) -> list[object] | None:
    """The ids of an OpenAI model list (`{"data": [{"id": ...}, ...]}`); None when the
    answer is not one (a web page, another API, one cut at MAX_EVENT_BYTES)."""
    try:
        body = json.loads(answer)
    except ValueError:
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return [m.get("id") for m in data if isinstance(m, dict)]


async def _lines(answer: httpx.Response) -> AsyncIterator[str]:
    """The answer's lines, none longer than MAX_EVENT_BYTES: an upstream that sends
    one without end would otherwise have the daemon hold all of it."""
    buffer = bytearray()
    async for data in answer.aiter_bytes():
        buffer += data
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            yield buffer[start:end].rstrip(b"\r").decode(errors="replace")
            start = end + 1
        del buffer[:start]
        if len(buffer) > MAX_EVENT_BYTES:
            raise errors.Unavailable(
                f"The upstream server sent a line of more than {MAX_EVENT_BYTES} bytes, "
                "more than any event of an answer holds."
            )
    if buffer:
        yield buffer.rstrip(b"\r").decode(errors="replace")


def _describe(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return "no connection within the connect timeout"
    if isinstance(exc, httpx.ReadTimeout):
        return "no answer within the first-byte timeout"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc})"
    return f"{type(exc).__name__} ({exc})"


class UpstreamPool:
    """One client per upstream spec, reused by every request to it."""

    def __init__(
        self, *, keys: Path | None = None, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        """`keys`: the daemon's keys directory ($BLAZAR_HOME/keys), where `file:` keys
        are read (None: none can be); `transport`: the clients' (see `UpstreamClient`)."""
        self._keys = keys
        self._transport = transport
        self._clients: dict[str, UpstreamClient] = {}

    def client(self, spec: Upstream) -> UpstreamClient:
        key = spec.model_dump_json()
        found = self._clients.get(key)
        if found is None:
            found = self._clients[key] = UpstreamClient(
                spec, keys=self._keys, transport=self._transport
            )
        return found

    async def probe(self, spec: Upstream) -> Probe:
        """Probe `spec`'s upstream through its client."""
        return await self.client(spec).probe()

    async def retain(self, specs: Iterable[Upstream]) -> None:
        """Retire the clients of specs no longer in use (each closes once the
        generations streaming through it end)."""
        keep = {spec.model_dump_json() for spec in specs}
        # All out of the pool before the first await: a retain that runs meanwhile
        # finds none of them to retire again.
        gone = [self._clients.pop(k) for k in list(self._clients) if k not in keep]
        for client in gone:
            await client.retire()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
