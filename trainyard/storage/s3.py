"""S3 storage through the MinIO SDK: the one implementation of :class:`CheckpointStorage`.

Works with any S3 endpoint (SeaweedFS ``weed mini``, AWS S3, an existing MinIO, Ceph RGW).
Imports no torch, so the control plane uses it too (to verify shards and write manifests).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, BinaryIO
from xml.sax.saxutils import escape

from trainyard.protocol.s3tls import split_endpoint, tls_context
from trainyard.protocol.storage import ObjectInfo, ObjectNotFoundError, Pace
from trainyard.storage.pacing import paced_chunks
from trainyard.storage.sigv4 import presign

PART_SIZE = 16 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """Where checkpoints live. ``endpoint`` is host:port (no scheme)."""

    endpoint: str
    bucket: str
    access_key: str = ""
    secret_key: str = ""
    secure: bool = False
    region: str | None = "us-east-1"
    public_endpoint: str = ""
    """host:port at which workers reach the store, when it is not ``endpoint``: presigned URLs
    name it (the signature covers the host). Empty: ``endpoint``."""
    ca_file: str = ""
    """PEM file of the CA(s) that sign the store's certificate (with ``secure``); empty: the
    system's trust store (trainyard/protocol/s3tls.py)."""
    ca_pem: str = ""
    """The same as PEM text (what an agent gives a worker)."""

    def __post_init__(self) -> None:
        if not self.endpoint or "://" in self.endpoint:
            raise ValueError(f"S3 endpoint must be host:port without a scheme, got {self.endpoint!r}")
        if not self.bucket:
            raise ValueError("S3 bucket must not be empty")
        if "://" in self.public_endpoint:
            raise ValueError(f"S3 public endpoint must be host:port without a scheme, got {self.public_endpoint!r}")

    @classmethod
    def from_mapping(cls, m: dict[str, Any]) -> S3Config:
        """From TRAINYARD_S3_* values; an endpoint may carry its scheme (``https://host:port``)."""
        endpoint, scheme_secure = split_endpoint(str(m["endpoint"]))
        secure = str(m.get("secure", "")).lower() in ("1", "true", "yes")
        return cls(
            endpoint=endpoint,
            bucket=str(m["bucket"]),
            access_key=str(m.get("access_key") or ""),
            secret_key=str(m.get("secret_key") or ""),
            secure=secure if scheme_secure is None else scheme_secure,
            region=str(m.get("region") or "us-east-1"),
            public_endpoint=str(m.get("public_endpoint") or ""),
            ca_file=str(m.get("ca_file") or ""),
            ca_pem=str(m.get("ca_pem") or ""),
        )

    @property
    def url(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.endpoint}"


