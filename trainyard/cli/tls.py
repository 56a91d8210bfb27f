"""What a client of the control plane trusts (standard library only: the CLI imports it cheaply).

The control plane serves HTTPS (``trainyard server --tls-cert``; docs/security.md, "TLS"). A client
verifies its certificate against a CA file, ``--ca-file`` or ``TRAINYARD_CA_FILE``, else against the
system's trust store (not a bundle shipped with a Python package), with hostname checks on.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

CA_FILE_ENV = "TRAINYARD_CA_FILE"


def client_context(ca_file: str | Path | None = None) -> ssl.SSLContext:
    """``ca_file``'s CAs, or the system's trust store when None."""
    return ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)


def cli_context() -> ssl.SSLContext:
    """What the CLI verifies with: TRAINYARD_CA_FILE, else the system's trust store."""
    return client_context(os.environ.get(CA_FILE_ENV) or None)


def untrusted(exc: BaseException) -> str | None:
    """Why a TLS handshake failed, when ``exc`` (or what caused it) says the certificate is not
    trusted; None otherwise."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLCertVerificationError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    return (f"the server's certificate is not trusted here ({cause.verify_message or cause.reason}): "
            f"set {CA_FILE_ENV} to the CA that signed it")
