"""Bytes and time of one collective, per link class (alpha-beta model). Pure: standard library only.

A group of ``per_node`` GPUs on each of ``nodes`` nodes runs a collective the bandwidth-optimal
hierarchical way (docs/planner.md, "Communication"): an all-reduce of B bytes is a reduce-scatter
inside each node ((g-1)/g B per GPU), an all-reduce across nodes of each GPU's 1/g share
(2(m-1)/m B/g), and an all-gather inside the node ((g-1)/g B). Per GPU that is exactly the ring's
2(n-1)/n B in all, n = g*m; the hierarchy only says which link carries which part. Reduce-scatter
and all-gather are half of it: (n-1)/n B.
"""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.planning.hardware import Hardware


@dataclass(frozen=True)
class Group:
    """The GPUs of one collective: ``per_node`` on each of ``nodes`` nodes."""

    per_node: int
    nodes: int

    @property
    def size(self) -> int:
        return self.per_node * self.nodes


@dataclass(frozen=True)
class Traffic:
    """What one GPU sends, and the ring steps it waits through, per link class."""

    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    intra_steps: float = 0.0
    inter_steps: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.intra_bytes + other.intra_bytes, self.inter_bytes + other.inter_bytes,
                       self.intra_steps + other.intra_steps, self.inter_steps + other.inter_steps)

    def times(self, count: float) -> Traffic:
        return Traffic(self.intra_bytes * count, self.inter_bytes * count, self.intra_steps * count,
                       self.inter_steps * count)

    @property
    def total_bytes(self) -> float:
        return self.intra_bytes + self.inter_bytes

    def seconds(self, hw: Hardware) -> float:
        """latency x steps + bytes / bandwidth, per link class; the phases run one after the other."""
        return (self.intra_steps * hw.intra.latency_s + self.intra_bytes / hw.intra.bytes_per_s
                + self.inter_steps * hw.inter.latency_s + self.inter_bytes / hw.inter.bytes_per_s)


def reduce_scatter(size_bytes: float, group: Group) -> Traffic:
    """Reduce-scatter (or all-gather) of a buffer of ``size_bytes`` (the unsharded size)."""
    g, m = group.per_node, group.nodes
    return Traffic(
        intra_bytes=(g - 1) / g * size_bytes,
        inter_bytes=(m - 1) / m * size_bytes / g,
        intra_steps=g - 1,
        inter_steps=m - 1,
    )


all_gather = reduce_scatter
"""All-gather moves the same bytes as reduce-scatter, the other way."""


def all_reduce(size_bytes: float, group: Group) -> Traffic:
    """Reduce-scatter then all-gather: 2(n-1)/n of the buffer per GPU."""
    return reduce_scatter(size_bytes, group).times(2)
