"""A fake `blazar.v1.Inference` servicer, the shim around it and golden files, for the
dialect tests.

The fake is Blazar's own gRPC boundary: it streams scripted chunks or aborts with
scripted errors through `blazar.rpc.status.abort`, exactly as the data plane does.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import uvicorn
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2_grpc

from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import errors
from blazar.rpc import status
from blazar.shim import app as shim_app


def delta(
    text: str, tokens: int = 1, *, logprobs: Sequence[inference_pb2.TokenLogprob] = ()
) -> inference_pb2.Chunk:
    return inference_pb2.Chunk(
        delta=inference_pb2.Delta(text=text, tokens=tokens, logprobs=logprobs)
    )


def lp(
    token: str, logprob: float, *top: tuple[str, float], token_id: int = 0
) -> inference_pb2.TokenLogprob:
    """A token's log-probability; alternatives as (token, logprob), best first."""
    return inference_pb2.TokenLogprob(
        id=token_id,
        token=token,
        logprob=logprob,
        bytes=token.encode(),
        top=[inference_pb2.TokenLogprob(token=t, logprob=p, bytes=t.encode()) for t, p in top],
    )


def final(
    reason: int = inference_pb2.FINISH_REASON_STOP,
    *,
    prompt: int = 7,
    completion: int = 3,
    cached: int = 0,
    prompt_logprobs: Sequence[inference_pb2.TokenLogprob] = (),
    tool_calls: int = 0,
) -> inference_pb2.Chunk:
    return inference_pb2.Chunk(
        final=inference_pb2.Final(
            tool_calls=tool_calls,
            finish_reason=reason,  # type: ignore[arg-type]
            usage=inference_pb2.Usage(
                prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
            ),
            model="lane-a",
            prompt_logprobs=prompt_logprobs,
        )
    )


# One step of a scripted stream: send a chunk, end the RPC with an error, or wait.
Step = inference_pb2.Chunk | errors.BlazarError | asyncio.Event


