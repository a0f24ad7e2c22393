"""The data plane's relay against fake engines on real Unix sockets (Blazar's own
boundary): a replica that refuses before its first chunk is skipped, and every request
is counted once by its outcome."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blazar._proto.engine.v1 import engine_pb2_grpc
from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import errors, tenants
from blazar.api.kinds import (
    Kind,
    Lane,
    LaneSpec,
    LaneStatus,
    Model,
    ModelSpec,
    ModelStatus,
    ReplicaStatus,
    SLOPolicy,
    SLOPolicySpec,
)
from blazar.api.meta import ObjectMeta
from blazar.dataplane import access, admission, dispatcher, prefixes, routing, server, unqueued
from blazar.enginehost import client
from blazar.enginehost.activity import Activity, Keep
from blazar.rpc import status
from blazar.store.memory import MemoryStore
from tests.unit import helpers


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(
        self, *, refuse: bool, text: str, hang: bool = False, die: bool = False, stall: bool = False
    ) -> None:
        self.refuse = refuse
        self.text = text
        # Never finish after the first chunk (a long generation).
        self.hang = hang
        # Go away after the first chunk, as a crashed engine process does.
        self.die = die
        # Answer nothing at all, as a stopped or deadlocked engine process does.
        self.stall = stall
        # Generate calls that ended by their caller's cancel.
        self.cancelled = 0
        self.server: grpc.aio.Server | None = None
        self.stopping: asyncio.Task[None] | None = None
        self.calls = 0
        # The prompts it has served, as its KV cache would hold them.
        self.served: list[str] = []
        # The Generate requests it was sent.
        self.requests: list[Any] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
        self.calls += 1
        self.requests.append(request)
        if self.refuse:
            await status.abort(context, errors.Unavailable("draining"))
        if self.stall:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        prompt = request.prompt or "".join(m.content for m in request.chat.messages)
        # A token per character of the longest prefix shared with a prompt it served.
        reused = max((shared(p, prompt) for p in self.served), default=0)
        self.served.append(prompt)
        if request.prompt == "refused":
            await status.abort(context, errors.InvalidRequest("The prompt does not fit."))
        await context.send_initial_metadata(
            (("blazar-prefix-reused", str(reused)), ("blazar-prompt-tokens", str(len(prompt))))
        )
        yield inference_pb2.Chunk(delta=inference_pb2.Delta(text=self.text, tokens=1))
        if request.prompt == "drained":
            await status.abort(context, errors.Unavailable("Drained before it finished."))
        if self.die and self.server is not None:
            await asyncio.sleep(0.1)  # the chunk goes out first
            # Not awaited here: stopping cancels this very call.
            self.stopping = asyncio.get_running_loop().create_task(self.server.stop(0))
        if self.hang or request.prompt == "hang":
            await asyncio.Event().wait()
        yield inference_pb2.Chunk(
            final=inference_pb2.Final(
                finish_reason=inference_pb2.FINISH_REASON_STOP,
                routing=inference_pb2.Routing(prefix_tokens_reused=reused),
            )
        )

    async def Embed(self, request: Any, context: Any) -> inference_pb2.EmbedResponse:
        self.calls += 1
        if self.refuse:
            await status.abort(context, errors.Unavailable("draining"))
        if self.stall:
            await asyncio.Event().wait()
        if list(request.inputs) == ["hang"]:
            await asyncio.Event().wait()
        if list(request.inputs) == ["bad"]:
            await status.abort(context, errors.InvalidRequest("Input 0 is bad."))
        return inference_pb2.EmbedResponse(
            embeddings=[inference_pb2.Embedding(values=[1.0], tokens=7) for _ in request.inputs],
            prompt_tokens=7 * len(request.inputs),
        )

    async def Tokenize(self, request: Any, context: Any) -> inference_pb2.TokenizeResponse:
        self.calls += 1
        if self.refuse:
            await status.abort(context, errors.Unavailable("draining"))
        return inference_pb2.TokenizeResponse(tokens=[1] * len(request.text))


def shared(a: str, b: str) -> int:
    """Characters of the longest common prefix of a and b."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@contextlib.asynccontextmanager
async def engines(*fakes: FakeEngine) -> AsyncIterator[list[str]]:
    directory = Path(tempfile.mkdtemp(prefix="bz-", dir="/tmp"))
    servers, sockets = [], []
    for i, fake in enumerate(fakes):
        srv = grpc.aio.server()
        fake.server = srv
        engine_pb2_grpc.add_EngineServicer_to_server(fake, srv)
        socket = str(directory / f"e{i}.sock")
        srv.add_insecure_port(f"unix:{socket}")
        await srv.start()
        servers.append(srv)
        sockets.append(socket)
    try:
        yield sockets
    finally:
        for srv in servers:
            await srv.stop(0)
        shutil.rmtree(directory, ignore_errors=True)


def lane(
    sockets: list[str],
    pids: list[int] | None = None,
    *,
    missed: list[int] | None = None,
    slo_policy: str | None = None,
) -> Lane:
    """Lane "l" whose Ready replicas are at `sockets` (with the health checks each
    missed in a row: `missed`)."""
    pids = pids or [100 + i for i in range(len(sockets))]
    missed = missed or [0] * len(sockets)
    return Lane(
        metadata=ObjectMeta(name="l"),
        spec=LaneSpec(model="m", replicas=len(sockets), slo_policy=slo_policy),
        status=LaneStatus(
            replica_statuses=[
                ReplicaStatus(index=i, state="Ready", socket=s, pid=pid, missed_probes=m)
                for i, (s, pid, m) in enumerate(zip(sockets, pids, missed, strict=True))
            ]
        ),
    )


@dataclass
class Plane:
    stub: inference_pb2_grpc.InferenceStub
    store: MemoryStore
    sockets: list[str]
    pool: client.EnginePool


