"""HTTPS for the control plane (issue 11, finding 4: the README said HTTPS, there was none).

A real ``trainyard server --tls-cert --tls-key`` on real PostgreSQL; real agents (the client and the
whole Agent) that verify its certificate against their CA. The dev cluster's HTTPS is exercised by
every end-to-end test (tests/e2e/conftest.py and harness.py check that they talk HTTPS to it).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import sqlalchemy

from node_agent.agent import Agent, AgentConfig
from node_agent.link.client import ControlPlaneClient, ControlPlaneUnavailable, StaleAttempt, TlsMismatch
from tests.factories import ADMIN, ADMIN_TOKEN, JOIN_TOKEN
from tests.helpers import ProcessReaper, free_port, wait_for
from trainyard.cli import main
from trainyard.cli.tls import client_context
from trainyard.dev.certs import ensure_server_tls
from trainyard.protocol.agent import GpuInfo, RegisterRequest
from trainyard.protocol.grants import StorageRequest
from trainyard.protocol.memtier import memory_grant_key

ROOT = Path(__file__).resolve().parents[1]


class Server(NamedTuple):
    url: str
    port: int
    ca_file: Path


@pytest.fixture
def https_server(tmp_path: Path, fresh_database_url: str, process_reaper: ProcessReaper) -> Iterator[Server]:
    tls = ensure_server_tls(tmp_path / "tls", ["127.0.0.1"])
    port = free_port()
    env = {**os.environ, "TRAINYARD_DATABASE_URL": fresh_database_url, "TRAINYARD_ADMIN_TOKEN": ADMIN_TOKEN,
           "TRAINYARD_JOIN_TOKEN": JOIN_TOKEN, "TRAINYARD_LOG_JSON": "false"}
    log = (tmp_path / "server.log").open("wb")
    proc = process_reaper.spawn(
        [sys.executable, "-m", "trainyard", "server", "--port", str(port), "--tls-cert", str(tls.cert_file),
         "--tls-key", str(tls.key_file)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"https://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        try:
            return httpx.get(f"{url}/readyz", verify=client_context(tls.ca_file), timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, 60, 0.2, what="the HTTPS control plane")
    yield Server(url, port, tls.ca_file)
    log.close()


def _register(url: str, ca_file: Path | None, name: str = "n1") -> str:
    client = ControlPlaneClient(url, join_token=JOIN_TOKEN, ca_file=str(ca_file) if ca_file else None)
    try:
        gpu = GpuInfo(index=0, uuid=f"virtual-{name}-0", kind="virtual-cpu", memory_mb=0)
        return client.register(RegisterRequest(name=name, address="127.0.0.1", gpus=[gpu])).node_id
    finally:
        client.close()


def test_agents_trust_only_a_server_certificate_signed_by_their_ca(https_server: Server, tmp_path: Path) -> None:
    assert _register(https_server.url, https_server.ca_file)  # the positive control
    stranger = ensure_server_tls(tmp_path / "another-ca", ["127.0.0.1"]).ca_file
    for ca_file in (stranger, None):  # another CA, or the system's trust store
        with pytest.raises(TlsMismatch, match="does not trust .*--ca-file"):
            _register(https_server.url, ca_file, name="n2")
    # Plain HTTP to the HTTPS port: the server hangs up, and the error says what to try.
    with pytest.raises(ControlPlaneUnavailable, match="use an https:// URL"):
        _register(f"http://127.0.0.1:{https_server.port}", None, name="n3")
    nodes = httpx.get(f"{https_server.url}/v1/nodes", headers=ADMIN, verify=client_context(https_server.ca_file))
    assert [n["name"] for n in nodes.json()] == ["n1"]


@pytest.mark.parametrize("how", ["close", "reset"])
def test_plain_http_to_a_server_that_hangs_up_hints_at_https(how: str) -> None:
    """An HTTPS server given plain HTTP hangs up: with a clean close or with a reset, depending on
    when its TLS layer gives up (CI saw the reset). Either way the error says what to try."""
    listener = socket.create_server(("127.0.0.1", 0))

    def hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            if how == "reset":  # linger 0: close() sends RST instead of FIN
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        with pytest.raises(ControlPlaneUnavailable, match="use an https:// URL"):
            _register(f"http://127.0.0.1:{listener.getsockname()[1]}", None)
    finally:
        listener.close()


def test_https_to_a_plain_http_server_says_so() -> None:
    class Plain(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - stdlib naming
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(TlsMismatch, match="does not speak TLS"):
            _register(f"https://127.0.0.1:{server.server_address[1]}", None)
    finally:
        server.shutdown()
        server.server_close()


def test_an_agent_with_another_ca_never_registers(https_server: Server, tmp_path: Path) -> None:
    stranger = ensure_server_tls(tmp_path / "another-ca", ["127.0.0.1"]).ca_file
    agents = {}
    for name, ca_file in (("wrong-ca", stranger), ("right-ca", https_server.ca_file)):
        agents[name] = Agent(AgentConfig(control_plane_url=https_server.url, ca_file=ca_file, join_token=JOIN_TOKEN,
                                         name=name, address="127.0.0.2", virtual_gpus=1, work_dir=tmp_path / name))
    try:
        for agent in agents.values():
            agent.start()
        assert agents["right-ca"].state.registered.wait(30)
        wait_for(lambda: agents["wrong-ca"].heartbeat._register_failures >= 2, 30, what="two refused registrations")
        assert not agents["wrong-ca"].state.registered.is_set()
    finally:
        for agent in agents.values():
            agent.stop(timeout=5)
    nodes = httpx.get(f"{https_server.url}/v1/nodes", headers=ADMIN, verify=client_context(https_server.ca_file))
    assert [n["name"] for n in nodes.json()] == ["right-ca"]


def test_the_server_refuses_a_bad_certificate_pair_in_one_line(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    one = ensure_server_tls(tmp_path / "one", ["127.0.0.1"])
    two = ensure_server_tls(tmp_path / "two", ["127.0.0.1"])
    for argv, said in (
        (["--tls-cert", str(one.cert_file)], "--tls-cert and --tls-key go together"),
        (["--tls-cert", str(one.cert_file), "--tls-key", str(two.key_file)], "cannot use the TLS certificate"),
        (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(one.key_file)], "cannot use the TLS"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["server", "--port", str(free_port()), *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_the_dev_ca_is_kept_and_the_server_certificate_follows_the_hosts(tmp_path: Path) -> None:
    first = ensure_server_tls(tmp_path / "tls", ["127.0.0.1", "localhost"])
    ca, cert = first.ca_file.read_bytes(), first.cert_file.read_bytes()
    again = ensure_server_tls(tmp_path / "tls", ["127.0.0.1", "localhost"])
    assert (again.ca_file.read_bytes(), again.cert_file.read_bytes()) == (ca, cert)  # nothing to renew
    moved = ensure_server_tls(tmp_path / "tls", ["127.0.0.1", "10.0.0.7"])
    assert moved.ca_file.read_bytes() == ca and moved.cert_file.read_bytes() != cert  # the CA stays trusted
    for private in (moved.key_file, tmp_path / "tls" / "ca-key.pem"):
        assert private.stat().st_mode & 0o077 == 0


def test_calls_for_workers_from_many_threads_share_a_few_connections(https_server: Server) -> None:
    """The local API answers each worker connection on a new thread; the storage requests it
    forwards borrow pooled clients instead of leaving one client (and its TLS connection) per thread."""
    client = ControlPlaneClient(https_server.url, join_token=JOIN_TOKEN, ca_file=str(https_server.ca_file))
    gpu = GpuInfo(index=0, uuid="virtual-p-0", kind="virtual-cpu", memory_mb=0)
    client.register(RegisterRequest(name="p", address="127.0.0.1", gpus=[gpu]))
    request = StorageRequest(fencing_token="f", node_rank=0, rank=0, method="GET", key="jobs/x/checkpoints/k")
    answers: list[str] = []

    def ask() -> None:
        try:
            client.storage_grants(str(uuid.uuid4()), request)
        except StaleAttempt as exc:  # no such attempt: refused, over a working connection
            answers.append(type(exc).__name__)

    try:
        for _ in range(12):
            thread = threading.Thread(target=ask)
            thread.start()
            thread.join()
        assert answers == ["StaleAttempt"] * 12
        assert len(client._clients) <= 2  # the registering thread's, and one pooled
    finally:
        client.close()


def test_the_cli_verifies_the_control_plane_with_trainyard_ca_file(
        https_server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRAINYARD_URL", https_server.url)
    monkeypatch.setenv("TRAINYARD_TOKEN", ADMIN_TOKEN)
    monkeypatch.delenv("TRAINYARD_CA_FILE", raising=False)
    with pytest.raises(SystemExit) as untrusted:  # the system's trust store does not know the cluster's CA
        main(["whoami"])
    err = capsys.readouterr().err
    assert untrusted.value.code == 1 and "not trusted here" in err and "TRAINYARD_CA_FILE" in err, err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setenv("TRAINYARD_CA_FILE", str(https_server.ca_file))
    with pytest.raises(SystemExit) as trusted:
        main(["whoami", "--output", "json"])
    out, err = capsys.readouterr()
    assert trusted.value.code == 0 and json.loads(out)["role"] == "admin", err


def test_an_agent_with_a_node_certificate_serves_its_memory_port_over_tls(
        https_server: Server, fresh_database_url: str, tmp_path: Path) -> None:
    node = ensure_server_tls(tmp_path / "tls", ["127.0.0.2"], common_name="trainyard tls-node", stem="tls-node")
    base = {"control_plane_url": https_server.url, "ca_file": https_server.ca_file, "join_token": JOIN_TOKEN,
            "name": "tls-node", "address": "127.0.0.2", "virtual_gpus": 1, "work_dir": tmp_path / "agent",
            "memory_tier_mb": 1}
    with pytest.raises(ValueError, match="go together"):
        AgentConfig(**base, memory_tls_cert=node.cert_file)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot use the memory TLS certificate"):
        AgentConfig(**base, memory_tls_cert=node.cert_file, memory_tls_key=https_server.ca_file)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs ca_file"):
        AgentConfig(**{**base, "ca_file": None}, memory_tls_cert=node.cert_file,  # type: ignore[arg-type]
                    memory_tls_key=node.key_file)
    agent = Agent(AgentConfig(**base, memory_tls_cert=node.cert_file, memory_tls_key=node.key_file))  # type: ignore[arg-type]
    try:
        agent.start()
        assert agent.state.registered.wait(30) and agent.state.memory_port is not None
        assert agent.state.memory is not None and agent.state.memory.require_tls
        # Its port accepts the grants the control plane derives from its credential (issue 23, finding 9).
        token = agent.state.client.node_token
        assert token and agent.state.memory.grant_key == memory_grant_key(token)
        with socket.create_connection(("127.0.0.2", agent.state.memory_port), timeout=5) as raw, \
                client_context(https_server.ca_file).wrap_socket(raw, server_hostname="127.0.0.2") as tls:
            assert tls.version() is not None  # the cluster's CA vouches for the node's certificate
        # Registered as such: its peers are handed an https:// URL (services/checkpoints/memtier.py).
        engine = sqlalchemy.create_engine(fresh_database_url)
        try:
            with engine.connect() as conn:
                row = conn.execute(sqlalchemy.text("SELECT memory_port, memory_tls FROM nodes WHERE name = 'tls-node'"))
                assert tuple(row.one()) == (agent.state.memory_port, True)
        finally:
            engine.dispose()
    finally:
        agent.stop(timeout=5)


def test_without_a_node_certificate_the_memory_port_is_plain_http_only_when_the_operator_asks(tmp_path: Path) -> None:
    """Issue 23 finding 9: shards and grants never cross the network in clear by default."""
    base = {"control_plane_url": "http://127.0.0.1:9", "join_token": "j", "name": "n", "address": "127.0.0.2",
            "virtual_gpus": 1, "work_dir": tmp_path / "agent", "memory_tier_mb": 1}
    off = Agent(AgentConfig(**base))  # type: ignore[arg-type]
    off._start_memory_tier()
    # Registered without a memory port: no peer for anyone.
    assert off.state.memory is None and off.state.memory_port is None
    plain = Agent(AgentConfig(**base, memory_plain_http=True))  # type: ignore[arg-type]
    plain._start_memory_tier()
    try:
        memory = plain.state.memory
        assert memory is not None and plain.state.memory_port is not None and not memory.require_tls
    finally:
        assert plain._peer_server is not None
        plain._peer_server.stop()
