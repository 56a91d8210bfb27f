"""Pure scheduling policy: unit tests of each rule, and hypothesis properties of ``decide``.

The properties check the decision against the inputs with an independent model of the rules
(``_usable`` below), not with the engine's own bookkeeping.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.scheduler.policy import (
    WAIT_BEHIND,
    WAIT_CAPACITY,
    WAIT_NEVER,
    WAIT_QUOTA,
    WAIT_RESERVED,
    Decision,
    JobDemand,
    NodeCapacity,
    PolicyOptions,
    Running,
    TenantShare,
    decide,
    place,
    queue_order,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def node(name: str, free: tuple[int, ...], total: int | None = None, kind: str = "k", *,
         running: tuple[Running, ...] = (), rack: str | None = None) -> NodeCapacity:
    return NodeCapacity(node_id=name, name=name, free=free, total=total or len(free), gpu_kind=kind,
                        running=running, labels={"rack": rack} if rack else {})


def busy(name: str, total: int, ends: float | None, *, free: int = 0, kind: str = "k",
         rack: str | None = None) -> NodeCapacity:
    """A node whose used GPUs are held by one attempt ending at ``ends`` (None: no time limit)."""
    used = total - free
    return node(name, tuple(range(used, total)), total, kind, rack=rack,
                running=(Running(gpus=used, ends_at=at(ends) if ends is not None else None),) if used else ())


def job(jid: str, nodes: int, per: int, t: int = 0, **kw) -> JobDemand:
    return JobDemand(job_id=jid, num_nodes=nodes, gpus_per_node=per, submitted_at=at(t), **kw)


def run(jobs, nodes, now: float = 0, **kw) -> Decision:
    return decide(jobs, nodes, now=at(now), **kw)


def placed(d: Decision) -> dict[str, tuple[str, ...]]:
    return {p.job_id: tuple(n for n, _ in p.nodes) for p in d.placements}


# -- placement ----------------------------------------------------------------------------------


def test_best_fit_prefers_partly_used_nodes():
    p = place(job("a", 1, 2), [node("n1", (0, 1, 2, 3)), node("n2", (2, 3), total=4)])
    assert p is not None and p.nodes == (("n2", (2, 3)),)


def test_multi_node_gang_uses_lowest_indices_and_stable_ranks():
    p = place(job("a", 2, 2), [node("n2", (1, 2, 3)), node("n1", (0, 1, 2, 3)), node("n3", (0,))])
    assert p is not None and p.nodes == (("n1", (0, 1)), ("n2", (1, 2)))


def test_gpu_kind_and_avoided_nodes_are_respected():
    nodes = [node("n1", (0, 1), kind="a100"), node("n2", (0, 1), kind="h100"), node("n3", (0, 1), kind="h100")]
    p = place(job("a", 1, 2, gpu_kinds=frozenset({"h100"}), avoid_nodes=frozenset({"n2"})), nodes)
    assert p is not None and p.nodes[0][0] == "n3"
    assert place(job("a", 2, 2, gpu_kinds=frozenset({"a100"})), nodes) is None


def test_a_gang_without_a_kind_uses_one_kind():
    nodes = [node("a1", (0, 1), kind="a100"), node("h1", (0, 1), kind="h100"), node("h2", (0, 1), kind="h100")]
    p = place(job("x", 2, 2), nodes)
    assert p is not None and {n for n, _ in p.nodes} == {"h1", "h2"}


def test_recovering_job_prefers_its_healthy_nodes_and_replaces_only_the_failed_one():
    nodes = [node("n1", (0, 1)), node("n2", (0, 1)), node("n3", (0, 1)), node("n4", (0, 1))]
    rec = job("r", 2, 2, recovering=True, prefer_nodes=frozenset({"n3"}), avoid_nodes=frozenset({"n1"}))
    p = place(rec, nodes)
    assert p is not None and {nid for nid, _ in p.nodes} == {"n2", "n3"}


def test_a_gang_stays_in_one_rack_when_it_can():
    # Best fit alone would take a1 (2 free) and b1 (2 free); rack b holds the whole gang.
    nodes = [node("a1", (0, 1), 4, rack="a"), node("a2", (0, 1, 2, 3), rack="a"),
             node("b1", (2, 3), 4, rack="b"), node("b2", (1, 2, 3), 4, rack="b"), node("b3", (0, 1, 2, 3), rack="b")]
    p = place(job("x", 3, 2), nodes)
    assert p is not None and {n for n, _ in p.nodes} == {"b1", "b2", "b3"}
    # Two racks are needed: the fewest racks, the fullest rack first.
    p = place(job("y", 4, 2), nodes)
    assert p is not None and {n for n, _ in p.nodes} >= {"b1", "b2", "b3"}


def test_node_ranks_keep_each_rack_together():
    # Four nodes in two racks, names interleaved: by name alone the ranks would alternate racks.
    nodes = [node("n1", (0,), rack="r2"), node("n2", (0,), rack="r1"), node("n3", (0,), rack="r2"),
             node("n4", (0,), rack="r1"), node("n5", (0,), rack="r2"), node("n6", (0,))]
    p = place(job("x", 6, 1), nodes)
    # The largest rack first, then by rack name, unlabelled last; by name inside a rack.
    assert p is not None and [n for n, _ in p.nodes] == ["n1", "n3", "n5", "n2", "n4", "n6"]


def test_topology_can_be_turned_off():
    nodes = [node("a1", (0, 1), 4, rack="a"), node("b1", (2, 3), 4, rack="b"), node("b2", (0, 1, 2, 3), rack="b")]
    p = place(job("x", 2, 2), nodes, topology_label=None)
    assert p is not None and {n for n, _ in p.nodes} == {"a1", "b1"}


# -- mixed clusters: kinds, names, fragmentation ------------------------------------------------


def test_issue_15_minimal_case_places_both_jobs_whatever_the_names():
    """Issue 15: an unconstrained 1-GPU job took a GPU of the only 8-GPU node because its kind's
    name came first, so the 8-GPU job behind it could not start; renamed, both were placed."""
    for g2, p100, t4 in (("G2", "P100", "T4"), ("Z-G2", "P100", "T4"), ("T4", "G2", "P100")):
        for prefix in ("", "z-"):
            nodes = [node(f"{prefix}g2-a", tuple(range(8)), kind=g2), node("p100-a", (0,), kind=p100),
                     busy("t4-a", 2, ends=None, free=1, kind=t4)]
            d = run([job("small", 1, 1), job("big", 1, 8, t=1)], nodes)
            where = placed(d)
            assert set(where) == {"small", "big"}, (g2, prefix, d)
            assert where["big"] == (f"{prefix}g2-a",) and where["small"] != where["big"]
            assert {p.job_id: p.gpu_kind for p in d.placements}["big"] == g2


def test_small_jobs_keep_the_room_that_waiting_shapes_need():
    """Best fit would put the 1-GPU job on the node with 2 free GPUs and leave room for only one of
    the 2-GPU jobs; counting what the waiting shapes lose, it goes where nothing they need breaks."""
    nodes = [busy("n1", 4, ends=None, free=2), busy("n2", 4, ends=None, free=3)]
    d = run([job("one", 1, 1), job("two-a", 1, 2, t=1), job("two-b", 1, 2, t=2)], nodes)
    where = placed(d)
    assert where["one"] == ("n2",) and {where["two-a"], where["two-b"]} == {("n1",), ("n2",)}


def test_a_small_job_fills_a_partly_used_node_before_it_breaks_a_whole_one():
    nodes = [node("whole", tuple(range(8))), busy("part", 8, ends=None, free=5)]
    d = run([job("one", 1, 1), job("eight", 1, 8, t=1), job("four", 1, 4, t=2)], nodes)
    assert placed(d) == {"one": ("part",), "eight": ("whole",), "four": ("part",)}


def test_flexible_jobs_leave_a_scarce_kind_to_the_jobs_that_need_it():
    """Issue 15: the first unconstrained jobs took the only GPUs of the scarcest kind (its name came
    first) and every job constrained to it waited. They go to the kind with the most free capacity
    relative to the demand that may use it, whatever the names."""
    for scarce in ("a-scarce", "z-scarce"):
        nodes = [node(f"h{i}", tuple(range(8)), kind="h100") for i in range(4)]
        nodes += [node("s1", (0,), kind=scarce), node("s2", (0,), kind=scarce)]
        flexible = [job(f"u{i}", 1, 1, t=i) for i in range(2)]
        d = run(flexible, nodes)
        assert all(p.gpu_kind == "h100" for p in d.placements) and len(d.placements) == 2
        d = run([*flexible, job("needs-it", 2, 1, t=5, gpu_kinds=frozenset({scarce}))], nodes)
        assert {p.job_id: p.gpu_kind for p in d.placements} == {"u0": "h100", "u1": "h100", "needs-it": scarce}


def test_a_flexible_job_does_not_take_the_gpus_a_job_naming_that_kind_waits_for():
    """Demand for a common kind (here an 8-GPU job no node can hold now) makes it look less free than
    a scarce kind; a flexible 2-GPU job still takes the common kind's free GPUs, not the scarce
    kind's only node that a waiting job names (it took it before the claims were counted)."""
    nodes = [busy("b1", 8, ends=None, free=3, kind="common"), node("c1", (0, 1), kind="scarce")]
    jobs = [job("pair", 1, 2), job("four", 1, 4, t=1), job("eight", 1, 8, t=2),
            job("needs-it", 1, 2, t=3, gpu_kinds=frozenset({"scarce"}))]
    d = run(jobs, nodes)
    assert {p.job_id: p.gpu_kind for p in d.placements} == {"pair": "common", "needs-it": "scarce"}


