"""trainyard/protocol/rendezvous.py: a store's client waits for the host's port itself, so that it
connects at once when the host comes up instead of at a step of torch's connect backoff."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.helpers import rendezvous_port
from trainyard.protocol.rendezvous import split_endpoint, wait_for_listener


def test_split_endpoint() -> None:
    assert split_endpoint("127.0.0.2:29500") == ("127.0.0.2", 29500)
    assert split_endpoint("[::1]:29500") == ("::1", 29500)
    for bad in ("127.0.0.2", ":1", "host:", "host:x"):
        with pytest.raises(ValueError):
            split_endpoint(bad)


def test_waits_through_refusals_until_the_host_listens_and_the_store_then_connects() -> None:
    port = rendezvous_port()
    result: list[int | None] = []
    thread = threading.Thread(target=lambda: result.append(wait_for_listener("127.0.0.1", port, 30)))
    thread.start()
    time.sleep(0.1)  # the client tries before the host exists (every 10 ms)
    host = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True, timeout=timedelta(seconds=30),
                         wait_for_workers=False)
    thread.join(30)
    assert result and result[0] is not None and result[0] >= 1
    # The probe left the host serving: a real client joins and sees what the host wrote.
    host.set("k", "v")
    joined = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timedelta(seconds=10))
    assert joined.get("k") == b"v"


def test_gives_up_at_its_timeout() -> None:
    assert wait_for_listener("127.0.0.1", rendezvous_port(), 0.05) is None


def test_torchruns_join_timeout_is_what_the_wait_left_of_it() -> None:
    """A host that never listens is noticed after one join timeout, not the wait's and then
    torchrun's own in full; the store keeps a floor for its later operations."""
    from node_agent.ranks.torchrun_entry import MIN_RDZV_TIMEOUT_S, with_timeout_left

    rest = ["--nnodes", "2", "--rdzv-conf", "timeout=300", "train.py", "--rdzv-conf", "timeout=9"]
    assert with_timeout_left(rest, 120.7) == ["--nnodes", "2", "--rdzv-conf", "timeout=120", "train.py",
                                              "--rdzv-conf", "timeout=9"]  # the script's own args untouched
    assert with_timeout_left(["--rdzv-conf", "a=1,timeout=300"], 0.2) == [
        "--rdzv-conf", f"a=1,timeout={MIN_RDZV_TIMEOUT_S}"]
    assert with_timeout_left(["train.py"], 5.0) == ["train.py"]
