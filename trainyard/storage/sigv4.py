"""AWS Signature V4 query presigning (standard library only): a URL that lets whoever holds it
make one kind of request on one object until it expires, without any credential.

The MinIO SDK presigns too, but signs only the ``host`` header; these URLs also sign headers the
request must then carry as given (``If-None-Match: *`` makes a PUT create-only: it can never
overwrite an object, docs/security.md), and query parameters (a multipart upload's id and part
number). Signing needs no network: the control plane mints URLs offline.

Reference: "Authenticating Requests: Using Query Parameters (AWS Signature Version 4)" in the S3
API documentation; the payload is ``UNSIGNED-PAYLOAD``, as in every presigned URL.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from datetime import UTC, datetime
from urllib.parse import quote

MAX_EXPIRES_S = 7 * 24 * 3600
"""The longest validity S3 accepts for a presigned URL."""

_ALGORITHM = "AWS4-HMAC-SHA256"


def _uri_encode(text: str, *, keep_slash: bool) -> str:
    return quote(text, safe="-_.~/" if keep_slash else "-_.~")


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def presign(
    *,
    method: str,
    endpoint: str,
    bucket: str,
    key: str,
    access_key: str,
    secret_key: str,
    region: str,
    expires_s: int,
    secure: bool = False,
    headers: Mapping[str, str] | None = None,
    query: Mapping[str, str] | None = None,
    now: datetime | None = None,
) -> str:
    """A path-style presigned URL for ``method`` on ``bucket``/``key`` at ``endpoint`` (host:port).

    ``headers`` are signed: the request must send exactly these (names are case-insensitive).
    ``query`` parameters are signed and part of the URL (an empty value: ``?uploads``)."""
    if not 1 <= expires_s <= MAX_EXPIRES_S:
        raise ValueError(f"expires_s must be 1-{MAX_EXPIRES_S}, got {expires_s}")
    if not key or not bucket:
        raise ValueError("bucket and key must not be empty")
    when = (now or datetime.now(UTC)).astimezone(UTC)
    amz_date, day = when.strftime("%Y%m%dT%H%M%SZ"), when.strftime("%Y%m%d")
    scope = f"{day}/{region}/s3/aws4_request"
    host = endpoint.removesuffix(":443" if secure else ":80")  # what clients send for a default port
    signed = {"host": host, **{k.lower().strip(): " ".join(v.split()) for k, v in (headers or {}).items()}}
    signed_names = ";".join(sorted(signed))
    params = {
        **dict(query or {}),
        "X-Amz-Algorithm": _ALGORITHM,
        "X-Amz-Credential": f"{access_key}/{scope}",
        "X-Amz-Date": amz_date,
        "X-Amz-Expires": str(expires_s),
        "X-Amz-SignedHeaders": signed_names,
    }
    canonical_query = "&".join(
        f"{_uri_encode(k, keep_slash=False)}={_uri_encode(v, keep_slash=False)}" for k, v in sorted(params.items())
    )
    path = "/" + _uri_encode(bucket, keep_slash=False) + "/" + _uri_encode(key, keep_slash=True)
    canonical_request = "\n".join([
        method.upper(),
        path,
        canonical_query,
        "".join(f"{name}:{signed[name]}\n" for name in sorted(signed)),
        signed_names,
        "UNSIGNED-PAYLOAD",
    ])
    string_to_sign = "\n".join([
        _ALGORITHM, amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest(),
    ])
    signing_key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), day), region), "s3"), "aws4_request")
    signature = hmac.new(signing_key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    scheme = "https" if secure else "http"
    return f"{scheme}://{host}{path}?{canonical_query}&X-Amz-Signature={signature}"
