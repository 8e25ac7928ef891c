"""The window over a framework's message list, as pure functions.

Every integration splits its framework's list into *units*: runs of
consecutive messages that must travel together (a call with its result, a
reasoning item with the items it belongs to). Each integration says what its
units are; this module only picks which to send, by the rules of SPEC
section 3: the longest suffix of complete units that fits ``max_messages``
and ``max_bytes``, a required last unit that must fit on its own
(``DecisionHistoryLimitExceeded`` otherwise), and incomplete units (a call
that never got its result, a result whose call is gone) never sent.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from touba.errors import ConfigurationError
from touba.history import ExchangeSize, select_window

__all__ = ["Unit", "check_bound", "fit_suffix"]

UNBOUNDED = sys.maxsize


@dataclass(frozen=True, slots=True)
class Unit:
    """Messages ``start`` .. ``stop - 1`` of a list, which travel together."""

    start: int
    stop: int
    complete: bool
    size: ExchangeSize


def check_bound(name: str, value: int | None) -> int:
    """A bound as an int (``None``: unbounded); ``ConfigurationError`` when not a positive int."""
    if value is None:
        return UNBOUNDED
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int or None, got {value!r}")
    return value


def check_limit(name: str, value: int) -> int:
    """A bound that must be given (``None`` refused too); ``ConfigurationError`` otherwise."""
    if check_bound(name, value) == UNBOUNDED:
        raise ConfigurationError(f"{name} must be a positive int")
    return value


def fit_suffix(
    sizes: Sequence[ExchangeSize],
    *,
    max_messages: int,
    max_bytes: int,
    required: bool,
) -> int:
    """Start of the longest suffix of ``sizes`` that fits both bounds.

    With ``required`` the last size is always kept and must fit on its own
    (touba's window rule, :func:`touba.history.select_window`, which raises
    :class:`~touba.errors.DecisionHistoryLimitExceeded` naming the bound);
    without it the suffix may be empty (``len(sizes)``).
    """
    if not sizes:
        return 0
    if required:
        return select_window(sizes, max_messages=max_messages, max_bytes=max_bytes)
    start = len(sizes)
    total = ExchangeSize(0, 0)
    while start > 0:
        candidate = total + sizes[start - 1]
        if candidate.messages > max_messages or candidate.bytes > max_bytes:
            break
        total = candidate
        start -= 1
    return start
