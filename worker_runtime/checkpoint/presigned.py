"""Checkpoint storage through presigned URLs: a worker's storage under an agent, with no credential.

A :class:`CheckpointStorage` whose every request uses a URL the control plane signed for that one
object and method (trainyard/protocol/grants.py), obtained through the worker's agent
(:class:`AgentGrants`). What it can do is what the grants allow and no more: write this rank's own
shards of this attempt, create-only (a PUT never overwrites: S3 answers 412), and read the
manifest and shards of the checkpoints in the attempt's restore plan. ``delete`` is refused here,
and would be by S3: no grant allows it.

Objects up to the control plane's part size go up in one PUT (S3 takes at most 5 GiB in one);
larger ones in parts (create, one PUT per part, complete), each with its own URL. A URL that has
expired (S3 answers 403) is asked for again once. An upload may be paced (``put_object_paced``: the
rate of its upload slot, docs/architecture.md "Checkpoint upload slots").
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, Protocol
from urllib.parse import quote

import httpx
import urllib3
from pydantic import ValidationError

from trainyard.protocol.env import LOCAL_API_PREFIX
from trainyard.protocol.grants import GrantAction, LocalStorageRequest, StorageGrant, StorageGrants
from trainyard.protocol.s3tls import tls_context, tls_failure
from trainyard.protocol.storage import ObjectInfo, ObjectNotFoundError, Pace
from trainyard.storage.pacing import paced_chunks
from worker_runtime.agent_http import socket_client

log = logging.getLogger(__name__)

_REFRESH_BEFORE = timedelta(seconds=10)
"""A cached URL this close to its expiry is asked for again rather than used."""


class GrantRefused(PermissionError):
    """The control plane (through the agent) refused the grant: 403, 409 or 422."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"storage grant refused (HTTP {status}): {detail}")
        self.status = status


class StorageTlsError(PermissionError):
    """S3's certificate is not trusted here (or TLS failed): retrying does not help; the message
    says what to configure."""


class GrantSource(Protocol):
    def grants(self, method: str, key: str, *, size_bytes: int | None = None,
               upload_id: str | None = None) -> StorageGrants: ...


class AgentGrants:
    """Grants from the worker's agent (local API ``POST .../storage``), fenced by the attempt's token.

    404 (not a readable checkpoint of the plan) raises ObjectNotFoundError, other refusals
    GrantRefused. An agent or control plane that cannot answer (503, 5xx, no connection) is asked
    again with backoff (``backoff_s`` doubling up to ``max_backoff_s``) for up to ``wait_s``, then
    OSError: a control plane restart or a database failover must delay a checkpoint, not lose it.
    While it waits the attempt is still fenced: once the control plane is back, a stale attempt's
    request is refused (409), never granted."""

    def __init__(self, *, agent_url: str, attempt_id: str, fencing_token: str, rank: int,
                 timeout_s: float = 40.0, wait_s: float = 300.0, backoff_s: float = 0.5,
                 max_backoff_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, agent_socket: str | None = None) -> None:
        self._url = f"{agent_url}{LOCAL_API_PREFIX}/attempts/{quote(attempt_id, safe='')}/storage"
        self._socket = agent_socket
        """The attempt's unix socket (TRAINYARD_AGENT_SOCKET); None: agent_url's host and port."""
        self._token = fencing_token
        self._rank = rank
        self._timeout = timeout_s
        self._wait = max(0.0, wait_s)
        self._backoff = backoff_s
        self._max_backoff = max_backoff_s
        self._clock = clock
        self._sleep = sleep

    def grants(self, method: str, key: str, *, size_bytes: int | None = None,
               upload_id: str | None = None) -> StorageGrants:
        body = LocalStorageRequest(fencing_token=self._token, rank=self._rank, method=method,  # type: ignore[arg-type]
                                   key=key, size_bytes=size_bytes, upload_id=upload_id)
        last = "no try made"
        deadline = self._clock() + self._wait
        tries = 0
        with socket_client(self._socket, self._timeout) as client:
            while True:
                tries += 1
                try:
                    resp = client.post(self._url, content=body.model_dump_json(),
                                       headers={"Content-Type": "application/json"})
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                else:
                    if resp.status_code == 200:
                        try:
                            return StorageGrants.model_validate_json(resp.content)
                        except ValidationError as exc:
                            raise OSError(f"the agent's storage grants for {key} are malformed: {exc}") from exc
                    detail = _detail(resp)
                    if resp.status_code == 404:
                        raise ObjectNotFoundError(f"{key}: {detail}")
                    if 400 <= resp.status_code < 500 and resp.status_code != 429:
                        raise GrantRefused(resp.status_code, detail)
                    last = f"HTTP {resp.status_code}: {detail}"
                pause = min(self._max_backoff, self._backoff * 2 ** min(tries - 1, 16))
                if self._clock() + pause > deadline:
                    break
                if tries == 1 or tries % 10 == 0:
                    log.warning("storage grant for %s not available yet (%s); asking again", key, last)
                self._sleep(pause)
        raise OSError(f"no storage grant for {key} from the agent after {tries} tries in "
                      f"{self._wait:.0f} s ({last})")