def test_a_job_may_accept_several_kinds_and_runs_on_one():
    nodes = [node("a1", (0, 1), kind="a100"), busy("h1", 2, ends=None, free=1, kind="h100"),
             node("h2", (0, 1), kind="h100"), node("l1", (0, 1), kind="l4")]
    either = frozenset({"a100", "h100"})
    d = run([job("gang", 2, 1, gpu_kinds=either), job("pair", 2, 2, t=1, gpu_kinds=either)], nodes)
    kinds = {p.job_id: (p.gpu_kind, {n for n, _ in p.nodes}) for p in d.placements}
    assert kinds["gang"] == ("h100", {"h1", "h2"})  # one kind: a100 has a single node
    assert "pair" not in kinds and d.waiting["pair"] == WAIT_RESERVED  # a100 + h100 would hold it; no mixing


def test_reservations_are_capped_per_kind():
    """A job waiting for a scarce kind holds a reservation on it even when the reservations of the
    common kind are all taken by jobs ahead of it; unconstrained jobs then cannot take its GPUs."""
    nodes = [busy(f"h{i}", 2, ends=100 + i, kind="h100") for i in range(3)] + [busy("s1", 2, ends=None, kind="p100")]
    jobs = [job(f"h{i}", 1, 2, t=i, gpu_kinds=frozenset({"h100"})) for i in range(2)]
    jobs += [job("s", 1, 2, t=5, gpu_kinds=frozenset({"p100"}))]
    d = run(jobs, nodes, options=PolicyOptions(max_reservations=1))
    assert {r.job_id: r.node_ids for r in d.reservations} == {"h0": ("h0",), "s": ("s1",)}
    assert d.waiting["h1"] == WAIT_CAPACITY
    # s1 frees one GPU: an unconstrained job that fits elsewhere never takes it, not even as backfill
    # (s's start is unknown), and one that fits nowhere else waits.
    nodes[-1] = busy("s1", 2, ends=None, free=1, kind="p100")
    d = run([*jobs, job("u", 1, 1, t=9)], nodes, options=PolicyOptions(max_reservations=1),
            previous={r.job_id: r.node_ids for r in d.reservations})
    assert placed(d) == {} and d.waiting["u"] == WAIT_CAPACITY


# -- order of service ---------------------------------------------------------------------------


def test_queue_order_recovering_then_priority_then_share_then_age():
    jobs = [job("old", 1, 1, t=0, tenant="big"), job("new-high", 1, 1, t=5, priority=5),
            job("rec", 1, 1, t=9, recovering=True), job("young-small-tenant", 1, 1, t=3, tenant="small")]
    tenants = {"big": TenantShare(gpus_in_use=8), "small": TenantShare(gpus_in_use=4, weight=2.0)}
    assert [j.job_id for j in queue_order(jobs, tenants)] == ["rec", "new-high", "young-small-tenant", "old"]


def test_tenants_take_turns_by_weighted_share_within_a_pass():
    # One 8-GPU node; a (weight 1) and b (weight 3) each queue four 1-GPU jobs, a's first.
    jobs = [job(f"a{i}", 1, 1, t=i, tenant="a") for i in range(4)] + [job(f"b{i}", 1, 1, t=10 + i, tenant="b")
                                                                       for i in range(4)]
    d = run(jobs, [node("n", tuple(range(5)), 8)], tenants={"a": TenantShare(), "b": TenantShare(weight=3)})
    # Shares after each admission: b is served while 3 x its usage stays below a's usage.
    assert [p.job_id for p in d.placements] == ["a0", "b0", "b1", "b2", "a1"]


