"""What a grpc call raises for an error the daemon sent, for tests of the callers."""

from __future__ import annotations

import grpc

from blazar.api import errors
from blazar.rpc import status


class FakeRpcError(grpc.RpcError):
    """A code, details and trailing metadata, as the daemon's error sends them."""

    def __init__(self, err: errors.BlazarError) -> None:
        self._err = err

    def code(self) -> grpc.StatusCode:
        return status.grpc_code(self._err)

    def details(self) -> str:
        return self._err.message

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return status.trailing_metadata(self._err)
