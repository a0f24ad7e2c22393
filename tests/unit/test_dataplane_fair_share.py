"""Fair share through the data plane (issue 19, acceptance 5): two tenants of weights
2 and 1 keep a one-slot Lane saturated; the engine serves them 2:1 within 10%.

Real gRPC, the real admission task and access checks, and a fake engine on a Unix
socket that takes a few milliseconds per request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from blazar._proto.engine.v1 import engine_pb2_grpc
from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import tenants
from blazar.api.kinds import Kind, Lane, LaneSpec, LaneStatus, ReplicaStatus
from blazar.api.meta import ObjectMeta
from blazar.dataplane import access, server
from blazar.store.memory import MemoryStore
from tests.unit.test_dataplane_relay import engines

KEYS = {"heavy": "bz-heavy", "light": "bz-light"}
AUTH = tenants.parse(
    f"""
tenants:
  - {{name: heavy, keys: ["{tenants.digest(KEYS["heavy"])}"], lanes: ["*"], weight: 2}}
  - {{name: light, keys: ["{tenants.digest(KEYS["light"])}"], lanes: ["*"]}}
""",
    source="test",
)
SERVICE_S = 0.004
SERVED = 150
# Requests each tenant keeps in flight: enough that both always have some waiting.
IN_FLIGHT = 6


class SlowEngine(engine_pb2_grpc.EngineServicer):
    """Serves one request at a time (the Lane has one slot), `SERVICE_S` each, and
    records whose it was (the prompt names the tenant)."""

    def __init__(self) -> None:
        self.served: list[str] = []
        self.server: grpc.aio.Server | None = None

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
        await asyncio.sleep(SERVICE_S)
        self.served.append(request.prompt)
        yield inference_pb2.Chunk(delta=inference_pb2.Delta(text="x", tokens=1))
        yield inference_pb2.Chunk(
            final=inference_pb2.Final(
                finish_reason=inference_pb2.FINISH_REASON_STOP,
                usage=inference_pb2.Usage(prompt_tokens=1, completion_tokens=1),
            )
        )


@contextlib.asynccontextmanager
async def one_slot_plane(engine: SlowEngine) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    """A data plane serving `AUTH`'s tenants Lane "l": one replica of one slot, ready on
    `engine`; a stub of it."""
    async with engines(engine) as sockets:  # type: ignore[arg-type]  # duck-typed servicer
        store = MemoryStore()
        lane = Lane(
            metadata=ObjectMeta(name="l"),
            spec=LaneSpec(model="m", replicas=1, slots=1),
            status=LaneStatus(
                replica_statuses=[ReplicaStatus(index=0, state="Ready", socket=sockets[0], pid=1)]
            ),
        )
        store.apply_all([lane])
        store.update_status(Kind.LANE, "l", lane.status)
        plane = await server.start(
            store=store, address="127.0.0.1:0", access=access.Access(tenants=AUTH)
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                yield inference_pb2_grpc.InferenceStub(channel)
        finally:
            await plane.stop(grace=0)


@pytest.mark.timeout(60)
def test_weights_two_to_one_give_two_to_one_service_under_saturation() -> None:
    async def main() -> Counter[str]:
        engine = SlowEngine()
        stop = asyncio.Event()
        async with one_slot_plane(engine) as stub:

            async def client(tenant: str) -> None:
                metadata = (("authorization", f"Bearer {KEYS[tenant]}"),)
                request = inference_pb2.CompleteRequest(model="l", prompt=tenant)
                while not stop.is_set():
                    async for _ in stub.Complete(request, metadata=metadata):
                        pass

            clients = [
                asyncio.create_task(client(tenant)) for tenant in KEYS for _ in range(IN_FLIGHT)
            ]
            deadline = time.monotonic() + 30
            # The first requests start before both tenants have queued: skip them.
            while len(engine.served) < SERVED + 2 * IN_FLIGHT:
                assert time.monotonic() < deadline, len(engine.served)
                await asyncio.sleep(0.01)
            stop.set()
            window = engine.served[2 * IN_FLIGHT : 2 * IN_FLIGHT + SERVED]
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
        return Counter(window)

    served = asyncio.run(main())
    assert served["heavy"] + served["light"] == SERVED
    assert served["heavy"] / served["light"] == pytest.approx(2.0, rel=0.1), served


@pytest.mark.timeout(30)
def test_the_request_log_names_the_tenant_that_made_it() -> None:
    """`request.done` and `request.failed` say whose request it was, as the refusals'
    log lines do: an operator reading one tenant's complaint must find its requests."""

    class FailingSecond(SlowEngine):
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
            if self.served:
                await context.abort(grpc.StatusCode.INTERNAL, "engine trouble")
            async for chunk in super().Generate(request, context):
                yield chunk

    async def main() -> list[dict[str, Any]]:
        async with one_slot_plane(FailingSecond()) as stub:
            with capture_logs() as logs:
                for tenant in ("heavy", "light"):
                    metadata = (("authorization", f"Bearer {KEYS[tenant]}"),)
                    request = inference_pb2.CompleteRequest(model="l", prompt=tenant)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        async for _ in stub.Complete(request, metadata=metadata):
                            pass
        return logs

    logs = asyncio.run(main())
    [done] = [line for line in logs if line["event"] == "request.done"]
    [failed] = [line for line in logs if line["event"] == "request.failed"]
    assert done["tenant"] == "heavy"
    assert failed["tenant"] == "light"


@pytest.mark.timeout(30)
def test_a_caller_that_leaves_gets_a_summary_line_running_or_queued() -> None:
    """`request.cancelled`, as `request.done` and `request.failed`: every request that
    reached the queue leaves one line, also when its caller gives up."""

    class Holding(SlowEngine):
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[inference_pb2.Chunk]:
            yield inference_pb2.Chunk(delta=inference_pb2.Delta(text="x", tokens=1))
            await asyncio.sleep(60)

    async def main() -> list[dict[str, Any]]:
        async with one_slot_plane(Holding()) as stub:
            with capture_logs() as logs:

                def call(tenant: str) -> Any:
                    metadata = (("authorization", f"Bearer {KEYS[tenant]}"),)
                    request = inference_pb2.CompleteRequest(model="l", prompt=tenant)
                    return stub.Complete(request, metadata=metadata)

                running = call("heavy")
                await running.read()  # its first chunk: it holds the one slot
                queued = call("light")
                await asyncio.sleep(0.2)
                queued.cancel()
                running.cancel()
                deadline = time.monotonic() + 10
                while sum(line["event"] == "request.cancelled" for line in logs) < 2:
                    assert time.monotonic() < deadline, logs
                    await asyncio.sleep(0.01)
        return logs

    lines = [line for line in asyncio.run(main()) if line["event"] == "request.cancelled"]
    by_tenant = {line["tenant"]: line for line in lines}
    assert by_tenant["light"]["queued"] is True and by_tenant["light"]["tokens"] == 0
    assert by_tenant["heavy"]["tokens"] == 1 and by_tenant["heavy"]["replica"] == 0
