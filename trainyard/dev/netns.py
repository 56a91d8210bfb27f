"""Nodes on real networks (issue 29): a dev cluster's nodes, each in a network namespace of its own,
on bridges joined by links with real limits, so that what the platform says about communication
and partitions is measured on links no faster than a cluster's, not on one kernel's loopback.

One cluster's layout (``prefix`` makes its names unique on the machine, ``10.<subnet>.0.0/16`` holds
its addresses, one L2 domain)::

    host side: the core bridge <p>c at 10.S.0.1 (the control plane, PostgreSQL, S3 listen there)
      rack r: bridge <p>r<r>, joined to the core by the veth pair <p>u<r> / <p>v<r> (its uplink)
        node i: namespace <p>-n<i>; veth <p>n<i> on its rack's bridge, eth0 at 10.S.1.<i> inside

Limits are token buckets (tc tbf) on the egress of both ends of a link, so both directions are
shaped: a node's own link (what it sends and what it receives), and its rack's uplink, which the
rack's nodes share for everything that leaves the rack (to other racks, to the host: the control
plane and S3). Delay, jitter and loss need the netem qdisc: where the kernel has none (the 2-core
development machine's has tbf and htb but neither netem nor tc actions), asking for them is an
error that says so.

Partitions (``cut``): a node's link down (both directions), or a blackhole route on one side for
the other side's address (one direction: what that side sends is dropped, so TCP's handshakes and
answers fail too, as with an asymmetric cut in a real network), between a node and the host or
between two nodes.

``down`` removes the namespaces (the veth ends inside go with them) and the bridges and veths on
the host. Each layout is recorded in ``/run/trainyard-netns/<prefix>.json`` with the pid that owns
it; ``up`` first removes every recorded layout whose owner is gone (a killed run).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

RUN_DIR = Path("/run/trainyard-netns")
MAX_NODES = 250
TBF_LATENCY = "100ms"
"""How long a packet may wait in a link's bucket before it is dropped: a cluster switch's buffer."""
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class NetnsError(RuntimeError):
    """A layout that cannot be built here, said in one line."""


def parse_rate(text: str) -> int:
    """A link rate as tc writes it (``100mbit``, ``10gbit``, ``1.5gbit``) in bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)", text.strip().lower())
    if match is None:
        raise ValueError(f"link rate {text!r}: a number and bit, kbit, mbit or gbit (e.g. 10gbit)")
    bits = int(float(match[1]) * _UNITS[match[2]])
    if not 8_000 <= bits <= 400 * 10**9:
        raise ValueError(f"link rate {text!r}: between 8kbit and 400gbit")
    return bits


@dataclass(frozen=True)
class Shape:
    """One link's limits, the same in both directions."""

    rate_bits: int | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.delay_ms > 10_000:
            raise ValueError("link delay must be between 0 and 10000 ms")

    @property
    def shaped(self) -> bool:
        return self.rate_bits is not None or self.delay_ms > 0


@dataclass(frozen=True)
class Topology:
    """Racks and link limits. Nodes go to racks in contiguous blocks (nodes 1-2 in rack 1 and 3-4 in
    rack 2 of a 4-node, 2-rack layout), as a scheduler's rack labels would show them."""

    racks: int = 1
    node_link: Shape = field(default_factory=Shape)
    rack_uplink: Shape = field(default_factory=Shape)

    def rack_of(self, node: int, nodes: int) -> int:
        """Node ``node``'s rack (both 1-based)."""
        if not 1 <= node <= nodes:
            raise ValueError(f"node {node} of {nodes}")
        return (node - 1) * self.racks // nodes + 1

    def validate(self, nodes: int) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"a network layout holds 1 to {MAX_NODES} nodes")
        if not 1 <= self.racks <= nodes:
            raise ValueError(f"--racks must be between 1 and the number of nodes ({nodes})")

    @property
    def needs_netem(self) -> bool:
        return self.node_link.delay_ms > 0 or self.rack_uplink.delay_ms > 0