def test_quota_holds_a_tenant_back_and_others_go_on():
    jobs = [job("a1", 1, 2, t=0, tenant="a"), job("a2", 1, 2, t=1, tenant="a"), job("b1", 1, 2, t=2, tenant="b")]
    d = run(jobs, [node("n1", (0, 1, 2, 3)), node("n2", (0, 1))],
            tenants={"a": TenantShare(gpu_quota=3, gpus_in_use=0)})
    assert set(placed(d)) == {"a1", "b1"}
    assert d.waiting == {"a2": WAIT_QUOTA}


# -- reservations and backfill ------------------------------------------------------------------


def test_head_job_gets_the_nodes_where_it_fits_soonest():
    nodes = [busy("n1", 2, ends=100), busy("n2", 2, ends=30), busy("n3", 2, ends=60), node("n4", (0, 1))]
    d = run([job("big", 2, 2)], nodes)
    (r,) = d.reservations
    assert r.job_id == "big" and set(r.node_ids) == {"n2", "n4"} and r.earliest_start == at(30)
    assert d.waiting == {"big": WAIT_RESERVED}
    assert r.held_gpus == 2  # n4's free GPUs wait for n2: the measured idle cost


def test_small_jobs_go_around_a_reservation_and_backfill_only_when_they_end_in_time():
    # big (2x2) waits for n2 (free at t=50); n3 is free, n1 has one free GPU.
    nodes = [busy("n1", 2, ends=500, free=1), busy("n2", 2, ends=50), node("n3", (0, 1))]
    jobs = [job("big", 2, 2, t=0), job("forever", 1, 1, t=1), job("short", 1, 1, t=2, time_limit_s=40),
            job("too-long", 1, 1, t=3, time_limit_s=60), job("short2", 1, 1, t=4, time_limit_s=50)]
    d = run(jobs, nodes, options=PolicyOptions(max_reservations=1))
    assert set(d.reservations[0].node_ids) == {"n2", "n3"}
    where = placed(d)
    assert where["forever"] == ("n1",)  # outside the reservation
    assert where["short"] == ("n3",) and where["short2"] == ("n3",)  # backfill: back by t=50
    assert "too-long" not in where and d.waiting["too-long"] == WAIT_CAPACITY
    assert [p.backfill for p in d.placements] == [False, True, True]


def test_gpus_beyond_what_the_reservation_needs_are_free_for_anyone():
    # big needs 2 per node; n2 has 4 free, so 2 of them may go to a job without a time limit.
    nodes = [busy("n1", 4, ends=100, free=1), node("n2", (0, 1, 2, 3))]
    d = run([job("big", 2, 2), job("forever", 1, 2, t=1), job("forever2", 1, 1, t=2)], nodes)
    assert set(d.reservations[0].node_ids) == {"n1", "n2"}
    assert placed(d) == {"forever": ("n2",), "forever2": ("n1",)}
    assert d.reservations[0].held_gpus == 2


def test_reservation_is_kept_on_its_nodes_and_its_start_only_moves_earlier():
    nodes = [busy("n1", 2, ends=100), busy("n2", 2, ends=50), busy("n3", 2, ends=60)]
    first = run([job("big", 2, 2)], nodes).reservations[0]
    assert set(first.node_ids) == {"n2", "n3"} and first.earliest_start == at(60)
    # Later, n1 would be as good as n3; the reservation stays where it is, and n3 ended early.
    later = [busy("n1", 2, ends=60), busy("n2", 2, ends=50), busy("n3", 2, ends=55)]
    kept = run([job("big", 2, 2)], later, now=10, previous={"big": first.node_ids}).reservations[0]
    assert set(kept.node_ids) == {"n2", "n3"} and kept.earliest_start == at(55)


def test_a_later_higher_priority_job_does_not_take_a_kept_reservation():
    nodes = [busy("n1", 2, ends=100), node("n2", (0, 1))]
    urgent = job("urgent", 1, 2, t=5, priority=10)
    d = run([job("big", 2, 2), urgent], nodes, previous={"big": ("n1", "n2")},
            options=PolicyOptions(max_reservations=2))
    assert placed(d) == {} and d.reservations[0].job_id == "big"
    assert d.waiting["urgent"] == WAIT_CAPACITY  # nothing left outside big's nodes to reserve


def test_reservations_are_capped_but_recovering_jobs_always_hold():
    nodes = [busy(f"n{i}", 2, ends=10 * i) for i in range(1, 7)]
    jobs = [job(f"j{i}", 2, 2, t=i) for i in range(3)] + [job("rec", 2, 2, t=9, recovering=True)]
    d = run(jobs, nodes, options=PolicyOptions(max_reservations=1))
    assert [r.job_id for r in d.reservations] == ["rec", "j0"]
    assert d.waiting["j1"] == d.waiting["j2"] == WAIT_CAPACITY


def test_recovering_job_keeps_its_healthy_nodes_even_against_backfill():
    # r needs 2 nodes x 2; its healthy node n1 is free, its failed one is gone; n2 frees at t=100.
    nodes = [node("n1", (0, 1)), busy("n2", 2, ends=100)]
    rec = job("r", 2, 2, recovering=True, prefer_nodes=frozenset({"n1"}))
    d = run([rec, job("tiny", 1, 1, t=1, time_limit_s=5)], nodes)
    assert placed(d) == {}
    (r,) = d.reservations
    held = {n.node_id: n for n in r.nodes}
    assert held["n1"].strict and held["n1"].held == 2
    assert d.waiting["tiny"] == WAIT_CAPACITY


def test_healthy_nodes_of_a_kind_that_cannot_hold_the_gang_are_not_held():
    # r's healthy node is of kind a, where two 8-GPU nodes do not exist; kind b could hold it.
    nodes = [node("a1", tuple(range(8)), kind="a"), busy("b1", 8, ends=100, kind="b"),
             busy("b2", 8, ends=50, kind="b")]
    rec = job("r", 2, 8, recovering=True, prefer_nodes=frozenset({"a1"}))
    d = run([rec, job("small", 1, 8, t=1)], nodes)
    assert d.waiting["r"] == WAIT_RESERVED and set(d.reservations[0].node_ids) == {"b1", "b2"}
    assert placed(d) == {"small": ("a1",)}


