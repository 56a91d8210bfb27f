"""Relay of the workers' requests for storage grants to the control plane (trainyard/protocol/grants.py;
docs/security.md, "Checkpoint storage").

A worker's request is its question: it is relayed at once, on the local API's request thread, and
answered with the control plane's answer, after the agent checked the worker's token and added
what only it knows (the node rank; the fencing token is the worker's own). The requests of the
node's ranks that come together (every rank of a save asks within milliseconds) go as one
``storage/batch`` request (batcher.py), each answered on its own. A control plane that answers the
batch path 404 or 405 predates it: from then on each request goes on its own. What the worker
gets, batched or not:

- 200 and the StorageGrants;
- the control plane's refusal of the request: 403, 404, 409 (a stale attempt, or a step already
  decided), 422, with its detail and problem type; 502 for an answer that is not one;
- 503 when the control plane cannot be reached (the worker asks again, with backoff).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

import structlog

from node_agent.link.batcher import WINDOW_S, Coalescer
from node_agent.link.client import (
    NO_BATCH_PATH,
    ControlPlaneClient,
    ControlPlaneUnavailable,
    RequestRejected,
    StaleAttempt,
    Unauthorized,
)
from trainyard.protocol.grants import (
    LocalStorageRequest,
    StorageAnswer,
    StorageBatchRequest,
    StorageItem,
    StorageRequest,
)

log = structlog.get_logger(__name__)

Answer = tuple[HTTPStatus, dict[str, Any]]


class GrantRelay:
    """``target(attempt_id)`` gives the attempt's node rank, or None when the agent no longer runs
    it; ``ranks(attempt_id)`` its ranks on this node (a batch of that many goes at once);
    ``on_unauthorized`` is called on a 401. ``forward`` is the local API's GrantForwarder."""

    def __init__(self, client: ControlPlaneClient, *, target: Callable[[str], int | None],
                 on_unauthorized: Callable[[], None], ranks: Callable[[str], int] | None = None,
                 window_s: float = WINDOW_S) -> None:
        self.client = client
        self._target = target
        self._on_unauthorized = on_unauthorized
        self._ranks = ranks or (lambda attempt_id: 0)
        self.requests: Coalescer[tuple[str, str], LocalStorageRequest, Answer | None] = Coalescer(
            self._send, window_s=window_s)
        self.batching = True
        """False once the control plane answered the batch path 404 or 405 (it predates batches)."""

    def forward(self, attempt_id: str, body: LocalStorageRequest) -> Answer:
        if self.batching:
            # Gathered by fencing token too: one batch carries one, and a worker's own is checked.
            answer = self.requests.submit((attempt_id, body.fencing_token), body, full_at=self._ranks(attempt_id))
            if answer is not None:
                return answer
        node_rank = self._target(attempt_id)
        if node_rank is None:
            return _not_here(attempt_id)
        request = StorageRequest(**body.model_dump(), node_rank=node_rank)
        try:
            return HTTPStatus.OK, self.client.storage_grants(attempt_id, request).model_dump(mode="json")
        except Exception as exc:  # noqa: BLE001 - _refusal re-raises what it does not know
            return self._refusal(exc)

    def _send(self, key: tuple[str, str], items: Sequence[LocalStorageRequest]) -> list[Answer | None]:
        attempt_id, token = key
        node_rank = self._target(attempt_id)
        if node_rank is None:
            return [_not_here(attempt_id)] * len(items)
        request = StorageBatchRequest(fencing_token=token, node_rank=node_rank, requests=[
            StorageItem(**item.model_dump(exclude={"fencing_token"})) for item in items])
        try:
            answer = self.client.storage_grants_batch(attempt_id, request)
            if len(answer.answers) != len(items):
                raise RequestRejected("the control plane's batch answer does not match its requests", status=502)
        except RequestRejected as exc:
            if exc.status in NO_BATCH_PATH:
                log.warning("storage_batches_unsupported", detail="the control plane predates batch paths; "
                            "forwarding each storage request on its own")
                self.batching = False
                return [None] * len(items)
            return [self._refusal(exc)] * len(items)
        except Exception as exc:  # noqa: BLE001 - _refusal re-raises what it does not know
            return [self._refusal(exc)] * len(items)
        return [_item(a) for a in answer.answers]

    def _refusal(self, exc: Exception) -> Answer:
        """The worker's answer to a request (or a batch) the control plane did not answer with grants."""
        if isinstance(exc, StaleAttempt):
            return HTTPStatus.CONFLICT, {"detail": str(exc), "type": exc.problem_type}
        if isinstance(exc, RequestRejected):  # 403, 404, 422: the worker's to know; a garbled answer: 502
            return _refused(exc.status), {"detail": str(exc), "type": exc.problem_type}
        if isinstance(exc, Unauthorized):
            self._on_unauthorized()
            return HTTPStatus.SERVICE_UNAVAILABLE, {"detail": "the agent is registering again; retry"}
        if isinstance(exc, ControlPlaneUnavailable):
            answer: dict[str, Any] = {"detail": f"the control plane is unreachable: {exc}"}
            if exc.retry_after_s:  # a busy replica said when: the worker hears it (local/api.py)
                answer["retry_after_s"] = exc.retry_after_s
            return HTTPStatus.SERVICE_UNAVAILABLE, answer
        raise exc


def _item(answer: StorageAnswer) -> Answer:
    if answer.status == HTTPStatus.OK and answer.grants is not None:
        return HTTPStatus.OK, answer.grants.model_dump(mode="json")
    status = _refused(answer.status)
    if status == HTTPStatus.BAD_GATEWAY:
        return status, {"detail": f"the control plane answered a storage request {answer.status}"}
    return status, {"detail": answer.detail or "", "type": answer.type}


def _refused(status: int | None) -> HTTPStatus:
    """A refusal's status for the worker: the control plane's 4xx, else 502 (not an answer)."""
    if status is not None and 400 <= status < 500:
        try:
            return HTTPStatus(status)
        except ValueError:
            pass
    return HTTPStatus.BAD_GATEWAY


def _not_here(attempt_id: str) -> Answer:
    return HTTPStatus.CONFLICT, {"detail": f"attempt {attempt_id} is not running here"}