@contextlib.asynccontextmanager
async def serving(
    fakes: list[FakeEngine],
    *,
    keys: access.Access | None = None,
    activity: Activity | None = None,
    policies: tuple[SLOPolicy, ...] = (),
) -> AsyncIterator[Plane]:
    """A data plane serving lane "l", whose replicas are the fakes, with its store (and
    the keys in force, the activity ledger, and the SLOPolicies, the first of them the
    Lane's, if given)."""
    async with engines(*fakes) as sockets:
        store = MemoryStore()
        named = policies[0].metadata.name if policies else None
        store.apply_all([*policies, lane(sockets, slo_policy=named)])
        store.update_status(Kind.LANE, "l", lane(sockets).status)
        plane = await server.start(
            store=store, address="127.0.0.1:0", access=keys, activity=activity
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                yield Plane(stub, store, sockets, plane.pool)
        finally:
            await plane.stop(grace=0)


@contextlib.asynccontextmanager
async def data_plane(fakes: list[FakeEngine]) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    """A data plane serving lane "l", whose replicas are the fakes."""
    async with serving(fakes) as plane:
        yield plane.stub


async def complete(
    fakes: list[FakeEngine], prompt: str = "hi"
) -> tuple[list[inference_pb2.Chunk], Exception | None]:
    async with data_plane(fakes) as stub:
        chunks: list[inference_pb2.Chunk] = []
        try:
            async for chunk in stub.Complete(
                inference_pb2.CompleteRequest(model="l", prompt=prompt)
            ):
                chunks.append(chunk)
        except grpc.aio.AioRpcError as exc:
            return chunks, exc
        return chunks, None


def requests_counted(outcome: str) -> float:
    labels = {"lane": "l", "outcome": outcome}
    return prometheus_client.REGISTRY.get_sample_value("blazar_requests_total", labels) or 0.0


def test_a_refusing_replica_is_skipped() -> None:
    refusing, serving = FakeEngine(refuse=True, text="no"), FakeEngine(refuse=False, text="yes")
    chunks, error = asyncio.run(complete([refusing, serving]))
    assert error is None
    assert [c.delta.text for c in chunks if c.HasField("delta")] == ["yes"]
    assert chunks[-1].final.routing.replica == 1
    assert (refusing.calls, serving.calls) == (1, 1)


def test_the_replica_is_announced_before_the_first_chunk() -> None:
    async def run() -> tuple[dict[str, str], int]:
        refusing, serving = FakeEngine(refuse=True, text="no"), FakeEngine(refuse=False, text="y")
        async with data_plane([refusing, serving]) as stub:
            call = stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hang"))
            first = await call.read()
            assert first.delta.text == "y"  # the engine is still generating
            metadata = {k: str(v) for k, v in await call.initial_metadata()}
            call.cancel()
        return metadata, refusing.calls

    metadata, refused = asyncio.run(run())
    # The replica that took the request, not the one that refused it first.
    assert (metadata["blazar-lane"], metadata["blazar-replica"], refused) == ("l", "1", 1)
    assert metadata["blazar-prefix-reused"] == "0"


def test_what_the_cache_held_is_announced_before_the_first_chunk() -> None:
    """The engine's count of reused prompt tokens, and of the prompt's, sent with its
    first chunk, are in the data plane's initial metadata, before the answer ends."""

    async def run() -> tuple[dict[str, str], int]:
        engine = FakeEngine(refuse=False, text="y")
        async with data_plane([engine]) as stub:
            async for _ in stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi you")):
                pass
            call = stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi there"))
            first = await call.read()
            assert first.HasField("delta")  # the answer goes on
            metadata = {k: str(v) for k, v in await call.initial_metadata()}
            call.cancel()
        return metadata, engine.calls

    metadata, calls = asyncio.run(run())
    assert (metadata["blazar-prefix-reused"], calls) == (str(len("hi ")), 2)
    # And the prompt's length, for a dialect that starts with its usage.
    assert metadata["blazar-prompt-tokens"] == str(len("hi there"))


def test_an_engine_that_does_not_say_what_its_cache_held_announces_nothing_of_it() -> None:
    assert client.prefix_reused((("blazar-prefix-reused", b"12"),)) == 12
    assert client.prefix_reused((("blazar-prefix-reused", "7"),)) == 7
    assert client.prefix_reused((("blazar-prefix-reused", "x"),)) is None
    assert client.prefix_reused((("other", "1"),)) is None
    assert client.prefix_reused(None) is None
    assert client.prompt_tokens((("blazar-prompt-tokens", "40"),)) == 40
    assert client.prompt_tokens((("blazar-prefix-reused", "7"),)) is None


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_request_every_replica_refuses_waits_for_a_restarted_one() -> None:
    """Faults keep the queue: refused before its first chunk by every replica (dying or
    draining), the request waits; the replicas as new processes serve it."""
    fakes = [FakeEngine(refuse=True, text="a"), FakeEngine(refuse=True, text="b")]

    async def run() -> tuple[list[inference_pb2.Chunk], list[int]]:
        async with serving(fakes) as plane:
            call = plane.stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi"))
            reading = asyncio.ensure_future(call.read())
            await wait_until(lambda: [f.calls for f in fakes] == [1, 1], "both refusals")
            await asyncio.sleep(0.1)
            # Left out until they are other processes: nobody asks them again.
            assert [f.calls for f in fakes] == [1, 1] and not reading.done()
            for fake in fakes:
                fake.refuse = False
            plane.store.update_status(Kind.LANE, "l", lane(plane.sockets, [200, 201]).status)
            chunks = [await asyncio.wait_for(reading, timeout=5)]
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            return chunks, [f.calls for f in fakes]

    chunks, calls = asyncio.run(run())
    assert chunks[0].delta.text == "a" and chunks[-1].final.routing.replica == 0
    assert calls == [2, 1]


def test_a_request_whose_replica_process_died_is_served_by_its_restart() -> None:
    """The process is gone, its socket with it: the connection fails, and the request
    waits for the restarted process on the same socket, which serves it at once (the
    new process's channel does not inherit the dead one's reconnect backoff)."""
    fake = FakeEngine(refuse=False, text="a")

    async def run() -> tuple[list[inference_pb2.Chunk], float]:
        async with serving([fake]) as plane:
            assert fake.server is not None
            await fake.server.stop(0)
            call = plane.stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi"))
            reading = asyncio.ensure_future(call.read())
            await asyncio.sleep(0.3)
            assert not reading.done()
            restarted = grpc.aio.server()
            engine_pb2_grpc.add_EngineServicer_to_server(fake, restarted)
            restarted.add_insecure_port(f"unix:{plane.sockets[0]}")
            await restarted.start()
            try:
                started = time.monotonic()
                plane.store.update_status(Kind.LANE, "l", lane(plane.sockets, [200]).status)
                chunks = [await asyncio.wait_for(reading, timeout=10)]
                took = time.monotonic() - started
                while (chunk := await call.read()) is not grpc.aio.EOF:
                    chunks.append(chunk)
                return chunks, took
            finally:
                await restarted.stop(0)

    chunks, took = asyncio.run(run())
    assert chunks[0].delta.text == "a" and chunks[-1].HasField("final")
    assert took < 0.9, took  # gRPC's first reconnect backoff is 1 s


def test_a_request_held_by_a_replica_that_misses_a_health_check_goes_to_one_that_answers() -> None:
    """A stopped or deadlocked engine answers nothing until the liveness probe kills it
    (20-30 s on): once it has missed one health check, the request it holds without a
    first token goes back to the queue and the replica that answers serves it, and no
    new request goes to the silent one."""
    hung, healthy = (
        FakeEngine(refuse=False, text="a", stall=True),
        FakeEngine(refuse=False, text="b"),
    )

    async def run() -> tuple[list[inference_pb2.Chunk], inference_pb2.Chunk, float]:
        async with serving([hung, healthy]) as plane:
            call = plane.stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="x"))
            reading = asyncio.ensure_future(call.read())
            await wait_until(lambda: hung.calls == 1, "the request on the silent replica")
            await asyncio.sleep(0.2)
            assert not reading.done() and healthy.calls == 0
            started = time.monotonic()
            missed = lane(plane.sockets, missed=[1, 0]).status
            plane.store.update_status(Kind.LANE, "l", missed)
            chunks = [await asyncio.wait_for(reading, timeout=5)]
            took = time.monotonic() - started
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            await wait_until(lambda: hung.cancelled == 1, "the silent call cancelled")
            later = [
                c
                async for c in plane.stub.Complete(
                    inference_pb2.CompleteRequest(model="l", prompt="y")
                )
            ]
            return chunks, later[-1], took

    chunks, later, took = asyncio.run(run())
    assert chunks[0].delta.text == "b" and chunks[-1].final.routing.replica == 1
    assert took < 2.0, took
    assert later.final.routing.replica == 1 and (hung.calls, healthy.calls) == (1, 2)