def test_healthy_nodes_in_two_kinds_are_held_in_the_kind_that_can_hold_the_gang():
    # r (2 x 4) kept a1 (kind a) and b1 (kind b). Kind a has one node that large, so only kind b
    # can ever hold it: b1 is held for r from the start of the pass, and "early", a recovering job
    # served before r, does not take b1's free GPUs. Hypothesis found it did: the hold went to kind
    # a (as many healthy nodes, the better rank) and moved to kind b only at r's turn, and "early"
    # went to kind b, where the demand for kind a ("a_only") left more room.
    nodes = [node("a1", tuple(range(1, 8)), 8, kind="a", running=(Running(gpus=1, ends_at=None),)),
             node("b1", (1, 2, 3), 4, kind="b", running=(Running(gpus=1, ends_at=None),)),
             busy("b0", 8, ends=None, kind="b")] + [node(f"a{i}", (0, 1), kind="a") for i in (2, 3, 4)]
    rec = job("r", 2, 4, recovering=True, priority=-1, prefer_nodes=frozenset({"a1", "b1"}))
    early = job("early", 1, 1, t=1, recovering=True)
    d = run([rec, early, job("a_only", 1, 1, t=2, gpu_kinds=frozenset({"a"}))], nodes)
    (r,) = d.reservations
    assert {n.node_id: n.strict for n in r.nodes} == {"b1": True, "b0": False}
    assert set(placed(d)) == {"early", "a_only"} and "b1" not in placed(d)["early"]


def test_job_that_can_never_fit_blocks_nobody():
    d = run([job("huge", 3, 2), job("small", 1, 1, t=1)], [node("n1", (0, 1)), node("n2", (0, 1))])
    assert d.waiting == {"huge": WAIT_NEVER} and set(placed(d)) == {"small"}


def test_recovery_reserve_runs_recovering_jobs_only():
    nodes = [node("n1", (0, 1)), node("n2", (0, 1)), busy("n3", 2, ends=None, free=1)]
    opts = PolicyOptions(recovery_reserve={"k": 1})
    d = run([job("a", 1, 2), job("b", 1, 2, t=1)], nodes, options=opts)
    (reserve,) = d.recovery_reserve
    assert reserve.node_ids == ("n1",) and reserve.idle_gpus == 2  # the emptiest node
    assert placed(d) == {"a": ("n2",)} and d.waiting["b"] == WAIT_RESERVED
    assert "n1" not in d.reservations[0].node_ids and d.reservations[0].earliest_start is None
    # A recovering job uses ordinary capacity first and the reserve when there is no other.
    d = run([job("r", 1, 2, recovering=True), job("b", 1, 2, t=1)], nodes, options=opts)
    assert placed(d) == {"r": ("n2",)} and not d.placements[0].from_reserve
    full = [node("n1", (0, 1)), busy("n2", 2, ends=None), busy("n3", 2, ends=None, free=1)]
    d = run([job("r", 1, 2, recovering=True), job("b", 1, 2, t=1)], full, options=opts)
    assert placed(d) == {"r": ("n1",)} and d.placements[0].from_reserve and d.recovery_reserve[0].idle_gpus == 0


def test_baselines_fifo_stops_and_greedy_skips():
    nodes = [busy("n1", 2, ends=50), node("n2", (0, 1))]
    jobs = [job("big", 2, 2), job("small", 1, 1, t=1)]
    fifo = run(jobs, nodes, options=PolicyOptions(mode="fifo"))
    assert placed(fifo) == {} and fifo.reservations == [] and fifo.waiting["small"] == WAIT_BEHIND
    greedy = run(jobs, nodes, options=PolicyOptions(mode="greedy"))
    assert set(placed(greedy)) == {"small"} and greedy.reservations == []
    fair = run(jobs, nodes)
    assert placed(fair) == {} and fair.reservations[0].job_id == "big"  # small has no time limit


# -- properties ---------------------------------------------------------------------------------

KINDS = ("a", "b")


@st.composite
def clusters(draw) -> list[NodeCapacity]:
    out = []
    for i in range(draw(st.integers(1, 7))):
        total = draw(st.sampled_from((2, 4, 8)))
        kind = draw(st.sampled_from(KINDS))
        used = draw(st.integers(0, total))
        free = tuple(sorted(draw(st.permutations(range(total)))[used:]))
        running, left = [], used
        while left:
            n = draw(st.integers(1, left))
            ends = draw(st.one_of(st.none(), st.integers(0, 300)))
            running.append(Running(gpus=n, ends_at=at(ends) if ends is not None else None))
            left -= n
        out.append(NodeCapacity(node_id=f"n{i}", name=f"n{i}", free=free, total=total, gpu_kind=kind,
                                labels={"rack": draw(st.sampled_from(("r1", "r2")))}, running=tuple(running)))
    return out


@st.composite
def queues(draw, node_ids: list[str]) -> list[JobDemand]:
    jobs = []
    for i in range(draw(st.integers(0, 12))):
        recovering = draw(st.booleans()) and draw(st.booleans())
        healthy = draw(st.lists(st.sampled_from(node_ids), max_size=2)) if recovering else []
        jobs.append(JobDemand(
            job_id=f"j{i}", num_nodes=draw(st.integers(1, 3)), gpus_per_node=draw(st.sampled_from((1, 2, 4, 8))),
            priority=draw(st.integers(-1, 1)), submitted_at=at(i), recovering=recovering,
            gpu_kinds=draw(st.one_of(st.none(), st.sets(st.sampled_from(KINDS), min_size=1).map(frozenset))),
            tenant=draw(st.sampled_from(("t1", "t2", "t3"))),
            time_limit_s=draw(st.one_of(st.none(), st.integers(1, 400))),
            avoid_nodes=frozenset(draw(st.lists(st.sampled_from(node_ids), max_size=1))),
            prefer_nodes=frozenset(healthy),
        ))
    return jobs


tenant_tables = st.fixed_dictionaries({
    t: st.builds(lambda w, q, u: TenantShare(weight=w, gpu_quota=q, gpus_in_use=u),
                 st.sampled_from((0.5, 1.0, 3.0)), st.one_of(st.none(), st.integers(0, 24)), st.integers(0, 8))
    for t in ("t1", "t2")
})


@st.composite
def scenarios(draw):
    nodes = draw(clusters())
    jobs = draw(queues([n.node_id for n in nodes]))
    opts = PolicyOptions(mode=draw(st.sampled_from(("fair", "fair", "greedy"))),
                         max_reservations=draw(st.integers(0, 3)),
                         recovery_reserve={"a": draw(st.integers(0, 1))},
                         topology_label=draw(st.sampled_from(("rack", None))))
    return nodes, jobs, draw(tenant_tables), opts, draw(st.integers(0, 100))


def _end(j: JobDemand, now: float) -> float:
    return now + j.time_limit_s if j.time_limit_s else float("inf")


