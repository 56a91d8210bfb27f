"""Which waiting upload slots to grant, and at what byte rate: a pure policy (standard library only;
services/checkpoints/upload_slots.py reads the rows, asks here, and writes the answer).

A slot counts against two limits: the cluster's (``cluster``) and its topology domain's
(``per_label``: the value of the scheduler's topology label on the uploading node; nodes without
the label share one domain). ``None`` is no limit. Waiters are served in arrival order (``seq``):
a pass walks them oldest first and grants each one that both limits still admit. A waiter is only
passed over when its own domain is full, and then only by waiters of other domains, so no node
waits behind a stream of later ones: when a slot of its domain frees, it is the oldest waiter
that fits (docs/architecture.md, "Checkpoint upload slots"). The node's byte budget is shared
evenly by the node's holders.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SlotLimits:
    """The limits a pass applies; ``None`` means unlimited (a setting of 0)."""

    cluster: int | None = None
    """Slots granted at once in the whole cluster."""
    per_label: int | None = None
    """Slots granted at once per topology domain."""
    node_rate_bytes_per_s: int | None = None
    """Bytes per second all uploads of one node may use together."""

    def __post_init__(self) -> None:
        for name in ("cluster", "per_label", "node_rate_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None (unlimited) or at least 1, got {value}")

    @property
    def unlimited(self) -> bool:
        """No concurrency limit: every request may be granted at once."""
        return self.cluster is None and self.per_label is None

    @classmethod
    def of(cls, cluster: int, per_label: int, node_rate_bytes_per_s: int) -> SlotLimits:
        """From settings, where 0 means unlimited."""
        return cls(cluster=cluster or None, per_label=per_label or None,
                   node_rate_bytes_per_s=node_rate_bytes_per_s or None)


@dataclass(frozen=True)
class Slot:
    """A waiting or granted slot as a pass sees it."""

    id: str
    seq: int
    label: str
    node: str


def grantable(limits: SlotLimits, held: Iterable[Slot], waiting: Sequence[Slot]) -> list[str]:
    """The ids of ``waiting`` to grant now, oldest first: each waiter in ``seq`` order whose grant
    keeps the cluster and its domain within their limits. ``held`` are the slots granted and still
    live (not expired, of a current attempt)."""
    total = 0
    per_label: Counter[str] = Counter()
    for slot in held:
        total += 1
        per_label[slot.label] += 1
    granted: list[str] = []
    for slot in sorted(waiting, key=lambda s: s.seq):
        if limits.cluster is not None and total >= limits.cluster:
            break  # nobody fits until a slot frees: the pass is over
        if limits.per_label is not None and per_label[slot.label] >= limits.per_label:
            continue  # its domain is full; a waiter of another domain may still fit
        granted.append(slot.id)
        total += 1
        per_label[slot.label] += 1
    return granted


def full_labels(limits: SlotLimits, held: Iterable[Slot]) -> set[str]:
    """Domains that admit no grant now (their waiters can be left out of a pass's read)."""
    if limits.per_label is None:
        return set()
    counts = Counter(slot.label for slot in held)
    return {label for label, n in counts.items() if n >= limits.per_label}


def node_rate(limits: SlotLimits, holders_on_node: int) -> int | None:
    """The byte rate each of a node's ``holders_on_node`` uploads gets: an even share of the
    node's budget (at least 1 B/s), or None without a budget."""
    if limits.node_rate_bytes_per_s is None:
        return None
    return max(1, limits.node_rate_bytes_per_s // max(1, holders_on_node))

