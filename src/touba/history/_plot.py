"""The per-decision figures kept in a conversation's head, for the memory panel's plot.

Each decision of a touba record adds one point to ``head["plot"]``: sizes,
counts and verdicts, never content. Only the last :data:`PLOT_POINTS`
decisions are kept (a ring: appending one drops the oldest), so the head
stays bounded and a decision's cost stays O(1) whatever the retained history.
The record keeps this shape (documented, JSON)::

    "plot": {"decisions": <decisions ever made>,
             "points": [[<the PLOT_FIELDS of one decision, in order>], ...]}

A head without ``plot`` (written before it existed) or with one this touba
cannot read simply has no points: the figures are an aid, never a reason to
refuse a record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

__all__ = ["PLOT_FIELDS", "PLOT_KEY", "PLOT_POINTS", "DecisionPoint", "add_point", "read_points"]

PLOT_KEY: Final = "plot"
PLOT_POINTS: Final = 64


@dataclass(frozen=True, slots=True)
class DecisionPoint:
    """The figures of one decision (SPEC section 3's measure; no content).

    ``decision``: its number in the conversation (1 = the first); ``at``:
    Unix seconds. ``retained_*``: what the conversation retains after it;
    ``sent_*``: the window sent to the model, summary included.
    ``trimmed_exchanges``: the oldest exchanges left out of that window (still
    retained); ``summary_exchanges``: those a summary in the window covers;
    ``new_summary``: a summary was made for this decision. ``guard_*``: the
    context guard's last count (None when the guard is off): how many count
    requests it made, the count, the reserve, the window and whether it fit.
    """

    decision: int
    at: int
    retained_messages: int
    retained_bytes: int
    sent_messages: int
    sent_bytes: int
    trimmed_exchanges: int
    summary_exchanges: int
    new_summary: bool
    guard_counts: int
    guard_count: int | None = None
    guard_reserve: int | None = None
    guard_window: int | None = None
    guard_fits: bool | None = None


PLOT_FIELDS: Final = tuple(f.name for f in fields(DecisionPoint))


def add_point(head: dict[str, Any], point: DecisionPoint) -> None:
    """Append ``point`` to ``head``'s ring, keeping the last :data:`PLOT_POINTS`."""
    plot = head.get(PLOT_KEY)
    points: list[Any] = []
    decisions = 0
    if isinstance(plot, Mapping):
        found = plot.get("points")
        points = list(found) if isinstance(found, list) else []
        total = plot.get("decisions")
        decisions = total if isinstance(total, int) and not isinstance(total, bool) else 0
    points.append([getattr(point, name) for name in PLOT_FIELDS])  # numbers: no deep copy
    head[PLOT_KEY] = {"decisions": max(decisions, point.decision), "points": points[-PLOT_POINTS:]}


def _number(value: object, *, optional: bool = False) -> bool:
    if value is None:
        return optional
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_points(head: Mapping[str, Any]) -> list[DecisionPoint]:
    """The points of ``head`` (oldest first); malformed ones are left out."""
    plot = head.get(PLOT_KEY)
    found = plot.get("points") if isinstance(plot, Mapping) else None
    if not isinstance(found, list):
        return []
    out: list[DecisionPoint] = []
    for raw in found:
        if not isinstance(raw, list) or len(raw) != len(PLOT_FIELDS):
            continue
        numbers = [*raw[:8], raw[9]]
        optional = raw[10:13]
        if not all(_number(v) for v in numbers) or not all(
            _number(v, optional=True) for v in optional
        ):
            continue
        if not isinstance(raw[8], bool) or not (raw[13] is None or isinstance(raw[13], bool)):
            continue
        ints = [int(v) for v in raw[:8]]
        guard = [None if v is None else int(v) for v in optional]
        out.append(
            DecisionPoint(
                decision=ints[0],
                at=ints[1],
                retained_messages=ints[2],
                retained_bytes=ints[3],
                sent_messages=ints[4],
                sent_bytes=ints[5],
                trimmed_exchanges=ints[6],
                summary_exchanges=ints[7],
                new_summary=raw[8],
                guard_counts=int(raw[9]),
                guard_count=guard[0],
                guard_reserve=guard[1],
                guard_window=guard[2],
                guard_fits=raw[13],
            )
        )
    return out
