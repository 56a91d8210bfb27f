"""Inline SVG charts for the dashboard (pure functions: no browser library to vendor or build)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

Point = tuple[float, float]

COLORS = ("#2563eb", "#d97706")


def _scale(values: Sequence[float], lo_px: float, hi_px: float, *,
           from_zero: bool = False) -> tuple[float, float, list[float]]:
    """``from_zero``: the axis starts at 0 (a rate of 9.6 to 9.9 steps/s is a flat line, not a cliff)."""
    lo, hi = min(values), max(values)
    if from_zero and lo >= 0:
        lo = 0.0
    if hi == lo:
        hi, lo = hi + 1.0, lo - (1.0 if lo else 0.0)
    span = hi - lo
    return lo, hi, [lo_px + (v - lo) / span * (hi_px - lo_px) for v in values]


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.2e}"


def line_chart(series: Sequence[tuple[str, Sequence[Point]]], *, boundaries: Sequence[tuple[float, str]] = (),
               width: int = 640, height: int = 220, from_zero: Sequence[str] = ()) -> str:
    """Up to two series against one x axis (steps): the first on the left axis, the second on the
    right; ``boundaries`` are dashed vertical lines (attempt starts) with a label; the series named
    in ``from_zero`` (rates) have an axis that starts at 0."""
    drawn = [(name, list(points)) for name, points in series if points]
    if not drawn:
        return (f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="no progress yet">'
                f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#6b7280">no progress reported yet'
                "</text></svg>")
    left, right, top, bottom = 56.0, width - 56.0, 16.0, height - 28.0
    xs = [x for _, pts in drawn for x, _ in pts] + [b for b, _ in boundaries]
    x_lo, x_hi, _ = _scale(xs, left, right)

    def x_px(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * (right - left)

    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="progress chart">',
             f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#9ca3af"/>',
             f'<text x="{left}" y="{height - 8}" font-size="11" fill="#6b7280">step {_fmt(x_lo)}</text>',
             f'<text x="{right}" y="{height - 8}" font-size="11" fill="#6b7280" text-anchor="end">{_fmt(x_hi)}</text>']
    for x, label in boundaries:
        px = x_px(x)
        parts.append(f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{bottom}" stroke="#a855f7" '
                     f'stroke-dasharray="4 3"/><text x="{px + 3:.1f}" y="{top + 10}" font-size="10" '
                     f'fill="#a855f7">{escape(label)}</text>')
    for i, (name, points) in enumerate(drawn[:2]):
        lo, hi, ys = _scale([y for _, y in points], bottom, top, from_zero=name in from_zero)
        coords = " ".join(f"{x_px(x):.1f},{y:.1f}" for (x, _), y in zip(points, ys, strict=True))
        color = COLORS[i]
        anchor, ax = ("end", left - 4) if i == 0 else ("start", right + 4)
        label = f'font-size="11" fill="{color}"'
        parts += [f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>',
                  f'<text x="{ax}" y="{top + 8}" {label} text-anchor="{anchor}">{_fmt(hi)}</text>',
                  f'<text x="{ax}" y="{bottom}" {label} text-anchor="{anchor}">{_fmt(lo)}</text>',
                  f'<text x="{(left + right) / 2 + (i - 0.5) * 160:.0f}" y="{height - 8}" font-size="12" '
                  f'fill="{color}" text-anchor="middle">{escape(name)}</text>']
        if len(points) == 1:
            parts.append(f'<circle cx="{coords.split(",")[0]}" cy="{ys[0]:.1f}" r="3" fill="{color}"/>')
    parts.append("</svg>")
    return "".join(parts)
