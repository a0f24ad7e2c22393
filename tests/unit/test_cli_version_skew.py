"""A CLI newer than its daemon (the package upgraded, the daemon not yet restarted)
refuses what the daemon would drop without a word, before it sends anything: `logs
--tail` (a field the old daemon's proto lacks) and an apply's resourceVersion
precondition (a meaning the old daemon lacks). `version` says which is which.

A fake `blazar.v1.Control` over real gRPC: the daemon's side is Blazar's own boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from blazar._proto.v1 import control_pb2, control_pb2_grpc
from blazar.api import features
from blazar.cli import main
from blazar.dataplane.control import ControlService
from blazar.store.memory import MemoryStore

LANE = (
    "apiVersion: blazar.dev/v1alpha1\nkind: Lane\n"
    "metadata: {{name: x{version}}}\nspec: {{model: m}}\n"
)


class Daemon(control_pb2_grpc.ControlServicer):
    """Answers Logs and Apply, recording what it was sent; `served`: the features its
    Version names, None for a daemon that predates Version (UNIMPLEMENTED)."""

    def __init__(self, served: Sequence[str] | None) -> None:
        self.served = served
        self.calls: list[str] = []

    def Version(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self.served is None:
            return super().Version(request, context)
        return control_pb2.VersionResponse(version="9.9.9", features=self.served)

    def Logs(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.calls.append("Logs")
        yield control_pb2.LogChunk(data=b"the whole log\n")

    def Apply(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append("Apply")
        return control_pb2.ApplyResponse(
            results=[control_pb2.ApplyResult(kind="Lane", name="x", action="configured")]
        )


@contextmanager
def daemon(served: Sequence[str] | None) -> Iterator[tuple[Daemon, str]]:
    fake = Daemon(served)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    control_pb2_grpc.add_ControlServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


OLD_DAEMONS = [
    pytest.param(None, id="predates-Version"),
    pytest.param((), id="names-no-feature"),
]


@pytest.mark.parametrize("served", OLD_DAEMONS)
def test_logs_tail_is_refused_by_a_daemon_that_would_print_the_whole_log(
    served: Sequence[str] | None, capsys: pytest.CaptureFixture[str]
) -> None:
    with daemon(served) as (fake, address):
        status = main.main(["--server", address, "logs", "lane/x", "--tail", "5"])
    assert status == 1
    assert fake.calls == []
    err = capsys.readouterr().err
    assert f"the Blazar daemon at {address} does not act on --tail" in err
    assert "Restart the daemon to run this version, or leave --tail out." in err


@pytest.mark.parametrize("served", OLD_DAEMONS)
def test_a_precondition_is_refused_by_a_daemon_that_would_overwrite_anyway(
    served: Sequence[str] | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "lane.yaml"
    manifest.write_text(LANE.format(version=", resourceVersion: 12"))
    with daemon(served) as (fake, address):
        status = main.main(["--server", address, "apply", "-f", str(manifest)])
        assert main.main(["--server", address, "diff", "-f", str(manifest)]) == 2
    assert status == 1
    assert fake.calls == []
    assert "does not act on metadata.resourceVersion" in capsys.readouterr().err


@pytest.mark.parametrize("served", OLD_DAEMONS)
def test_an_old_daemon_still_serves_what_it_knows(
    served: Sequence[str] | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "lane.yaml"
    manifest.write_text(LANE.format(version=""))
    with daemon(served) as (fake, address):
        assert main.main(["--server", address, "logs", "lane/x"]) == 0
        assert main.main(["--server", address, "apply", "-f", str(manifest)]) == 0
    assert fake.calls == ["Logs", "Apply"]
    assert "the whole log" in capsys.readouterr().out


def test_a_daemon_that_acts_on_the_features_is_sent_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "lane.yaml"
    manifest.write_text(LANE.format(version=", resourceVersion: 12"))
    with daemon(features.SERVED) as (fake, address):
        assert main.main(["--server", address, "logs", "lane/x", "--tail", "5"]) == 0
        assert main.main(["--server", address, "apply", "-f", str(manifest)]) == 0
    assert fake.calls == ["Logs", "Apply"]


@pytest.mark.parametrize(
    ("served", "printed"),
    [
        (
            None,
            "Server Version: older than this CLI (it cannot tell its version)\n"
            f"The daemon does not act on: {', '.join(features.SERVED)}; ",
        ),
        (
            (features.LOGS_TAIL,),
            f"Server Version: 9.9.9\nThe daemon does not act on: {features.APPLY_PRECONDITION}; ",
        ),
        (features.SERVED, "Server Version: 9.9.9\n"),
    ],
)
def test_version_prints_both_sides_and_what_the_daemon_lacks(
    served: Sequence[str] | None, printed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with daemon(served) as (_, address):
        assert main.main(["--server", address, "version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Client Version: {features.version()}\n{printed}")
    if served == features.SERVED:
        assert "does not act" not in out


def test_version_client_calls_no_daemon(capsys: pytest.CaptureFixture[str]) -> None:
    assert main.main(["--server", "127.0.0.1:1", "version", "--client"]) == 0
    assert capsys.readouterr().out == f"Client Version: {features.version()}\n"


def test_the_daemon_names_every_feature_of_this_version() -> None:
    service = ControlService(store=MemoryStore())
    answer = asyncio.run(service.Version(control_pb2.VersionRequest(), None))
    assert answer.version == features.version()
    assert list(answer.features) == list(features.SERVED)