@dataclass(frozen=True)
class Layout:
    """The names, addresses and commands of one cluster's network (pure: nothing runs here)."""

    prefix: str
    subnet: int
    nodes: int
    topology: Topology

    def __post_init__(self) -> None:
        if not re.fullmatch(r"ty[0-9a-f]{4}", self.prefix):
            raise ValueError(f"layout prefix {self.prefix!r}: 'ty' and 4 hex digits")
        if not 16 <= self.subnet <= 254:
            raise ValueError("subnet must be 10.16-254.0.0/16")
        self.topology.validate(self.nodes)

    @property
    def host_address(self) -> str:
        return f"10.{self.subnet}.0.1"

    def node_address(self, node: int) -> str:
        return f"10.{self.subnet}.1.{node}"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def node_link(self, node: int) -> str:
        """The host end of node ``node``'s link (on its rack's bridge)."""
        return f"{self.prefix}n{node}"

    @property
    def core(self) -> str:
        return f"{self.prefix}c"

    def rack_bridge(self, rack: int) -> str:
        return f"{self.prefix}r{rack}"

    def uplink(self, rack: int) -> tuple[str, str]:
        """(the core's end, the rack's end) of rack ``rack``'s uplink."""
        return f"{self.prefix}u{rack}", f"{self.prefix}v{rack}"

    def rack_of(self, node: int) -> int:
        return self.topology.rack_of(node, self.nodes)

    def build(self) -> list[list[str]]:
        """Every ``ip`` and ``tc`` command that builds the layout, in order."""
        cidr = "/16"
        cmds = [
            ["ip", "link", "add", self.core, "type", "bridge"],
            ["ip", "addr", "add", self.host_address + cidr, "dev", self.core],
            ["ip", "link", "set", self.core, "up"],
        ]
        for rack in range(1, self.topology.racks + 1):
            bridge, (up_core, up_rack) = self.rack_bridge(rack), self.uplink(rack)
            cmds += [
                ["ip", "link", "add", bridge, "type", "bridge"],
                ["ip", "link", "set", bridge, "up"],
                ["ip", "link", "add", up_core, "type", "veth", "peer", "name", up_rack],
                ["ip", "link", "set", up_core, "master", self.core, "up"],
                ["ip", "link", "set", up_rack, "master", bridge, "up"],
                *_shape(up_core, self.topology.rack_uplink),  # into the rack
                *_shape(up_rack, self.topology.rack_uplink),  # out of it
            ]
        for node in range(1, self.nodes + 1):
            ns, link, inner = self.namespace(node), self.node_link(node), f"{self.prefix}m{node}"
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "link", "add", link, "type", "veth", "peer", "name", inner, "netns", ns],
                ["ip", "-n", ns, "link", "set", inner, "name", "eth0"],
                ["ip", "-n", ns, "addr", "add", self.node_address(node) + cidr, "dev", "eth0"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
                ["ip", "link", "set", link, "master", self.rack_bridge(self.rack_of(node)), "up"],
                *_shape(link, self.topology.node_link),  # to the node
                *_shape("eth0", self.topology.node_link, ns),  # from it
            ]
        return cmds

    def teardown(self) -> list[list[str]]:
        """What removes it; each may fail (already gone) without stopping the others."""
        cmds = [["ip", "netns", "del", self.namespace(node)] for node in range(1, self.nodes + 1)]
        cmds += [["ip", "link", "del", self.node_link(node)] for node in range(1, self.nodes + 1)]
        for rack in range(1, self.topology.racks + 1):
            cmds += [["ip", "link", "del", self.uplink(rack)[0]], ["ip", "link", "del", self.rack_bridge(rack)]]
        return [*cmds, ["ip", "link", "del", self.core]]

    def record(self, owner: int, started: float | None) -> dict[str, object]:
        return {"prefix": self.prefix, "subnet": self.subnet, "nodes": self.nodes, "racks": self.topology.racks,
                "owner": owner, "owner_started": started}

    @classmethod
    def from_record(cls, record: dict[str, object]) -> Layout:
        return cls(prefix=str(record["prefix"]), subnet=int(str(record["subnet"])), nodes=int(str(record["nodes"])),
                   topology=Topology(racks=int(str(record["racks"]))))


