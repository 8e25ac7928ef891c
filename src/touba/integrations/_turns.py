"""The chat-shaped window shared by the pydantic-ai and LangChain integrations.

Both frameworks keep a conversation as messages where a user turn opens with
an *input* (a user request) and goes on with *exchanges* (a model message
with tool calls, then the messages carrying their results). Each integration
splits its list into :class:`Unit`\\ s (``is_input`` marks a turn's opening
unit); :func:`turn_window` then picks what to send, the way touba's own
window and chat memory do (SPEC sections 3 and 8):

- the current turn's input (the last input unit) is always sent and, like
  touba's invocation input, is not counted in the bounds;
- then the longest suffix that fits ``max_messages`` and ``max_bytes``: the
  current turn's exchanges first (its last one always: it holds the results
  the model is about to read, and must fit on its own, else
  ``DecisionHistoryLimitExceeded``), then whole earlier turns, newest first;
  an earlier turn is never cut, so the window always opens on a user input;
- incomplete units (a call whose result never came, a result whose call is
  gone) are never sent; ``keep_pending_tail`` keeps a last unit still
  awaiting results (a durable conversation paused on deferred calls is
  loaded as it stands, for the framework to resume).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from touba.history import ExchangeSize
from touba.integrations._cut import Unit, fit_suffix

__all__ = ["TurnUnit", "turn_window"]


@dataclass(frozen=True, slots=True)
class TurnUnit:
    unit: Unit
    is_input: bool


def _size(units: Sequence[TurnUnit]) -> ExchangeSize:
    total = ExchangeSize(0, 0)
    for u in units:
        if u.unit.complete:
            total = total + u.unit.size
    return total


def turn_window(
    units: Sequence[TurnUnit],
    *,
    max_messages: int,
    max_bytes: int,
    keep_pending_tail: bool = False,
) -> list[Unit]:
    """The units to send, oldest first (see the module docstring)."""
    if not units:
        return []
    inputs = [i for i, u in enumerate(units) if u.is_input]
    pin = inputs[-1] if inputs else None
    current = list(units[pin + 1 :] if pin is not None else units)
    prior = list(units[:pin]) if pin is not None else []
    sendable = [u for u in current if u.unit.complete]
    if keep_pending_tail and current and not current[-1].unit.complete:
        sendable.append(current[-1])
    turns: list[list[TurnUnit]] = []
    for u in prior:
        if u.is_input or not turns:
            turns.append([])
        turns[-1].append(u)
    sizes = [_size(t) for t in turns] + [u.unit.size for u in sendable]
    required = bool(sendable)
    start = fit_suffix(sizes, max_messages=max_messages, max_bytes=max_bytes, required=required)
    chosen: list[Unit] = []
    for turn in turns[start:]:
        chosen.extend(u.unit for u in turn if u.unit.complete)
    if pin is not None:
        chosen.append(units[pin].unit)
    chosen.extend(u.unit for u in sendable[max(0, start - len(turns)) :])
    return chosen
