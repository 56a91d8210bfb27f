"""Storage grants: presigned URLs for the exact checkpoint objects a worker may read or write
(pydantic only; docs/security.md, "Checkpoint storage").

Workers hold no storage credentials. To save a shard or restore a checkpoint a worker asks its
agent, whose local API forwards the request to the control plane with the node's credential; the
control plane checks the attempt's fencing token and what the key is, and signs URLs with the
credentials only it holds (offline: no request to S3):

- ``POST /v1/local/attempts/{attempt_id}/storage``  LocalStorageRequest -> 200 StorageGrants
- ``POST /v1/agent/attempts/{attempt_id}/storage``  StorageRequest (node token) -> 200 StorageGrants
- ``POST /v1/agent/attempts/{attempt_id}/storage/batch``  StorageBatchRequest (node token) -> 200
  StorageBatchAnswer: the requests of several of the node's ranks at once (the agent gathers its
  workers' requests for a few milliseconds: node_agent/link/batcher.py), each answered as the single
  path would, in order: one refused request does not refuse the others. A stale attempt (or a
  fencing token that does not match) refuses the whole batch with 409. An agent whose control plane
  answers this path 404 (an older one) uses the single path.

What may be granted:

- PUT: this attempt's own shard key of the worker's rank (``trainyard.protocol.keys.shard_key``), for
  a step whose checkpoint is not decided yet. The URL is create-only: it signs ``If-None-Match: *``,
  so it can never overwrite an object, not even the shard it wrote. An object larger than the
  control plane's part size is uploaded in parts: the first answer is a ``create_upload`` grant;
  the worker sends it, then asks again with the ``upload_id`` S3 gave and gets a grant per part,
  one to complete the upload (create-only as well) and one to abort it.
- GET: the manifest and shards of the checkpoints in the attempt's restore plan. Asked for a
  manifest, the control plane also grants the worker's own shard and rank 0's (which holds the
  replicated state), so a restore costs one request per candidate.

Nothing grants listing, deleting, or any object of another job. A refused request is 403 (not
this worker's object), 404 (not a readable checkpoint of the plan), 409 (a stale attempt, or a
step already decided), or 422.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_KEY_LENGTH = 1024
"""S3's longest object key, in bytes of UTF-8."""
MAX_PARTS = 10_000
"""S3's most parts of one multipart upload."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Asked(_Wire):
    rank: int = Field(ge=0, le=2**31 - 1, description="The asking worker's global rank.")
    method: Literal["GET", "PUT"]
    key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH, description="The object key.")
    size_bytes: int | None = Field(
        default=None, ge=0, le=5 * 2**40,
        description="PUT: the object's size in bytes (S3 objects are at most 5 TiB). Required for PUT.",
    )
    upload_id: str | None = Field(
        default=None, min_length=1, max_length=1024, pattern=r"^[\x21-\x7e]+$",
        description="PUT in parts: the upload id S3 answered to the create_upload grant.",
    )

    @model_validator(mode="after")
    def _put_has_size(self) -> _Asked:
        if self.method == "PUT" and self.size_bytes is None:
            raise ValueError("a PUT grant needs size_bytes")
        if self.method == "GET" and (self.size_bytes is not None or self.upload_id is not None):
            raise ValueError("size_bytes and upload_id only go with PUT")
        return self


_TOKEN = Field(max_length=256, pattern=r"^[\x21-\x7e]*$", description="The attempt's fencing token.")


class LocalStorageRequest(_Asked):
    """Worker -> agent (local API), authenticated by the attempt's fencing token."""

    fencing_token: str = _TOKEN


class StorageRequest(_Asked):
    """Agent -> control plane (node token), for one of the node's attempts."""

    fencing_token: str = _TOKEN
    node_rank: int = Field(ge=0, le=2**31 - 1, description="The node's rank in the attempt, 0 to 2,147,483,647.")


BATCH_MAX = 4096
"""Most requests one batch may carry (a node runs far fewer ranks)."""


class StorageItem(_Asked):
    """One rank's request in a batch (the batch carries the token and the node rank)."""


class StorageBatchRequest(_Wire):
    """Agent -> control plane (node token): several of its workers' requests of one attempt."""

    fencing_token: str = _TOKEN
    node_rank: int = Field(ge=0, le=2**31 - 1, description="The node's rank in the attempt, 0 to 2,147,483,647.")
    requests: list[StorageItem] = Field(default_factory=list, max_length=BATCH_MAX,
                                        description="The workers' requests; answered in this order.")


class GrantAction(StrEnum):
    get = "get"
    put = "put"
    create_upload = "create_upload"
    upload_part = "upload_part"
    complete_upload = "complete_upload"
    abort_upload = "abort_upload"


class StorageGrant(_Wire):
    key: str
    action: GrantAction
    method: str = Field(description="The HTTP method the URL is signed for.")
    url: str = Field(description="Presigned URL; holds no credential, only a signature.")
    headers: dict[str, str] = Field(
        default_factory=dict, description="Signed headers: send exactly these, or S3 refuses the request."
    )
    part_number: int | None = Field(default=None, ge=1, le=MAX_PARTS)
    expires_at: datetime


class StorageGrants(_Wire):
    grants: list[StorageGrant] = Field(default_factory=list)
    part_size_bytes: int | None = Field(
        default=None, ge=1, description="Uploads in parts: the size of every part but the last."
    )


class StorageAnswer(_Wire):
    """The answer to one request of a batch: what the single path would have answered."""

    status: int = Field(description="200, or the HTTP status the single path would have refused it with "
                        "(403, 404, 409, 422).")
    grants: StorageGrants | None = Field(default=None, description="The grants (status 200).")
    detail: str | None = Field(default=None, description="Why it was refused.")
    type: str | None = Field(default=None, description="The refusal's problem type (RFC 9457), as the single "
                             "path's problem+json would give it.")


class StorageBatchAnswer(_Wire):
    answers: list[StorageAnswer] = Field(default_factory=list, description="One per request, in order.")
