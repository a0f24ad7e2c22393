"""Throwaway certificate authorities and server certificates for TLS tests, made at test
time with the `openssl` command (the venv has no `cryptography`; tests that need these
skip where openssl is missing)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Authority:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ServerCertificate:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        pytest.skip("the openssl command is not on PATH")
    subprocess.run([exe, *args], check=True, capture_output=True, timeout=30)


def _new_key(path: Path) -> None:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
    )


def authority(directory: Path, name: str) -> Authority:
    """A self-signed CA named `name`, valid for a day."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _new_key(key)
    _openssl(
        "req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", "1",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return Authority(cert=cert, key=key)


def server(
    directory: Path, ca: Authority, *, names: list[str], common_name: str = "blazar"
) -> ServerCertificate:
    """A server certificate signed by `ca` for `names` (DNS names, or IP addresses)."""
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.pem"
    ext = directory / "server.ext"
    alt = ",".join(f"IP:{n}" if n.replace(".", "").isdigit() else f"DNS:{n}" for n in names)
    ext.write_text(
        f"subjectAltName={alt}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    _new_key(key)
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={common_name}")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
        "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext),
    )  # fmt: skip
    return ServerCertificate(cert=cert, key=key)
