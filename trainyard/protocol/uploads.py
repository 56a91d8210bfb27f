"""Checkpoint upload slots: the wire messages (docs/architecture.md, "Checkpoint upload slots").

Many ranks uploading their shards at once can saturate a shared link (a rack's uplink) or the
object store. Before uploading a shard a worker asks for a slot; the control plane grants slots
within a cluster-wide limit and a limit per topology domain, first come first served, and gives
each grant a byte rate (the node's budget shared by the node's holders). A slot is a lease: it
expires unless renewed, and it is fenced by the attempt like a shard report (a stale attempt gets
409 and no slot).

Worker -> its agent's local API (the fencing token authenticates the worker):

- ``POST /v1/local/attempts/{attempt_id}/upload-slot``  LocalSlotRequest -> SlotAnswer
- ``POST /v1/local/attempts/{attempt_id}/upload-slot/release``  LocalSlotRelease -> SlotReleased

Agent -> control plane (node credential), relayed as they come:

- ``POST /v1/agent/attempts/{attempt_id}/upload-slots``  SlotRequest -> SlotAnswer. A long poll:
  answered at once when the slot is granted (or was already: then it is renewed), else when it is
  granted or after ``wait_s`` with ``state: waiting``, the queue position and when to ask again.
  The same (attempt, rank, step) names one slot: asking again polls or renews it.
- ``POST /v1/agent/attempts/{attempt_id}/upload-slots/release``  SlotRelease -> SlotReleased.
- ``POST /v1/agent/attempts/{attempt_id}/upload-slots/batch``  SlotBatchRequest -> SlotBatchAnswer: the
  asks and releases of several of the node's ranks in one request (the agent gathers its workers'
  requests for a few milliseconds: node_agent/link/batcher.py), so a checkpoint costs the control
  plane a few requests per node, not three per rank. Releases are applied first, so the capacity
  they free serves the asks in the same grant pass. A long poll like the single ask: answered at
  once when any ask is granted (or when there is no ask, or ``wait_s`` is 0), else when a grant pass
  grants any of them, else after ``wait_s``, with every ask's answer (``waiting`` ones ask again).
  Fenced once for the whole batch: a stale attempt is 409 and nothing in it is applied; a rank
  outside the world or of another node is 422 / 403 for the whole batch. An agent whose control
  plane answers this path 404 (an older one) uses the single paths above.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainyard.protocol.limits import Int32, Int64

SLOT_WAIT_MAX_S = 60.0
"""The longest one long poll for a slot may be asked to last."""
BATCH_MAX = 4096
"""Most asks, and most releases, one batch may carry (a node runs far fewer ranks)."""
SECONDS_MAX = 1e9
"""Bound of the durations a worker reports (finite: NaN and infinities are refused)."""

Seconds = Annotated[float, Field(ge=0, le=SECONDS_MAX)]
Token = Annotated[str, Field(min_length=1, max_length=128)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _SlotKey(_Wire):
    rank: Int32 = Field(description="Global rank of the uploading worker.")
    step: Int32 = Field(description="The checkpoint's step.")


class _Ask(_SlotKey):
    size_bytes: Int64 = Field(description="Bytes the worker is about to upload.")
    wait_s: float = Field(default=20.0, ge=0, le=SLOT_WAIT_MAX_S,
                          description="Longest this request may wait for the slot (a long poll); 0: answer now.")


class LocalSlotRequest(_Ask):
    fencing_token: Token


class SlotRequest(_Ask):
    fencing_token: Token
    node_rank: Int32 = Field(description="The node's rank in the attempt (torchrun's node_rank), 0 to 2,147,483,647.")


class SlotAnswer(_Wire):
    slot_id: str
    state: Literal["granted", "waiting"]
    position: int = Field(ge=0, description="Waiting slots ahead of this one (0 once granted).")
    retry_after_s: float = Field(ge=0, description="While waiting: ask again after this long (0: at once, "
                                 "the next request is again a long poll).")
    rate_bytes_per_s: int | None = Field(default=None, description="Granted: the pace to upload at; None: unpaced.")
    ttl_s: float = Field(gt=0, description="Granted: the lease ends this long after the answer unless the "
                         "worker asks again (a renewal); waiting: the queue place is dropped after this long "
                         "without a new request.")
    max_wait_s: float | None = Field(default=None, description="How long a worker should wait for a slot "
                                     "before it uploads without one (upload_slot_max_wait_s); None: no bound.")


class _Release(_SlotKey):
    uploaded_bytes: Int64 = Field(default=0, description="Bytes uploaded, 0 to 2^63 - 1.")
    upload_s: Seconds = Field(default=0.0, description="Seconds the upload took (0 when it never started).")
    ok: bool = Field(default=True, description="False: the upload failed, or the worker stopped waiting.")


class LocalSlotRelease(_Release):
    fencing_token: Token


class SlotRelease(_Release):
    fencing_token: Token
    node_rank: Int32 = Field(description="The node's rank in the attempt (torchrun's node_rank), 0 to 2,147,483,647.")


class SlotReleased(_Wire):
    released: bool = Field(description="False when the slot was already released or had expired.")


class LocalSlotReleased(SlotReleased):
    """The agent's answer to a worker's release (the local API)."""

    held: bool = Field(False, description="The agent holds the release and resends it until the control "
                       "plane takes it (it answered 503): nothing is released yet, and the worker is done.")


SlotUse = Literal["granted", "bypassed", "none"]
"""How a shard was uploaded: ``granted`` (within a slot), ``bypassed`` (without one: the wait was
over its bound, the next save was due, or the slot service was unreachable; a
``checkpoint.upload_unslotted`` event says why), ``none`` (no slot service: a worker run without an
agent, or an agent that predates slots)."""


class SlotAsk(_SlotKey):
    """One rank's ask in a batch: create, poll or renew the slot of (rank, step)."""

    size_bytes: Int64 = Field(description="Bytes the worker is about to upload.")


class SlotReleaseItem(_Release):
    """One rank's release in a batch."""


class SlotBatchRequest(_Wire):
    fencing_token: Token
    node_rank: Int32 = Field(description="The node's rank in the attempt (torchrun's node_rank), 0 to 2,147,483,647.")
    wait_s: float = Field(default=20.0, ge=0, le=SLOT_WAIT_MAX_S,
                          description="Longest this request may wait for any of its asks to be granted (a long "
                          "poll); 0: answer now.")
    asks: list[SlotAsk] = Field(default_factory=list, max_length=BATCH_MAX,
                                description="Slots asked for, polled or renewed; answered in this order.")
    releases: list[SlotReleaseItem] = Field(default_factory=list, max_length=BATCH_MAX,
                                            description="Slots given back, applied before the asks.")


class SlotBatchItem(SlotAnswer):
    rank: Int32 = Field(description="The asking rank (as in its ask).")
    step: Int32 = Field(description="The checkpoint's step (as in its ask).")


class SlotBatchAnswer(_Wire):
    answers: list[SlotBatchItem] = Field(default_factory=list, description="One per ask, in the asks' order.")
    released: list[bool] = Field(default_factory=list, description="One per release, in the releases' order: "
                                 "False when that slot was already released or had expired.")


class UploadStats(_Wire):
    """What a shard's upload cost, reported with the shard (ShardInfo.upload)."""

    wait_s: Seconds = Field(description="Time spent waiting for a slot.")
    upload_s: Seconds = Field(description="Time the upload itself took.")
    slot: SlotUse
