"""The state tables of services/states.py (issue 9, design): every non-terminal state has an
automatic exit whose timeouts are real settings, every state can reach an end, the mutators are
the only writers of the state columns and refuse what the tables do not allow, and no module
spells a state group by hand."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from control_plane.errors import InvalidState
from control_plane.models import Attempt, AttemptPart, Checkpoint, Job, Node
from control_plane.schemas.jobs import JOB_STATES
from control_plane.services import states
from control_plane.settings import Settings

TABLES = {"job": states.JOB, "attempt": states.ATTEMPT, "part": states.PART, "node": states.NODE,
          "checkpoint": states.CHECKPOINT, "upload_slot": states.UPLOAD_SLOT}
ROOT = Path(__file__).resolve().parents[2] / "control_plane"
DOC = ROOT.parent / "docs" / "architecture.md"


@pytest.mark.parametrize("name", TABLES)
def test_every_non_terminal_state_has_an_automatic_exit(name):
    table = TABLES[name]
    settings = set(Settings.model_fields)
    for state, spec in table.items():
        assert spec.to <= set(table), (name, state, spec.to - set(table))
        if not spec.to:
            assert spec.exit is None, (name, state)  # terminal
            continue
        assert spec.exit is not None and spec.exit.how, f"{name} {state}: no exit written down"
        for setting in spec.exit.settings:
            assert setting in settings, f"{name} {state}: {setting} is not a setting"
        if name == "node" and state in states.NODE_WAITS_FOR_OPERATOR:
            # On purpose: a lost node's GPUs are never given away on a timeout. Its agent's
            # return (a message) or an operator ends it; no job or attempt waits on that alone.
            assert spec.exit.message and spec.exit.operator, state
            continue
        assert spec.exit.settings, f"{name} {state}: no timeout gets it out"
        assert all(Settings.model_fields[s].default > 0 for s in spec.exit.settings)


@pytest.mark.parametrize("name", ["job", "attempt", "part", "checkpoint", "upload_slot"])
def test_every_state_can_reach_an_end(name):
    table = TABLES[name]
    ends = {s for s, spec in table.items() if not spec.to}
    for state in table:
        seen, frontier = set(), {state}
        while frontier:
            s = frontier.pop()
            seen.add(s)
            frontier |= table[s].to - seen
        assert seen & ends, (name, state)


def test_the_tables_are_the_ones_docs_and_renderer_show():
    assert states.TABLES == TABLES
    rendered = states.render_markdown()
    for name, table in TABLES.items():  # every state of every table is in the rendered list
        block = rendered.split(f"**{name}**", 1)[1].split("\n\n**", 1)[0]
        assert [line.split("`")[1] for line in block.splitlines() if line.startswith("- `")] == list(table), name
    assert rendered in DOC.read_text(), (
        "docs/architecture.md does not show the state tables of services/states.py; paste "
        "`python -c 'from control_plane.services.states import render_markdown; print(render_markdown())'`")


def test_the_checkpoint_table_is_the_one_checkpoints_uses():
    from control_plane.models import Checkpoint
    from control_plane.services.checkpoints import checkpoints

    assert set(states.CHECKPOINT) == {"pending", "committed", "unusable", "aborted", "deleted"}
    kinds = {s: {t: f"checkpoint.{t}" for t in spec.to} for s, spec in states.CHECKPOINT.items()}
    assert kinds == checkpoints.TRANSITIONS
    assert checkpoints.TERMINAL == states.CHECKPOINT_TERMINAL == set(states.CHECKPOINT_COLLECTED)
    for state in states.CHECKPOINT:  # the column's documented values are the table's
        assert state in (Checkpoint.state.doc or "")


def test_the_groups_match_the_tables_and_the_schema():
    assert set(states.JOB) == set(JOB_STATES)
    assert {"succeeded", "failed", "cancelled"} == states.JOB_TERMINAL
    for group in (states.JOB_WAITING, states.JOB_ACTIVE):
        assert set(group) <= set(states.JOB) - states.JOB_TERMINAL
    assert set(states.ATTEMPT_LIVE) < set(states.ATTEMPT_HOLDING) < set(states.ATTEMPT)
    assert set(states.PART_ORDER) == set(states.PART)
    for src, spec in states.PART.items():  # a part only moves forward
        assert all(states.PART_ORDER[dst] > states.PART_ORDER[src] for dst in spec.to), src


def _py_files():
    return [p for p in ROOT.rglob("*.py") if p.name != "states.py"]


def test_only_the_mutators_write_state_columns():
    # Workers (``w``) have their own merge.
    allowed = {("status_reports.py", "w")}
    offenders = []
    for path in _py_files():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and el.attr == "state":
                        owner = el.value.id if isinstance(el.value, ast.Name) else None
                        if (path.name, None) in allowed or (path.name, owner) in allowed:
                            continue
                        offenders.append(f"{path.relative_to(ROOT)}:{el.lineno}")
    assert offenders == []


def test_no_module_spells_a_state_group_by_hand():
    groups = {frozenset(g) for g in (states.JOB_WAITING, states.JOB_ACTIVE, states.ATTEMPT_LIVE,
                                     states.ATTEMPT_HOLDING, states.PART_STARTED, states.PART_DONE,
                                     states.CHECKPOINT_COLLECTED, states.UPLOAD_SLOT_OPEN)}
    offenders = []
    for path in _py_files():
        if path.name == "models.py":  # the partial index is written in SQL there
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            strings = isinstance(node, ast.Tuple | ast.Set) and node.elts and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
            if strings and frozenset(e.value for e in node.elts) in groups:  # type: ignore[attr-defined]
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_mutators_refuse_what_the_tables_do_not_allow(clock):
    session = Session()  # unbound: the mutators only add event rows
    job = Job(id=uuid.uuid4(), state="succeeded")
    with pytest.raises(InvalidState):
        states.set_job_state(session, job, "running", "no")
    attempt = Attempt(id=uuid.uuid4(), job_id=job.id, state="ended")
    with pytest.raises(InvalidState):
        states.set_attempt_state(session, attempt, "running", "no")
    part = AttemptPart(id=uuid.uuid4(), attempt_id=attempt.id, node_id=uuid.uuid4(), node_rank=0, state="running")
    assert states.advance_part(session, part, "launching") is False and part.state == "running"  # monotonic
    assert states.advance_part(session, part, "exited") is True and part.state == "exited"
    node = Node(id=uuid.uuid4(), name="n", state="removed", schedulable=False, draining=True)
    assert states.set_node_state(session, node, "ready", "back", kind="node.rejoined")
    assert (node.state, node.schedulable, node.draining) == ("ready", True, False)
    with pytest.raises(InvalidState):
        states.set_node_state(session, Node(id=uuid.uuid4(), name="m", state="removed"), "lost", "x", kind="k")
    with pytest.raises(ValueError):
        states.set_node_state(session, node, "sleeping", "x", kind="k")
    ckpt = Checkpoint(id=uuid.uuid4(), job_id=job.id, attempt_id=attempt.id, step=5, state="committed")
    assert states.set_checkpoint_state(session, ckpt, "aborted", "late abort") is False  # not in the table
    assert states.set_checkpoint_state(session, ckpt, "unusable", "bad", reason="bad") is True
    assert (ckpt.state, ckpt.reason) == ("unusable", "bad")
    assert states.set_checkpoint_state(session, ckpt, "deleted", "x") is False  # terminal
    with pytest.raises(ValueError):
        states.set_checkpoint_state(session, ckpt, "superseded", "x")
    assert sorted(e.kind for e in session.new) == ["checkpoint.unusable", "node.rejoined", "part.exited"]
