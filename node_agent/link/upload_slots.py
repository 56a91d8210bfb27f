"""Relay of the workers' checkpoint upload-slot requests to the control plane
(trainyard/protocol/uploads.py; docs/architecture.md, "Checkpoint upload slots").

Unlike shards and events (relay.py: queued, answered at once, sent later), a slot request is the
worker's question, so it is relayed as it comes, on the local API's request thread, and answered
with the control plane's answer: a granted slot, or the queue position after a long poll. The agent
adds what only it knows (the attempt's fencing token as the control plane issued it, its node rank)
after checking the worker's token (local/api.py). What the worker gets:

- 200 and the SlotAnswer / SlotReleased;
- 409 when the control plane says the attempt is stale (the agent then stops it, as for a refused
  shard): no slot, no upload;
- 422 when the control plane refused the request for another reason;
- 503 with ``Retry-After`` when the control plane cannot be reached (the worker retries, and uploads
  without a slot once its bounded wait is over).
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import structlog

from node_agent.link.client import (
    ControlPlaneClient,
    ControlPlaneUnavailable,
    RequestRejected,
    StaleAttempt,
    Unauthorized,
)
from trainyard.protocol.uploads import LocalSlotRelease, LocalSlotRequest, SlotRelease, SlotRequest

log = structlog.get_logger(__name__)

UNAVAILABLE_RETRY_S = 2.0
"""What a 503 tells the worker to wait before it asks again."""

Answer = tuple[HTTPStatus, dict[str, Any]]


class SlotRelay:
    """``target(attempt_id)`` gives the attempt's (fencing token, node rank), or None when the agent
    no longer runs it; ``on_stale`` is called on a fencing 409, ``on_unauthorized`` on a 401."""

    def __init__(
        self,
        client: ControlPlaneClient,
        *,
        target: Callable[[str], tuple[str, int] | None],
        on_stale: Callable[[str, StaleAttempt], None],
        on_unauthorized: Callable[[], None],
    ) -> None:
        self.client = client
        self._target = target
        self._on_stale = on_stale
        self._on_unauthorized = on_unauthorized

    def ask(self, attempt_id: str, body: LocalSlotRequest) -> Answer:
        def send(token: str, node_rank: int) -> dict[str, Any]:
            request = SlotRequest(**body.model_dump(exclude={"fencing_token"}), fencing_token=token,
                                  node_rank=node_rank)
            return self.client.upload_slot(attempt_id, request).model_dump(mode="json")
        return self._relay(attempt_id, "upload_slot", send)

    def release(self, attempt_id: str, body: LocalSlotRelease) -> Answer:
        def send(token: str, node_rank: int) -> dict[str, Any]:
            request = SlotRelease(**body.model_dump(exclude={"fencing_token"}), fencing_token=token,
                                  node_rank=node_rank)
            return self.client.release_upload_slot(attempt_id, request).model_dump(mode="json")
        return self._relay(attempt_id, "upload_slot_release", send)

    def _relay(self, attempt_id: str, what: str, send: Callable[[str, int], dict[str, Any]]) -> Answer:
        target = self._target(attempt_id)
        if target is None:
            return HTTPStatus.CONFLICT, {"detail": f"attempt {attempt_id} is not running here"}
        try:
            return HTTPStatus.OK, send(*target)
        except StaleAttempt as exc:
            if exc.fencing:
                log.warning("upload_slot_stale_attempt", attempt_id=attempt_id, what=what)
                self._on_stale(attempt_id, exc)
                return HTTPStatus.CONFLICT, {"detail": f"stale attempt: {exc}"}
            return HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": str(exc), "upstream_status": exc.status}
        except Unauthorized:
            self._on_unauthorized()
            return HTTPStatus.SERVICE_UNAVAILABLE, {"detail": "the agent is registering again",
                                                    "retry_after_s": UNAVAILABLE_RETRY_S}
        except ControlPlaneUnavailable as exc:
            log.info("upload_slot_control_plane_unavailable", attempt_id=attempt_id, what=what, error=str(exc))
            return HTTPStatus.SERVICE_UNAVAILABLE, {"detail": f"the control plane cannot be reached: {exc}",
                                                    "retry_after_s": max(UNAVAILABLE_RETRY_S,
                                                                         exc.retry_after_s or 0.0)}
        except RequestRejected as exc:
            # 422, not the upstream status: a worker must not read a refusal as "fenced off".
            return HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": str(exc), "upstream_status": exc.status}
