"""The daemon's gRPC server: Inference, Control, health checking and reflection.

Requests are limited to `blazar.rpc.limits.MAX_REQUEST_BYTES`; a larger one is refused
with INVALID_ARGUMENT (see that module for why gRPC's own limit is set higher).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from blazar._proto.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from blazar.dataplane.control import ControlService
from blazar.dataplane.inference import InferenceService
from blazar.enginehost.client import EnginePool
from blazar.rpc import limits
from blazar.store.base import Store

SERVICES = (
    inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
)


@dataclass
class DataPlane:
    server: grpc.aio.Server
    port: int
    inference: InferenceService
    health: health_aio.HealthServicer
    pool: EnginePool

    async def set_serving(self, serving: bool) -> None:
        state = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *SERVICES):
            await self.health.set(name, state)

    async def stop(self, grace: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)
        await self.inference.close()
        await self.pool.close()


async def start(*, store: Store, address: str) -> DataPlane:
    """Bind address (port 0 picks a free port) and start serving; OSError when the
    address cannot be bound (taken by another process, not local, ...)."""
    server = grpc.aio.server(
        interceptors=(limits.RequestSizeLimit(),), options=limits.SERVER_OPTIONS
    )
    pool = EnginePool()
    inference = InferenceService(store=store, pool=pool)
    inference_pb2_grpc.add_InferenceServicer_to_server(inference, server)
    control = ControlService(store=store, live=inference.live_status)
    control_pb2_grpc.add_ControlServicer_to_server(control, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            *SERVICES,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    try:
        # grpcio raises RuntimeError when it cannot bind (older releases returned 0).
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        # Stopped here, on the running loop: left to the garbage collector, the server
        # would try to shut down on a closed loop and print a traceback.
        await server.stop(None)
        raise OSError(f"cannot bind gRPC address {address}")
    await server.start()
    plane = DataPlane(server=server, port=port, inference=inference, health=health, pool=pool)
    await plane.set_serving(True)
    return plane
