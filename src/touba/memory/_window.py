"""Which earlier chat turns a new turn sees (SPEC section 8, seed 004), as a pure function."""

from __future__ import annotations

from collections.abc import Sequence

from touba.errors import ConfigurationError
from touba.memory._model import StoredTurn
from touba.providers._types import Turn

__all__ = ["select_prior_turns"]


def select_prior_turns(
    turns: Sequence[StoredTurn | Turn], short_term_turns: int, full_context_turns: int
) -> tuple[Turn, ...]:
    """The turns sent before a new message, oldest first.

    ``turns`` are a session's turns in order (a suffix of them is enough). The
    last ``short_term_turns`` are kept (0: none, the agent forgets the previous
    turn); the last ``full_context_turns`` of *those* keep their whole tool
    trace, the others only their text. A turn is never cut: all its replies
    are kept, and its whole trace or none of it. The two settings are
    independent: the trace layer lies within the text window.
    """
    for name, value in (
        ("short_term_turns", short_term_turns),
        ("full_context_turns", full_context_turns),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(f"{name} must be an int >= 0, got {value!r}")
    if short_term_turns == 0:
        return ()
    window = list(turns)[-short_term_turns:]
    traced_from = len(window) - full_context_turns
    return tuple(_turn(t, with_trace=i >= traced_from) for i, t in enumerate(window))


def _turn(turn: StoredTurn | Turn, *, with_trace: bool) -> Turn:
    if isinstance(turn, StoredTurn):
        return turn.as_turn(with_trace=with_trace)
    if with_trace or not turn.trace:
        return turn
    return Turn(turn.user, turn.replies)