def _final_state(nodes, d: Decision, jobs, now: float):
    """Free GPUs after the decision, and each node's releases (ends, GPUs) including placements."""
    by_id = {j.job_id: j for j in jobs}
    free = {n.node_id: set(n.free) for n in nodes}
    rel = {n.node_id: [((r.ends_at - T0).total_seconds() if r.ends_at else float("inf"), r.gpus) for r in n.running]
           for n in nodes}
    for p in d.placements:
        for nid, ix in p.nodes:
            free[nid] -= set(ix)
            rel[nid].append((_end(by_id[p.job_id], now), len(ix)))
    return free, rel


def _taken_by_strangers(d: Decision, jobs: list[JobDemand], nid: str, owner: JobDemand) -> int:
    """GPUs placed on ``nid`` by jobs for which it is not a healthy node too (a node shared by
    recovering jobs is theirs together)."""
    by_id = {j.job_id: j for j in jobs}
    return sum(len(ix) for p in d.placements for n, ix in p.nodes
               if n == nid and p.job_id != owner.job_id
               and not (by_id[p.job_id].recovering and nid in by_id[p.job_id].prefer_nodes))


def _kept(jobs: list[JobDemand], tenants, nid: str) -> int:
    """What a healthy node keeps: the largest share among the recovering jobs that prefer it (those
    over their quota at the start of the pass hold nothing)."""
    def over(j: JobDemand) -> bool:
        t = tenants.get(j.tenant, TenantShare())
        return t.gpu_quota is not None and t.gpus_in_use + j.num_gpus > t.gpu_quota
    return max((j.gpus_per_node for j in jobs if j.recovering and nid in j.prefer_nodes and not over(j)), default=0)


def _holds(d: Decision, jobs: list[JobDemand], nid: str) -> list[tuple[str, int, float, float, bool]]:
    """The reservations on ``nid``: (job, GPUs, start, end, strict); the end is the start + the
    job's time limit (a reservation occupies its share for that long once its job starts)."""
    limits = {j.job_id: j.time_limit_s for j in jobs}
    out = []
    for r in d.reservations:
        for hn in r.nodes:
            if hn.node_id == nid:
                start = (r.earliest_start - T0).total_seconds() if r.earliest_start else float("inf")
                limit = limits[r.job_id]
                out.append((r.job_id, hn.gpus, start, start + limit if limit else float("inf"), hn.strict))
    return out


def _busy_at(holds, t: float, but: str) -> int:
    """GPUs the reservations in ``holds`` other than ``but``'s occupy at ``t``."""
    return sum(g for jid, g, start, end, _ in holds if jid != but and start <= t < end)


def _usable(j: JobDemand, nid: str, d: Decision, free, rel, now: float, kept: int = 0,
            jobs: list[JobDemand] | None = None) -> int:
    """GPUs ``j`` could take on ``nid`` after the decision without breaking any hold (the rules,
    written independently of the engine). ``kept``: what the node keeps if it is a healthy one."""
    f = len(free[nid])
    for h in d.recovery_reserve:
        if nid in h.node_ids:
            return f if j.recovering else 0
    holds = [h for h in _holds(d, jobs or [j], nid) if h[0] != j.job_id]
    for _, gpus, _, _, strict in holds:
        if strict:
            return max(0, f - max(gpus, kept))
    usable = f
    for jid, gpus, start, _, _ in holds:
        if _end(j, now) <= start and j.time_limit_s:
            continue  # backfill: back before it starts
        by_start = f + sum(g for e, g in rel[nid] if e <= start and e != float("inf"))
        usable = min(usable, by_start - gpus - _busy_at(holds, start, jid))
    return max(0, usable)


def _descriptors(nodes: list[NodeCapacity], jobs: list[JobDemand], opts: PolicyOptions,
                 previous: dict[str, tuple[str, ...]]) -> tuple[dict[str, object], dict[str, object]]:
    """What a node and a GPU kind are apart from their names: capacity, what runs, the topology
    label, the jobs that refer to them. Nodes (kinds) with equal descriptors are interchangeable."""
    def base(n: NodeCapacity) -> tuple[object, ...]:
        running = sorted(((r.ends_at - T0).total_seconds() if r.ends_at else float("inf"), r.gpus) for r in n.running)
        refs = sorted([(0, j.job_id) for j in jobs if n.node_id in j.prefer_nodes]
                      + [(1, j.job_id) for j in jobs if n.node_id in j.avoid_nodes]
                      + [(2 + i, jid) for jid, ids in previous.items()
                         for i, nid in enumerate(ids) if nid == n.node_id])
        # The topology label only sets nodes apart when the policy reads it (topology_label).
        label = n.labels.get(opts.topology_label, "") if opts.topology_label else ""
        return (n.total, n.free, tuple(running), label, tuple(refs))

    kinds = {}
    for kind in {n.gpu_kind for n in nodes}:
        kinds[kind] = (tuple(sorted(base(n) for n in nodes if n.gpu_kind == kind)),
                       tuple(sorted(j.job_id for j in jobs if j.gpu_kinds and kind in j.gpu_kinds)),
                       opts.reserve_nodes(kind))
    return {n.node_id: (kinds[n.gpu_kind], base(n)) for n in nodes}, kinds


