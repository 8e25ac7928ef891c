"""The conversation plot is well-formed SVG of numbers, styled by classes only."""

from __future__ import annotations

import xml.etree.ElementTree as ET  # our own SVG, not untrusted input

from touba.history._plot import DecisionPoint
from touba.panel._svg import render_plot


def point(n: int, **fields: object) -> DecisionPoint:
    base: dict[str, object] = {
        "decision": n,
        "at": 0,
        "retained_messages": 2 * n,
        "retained_bytes": 300 * n,
        "sent_messages": min(2 * n, 4),
        "sent_bytes": min(300 * n, 1200),
        "trimmed_exchanges": max(n - 2, 0),
        "summary_exchanges": 0,
        "new_summary": False,
        "guard_counts": 0,
    }
    return DecisionPoint(**{**base, **fields})  # type: ignore[arg-type]


def test_no_point_draws_nothing() -> None:
    assert str(render_plot([])) == ""


def test_sizes_trims_and_summaries_are_drawn() -> None:
    points = [point(1), point(2), point(3, new_summary=True, summary_exchanges=1), point(4)]
    svg = str(render_plot(points))
    root = ET.fromstring(  # noqa: S314
        svg
    )  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    assert len(root.findall(f"{ns}polyline")) == 4  # retained and sent, in two charts
    assert len(root.findall(f"{ns}rect[@class='plot-summary']")) == 2
    assert len(root.findall(f"{ns}line[@class='plot-trim']")) == 2 * 2
    titles = [t.text or "" for t in root.iter(f"{ns}title")]
    assert "decision 3; retained 6 messages, 900 B; sent 4 messages, 900 B" in titles[2]
    assert "style=" not in svg
    assert "context guard" not in svg


def test_the_guard_chart_appears_when_the_guard_ran() -> None:
    points = [
        point(
            1,
            guard_counts=1,
            guard_count=100,
            guard_reserve=800,
            guard_window=1000,
            guard_fits=True,
        ),
        point(
            2,
            guard_counts=2,
            guard_count=300,
            guard_reserve=1100,
            guard_window=1000,
            guard_fits=False,
        ),
    ]
    svg = str(render_plot(points))
    ET.fromstring(  # noqa: S314
        svg
    )
    assert "context guard" in svg
    assert "count 300, reserve 1100 of window 1000 (does not fit; 2 count requests)" in svg


def test_a_single_point_is_centred() -> None:
    root = ET.fromstring(  # noqa: S314
        str(render_plot([point(1)]))
    )
    assert root.findall("{http://www.w3.org/2000/svg}circle")
