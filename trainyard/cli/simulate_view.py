"""``trainyard simulate``'s tables (the figures are control_plane/goodput/simulate.py's)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render(result: Any, console: Console) -> None:
    r = result
    console.print(f"job MTBF {r.job_mtbf_s / 3600:.2f} h (node MTBF {r.node_mtbf_h:,.0f} h); Young's interval "
                  f"{r.young_interval_s:,.0f} s; simulated at {r.interval_s:,.0f} s "
                  f"(best found {r.best_interval_s:,.0f} s)")
    summary = Table(title="goodput at that interval")
    for column in ("goodput", "closed form", "wall h", "lost work h", "stall h", "recovery h", "waiting h",
                   "failures", "saves"):
        summary.add_column(column, justify="right")
    summary.add_row(_pct(r.goodput), _pct(r.goodput_closed_form), f"{r.wall_h:,.1f}", f"{r.lost_work_h:,.1f}",
                    f"{r.checkpoint_stall_h:,.1f}", f"{r.recovery_h:,.1f}", f"{r.waiting_h:,.1f}", str(r.failures),
                    f"{r.saves:,}")
    console.print(summary)
    intervals = Table(title="goodput by interval")
    intervals.add_column("interval s", justify="right")
    intervals.add_column("goodput", justify="right")
    for p in r.intervals:
        intervals.add_row(f"{p.interval_s:,.0f}", _pct(p.goodput))
    console.print(intervals)
    spares = Table(title="goodput by spare nodes")
    for column in ("spares", "goodput", "waiting for a node h"):
        spares.add_column(column, justify="right")
    for p in r.spares:
        spares.add_row("always one" if p.spares is None else str(p.spares), _pct(p.goodput), f"{p.waiting_h:,.1f}")
    console.print(spares)
    modes = Table(title="async against sync saves (each at its best interval)")
    for column in ("mode", "blocking s", "background s", "interval s", "goodput"):
        modes.add_column(column, justify="right")
    for m in r.modes:
        modes.add_row(m.mode, f"{m.blocking_s:g}", f"{m.background_s:g}", f"{m.interval_s:,.0f}", _pct(m.goodput))
    console.print(modes)