def test_an_embedding_held_by_a_replica_that_misses_a_health_check_goes_to_one_that_answers() -> (
    None
):
    """Embedding is safe to repeat: one under way on a replica that goes silent is
    sent to the replica that answers once the silent one misses a health check, not
    when it is killed."""
    hung = FakeEngine(refuse=False, text="a", stall=True)
    healthy = FakeEngine(refuse=False, text="b")

    async def run() -> tuple[inference_pb2.EmbedResponse, float]:
        async with serving([hung, healthy]) as plane:
            call = plane.stub.Embed(inference_pb2.EmbedRequest(model="l", inputs=["x"]))
            answer = asyncio.ensure_future(call)
            await wait_until(lambda: hung.calls == 1, "the call on the silent replica")
            await asyncio.sleep(0.3)
            assert not answer.done() and healthy.calls == 0
            started = time.monotonic()
            missed = lane(plane.sockets, missed=[1, 0]).status
            plane.store.update_status(Kind.LANE, "l", missed)
            response = await asyncio.wait_for(answer, timeout=5)
            return response, time.monotonic() - started

    response, took = asyncio.run(run())
    assert response.routing.replica == 1 and healthy.calls == 1
    assert took < 2.0, took


def test_a_request_whose_only_replica_went_silent_past_its_target_is_a_503() -> None:
    """The Lane's only replica goes silent with the request on it: taken back at the
    first missed health check, the request is past its policy's TTFT target, and is
    refused as UNAVAILABLE (a replica failed) with a retry hint, not as
    RESOURCE_EXHAUSTED (load), and not only when the replica is killed."""
    hung = FakeEngine(refuse=False, text="a", stall=True)
    fast = SLOPolicy(metadata=ObjectMeta(name="fast"), spec=SLOPolicySpec(ttft_target_ms=100))

    async def run() -> tuple[grpc.aio.AioRpcError, float]:
        async with serving([hung], policies=(fast,)) as plane:
            call = plane.stub.Complete(
                inference_pb2.CompleteRequest(model="l", prompt="x"), timeout=5
            )
            reading = asyncio.ensure_future(call.read())
            await wait_until(lambda: hung.calls == 1, "the request on the silent replica")
            await asyncio.sleep(0.2)  # past its 100 ms target
            started = time.monotonic()
            plane.store.update_status(Kind.LANE, "l", lane(plane.sockets, missed=[1]).status)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await reading
            return raised.value, time.monotonic() - started

    error, took = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    assert "failed before its first token" in (error.details() or "")
    assert "ttftTargetMs" in (error.details() or "")
    assert status.from_rpc_error(error).metadata.get(errors.RETRY_AFTER_KEY)
    assert took < 2.0, took