class PresignedStorage:
    """CheckpointStorage over presigned URLs from ``source``; safe to use from several threads."""

    def __init__(self, source: GrantSource, *, timeout_s: float = 30.0, retries: int = 2,
                 clock: Callable[[], datetime] | None = None, ca_file: str | None = None,
                 ca_pem: str | None = None) -> None:
        """``ca_file`` / ``ca_pem``: the CA(s) an https S3 is verified with (TRAINYARD_S3_CA_FILE,
        TRAINYARD_S3_CA_PEM); neither: the system's trust store."""
        self._source = source
        self._retries = max(0, retries)
        self._clock = clock or (lambda: datetime.now(UTC))
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=min(5.0, timeout_s), read=timeout_s), retries=False, maxsize=16,
            ssl_context=tls_context(ca_file, ca_pem))
        self._lock = threading.Lock()
        self._readable: dict[str, StorageGrant] = {}

    # --- reading ---

    def get_object(self, key: str) -> BinaryIO:
        resp = self._get(key, {})
        if resp.status != 200:
            raise _failed("GET", key, resp)
        return resp  # type: ignore[return-value]  # urllib3's response streams (read, close, release_conn)

    def stat(self, key: str) -> ObjectInfo | None:
        """From a one-byte ranged GET (a grant is for GET only, not HEAD)."""
        try:
            resp = self._get(key, {"Range": "bytes=0-0"})
        except ObjectNotFoundError:
            return None
        try:
            if resp.status == 206:
                total = resp.headers.get("Content-Range", "").rpartition("/")[2]
                return ObjectInfo(key=key, size=int(total), etag=_etag(resp))
            if resp.status in (200, 416):  # no range support, or an empty object
                size = int(resp.headers.get("Content-Length") or 0) if resp.status == 200 else 0
                return ObjectInfo(key=key, size=size, etag=_etag(resp))
            raise _failed("GET", key, resp)
        finally:
            resp.drain_conn()
            resp.release_conn()

    def _get(self, key: str, headers: dict[str, str]) -> Any:
        """The response to a GET of ``key`` (status 2xx or 416); ObjectNotFoundError for 404."""
        for fresh in (False, True):
            grant = self._read_grant(key, fresh=fresh)
            resp = self._send(grant, headers=headers, preload=False, idempotent=True)
            if resp.status < 300 or resp.status == 416:
                return resp
            failure = _failed("GET", key, resp)
            if resp.status == 404:
                raise ObjectNotFoundError(key)
            if resp.status != 403 or fresh:
                raise failure
            log.info("GET %s refused (%s); asking for a fresh URL", key, failure)
        raise AssertionError("unreachable")

    def _read_grant(self, key: str, *, fresh: bool) -> StorageGrant:
        with self._lock:
            grant = self._readable.get(key)
        if grant is None or fresh or grant.expires_at - _REFRESH_BEFORE <= self._clock():
            # One answer may carry several URLs (a manifest's comes with this rank's shards): keep all.
            granted = self._source.grants("GET", key).grants
            with self._lock:
                self._readable.update({g.key: g for g in granted if g.action == GrantAction.get})
                grant = self._readable.get(key)
            if grant is None:
                raise OSError(f"the control plane granted no GET of {key}")
        return grant

    # --- writing ---

    def put_object(self, key: str, data: BinaryIO, *, length: int | None = None) -> ObjectInfo:
        """Create ``key`` (never overwrite it: FileExistsError if it exists)."""
        if length is None:
            payload = data.read()
            data, length = io.BytesIO(payload), len(payload)
        return self._put(key, data, length, None)

    def put_object_paced(self, key: str, data: BinaryIO, *, length: int, pace: Pace) -> ObjectInfo:
        """``put_object`` whose bytes leave no faster than ``pace`` releases them (an upload slot's
        rate, trainyard/storage/pacing.py): each body is streamed chunk by chunk as it is
        released, not read at that rate and then sent in one burst."""
        return self._put(key, data, length, pace)

    def _put(self, key: str, data: BinaryIO, length: int, pace: Pace | None) -> ObjectInfo:
        granted = self._source.grants("PUT", key, size_bytes=length)
        first = granted.grants[0] if granted.grants else None
        if first is not None and first.action == GrantAction.put:
            return self._put_once(first, data, length, pace)
        if first is not None and first.action == GrantAction.create_upload and granted.part_size_bytes:
            return self._put_parts(first, data, length, granted.part_size_bytes, pace)
        raise OSError(f"the control plane granted no upload of {key}")

    def _put_once(self, grant: StorageGrant, data: BinaryIO, length: int, pace: Pace | None) -> ObjectInfo:
        start = data.tell()
        for attempt in range(self._retries + 1):
            data.seek(start)
            try:
                resp = self._send(grant, body=_body(data, length, pace), headers={"Content-Length": str(length)})
            except StorageTlsError:
                raise
            except OSError as exc:  # urllib3's errors are OSErrors: the outcome is unknown, try again
                if attempt == self._retries:
                    raise
                log.info("PUT %s failed (%s); trying again", grant.key, exc)
                continue
            if resp.status == 200:
                return ObjectInfo(key=grant.key, size=length, etag=_etag(resp))
            if resp.status == 412 and attempt:
                # An earlier try of this very upload got through (its answer was lost): only this
                # rank of this attempt can write this key, and a PUT is atomic.
                return ObjectInfo(key=grant.key, size=length)
            if resp.status == 412:
                raise FileExistsError(f"{grant.key} exists already; a checkpoint object is never overwritten")
            raise _failed("PUT", grant.key, resp)
        raise AssertionError("unreachable")

    def _put_parts(self, create: StorageGrant, data: BinaryIO, length: int, part_size: int,
                   pace: Pace | None) -> ObjectInfo:
        key = create.key
        resp = self._send(create)
        if resp.status != 200:
            raise _failed("POST (create upload)", key, resp)
        match = re.search(rb"<UploadId>([^<]+)</UploadId>", resp.data)
        if match is None:
            raise OSError(f"S3 gave no upload id for {key}")
        upload_id = match[1].decode()
        grants = self._source.grants("PUT", key, size_bytes=length, upload_id=upload_id)
        try:
            etags = []
            for number in range(1, -(-length // part_size) + 1):
                chunk = data.read(min(part_size, length - (number - 1) * part_size))
                grants, etag = self._put_part(grants, key, length, upload_id, number, chunk, pace)
                etags.append(etag)
            return self._complete(grants, key, length, etags)
        except BaseException:
            self._abort(grants, key)
            raise

    def _put_part(self, grants: StorageGrants, key: str, length: int, upload_id: str, number: int,
                  chunk: bytes, pace: Pace | None) -> tuple[StorageGrants, str]:
        refreshed = False
        for attempt in range(self._retries + 1):
            grant = _one(grants, GrantAction.upload_part, number)
            if not refreshed and grant.expires_at - _REFRESH_BEFORE <= self._clock():
                grants, refreshed = self._source.grants("PUT", key, size_bytes=length, upload_id=upload_id), True
                grant = _one(grants, GrantAction.upload_part, number)
            try:
                # A part may be sent again (the last one counts); a paced one is paced again.
                body = chunk if pace is None else paced_chunks(io.BytesIO(chunk), len(chunk), pace)
                resp = self._send(grant, body=body, headers={"Content-Length": str(len(chunk))})
            except OSError:
                if attempt == self._retries:
                    raise
                continue
            if resp.status == 200 and _etag(resp):
                return grants, str(_etag(resp))
            if resp.status == 403 and not refreshed:  # expired (or clock skew): fresh URLs, once
                grants, refreshed = self._source.grants("PUT", key, size_bytes=length, upload_id=upload_id), True
                continue
            raise _failed(f"PUT (part {number})", key, resp)
        raise OSError(f"part {number} of {key} could not be uploaded")

    def _complete(self, grants: StorageGrants, key: str, length: int, etags: list[str]) -> ObjectInfo:
        body = "<CompleteMultipartUpload>" + "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>" for n, e in enumerate(etags, 1)
        ) + "</CompleteMultipartUpload>"
        grant = _one(grants, GrantAction.complete_upload)
        for attempt in range(self._retries + 1):
            try:
                resp = self._send(grant, body=body.encode())
            except OSError:
                if attempt == self._retries:
                    raise
                continue
            # S3 may answer 200 and still fail the completion in the body.
            if resp.status == 200 and b"<Error>" not in resp.data:
                return ObjectInfo(key=key, size=length, etag=_etag(resp))
            if resp.status in (404, 412) and attempt:
                return ObjectInfo(key=key, size=length)  # an earlier try completed it (see _put_once)
            if resp.status == 412:
                raise FileExistsError(f"{key} exists already; a checkpoint object is never overwritten")
            raise _failed("POST (complete upload)", key, resp)
        raise AssertionError("unreachable")

    def _abort(self, grants: StorageGrants, key: str) -> None:
        try:
            self._send(_one(grants, GrantAction.abort_upload))
        except Exception as exc:  # the parts stay until the bucket's lifecycle rule removes them
            log.warning("could not abort the upload of %s: %s", key, exc)

    def delete(self, key: str) -> None:
        raise PermissionError(f"workers do not delete checkpoint objects ({key}): the control plane does")

    # --- HTTP ---

    def _send(self, grant: StorageGrant, *, body: Any = None, headers: dict[str, str] | None = None,
              preload: bool = True, idempotent: bool = False) -> Any:
        retries = urllib3.Retry(total=self._retries, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504),
                                allowed_methods=None) if idempotent else False
        try:
            return self._http.request(grant.method, grant.url, body=body, headers={**grant.headers, **(headers or {})},
                                      preload_content=preload, retries=retries)
        except urllib3.exceptions.HTTPError as exc:
            problem = tls_failure(exc, "/".join(grant.url.split("/", 3)[:3]))
            if problem is not None:  # retrying cannot fix trust: one line, and no retry
                raise StorageTlsError(problem) from None
            raise




def _body(data: BinaryIO, length: int, pace: Pace | None) -> Any:
    """What a PUT sends: ``data`` as it is, or its ``length`` bytes as ``pace`` releases them (a
    generator from ``data``'s current position; sent again from a fresh one on a retry)."""
    return data if pace is None else paced_chunks(data, length, pace)


def _one(grants: StorageGrants, action: GrantAction, part_number: int | None = None) -> StorageGrant:
    for grant in grants.grants:
        if grant.action == action and (part_number is None or grant.part_number == part_number):
            return grant
    raise OSError(f"the control plane granted no {action.value}" + (f" of part {part_number}" if part_number else ""))


def _etag(resp: Any) -> str | None:
    value = resp.headers.get("ETag")
    return str(value) if value else None


def _failed(what: str, key: str, resp: Any) -> OSError:
    data = resp.data or b""  # reads a streamed body to its end
    resp.release_conn()
    text = data[:300].decode(errors="replace")
    code = re.search(r"<Code>([^<]+)</Code>", text)
    return OSError(f"{what} {key}: HTTP {resp.status} {code[1] if code else text[:120]}")


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    return str(body.get("detail") or body.get("title") or body)[:500] if isinstance(body, dict) else str(body)[:300]