class S3Storage:
    """Objects in one bucket. Single PUTs are atomic in S3: a reader never sees a prefix."""

    def __init__(self, config: S3Config, *, timeout_s: float = 30.0, retries: int = 2) -> None:
        import urllib3
        from minio import Minio

        self.config = config
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=min(5.0, timeout_s), read=timeout_s),
            retries=urllib3.Retry(total=retries, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)),
            maxsize=16,
            ssl_context=tls_context(config.ca_file, config.ca_pem) if config.secure else None,
        )
        self._http = http
        self._client = Minio(
            config.endpoint,
            access_key=config.access_key or None,
            secret_key=config.secret_key or None,
            secure=config.secure,
            region=config.region,
            http_client=http,
        )
        self.bucket = config.bucket

    def ensure_bucket(self) -> None:
        if not self._client.bucket_exists(self.bucket):
            self._client.make_bucket(self.bucket)

    def put_object(self, key: str, data: BinaryIO, *, length: int | None = None) -> ObjectInfo:
        if length is None:
            result = self._client.put_object(self.bucket, key, data, length=-1, part_size=PART_SIZE)
        else:
            result = self._client.put_object(self.bucket, key, data, length=length)
        info = self.stat(key)
        return info or ObjectInfo(key=key, size=length or 0, etag=result.etag)

    def put_object_paced(self, key: str, data: BinaryIO, *, length: int, pace: Pace) -> ObjectInfo:
        """One PUT whose body is sent chunk by chunk as ``pace`` releases it (the rate of an upload
        slot: trainyard/storage/pacing.py), so the bytes leave at that rate rather than being
        read at it and then sent in one burst (the SDK reads a whole part into memory first). The
        request is signed in its URL (a presigned PUT, unsigned payload), which lets the body stream."""

        url = self._client.presigned_put_object(self.bucket, key, expires=timedelta(hours=1))
        # No retry: a streamed body cannot be sent again (the caller fails the save, as for any error).
        resp = self._http.urlopen("PUT", url, body=paced_chunks(data, length, pace),
                                  headers={"Content-Length": str(length)}, retries=False, preload_content=True,
                                  chunked=False)
        if resp.status >= 300:
            raise OSError(f"PUT {key}: HTTP {resp.status} {resp.data[:300]!r}")
        info = self.stat(key)
        return info or ObjectInfo(key=key, size=length, etag=resp.headers.get("ETag"))

    def put_bytes(self, key: str, payload: bytes) -> ObjectInfo:
        return self.put_object(key, io.BytesIO(payload), length=len(payload))

    def get_object(self, key: str) -> BinaryIO:
        from minio.error import S3Error

        try:
            return self._client.get_object(self.bucket, key)  # type: ignore[return-value]
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "NoSuchBucket"):
                raise ObjectNotFoundError(key) from exc
            raise

    def get_bytes(self, key: str) -> bytes:
        resp = self.get_object(key)
        try:
            return resp.read()
        finally:
            resp.close()
            release = getattr(resp, "release_conn", None)
            if release:
                release()

    def stat(self, key: str) -> ObjectInfo | None:
        from minio.error import S3Error

        try:
            st = self._client.stat_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "NoSuchBucket", "ResourceNotFound"):
                return None
            raise
        return ObjectInfo(key=key, size=int(st.size or 0), etag=st.etag)

    def delete(self, key: str) -> None:
        self._client.remove_object(self.bucket, key)

    def presign(self, method: str, key: str, *, expires_s: int, headers: dict[str, str] | None = None,
                query: dict[str, str] | None = None, now: datetime | None = None) -> str:
        """A URL that allows ``method`` on ``key`` (with exactly ``headers``) for ``expires_s``
        seconds from ``now`` (default: the wall clock), to whoever holds it (sigv4.presign; offline)."""

        cfg = self.config
        return presign(method=method, endpoint=cfg.public_endpoint or cfg.endpoint, bucket=self.bucket, key=key,
                       access_key=cfg.access_key, secret_key=cfg.secret_key, region=cfg.region or "us-east-1",
                       expires_s=expires_s, secure=cfg.secure, headers=headers, query=query, now=now)

    # An upload in parts driven by the caller, one part at a time (the control plane streams a code
    # archive through it: the object appears, whole, only at complete_upload, so an upload whose
    # hash turns out wrong is aborted and never seen). Signed here (sigv4.py) with this client's
    # credentials, as the SDK's own multipart calls are private.
    def _signed(self, method: str, key: str, query: dict[str, str], body: bytes = b"") -> Any:

        cfg = self.config
        url = presign(method=method, endpoint=cfg.endpoint, bucket=self.bucket, key=key, access_key=cfg.access_key,
                      secret_key=cfg.secret_key, region=cfg.region or "us-east-1", expires_s=300, secure=cfg.secure,
                      query=query)
        return self._http.request(method, url, body=body, headers={"Content-Length": str(len(body))}, retries=False)

    def start_upload(self, key: str) -> str:
        resp = self._signed("POST", key, {"uploads": ""})
        found = re.search(rb"<UploadId>([^<]+)</UploadId>", resp.data) if resp.status == 200 else None
        if found is None:
            raise OSError(f"create upload {key}: HTTP {resp.status} {resp.data[:300]!r}")
        return found[1].decode()

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes) -> str:
        """Part ``number`` (1-10,000; at least 5 MiB but for the last); its ETag."""
        resp = self._signed("PUT", key, {"uploadId": upload_id, "partNumber": str(number)}, data)
        if resp.status != 200 or not resp.headers.get("ETag"):
            raise OSError(f"upload part {number} of {key}: HTTP {resp.status} {resp.data[:300]!r}")
        return str(resp.headers["ETag"])

    def complete_upload(self, key: str, upload_id: str, etags: list[str]) -> None:
        parts = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(etag)}</ETag></Part>"
                        for n, etag in enumerate(etags, start=1))
        resp = self._signed("POST", key, {"uploadId": upload_id},
                            f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode())
        # S3 may answer 200 with an error document when the completion fails late.
        if resp.status != 200 or b"<Error>" in resp.data:
            raise OSError(f"complete upload {key}: HTTP {resp.status} {resp.data[:300]!r}")

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort an upload in parts (its parts are deleted); one already completed or aborted is no
        error (the control plane's storage sweep, services/checkpoints/storage_sweep.py)."""
        resp = self._signed("DELETE", key, {"uploadId": upload_id})
        if resp.status >= 300 and resp.status != 404:  # 404: NoSuchUpload, nothing left to abort
            raise OSError(f"abort upload {key}: HTTP {resp.status} {resp.data[:300]!r}")

    def list_objects_modified(self, prefix: str) -> Iterator[tuple[str, datetime | None]]:
        """Every object under ``prefix`` with when it was last written."""
        for obj in self._client.list_objects(self.bucket, prefix=prefix, recursive=True):
            if obj.object_name and not obj.is_dir:
                yield obj.object_name, obj.last_modified

    def list_keys(self, prefix: str) -> Iterator[str]:
        for obj in self.list_objects(prefix):
            yield obj.key

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` with its size, from ListObjectsV2 (1,000 keys a request)."""
        for obj in self._client.list_objects(self.bucket, prefix=prefix, recursive=True):
            if obj.object_name and not obj.is_dir:
                yield ObjectInfo(key=obj.object_name, size=int(obj.size or 0), etag=obj.etag)
