"""Checkpoint upload slots: leases on the shared links, granted first come, first served within a
cluster-wide limit and a limit per topology domain, paced by a byte budget per node
(docs/architecture.md, "Checkpoint upload slots"; the pure policy is services/checkpoints/upload_policy.py).

Scale (1,024 ranks asking at once): a request is fenced like a shard report, sharing the job and
attempt rows (``FOR SHARE``: the ranks of a job never wait for each other) and writing only its own
slot row. Grants are decided by a grant pass, one transaction under a transaction-scoped advisory
lock, that grants every waiter that fits at once. A request that waits runs a pass itself if no
other runs (``pg_try_advisory_xact_lock``), else it kicks its replica's ``PassRunner``, a thread
that runs the next pass after the current one (``pg_advisory_xact_lock``: it then sees the waiter);
releases only kick it, so the releases and requests that come together are served by one pass. A
grant sends ``NOTIFY trainyard_upload_slot`` with the slot's key, which wakes the slot's long poll
on whichever replica holds it (control_plane/wakeups.py); the woken poll reads its answer in one
transaction. Waiting holds no thread and no connection.

A node's agent sends its ranks' asks and releases together (``batch_and_wait``): fenced once, the
releases then the asks applied in one transaction (one read of the open slots, one insert of the
new ones, the queue positions in one query), one long poll on all their keys; a single ask takes
the same steps (``_fence``, ``_take``, ``_answers``) for one rank.

A waiting slot stays queued while its rank is alive and asking: the replica holding its long poll
renews its place (``renew``, every third of a lease, and in each of its passes) however long the
answer takes under load; once its rank stops asking, it expires a lease later.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timedelta
from typing import Any

import structlog
from sqlalchemy import (
    ARRAY,
    BigInteger,
    Text,
    and_,
    any_,
    cast,
    delete,
    exists,
    func,
    not_,
    or_,
    select,
    text,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker

from control_plane import wakeups
from control_plane.clock import now
from control_plane.db import session_scope
from control_plane.errors import NotFound, StaleAttempt, Unprocessable
from control_plane.models import UPLOAD_SLOTS_OPEN_SQL, Attempt, Job, Node, UploadSlot
from control_plane.schemas.uploads import SlotLimitsOut, UploadSlotOut, UploadSlotsOut
from control_plane.services import events
from control_plane.services.checkpoints.upload_policy import Slot, SlotLimits, full_labels, grantable, node_rate
from control_plane.services.cluster import nodes
from control_plane.services.runs.fencing import authorize_report, check_own_ranks
from control_plane.services.states import UPLOAD_SLOT_OPEN, move_upload_slots
from control_plane.settings import Settings
from trainyard.protocol.uploads import (
    SlotAnswer,
    SlotAsk,
    SlotBatchAnswer,
    SlotBatchItem,
    SlotBatchRequest,
    SlotRelease,
    SlotReleaseItem,
    SlotRequest,
)

log = structlog.get_logger("trainyard.upload_slots")

PASS_LOCK_KEY = 0x74_79_75_70_6C_64  # "tyupld": serializes grant passes across replicas
WALK_MAX = 20_000
"""Waiting slots one pass reads at most (oldest first)."""
VIEW_MAX = 10_000
"""Slots one view lists at most."""
HISTORY_S = 86_400.0
"""Ended slots are deleted this long after they ended (the maintenance loop)."""


def limits_of(settings: Settings) -> SlotLimits:
    return SlotLimits.of(settings.upload_slots_max, settings.upload_slots_per_label,
                         settings.upload_node_rate_bytes_per_s)


def slot_key(attempt_id: uuid.UUID | str, rank: int, step: int) -> str:
    """The long-poll key of the one open slot of (attempt, rank, step)."""
    return f"{attempt_id}/{rank}/{step}"


async def ask_and_wait(factory: sessionmaker[Session], waits: wakeups.Wakeups, passes: PassRunner | None,
                       token: str, attempt_id: uuid.UUID, req: SlotRequest, settings: Settings,
                       run: wakeups.RunInThread | None = None) -> SlotAnswer:
    """A slot request as a long poll: granted at once if it can be, else answered when a grant
    pass (on any replica) grants it, or after ``wait_s`` (at most upload_slot_poll_s) with the
    queue position. While it waits, this replica's runner keeps its queue place alive (``renew``).
    ``run``: how its transactions get a thread (the bookkeeping gate's, control_plane/lanes.py)."""
    def first() -> SlotAnswer | None:
        if req.wait_s <= 0:
            return ask(factory, token, attempt_id, req, settings, passes)
        return _ask(factory, token, attempt_id, req, settings, passes, defer=True)

    def then() -> SlotAnswer:
        return poll(factory, token, attempt_id, req, settings, passes)

    wait_s = min(req.wait_s, settings.upload_slot_poll_s)
    return await waits.wait_until(slot_key(attempt_id, req.rank, req.step), first, then, wait_s, run)


def ask(factory: sessionmaker[Session], token: str, attempt_id: uuid.UUID, req: SlotRequest,
        settings: Settings, passes: PassRunner | None = None) -> SlotAnswer:
    """Create, poll or renew the slot of (attempt, rank, step), fenced by the attempt (a stale one
    gets 409 and no slot); then, if it waits, a grant pass and the answer in a second transaction."""
    answer = _ask(factory, token, attempt_id, req, settings, passes, defer=False)
    assert answer is not None
    return answer


def _ask(factory: sessionmaker[Session], token: str, attempt_id: uuid.UUID, req: SlotRequest,
         settings: Settings, passes: PassRunner | None, *, defer: bool) -> SlotAnswer | None:
    """``ask``; with ``defer``, a slot left waiting is answered None at once and this replica's runner
    is kicked for a pass (the long poll is woken by the grant): a burst of requests costs a few
    passes, not one each."""
    limits = limits_of(settings)
    with session_scope(factory) as s:
        node, attempt = _fence(s, token, attempt_id, req.fencing_token, req.node_rank, {req.rank}, asking=True)
        [slot] = _take(s, node, attempt, [req], req.wait_s, limits, settings)
        if slot.state != "waiting":
            return _answer(s, slot, settings, long_poll=req.wait_s > 0)
        slot_id = slot.id
    # Committed: a pass on any replica now sees this waiter.
    if defer and passes is not None:
        passes.kick()
        return None
    return _pass_and_answer(factory, settings, passes, slot_id, long_poll=req.wait_s > 0)


def _fence(s: Session, token: str, attempt_id: uuid.UUID, fencing_token: str, node_rank: int, ranks: set[int],
           *, asking: bool) -> tuple[Node, Attempt]:
    """The node of ``token``, speaking for ``ranks`` of its part of the attempt, fenced like a shard
    report: 409 for a stale attempt (or, ``asking``, one that ended: no new slot), 422 for a rank
    outside the world, 403 for another node's rank."""
    node = nodes.authenticate(s, token)
    _job, attempt, part = authorize_report(s, node, attempt_id, fencing_token, node_rank, exclusive=False)
    if asking and attempt.outcome is not None:
        raise StaleAttempt(f"attempt {attempt.number} already ended ({attempt.outcome}); no upload slot")
    outside = sorted(r for r in ranks if r >= attempt.num_gpus)
    if outside:
        named = f"rank {outside[0]} is" if len(outside) == 1 else f"ranks {outside[:16]} are"
        raise Unprocessable(f"{named} outside attempt {attempt.number}'s world of {attempt.num_gpus}")
    check_own_ranks(s, part, ranks)  # a node asks (and releases) only for its own ranks
    return node, attempt


def poll(factory: sessionmaker[Session], token: str, attempt_id: uuid.UUID, req: SlotRequest,
         settings: Settings, passes: PassRunner | None = None) -> SlotAnswer:
    """The end of a long poll (woken, or timed out): the slot's answer in one transaction, a waiting
    one's queue place renewed (its rank asks again at once). A slot no longer open (its attempt
    ended or went stale) is asked for anew, fenced (409 for a stale attempt)."""
    with session_scope(factory) as s:
        slot = _open_slot(s, attempt_id, req.rank, req.step)
        if slot is not None:
            if slot.state == "waiting":
                slot.expires_at = _queue_expiry(now(), settings, 0.0)
            return _answer(s, slot, settings, long_poll=req.wait_s > 0)
    return ask(factory, token, attempt_id, req, settings, passes)


def _pass_and_answer(factory: sessionmaker[Session], settings: Settings, passes: PassRunner | None,
                     slot_id: uuid.UUID, *, long_poll: bool) -> SlotAnswer:
    return _pass_and_answers(factory, settings, passes, [slot_id], long_poll=long_poll)[0]


def _pass_and_answers(factory: sessionmaker[Session], settings: Settings, passes: PassRunner | None,
                      slot_ids: Sequence[uuid.UUID], *, long_poll: bool) -> list[SlotAnswer]:
    """A grant pass if no other runs now (else this replica's runner is asked for one, which waits
    its turn), and the slots' answers, in one transaction."""
    with session_scope(factory) as s:
        if passes is None:
            _locked_pass(s, limits_of(settings), settings, alive=(), blocking=True)
        elif not _locked_pass(s, limits_of(settings), settings, alive=passes.held(), blocking=False):
            passes.kick()
        slots = [s.get(UploadSlot, slot_id, populate_existing=True) for slot_id in slot_ids]
        return _answers(s, slots, settings, long_poll=long_poll)


def _open_slot(s: Session, attempt_id: uuid.UUID, rank: int, step: int) -> UploadSlot | None:
    return _open_slots(s, attempt_id, [(rank, step)]).get((rank, step))


def _open_slots(s: Session, attempt_id: uuid.UUID, keys: Collection[tuple[int, int]]) -> dict[tuple[int, int],
                                                                                              UploadSlot]:
    """The open slots of these (rank, step) of the attempt, locked in one order (by id, as the grant
    pass's updates by id go), so two requests locking several never deadlock on each other."""
    if not keys:
        return {}
    rows = s.scalars(select(UploadSlot).where(
        UploadSlot.attempt_id == attempt_id, tuple_(UploadSlot.rank, UploadSlot.step).in_(sorted(set(keys))),
        UploadSlot.state.in_(UPLOAD_SLOT_OPEN)).order_by(UploadSlot.id).with_for_update(key_share=True)
        .execution_options(populate_existing=True))
    return {(slot.rank, slot.step): slot for slot in rows}


def _take(s: Session, node: Node, attempt: Attempt, asks: Sequence[SlotAsk | SlotRequest], wait_s: float,
          limits: SlotLimits, settings: Settings) -> list[UploadSlot]:
    """Create, poll or renew the slot of each ask (in order, a slot per (rank, step)): one read of
    the open ones, one insert of the new ones; a waiter's queue place lasts its long poll, a holder's
    lease goes on at the node's current share of its budget."""
    t = now()
    wait_s = min(wait_s, settings.upload_slot_poll_s)
    found = _open_slots(s, attempt.id, [(a.rank, a.step) for a in asks])
    new: dict[tuple[int, int], dict[str, Any]] = {}
    direct = _grants_directly(limits)
    label = node.domain(settings.topology_label)
    for a in asks:
        key = (a.rank, a.step)
        if key in found or key in new:
            continue
        new[key] = dict(
            id=uuid.uuid4(), job_id=attempt.job_id, attempt_id=attempt.id, node_id=node.id, rank=a.rank, step=a.step,
            label=label, size_bytes=a.size_bytes, requested_at=t,
            state="granted" if direct else "waiting", granted_at=t if direct else None,
            expires_at=t + timedelta(seconds=settings.upload_slot_ttl_s) if direct
            else _queue_expiry(t, settings, wait_s))
    holders: int | None = None
    for slot in found.values():
        if slot.state == "waiting":
            slot.expires_at = _queue_expiry(t, settings, wait_s)
        else:  # a renewal: the lease goes on, at the node's current share of its budget
            holders = _holders(s, slot.node_id) if holders is None else holders
            slot.expires_at = t + timedelta(seconds=settings.upload_slot_ttl_s)
            slot.rate_bytes_per_s = node_rate(limits, holders)
    if new:
        # A concurrent request for the same slot (a retry whose first answer was lost) inserts
        # nothing. The index predicate goes as SQL text (UPLOAD_SLOTS_OPEN_SQL): bound parameters in
        # it match no index once psycopg prepares the statement. Rows go in the asks' order: ``seq``
        # keeps first come, first served within a batch.
        s.execute(pg_insert(UploadSlot).values(list(new.values())).on_conflict_do_nothing(
            index_elements=["attempt_id", "rank", "step"], index_where=text(UPLOAD_SLOTS_OPEN_SQL)))
        found.update(_open_slots(s, attempt.id, list(new)))
    return [found[(a.rank, a.step)] for a in asks]


def _grants_directly(limits: SlotLimits) -> bool:
    """Without a limit or a budget there is nothing to decide: a slot is granted as it is recorded,
    and no pass is needed."""
    return limits.unlimited and limits.node_rate_bytes_per_s is None


def _queue_expiry(t: datetime, settings: Settings, wait_s: float) -> datetime:
    """A waiter's place lasts its long poll (``wait_s``; renewed while the poll is held: ``renew``)
    and a lease more, in which its rank asks again; one that stops asking (crashed) is dropped."""
    return t + timedelta(seconds=wait_s + settings.upload_slot_ttl_s)


def _holders(s: Session, node_id: uuid.UUID) -> int:
    return int(s.scalar(select(func.count()).where(UploadSlot.node_id == node_id, UploadSlot.state == "granted"))
               or 0)


def _answer(s: Session, slot: UploadSlot | None, settings: Settings, *, long_poll: bool) -> SlotAnswer:
    return _answers(s, [slot], settings, long_poll=long_poll)[0]


def _answers(s: Session, slots: Sequence[UploadSlot | None], settings: Settings, *,
             long_poll: bool) -> list[SlotAnswer]:
    """Each slot's answer; the queue positions of the waiting ones in one query."""
    if any(slot is None or slot.state not in UPLOAD_SLOT_OPEN for slot in slots):
        # Reclaimed between the request's two transactions: its attempt ended or stopped being current.
        raise StaleAttempt("the upload slot was reclaimed: its attempt ended or is no longer the job's current one")
    t = now()
    open_ = [slot for slot in slots if slot is not None]
    positions = _positions(s, sorted({slot.seq for slot in open_ if slot.state == "waiting"}))
    return [SlotAnswer(
        slot_id=str(slot.id), state="granted" if slot.state == "granted" else "waiting",
        position=positions.get(slot.seq, 0) if slot.state == "waiting" else 0,
        retry_after_s=0.0 if long_poll or slot.state == "granted" else min(1.0, settings.upload_slot_poll_s),
        rate_bytes_per_s=slot.rate_bytes_per_s, ttl_s=max(0.001, (slot.expires_at - t).total_seconds()),
        max_wait_s=settings.upload_slot_max_wait_s or None) for slot in open_]


def _positions(s: Session, seqs: list[int]) -> dict[int, int]:
    """Waiting slots ahead of each of these (by ``seq``), in one query."""
    if not seqs:
        return {}
    asked = func.unnest(cast(seqs, ARRAY(BigInteger))).table_valued("seq").render_derived(name="asked")
    ahead = (select(func.count()).where(UploadSlot.state == "waiting", UploadSlot.seq < asked.c.seq)
             .correlate(asked).scalar_subquery())
    return {int(seq): int(n or 0) for seq, n in s.execute(select(asked.c.seq, ahead))}


def release_and_grant(session: Session, node: Node, attempt_id: uuid.UUID, req: SlotRelease,
                      factory: sessionmaker[Session], settings: Settings, passes: PassRunner | None = None) -> bool:
    """The upload ended (or failed, or its worker stopped waiting): release the slot, committed,
    then hand what it held to the next waiters. False when it was not open any more."""
    _job, _attempt, part = authorize_report(session, node, attempt_id, req.fencing_token, req.node_rank,
                                            exclusive=False)
    check_own_ranks(session, part, {req.rank})
    [moved] = _release(session, attempt_id, [req])
    session.commit()
    if moved:
        _hand_on(factory, settings, passes)
    return moved


def _release(s: Session, attempt_id: uuid.UUID, releases: Sequence[SlotRelease | SlotReleaseItem]) -> list[bool]:
    """Release each (rank, step)'s open slot: whether it was open."""
    t = now()
    return [bool(move_upload_slots(s, and_(UploadSlot.attempt_id == attempt_id, UploadSlot.rank == r.rank,
                                           UploadSlot.step == r.step), "released",
                                   ended_at=t, ok=r.ok, uploaded_bytes=r.uploaded_bytes, upload_s=r.upload_s))
            for r in releases]


def _hand_on(factory: sessionmaker[Session], settings: Settings, passes: PassRunner | None) -> None:
    """After a commit that freed capacity or queued waiters: a grant pass, by this replica's runner
    (releases and requests that come together are served by one pass), or here without one."""
    if _grants_directly(limits_of(settings)):
        return  # nobody waits
    if passes is not None:
        passes.kick()
    else:
        grant_pass(factory, settings)


async def batch_and_wait(factory: sessionmaker[Session], waits: wakeups.Wakeups, passes: PassRunner | None,
                         token: str, attempt_id: uuid.UUID, req: SlotBatchRequest,
                         settings: Settings, run: wakeups.RunInThread | None = None) -> SlotBatchAnswer:
    """The asks and releases of several of a node's ranks, in one long poll (trainyard/protocol/uploads.py):
    fenced once, the releases then the asks applied in one transaction; answered at once when any
    ask is granted (or there is none, or ``wait_s`` is 0), else when a grant pass grants any of them
    (a wake-up for any of their keys), else after ``wait_s``: each ask's answer, ``waiting`` with its
    queue position. ``run``: how its transactions get a thread (the bookkeeping gate's, lanes.py)."""
    released: list[bool] = []
    long_poll = req.wait_s > 0

    def first() -> SlotBatchAnswer | None:
        done, answers = _batch(factory, token, attempt_id, req, settings, passes, defer=long_poll)
        released.extend(done)
        return None if answers is None else _batch_answer(req, answers, released)

    def then() -> SlotBatchAnswer:
        return _batch_answer(req, _poll_batch(factory, token, attempt_id, req, settings, passes), released)

    keys = [slot_key(attempt_id, a.rank, a.step) for a in req.asks]
    return await waits.wait_any(keys, first, then, min(req.wait_s, settings.upload_slot_poll_s), run)


def _batch_answer(req: SlotBatchRequest, answers: list[SlotAnswer], released: list[bool]) -> SlotBatchAnswer:
    return SlotBatchAnswer(answers=[SlotBatchItem(**answer.model_dump(), rank=a.rank, step=a.step)
                                    for a, answer in zip(req.asks, answers, strict=True)], released=released)


def _batch(factory: sessionmaker[Session], token: str, attempt_id: uuid.UUID, req: SlotBatchRequest,
           settings: Settings, passes: PassRunner | None, *, defer: bool) -> tuple[list[bool], list[SlotAnswer] | None]:
    """The batch's first phase: (each release's outcome, the asks' answers). With ``defer``, asks
    that all wait are answered None (the long poll waits for a grant) and the runner is kicked."""
    limits = limits_of(settings)
    long_poll = req.wait_s > 0
    with session_scope(factory) as s:
        ranks = {a.rank for a in req.asks} | {r.rank for r in req.releases}
        node, attempt = _fence(s, token, attempt_id, req.fencing_token, req.node_rank, ranks, asking=bool(req.asks))
        released = _release(s, attempt_id, req.releases)
        slots = _take(s, node, attempt, req.asks, req.wait_s, limits, settings)
        waiting = [slot.id for slot in slots if slot.state == "waiting"]
        answers = None
        if not waiting or (long_poll and len(waiting) < len(slots)):
            answers = _answers(s, slots, settings, long_poll=long_poll)
        ids = [slot.id for slot in slots]
    # Committed: a pass on any replica now sees the capacity released and the waiters.
    if answers is not None or (defer and passes is not None):
        if waiting or any(released):
            _hand_on(factory, settings, passes)
        return released, answers
    return released, _pass_and_answers(factory, settings, passes, ids, long_poll=long_poll)


def _poll_batch(factory: sessionmaker[Session], token: str, attempt_id: uuid.UUID, req: SlotBatchRequest,
                settings: Settings, passes: PassRunner | None) -> list[SlotAnswer]:
    """The end of a batch's long poll: every ask's answer in one transaction, the waiting ones' queue
    places renewed (their ranks ask again at once). Should a slot be no longer open, the asks are
    made anew, fenced (409 for a stale attempt); the releases are not applied again."""
    keys = [(a.rank, a.step) for a in req.asks]
    with session_scope(factory) as s:
        found = _open_slots(s, attempt_id, keys)
        if all(key in found for key in keys):
            t = now()
            for slot in found.values():
                if slot.state == "waiting":
                    slot.expires_at = _queue_expiry(t, settings, 0.0)
            return _answers(s, [found[key] for key in keys], settings, long_poll=req.wait_s > 0)
    _released, answers = _batch(factory, token, attempt_id, req.model_copy(update={"releases": []}), settings,
                                passes, defer=False)
    assert answers is not None
    return answers


def grant_pass(factory: sessionmaker[Session], settings: Settings, *, alive: Collection[str] = ()) -> int:
    """Reclaim expired and stale slots, then grant waiters oldest first within the limits, in one
    transaction after any pass running on another replica (its grants are then seen); returns how
    many it granted. ``alive``: keys of the waits held by this replica (renewed first)."""
    with session_scope(factory) as s:
        return _locked_pass(s, limits_of(settings), settings, alive=alive, blocking=True) or 0


def _locked_pass(s: Session, limits: SlotLimits, settings: Settings, *, alive: Collection[str],
                 blocking: bool) -> int | None:
    """A pass under the pass lock (transaction-scoped); None when ``blocking`` is False and another
    pass holds the lock. READ COMMITTED: a pass that waited for the lock reads what the one before
    it committed."""
    if blocking:
        s.execute(select(func.pg_advisory_xact_lock(PASS_LOCK_KEY)))
    elif not s.scalar(select(func.pg_try_advisory_xact_lock(PASS_LOCK_KEY))):
        return None
    return _pass(s, limits, settings, alive)


def _pass(s: Session, limits: SlotLimits, settings: Settings, alive: Collection[str]) -> int:
    """One pass: how many it granted (one UPDATE per byte rate granted, one NOTIFY for them all)."""
    t = now()
    _renew(s, settings, alive, t)
    _reclaim(s, t)
    held = [Slot(str(r.id), r.seq, r.label, str(r.node_id)) for r in s.execute(
        select(UploadSlot.id, UploadSlot.seq, UploadSlot.label, UploadSlot.node_id)
        .where(UploadSlot.state == "granted"))]
    if limits.cluster is not None and len(held) >= limits.cluster:
        return 0
    # Grants are stamped after the holders were read: a release this pass saw committed ended
    # before it, so the recorded times never show more holders at once than the limits allowed.
    t = now()
    full = full_labels(limits, held)
    waiting = [Slot(str(r.id), r.seq, r.label, str(r.node_id)) for r in s.execute(
        select(UploadSlot.id, UploadSlot.seq, UploadSlot.label, UploadSlot.node_id)
        .where(UploadSlot.state == "waiting", UploadSlot.label.not_in(full) if full else true())
        .order_by(UploadSlot.seq).limit(WALK_MAX))]
    chosen = set(grantable(limits, held, waiting))
    if not chosen:
        return 0
    granted = [w for w in waiting if w.id in chosen]
    holders: dict[str, int] = defaultdict(int)
    for slot in [*held, *granted]:
        holders[slot.node] += 1
    by_rate: dict[int | None, list[uuid.UUID]] = defaultdict(list)
    for slot in granted:
        by_rate[node_rate(limits, holders[slot.node])].append(uuid.UUID(slot.id))
    expires = t + timedelta(seconds=settings.upload_slot_ttl_s)
    moved = []
    for rate, ids in by_rate.items():
        moved += move_upload_slots(s, UploadSlot.id.in_(ids), "granted", granted_at=t, expires_at=expires,
                                   rate_bytes_per_s=rate)
    wakeups.notify(s, wakeups.SLOT_CHANNEL, [slot_key(r.attempt_id, r.rank, r.step) for r in moved])
    return len(moved)


def _renew(s: Session, settings: Settings, alive: Collection[str], t: datetime) -> int:
    """Keep the queue places of the waits held open (``alive``: slot keys) for a lease more: a rank
    in a long poll is alive and asking, however long the control plane takes to answer it."""
    if not alive:
        return 0
    key = func.concat(UploadSlot.attempt_id, "/", UploadSlot.rank, "/", UploadSlot.step)
    expires = t + timedelta(seconds=settings.upload_slot_ttl_s)
    result = s.execute(update(UploadSlot).where(UploadSlot.state == "waiting", UploadSlot.expires_at < expires,
                                                key == any_(cast(sorted(alive), ARRAY(Text))))
                       .values(expires_at=expires).execution_options(synchronize_session=False))
    return int(getattr(result, "rowcount", 0) or 0)


def renew(factory: sessionmaker[Session], settings: Settings, alive: Collection[str]) -> int:
    """``_renew`` in a transaction of its own (this replica's runner, every third of a lease)."""
    if not alive:
        return 0
    with session_scope(factory) as s:
        return _renew(s, settings, alive, now())


class PassRunner:
    """This replica's grant passes and the renewal of the slot waits it holds, on a thread of its
    own (not a request thread, so a burst of requests cannot hold them up). Requests and releases
    that find a pass running ``kick`` it: whatever they were, one pass serves them all."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings, held: Callable[[], Collection[str]]):
        self._factory = factory
        self._settings = settings
        self.held = held
        """Keys of the slot waits this replica holds open."""
        self._kicked = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def kick(self) -> None:
        self._kicked.set()

    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="trainyard-upload-slot-passes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._kicked.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _run(self) -> None:
        every = min(5.0, self._settings.upload_slot_ttl_s / 3)
        renew_at = time.monotonic() + every
        while not self._stopping.is_set():
            self._kicked.wait(max(0.0, renew_at - time.monotonic()))
            if self._stopping.is_set():
                return
            try:
                if self._kicked.is_set():
                    self._kicked.clear()  # before the pass: a kick during it brings another
                    grant_pass(self._factory, self._settings, alive=self.held())
                if time.monotonic() >= renew_at:
                    renew(self._factory, self._settings, self.held())
                    renew_at = time.monotonic() + every
            except Exception as exc:  # the database is away: the next kick or renewal tries again
                log.warning("upload slot pass failed", error=str(exc))
                self._kicked.set()
                self._stopping.wait(1.0)


def _reclaim(s: Session, t: datetime) -> None:
    """Expire open slots past their lease, and those of an attempt that ended or is not its job's
    current one any more (a stale attempt holds no slot); an event per attempt."""
    current = exists().where(Job.id == UploadSlot.job_id, Job.current_attempt_id == UploadSlot.attempt_id,
                             Attempt.id == UploadSlot.attempt_id, Attempt.outcome.is_(None))
    moved = move_upload_slots(s, or_(UploadSlot.expires_at < t, not_(current)), "expired", ended_at=t)
    silent: dict[tuple[uuid.UUID, uuid.UUID], list[int]] = defaultdict(list)
    for row in moved:
        silent[(row.job_id, row.attempt_id)].append(row.rank)
    for (job_id, attempt_id), ranks in sorted(silent.items()):
        ranks.sort()
        events.record(s, "upload_slot.expired",
                      f"{len(ranks)} upload slot(s) reclaimed: not renewed or asked for within the lease, or the "
                      f"attempt ended (ranks {ranks[:16]}{' ...' if len(ranks) > 16 else ''})",
                      job_id=job_id, attempt_id=attempt_id, ranks=ranks[:256])


def maintenance(factory: sessionmaker[Session], settings: Settings) -> None:
    """The maintenance loop's share: a grant pass (reclaims what crashed holders left and serves
    waiters even when no request comes), and old ended slots deleted. The waits replicas hold are
    kept alive by their runners."""
    grant_pass(factory, settings)
    with session_scope(factory) as s:
        old = select(UploadSlot.id).where(UploadSlot.state.not_in(UPLOAD_SLOT_OPEN),
                                          UploadSlot.ended_at < now() - timedelta(seconds=HISTORY_S)).limit(10_000)
        s.execute(delete(UploadSlot).where(UploadSlot.id.in_(old.scalar_subquery())))


def view(session: Session, settings: Settings, job_id: uuid.UUID | None) -> UploadSlotsOut:
    """The limits, the open slots of the cluster (or every slot of one job, oldest first)."""
    if job_id is not None and session.get(Job, job_id) is None:
        raise NotFound(f"job {job_id} not found")
    counts: dict[str, int] = {state: n for state, n in session.execute(select(UploadSlot.state, func.count()).where(
        UploadSlot.state.in_(UPLOAD_SLOT_OPEN)).group_by(UploadSlot.state))}
    which = UploadSlot.job_id == job_id if job_id is not None else UploadSlot.state.in_(UPLOAD_SLOT_OPEN)
    rows = session.execute(select(UploadSlot, Node.name).join(Node, Node.id == UploadSlot.node_id)
                           .where(which).order_by(UploadSlot.seq).limit(VIEW_MAX)).all()
    limits = SlotLimitsOut(max=settings.upload_slots_max, per_label=settings.upload_slots_per_label,
                           topology_label=settings.topology_label,
                           node_rate_bytes_per_s=settings.upload_node_rate_bytes_per_s,
                           ttl_s=settings.upload_slot_ttl_s)
    return UploadSlotsOut(limits=limits, granted=counts.get("granted", 0), waiting=counts.get("waiting", 0), slots=[
        UploadSlotOut(id=str(u.id), seq=u.seq, job_id=str(u.job_id), attempt_id=str(u.attempt_id),
                      node_id=str(u.node_id), node_name=name, label=u.label, rank=u.rank, step=u.step,
                      size_bytes=u.size_bytes, state=u.state, requested_at=u.requested_at, granted_at=u.granted_at,
                      expires_at=u.expires_at, ended_at=u.ended_at, rate_bytes_per_s=u.rate_bytes_per_s, ok=u.ok,
                      uploaded_bytes=u.uploaded_bytes, upload_s=u.upload_s)
        for u, name in rows])