def _signature(d: Decision, nodes, jobs, opts, previous) -> tuple[object, ...]:
    """The decision with every node and kind replaced by its descriptor (rank order aside)."""
    desc, kinds = _descriptors(nodes, jobs, opts, previous)
    return (
        [(p.job_id, sorted((desc[nid], ix) for nid, ix in p.nodes), kinds[p.gpu_kind], p.backfill, p.from_reserve)
         for p in d.placements],
        [(r.job_id, r.earliest_start, sorted((desc[h.node_id], h.gpus, h.free_at_start, h.held, h.strict)
                                             for h in r.nodes)) for r in d.reservations],
        sorted((kinds[h.gpu_kind], sorted(desc[nid] for nid in h.node_ids), h.idle_gpus) for h in d.recovery_reserve),
        d.waiting,
    )


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.data())
def test_decisions_do_not_depend_on_names_or_input_order(scenario, data):
    """Issue 15: renaming the GPU kinds and the nodes, and shuffling the nodes and the jobs, gives
    the same decisions up to the renaming (two passes: the second keeps the first's reservations)."""
    nodes, jobs, tenants, opts, now = scenario
    names = data.draw(st.permutations([f"m{i}" for i in range(len(nodes))]))
    node_map = {n.node_id: f"{names[i]}-{data.draw(st.sampled_from('az'))}" for i, n in enumerate(nodes)}
    kind_map = dict(zip(KINDS, data.draw(st.permutations(["zz-" + KINDS[0], "aa-" + KINDS[1]])), strict=True))

    def ids(s: frozenset[str]) -> frozenset[str]:
        return frozenset(node_map[x] for x in s)

    renamed_nodes = data.draw(st.permutations([replace(n, node_id=node_map[n.node_id], name=node_map[n.node_id],
                                                       gpu_kind=kind_map[n.gpu_kind]) for n in nodes]))
    renamed_jobs = data.draw(st.permutations([
        replace(j, gpu_kinds=frozenset(kind_map[k] for k in j.gpu_kinds) if j.gpu_kinds else None,
                avoid_nodes=ids(j.avoid_nodes), prefer_nodes=ids(j.prefer_nodes)) for j in jobs]))
    renamed_opts = replace(opts, recovery_reserve={kind_map[k]: v for k, v in opts.recovery_reserve.items()})
    first = decide(jobs, nodes, now=at(now), tenants=tenants, options=opts)
    again = decide(renamed_jobs, renamed_nodes, now=at(now), tenants=tenants, options=renamed_opts)
    assert _signature(first, nodes, jobs, opts, {}) == _signature(again, renamed_nodes, renamed_jobs, renamed_opts, {})
    previous = {r.job_id: r.node_ids for r in first.reservations}
    starts = {r.job_id: r.earliest_start for r in first.reservations}
    renamed_previous = {jid: tuple(node_map[n] for n in nids) for jid, nids in previous.items()}
    second = decide(jobs, nodes, now=at(now + 1), tenants=tenants, options=opts, previous=previous,
                    previous_starts=starts)
    again = decide(renamed_jobs, renamed_nodes, now=at(now + 1), tenants=tenants, options=renamed_opts,
                   previous=renamed_previous, previous_starts=starts)
    assert (_signature(second, nodes, jobs, opts, previous)
            == _signature(again, renamed_nodes, renamed_jobs, renamed_opts, renamed_previous))


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_decisions_are_whole_gangs_within_free_capacity_and_quotas(scenario):
    nodes, jobs, tenants, opts, now = scenario
    d = decide(jobs, nodes, now=at(now), tenants=tenants, options=opts)
    caps = {n.node_id: n for n in nodes}
    by_id = {j.job_id: j for j in jobs}
    free = {n.node_id: set(n.free) for n in nodes}
    reserve = {nid for h in d.recovery_reserve for nid in h.node_ids}
    assert len({p.job_id for p in d.placements}) == len(d.placements)  # one decision per job
    assert not ({p.job_id for p in d.placements} & set(d.waiting))
    assert {p.job_id for p in d.placements} | set(d.waiting) == set(by_id)
    used = {t: s.gpus_in_use for t, s in tenants.items()}
    for p in d.placements:
        j = by_id[p.job_id]
        assert len(p.nodes) == j.num_nodes == len({nid for nid, _ in p.nodes})  # never a partial gang
        kinds = {caps[nid].gpu_kind for nid, _ in p.nodes}
        assert len(kinds) == 1 and (j.gpu_kinds is None or kinds <= j.gpu_kinds)  # one kind, an accepted one
        assert p.gpu_kind == caps[p.nodes[0][0]].gpu_kind
        for nid, ix in p.nodes:
            assert len(ix) == j.gpus_per_node
            assert set(ix) <= free[nid]  # never a GPU that is not free, never one twice
            free[nid] -= set(ix)
            assert nid not in j.avoid_nodes
            assert j.recovering or nid not in reserve
        if opts.topology_label:  # node ranks keep a topology domain together
            labels = [caps[nid].labels.get(opts.topology_label) for nid, _ in p.nodes]
            runs = [label for i, label in enumerate(labels) if i == 0 or labels[i - 1] != label]
            assert len(runs) == len(set(runs)), labels
        used[j.tenant] = used.get(j.tenant, 0) + j.num_gpus
        quota = tenants.get(j.tenant, TenantShare()).gpu_quota
        assert quota is None or used[j.tenant] <= quota  # quotas respected
    assert sum(len(f) for f in free.values()) >= 0


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_no_job_waits_that_could_fit_without_delaying_a_reservation(scenario):
    nodes, jobs, tenants, opts, now = scenario
    d = decide(jobs, nodes, now=at(now), tenants=tenants, options=opts)
    free, rel = _final_state(nodes, d, jobs, now)
    by_id = {j.job_id: j for j in jobs}
    used = {t: s.gpus_in_use for t, s in tenants.items()}
    for p in d.placements:
        used[by_id[p.job_id].tenant] = used.get(by_id[p.job_id].tenant, 0) + by_id[p.job_id].num_gpus
    for jid, why in d.waiting.items():
        j = by_id[jid]
        if why == WAIT_QUOTA:
            quota = tenants.get(j.tenant, TenantShare()).gpu_quota
            assert quota is not None and used.get(j.tenant, 0) + j.num_gpus > quota
            continue
        for kind in {n.gpu_kind for n in nodes}:
            if j.gpu_kinds is not None and kind not in j.gpu_kinds:
                continue
            fits = [n.node_id for n in nodes if n.gpu_kind == kind and n.node_id not in j.avoid_nodes
                    and _usable(j, n.node_id, d, free, rel, now, _kept(jobs, tenants, n.node_id), jobs)
                    >= j.gpus_per_node]
            assert len(fits) < j.num_nodes, f"{jid} waits ({why}) but fits on {fits}"


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_reservations_hold_what_their_job_needs_at_the_earliest_start(scenario):
    nodes, jobs, tenants, opts, now = scenario
    _assert_holds(nodes, jobs, decide(jobs, nodes, now=at(now), tenants=tenants, options=opts), opts, now)


