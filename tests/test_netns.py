"""trainyard/dev/netns.py (issue 29): the layout's names, addresses and tc commands (pure), then real
network namespaces, bridges and token buckets on this machine (root): traffic between racks crosses
the shaped uplinks and traffic inside a rack does not, partitions cut what they say and heal, a
layout whose owner died is removed by the next one, and nothing is left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import need
from trainyard.dev.netns import Layout, NetnsError, Network, Shape, Topology, parse_rate, remove_stale


@pytest.fixture
def netns_tools() -> None:
    """Root, iproute2 and nsenter, or the test is skipped (failed in CI: TRAINYARD_TEST_STRICT=1)."""
    need(os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("nsenter") is not None,
         "network namespaces need root, iproute2 and nsenter")


root_only = pytest.mark.usefixtures("netns_tools")


def test_rates_parse_as_tc_writes_them_and_nonsense_is_refused() -> None:
    assert parse_rate("10gbit") == 10**10 and parse_rate("1.5Gbit") == 15 * 10**8 and parse_rate("200mbit") == 2 * 10**8
    for bad in ("10", "fast", "10gb", "-1mbit", "1000gbit", "1bit"):
        with pytest.raises(ValueError):
            parse_rate(bad)


@given(nodes=st.integers(1, 250), data=st.data())
def test_racks_are_contiguous_blocks_and_none_is_empty(nodes: int, data: st.DataObject) -> None:
    racks = data.draw(st.integers(1, nodes))
    topology = Topology(racks=racks)
    seen = [topology.rack_of(node, nodes) for node in range(1, nodes + 1)]
    assert seen == sorted(seen) and set(seen) == set(range(1, racks + 1))
    assert max(seen.count(r) for r in set(seen)) - min(seen.count(r) for r in set(seen)) <= 1


def test_names_fit_the_kernels_limit_and_every_link_end_is_shaped() -> None:
    top = Topology(racks=3, node_link=Shape(parse_rate("10gbit")), rack_uplink=Shape(parse_rate("1gbit")))
    layout = Layout(prefix="tyab12", subnet=201, nodes=250, topology=top)
    devices = {cmd[cmd.index("dev") + 1] for cmd in layout.build() if cmd[0] == "tc"}
    names = [layout.core, *(layout.rack_bridge(r) for r in (1, 2, 3)), *(layout.node_link(n) for n in (1, 250)),
             *layout.uplink(3), layout.namespace(250)]
    assert all(len(name) <= 15 for name in names), names  # IFNAMSIZ
    tbf = [cmd for cmd in layout.build() if cmd[0] == "tc"]
    # Both ends of each uplink and of each node's link: both directions shaped.
    assert {layout.uplink(r)[0] for r in (1, 2, 3)} | {layout.uplink(r)[1] for r in (1, 2, 3)} <= devices
    assert sum(1 for cmd in tbf if "eth0" in cmd) == 250 and all("tbf" in cmd for cmd in tbf)
    rates = {cmd[cmd.index("rate") + 1] for cmd in tbf}
    assert rates == {"10000000000bit", "1000000000bit"}
    assert layout.node_address(250) == "10.201.1.250" and layout.host_address == "10.201.0.1"
    delayed = Layout(prefix="tyab12", subnet=201, nodes=2,
                     topology=Topology(rack_uplink=Shape(parse_rate("1gbit"), delay_ms=0.2)))
    uplink = [cmd for cmd in delayed.build() if cmd[0] == "tc" and delayed.uplink(1)[0] in cmd]
    assert uplink[0][-5:-2] == ["netem", "delay", "0.2ms"] and "tbf" in uplink[1] and "parent" in uplink[1]


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="--racks"):
        Topology(racks=3).validate(2)
    with pytest.raises(ValueError):
        Layout(prefix="x; rm -rf", subnet=200, nodes=1, topology=Topology())
    with pytest.raises(ValueError):
        Shape(delay_ms=-1)


# --- on real namespaces ----------------------------------------------------------------------------

PROBE = """\
import socket, sys
s = socket.socket(); s.settimeout(2)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    s.sendall(b"x" * int(sys.argv[3])); s.shutdown(socket.SHUT_WR); s.recv(1)
    print("ok")
