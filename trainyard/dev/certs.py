"""Certificates for the control plane's HTTPS: a local certificate authority and server
certificates signed by it (``trainyard dev up``; tests), and what a client trusts.

A production cluster uses certificates from its own CA (docs/security.md, "TLS"); this is the
same thing at the scale of one machine. The CA's key stays in its directory (mode 0600) and the
CA is kept across runs, so agents and users who trust ``ca.pem`` keep trusting the cluster; the
server certificate is issued again whenever it would expire soon or names other hosts. What a
client trusts is trainyard/cli/tls.py.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 397
"""The longest validity clients (browsers) accept for a server certificate."""
RENEW_BEFORE = timedelta(days=30)


@dataclass(frozen=True)
class ServerTls:
    """Where a CA and a server certificate signed by it live (PEM files)."""

    ca_file: Path
    cert_file: Path
    """The server's certificate (clients verify it with ``ca_file``)."""
    key_file: Path


def ensure_server_tls(directory: Path, hosts: list[str], *, common_name: str = "trainyard control plane",
                      stem: str = "server") -> ServerTls:
    """A CA in ``directory`` (made once, then kept) and a server certificate for ``hosts`` (IP
    addresses or DNS names) signed by it, issued again when it is missing, expires within
    RENEW_BEFORE, or names other hosts. ``stem`` names its files (``<stem>.pem``, ``<stem>-key.pem``):
    the control plane's is ``server``; each dev node's agent has one of its own for its memory port."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    tls = ServerTls(directory / "ca.pem", directory / f"{stem}.pem", directory / f"{stem}-key.pem")
    ca_key_file = directory / "ca-key.pem"
    ca_cert, ca_key = _load_ca(tls.ca_file, ca_key_file)
    if ca_cert is None or ca_key is None:
        ca_cert, ca_key = _new_ca()
        _write(ca_key_file, _key_pem(ca_key), private=True)
        _write(tls.ca_file, _cert_pem(ca_cert))
    if not _current(tls, ca_cert, hosts):
        cert, key = _new_server_cert(ca_cert, ca_key, hosts, common_name)
        _write(tls.key_file, _key_pem(key), private=True)
        _write(tls.cert_file, _cert_pem(cert))
    return tls


def _names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _new_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainyard local CA")])
    start = datetime.now(UTC) - timedelta(minutes=5)  # a slightly slow client clock still accepts it
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _new_server_cert(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, hosts: list[str],
                     common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    start = datetime.now(UTC) - timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _load_ca(cert_file: Path, key_file: Path) -> tuple[x509.Certificate | None, ec.EllipticCurvePrivateKey | None]:
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    except (OSError, ValueError):
        return None, None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None, None
    if cert.not_valid_after_utc - RENEW_BEFORE <= datetime.now(UTC):
        return None, None
    return cert, key


def _current(tls: ServerTls, ca_cert: x509.Certificate, hosts: list[str]) -> bool:
    """The server certificate exists, is the CA's, is not about to expire and names ``hosts``."""
    try:
        cert = x509.load_pem_x509_certificate(tls.cert_file.read_bytes())
        tls.key_file.stat()
    except (OSError, ValueError):
        return False
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return (cert.issuer == ca_cert.subject
            and cert.not_valid_after_utc - RENEW_BEFORE > datetime.now(UTC)
            and set(san) == set(_names(hosts)))


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Atomically, and a private key never readable by others even for a moment."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
