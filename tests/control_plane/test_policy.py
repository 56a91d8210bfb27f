"""Pure placement policy: unit tests and hypothesis invariants."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.scheduler.policy import JobDemand, NodeCapacity, decide, place, queue_order

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def node(name: str, free: tuple[int, ...], total: int | None = None, kind: str = "k") -> NodeCapacity:
    return NodeCapacity(node_id=name, name=name, free=free, total=total or len(free), gpu_kind=kind)


def job(jid: str, nodes: int, per: int, t: int = 0, **kw) -> JobDemand:
    return JobDemand(job_id=jid, num_nodes=nodes, gpus_per_node=per, submitted_at=T0 + timedelta(seconds=t), **kw)


def test_best_fit_prefers_partly_used_nodes():
    p = place(job("a", 1, 2), [node("n1", (0, 1, 2, 3)), node("n2", (2, 3), total=4)])
    assert p is not None and p.nodes == (("n2", (2, 3)),)


def test_multi_node_gang_uses_lowest_indices_and_stable_ranks():
    p = place(job("a", 2, 2), [node("n2", (1, 2, 3)), node("n1", (0, 1, 2, 3)), node("n3", (0,))])
    assert p is not None and p.nodes == (("n1", (0, 1)), ("n2", (1, 2)))


def test_gpu_kind_and_avoided_nodes_are_respected():
    nodes = [node("n1", (0, 1), kind="a100"), node("n2", (0, 1), kind="h100"), node("n3", (0, 1), kind="h100")]
    assert place(job("a", 1, 2, gpu_kind="h100", avoid_nodes=frozenset({"n2"})), nodes).nodes[0][0] == "n3"
    assert place(job("a", 2, 2, gpu_kind="a100"), nodes) is None


def test_queue_order_recovering_then_priority_then_age():
    jobs = [job("old", 1, 1, t=0), job("new-high", 1, 1, t=5, priority=5), job("rec", 1, 1, t=9, recovering=True)]
    assert [j.job_id for j in queue_order(jobs)] == ["rec", "new-high", "old"]


def test_head_of_line_is_not_jumped():
    # The 2x2 job at the head does not fit; the 1-GPU job behind it must not take its place.
    decisions = decide([job("big", 2, 2, t=0), job("small", 1, 1, t=1)], [node("n1", (0, 1)), node("n2", (0,))])
    assert decisions == []


def test_second_job_waits_for_the_first():
    nodes = [node("n1", (0, 1)), node("n2", (0, 1))]
    decisions = decide([job("a", 2, 2, t=0), job("b", 1, 2, t=1)], nodes)
    assert [d.job_id for d in decisions] == ["a"]


clusters = st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=8).map(
    lambda frees: [node(f"n{i}", tuple(range(f)), total=8) for i, f in enumerate(frees)]
)
queues = st.lists(
    st.tuples(st.integers(1, 4), st.integers(1, 8), st.integers(-2, 2), st.booleans()), max_size=12
).map(lambda js: [job(f"j{i}", n, g, t=i, priority=p, recovering=r) for i, (n, g, p, r) in enumerate(js)])


@settings(max_examples=300, deadline=None)
@given(clusters, queues)
def test_decisions_are_whole_gangs_within_free_capacity(nodes, jobs):
    decisions = decide(jobs, nodes)
    free = {n.node_id: set(n.free) for n in nodes}
    by_id = {j.job_id: j for j in jobs}
    assert len({d.job_id for d in decisions}) == len(decisions)  # one decision per job
    for d in decisions:
        j = by_id[d.job_id]
        assert len(d.nodes) == j.num_nodes  # never a partial gang
        assert len({nid for nid, _ in d.nodes}) == j.num_nodes
        for nid, ix in d.nodes:
            assert len(ix) == j.gpus_per_node
            assert set(ix) <= free[nid]  # never a GPU that is not free
            free[nid] -= set(ix)  # never the same GPU twice
    # Admitted jobs are a prefix of the service order.
    order = [j.job_id for j in queue_order(jobs)]
    assert [d.job_id for d in decisions] == order[: len(decisions)]


def test_recovering_job_prefers_its_healthy_nodes_and_replaces_only_the_failed_one():
    nodes = [node("n1", (0, 1)), node("n2", (0, 1)), node("n3", (0, 1)), node("n4", (0, 1))]
    rec = job("r", 2, 2, recovering=True, prefer_nodes=frozenset({"n3"}), avoid_nodes=frozenset({"n1"}))
    p = place(rec, nodes)
    assert p is not None and {nid for nid, _ in p.nodes} == {"n2", "n3"}
