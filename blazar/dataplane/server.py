"""The daemon's gRPC server: Inference, Control, health checking and reflection.

Who may call what is `blazar.dataplane.access`'s to say; every call passes its
interceptor first. Besides its TCP address the server may listen on a Unix socket
(`control_socket`), made 0600: Control's home on this host (see `access`). With
`credentials` the TCP address speaks TLS only; the Unix socket stays plain.

Requests are limited to `blazar.rpc.limits.MAX_REQUEST_BYTES`; a larger one is refused
with INVALID_ARGUMENT (see that module for why gRPC's own limit is set higher).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from blazar._proto.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from blazar.dataplane import access as access_
from blazar.dataplane.control import ControlService, EngineSamples
from blazar.dataplane.inference import InferenceService
from blazar.enginehost.activity import Activity
from blazar.enginehost.client import EnginePool
from blazar.enginehost.upstream import UpstreamPool
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
    control: ControlService
    health: health_aio.HealthServicer
    pool: EnginePool
    access: access_.Access

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
        # Before the server's stop, which cancels every call still open after `grace`
        # with gRPC's own "Cancelling all calls": a waiting request hears why, and that
        # it may retry, and goes at once rather than after the grace period.
        self.inference.refuse_waiting()
        # Likewise a `get -w` or `logs -f` hears that the daemon stops, and the stop
        # does not wait out the grace period for streams that never end by themselves.
        self.control.close()
        await self.server.stop(grace)
        await self.inference.close()
        await self.pool.close()


# A Unix socket's path is at most this long (sun_path, less its terminating NUL).
MAX_SOCKET_PATH = 107


async def start(
    *,
    store: Store,
    address: str,
    access: access_.Access | None = None,
    control_socket: Path | None = None,
    activity: Activity | None = None,
    log_dir: Path | None = None,
    engines: EngineSamples | None = None,
    credentials: grpc.ServerCredentials | None = None,
    max_concurrent_rpcs: int = limits.MAX_CONCURRENT_RPCS,
    upstreams: UpstreamPool | None = None,
) -> DataPlane:
    """Bind address (port 0 picks a free port), and `control_socket` if given, and start
    serving; OSError when either cannot be bound (taken by another process, not local,
    a socket path too long, ...). Without `access`, everything is open to everyone
    (`Access.open`: for tests and tools; the daemon passes its own)."""
    access = access if access is not None else access_.Access.open()
    if control_socket is not None and len(os.fsencode(control_socket)) > MAX_SOCKET_PATH:
        raise OSError(
            f"the Unix socket path {control_socket} is longer than {MAX_SOCKET_PATH} bytes"
        )
    server = grpc.aio.server(
        interceptors=(access_.AccessInterceptor(access), limits.RequestSizeLimit()),
        options=limits.SERVER_OPTIONS,
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    pool = EnginePool()
    inference = InferenceService(
        store=store, pool=pool, access=access, activity=activity, upstreams=upstreams
    )
    inference_pb2_grpc.add_InferenceServicer_to_server(inference, server)
    control = ControlService(
        store=store, live=inference.live_status, log_dir=log_dir, engines=engines
    )
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
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port != 0 and control_socket is not None:
        try:
            bound = server.add_insecure_port(f"unix:{control_socket}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            await server.stop(None)
            raise OSError(f"cannot bind the Unix socket {control_socket}")
    if port == 0:
        # Stopped here, on the running loop: left to the garbage collector, the server
        # would try to shut down on a closed loop and print a traceback.
        await server.stop(None)
        raise OSError(f"cannot bind gRPC address {address}")
    await server.start()
    if control_socket is not None:
        # Its owner's alone, whatever the umask (the home around it is 0700 too).
        os.chmod(control_socket, 0o600)
    plane = DataPlane(
        server=server,
        port=port,
        inference=inference,
        control=control,
        health=health,
        pool=pool,
        access=access,
    )
    await plane.set_serving(True)
    return plane
