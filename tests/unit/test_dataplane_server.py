"""`blazar.dataplane.server`: the daemon's gRPC server owns its port alone."""

from __future__ import annotations

import asyncio

import pytest

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
