"""TLS from PEM files: the daemon's certificate for its TCP listeners (the HTTP shim and
gRPC), and the certificate authority a client trusts to reach them.

Files are read and checked once, where they are named (`serve --tls-cert/--tls-key`,
the CLI's `--tls-ca`), so that a missing file, a key that is not the certificate's or
a file that is not PEM ends the command with one line (InvalidRequest) before anything
listens. The daemon's Unix sockets (Control, engines) stay plain: only their owner can
reach them, and nothing of them crosses a wire.

The HTTP shim reaches the data plane over the daemon's own TCP listener, so with TLS on
that hop speaks TLS too (`Certificate.loopback_channel`): it trusts the daemon's own
certificate chain, and asks for a name the leaf certificate holds, since the address
it dials (127.0.0.1, or 0.0.0.0 for a daemon listening everywhere) need not be one.
"""

from __future__ import annotations

import _ssl
import contextlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from blazar.api import errors

# The channel option gRPC checks the server's certificate against instead of the
# dialed host.
TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise errors.InvalidRequest(f"{flag}: cannot read {path}: {exc.strerror}") from None


def _why(exc: ssl.SSLError) -> str:
    """What OpenSSL's refusal means, in words (its own are "PEM lib (_ssl.c:3905)")."""
    if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
        return "the key is not the certificate's"
    return "not a PEM certificate chain and its unencrypted private key"


def names(cert: Path) -> list[str]:
    """The names the first (leaf) certificate in `cert` answers to: its DNS names, then
    its IP addresses, then its common name. Read with the ssl module's own decoder (the
    only X.509 parser in the standard library; `cryptography` is not a dependency)."""
    decode: Any = getattr(_ssl, "_test_decode_cert", None)
    if decode is None:
        return []
    try:
        info: dict[str, Any] = decode(str(cert))
    except (ssl.SSLError, OSError):
        return []
    alt = info.get("subjectAltName", ())
    found = [value for kind, value in alt if kind == "DNS" and "*" not in value]
    found += [value for kind, value in alt if kind == "IP Address"]
    for rdn in info.get("subject", ()):
        found += [value for key, value in rdn if key == "commonName"]
    return found


@dataclass(frozen=True)
class Certificate:
    """The daemon's certificate chain and private key, as read and checked by `load`."""

    cert_path: Path
    key_path: Path
    chain: bytes
    key: bytes
    # A name the leaf answers to; "" when none could be read (the shim then dials by
    # address, which works when the certificate names it).
    name: str

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.chain)])

    def loopback_channel(self) -> tuple[grpc.ChannelCredentials, Sequence[tuple[str, str]]]:
        """Credentials and options for a channel from this host to the daemon itself."""
        options = ((TARGET_NAME_OVERRIDE, self.name),) if self.name else ()
        return grpc.ssl_channel_credentials(root_certificates=self.chain), options


def load(cert: Path, key: Path) -> Certificate:
    """The certificate chain in `cert` and its private key in `key` (PEM, key
    unencrypted); InvalidRequest with one line naming the flag and the problem."""
    chain = _read(cert, "--tls-cert")
    secret = _read(key, "--tls-key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # Checks both files are PEM and the key is the certificate's.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        raise errors.InvalidRequest(f"--tls-cert {cert}, --tls-key {key}: {_why(exc)}") from None
    except OSError as exc:
        raise errors.InvalidRequest(f"--tls-cert/--tls-key: {exc.strerror or exc}") from None
    found = names(cert)
    return Certificate(
        cert_path=cert, key_path=key, chain=chain, key=secret, name=found[0] if found else ""
    )


def authority(ca: Path, *, flag: str = "--tls-ca") -> grpc.ChannelCredentials:
    """Channel credentials that trust the certificate authorities in `ca` (PEM);
    InvalidRequest with one line when the file does not read or holds none."""
    roots = _read(ca, flag)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # Not PEM raises; empty or PEM without a certificate loads nothing: one check.
    with contextlib.suppress(ssl.SSLError, ValueError):
        context.load_verify_locations(cadata=roots.decode("ascii", errors="replace"))
    if not context.cert_store_stats()["x509"]:
        raise errors.InvalidRequest(f"{flag}: {ca} holds no PEM certificate to trust")
    return grpc.ssl_channel_credentials(root_certificates=roots)
