"""TLS end to end (issue 19): a real daemon started with `--tls-cert/--tls-key` and an
auth file serves HTTPS and gRPC over TLS to clients that trust its CA, refuses
plaintext and clients that trust another CA, and its own shim reaches the data plane
over the TLS listener (a chat through the shim crosses that hop).

The certificate names `blazar.test` first and 127.0.0.1 second: clients dial the
address, the shim's own hop asks for the name. Generations ask for two tokens: what
the model writes does not matter here, only that the answer arrives whole. They ask
for the `batch` policy, which queues rather than refuses on a busy host.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import tenants
from tests import certificates
from tests.integration.harness import REPO, Daemon, default_fleet

pytestmark = pytest.mark.slow

LANE = "gemma3"
KEY = tenants.new_key()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    ca = certificates.authority(root, "test-ca")
    other = certificates.authority(root, "other-ca")
    leaf = certificates.server(root, ca, names=["blazar.test", "127.0.0.1"])
    auth = root / "auth.yaml"
    auth.write_text(
        textwrap.dedent(
            f"""\
            tenants:
              - name: ops
                keys: ["{tenants.digest(KEY)}"]
                lanes: ["*"]
                admin: true
                sloPolicies: ["*"]
            """
        )
    )
    return {"ca": ca.cert, "other_ca": other.cert, "cert": leaf.cert, "key": leaf.key, "auth": auth}


@pytest.fixture(scope="module")
def daemon(model_path: Path, pki: dict[str, Path]) -> Iterator[Daemon]:
    args = ["--auth-file", str(pki["auth"])]
    args += ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]
    with default_fleet(serve_args=args) as d:
        yield d


def _https(ca: Path) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=60)


def test_the_openai_client_over_https_gets_an_answer(daemon: Daemon, pki: dict[str, Path]) -> None:
    client = openai.OpenAI(
        base_url=f"https://{daemon.http}/v1", api_key=KEY, http_client=_https(pki["ca"])
    )
    with client:
        reply = client.chat.completions.create(
            model=LANE,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_headers={"x-blazar-slo": "batch"},
        )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 2
    with _https(pki["ca"]) as http:
        # The probe lists models through the shim's TLS hop with the daemon's key.
        assert http.get(f"https://{daemon.http}/readyz").json() == {"status": "ready"}


def _chat(channel: grpc.Channel) -> list[inference_pb2.Chunk]:
    request = inference_pb2.ChatRequest(
        model=LANE,
        messages=[inference_pb2.Message(role="user", content="Hi")],
        sampling=inference_pb2.Sampling(max_tokens=2),
        slo="batch",
    )
    with channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        metadata = (("authorization", f"Bearer {KEY}"),)
        return list(stub.Chat(request, metadata=metadata, timeout=60))


def test_a_grpc_client_trusting_the_ca_streams(daemon: Daemon, pki: dict[str, Path]) -> None:
    credentials = grpc.ssl_channel_credentials(pki["ca"].read_bytes())
    chunks = _chat(grpc.secure_channel(daemon.grpc, credentials))
    final = chunks[-1]
    assert final.WhichOneof("part") == "final"
    assert final.final.finish_reason in (
        inference_pb2.FINISH_REASON_STOP,
        inference_pb2.FINISH_REASON_LENGTH,
    )
    assert sum(c.delta.tokens for c in chunks[:-1]) == final.final.usage.completion_tokens


def test_plaintext_clients_are_refused(daemon: Daemon) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _chat(grpc.insecure_channel(daemon.grpc))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{daemon.http}/v1/models", headers={"authorization": f"Bearer {KEY}"})


def test_clients_trusting_another_ca_fail_verification(
    daemon: Daemon, pki: dict[str, Path]
) -> None:
    credentials = grpc.ssl_channel_credentials(pki["other_ca"].read_bytes())
    with pytest.raises(grpc.RpcError) as caught:
        _chat(grpc.secure_channel(daemon.grpc, credentials))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    with _https(pki["other_ca"]) as http, pytest.raises(httpx.ConnectError) as refused:
        http.get(f"https://{daemon.http}/healthz")
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)


def _cli(daemon: Daemon, *args: str, ca: Path | None) -> subprocess.CompletedProcess[str]:
    flags = ["--server", daemon.grpc, "--api-key", KEY]
    flags += ["--tls-ca", str(ca)] if ca is not None else []
    return subprocess.run(
        [sys.executable, "-m", "blazar.cli", *flags, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_the_cli_reaches_control_over_tls_with_the_ca(daemon: Daemon, pki: dict[str, Path]) -> None:
    listed = _cli(daemon, "get", "lanes", ca=pki["ca"])
    assert listed.returncode == 0, listed.stderr
    assert LANE in listed.stdout
    plain = _cli(daemon, "get", "lanes", ca=None)
    assert plain.returncode == 1
    assert f"cannot reach the Blazar daemon at {daemon.grpc}" in plain.stderr
    assert "(a daemon serving TLS needs --tls-ca FILE)" in plain.stderr
    # The Control socket stays plain: the harness's CLI uses it without a CA.
    assert daemon.cli("get", "lanes").returncode == 0
