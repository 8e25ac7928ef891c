"""Window selection over complete exchanges (SPEC section 3), as pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from touba.errors import DecisionHistoryLimitExceeded

__all__ = ["ExchangeSize", "select_window"]


@dataclass(frozen=True, slots=True)
class ExchangeSize:
    """How many messages and bytes one exchange (or any group of messages) weighs."""

    messages: int
    bytes: int

    def __add__(self, other: ExchangeSize) -> ExchangeSize:
        return ExchangeSize(self.messages + other.messages, self.bytes + other.bytes)


def select_window(
    sizes: Sequence[ExchangeSize],
    *,
    max_messages: int,
    max_bytes: int,
    reserve: ExchangeSize = ExchangeSize(0, 0),
) -> int:
    """Return the start of the longest suffix of ``sizes`` that fits both bounds.

    ``sizes`` are complete exchanges, oldest first; the last one (which holds
    the current observations) is always part of the window, so it must fit on
    its own or :class:`DecisionHistoryLimitExceeded` is raised naming the bound.
    ``reserve`` is room kept for an optional extra message (a summary): it
    limits how far the window extends beyond the last exchange but never
    evicts that last exchange. With no exchanges the window is empty (``0``).
    """
    if not sizes:
        return 0
    last = sizes[-1]
    if last.messages > max_messages:
        raise DecisionHistoryLimitExceeded(
            f"the last complete exchange holds {last.messages} messages, more than "
            f"max_messages={max_messages}; raise HistoryConfig.max_messages or make the "
            "model propose fewer calls per decision",
            limit="max_messages",
        )
    if last.bytes > max_bytes:
        raise DecisionHistoryLimitExceeded(
            f"the last complete exchange weighs {last.bytes} bytes, more than "
            f"max_bytes={max_bytes}; raise HistoryConfig.max_bytes or make the "
            "capabilities return smaller results",
            limit="max_bytes",
        )
    budget_messages = max_messages - reserve.messages
    budget_bytes = max_bytes - reserve.bytes
    messages, size = last.messages, last.bytes
    start = len(sizes) - 1
    while start > 0:
        before = sizes[start - 1]
        messages += before.messages
        size += before.bytes
        if messages > budget_messages or size > budget_bytes:
            break
        start -= 1
    return start
