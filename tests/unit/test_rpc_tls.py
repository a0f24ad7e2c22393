"""TLS from PEM files (`blazar.rpc.tls`) and the commands that take them: what reads,
what is refused in one line, and what a channel built from them reaches."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from blazar import logs
from blazar.api import errors
from blazar.cli import main
from blazar.rpc import tls
from tests import certificates


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    ca = certificates.authority(root, "test-ca")
    other = certificates.authority(root, "other-ca")
    # Only a DNS name the shim's own hop cannot dial: it must ask for it by name.
    leaf = certificates.server(root, ca, names=["blazar.test"])
    notes = root / "notes.txt"
    notes.write_text("not a certificate\n")
    return {
        "ca": ca.cert,
        "other_ca": other.cert,
        "other_key": other.key,
        "cert": leaf.cert,
        "key": leaf.key,
        "notes": notes,
        "dir": root,
    }


def test_a_certificate_and_its_key_load_with_the_leafs_name(pki: dict[str, Path]) -> None:
    cert = tls.load(pki["cert"], pki["key"])
    assert cert.name == "blazar.test"
    assert b"BEGIN CERTIFICATE" in cert.chain
    assert b"PRIVATE KEY" in cert.key


def test_names_are_dns_then_ip_then_common_name(tmp_path: Path) -> None:
    ca = certificates.authority(tmp_path, "ca")
    leaf = certificates.server(
        tmp_path, ca, names=["10.1.2.3", "a.example", "b.example"], common_name="cn.example"
    )
    assert tls.names(leaf.cert) == ["a.example", "b.example", "10.1.2.3", "cn.example"]


@pytest.mark.parametrize(
    ("cert", "key", "says"),
    [
        ("missing", "key", "--tls-cert: cannot read {missing}: No such file or directory"),
        ("cert", "missing", "--tls-key: cannot read {missing}: No such file or directory"),
        ("dir", "key", "--tls-cert: cannot read {dir}: Is a directory"),
        ("cert", "other_key", "--tls-key {other_key}: the key is not the certificate's"),
        ("notes", "key", "--tls-key {key}: not a PEM certificate chain and its unencrypted"),
        ("cert", "cert", "--tls-key {cert}: not a PEM certificate chain"),
    ],
)
def test_files_that_are_not_a_certificate_and_its_key_are_refused_in_one_line(
    pki: dict[str, Path], cert: str, key: str, says: str
) -> None:
    paths = {**pki, "missing": pki["dir"] / "missing.pem"}
    with pytest.raises(errors.InvalidRequest) as caught:
        tls.load(paths[cert], paths[key])
    message = caught.value.message
    assert "\n" not in message
    assert says.format(**paths) in message


@pytest.mark.parametrize("name", ["notes", "key", "empty"])
def test_a_ca_file_without_a_certificate_is_refused(pki: dict[str, Path], name: str) -> None:
    empty = pki["dir"] / "empty.pem"
    empty.write_text("")
    path = empty if name == "empty" else pki[name]
    with pytest.raises(errors.InvalidRequest, match="holds no PEM certificate to trust"):
        tls.authority(path)


@pytest.fixture(scope="module")
def tls_server(pki: dict[str, Path]) -> Iterator[int]:
    """A gRPC health service behind the certificate on 127.0.0.1 (port 0)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port(
        "127.0.0.1:0", tls.load(pki["cert"], pki["key"]).server_credentials()
    )
    server.start()
    yield port
    server.stop(None)


def _check(channel: grpc.Channel) -> int:
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return int(reply.status)


def test_the_loopback_channel_reaches_the_daemon_by_the_certificates_name(
    pki: dict[str, Path], tls_server: int
) -> None:
    # 127.0.0.1 is not in the certificate: only the name override lets the hop verify.
    credentials, options = tls.load(pki["cert"], pki["key"]).loopback_channel()
    channel = grpc.secure_channel(f"127.0.0.1:{tls_server}", credentials, options=options)
    assert _check(channel) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as caught:
        _check(grpc.secure_channel(f"127.0.0.1:{tls_server}", credentials))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("ca", ["other_ca", "plain"])
def test_an_untrusting_or_plaintext_client_is_refused(
    pki: dict[str, Path], tls_server: int, ca: str
) -> None:
    target = f"127.0.0.1:{tls_server}"
    options = ((tls.TARGET_NAME_OVERRIDE, "blazar.test"),)
    channel = (
        grpc.insecure_channel(target)
        if ca == "plain"
        else grpc.secure_channel(target, tls.authority(pki[ca]), options=options)
    )
    with pytest.raises(grpc.RpcError) as caught:
        _check(channel)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


# --- the commands ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tls-cert", "{cert}"], "--tls-cert needs --tls-key too"),
        (["--tls-key", "{key}"], "--tls-key needs --tls-cert too"),
        (["--tls-cert", "{cert}", "--tls-key", "{other_key}"], "the key is not the certificate's"),
        (["--tls-cert", "{dir}/nope.pem", "--tls-key", "{key}"], "--tls-cert: cannot read"),
        # TLS does not replace keys: beyond loopback, an auth file is still required.
        (
            ["--tls-cert", "{cert}", "--tls-key", "{key}", "--http", "0.0.0.0:0"],
            "--http 0.0.0.0:0 is reachable from other hosts, and this server has no API keys",
        ),
    ],
)
def test_serve_refuses_bad_tls_files_before_it_starts_anything(
    pki: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    says: str,
) -> None:
    # Logging stays as it was: configured onto capsys's stream, it would outlive it.
    monkeypatch.setattr(logs, "configure", lambda **_: None)
    home = tmp_path / "home"
    argv = ["serve", "--home", str(home), "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]
    code = main.main([*argv, *(f.format(**pki) for f in flags)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and says in err
    assert not home.exists()  # nothing was started or written


def test_the_cli_refuses_a_ca_for_the_unix_socket(
    pki: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main.main(["--server", "unix:/nowhere.sock", "--tls-ca", str(pki["ca"]), "get", "lanes"])
    assert code == 1
    assert "--tls-ca is for a daemon reached over TCP" in capsys.readouterr().err


def test_the_cli_refuses_a_ca_file_that_does_not_read(
    pki: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BLAZAR_TLS_CA", str(pki["notes"]))
    code = main.main(["--server", "127.0.0.1:1", "get", "lanes"])
    assert code == 1
    assert "BLAZAR_TLS_CA: " in capsys.readouterr().err
