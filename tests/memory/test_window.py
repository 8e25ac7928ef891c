"""``select_prior_turns``: the short-term window and the full-context layer (SPEC section 8)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from touba.errors import ConfigurationError
from touba.history._model import ObservationStatus
from touba.memory import MemoryConfig, StoredTurn, select_prior_turns
from touba.providers import TraceCall, Turn

PROPERTY = settings(max_examples=100, deadline=None)
WHEN = datetime(2026, 1, 1, tzinfo=UTC)

STATUSES: tuple[ObservationStatus, ...] = ("ok", "error", "denied")
CALLS = [
    TraceCall(f"c{i}", name, {"n": i}, STATUSES[i % 3], i)
    for i, name in enumerate(["lookup_order", "refund", "create_key_event"] * 2)
]
groups = st.lists(st.sampled_from(CALLS), min_size=1, max_size=3).map(tuple)
turns_st = st.lists(
    st.builds(
        Turn,
        user=st.integers(0, 99).map(str),
        replies=st.lists(st.sampled_from(["a", "b", "é"]), max_size=3).map(tuple),
        trace=st.lists(groups, max_size=3).map(tuple),
    ),
    max_size=12,
)
short_st = st.integers(min_value=0, max_value=14)
full_st = st.integers(min_value=0, max_value=5)


def stored(turns: list[Turn]) -> list[StoredTurn]:
    return [
        StoredTurn("s", i, t.user, t.replies, t.trace, f"inv-{i}", WHEN)
        for i, t in enumerate(turns)
    ]


@PROPERTY
@given(turns_st, short_st, full_st)
def test_the_last_n_turns_the_last_m_of_them_with_their_whole_trace(
    turns: list[Turn], short: int, full: int
) -> None:
    selected = select_prior_turns(turns, short, full)
    kept = turns[len(turns) - min(short, len(turns)) :]
    assert len(selected) == len(kept)
    traced = min(full, len(kept))
    for position, (got, original) in enumerate(zip(selected, kept, strict=True)):
        # Never a partial turn: every reply is there, and the trace is whole or absent.
        assert (got.user, got.replies) == (original.user, original.replies)
        with_trace = position >= len(kept) - traced
        assert got.trace == (original.trace if with_trace else ())
    # Stored turns (as a store returns them) select exactly alike.
    assert select_prior_turns(stored(turns), short, full) == selected
    if short == 0:
        assert selected == ()


@PROPERTY
@given(turns_st, short_st, full_st)
def test_the_two_settings_are_independent(turns: list[Turn], short: int, full: int) -> None:
    selected = select_prior_turns(turns, short, full)
    text_only = select_prior_turns(turns, short, 0)
    # M never changes which turns are sent, only whether they carry their trace...
    assert [(t.user, t.replies) for t in selected] == [(t.user, t.replies) for t in text_only]
    assert all(t.trace == () for t in text_only)
    # ...and N never changes which of the sent turns carry it: the last M of the window.
    wide = select_prior_turns(turns, len(turns) + 1, full)
    assert selected == wide[len(wide) - len(selected) :] or not selected


def test_zero_turns_sends_nothing_whatever_full_context_says() -> None:
    turns = [Turn("q", ("a",), ((CALLS[0],),))] * 3
    for full in range(6):
        assert select_prior_turns(turns, 0, full) == ()
        assert select_prior_turns([], 30, full) == ()


def test_seed_defaults_thirty_turns_and_the_last_one_with_its_trace() -> None:
    config = MemoryConfig()
    call = TraceCall("c1", "lookup_order", {"order_id": "A1"}, "ok", {"state": "shipped"})
    turns = [Turn(f"q{i}", (f"a{i}", f"b{i}"), ((call,), (call,))) for i in range(40)]
    selected = select_prior_turns(turns, config.short_term_turns, config.full_context_turns)
    assert [t.user for t in selected] == [f"q{i}" for i in range(10, 40)]
    assert [t.trace for t in selected[:-1]] == [()] * 29
    assert selected[-1] == turns[-1]  # both replies, both decisions' calls


def test_a_turn_with_several_replies_is_never_cut() -> None:
    call = TraceCall("c1", "refund", {"amount": 5}, "ok", None)
    turn = Turn("refund me", ("checking", "done"), ((call,),))
    assert select_prior_turns([turn], 1, 1) == (turn,)
    assert select_prior_turns([turn], 1, 0) == (Turn("refund me", ("checking", "done")),)


@pytest.mark.parametrize(("short", "full"), [(-1, 0), (0, -1), (True, 1), (1, 1.5), ("3", 1)])
def test_bad_settings_are_refused(short: object, full: object) -> None:
    with pytest.raises(ConfigurationError):
        select_prior_turns([], short, full)  # type: ignore[arg-type]