def test_requests_for_a_lane_whose_replica_is_starting_wait_for_it() -> None:
    """A generation and an embedding that arrive while the Lane's only replica starts
    (the daemon just came up, or its engine is restarting) wait for it and are served,
    where they were refused with 503 "retry shortly"; a refusal comes only once no
    replica is on its way (the start failed)."""
    fake = FakeEngine(refuse=False, text="a")

    async def run() -> tuple[list[inference_pb2.Chunk], inference_pb2.EmbedResponse, Any]:
        async with serving([fake]) as plane:
            starting = lane(plane.sockets)
            starting.status.replica_statuses[0].state = "Starting"
            plane.store.update_status(Kind.LANE, "l", starting.status)
            await asyncio.sleep(0.2)
            call = plane.stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi"))
            reading = asyncio.ensure_future(call.read())
            embedding = asyncio.ensure_future(
                plane.stub.Embed(inference_pb2.EmbedRequest(model="l", inputs=["a"]))
            )
            await asyncio.sleep(0.3)
            assert not reading.done() and not embedding.done() and fake.calls == 0
            plane.store.update_status(Kind.LANE, "l", lane(plane.sockets).status)
            chunks = [await asyncio.wait_for(reading, timeout=5)]
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            embedded = await asyncio.wait_for(embedding, timeout=5)
            # The start failed: nothing is on its way, a new request is refused at once.
            failed = lane(plane.sockets)
            failed.status.replica_statuses[0].state = "Failed"
            plane.store.update_status(Kind.LANE, "l", failed.status)
            await asyncio.sleep(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(
                    plane.stub.Embed(inference_pb2.EmbedRequest(model="l", inputs=["a"])), 3
                )
            # Its crash back-off runs for 5 s more: a generation is refused with that
            # wait as its hint (HTTP's Retry-After), not a bare "retry shortly".
            due = datetime.now(UTC) + timedelta(seconds=5)
            failed.status.replica_statuses[0].restart_at = due
            plane.store.update_status(Kind.LANE, "l", failed.status)
            await asyncio.sleep(0.2)
            call = plane.stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi"))
            with pytest.raises(grpc.aio.AioRpcError) as backing_off:
                await asyncio.wait_for(call.read(), 3)
            return chunks, embedded, info.value, backing_off.value

    chunks, embedded, refused, backing_off = asyncio.run(run())
    assert chunks[0].delta.text == "a" and chunks[-1].HasField("final")
    assert embedded.prompt_tokens == 7
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "retry shortly" in (refused.details() or "")
    hint = status.from_rpc_error(backing_off)
    assert isinstance(hint, errors.Unavailable) and "restarted in" in hint.message
    assert 4000 < int(hint.metadata[errors.RETRY_AFTER_KEY]) <= 5000


def test_the_client_of_a_replaced_engine_process_is_closed() -> None:
    """A restarted worker gets a client of its own; its predecessor's, whose process is
    gone, is closed once the route table no longer holds that process (it stayed open
    until the daemon stopped, one more for every restart). The new one keeps serving."""
    fake = FakeEngine(refuse=False, text="a")

    async def tokenize(plane: Plane) -> None:
        await plane.stub.Tokenize(inference_pb2.TokenizeRequest(model="l", text="a"))

    def closed(engine: client.EngineClient) -> bool:
        return engine._channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN

    async def run() -> tuple[bool, bool]:
        async with serving([fake]) as plane:
            await tokenize(plane)
            old = plane.pool.client(plane.sockets[0], process=100)
            plane.store.update_status(Kind.LANE, "l", lane(plane.sockets, [200]).status)
            await asyncio.sleep(0.2)
            await tokenize(plane)
            new = plane.pool.client(plane.sockets[0], process=200)
            assert new is not old
            # Any later table (another status write) retires what it no longer holds.
            later = lane(plane.sockets, [200]).status
            later.ready_replicas = 1
            plane.store.update_status(Kind.LANE, "l", later)
            with contextlib.suppress(AssertionError):
                await wait_until(lambda: closed(old), "the old client closed", timeout=2)
            await tokenize(plane)
            return closed(old), closed(new)

    assert asyncio.run(run()) == (True, False)


def test_a_waiting_request_of_a_lane_scaled_to_zero_is_unavailable() -> None:
    async def run() -> grpc.aio.AioRpcError:
        async with serving([FakeEngine(refuse=True, text="a")]) as plane:
            call = plane.stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi"))
            reading = asyncio.ensure_future(call.read())
            await asyncio.sleep(0.2)
            paused = lane(plane.sockets)
            paused.spec.replicas = 0
            plane.store.apply_all([paused])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(reading, timeout=5)
            return info.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "scaled to zero" in (error.details() or "")


def test_a_request_to_a_lane_scaled_to_zero_while_it_drains_is_refused_at_once() -> None:
    """Scaled to `replicas: 0` while its replica still drains (the status lists it as
    Ready until the drain ends, up to the stop grace): a request that arrives then is
    refused at once with the scaled-to-zero error, as the ones already waiting were,
    rather than queued for a draining engine that refuses it (a 429 at its deadline, or
    a wait until the drain ends)."""

    async def run() -> tuple[grpc.aio.AioRpcError, float]:
        async with serving([FakeEngine(refuse=True, text="a")]) as plane:
            paused = lane(plane.sockets)
            paused.spec.replicas = 0
            plane.store.apply_all([paused])
            plane.store.update_status(Kind.LANE, "l", lane(plane.sockets).status)
            await asyncio.sleep(0.2)
            started = time.monotonic()
            call = plane.stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(call.read(), timeout=3)
            return info.value, time.monotonic() - started

    error, took = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "scaled to zero" in (error.details() or "")
    assert took < 1.0, took


def test_embed_and_tokenize_on_a_lane_scaled_to_zero_while_it_drains_say_so() -> None:
    """Embeddings and tokenizing do not queue in admission: they went straight to the
    draining replica, which refused them ("the engine is draining"), and the caller
    learnt nothing of the Lane's `replicas: 0`. They get the error generation gets, and
    the draining engine is not asked."""
    draining = FakeEngine(refuse=True, text="a")

    async def run() -> list[grpc.aio.AioRpcError]:
        async with serving([draining]) as plane:
            paused = lane(plane.sockets)
            paused.spec.replicas = 0
            plane.store.apply_all([paused])
            plane.store.update_status(Kind.LANE, "l", lane(plane.sockets).status)
            await asyncio.sleep(0.2)
            errors_seen = []
            for call in (
                plane.stub.Embed(inference_pb2.EmbedRequest(model="l", inputs=["a"])),
                plane.stub.Tokenize(inference_pb2.TokenizeRequest(model="l", text="a")),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(call, timeout=3)
                errors_seen.append(info.value)
            return errors_seen

    for error in asyncio.run(run()):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "scaled to zero" in (error.details() or ""), error.details()
    assert draining.calls == 0


def test_an_engine_lost_mid_stream_is_a_retryable_error_that_says_so() -> None:
    dying = FakeEngine(refuse=False, text="x", hang=True, die=True)
    chunks, error = asyncio.run(complete([dying]))
    assert [c.delta.text for c in chunks] == ["x"]
    assert isinstance(error, grpc.aio.AioRpcError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    # gRPC's own words ("Stream removed (Socket closed)") are not the caller's.
    assert error.details() == (
        "Lost the engine of replica 0 of Lane 'l' before this request finished; retry."
    )
    # An error the engine sent itself keeps its own words.
    chunks, error = asyncio.run(complete([FakeEngine(refuse=False, text="x")], prompt="drained"))
    assert isinstance(error, grpc.aio.AioRpcError)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "Drained before it finished.",
    )


def test_models_list_the_replicas_each_lane_asks_for() -> None:
    async def listed() -> list[tuple[str, bool, int, int, int, bool]]:
        async with data_plane([FakeEngine(refuse=False, text="x")] * 2) as stub:
            reply = await stub.ListModels(inference_pb2.ListModelsRequest())
        return [
            (m.id, m.ready, m.replicas, m.ready_replicas, m.slots, m.HasField("file"))
            for m in reply.models
        ]

    # The Model "m" is not in the store, so nothing is known of its file.
    assert asyncio.run(listed()) == [("l", True, 2, 2, 4, False)]


def test_models_list_what_the_controller_read_of_the_model_file() -> None:
    async def listed() -> inference_pb2.ModelFile:
        async with serving([FakeEngine(refuse=False, text="x")]) as plane:
            plane.store.apply_all(
                [Model(metadata=ObjectMeta(name="m"), spec=ModelSpec(source={"path": "/m.gguf"}))]
            )
            plane.store.update_status(
                Kind.MODEL,
                "m",
                ModelStatus(
                    path="/m.gguf",
                    size_bytes=253_000_000,
                    mtime_ns=1_767_225_600_123_456_789,
                    sha256="ab" * 32,
                    architecture="gemma3",
                    context_length=32768,
                    parameters={
                        "name": "Gemma 3 270m",
                        "size_label": "268M",
                        "file_type": "15",
                        "embedding_length": "640",
                        "block_count": "18",
                        "attention.head_count": "4",
                        "attention.head_count_kv": "1",
                        "has_chat_template": "true",
                    },
                ),
            )
            reply = await plane.stub.ListModels(inference_pb2.ListModelsRequest())
        (info,) = reply.models
        return info.file

    assert asyncio.run(listed()) == helpers.MODEL_FILE


def test_a_healthy_first_replica_is_used_once() -> None:
    first, second = FakeEngine(refuse=False, text="x"), FakeEngine(refuse=False, text="y")
    chunks, error = asyncio.run(complete([first, second]))
    assert error is None and (first.calls, second.calls) == (1, 0)
    assert chunks[-1].final.routing.replica == 0


def in_flight() -> float:
    return (
        prometheus_client.REGISTRY.get_sample_value("blazar_requests_in_flight", {"lane": "l"})
        or 0.0
    )


def test_a_caller_leaving_counts_as_cancelled() -> None:
    async def leave_after_first_chunk() -> None:
        async with data_plane([FakeEngine(refuse=False, text="x", hang=True)]) as stub:
            call = stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi"))
            assert (await call.read()).delta.text == "x"
            assert in_flight() == 1
            call.cancel()
            deadline = time.monotonic() + 5
            while requests_counted("cancelled") == before and time.monotonic() < deadline:
                await asyncio.sleep(0.01)

    before, ok = requests_counted("cancelled"), requests_counted("ok")
    asyncio.run(leave_after_first_chunk())
    assert requests_counted("cancelled") == before + 1
    assert in_flight() == 0
    # A finished request counts once, as ok.
    asyncio.run(complete([FakeEngine(refuse=False, text="y")]))
    assert (requests_counted("cancelled"), requests_counted("ok")) == (before + 1, ok + 1)


def test_the_tokens_a_caller_that_left_was_sent_count_as_generated() -> None:
    """blazar_completion_tokens_total counts what the engines generated, of streams
    their callers left too (as the tenant's tokens do), not only of finished ones."""

    def generated() -> float:
        labels = {"lane": "l"}
        value = prometheus_client.REGISTRY.get_sample_value(
            "blazar_completion_tokens_total", labels
        )
        return value or 0.0

    async def leave_after_first_chunk() -> None:
        async with data_plane([FakeEngine(refuse=False, text="x", hang=True)]) as stub:
            call = stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hi"))
            assert (await call.read()).delta.tokens == 1
            call.cancel()
            deadline = time.monotonic() + 5
            while generated() == before and time.monotonic() < deadline:
                await asyncio.sleep(0.01)

    before = generated()
    asyncio.run(leave_after_first_chunk())
    assert generated() == before + 1


def test_a_caller_leaving_a_stream_is_charged_the_tokens_it_was_sent() -> None:
    """Else leaving a stream before its Final escapes the tenant's tokensPerMinute: a
    tenant allowed one token a minute that leaves after its first chunk (one token, of
    a prompt prefilled) is refused its next request."""
    auth = tenants.parse(
        f"""
tenants:
  - {{name: t, keys: ["{tenants.digest("bz-t")}"], lanes: ["*"], rateLimit: {{tokensPerMinute: 1}}}}
""",
        source="test",
    )
    key = (("authorization", "Bearer bz-t"),)

    def completion_tokens() -> float:
        labels = {"tenant": "t", "kind": "completion"}
        return (
            prometheus_client.REGISTRY.get_sample_value("blazar_tenant_tokens_total", labels) or 0
        )

    async def leave_then_ask_again() -> grpc.aio.AioRpcError | None:
        fake = FakeEngine(refuse=False, text="x", hang=True)
        async with serving([fake], keys=access.Access(tenants=auth)) as plane:
            call = plane.stub.Complete(
                inference_pb2.CompleteRequest(model="l", prompt="hi"), metadata=key
            )
            assert (await call.read()).delta.text == "x"
            call.cancel()
            deadline = time.monotonic() + 5
            while completion_tokens() == before and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            again = plane.stub.Complete(
                inference_pb2.CompleteRequest(model="l", prompt="hi"), metadata=key
            )
            try:
                await again.read()
            except grpc.aio.AioRpcError as exc:
                return exc
            again.cancel()
            return None

    before = completion_tokens()
    refused = asyncio.run(leave_then_ask_again())
    assert completion_tokens() == before + 1
    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(status.from_rpc_error(refused), errors.RateLimited)


def test_a_refused_request_says_nothing_of_its_lanes_idleness() -> None:
    """A generation or an embedding its engine refuses (a prompt over the context) with
    Ollama's keep_alive 0 does not put the Lane to sleep, nor does -1 keep it awake:
    a refused request leaves nothing behind. A served one does."""

    async def keeps() -> list[Keep]:
        activity = Activity()
        async with serving([FakeEngine(refuse=False, text="x")], activity=activity) as plane:
            seen = []
            for keep_alive_s in (0.0, -1.0):
                with pytest.raises(grpc.aio.AioRpcError):
                    request = inference_pb2.CompleteRequest(
                        model="l", prompt="refused", keep_alive_s=keep_alive_s
                    )
                    async for _ in plane.stub.Complete(request):
                        pass
                seen.append(activity.keep("l"))
                with pytest.raises(grpc.aio.AioRpcError):
                    await plane.stub.Embed(
                        inference_pb2.EmbedRequest(
                            model="l", inputs=["bad"], keep_alive_s=keep_alive_s
                        )
                    )
                seen.append(activity.keep("l"))
            served = inference_pb2.CompleteRequest(model="l", prompt="hi", keep_alive_s=0)
            async for _ in plane.stub.Complete(served):
                pass
            seen.append(activity.keep("l"))
            return seen

    *refused, served = asyncio.run(keeps())
    assert refused == [Keep()] * 4
    assert served == Keep(release=True)


def test_a_session_returns_to_its_replica_while_it_has_room() -> None:
    async def run() -> list[int]:
        fakes = [FakeEngine(refuse=False, text="a"), FakeEngine(refuse=False, text="b")]
        async with data_plane(fakes) as stub:

            async def replica_of(prompt: str, session: str = "") -> int:
                request = inference_pb2.CompleteRequest(model="l", prompt=prompt, session=session)
                chunks = [c async for c in stub.Complete(request)]
                return chunks[-1].final.routing.replica

            first = await replica_of("hi", session="s")
            # Replica 0 now has a request in flight; it still has free slots.
            busy = stub.Complete(inference_pb2.CompleteRequest(model="l", prompt="hang"))
            assert (await busy.read()).delta.text == "a"
            picks = [first, await replica_of("hi", session="s"), await replica_of("hi")]
            busy.cancel()
            return picks

    # The session stays on replica 0; a request without one goes to the idle replica.
    assert asyncio.run(run()) == [0, 0, 1]


def test_a_session_key_over_256_bytes_is_invalid() -> None:
    """40 sessions of 2 MiB grew the daemon by 114 MiB before keys were bounded."""

    async def run() -> tuple[grpc.aio.AioRpcError | None, int]:
        fake = FakeEngine(refuse=False, text="x")
        async with data_plane([fake]) as stub:
            request = inference_pb2.CompleteRequest(model="l", prompt="hi", session="s" * 2**21)
            try:
                async for _ in stub.Complete(request):
                    pass
            except grpc.aio.AioRpcError as exc:
                ok = [
                    c
                    async for c in stub.Complete(
                        inference_pb2.CompleteRequest(model="l", prompt="hi", session="s" * 256)
                    )
                ]
                return exc, len(ok)
            return None, 0

    err, chunks = asyncio.run(run())
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2,097,152 bytes; at most 256" in (err.details() or "")
    assert chunks > 0


async def call(stub: inference_pb2_grpc.InferenceStub, prompt: str) -> grpc.aio.AioRpcError | None:
    try:
        async for _ in stub.Complete(inference_pb2.CompleteRequest(model="l", prompt=prompt)):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


def test_a_request_over_the_size_limit_is_invalid_not_overloaded() -> None:
    fake = FakeEngine(refuse=False, text="x")

    async def run() -> tuple[list[Any], list[grpc.aio.AioRpcError | None]]:
        async with data_plane([fake]) as stub:
            unary: list[Any] = []
            for text in ("y" * 6_000_000, "y" * 9 * 2**20):
                try:
                    await stub.Tokenize(inference_pb2.TokenizeRequest(model="l", text=text))
                except grpc.aio.AioRpcError as exc:
                    unary.append(exc)
            streams = [await call(stub, "y" * size) for size in (5_600_000, 3_500_000)]
            return unary, streams

    unary, streams = asyncio.run(run())
    over_limit, over_ceiling = unary
    refused = streams[0]
    for exc in (over_limit, refused):
        assert isinstance(exc, grpc.aio.AioRpcError)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "larger than the server accepts" in (exc.details() or "")
        assert "the limit is 4194304 bytes (4 MiB)" in (exc.details() or "")
        assert type(status.from_rpc_error(exc)) is errors.RequestTooLarge
    # Past the ceiling gRPC refuses by itself; Blazar's clients still read it as too large.
    assert over_ceiling.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert type(status.from_rpc_error(over_ceiling)) is errors.RequestTooLarge
    # Within the limit the request reaches the engine (which judges its context length).
    assert streams[1] is None
    assert fake.calls == 1


def test_the_size_limit_keeps_writer_style_streams_working() -> None:
    # grpc's health Watch writes with context.write instead of yielding.
    async def first_status() -> int:
        store = MemoryStore()
        plane = await server.start(store=store, address="127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                response = await asyncio.wait_for(call.read(), timeout=5)
                call.cancel()
                return int(response.status)
        finally:
            await plane.stop(grace=0)

    assert asyncio.run(first_status()) == health_pb2.HealthCheckResponse.SERVING


def embeddings_counted(outcome: str) -> float:
    labels = {"lane": "l", "outcome": outcome}
    value = prometheus_client.REGISTRY.get_sample_value("blazar_embedding_requests_total", labels)
    return value or 0.0


def test_embedding_requests_are_counted_by_outcome() -> None:
    def tokens() -> float:
        value = prometheus_client.REGISTRY.get_sample_value(
            "blazar_embedded_tokens_total", {"lane": "l"}
        )
        return value or 0.0

    before = (embeddings_counted("ok"), embeddings_counted("invalid_request"), tokens())

    async def run() -> grpc.aio.AioRpcError | None:
        async with data_plane([FakeEngine(refuse=False, text="x")]) as stub:
            response = await stub.Embed(inference_pb2.EmbedRequest(model="l", inputs=["a", "b"]))
            assert (response.model, response.prompt_tokens) == ("l", 14)
            try:
                await stub.Embed(inference_pb2.EmbedRequest(model="l", inputs=["bad"]))
            except grpc.aio.AioRpcError as exc:
                return exc
            return None

    refused = asyncio.run(run())
    assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = (embeddings_counted("ok"), embeddings_counted("invalid_request"), tokens())
    assert after == (before[0] + 1, before[1] + 1, before[2] + 14)


def test_an_embedding_refused_by_a_draining_replica_goes_to_the_next() -> None:
    draining, ready = FakeEngine(refuse=True, text="x"), FakeEngine(refuse=False, text="x")
    before = embeddings_counted("ok")

    async def run() -> inference_pb2.EmbedResponse:
        async with data_plane([draining, ready]) as stub:
            # Both idle: the lower index, the draining one, is asked first.
            response: inference_pb2.EmbedResponse = await stub.Embed(
                inference_pb2.EmbedRequest(model="l", inputs=["a"])
            )
            return response

    response = asyncio.run(run())
    assert response.prompt_tokens == 7
    assert (draining.calls, ready.calls) == (1, 1)
    assert embeddings_counted("ok") == before + 1
    # The replica that embedded it, not the one asked first.
    assert (response.routing.lane, response.routing.replica) == ("l", 1)


def test_an_embedding_no_replica_takes_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica turned it away and none came back as a new process in time: the
    caller is told so in Blazar's words (not gRPC's text of a failed connection)."""
    monkeypatch.setattr(unqueued, "REPLICA_RETURN_S", 0.3)

    async def run() -> tuple[grpc.aio.AioRpcError, float]:
        async with data_plane([FakeEngine(refuse=True, text="x")] * 2) as stub:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Embed(inference_pb2.EmbedRequest(model="l", inputs=["a"]))
            return info.value, time.monotonic() - started

    error, took = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "lost its replica" in (error.details() or ""), error.details()
    assert 0.3 <= took < 3.0, took


def test_embed_and_tokenize_whose_replica_died_wait_for_it_to_restart() -> None:
    """Faults keep the call, as they keep a queued generation: replica 0's process is
    gone (its socket no longer answers) and replica 1 drains. Embedding and tokenizing
    are safe to repeat, so they wait, and the replicas as new processes serve them."""
    gone, draining = FakeEngine(refuse=False, text="a"), FakeEngine(refuse=True, text="b")

    async def run() -> tuple[inference_pb2.EmbedResponse, inference_pb2.TokenizeResponse]:
        async with serving([gone, draining]) as plane:
            assert gone.server is not None
            await gone.server.stop(0)
            embedding = asyncio.ensure_future(
                plane.stub.Embed(inference_pb2.EmbedRequest(model="l", inputs=["a"]))
            )
            counting = asyncio.ensure_future(
                plane.stub.Tokenize(inference_pb2.TokenizeRequest(model="l", text="abc"))
            )
            await wait_until(lambda: draining.calls == 2, "both refused by the draining one")
            await asyncio.sleep(0.3)
            # Left out until they are other processes: nobody asks them again.
            assert draining.calls == 2 and not embedding.done() and not counting.done()
            # Replica 0 restarted on its socket; replica 1 still drains.
            restarted = grpc.aio.server()
            engine_pb2_grpc.add_EngineServicer_to_server(gone, restarted)
            restarted.add_insecure_port(f"unix:{plane.sockets[0]}")
            await restarted.start()
            try:
                plane.store.update_status(Kind.LANE, "l", lane(plane.sockets, [200, 101]).status)
                return (
                    await asyncio.wait_for(embedding, timeout=5),
                    await asyncio.wait_for(counting, timeout=5),
                )
            finally:
                await restarted.stop(0)

    embedded, counted = asyncio.run(run())
    assert (embedded.model, embedded.prompt_tokens, len(counted.tokens)) == ("l", 7, 3)
    assert (gone.calls, draining.calls) == (2, 2)


@pytest.mark.parametrize(
    ("ending", "outcome"),
    [
        # Its caller cancels the call.
        ("leaves", "cancelled"),
        # Its deadline passes: the caller did not leave (`status.cut_by_deadline`).
        ("deadline", "deadline_exceeded"),
    ],
)
def test_an_embedding_that_ends_unanswered_counts_how(ending: str, outcome: str) -> None:
    before = embeddings_counted(outcome)

    async def run() -> None:
        async with data_plane([FakeEngine(refuse=False, text="x")]) as stub:
            request = inference_pb2.EmbedRequest(model="l", inputs=["hang"])
            if ending == "deadline":
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Embed(request, timeout=0.3)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                call = stub.Embed(request, timeout=30)
                await asyncio.sleep(0.3)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            deadline = time.monotonic() + 10
            while embeddings_counted(outcome) == before and time.monotonic() < deadline:
                await asyncio.sleep(0.01)

    asyncio.run(run())
    assert embeddings_counted(outcome) == before + 1


# Whole prefix blocks of text, each conversation its own letter.
def long_text(letter: str, blocks: int = 3 * routing.MIN_PREFIX_BLOCKS) -> str:
    return letter * prefixes.BLOCK_CHARS * blocks


async def routed(
    stub: inference_pb2_grpc.InferenceStub, prompt: str, session: str = ""
) -> tuple[int, int]:
    """(replica, prefix tokens reused) of one completion."""
    request = inference_pb2.CompleteRequest(model="l", prompt=prompt, session=session)
    chunks = [c async for c in stub.Complete(request)]
    final = chunks[-1].final
    return final.routing.replica, final.routing.prefix_tokens_reused


def test_a_follow_up_is_forecast_to_prefill_only_what_its_replicas_cache_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admission hears how much of the prompt the cache of the replica it prefers holds
    (by the prefix index), so a long conversation's next turn is not forecast, and
    refused early, as a cold prompt."""
    seen: list[admission.Ticket] = []
    admit = dispatcher.LaneDispatcher.admit

    async def spy(self: dispatcher.LaneDispatcher, ticket: admission.Ticket, **kw: Any) -> Any:
        seen.append(ticket)
        return await admit(self, ticket, **kw)

    monkeypatch.setattr(dispatcher.LaneDispatcher, "admit", spy)

    async def run() -> list[tuple[int, int]]:
        fakes = [FakeEngine(refuse=False, text="x") for _ in range(2)]
        async with data_plane(fakes) as stub:
            a = long_text("a")
            return [await routed(stub, a), await routed(stub, a + " and more")]

    (first, _), (again, reused) = asyncio.run(run())
    assert again == first and reused > 0
    cold, warm = seen
    assert cold.cached_tokens == 0
    assert warm.prefer == again and 0 < warm.cached_tokens < warm.prompt_tokens
    assert warm.fresh_tokens(again) < warm.fresh_tokens(1 - again) == warm.prompt_tokens


def test_follow_ups_go_to_the_replica_that_holds_their_prefix() -> None:
    async def run() -> list[tuple[int, int]]:
        fakes = [FakeEngine(refuse=False, text="x") for _ in range(2)]
        async with data_plane(fakes) as stub:
            a, b = long_text("a"), long_text("b")
            return [
                await routed(stub, a),
                # Both idle: the replica whose cache holds less.
                await routed(stub, b),
                await routed(stub, b + " and more"),
                await routed(stub, a + " and more"),
                # A short prompt has no whole block: load, then the smaller cache.
                await routed(stub, "hi"),
            ]

    picks = asyncio.run(run())
    assert [replica for replica, _ in picks] == [0, 1, 1, 0, 0]
    assert [reused > 0 for _, reused in picks] == [False, False, True, True, False]


def test_a_conversation_follows_its_earlier_turns() -> None:
    async def run() -> list[int]:
        fakes = [FakeEngine(refuse=False, text="x") for _ in range(2)]
        async with data_plane(fakes) as stub:

            async def chat(*turns: tuple[str, str]) -> int:
                messages = [inference_pb2.Message(role=r, content=c) for r, c in turns]
                request = inference_pb2.ChatRequest(model="l", messages=messages)
                chunks = [c async for c in stub.Chat(request)]
                return chunks[-1].final.routing.replica

            first = ("user", long_text("a"))
            other = ("user", long_text("b"))
            return [
                await chat(first),
                await chat(other),
                await chat(first, ("assistant", "x"), ("user", "Go on.")),
                await chat(other, ("assistant", "x"), ("user", "Go on.")),
            ]

    assert asyncio.run(run()) == [0, 1, 0, 1]


def test_the_session_wins_over_a_prefix_held_elsewhere() -> None:
    async def run() -> list[int]:
        fakes = [FakeEngine(refuse=False, text="x") for _ in range(2)]
        async with data_plane(fakes) as stub:
            a, b = long_text("a"), long_text("b")
            return [
                (await routed(stub, a, session="s"))[0],
                (await routed(stub, b))[0],
                (await routed(stub, b + " more", session="s"))[0],
            ]

    assert asyncio.run(run()) == [0, 1, 0]


def test_a_restarted_replica_is_forgotten() -> None:
    async def run() -> list[int]:
        fakes = [FakeEngine(refuse=False, text="x") for _ in range(2)]
        async with serving(fakes) as plane:
            picks = [(await routed(plane.stub, long_text("a")))[0]]
            # Replica 0's process restarted: same index and socket, an empty cache.
            plane.store.update_status(Kind.LANE, "l", lane(plane.sockets, [200, 101]).status)
            # Both idle, neither cache holds anything: the lowest index.
            picks.append((await routed(plane.stub, long_text("b")))[0])
            # Replica 0 holds b now; a follow-up of a has no cached prefix anywhere and
            # goes to the replica caching less.
            picks.append((await routed(plane.stub, long_text("a") + " more"))[0])
            return picks

    assert asyncio.run(run()) == [0, 0, 1]


def refused_with_no_ready_replica(request: inference_pb2.CompleteRequest) -> grpc.aio.AioRpcError:
    """What a Complete on Lane "l", stored with no replica ready, is refused with."""

    async def run() -> grpc.aio.AioRpcError:
        store = MemoryStore()
        store.apply_all([Lane(metadata=ObjectMeta(name="l"), spec=LaneSpec(model="m"))])
        plane = await server.start(store=store, address="127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Complete(request).read()
                return info.value
        finally:
            await plane.stop(grace=0)

    return asyncio.run(run())


def test_an_unknown_policy_is_invalid_even_with_no_ready_replica() -> None:
    error = refused_with_no_ready_replica(
        inference_pb2.CompleteRequest(model="l", prompt="x", slo="nosuch")
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'nosuch'" in (error.details() or "")


def test_a_request_refused_for_want_of_a_ready_replica_counts_among_its_lanes() -> None:
    """The 503 of a Lane whose only replica is (re)starting is one of its requests'
    outcomes in `blazar_requests_total`, as every other refusal after the Lane is known."""
    before = requests_counted("unavailable")
    error = refused_with_no_ready_replica(inference_pb2.CompleteRequest(model="l", prompt="x"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no ready replica" in (error.details() or "")
    assert requests_counted("unavailable") == before + 1


def test_a_chat_reaches_the_engine_with_its_tools_unchanged() -> None:
    call = inference_pb2.ToolCall(id="call_1", name="f", arguments='{"x":1}')
    request = inference_pb2.ChatRequest(
        model="l",
        messages=[
            inference_pb2.Message(role="user", content="hi"),
            inference_pb2.Message(role="assistant", tool_calls=[call]),
            inference_pb2.Message(role="tool", content="2", tool_call_id="call_1", name="f"),
        ],
        tools=[inference_pb2.Tool(name="f", description="d", parameters='{"type":"object"}')],
        tool_choice=inference_pb2.ToolChoice(mode=inference_pb2.ToolChoice.MODE_NAMED, name="f"),
        parallel_tool_calls=False,
    )
    fake = FakeEngine(refuse=False, text="x")

    async def run() -> None:
        async with data_plane([fake]) as stub:
            _ = [c async for c in stub.Chat(request)]

    asyncio.run(run())
    (sent,) = fake.requests
    assert list(sent.chat.messages) == list(request.messages)
    assert list(sent.chat.tools) == list(request.tools)
    assert sent.chat.tool_choice == request.tool_choice
    assert sent.chat.HasField("parallel_tool_calls") and not sent.chat.parallel_tool_calls


def test_an_unset_parallel_tool_calls_stays_unset() -> None:
    fake = FakeEngine(refuse=False, text="x")
    request = inference_pb2.ChatRequest(
        model="l", messages=[inference_pb2.Message(role="user", content="hi")]
    )

    async def run() -> None:
        async with data_plane([fake]) as stub:
            _ = [c async for c in stub.Chat(request)]

    asyncio.run(run())
    assert not fake.requests[0].chat.HasField("parallel_tool_calls")


def test_each_tenant_has_its_own_cache_scope_and_sessions() -> None:
    """The engine is told the tenant's cache scope (it reuses a slot's cache only within
    one), and a session name one tenant used does not route another tenant's request:
    "s" of tenant a went to replica 1; b's "s", both replicas idle, goes to replica 0,
    as a session nobody used would, while a's "s" goes back to replica 1."""
    auth = tenants.parse(
        f"""
tenants:
  - {{name: a, keys: ["{tenants.digest("bz-a")}"], lanes: ["*"]}}
  - {{name: b, keys: ["{tenants.digest("bz-b")}"], lanes: ["*"]}}
""",
        source="test",
    )

    def key(tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer bz-{tenant}"),)

    async def replica_of(plane: Plane, tenant: str, prompt: str, session: str) -> str:
        request = inference_pb2.CompleteRequest(model="l", prompt=prompt, session=session)
        call = plane.stub.Complete(request, metadata=key(tenant))
        async for _ in call:
            pass
        return dict(await call.initial_metadata())["blazar-replica"]

    async def run() -> tuple[list[str], list[str]]:
        engines = [FakeEngine(refuse=False, text="x"), FakeEngine(refuse=False, text="x")]
        async with serving(engines, keys=access.Access(tenants=auth)) as plane:
            busy = plane.stub.Complete(
                inference_pb2.CompleteRequest(model="l", prompt="hang"), metadata=key("a")
            )
            assert (await busy.read()).delta.text == "x"  # replica 0 is busy with it
            first = await replica_of(plane, "a", "hi", "s")
            busy.cancel()
            await asyncio.sleep(0.2)  # its end reaches the data plane: both idle
            others = await replica_of(plane, "b", "hi", "s")
            again = await replica_of(plane, "a", "hi", "s")
            scopes = [r.cache_scope for e in engines for r in e.requests]
            return [first, others, again], scopes

    replicas, scopes = asyncio.run(run())
    assert replicas == ["1", "0", "1"]
    assert sorted(scopes) == ["a", "a", "a", "b"]


def test_retiring_keeps_a_replaced_client_whose_process_still_serves() -> None:
    """A caller routed before a restart asks for the old process's client and so swaps
    the two (the new process's client becomes the replaced one): the route table still
    holds the new process, so its client, and the calls on it, stay open."""

    async def run() -> tuple[bool, bool]:
        pool = client.EnginePool()
        new = pool.client("/nonexistent/e0.sock", process=200)
        old = pool.client("/nonexistent/e0.sock", process=100)  # a late caller's
        await pool.retire([("/nonexistent/e0.sock", 200)])
        shut = [c._channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN for c in (new, old)]
        await pool.close()
        return shut[0], shut[1]

    assert asyncio.run(run()) == (False, False)
