"""The dashboard's progress chart and the history it is drawn from (issue 26 item 8): a short job
gets enough points to read, and a steady step rate reads as steady (its axis starts at zero)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from control_plane.services.runs.progress import SAMPLE_MIN_S, SAMPLE_S, sample_interval_s
from control_plane.ui.charts import line_chart


def _heights(svg: str, series: int) -> list[float]:
    points = re.findall(r'<polyline [^>]*points="([^"]+)"', svg)[series]
    return [float(p.split(",")[1]) for p in points.split()]


def test_a_steady_rate_is_drawn_flat_and_a_loss_curve_uses_its_height() -> None:
    rate = [(float(step), 9.62 + 0.3 * (step % 2)) for step in range(0, 600, 10)]  # 9.62 .. 9.92 steps/s
    loss = [(float(step), 3.0 - step / 300) for step in range(0, 600, 10)]
    svg = line_chart([("loss", loss), ("steps/s", rate)], from_zero=("steps/s",))
    top, bottom = 16.0, 220 - 28.0
    rates = _heights(svg, 1)
    # 0.3 of ~9.9 steps/s is 3% of the axis, not all of it: no "crash" in a healthy job.
    assert max(rates) - min(rates) < 0.05 * (bottom - top)
    assert ">0<" in svg  # the rate axis is labelled from 0
    losses = _heights(svg, 0)
    assert max(losses) - min(losses) > 0.9 * (bottom - top)


@given(st.floats(min_value=0, max_value=10 * 365 * 86400))
def test_history_samples_are_denser_early_and_bounded_later(age_s: float) -> None:
    interval = sample_interval_s(age_s)
    assert SAMPLE_MIN_S <= interval <= SAMPLE_S
    assert sample_interval_s(age_s + 1) >= interval  # never denser as a part ages


def test_a_one_minute_job_gets_about_sixty_points() -> None:
    t, samples = 0.0, 1
    last = 0.0
    while t < 60:
        t += 0.5  # the agent reports progress every 0.5 s while steps change
        if t - last >= sample_interval_s(t):
            samples, last = samples + 1, t
    assert samples >= 50