def _assert_holds(nodes: list[NodeCapacity], jobs: list[JobDemand], d: Decision, opts: PolicyOptions,
                  now: float) -> None:
    """What the placements left of every reservation's nodes is what it needs at its earliest start,
    beside the other reservations there (and a healthy node is its recovering job's alone)."""
    free, rel = _final_state(nodes, d, jobs, now)
    initial = {n.node_id: len(n.free) for n in nodes}
    by_id = {j.job_id: j for j in jobs}
    holders = [r.job_id for r in d.reservations]
    assert len(set(holders)) == len(holders)
    kind = {n.node_id: n.gpu_kind for n in nodes}
    per_kind = Counter(kind[r.node_ids[0]] for r in d.reservations if not by_id[r.job_id].recovering)
    assert all(v <= opts.max_reservations for v in per_kind.values())  # capped per GPU kind
    for r in d.reservations:  # a reservation holds nodes of one kind, one its job accepts
        kinds = {kind[nid] for nid in r.node_ids}
        assert len(kinds) == 1 and (by_id[r.job_id].gpu_kinds is None or kinds <= by_id[r.job_id].gpu_kinds)
    holding = [nid for r in d.reservations for nid in r.node_ids]
    for r in d.reservations:
        j = by_id[r.job_id]
        assert d.waiting[r.job_id] == WAIT_RESERVED
        # Whole, or only a recovering job's healthy nodes (the rest it needs is held for others).
        assert len(r.nodes) == j.num_nodes or (j.recovering and all(n.strict for n in r.nodes))
        # Reservations share a node (each occupies its share from its start for its time limit),
        # but a recovering job's healthy node is its alone.
        assert all(holding.count(hn.node_id) == 1 for hn in r.nodes if hn.strict)
        start = (r.earliest_start - T0).total_seconds() if r.earliest_start else None
        assert start is None or start >= now
        for hn in r.nodes:
            assert hn.gpus == j.gpus_per_node and 0 <= hn.held <= len(free[hn.node_id])
            if hn.strict:
                # A recovering job's healthy node: others took only GPUs beyond its share.
                assert j.recovering and hn.node_id in j.prefer_nodes
                taken = _taken_by_strangers(d, jobs, hn.node_id, j)
                assert taken <= max(0, initial[hn.node_id] - j.gpus_per_node)
            elif start is not None:
                by_start = len(free[hn.node_id]) + sum(g for e, g in rel[hn.node_id] if e <= start)
                busy = _busy_at(_holds(d, jobs, hn.node_id), start, r.job_id)
                assert by_start - busy >= j.gpus_per_node, (r, hn)


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_a_blocked_recovering_job_keeps_its_healthy_nodes(scenario):
    """A waiting recovering job's reservation takes its healthy nodes (of the GPU kind it will
    run on) first, strictly: jobs that do not share them take only GPUs beyond its share."""
    nodes, jobs, tenants, opts, now = scenario
    d = decide(jobs, nodes, now=at(now), tenants=tenants, options=opts)
    caps = {n.node_id: n for n in nodes}
    by_job = {r.job_id: r for r in d.reservations}
    for j in jobs:
        r = by_job.get(j.job_id)
        if not j.recovering or r is None:
            continue
        (kind,) = {caps[nid].gpu_kind for nid in r.node_ids}
        others = {nid for o in d.reservations if o.job_id != j.job_id for nid in o.node_ids}
        eligible = {nid for nid in j.prefer_nodes - j.avoid_nodes - others
                    if caps[nid].gpu_kind == kind and caps[nid].total >= j.gpus_per_node}
        in_res = {hn.node_id for hn in r.nodes if hn.node_id in j.prefer_nodes}
        assert len(in_res) == min(j.num_nodes, len(eligible)) and in_res <= eligible
        for hn in r.nodes:
            assert hn.strict == (hn.node_id in j.prefer_nodes)
            if hn.strict:
                n = caps[hn.node_id]
                assert _taken_by_strangers(d, jobs, hn.node_id, j) <= max(0, len(n.free) - j.gpus_per_node)


MAX_STOP = 3
"""Seconds an attempt may take to stop (its GPUs held) in the simulations."""


STREAM_KINDS = (None, frozenset({"common"}), frozenset({"scarce"}), frozenset({"common", "scarce"}))


@st.composite
def streams(draw, *, limited: bool = False, one_class: bool = False, stopping: bool = True, kinds: bool = False):
    """A cluster and a stream of arriving jobs, each with a time limit (a few without, unless
    ``limited``), a run time and a stop time (the attempt is stopping, its GPUs still held; none
    unless ``stopping``) that end within it. ``one_class``: one tenant and one priority (service
    order is submit order). ``kinds``: a common GPU kind and one or two nodes of a scarce one; jobs
    accept any kind, one of them, or both."""
    nodes = [(f"n{i}", draw(st.sampled_from((2, 4))), "common") for i in range(draw(st.integers(2, 5)))]
    if kinds:
        nodes += [(f"s{i}", draw(st.sampled_from((1, 2))), "scarce") for i in range(draw(st.integers(1, 2)))]
    jobs = []
    for i in range(draw(st.integers(1, 14))):
        limit = draw(st.integers(5, 200) if limited else st.one_of(st.none(), st.integers(5, 200)))
        runs = draw(st.integers(1, limit)) if limit else draw(st.integers(1, 200))
        stops = draw(st.integers(0, min(MAX_STOP, limit - runs) if limit else MAX_STOP)) if stopping else 0
        arrives = draw(st.integers(0, 150))
        jobs.append((arrives, JobDemand(
            job_id=f"j{i}", num_nodes=draw(st.integers(1, 3)), gpus_per_node=draw(st.sampled_from((1, 2, 4))),
            submitted_at=at(arrives + i / 1000), tenant="t1" if one_class else draw(st.sampled_from(("t1", "t2"))),
            time_limit_s=limit, priority=0 if one_class else draw(st.sampled_from((0, 0, 1))),
            gpu_kinds=draw(st.sampled_from(STREAM_KINDS)) if kinds else None,
        ), runs, stops))
    # A 1-GPU stream: the shape of finding 15 (small jobs keep the queue deep before a gang).
    if draw(st.booleans()):
        first = draw(st.integers(0, 20))
        for k in range(draw(st.integers(4, 16))):
            i = len(jobs)
            arrives = first + k * draw(st.integers(0, 4))
            jobs.append((arrives, JobDemand(
                job_id=f"j{i}", num_nodes=1, gpus_per_node=1, submitted_at=at(arrives + i / 1000), tenant="t1",
                time_limit_s=40, gpu_kinds=draw(st.sampled_from(STREAM_KINDS)) if kinds else None),
                8, draw(st.integers(0, 2)) if stopping else 0))
    return nodes, jobs, draw(st.integers(1, 4))