def _shape(dev: str, shape: Shape, namespace: str | None = None) -> list[list[str]]:
    """tc commands limiting ``dev``'s egress to ``shape``: netem for delay (with tbf under it for
    the rate), tbf alone for a rate."""
    if not shape.shaped:
        return []
    tc = ["tc", *(["-n", namespace] if namespace else []), "qdisc", "add", "dev", dev]
    tbf: list[str] = []
    if shape.rate_bits is not None:
        burst = max(32 * 1024, shape.rate_bits // 8 // 100)  # 10 ms of the rate: a timer tick or two
        tbf = ["tbf", "rate", f"{shape.rate_bits}bit", "burst", str(burst), "latency", TBF_LATENCY]
    if shape.delay_ms <= 0:
        return [[*tc, "root", *tbf]]
    cmds = [[*tc, "root", "handle", "1:", "netem", "delay", f"{shape.delay_ms}ms", "limit", "100000"]]
    return cmds + ([[*tc, "parent", "1:1", "handle", "10:", *tbf]] if tbf else [])


# --- on this machine -------------------------------------------------------------------------------


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise NetnsError(f"{cmd[0]} is not installed (iproute2): needed for --netns") from exc
    if check and done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())
        raise NetnsError(f"{' '.join(cmd)}: {said}")
    return done


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _owner_alive(pid: int, started: float | None) -> bool:
    """The process that built a layout still runs: that pid, not a zombie, started when recorded (a
    pid reused after a crash must not keep a dead run's layout forever)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (started is None or abs(proc.create_time() - started) < 0.01)
    except psutil.Error:
        return False


LOCK = Path("/run/trainyard-netns.lock")
"""One lock for the machine, whatever the record directory: two layouts built at once must not take
the same 10.x network."""


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _taken_subnets() -> set[int]:
    """Second octets of the 10.x networks this machine's host side already has addresses or
    routes in (another layout's, or the machine's own)."""
    text = _run(["ip", "-o", "-4", "addr", "show"]).stdout + _run(["ip", "-4", "route", "show"]).stdout
    return {int(m) for m in re.findall(r"\b10\.(\d{1,3})\.", text)}


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delay, jitter, loss), tried on a throwaway veth."""
    name = f"tyq{secrets.token_hex(3)}"
    if _run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"], check=False).returncode:
        return False
    try:
        return _run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms"], check=False).returncode == 0
    finally:
        _run(["ip", "link", "del", name], check=False)


def remove_stale(run_dir: Path = RUN_DIR) -> list[str]:
    """Remove the recorded layouts whose owner process is gone; their prefixes."""
    with _locked(run_dir):
        return _remove_stale(run_dir)


def _records(run_dir: Path) -> Iterator[tuple[Path, Layout | None, int, float | None]]:
    for path in sorted(run_dir.glob("ty*.json")):
        try:
            record = json.loads(path.read_text())
            started = record.get("owner_started")
            yield (path, Layout.from_record(record), int(record["owner"]),
                   None if started is None else float(started))
        except (OSError, ValueError, KeyError, TypeError):
            yield path, None, 0, None


def _remove_stale(run_dir: Path) -> list[str]:
    removed = []
    for path, layout, owner, started in _records(run_dir):
        if layout is not None and _owner_alive(owner, started):
            continue
        for cmd in layout.teardown() if layout is not None else []:
            _run(cmd, check=False)
        path.unlink(missing_ok=True)
        if layout is not None:
            removed.append(layout.prefix)
    return removed


