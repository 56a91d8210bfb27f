"""S3 over HTTPS: the endpoint's scheme, what a client trusts, and a failure said in one line
(standard library only: the control plane, the CLI's dev cluster and workers import it).

An operator whose S3 serves a certificate from a private CA gives that CA once, as the control
plane's ``TRAINYARD_S3_CA_FILE``: the control plane verifies S3 with it, and hands its PEM to the
agents at registration, which give it to workers as ``TRAINYARD_S3_CA_PEM`` (a CA certificate is
public: no credential travels). A script outside Trainyard with S3 of its own uses
``TRAINYARD_S3_CA_FILE``. Without a CA, the system's trust store. docs/security.md, "Checkpoint
storage".
"""

from __future__ import annotations

import ssl
from pathlib import Path

CA_FILE_SETTING = "TRAINYARD_S3_CA_FILE"
MAX_CA_PEM_BYTES = 64 * 1024
"""The most PEM a CA file may hold: it travels to every worker in an environment variable (a
private CA is a certificate or two, a few KiB; the system's bundle is not needed there)."""


def split_endpoint(text: str) -> tuple[str, bool | None]:
    """``host:port`` and whether the scheme says TLS: ``https://h:p`` -> (h:p, True), ``http://h:p``
    -> (h:p, False), ``h:p`` -> (h:p, None: the secure setting decides)."""
    for scheme, secure in (("https://", True), ("http://", False)):
        if text.lower().startswith(scheme):
            return text[len(scheme):].rstrip("/"), secure
    return text, None


def read_ca_pem(path: str | Path) -> str:
    """The PEM text of a CA file, checked: readable, at most MAX_CA_PEM_BYTES, at least one
    certificate that loads. ValueError in one line otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{CA_FILE_SETTING} {path} cannot be read: {exc.strerror or exc}") from exc
    if len(data) > MAX_CA_PEM_BYTES:
        raise ValueError(f"{CA_FILE_SETTING} {path} holds {len(data)} bytes, over {MAX_CA_PEM_BYTES}: give only "
                         "the CA(s) that sign the S3 server's certificate")
    text = data.decode("ascii", errors="replace")
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise ValueError(f"{CA_FILE_SETTING} {path} holds no PEM certificate")
    try:
        ssl.create_default_context(cadata=text)
    except ssl.SSLError as exc:
        raise ValueError(f"{CA_FILE_SETTING} {path} does not load as CA certificates: {exc.reason or exc}") from exc
    return text


def tls_context(ca_file: str | None = None, ca_pem: str | None = None) -> ssl.SSLContext | None:
    """What an S3 client verifies with: these CAs (a file, PEM text, or both), hostname checks on;
    None when neither is given (the client's default: the system's trust store)."""
    if not ca_file and not ca_pem:
        return None
    return ssl.create_default_context(cafile=ca_file or None, cadata=ca_pem or None)


def tls_failure(exc: BaseException, where: str) -> str | None:
    """One line saying why a TLS handshake with S3 at ``where`` failed, when ``exc`` or what it
    wraps (urllib3 keeps the ssl error in ``reason`` or ``args``) is a TLS error; None otherwise."""
    found = [e for e in _wrapped(exc) if isinstance(e, ssl.SSLError)]
    verify = next((e for e in found if isinstance(e, ssl.SSLCertVerificationError)), None)
    if verify is not None:
        return (f"S3 at {where} presented a certificate not trusted here "
                f"({verify.verify_message or verify.reason}): set {CA_FILE_SETTING} to the CA that signed it")
    if found:
        return f"TLS with S3 at {where} failed ({found[0].reason or found[0]}): is it an https endpoint?"
    return None


def _wrapped(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it wraps, breadth first (bounded: a chain may loop)."""
    out: list[BaseException] = []
    todo = [exc]
    while todo and len(out) < 20:
        e = todo.pop(0)
        if any(e is o for o in out):
            continue
        out.append(e)
        reason = getattr(e, "reason", None)
        todo += [x for x in (reason, e.__cause__, e.__context__, *e.args) if isinstance(x, BaseException)]
    return out
