"""The memory port against hosts that are not well-behaved peers: connection floods, slow senders,
huge announced bodies (node_agent/memtier/peer.py), over real TCP on loopback addresses (each
127.0.0.N stands for another host); and over real TLS with a node certificate from the cluster's CA."""

from __future__ import annotations

import hashlib
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from node_agent.memtier.peer import PeerLimits, PeerServer, serving
from node_agent.memtier.store import job_owner
from node_agent.memtier.tier import AttemptMemory, MemoryTier
from trainyard.dev.certs import ensure_server_tls
from trainyard.protocol.memtier import memory_grant

KEY = "k" * 64
"""Every test tier's grant key (an agent's is memory_grant_key of its credential)."""
GRANT = memory_grant(KEY, "job-1")

LIMITS = PeerLimits(request_timeout_s=1.0, connections_total=6, connections_per_peer=3, inflight_bytes=1 << 20)


@pytest.fixture
def port() -> Iterator[tuple[PeerServer, MemoryTier]]:
    tier = MemoryTier(1 << 20, grant_key=KEY, peer_timeout_s=5)
    with serving(tier, limits=LIMITS) as server:
        yield server, tier


def connect(server: PeerServer, source: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5, source_address=(source, 0))
    return sock


def answer_of(sock: socket.socket) -> bytes:
    """What the server says before it closes (b"" when it closes without a word)."""
    got = b""
    with sock:
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return got


def legitimate_peer_works(server: PeerServer, source: str = "127.0.0.2") -> bool:
    data = secrets.token_bytes(1000)
    url = f"http://127.0.0.1:{server.port}/v1/peer/jobs/job-1/shards/0/{hashlib.sha256(data).hexdigest()}"
    auth = {"Authorization": f"Bearer {GRANT}"}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=5, trust_env=False) as client:
        return (client.put(url, headers=auth, content=data).status_code == 201
                and client.get(url, headers=auth).content == data)


def test_a_flood_of_idle_connections_is_capped_per_host_and_times_out_while_another_peer_is_served(
        port: tuple[PeerServer, MemoryTier]) -> None:
    server, _ = port
    before = threading.active_count()
    flood = [connect(server, "127.0.0.1") for _ in range(20)]  # connect and send nothing
    deadline = time.monotonic() + 5
    while server.serving < LIMITS.connections_per_peer and time.monotonic() < deadline:
        time.sleep(0.01)
    # One host holds at most its share of threads; the rest are answered 503 without a thread.
    assert server.serving == LIMITS.connections_per_peer
    assert threading.active_count() - before <= LIMITS.connections_per_peer
    assert legitimate_peer_works(server)  # another host is served while the flood holds its share
    answers = [answer_of(sock) for sock in flood]
    busy = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(busy) == 20 - LIMITS.connections_per_peer and b"too many connections" in busy[0]
    assert len(timed_out) == LIMITS.connections_per_peer  # held ones are told 408 at their deadline, then closed
    assert server.serving == 0 or _settles(lambda: server.serving == 0)
    assert legitimate_peer_works(server, "127.0.0.1")  # the flooding host's share is free again


def test_a_slow_sender_is_cut_off_at_the_request_deadline(port: tuple[PeerServer, MemoryTier]) -> None:
    server, tier = port
    sock = connect(server, "127.0.0.3")
    request = (f"PUT /v1/peer/jobs/job-1/shards/0/{'0' * 64} HTTP/1.1\r\nHost: p\r\n"
               f"Authorization: Bearer {GRANT}\r\nX-Padding: {'p' * 200}\r\n").encode()
    started, cut = time.monotonic(), False
    for byte in request:  # one byte every 20 ms: each arrives well within any per-read timeout
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        time.sleep(0.02)
        if time.monotonic() - started > 4 * LIMITS.request_timeout_s:
            break
    answer = answer_of(sock)
    assert cut or answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 4 * LIMITS.request_timeout_s
    assert len(tier.store) == 0


def test_bodies_announced_beyond_what_may_be_in_flight_are_refused(port: tuple[PeerServer, MemoryTier]) -> None:
    server, tier = port
    size = LIMITS.inflight_bytes // 2 + 1  # type: ignore[operator]
    head = (f"PUT /v1/peer/jobs/job-1/shards/0/{'0' * 64} HTTP/1.1\r\nHost: p\r\n"
            f"Authorization: Bearer {GRANT}\r\nContent-Length: {size}\r\n\r\n").encode()
    first = connect(server, "127.0.0.4")
    first.sendall(head)  # and no body: it holds its bytes until its deadline
    deadline = time.monotonic() + 5
    while tier.inflight_held < size and time.monotonic() < deadline:
        time.sleep(0.01)
    second = connect(server, "127.0.0.5")
    second.sendall(head)
    refused = answer_of(second)
    assert refused.startswith(b"HTTP/1.1 503") and b"bytes are being received" in refused
    too_big = connect(server, "127.0.0.5")
    too_big.sendall(head.replace(str(size).encode(), str((1 << 20) + 1).encode()))
    assert answer_of(too_big).startswith(b"HTTP/1.1 413")
    assert answer_of(first).startswith(b"HTTP/1.1 408")
    assert _settles(lambda: tier.inflight_held == 0) and len(tier.store) == 0
    assert legitimate_peer_works(server)


