"""The upload-slot policy (control_plane/services/checkpoints/upload_policy.py), pure: hand cases, then
hypothesis properties over random streams of arrivals, releases, crashes and lease expiries,
simulated with the rules the service applies (a slot counts while granted, unexpired and of a
current attempt)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.services.checkpoints.upload_policy import Slot, SlotLimits, full_labels, grantable, node_rate


def _s(seq: int, label: str = "r1", node: str = "n1") -> Slot:
    return Slot(id=f"s{seq}", seq=seq, label=label, node=node)


def test_limits_of_settings_treat_zero_as_unlimited():
    assert SlotLimits.of(0, 0, 0) == SlotLimits()
    assert SlotLimits().unlimited and not SlotLimits(per_label=1).unlimited
    assert SlotLimits.of(4, 2, 1000) == SlotLimits(cluster=4, per_label=2, node_rate_bytes_per_s=1000)
    with pytest.raises(ValueError, match="cluster"):
        SlotLimits(cluster=0)


def test_oldest_first_within_the_cluster_limit():
    waiting = [_s(5), _s(2), _s(9), _s(7)]
    assert grantable(SlotLimits(cluster=3), [_s(1)], waiting) == ["s2", "s5"]
    assert grantable(SlotLimits(), [], waiting) == ["s2", "s5", "s7", "s9"]


def test_a_full_domain_is_passed_over_not_the_queue():
    held = [_s(1, "r1"), _s(2, "r1")]
    waiting = [_s(3, "r1"), _s(4, "r2"), _s(5, "r1"), _s(6, "r2"), _s(7, "r3")]
    limits = SlotLimits(cluster=4, per_label=2)
    assert grantable(limits, held, waiting) == ["s4", "s6"]  # r1 full; then the cluster is
    assert full_labels(limits, held) == {"r1"}
    # When a slot of r1 frees, its oldest waiter goes before any later one of another domain.
    assert grantable(limits, [_s(2, "r1"), _s(4, "r2"), _s(6, "r2")], [_s(3, "r1"), _s(5, "r1"), _s(7, "r3")]) == [
        "s3"]


def test_node_rate_is_an_even_share_of_the_budget():
    assert node_rate(SlotLimits(), 3) is None
    limits = SlotLimits(node_rate_bytes_per_s=1000)
    assert [node_rate(limits, n) for n in (0, 1, 3, 2000)] == [1000, 1000, 333, 1]


@dataclass
class _World:
    """The slot table as the service keeps it, driven by the policy."""

    limits: SlotLimits
    ttl: int
    t: int = 0
    seq: int = 0
    waiting: list[Slot] = field(default_factory=list)
    held: dict[str, tuple[Slot, int]] = field(default_factory=dict)  # id -> (slot, expires at)
    crashed: set[str] = field(default_factory=set)  # holders that will never release nor renew
    granted_order: list[Slot] = field(default_factory=list)

    def arrive(self, label: str, node: str) -> None:
        self.seq += 1
        self.waiting.append(Slot(id=f"s{self.seq}", seq=self.seq, label=label, node=node))

    def grant_pass(self) -> list[str]:
        # _reclaim: leases past their expiry stop counting (a crashed holder leaks nothing)
        self.held = {i: (s, exp) for i, (s, exp) in self.held.items() if exp > self.t}
        held = [s for s, _ in self.held.values()]
        chosen = grantable(self.limits, held, self.waiting)
        granted = [w for w in self.waiting if w.id in set(chosen)]
        _check_pass(self.limits, held, self.waiting, granted)
        for slot in granted:
            self.held[slot.id] = (slot, self.t + self.ttl)
            self.granted_order.append(slot)
        self.waiting = [w for w in self.waiting if w.id not in set(chosen)]
        return chosen


def _check_pass(limits: SlotLimits, held: list[Slot], waiting: list[Slot], granted: list[Slot]) -> None:
    after = Counter(s.label for s in [*held, *granted])
    total = sum(after.values())
    # Never more than the limits granted at once.
    assert limits.cluster is None or total <= limits.cluster
    assert limits.per_label is None or all(n <= limits.per_label for n in after.values())
    left = [w for w in waiting if w not in granted]
    newest = max((g.seq for g in granted), default=-1)
    for w in left:
        label_full = limits.per_label is not None and after[w.label] >= limits.per_label
        cluster_full = limits.cluster is not None and total >= limits.cluster
        # FIFO: a waiter is passed over by a later one only when its own domain is full.
        assert w.seq > newest or label_full, (w, granted)
        # And nothing that fits is left waiting.
        assert label_full or cluster_full, (w, after)


_events = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(["r1", "r2", "r3"]), st.sampled_from(["n1", "n2", "n3", "n4"])),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("crash"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.integers(1, 12)),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(cluster=st.one_of(st.none(), st.integers(1, 6)), per_label=st.one_of(st.none(), st.integers(1, 3)),
       events=_events)
def test_never_over_the_limits_fifo_and_expired_leases_return(cluster, per_label, events):
    world = _World(SlotLimits(cluster=cluster, per_label=per_label), ttl=10)
    for event in events:
        if event[0] == "arrive":
            world.arrive(event[1], event[2])
        elif event[0] in ("release", "crash") and world.held:
            live = sorted(i for i in world.held if i not in world.crashed)
            if live:
                victim = live[event[1] % len(live)]
                if event[0] == "release":
                    del world.held[victim]
                else:
                    world.crashed.add(victim)
        elif event[0] == "tick":
            world.t += event[1]
            # Live holders renew (every third of the lease); crashed ones do not.
            world.held = {i: (s, world.t + world.ttl if i not in world.crashed else exp)
                          for i, (s, exp) in world.held.items()}
        world.grant_pass()
    # Within a domain, slots are granted in arrival order.
    for label in {s.label for s in world.granted_order}:
        seqs = [s.seq for s in world.granted_order if s.label == label]
        assert seqs == sorted(seqs)
    # Once every holder has crashed and the leases ran out, all the capacity is back: nobody waits
    # behind a holder that will never release.
    world.crashed |= set(world.held)
    world.t += world.ttl + 1
    world.grant_pass()
    assert all(i not in world.crashed for i in world.held)
    if world.waiting:
        counts = Counter(s.label for s, _ in world.held.values())
        assert cluster is not None and sum(counts.values()) == cluster or per_label is not None and all(
            counts[w.label] >= per_label for w in world.waiting)


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(1, 10**9), holders=st.integers(1, 64))
def test_a_nodes_uploads_share_its_budget_without_exceeding_it(budget, holders):
    rate = node_rate(SlotLimits(node_rate_bytes_per_s=budget), holders)
    assert rate is not None and rate >= 1
    assert rate * holders <= budget or rate == 1
