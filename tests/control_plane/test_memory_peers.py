"""The in-memory checkpoint tier at allocation: each part's peer on another failure domain, the
previous attempt's copies as restore sources, and the job's memory secret given to agents only."""

from __future__ import annotations

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.services.checkpoints.memtier import PeerNode, choose_peer, peer_url
from control_plane.services.checkpoints.memtier_facts import restored_tiers
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for
from trainyard.protocol.memtier import memory_grant, memory_grant_key

_node = st.tuples(st.uuids(), st.sampled_from(["", "r1", "r2", "r3"]))


@settings(max_examples=100, deadline=None)
@given(me=_node, others=st.lists(_node, max_size=6), seed=st.text(max_size=10))
def test_a_peer_is_another_node_on_another_domain_whenever_one_exists(
        me: tuple[uuid.UUID, str], others: list[tuple[uuid.UUID, str]], seed: str) -> None:
    candidates = [PeerNode(n, d, f"http://h{i}:1") for i, (n, d) in enumerate([me, *others])]
    peer = choose_peer(me[0], me[1], candidates, seed)
    rest = [c for c in candidates if c.node_id != me[0]]
    if not rest:
        assert peer is None
        return
    assert peer is not None and peer.node_id != me[0]
    if any(c.domain != me[1] for c in rest):
        assert peer.domain != me[1]
    assert choose_peer(me[0], me[1], list(reversed(candidates)), seed) == peer  # the order given does not matter


def test_peer_urls_bracket_ipv6_addresses() -> None:
    assert peer_url("10.0.0.1", 7000) == "http://10.0.0.1:7000"
    assert peer_url("::1", 7000) == "http://[::1]:7000"
    assert peer_url("::1", 7000, tls=True) == "https://[::1]:7000"


def test_a_peer_whose_memory_port_speaks_tls_is_reached_at_https(client, schedule) -> None:
    agents = [FakeAgentSession(client, name, 1, address=address, labels={"rack": rack}, memory_port=port,
                               memory_tls=tls)
              for name, address, rack, port, tls in (("t1", "127.0.0.1", "r1", 7200, True),
                                                     ("t2", "127.0.0.2", "r2", 7201, False))]
    client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=1), headers=ADMIN)
    assert schedule() == 1
    peers = {a.name: spec["memory"]["peer_url"] for a in agents for spec in a.heartbeat()["assignments"]}
    assert peers == {"t1": "http://127.0.0.2:7201", "t2": "https://127.0.0.1:7200"}