except OSError as exc:
    print(type(exc).__name__)
"""


class Sink:
    """A TCP server in a namespace (or on the host) that reads everything sent to it."""

    def __init__(self, network: Network, node: int | None) -> None:
        self.address = network.layout.host_address if node is None else network.layout.node_address(node)
        prefix = [] if node is None else network.exec_prefix(node)
        code = ("import socket, threading\n"
                f"s = socket.socket(); s.bind(({self.address!r}, 0)); s.listen(16)\n"
                "print(s.getsockname()[1], flush=True)\n"
                "def drain(c):\n    while c.recv(1 << 16): pass\n    c.sendall(b'k'); c.close()\n"
                "while True:\n    c, _ = s.accept(); threading.Thread(target=drain, args=(c,), daemon=True).start()\n")
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def send(network: Network, node: int, to: Sink, size: int = 1000) -> str:
    done = subprocess.run([*network.exec_prefix(node), sys.executable, "-c", PROBE, to.address, str(to.port),
                           str(size)], capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or done.stderr[-300:]


def sent_bytes(network: Network, dev: str, namespace: str | None = None) -> int:
    out = subprocess.run(["tc", *(["-n", namespace] if namespace else []), "-s", "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    return int(re.search(r"Sent (\d+) bytes", out)[1])  # type: ignore[index]


def leftovers(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [n for n in names if n.startswith(prefix)] + re.findall(rf"\d+: ({prefix}\w*)[@:]", links)


@pytest.fixture
def network(netns_tools: None, tmp_path: Path) -> Iterator[Network]:
    top = Topology(racks=2, node_link=Shape(parse_rate("400mbit")), rack_uplink=Shape(parse_rate("100mbit")))
    net = Network.up(3, top, run_dir=tmp_path / "run")
    try:
        yield net
    finally:
        net.down()
        assert leftovers(net.layout.prefix) == []


@root_only
def test_traffic_between_racks_crosses_the_shaped_uplinks_and_inside_a_rack_does_not(network: Network) -> None:
    lay = network.layout
    assert [lay.rack_of(n) for n in (1, 2, 3)] == [1, 1, 2]
    sinks = {node: Sink(network, node) for node in (2, 3)}
    try:
        up1, up2 = lay.uplink(1)[1], lay.uplink(2)[0]  # out of rack 1; into rack 2
        before = sent_bytes(network, up1), sent_bytes(network, up2)
        assert send(network, 1, sinks[2], 2_000_000) == "ok"  # same rack
        inside = sent_bytes(network, up1) - before[0], sent_bytes(network, up2) - before[1]
        assert send(network, 1, sinks[3], 2_000_000) == "ok"  # rack 1 to rack 2
        across = sent_bytes(network, up1) - before[0] - inside[0], sent_bytes(network, up2) - before[1] - inside[1]
        assert max(inside) < 100_000, inside  # a few broadcasts (ARP), not the 2 MB
        assert min(across) > 2_000_000, across
        assert sent_bytes(network, "eth0", lay.namespace(1)) > 4_000_000  # node 1's own link, both sends
    finally:
        for sink in sinks.values():
            sink.close()


@root_only
def test_partitions_cut_what_they_say_and_heal(network: Network) -> None:
    host, peer = Sink(network, None), Sink(network, 3)
    try:
        assert send(network, 1, host) == "ok" and send(network, 1, peer) == "ok"
        network.cut(1)  # node 1 from the host, both ways; node 1 still reaches node 3
        assert send(network, 1, host) != "ok" and send(network, 1, peer) == "ok" and send(network, 2, host) == "ok"
        network.heal()
        assert send(network, 1, host) == "ok"
        network.cut(1, direction="in")  # only what the host sends node 1 is dropped: no handshake either
        assert send(network, 1, host) == "TimeoutError"
        network.heal()
        network.cut(1, peer=3, direction="out")  # node 1 to node 3 only
        assert send(network, 1, peer) != "ok" and send(network, 1, host) == "ok" and send(network, 2, peer) == "ok"
        network.heal()
        network.link_down(2)  # a pulled cable
        assert send(network, 2, host) != "ok" and send(network, 1, host) == "ok"
        network.heal()
        assert all(send(network, node, host) == "ok" for node in (1, 2, 3))
    finally:
        host.close()
        peer.close()


@root_only
def test_a_layout_whose_owner_died_is_removed_by_the_next_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stale = Network.up(2, Topology(), run_dir=run_dir)
    record = run_dir / f"{stale.layout.prefix}.json"
    dead = subprocess.Popen(["true"])
    dead.wait()
    record.write_text(json.dumps({**json.loads(record.read_text()), "owner": dead.pid}))  # as if its run was killed
    assert leftovers(stale.layout.prefix)
    other = Network.up(1, Topology(), run_dir=run_dir)  # this process, but started "earlier": a reused pid
    other_record = run_dir / f"{other.layout.prefix}.json"
    other_record.write_text(json.dumps({**json.loads(other_record.read_text()), "owner_started": 1.0}))
    fresh = Network.up(1, Topology(), run_dir=run_dir)
    try:
        assert leftovers(stale.layout.prefix) == [] and not record.exists()
        assert leftovers(other.layout.prefix) == [] and not other_record.exists()
        assert remove_stale(run_dir) == []  # the live one is kept
        assert leftovers(fresh.layout.prefix)
    finally:
        fresh.down()
    assert leftovers(fresh.layout.prefix) == []


@root_only
def test_link_delay_is_applied_with_netem_or_refused_in_one_line_without(tmp_path: Path) -> None:
    from trainyard.dev.netns import netem_available

    topology = Topology(rack_uplink=Shape(parse_rate("1gbit"), delay_ms=0.2))
    if not netem_available():  # this development machine's kernel: tbf and htb, no netem
        with pytest.raises(NetnsError, match="netem"):
            Network.up(2, topology, run_dir=tmp_path / "run")
        return
    with Network.up(2, topology, run_dir=tmp_path / "run") as net:
        shown = subprocess.run(["tc", "qdisc", "show", "dev", net.layout.uplink(1)[0]], capture_output=True,
                               text=True, check=True).stdout
        assert "netem" in shown and "delay 200us" in shown and "tbf" in shown, shown


def test_not_root_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="needs root"):
        Network.up(2, Topology(), run_dir=tmp_path / "run")


@root_only
def test_in_a_nodes_namespace_gloo_is_told_the_interface_of_the_nodes_address(network: Network) -> None:
    """Without it gloo takes the address the host name resolves to, which no namespace has."""
    code = ("import sys; from node_agent.part.commands import interface_of; "
            "print(interface_of(sys.argv[1]), interface_of('192.0.2.250'))")
    done = subprocess.run([*network.exec_prefix(2), sys.executable, "-c", code, network.layout.node_address(2)],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.split() == ["eth0", "None"], done.stderr[-500:]


@pytest.mark.parametrize(("args", "said"), [
    (["--racks", "2"], "go with --netns"),
    (["--netns", "--node-link", "fast"], "link rate 'fast'"),
    (["--netns", "--nodes", "2", "--racks", "3"], "--racks must be between 1 and the number of nodes"),
    (["--netns", "--host", "0.0.0.0"], "--host goes without --netns"),
])
def test_dev_up_refuses_a_bad_network_in_one_line(args: list[str], said: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "trainyard", "dev", "up", "--data-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0 and said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
