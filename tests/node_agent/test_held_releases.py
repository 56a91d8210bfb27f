"""The agent holds the slot releases a control plane could not take (node_agent/link/upload_slots.py):
with the control plane unreachable for real (a closed port), each release is answered ``held`` at
once and kept; one attempt's workers (another tenant's code) cannot take the room the parts beside
it need; an ask for the same slot drops its held release; closing stops the resends. What a busy
control plane does with the resends is tested against a real one in
tests/control_plane/test_upload_batches.py."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import pytest

from node_agent.link import upload_slots
from node_agent.link.client import ControlPlaneClient, RetryPolicy
from node_agent.link.upload_slots import SlotRelay
from trainyard.embedded import free_port
from trainyard.protocol.uploads import LocalSlotRelease, LocalSlotRequest

TOKEN = "t" * 32


def _relay() -> tuple[SlotRelay, list[str]]:
    client = ControlPlaneClient(f"http://127.0.0.1:{free_port()}", join_token="j", timeout_s=1.0,
                                retry=RetryPolicy(attempts=1))  # nothing listens there
    client.node_token = "n"
    stale: list[str] = []
    relay = SlotRelay(client, target=lambda attempt: ("f" * 32, 0), on_stale=lambda a, exc: stale.append(a),
                      on_unauthorized=lambda: None, window_s=0.0)
    return relay, stale


def _release(relay: SlotRelay, attempt: str, step: int, rank: int = 0) -> tuple[HTTPStatus, dict[str, Any]]:
    return relay.release(attempt, LocalSlotRelease(fencing_token=TOKEN, rank=rank, step=step, ok=True,
                                                   uploaded_bytes=1, upload_s=0.1))


def test_an_attempt_holds_at_most_its_share_and_the_parts_beside_it_keep_theirs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload_slots, "RELEASES_HELD_PER_ATTEMPT", 3)
    relay, stale = _relay()
    try:
        answers = [_release(relay, "hostile", step) for step in range(5)]
        assert [a[0] for a in answers] == [HTTPStatus.OK] * 3 + [HTTPStatus.SERVICE_UNAVAILABLE] * 2
        assert all(a[1] == {"released": False, "held": True} for a in answers[:3])
        assert answers[3][1]["retry_after_s"] > 0  # past its share: the worker retries, as before holding
        assert _release(relay, "neighbour", 1) == (HTTPStatus.OK, {"released": False, "held": True})
        assert relay.held() == 4 and stale == []
    finally:
        relay.close()


def test_an_ask_for_the_same_slot_drops_its_held_release_and_close_stops_holding() -> None:
    relay, _ = _relay()
    try:
        assert _release(relay, "a", 10, rank=3)[1] == {"released": False, "held": True}
        assert _release(relay, "a", 10, rank=4)[1] == {"released": False, "held": True}
        status, _ = relay.ask("a", LocalSlotRequest(fencing_token=TOKEN, rank=3, step=10, size_bytes=1, wait_s=0))
        assert status == HTTPStatus.SERVICE_UNAVAILABLE  # the ask itself is unreachable too
        assert relay.held() == 1  # rank 3's release went: its ask renews that slot
        relay.close()
        assert _release(relay, "a", 11)[0] == HTTPStatus.SERVICE_UNAVAILABLE  # closed: nothing more is held
    finally:
        relay.close()