def _settles(check: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_the_memory_port_speaks_tls_and_peers_verify_it_against_the_clusters_ca(tmp_path: Path) -> None:
    node = ensure_server_tls(tmp_path / "tls", ["127.0.0.1"], common_name="trainyard node-2", stem="node-2")
    stranger_ca = ensure_server_tls(tmp_path / "elsewhere", ["127.0.0.1"]).ca_file
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(node.cert_file, node.key_file)
    data = secrets.token_bytes(5000)
    digest = hashlib.sha256(data).hexdigest()
    peer_tier = MemoryTier(1 << 20, grant_key=KEY)
    with serving(peer_tier, tls=server_tls, limits=LIMITS) as server:
        assert server.scheme == "https"
        https_url = f"https://127.0.0.1:{server.port}"
        job = AttemptMemory("job-1", secrets.token_hex(32), https_url, grants={https_url: GRANT})
        trusted = MemoryTier(1 << 20, grant_key=KEY, peer_timeout_s=5,
                             peer_tls=ssl.create_default_context(cafile=node.ca_file), require_tls=True)
        trusted.put(job, 0, digest, data)
        assert trusted.wait_pushed(5) and trusted.pushed == 1 and trusted.push_failures == 0
        assert peer_tier.store.get(job.owner, "job-1", digest) is not None
        assert trusted.get(job, 0, digest, "peer") == data  # read back over TLS

        # A peer that does not trust the cluster's CA neither sends nor gets anything.
        stranger = MemoryTier(1 << 20, grant_key=KEY, peer_timeout_s=5,
                              peer_tls=ssl.create_default_context(cafile=stranger_ca))
        assert stranger.get(job, 0, digest, "peer") is None
        stranger.put(job, 1, digest, data)
        assert stranger.wait_pushed(5) and stranger.push_failures == 1 and stranger.pushed == 0
        # Plain HTTP to the TLS port gets no answer at all: no shard, no problem text in the clear.
        url = f"http://127.0.0.1:{server.port}/v1/peer/jobs/job-1/shards/0/{digest}"
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, headers={"Authorization": f"Bearer {GRANT}"}, timeout=5)
        assert trusted.get(job, 0, digest, "peer") == data  # failed handshakes cost the port nothing
        assert _settles(lambda: server.serving == 0)

    # An agent whose own port speaks TLS never talks to a plain-HTTP peer (the job's secret would go
    # over the network in the clear): a miss, nothing sent.
    plain_tier = MemoryTier(1 << 20, grant_key=KEY)
    with serving(plain_tier) as plain:
        plain_url = f"http://127.0.0.1:{plain.port}"
        clear = AttemptMemory("job-1", job.secret, plain_url, grants={plain_url: GRANT})
        trusted.put(clear, 0, digest, data)
        assert trusted.wait_pushed(5) and trusted.pushed == 1 and len(plain_tier.store) == 0
        assert trusted.get(clear, 0, digest, "peer") is None
    trusted.stop()
    stranger.stop()


def test_a_forged_bearer_neither_stores_reads_nor_evicts_and_a_granted_job_evicts_only_its_own(
        port: tuple[PeerServer, MemoryTier]) -> None:
    """Issue 23 finding 9: any bearer of 32+ characters once became an owner here and could evict
    every other job's shards by filling the budget. Now a request needs the control plane's grant of
    the job in its path for this node, and even a job with its grant stays within its share."""
    server, tier = port
    base = f"http://127.0.0.1:{server.port}/v1/peer/jobs"
    victim = secrets.token_bytes(300 << 10)
    victim_url = f"{base}/job-1/shards/0/{hashlib.sha256(victim).hexdigest()}"
    with httpx.Client(timeout=5, trust_env=False) as client:
        assert client.put(victim_url, headers={"Authorization": f"Bearer {GRANT}"}, content=victim).status_code == 201
        forged = [secrets.token_hex(32), "s" * 40, memory_grant(KEY, "job-2"), memory_grant("other-node" * 8, "job-1")]
        for bearer in forged:  # a guess, another job's grant, job-1's grant for another node
            auth = {"Authorization": f"Bearer {bearer}"}
            assert client.get(victim_url, headers=auth).status_code == 401
            for i in range(4):
                junk = secrets.token_bytes(300 << 10)
                answer = client.put(f"{base}/job-1/shards/{i}/{hashlib.sha256(junk).hexdigest()}", headers=auth,
                                    content=junk)
                assert answer.status_code == 401 and answer.headers["content-type"] == "application/problem+json"
        assert len(tier.store) == 1
        # Job 2, with its own grant, fills what it may: only its own oldest entries make room.
        auth = {"Authorization": f"Bearer {memory_grant(KEY, 'job-2')}"}
        for i in range(6):
            junk = secrets.token_bytes(300 << 10)
            answer = client.put(f"{base}/job-2/shards/{i}/{hashlib.sha256(junk).hexdigest()}", headers=auth,
                                content=junk)
            assert answer.status_code == 201, answer.text
        assert tier.store.job_bytes(job_owner("job-2"), "job-2") <= tier.store.budget_bytes // 2
        assert client.get(victim_url, headers={"Authorization": f"Bearer {GRANT}"}).content == victim
