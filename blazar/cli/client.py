"""The CLI's one client of the daemon's `blazar.v1.Control`: one channel per command,
typed answers, the caller's API key (if any) on every call.

The generated stub's calls return untyped values; each method here states what its
RPC answers. Errors are left as `grpc.RpcError` for `blazar.cli.main` to print.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import grpc

from blazar._proto.v1 import control_pb2, control_pb2_grpc
from blazar.api import errors, features, kinds
from blazar.cli import home
from blazar.rpc import tls

# Targets gRPC reads by a scheme of its own (name resolvers), taken as they are.
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")


def target(args: argparse.Namespace) -> str:
    """The daemon's address: --server, else the Control socket of $BLAZAR_HOME.
    InvalidRequest for a --server that is neither HOST:PORT (a port from 1 to 65535)
    nor a gRPC target with its scheme: gRPC would dial port 443 for "HOST:" or "HOST"."""
    if not args.server:
        return f"unix:{home.control_socket(home.default_home())}"
    server = str(args.server)
    if server.startswith(_SCHEMES):
        return server
    host, sep, port = server.rpartition(":")
    if not (sep and host.strip("[]") and port.isascii() and port.isdigit()) or not (
        0 < int(port) <= 65535
    ):
        raise errors.InvalidRequest(
            f"--server: '{server}' is not HOST:PORT (a port from 1 to 65535) or unix:PATH"
        )
    return server


def from_args(args: argparse.Namespace) -> ControlClient:
    """A client of the daemon the command line names, with its key (--api-key, else
    $BLAZAR_API_KEY) if any, over TLS when a CA is named for a TCP daemon, and a
    deadline on each call (--request-timeout)."""
    key = args.api_key or os.environ.get("BLAZAR_API_KEY") or None
    where = target(args)
    return ControlClient(
        where,
        api_key=key,
        credentials=credentials(args, where),
        timeout=request_timeout(args),
    )


def request_timeout(args: argparse.Namespace) -> float | None:
    """--request-timeout in seconds, as kubectl (client-go's ParseTimeout) reads it: a
    whole number of seconds, or a duration with its unit (5s, 2m, 1h); 0 or unset waits
    as long as the call takes (None)."""
    text = getattr(args, "request_timeout", None)
    if text is None:
        return None
    text = text.strip()
    try:
        if text.isascii() and text.isdigit():
            return float(text) or None
        seconds = kinds.parse_duration(text).total_seconds()
    except ValueError as exc:
        raise errors.InvalidRequest(f"--request-timeout: {exc}") from None
    return seconds or None


def credentials(args: argparse.Namespace, target: str) -> grpc.ChannelCredentials | None:
    """TLS credentials for a TCP target when a CA is named (--tls-ca, else
    $BLAZAR_TLS_CA); a Unix socket is always plain."""
    if target.startswith("unix:"):
        if args.tls_ca:
            raise errors.InvalidRequest(
                f"--tls-ca is for a daemon reached over TCP; {target} is a Unix socket, "
                "which is always plain"
            )
        return None  # $BLAZAR_TLS_CA is for TCP targets only
    if args.tls_ca:
        return tls.authority(Path(args.tls_ca))
    env = os.environ.get("BLAZAR_TLS_CA")
    return tls.authority(Path(env), flag="BLAZAR_TLS_CA") if env else None


class ControlClient:
    """Use inside `with`: leaving the block closes the channel."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
    ) -> None:
        # Each call's deadline in seconds (None: none); not a watch's or a followed
        # log's, which run until the caller stops reading.
        self.timeout = timeout
        # TLS when the daemon's TCP listener speaks it (`blazar.rpc.tls.authority`).
        self._channel = (
            grpc.secure_channel(target, credentials)
            if credentials is not None
            else grpc.insecure_channel(target)
        )
        self._target = target
        # What the daemon acts on of `features.SERVED`, once asked (`require`).
        self._features: frozenset[str] | None = None
        self._daemon_version: str | None = None
        # Over TCP, Control needs an admin tenant's key; on the Unix socket none.
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._stub = control_pb2_grpc.ControlStub(self._channel)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._channel.close()

    def apply(self, request: control_pb2.ApplyRequest) -> control_pb2.ApplyResponse:
        response: control_pb2.ApplyResponse = self._stub.Apply(
            request, metadata=self._metadata, timeout=self.timeout
        )
        return response

    def get(self, request: control_pb2.GetRequest) -> control_pb2.GetResponse:
        response: control_pb2.GetResponse = self._stub.Get(
            request, metadata=self._metadata, timeout=self.timeout
        )
        return response

    def list(self, request: control_pb2.ListRequest) -> control_pb2.ListResponse:
        response: control_pb2.ListResponse = self._stub.List(
            request, metadata=self._metadata, timeout=self.timeout
        )
        return response

    def delete(self, request: control_pb2.DeleteRequest) -> control_pb2.DeleteResponse:
        response: control_pb2.DeleteResponse = self._stub.Delete(
            request, metadata=self._metadata, timeout=self.timeout
        )
        return response

    def events(self, request: control_pb2.EventsRequest) -> control_pb2.EventsResponse:
        response: control_pb2.EventsResponse = self._stub.Events(
            request, metadata=self._metadata, timeout=self.timeout
        )
        return response

    def top(self, request: control_pb2.TopRequest) -> control_pb2.TopResponse:
        response: control_pb2.TopResponse = self._stub.Top(
            request, metadata=self._metadata, timeout=self.timeout
        )
        return response

    def version(self) -> control_pb2.VersionResponse | None:
        """The daemon's version and features; None from one that predates `Version`
        (UNIMPLEMENTED), which has none of the features."""
        try:
            response: control_pb2.VersionResponse = self._stub.Version(
                control_pb2.VersionRequest(), metadata=self._metadata, timeout=self.timeout
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
        return response

    def require(self, feature: str, *, used: str) -> None:
        """InvalidRequest, before anything is sent, unless the daemon acts on `feature`
        (`blazar.api.features`), which `used` (what the command line asked for) needs:
        an older daemon would drop it without a word."""
        if self._features is None:
            answer = self.version()
            self._features = frozenset(answer.features) if answer is not None else frozenset()
            self._daemon_version = answer.version if answer is not None else None
        if feature in self._features:
            return
        runs = (
            f"runs Blazar {self._daemon_version}"
            if self._daemon_version
            else "runs a Blazar older than this one"
        )
        raise errors.InvalidRequest(
            f"the Blazar daemon at {self._target} does not act on {used}: it {runs}, and "
            f"would ignore it (this CLI is Blazar {features.version()}). Restart the "
            f"daemon to run this version, or leave {used} out."
        )

    def watch(self, request: control_pb2.WatchRequest) -> Iterator[control_pb2.WatchEvent]:
        """Changes as they happen; the stream is cancelled when the caller stops reading
        (Ctrl-C included) or leaves the `with` block."""
        stream = self._stub.Watch(request, metadata=self._metadata)
        try:
            yield from stream
        finally:
            stream.cancel()

    def logs(self, request: control_pb2.LogsRequest) -> Iterator[bytes]:
        """A replica's log output as it arrives; cancelled as `watch` is. Without
        `follow`, the whole answer is due within the call's deadline."""
        timeout = None if request.follow else self.timeout
        stream = self._stub.Logs(request, metadata=self._metadata, timeout=timeout)
        try:
            for chunk in stream:
                yield chunk.data
        finally:
            stream.cancel()