class Network:
    """One built layout: ``Network.up(...)``, ``down()`` (idempotent), the command prefix that runs a
    program in a node's namespace, and partitions."""

    def __init__(self, layout: Layout, run_dir: Path = RUN_DIR) -> None:
        self.layout = layout
        self.run_dir = run_dir
        self._cuts: list[list[str]] = []
        self._up = False

    @classmethod
    def up(cls, nodes: int, topology: Topology, run_dir: Path = RUN_DIR) -> Network:
        """Build a new layout (root only), after removing stale ones; raises NetnsError."""
        if os.geteuid() != 0:
            raise NetnsError(f"--netns needs root (network namespaces, bridges, tc); running as uid {os.geteuid()}")
        try:
            topology.validate(nodes)
        except ValueError as exc:
            raise NetnsError(str(exc)) from exc
        if topology.needs_netem and not netem_available():
            raise NetnsError("link delay needs the kernel's netem qdisc (sch_netem), which this kernel does not "
                             "have; shape rates only (tbf), or run on a kernel with netem")
        with _locked(run_dir):  # built under the lock: the next layout sees this one's addresses
            _remove_stale(run_dir)
            taken = _taken_subnets() | {layout.subnet for _, layout, _, _ in _records(run_dir) if layout is not None}
            subnet = next((s for s in [*range(200, 255), *range(16, 200)] if s not in taken), None)
            if subnet is None:
                raise NetnsError("no free 10.x.0.0/16 network on this machine for the layout")
            names = _run(["ip", "-o", "link", "show"]).stdout + _run(["ip", "netns", "list"]).stdout
            prefix = "ty" + next(p for p in iter(lambda: secrets.token_hex(2), None)
                                 if not (run_dir / f"ty{p}.json").exists() and f"ty{p}" not in names)
            layout = Layout(prefix=prefix, subnet=subnet, nodes=nodes, topology=topology)
            (run_dir / f"{prefix}.json").write_text(json.dumps(layout.record(os.getpid(), _started(os.getpid()))))
            network = cls(layout, run_dir)
            network._up = True
            try:
                for cmd in layout.build():
                    _run(cmd)
            except NetnsError:
                network.down()
                raise
        return network

    def exec_prefix(self, node: int) -> list[str]:
        """Run what follows in node ``node``'s namespace (its network alone: the mounts, /sys and the
        cgroups stay the host's, which ``ip netns exec`` would remount)."""
        return ["nsenter", f"--net=/run/netns/{self.layout.namespace(node)}", "--"]

    def cut(self, node: int, *, peer: int | None = None, direction: str = "both") -> None:
        """Partition node ``node`` from the host (``peer`` None) or from node ``peer``. ``direction``:
        ``both``; ``out`` (what ``node`` sends is dropped); ``in`` (what it is sent is dropped)."""
        if direction not in ("both", "in", "out"):
            raise ValueError("direction is both, in or out")
        lay = self.layout
        theirs = lay.host_address if peer is None else lay.node_address(peer)
        mine = lay.node_address(node)
        routes = []
        if direction in ("both", "out"):
            routes.append(["ip", "-n", lay.namespace(node), "route", "add", "blackhole", f"{theirs}/32"])
        if direction in ("both", "in"):
            routes.append(["ip", *(["-n", lay.namespace(peer)] if peer is not None else []),
                           "route", "add", "blackhole", f"{mine}/32"])
        for cmd in routes:
            _run(cmd)
            self._cuts.append(cmd)

    def link_down(self, node: int) -> None:
        """Node ``node``'s link down: cut from everything, both ways (a pulled cable)."""
        _run(["ip", "link", "set", self.layout.node_link(node), "down"])

    def heal(self) -> None:
        """Undo every cut and bring every node's link up."""
        for cmd in reversed(self._cuts):
            _run([*cmd[:cmd.index("add")], "del", *cmd[cmd.index("add") + 1:]], check=False)
        self._cuts.clear()
        for node in range(1, self.layout.nodes + 1):
            _run(["ip", "link", "set", self.layout.node_link(node), "up"], check=False)

    def down(self) -> None:
        if not self._up:
            return
        for cmd in self.layout.teardown():
            _run(cmd, check=False)
        (self.run_dir / f"{self.layout.prefix}.json").unlink(missing_ok=True)
        self._up = False

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
