"""What the session page shows of each turn's context record (what the model was given).

A turn's record (:mod:`touba.memory._turn_context`) is rendered as one line
("given turns 2 (full trace); short-term memory 1 turn, saved in the panel
...; key events: none open"), a details list (system prompt, key events,
decision windows) and where its decision history is: a link to the
conversation's page and plot when the panel's history store still holds it,
otherwise why it is not there. Whether it is held costs one listing of the
history store per page, made only when a turn of the page retained its
history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from touba.memory import StoredTurn
from touba.memory._turn_context import describe_context, describe_windows

__all__ = ["TurnContextView", "context_views"]


@dataclass(frozen=True, slots=True)
class TurnContextView:
    """One turn's context, as the session page shows it."""

    line: str
    details: tuple[str, ...]
    conversation: str | None = None
    """The decision-history conversation key to link, when the history store holds it."""
    note: str | None = None
    """Why there is no link (history deleted, expired, or no history store given)."""


def _note(record: Mapping[str, Any], key: str | None, history: bool, held: set[str]) -> str | None:
    if not isinstance(record.get("version"), int):
        return None  # not a record this touba reads: its line says so
    if key is None:
        return "no decision history (its provider keeps none)"
    if record.get("decision_history") == "deleted":
        return "decision history not kept (deleted when the turn was stored)"
    if not history:
        return "decision history kept, but the panel has no history store (--history-db)"
    if key not in held:
        return "decision history no longer in the history store (expired or deleted)"
    return None


async def context_views(turns: Sequence[StoredTurn], history: Any) -> dict[int, TurnContextView]:
    """The view of each turn of a page, by turn index; ``history``: the panel's
    decision-history store, or None."""
    retained = [
        t.context.get("conversation_key")
        for t in turns
        if t.context is not None and t.context.get("decision_history") == "retained"
    ]
    held: set[str] = set()
    if history is not None and any(isinstance(k, str) for k in retained):
        held = {row.key for row in await history.list()}
    views: dict[int, TurnContextView] = {}
    for turn in turns:
        record = turn.context
        if record is None:
            views[turn.index] = TurnContextView(describe_context(None), ())
            continue
        key = record.get("conversation_key")
        key = key if isinstance(key, str) else None
        note = _note(record, key, history is not None, held)
        views[turn.index] = TurnContextView(
            describe_context(record),
            tuple(describe_windows(record)),
            conversation=key if note is None else None,
            note=note,
        )
    return views