@dataclass
class FakeInference(inference_pb2_grpc.InferenceServicer):
    """Serves `scripts[model]`; unknown models get MODEL_NOT_FOUND like the data plane."""

    scripts: dict[str, list[Step]] = field(default_factory=dict)
    models: list[inference_pb2.ModelInfo] = field(default_factory=list)
    # What Embed answers for a model whose script holds no error.
    embeddings: inference_pb2.EmbedResponse = field(default_factory=inference_pb2.EmbedResponse)
    # What Tokenize answers for a model whose script holds no error (its count set).
    tokenized: inference_pb2.TokenizeResponse = field(
        default_factory=inference_pb2.TokenizeResponse
    )
    requests: list[Any] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    # Announce this replica in the initial metadata with the first chunk, as the data
    # plane does.
    replica: int | None = None
    # And admission's predicted first token, in milliseconds, beside the replica.
    predicted_ttft_ms: int | None = None
    # And the prompt tokens the replica's cache held, and the prompt's in all.
    prefix_reused: int | None = None
    prompt_tokens: int | None = None
    # Every KeepAlive call (loads and unloads), in order.
    keep_alives: list[inference_pb2.KeepAliveRequest] = field(default_factory=list)
    # What WatchAdmission streams, in order (None ends the stream).
    admission: asyncio.Queue[inference_pb2.AdmissionGates | None] = field(
        default_factory=asyncio.Queue
    )

    # The watcher ids WatchAdmission was opened with, in order.
    watchers: list[str] = field(default_factory=list)

    async def WatchAdmission(
        self, request: Any, context: Any
    ) -> AsyncIterator[inference_pb2.AdmissionGates]:
        self.watchers.append(request.watcher)
        while (message := await self.admission.get()) is not None:
            yield message

    async def Chat(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
        async for chunk in self._play(request, context):
            yield chunk

    async def Complete(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
        async for chunk in self._play(request, context):
            yield chunk

    async def ListModels(self, request: Any, context: Any) -> inference_pb2.ListModelsResponse:
        self.metadata.append(dict(context.invocation_metadata()))
        script = self.scripts.get("__list__", [])
        for step in script:
            if isinstance(step, errors.BlazarError):
                await status.abort(context, step)
        return inference_pb2.ListModelsResponse(models=self.models)

    async def Embed(self, request: Any, context: Any) -> inference_pb2.EmbedResponse:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if request.model not in self.scripts:
            await status.abort(context, errors.ModelNotFound.of(request.model))
        for step in self.scripts[request.model]:
            if isinstance(step, errors.BlazarError):
                await status.abort(context, step)
        return self.embeddings

    async def KeepAlive(self, request: Any, context: Any) -> inference_pb2.KeepAliveResponse:
        """A listed model's Lane is loaded or unloaded; others are MODEL_NOT_FOUND."""
        self.metadata.append(dict(context.invocation_metadata()))
        listed = {m.id: m.lane for m in self.models}
        if request.model not in listed:
            await status.abort(context, errors.ModelNotFound.of(request.model))
        self.keep_alives.append(request)
        return inference_pb2.KeepAliveResponse(lane=listed[request.model])

    async def Tokenize(self, request: Any, context: Any) -> inference_pb2.TokenizeResponse:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if request.model not in self.scripts:
            await status.abort(context, errors.ModelNotFound.of(request.model))
        for step in self.scripts[request.model]:
            if isinstance(step, errors.BlazarError):
                await status.abort(context, step)
        # As the engine answers: the count always, the tokens unless only it was asked.
        count = len(self.tokenized.tokens)
        if request.count_only:
            return inference_pb2.TokenizeResponse(count=count)
        answer = inference_pb2.TokenizeResponse()
        answer.CopyFrom(self.tokenized)
        answer.count = count
        return answer

    async def _play(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if request.model not in self.scripts:
            await status.abort(context, errors.ModelNotFound.of(request.model))
        try:
            announce = self.replica is not None
            for step in self.scripts[request.model]:
                if isinstance(step, asyncio.Event):
                    await step.wait()
                elif isinstance(step, errors.BlazarError):
                    await status.abort(context, step)
                else:
                    if announce:
                        announce = False
                        metadata = [
                            ("blazar-lane", "lane-a"),
                            ("blazar-replica", str(self.replica)),
                        ]
                        if self.prefix_reused is not None:
                            metadata.append(("blazar-prefix-reused", str(self.prefix_reused)))
                        if self.prompt_tokens is not None:
                            metadata.append(("blazar-prompt-tokens", str(self.prompt_tokens)))
                        if self.predicted_ttft_ms is not None:
                            metadata.append(
                                ("blazar-predicted-ttft-ms", str(self.predicted_ttft_ms))
                            )
                        await context.send_initial_metadata(tuple(metadata))
                    yield step
        except asyncio.CancelledError:
            self.cancelled.append(request.model)
            raise


@dataclass
class Daemon:
    fake: FakeInference
    health: Any
    target: str


@asynccontextmanager
async def fake_daemon() -> AsyncIterator[Daemon]:
    server = grpc.aio.server()
    fake = FakeInference()
    inference_pb2_grpc.add_InferenceServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Daemon(fake=fake, health=health_servicer, target=f"127.0.0.1:{port}")
    finally:
        await server.stop(grace=None)


@asynccontextmanager
async def asgi_shim(target: str) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The app in-process, and a client of it; httpx's ASGITransport does not run the
    lifespan, so we do. Bodies go as JSON (`content-type`), as every official client
    sends them."""
    app = shim_app.create_app(inference_target=target)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://shim",
            headers={"content-type": "application/json"},
        ) as client:
            yield client, app


@asynccontextmanager
async def asgi_client(target: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app in-process (`asgi_shim`)."""
    async with asgi_shim(target) as (client, _app):
        yield client


UPDATE_GOLDEN = os.environ.get("BLAZAR_UPDATE_GOLDEN") == "1"


def check_golden(path: Path, document: Any) -> None:
    """`document` must equal the JSON at `path`; BLAZAR_UPDATE_GOLDEN=1 rewrites it."""
    rendered = json.dumps(document, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered)
        return
    assert path.exists(), f"{path} is missing; run with BLAZAR_UPDATE_GOLDEN=1 to create it"
    assert json.loads(path.read_text()) == json.loads(rendered), (
        f"{path} differs; if the change is intended, rerun with BLAZAR_UPDATE_GOLDEN=1"
    )


def script_json(script: Sequence[Step]) -> list[Any]:
    out: list[Any] = []
    for step in script:
        if isinstance(step, inference_pb2.Chunk):
            out.append(json_format.MessageToDict(step, preserving_proto_field_name=True))
        elif isinstance(step, errors.BlazarError):
            out.append({"abort": type(step).__name__, "message": step.message, **step.metadata})
    return out


@asynccontextmanager
async def uvicorn_shim(target: str) -> AsyncIterator[str]:
    """A real uvicorn server on an ephemeral port; yields its base URL."""
    app = shim_app.create_app(inference_target=target)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        await poll(lambda: server.started or task.done(), what="uvicorn to start")
        assert server.started, task.exception()
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def poll(condition: Callable[[], bool], *, what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
