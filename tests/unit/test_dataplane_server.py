"""`blazar.dataplane.server`: the daemon's gRPC server owns its port alone."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from blazar._proto.v1 import inference_pb2
from blazar.dataplane import server
from blazar.store.memory import MemoryStore


def test_a_second_server_cannot_bind_a_port_in_use() -> None:
    async def main() -> None:
        first = await server.start(store=MemoryStore(), address="127.0.0.1:0")
        try:
            # grpcio's default SO_REUSEPORT would let this bind and share the port.
            with pytest.raises(OSError, match=f"cannot bind gRPC address 127.0.0.1:{first.port}"):
                await server.start(store=MemoryStore(), address=f"127.0.0.1:{first.port}")
        finally:
            await first.stop(grace=0)

    asyncio.run(main())


def test_a_request_protobuf_cannot_parse_is_invalid_argument_not_unknown() -> None:
    """A string field that is not UTF-8 (a C++ or hand-made client can send one) was
    answered UNKNOWN by gRPC's own decoding; the request is read before any handler."""
    good = inference_pb2.CompleteRequest(model="nope", prompt="AB").SerializeToString()
    bad = good.replace(b"AB", b"\xff\xfe")
    tokenize = inference_pb2.TokenizeRequest(model="nope", text="AB").SerializeToString()

    async def main() -> None:
        running = await server.start(store=MemoryStore(), address="127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                complete = channel.unary_stream("/blazar.v1.Inference/Complete")
                unary = channel.unary_unary("/blazar.v1.Inference/Tokenize")
                codes = []
                for call in (
                    lambda: _drain(complete(good)),
                    lambda: _drain(complete(bad)),
                    lambda: unary(tokenize.replace(b"AB", b"\xc3\x28")),
                    lambda: _drain(complete(bad + b"\x00" * (5 * 2**20))),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call()
                    codes.append((caught.value.code(), (caught.value.details() or "")[:36]))
        finally:
            await running.stop(grace=0)
        assert codes == [
            (grpc.StatusCode.NOT_FOUND, "The model 'nope' does not exist."),
            (grpc.StatusCode.INVALID_ARGUMENT, "The request is not a valid message: "),
            (grpc.StatusCode.INVALID_ARGUMENT, "The request is not a valid message: "),
            # The size is checked first: bad bytes past the limit are too large.
            (grpc.StatusCode.INVALID_ARGUMENT, "The request is larger than the serve"),
        ]

    asyncio.run(main())


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


def test_health_checking_and_reflection_are_on() -> None:
    """DESIGN §6: `grpc.health.v1` answers for the server and each public service, and
    reflection lists them, so grpcurl and load balancers work without the .proto files."""

    async def main() -> tuple[list[int], set[str]]:
        running = await server.start(store=MemoryStore(), address="127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                statuses = [
                    (await health.Check(health_pb2.HealthCheckRequest(service=name))).status
                    for name in ("", "blazar.v1.Inference", "blazar.v1.Control")
                ]
                reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
                ask = reflection_pb2.ServerReflectionRequest(list_services="")
                services: set[str] = set()
                async for answer in reflect.ServerReflectionInfo(iter([ask])):
                    services |= {s.name for s in answer.list_services_response.service}
        finally:
            await running.stop(grace=0)
        return statuses, services

    statuses, services = asyncio.run(main())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 3
    assert {"blazar.v1.Inference", "blazar.v1.Control", "grpc.health.v1.Health"} <= services
