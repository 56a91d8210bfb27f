"""The pure handover policy (scheduler/handover_policy.py): a parked part's GPUs are free for its own
job only, all together; a placement adopts a parked node only on exactly its GPUs."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.scheduler.handover_policy import plan_handover, seen_by, without
from control_plane.scheduler.policy import JobDemand, NodeCapacity, Placement

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _node(name: str, free: tuple[int, ...], total: int = 4) -> NodeCapacity:
    return NodeCapacity(node_id=name, name=name, free=free, total=total, gpu_kind="k")


def _job(nodes: int, per_node: int, prefer: frozenset[str] = frozenset()) -> JobDemand:
    return JobDemand(job_id="j", num_nodes=nodes, gpus_per_node=per_node, submitted_at=T0, recovering=True,
                     prefer_nodes=prefer)


def test_the_parked_node_offers_exactly_its_parked_gpus():
    nodes = [_node("a", (3,)), _node("b", (0, 1, 2, 3))]
    seen = seen_by(nodes, {"a": (1, 0)})
    assert [n.free for n in seen] == [(0, 1), (0, 1, 2, 3)]
    plan = plan_handover(_job(2, 2, frozenset({"a"})), nodes, {"a": (0, 1)}, topology_label=None)
    assert plan is not None and plan.adopted == {"a": (0, 1)}
    assert dict(plan.placement.nodes)["a"] == (0, 1)


def test_no_handover_without_a_usable_parked_node():
    nodes = [_node("a", ()), _node("b", (0, 1)), _node("c", (0, 1))]
    assert plan_handover(_job(2, 2), nodes, {}, topology_label=None) is None
    assert plan_handover(_job(2, 2), nodes, {"a": (0,)}, topology_label=None) is None  # another shape
    assert plan_handover(_job(2, 2), nodes, {"gone": (0, 1)}, topology_label=None) is None  # not schedulable
    assert plan_handover(_job(4, 2), nodes, {"a": (0, 1)}, topology_label=None) is None  # does not fit


@settings(max_examples=60, deadline=None)
@given(free=st.lists(st.sets(st.integers(0, 3), max_size=4), min_size=1, max_size=5),
       parked=st.dictionaries(st.integers(0, 4), st.sets(st.integers(0, 3), min_size=1, max_size=4), max_size=3),
       nodes=st.integers(1, 3), per_node=st.integers(1, 4))
def test_a_handover_adopts_only_exact_parked_gpus_and_never_takes_a_gpu_twice(free, parked, nodes, per_node):
    capacity = [_node(f"n{i}", tuple(sorted(f - parked.get(i, set())))) for i, f in enumerate(free)]
    held = {f"n{i}": tuple(sorted(ix)) for i, ix in parked.items() if i < len(free)}
    plan = plan_handover(_job(nodes, per_node, frozenset(held)), capacity, held, topology_label=None)
    if plan is None:
        return
    placed = dict(plan.placement.nodes)
    assert plan.adopted and all(placed[n] == ix == held[n] for n, ix in plan.adopted.items())
    free_of = {n.node_id: set(n.free) for n in capacity}
    for node, ix in placed.items():
        assert len(ix) == per_node
        assert set(ix) <= (set(held[node]) if node in plan.adopted else free_of[node])  # its own, or free
    left = {n.node_id: set(n.free) for n in without(capacity, plan.placement)}
    assert all(not (left[node] & set(ix)) for node, ix in placed.items())


def test_without_removes_what_a_placement_takes():
    nodes = [_node("a", (0, 1, 2)), _node("b", (0,))]
    left = without(nodes, Placement(job_id="j", nodes=(("a", (1,)),)))
    assert [n.free for n in left] == [(0, 2), (0,)]


def test_a_handover_takes_no_node_held_for_another_job_and_no_gpu_beyond_its_quota():
    """Finding 6: the replacement node of a handover is what the ordinary pass would allow."""
    nodes = [_node("a", ()), _node("b", (0, 1)), _node("c", (0, 1))]
    job = _job(2, 2, frozenset({"a"}))
    plan = plan_handover(job, nodes, {"a": (0, 1)}, topology_label=None, held={"b"})
    assert plan is not None and dict(plan.placement.nodes).keys() == {"a", "c"}
    assert plan_handover(job, nodes, {"a": (0, 1)}, topology_label=None, held={"b", "c"}) is None
    assert plan_handover(job, nodes, {"a": (0, 1)}, topology_label=None, quota_left=1) is None
    assert plan_handover(job, nodes, {"a": (0, 1)}, topology_label=None, quota_left=2) is not None
    assert plan_handover(_job(1, 2, frozenset({"a"})), nodes, {"a": (0, 1)}, topology_label=None, held={"a"},
                         quota_left=0) is not None  # its own parked GPUs cost nothing more


@settings(max_examples=60, deadline=None)
@given(free=st.lists(st.sets(st.integers(0, 3), max_size=4), min_size=1, max_size=5),
       parked=st.dictionaries(st.integers(0, 4), st.sets(st.integers(0, 3), min_size=1, max_size=4), max_size=3),
       nodes=st.integers(1, 3), per_node=st.integers(1, 4), blocked=st.sets(st.integers(0, 4)),
       quota=st.none() | st.integers(0, 8))
def test_a_handover_never_uses_a_held_node_or_exceeds_the_quota(free, parked, nodes, per_node, blocked, quota):
    capacity = [_node(f"n{i}", tuple(sorted(f - parked.get(i, set())))) for i, f in enumerate(free)]
    mine = {f"n{i}": tuple(sorted(ix)) for i, ix in parked.items() if i < len(free)}
    held = {f"n{i}" for i in blocked}
    plan = plan_handover(_job(nodes, per_node, frozenset(mine)), capacity, mine, topology_label=None, held=held,
                         quota_left=quota)
    if plan is None:
        return
    others = [(n, ix) for n, ix in plan.placement.nodes if n not in plan.adopted]
    assert all(n not in held for n, _ in others)
    assert quota is None or sum(len(ix) for _, ix in others) <= quota
