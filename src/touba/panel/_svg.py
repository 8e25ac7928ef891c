"""The picture of a conversation: inline SVG drawn on the server, no chart library.

:func:`render_plot` draws, decision by decision (the last ones the record
head keeps, :mod:`touba.history._plot`), messages and bytes retained against
those sent, marks the decisions where older exchanges were left out of the
window (trimmed) and where a summary was made, and, when the context guard
ran, its count and reserve against the window. It is a pure function of
numbers: no text from the store reaches the SVG, and its few labels are
escaped anyway. No ``style`` attribute is used (the CSP allows the panel's
stylesheet only): colours come from classes in ``panel.css``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from markupsafe import Markup, escape

from touba.history._plot import DecisionPoint
from touba.panel._format import count_of, size

__all__ = ["render_plot"]

WIDTH: Final = 720
CHART_HEIGHT: Final = 160
LEFT: Final = 64
RIGHT: Final = 16
TOP: Final = 32
BOTTOM: Final = 22


@dataclass(frozen=True, slots=True)
class _Series:
    name: str
    css: str
    values: Sequence[float | None]


def _human(value: float) -> str:
    for unit, scale in (("Mi", 1 << 20), ("Ki", 1 << 10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f}"


def _chart(
    title: str,
    points: Sequence[DecisionPoint],
    series: Sequence[_Series],
    *,
    y_offset: int,
    marks: bool,
    describe: Callable[[DecisionPoint], str],
) -> list[str]:
    count = len(points)
    inner_w = WIDTH - LEFT - RIGHT
    inner_h = CHART_HEIGHT - TOP - BOTTOM
    values = [v for s in series for v in s.values if v is not None]
    top = max(values, default=1.0) or 1.0

    def x(i: int) -> float:
        return LEFT + (inner_w / 2 if count == 1 else inner_w * i / (count - 1))

    def y(value: float) -> float:
        return y_offset + TOP + inner_h * (1 - value / top)

    out = [
        f'<text class="plot-title" x="{LEFT}" y="{y_offset + 14}">{escape(title)}</text>',
        f'<line class="plot-axis" x1="{LEFT}" y1="{y_offset + TOP + inner_h}" '
        f'x2="{WIDTH - RIGHT}" y2="{y_offset + TOP + inner_h}"/>',
        f'<line class="plot-axis" x1="{LEFT}" y1="{y_offset + TOP}" x2="{LEFT}" '
        f'y2="{y_offset + TOP + inner_h}"/>',
        f'<text class="plot-tick" x="{LEFT - 6}" y="{y(top) + 4:.1f}" '
        f'text-anchor="end">{escape(_human(top))}</text>',
        f'<text class="plot-tick" x="{LEFT - 6}" y="{y(0) + 4:.1f}" text-anchor="end">0</text>',
        f'<text class="plot-tick" x="{LEFT}" y="{y_offset + CHART_HEIGHT - 4}">'
        f"decision {points[0].decision}</text>",
        f'<text class="plot-tick" x="{WIDTH - RIGHT}" y="{y_offset + CHART_HEIGHT - 4}" '
        f'text-anchor="end">decision {points[-1].decision}</text>',
    ]
    if marks:
        for i, point in enumerate(points):
            if point.trimmed_exchanges:
                out.append(
                    f'<line class="plot-trim" x1="{x(i):.1f}" y1="{y_offset + TOP}" '
                    f'x2="{x(i):.1f}" y2="{y_offset + TOP + inner_h}"/>'
                )
            if point.new_summary:
                out.append(
                    f'<rect class="plot-summary" x="{x(i) - 4:.1f}" y="{y_offset + TOP - 10}" '
                    'width="8" height="8"/>'
                )
    for s in series:
        coords = [(x(i), y(v)) for i, v in enumerate(s.values) if v is not None]
        if not coords:
            continue
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in coords)
        out.append(f'<polyline class="plot-line {s.css}" points="{path}"/>')
        for px, py in coords:
            out.append(f'<circle class="plot-dot {s.css}" cx="{px:.1f}" cy="{py:.1f}" r="2.5"/>')
    # One transparent column per decision carries its figures as a tooltip.
    step = inner_w / max(count - 1, 1)
    for i, point in enumerate(points):
        left = max(x(i) - step / 2, LEFT)
        width = min(step, WIDTH - RIGHT - left)
        out.append(
            f'<rect class="plot-hit" x="{left:.1f}" y="{y_offset + TOP}" width="{width:.1f}" '
            f'height="{inner_h}"><title>{escape(describe(point))}</title></rect>'
        )
    legend_x = WIDTH - RIGHT
    for s in reversed(series):
        out.append(
            f'<text class="plot-legend {s.css}" x="{legend_x}" y="{y_offset + 14}" '
            f'text-anchor="end">{escape(s.name)}</text>'
        )
        legend_x -= 9 * len(s.name) + 18
    return out


def _sizes(point: DecisionPoint) -> str:
    parts = [
        f"decision {point.decision}",
        f"retained {count_of(point.retained_messages, 'message')}, {size(point.retained_bytes)}",
        f"sent {count_of(point.sent_messages, 'message')}, {size(point.sent_bytes)}",
    ]
    if point.trimmed_exchanges:
        oldest = count_of(point.trimmed_exchanges, "oldest exchange")
        parts.append(f"trimmed: {oldest} not sent")
    if point.summary_exchanges:
        made = "made now, " if point.new_summary else ""
        parts.append(f"summary ({made}covers {count_of(point.summary_exchanges, 'exchange')})")
    return "; ".join(parts)


def _guard(point: DecisionPoint) -> str:
    if point.guard_count is None:
        return f"decision {point.decision}: guard off"
    verdict = "fits" if point.guard_fits else "does not fit"
    return (
        f"decision {point.decision}: count {point.guard_count}, reserve "
        f"{point.guard_reserve} of window {point.guard_window} ({verdict}; "
        f"{count_of(point.guard_counts, 'count request')})"
    )


def render_plot(points: Sequence[DecisionPoint]) -> Markup:
    """The SVG of ``points`` (oldest first); an empty Markup when there are none."""
    if not points:
        return Markup("")
    charts = [
        (
            "messages: retained and sent",
            [
                _Series("retained", "s-retained", [p.retained_messages for p in points]),
                _Series("sent", "s-sent", [p.sent_messages for p in points]),
            ],
            True,
            _sizes,
        ),
        (
            "bytes: retained and sent",
            [
                _Series("retained", "s-retained", [p.retained_bytes for p in points]),
                _Series("sent", "s-sent", [p.sent_bytes for p in points]),
            ],
            True,
            _sizes,
        ),
    ]
    if any(p.guard_count is not None for p in points):
        charts.append(
            (
                "context guard: tokens counted, reserve and window",
                [
                    _Series("window", "s-window", [p.guard_window for p in points]),
                    _Series("reserve", "s-reserve", [p.guard_reserve for p in points]),
                    _Series("count", "s-count", [p.guard_count for p in points]),
                ],
                False,
                _guard,
            )
        )
    body: list[str] = []
    for index, (title, series, marks, describe) in enumerate(charts):
        body += _chart(
            title,
            points,
            series,
            y_offset=index * CHART_HEIGHT,
            marks=marks,
            describe=describe,
        )
    height = CHART_HEIGHT * len(charts)
    label = f"Figures of the last {len(points)} decisions"
    head = (
        f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}" role="img" aria-label="{escape(label)}">'
    )
    return Markup(head + "".join(body) + "</svg>")  # noqa: S704 - numbers and escaped labels
