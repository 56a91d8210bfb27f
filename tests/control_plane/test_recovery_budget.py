"""The recovery split and its budgets (services/runs/recovery_budget.py): pure, so unit tests and
hypothesis properties, no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import example, given, settings
from hypothesis import strategies as st

from control_plane.services.runs import recovery_budget as rb
from control_plane.settings import Settings

T0 = datetime(2026, 12, 5, 3, 0, tzinfo=UTC)


def _marks(*offsets: float | None) -> rb.Marks:
    at = [None if o is None else T0 + timedelta(seconds=o) for o in offsets]
    return rb.Marks(failure=T0, failed=at[0], created=at[1], received=at[2], running=at[3], initialised=at[4],
                    first_step=at[5])


def test_each_phase_runs_from_the_boundary_before_it():
    cut = rb.split(_marks(0.2, 0.5, 0.55, 1.8, 3.0, 3.4))
    assert cut.phases == {"detection": 0.2, "decision": 0.3, "wake_up": 0.05, "process_start": 1.25,
                          "rendezvous": 1.2, "restore": 0.4}
    assert cut.total_s == 3.4


def test_an_unreported_boundary_leaves_its_phase_null_and_its_time_to_the_next():
    # An older agent sends no received age, a script without init_distributed no ready.
    cut = rb.split(_marks(0.2, 0.5, None, 1.8, None, 3.4))
    assert cut.phases["wake_up"] is None and cut.phases["rendezvous"] is None
    assert cut.phases["process_start"] == 1.3 and cut.phases["restore"] == 1.6
    assert cut.total_s == 3.4


def test_a_recovery_in_progress_has_no_total_and_its_later_phases_are_null():
    cut = rb.split(_marks(0.2, 0.5, 0.6, None, None, None))
    assert cut.total_s is None
    assert [cut.phases[p] for p in rb.PHASES] == [0.2, 0.3, 0.1, None, None, None]


def test_a_boundary_before_the_one_before_it_makes_an_empty_phase_not_a_negative_one():
    cut = rb.split(_marks(0.2, 0.5, 0.4, 1.0, 0.9, 2.0))
    assert cut.phases["wake_up"] == 0.0 and cut.phases["rendezvous"] == 0.0
    assert cut.phases["process_start"] == 0.5 and cut.phases["restore"] == 1.0


offsets = st.one_of(st.none(), st.floats(min_value=-5, max_value=600, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(st.lists(offsets, min_size=5, max_size=5), st.floats(min_value=0, max_value=600, allow_nan=False))
@example([None] * 5, 1.9214999999)  # CI found it: 1921.4999999 ms as a float, 1921.5 -> 1922 as a timestamp
def test_phases_are_never_negative_and_add_up_to_the_total(middle: list[float | None], last: float):
    cut = rb.split(_marks(*middle, last))
    measured = [cut.phases[p] for p in rb.PHASES if cut.phases[p] is not None]
    assert all(s >= 0 for s in measured)
    assert cut.total_s is not None
    # Exact in milliseconds: the job view's phases add up to its total.
    assert round(sum(measured) * 1000) == round(cut.total_s * 1000)
    # The first step, or a boundary that raced past it (never before the failure). Each offset as the
    # timestamps hold it (microseconds): 1.9215 s rounds to 1922 ms there, its float 1.92149... to 1921.
    known = [timedelta(seconds=o).total_seconds() for o in [*middle, last] if o is not None]
    assert round(cut.total_s * 1000) == max(0, *(round(o * 1000) for o in known))


@settings(max_examples=200, deadline=None)
@given(st.lists(offsets, min_size=6, max_size=6))
def test_the_boundaries_come_in_order(all_offsets: list[float | None]):
    cut = rb.split(_marks(*all_offsets))
    ends, at = [], 0.0
    for p in rb.PHASES:
        if cut.phases[p] is not None:
            at += cut.phases[p]
            ends.append(at)
    assert ends == sorted(ends)


def test_over_budget_names_each_phase_longer_than_its_budget_in_order():
    phases = {"detection": 0.2, "decision": 3.0, "wake_up": 0.05, "process_start": None, "rendezvous": 9.0,
              "restore": 1.0}
    budgets = {"detection": 0.2, "decision": 1.0, "wake_up": None, "process_start": 0.1, "rendezvous": 5.0}
    over = rb.over_budget(phases, budgets)
    # Equal is within budget; no budget (or no measure) is never over.
    assert over == [rb.Overrun("decision", 3.0, 1.0), rb.Overrun("rendezvous", 9.0, 5.0)]
    assert rb.describe(over, 13.25) == ("recovery over budget: decision took 3.000s (budget 1s); rendezvous "
                                        "took 9.000s (budget 5s) of 13.250s in all")


@given(st.dictionaries(st.sampled_from(rb.PHASES), st.floats(min_value=0, max_value=100, allow_nan=False)),
       st.dictionaries(st.sampled_from(rb.PHASES), st.floats(min_value=0.001, max_value=100, allow_nan=False)))
def test_over_budget_is_exactly_the_phases_above_their_budget(phases: dict[str, float], budgets: dict[str, float]):
    over = {o.phase for o in rb.over_budget(phases, budgets)}
    assert over == {p for p in phases if p in budgets and phases[p] > budgets[p]}


def test_a_jobs_own_budget_wins_over_the_clusters_phase_by_phase():
    cluster = {"detection": 15.0, "decision": 5.0, "wake_up": 1.0}
    assert rb.budgets_for(cluster, {"wake_up": 0.1, "decision": None}) == {
        "detection": 15.0, "decision": 5.0, "wake_up": 0.1, "process_start": None, "rendezvous": None,
        "restore": None}
    assert rb.budgets_for(cluster, None)["wake_up"] == 1.0


def test_the_cluster_has_a_budget_setting_for_every_phase():
    s = Settings(recovery_budget_wake_up_s=0.25, recovery_budget_restore_s=None)
    assert list(s.recovery_budgets) == list(rb.PHASES)
    assert s.recovery_budgets["wake_up"] == 0.25 and s.recovery_budgets["restore"] is None
