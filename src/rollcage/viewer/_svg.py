"""Small inline SVG charts for the report: no library, no network, nothing executable.

Every label that could come from data goes through ``html.escape``; colours come
from CSS classes (``o-completed`` …) so the charts follow the page's theme.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

__all__ = ["bar_chart", "histogram", "scatter"]

_WIDTH = 420
_HEIGHT = 220
_LEFT = 48
_RIGHT = 12
_TOP = 28
_BOTTOM = 40


def _number(value: float) -> str:
    """A short axis label: 3 significant digits, thousands as k."""
    if value == 0:
        return "0"
    if abs(value) >= 10_000:
        return f"{value / 1000:.3g}k"
    return f"{value:.3g}"


def _frame(title: str, body: list[str], *, x_label: str = "", y_label: str = "") -> str:
    label = escape(title)
    parts = [
        f'<svg class="chart" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" aria-label="{label}" '
        'xmlns="http://www.w3.org/2000/svg">',
        f"<title>{label}</title>",
        f'<text class="chart-title" x="{_LEFT}" y="16">{label}</text>',
        f'<line class="axis" x1="{_LEFT}" y1="{_HEIGHT - _BOTTOM}" x2="{_WIDTH - _RIGHT}" '
        f'y2="{_HEIGHT - _BOTTOM}"/>',
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_HEIGHT - _BOTTOM}"/>',
        *body,
    ]
    if x_label:
        parts.append(
            f'<text class="axis-label" x="{(_LEFT + _WIDTH - _RIGHT) / 2}" y="{_HEIGHT - 6}" '
            f'text-anchor="middle">{escape(x_label)}</text>'
        )
    if y_label:
        parts.append(
            f'<text class="axis-label" x="12" y="{(_TOP + _HEIGHT - _BOTTOM) / 2}" text-anchor="middle" '
            f'transform="rotate(-90 12 {(_TOP + _HEIGHT - _BOTTOM) / 2})">{escape(y_label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _empty(title: str, message: str) -> str:
    return _frame(
        title,
        [
            f'<text class="empty" x="{(_LEFT + _WIDTH) / 2}" y="{_HEIGHT / 2}" '
            f'text-anchor="middle">{escape(message)}</text>'
        ],
    )


def bar_chart(title: str, bars: Sequence[tuple[str, int, str]]) -> str:
    """Vertical bars, one per ``(label, count, css_class)``, each with its count above it."""
    if not bars:
        return _empty(title, "nothing to show")
    top = max(count for _, count, _ in bars) or 1
    plot_w = _WIDTH - _LEFT - _RIGHT
    plot_h = _HEIGHT - _TOP - _BOTTOM
    slot = plot_w / len(bars)
    body: list[str] = [
        f'<text class="tick" x="{_LEFT - 4}" y="{_TOP + 4}" text-anchor="end">{_number(top)}</text>'
    ]
    for index, (label, count, css) in enumerate(bars):
        height = plot_h * count / top
        x = _LEFT + index * slot + slot * 0.15
        y = _TOP + plot_h - height
        body.append(
            f'<rect class="bar {escape(css)}" x="{x:.1f}" y="{y:.1f}" width="{slot * 0.7:.1f}" '
            f'height="{height:.1f}"><title>{escape(label)}: {count}</title></rect>'
        )
        body.append(
            f'<text class="value" x="{x + slot * 0.35:.1f}" y="{y - 3:.1f}" '
            f'text-anchor="middle">{count}</text>'
        )
        body.append(
            f'<text class="tick" x="{x + slot * 0.35:.1f}" y="{_HEIGHT - _BOTTOM + 14}" '
            f'text-anchor="middle">{escape(label)}</text>'
        )
    return _frame(title, body)


def histogram(title: str, values: Sequence[float], *, bins: int = 20, x_label: str = "") -> str:
    """The distribution of ``values`` in equal-width bins, with the count of each bin on hover."""
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return _empty(title, "no values")
    low, high = min(finite), max(finite)
    # Quarters keep the span finite even from -1.7e308 to 1.7e308 (a record's reward can be anything).
    span = high / 4 - low / 4
    if span == 0:
        bins, width = 1, 1.0
    else:
        width = span / bins * 4
    counts = [0] * bins
    for value in finite:
        counts[0 if span == 0 else min(bins - 1, int(bins * ((value / 4 - low / 4) / span)))] += 1
    top = max(counts)
    plot_w = _WIDTH - _LEFT - _RIGHT
    plot_h = _HEIGHT - _TOP - _BOTTOM
    slot = plot_w / bins
    body = [
        f'<text class="tick" x="{_LEFT - 4}" y="{_TOP + 4}" text-anchor="end">{top}</text>',
        f'<text class="tick" x="{_LEFT}" y="{_HEIGHT - _BOTTOM + 14}" '
        f'text-anchor="start">{_number(low)}</text>',
        f'<text class="tick" x="{_WIDTH - _RIGHT}" y="{_HEIGHT - _BOTTOM + 14}" '
        f'text-anchor="end">{_number(high)}</text>',
    ]
    for index, count in enumerate(counts):
        if not count:
            continue
        height = plot_h * count / top
        start = low + index * width
        end = high if bins == 1 else start + width
        body.append(
            f'<rect class="bar hist" x="{_LEFT + index * slot + 1:.1f}" y="{_TOP + plot_h - height:.1f}" '
            f'width="{max(1.0, slot - 2):.1f}" height="{height:.1f}">'
            f"<title>{_number(start)} – {_number(end)}: {count}</title></rect>"
        )
    return _frame(title, body, x_label=x_label, y_label="rollouts")


def scatter(
    title: str,
    points: Sequence[tuple[float, float, str, str]],
    *,
    x_label: str,
    y_label: str,
    max_points: int = 2000,
) -> str:
    """One dot per ``(x, y, css_class, label)``; evenly thinned to ``max_points`` to keep the page light."""
    usable = [point for point in points if math.isfinite(point[0]) and math.isfinite(point[1])]
    if not usable:
        return _empty(title, "no values")
    note = ""
    if len(usable) > max_points:
        step = len(usable) / max_points
        usable = [usable[int(index * step)] for index in range(max_points)]
        note = f" (every {step:.1f}th of {len(points):,})"
    x_high = max(point[0] for point in usable) or 1.0
    y_high = max(point[1] for point in usable) or 1.0
    plot_w = _WIDTH - _LEFT - _RIGHT
    plot_h = _HEIGHT - _TOP - _BOTTOM
    body = [
        f'<text class="tick" x="{_LEFT - 4}" y="{_TOP + 4}" text-anchor="end">{_number(y_high)}</text>',
        f'<text class="tick" x="{_WIDTH - _RIGHT}" y="{_HEIGHT - _BOTTOM + 14}" '
        f'text-anchor="end">{_number(x_high)}</text>',
    ]
    for x, y, css, label in usable:
        cx = _LEFT + plot_w * max(0.0, x) / x_high
        cy = _TOP + plot_h - plot_h * max(0.0, y) / y_high
        body.append(
            f'<circle class="dot {escape(css)}" cx="{cx:.1f}" cy="{cy:.1f}" r="2.5">'
            f"<title>{escape(label)}</title></circle>"
        )
    return _frame(title + note, body, x_label=x_label, y_label=y_label)