def _simulate(stream, check=None, *, promise_kept: bool = True) -> None:
    """Passes at every arrival, every end of a run (the attempt is then stopping: the pass sees its
    GPUs held, released now) and every release, as allocate.py feeds them: a starting or running
    attempt holds its GPUs until its allocation + its time limit. Jobs end within their limits.
    Once a job holds a reservation with a known earliest start, it starts by then (unless not
    ``promise_kept``: the pass counts a stopping attempt's GPUs as released now, so a stop that
    takes time delays the reservations that wait for it, and those planned around them).
    Every pass leaves each reservation what it needs at its start (``_assert_holds``);
    ``check(now, waiting, decision)`` runs after it."""
    node_specs, arrivals, depth = stream
    now = 0.0
    running: dict[str, tuple[dict[str, tuple[int, ...]], float, float | None]] = {}  # job -> gpus, ends, limit end
    stopping: dict[str, tuple[dict[str, tuple[int, ...]], float]] = {}  # job -> gpus, released at
    waiting: list[JobDemand] = []
    pending = sorted(arrivals, key=lambda a: (a[0], a[1].job_id))
    runs = {j.job_id: (r, stop) for _, j, r, stop in arrivals}
    promise: dict[str, float] = {}
    previous: dict[str, tuple[str, ...]] = {}
    starts: dict[str, datetime | None] = {}
    opts = PolicyOptions(max_reservations=depth)
    for _ in range(400):
        waiting += [j for t, j, _, _ in pending if t <= now]
        pending = [a for a in pending if a[0] > now]
        for jid in [jid for jid, (_, ends, _) in running.items() if ends <= now]:
            gpus, ends, _ = running.pop(jid)
            stopping[jid] = (gpus, ends + runs[jid][1])
        for jid in [jid for jid, (_, released) in stopping.items() if released <= now]:
            del stopping[jid]
        caps = []
        for name, total, kind in node_specs:
            held = [(gpus[name], at(e) if e is not None else None) for gpus, _, e in running.values() if name in gpus]
            held += [(gpus[name], at(now)) for gpus, _ in stopping.values() if name in gpus]
            used = {i for g, _ in held for i in g}
            caps.append(NodeCapacity(
                node_id=name, name=name, total=total, free=tuple(i for i in range(total) if i not in used),
                gpu_kind=kind, running=tuple(Running(gpus=len(g), ends_at=e) for g, e in held)))
        d = decide(waiting, caps, now=at(now), previous=previous, previous_starts=starts, options=opts)
        _assert_holds(caps, waiting, d, opts, now)
        if check is not None:
            check(now, waiting, d)
        for p in d.placements:
            if p.job_id in promise and promise_kept:
                late = f"{p.job_id} started at {now}, promised {promise[p.job_id]}"
                assert now <= promise[p.job_id] + 1e-6, late
            j = next(w for w in waiting if w.job_id == p.job_id)
            running[p.job_id] = (dict(p.nodes), now + runs[p.job_id][0],
                                 now + j.time_limit_s if j.time_limit_s else None)
        admitted = {p.job_id for p in d.placements}
        waiting = [w for w in waiting if w.job_id not in admitted]
        previous = {r.job_id: r.node_ids for r in d.reservations}
        starts = {r.job_id: r.earliest_start for r in d.reservations}
        for r in d.reservations:
            if r.earliest_start is not None and r.job_id not in promise:
                promise[r.job_id] = (r.earliest_start - T0).total_seconds()
        events = ([ends for _, ends, _ in running.values() if ends > now]
                  + [released for _, released in stopping.values()] + [t for t, _, _, _ in pending])
        if not events:
            break
        now = min(events)


@settings(max_examples=250, deadline=None)
@given(streams(stopping=False))
def test_a_reserved_job_starts_no_later_than_its_earliest_start(stream):
    _simulate(stream)


def _could_ever_fit(j: JobDemand, node_specs, kind: str | None = None) -> bool:
    """Whether nodes of one kind (``kind``, or any the job accepts) could hold ``j`` when empty."""
    kinds = {k for _, _, k in node_specs} if kind is None else {kind}
    return any(sum(1 for _, total, k in node_specs if k == each and total >= j.gpus_per_node) >= j.num_nodes
               for each in kinds if j.gpu_kinds is None or each in j.gpu_kinds)


@settings(max_examples=250, deadline=None)
@given(streams(limited=True))
def test_a_blocked_job_holds_a_reservation_while_there_are_fewer_than_the_cap(stream):
    """Finding 15: with every job limited, each pass gives every blocked job that could ever fit a
    reservation until ``max_reservations`` are held. (Reservations held a node whole, so a gang
    behind two 1-GPU reservations on a 2-node cluster reserved nothing, and the 1-GPU jobs after it
    started before it, for ever.)"""
    node_specs, _, depth = stream

    def check(now: float, waiting: list[JobDemand], d: Decision) -> None:
        holders = {r.job_id for r in d.reservations}
        bare = [j.job_id for j in waiting if j.job_id in d.waiting and j.job_id not in holders
                and _could_ever_fit(j, node_specs)]
        assert not bare or len(holders) == depth, f"at {now}: {bare} hold nothing; {len(holders)} of {depth} held"

    _simulate(stream, check, promise_kept=False)


@settings(max_examples=250, deadline=None)
@given(streams(limited=True, one_class=True))
def test_the_first_blocked_jobs_in_service_order_hold_the_reservations(stream):
    """One tenant, one priority: the reservations are held by the earliest submitted blocked jobs
    (those that could ever fit), so a job submitted later never takes a reservation's place."""
    node_specs, _, depth = stream

    def check(now: float, waiting: list[JobDemand], d: Decision) -> None:
        blocked = sorted((j for j in waiting if j.job_id in d.waiting and _could_ever_fit(j, node_specs)),
                         key=lambda j: j.submitted_at)
        assert {r.job_id for r in d.reservations} == {j.job_id for j in blocked[:depth]}, now

    _simulate(stream, check, promise_kept=False)


@settings(max_examples=200, deadline=None)
@given(streams(limited=True, one_class=True, stopping=False, kinds=True))
def test_a_job_waiting_for_a_scarce_kind_is_not_passed_over_by_later_jobs(stream):
    """Issue 15, across kinds: reservations are capped per GPU kind and hold only nodes of a kind
    their job accepts. A blocked job holds none only while every kind it accepts (and could fit
    on) has all its reservations, taken by jobs submitted before it: so jobs that come later,
    constrained or not, never keep it from its kind; and every reserved job starts by its first
    earliest start."""
    node_specs, _, depth = stream
    kind_of = {name: kind for name, _, kind in node_specs}

    def check(now: float, waiting: list[JobDemand], d: Decision) -> None:
        holders = {r.job_id: kind_of[r.node_ids[0]] for r in d.reservations}
        submitted = {j.job_id: j.submitted_at for j in waiting}
        for j in waiting:
            if j.job_id not in d.waiting or j.job_id in holders:
                continue
            for kind in {"common", "scarce"}:
                if (j.gpu_kinds is None or kind in j.gpu_kinds) and _could_ever_fit(j, node_specs, kind):
                    on_kind = [jid for jid, k in holders.items() if k == kind]
                    assert len(on_kind) >= depth, f"at {now}: {j.job_id} holds nothing; {kind} has {on_kind}"
                    assert all(submitted[jid] < j.submitted_at for jid in on_kind), (now, j.job_id, on_kind)

    _simulate(stream, check)