def test_parts_get_a_peer_on_another_rack_and_the_next_attempt_the_old_copies(client, schedule) -> None:
    racks = {"n1": "r1", "n2": "r1", "n3": "r2", "n4": "r2"}
    agents = [FakeAgentSession(client, name, 1, address=f"127.0.0.{i + 1}", labels={"rack": rack},
                               memory_port=7000 + i) for i, (name, rack) in enumerate(racks.items())]
    off = FakeAgentSession(client, "n5", 1, address="127.0.0.9", labels={"rack": "r1"})  # no memory tier
    url = {a.name: f"http://127.0.0.{i + 1}:{7000 + i}" for i, a in enumerate(agents)}
    job = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=1), headers=ADMIN).json()
    assert schedule() == 1
    first = {a.name: spec for a in [*agents, off] for spec in a.heartbeat()["assignments"]}
    by_token = {a.name: a.token for a in agents}
    assert len(first) == 2
    if "n5" in first:  # its agent serves no memory tier: nothing for it
        assert first.pop("n5")["memory"] is None
    secrets = {spec["memory"]["secret"] for spec in first.values()}
    assert len(secrets) == 1 and len(secrets.pop()) == 64  # one secret for the whole job
    for name, spec in first.items():
        peer = spec["memory"]["peer_url"]
        assert peer != url[name]
        peer_rack = racks[next(n for n, u in url.items() if u == peer)]
        assert peer_rack != racks[name]  # a copy on another failure domain
        assert spec["memory"]["sources"] == []
        # The grant of this job at its peer: what the peer's agent computes from its own credential.
        peer_agent = next(a for a in agents if url[a.name] == peer)
        assert spec["memory"]["grants"] == {peer: memory_grant(memory_grant_key(peer_agent.token), job["id"])}
        assert spec["memory"]["grants"][peer] != memory_grant(memory_grant_key(by_token[name]), job["id"])
    # Never shown: not in the job's view or its attempts.
    secret = next(iter(first.values()))["memory"]["secret"]
    for path in (f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/attempts", f"/v1/jobs/{job['id']}/events"):
        assert secret not in client.get(path, headers=ADMIN).text

    by_name = {a.name: a for a in [*agents, off]}
    name, spec = next(iter(first.items()))
    r = by_name[name].status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited", 1))
    assert r.status_code == 200, r.text
    for agent in by_name.values():
        agent.heartbeat([])
    assert schedule() == 1
    second = {a.name: s for a in [*agents, off] for s in a.heartbeat()["assignments"]
              if s["attempt_id"] != spec["attempt_id"]}
    assert second and all(s["memory"]["secret"] == secret for s in second.values() if s["memory"])
    for new_name, new_spec in second.items():
        if new_spec["memory"] is None:
            assert new_name == "n5"
            continue
        old_node, old = next((n, s) for n, s in first.items() if s["node_rank"] == new_spec["node_rank"]) \
            if any(s["node_rank"] == new_spec["node_rank"] for s in first.values()) else (None, None)
        if old is None:  # that node rank ran on the node without a tier: no copies anywhere
            assert new_spec["memory"]["sources"] == []
            continue
        # The previous attempt's copies of this node rank: its old node (unless it is this one) and its peer.
        expected = [u for u in (url[str(old_node)], old["memory"]["peer_url"])
                    if u not in (new_spec["memory"]["peer_url"], url[new_name])]
        assert new_spec["memory"]["sources"] == expected
        # A grant for each agent the spec names, and for no other.
        named = {u for u in (new_spec["memory"]["peer_url"], *expected) if u}
        assert set(new_spec["memory"]["grants"]) == named
        tokens = {url[a.name]: a.token for a in agents}
        for u in named:
            assert new_spec["memory"]["grants"][u] == memory_grant(memory_grant_key(tokens[u]), job["id"])


def test_restored_tiers_are_recorded_only_when_well_formed() -> None:
    assert restored_tiers({"tiers": {"local": [1, 0, 0], "s3": [2]}}) == {"local": [0, 1], "s3": [2]}
    for bad in (None, {}, [], {"disk": [0]}, {"local": [True]}, {"local": [-1]}, {"local": "0"},
                {"local": [0.5]}, {"peer": [1 << 21]}):
        assert restored_tiers({"tiers": bad}) is None
    assert restored_tiers({}) is None


@settings(max_examples=100, deadline=None)
@given(data=st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10), max_size=3))
def test_restored_tiers_never_raise_on_anything_a_worker_sends(data: dict) -> None:
    got = restored_tiers({"tiers": data})
    tiers = {"process", "local", "peer", "s3"}
    assert got is None or (set(got) <= tiers and all(isinstance(r, int) for v in got.values() for r in v))


def test_a_job_that_turns_the_memory_tier_off_gets_no_tier_on_any_part(client, schedule) -> None:
    agents = [FakeAgentSession(client, f"m{i}", 1, address=f"127.0.0.{i + 1}", labels={"rack": f"r{i}"},
                               memory_port=7100 + i) for i in range(2)]
    small = {"num_nodes": 2, "gpus_per_node": 1}
    for bad in ("false", 0, None, [], {"on": False}):
        r = client.post("/v1/jobs", json=job_body(**small, checkpoint={"interval_steps": 5, "memory_tier": bad}),
                        headers=ADMIN)
        assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text
        assert "memory_tier" in r.text
    on = client.post("/v1/jobs", json=job_body(name="on", **small), headers=ADMIN).json()
    assert on["checkpoint"]["memory_tier"] is True  # shown, on by default
    client.post(f"/v1/jobs/{on['id']}/cancel", headers=ADMIN)
    off = client.post("/v1/jobs", json=job_body(name="off", **small,
                                                checkpoint={"interval_steps": 5, "memory_tier": False}), headers=ADMIN)
    assert off.status_code == 201, off.text
    job = off.json()
    assert job["checkpoint"] == {"interval_steps": 5, "keep_last": 3, "memory_tier": False}
    assert schedule() == 1
    specs = [spec for a in agents for spec in a.heartbeat()["assignments"]]
    assert len(specs) == 2 and all(spec["job_id"] == job["id"] for spec in specs)
    # Both nodes serve a tier, yet neither part has one; the workers are told too (their checkpoint block).
    assert all(spec["memory"] is None and spec["checkpoint"]["memory_tier"] is False for spec in specs)
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["checkpoint"]["memory_tier"] is False
