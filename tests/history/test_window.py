"""``select_window``: the longest suffix of complete exchanges that fits (SPEC section 3)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from touba.errors import DecisionHistoryLimitExceeded
from touba.history import ExchangeSize, select_window

sizes_st = st.builds(
    ExchangeSize,
    messages=st.integers(min_value=1, max_value=12),
    bytes=st.integers(min_value=1, max_value=5_000),
)
reserve_st = st.builds(
    ExchangeSize,
    messages=st.integers(min_value=0, max_value=3),
    bytes=st.integers(min_value=0, max_value=2_000),
)
bounds_st = st.tuples(
    st.integers(min_value=1, max_value=40), st.integers(min_value=1, max_value=40_000)
)

PROPERTY = settings(max_examples=200, deadline=None)


def total(sizes: list[ExchangeSize]) -> ExchangeSize:
    out = ExchangeSize(0, 0)
    for size in sizes:
        out = out + size
    return out


def last_fits(sizes: list[ExchangeSize], max_messages: int, max_bytes: int) -> bool:
    return sizes[-1].messages <= max_messages and sizes[-1].bytes <= max_bytes


def fits_with_reserve(
    window: list[ExchangeSize], max_messages: int, max_bytes: int, reserve: ExchangeSize
) -> bool:
    """The last exchange must fit the bounds; anything beyond it must leave the reserve."""
    if len(window) == 1:
        return window[0].messages <= max_messages and window[0].bytes <= max_bytes
    size = total(window)
    return (
        size.messages <= max_messages - reserve.messages and size.bytes <= max_bytes - reserve.bytes
    )


@PROPERTY
@given(st.lists(sizes_st, min_size=1, max_size=30), bounds_st, reserve_st)
def test_window_is_the_longest_fitting_suffix(
    sizes: list[ExchangeSize], bounds: tuple[int, int], reserve: ExchangeSize
) -> None:
    max_messages, max_bytes = bounds
    if not last_fits(sizes, max_messages, max_bytes):
        with pytest.raises(DecisionHistoryLimitExceeded):
            select_window(sizes, max_messages=max_messages, max_bytes=max_bytes, reserve=reserve)
        return
    start = select_window(sizes, max_messages=max_messages, max_bytes=max_bytes, reserve=reserve)
    # (b) the last exchange is always in the window
    assert 0 <= start <= len(sizes) - 1
    window = sizes[start:]
    # (a) the suffix fits both bounds (the reserve limits everything beyond the last)
    assert total(window).messages <= max_messages
    assert total(window).bytes <= max_bytes
    assert fits_with_reserve(window, max_messages, max_bytes, reserve)
    # (c) maximal: one more (older) exchange would break a bound
    if start > 0:
        assert not fits_with_reserve(sizes[start - 1 :], max_messages, max_bytes, reserve)


@PROPERTY
@given(st.lists(sizes_st, min_size=1, max_size=30), bounds_st)
def test_without_reserve_the_window_is_the_plain_one_at_a_time_rule(
    sizes: list[ExchangeSize], bounds: tuple[int, int]
) -> None:
    max_messages, max_bytes = bounds
    if not last_fits(sizes, max_messages, max_bytes):
        return
    # One at a time from the newest, stopping at the first exchange that does not fit.
    expected, used = len(sizes), ExchangeSize(0, 0)
    for index in range(len(sizes) - 1, -1, -1):
        candidate = used + sizes[index]
        if candidate.messages > max_messages or candidate.bytes > max_bytes:
            break
        expected, used = index, candidate
    assert select_window(sizes, max_messages=max_messages, max_bytes=max_bytes) == expected


@PROPERTY
@given(st.lists(sizes_st, max_size=10), sizes_st, bounds_st, reserve_st)
def test_last_exchange_over_a_bound_is_refused_naming_it(
    older: list[ExchangeSize], last: ExchangeSize, bounds: tuple[int, int], reserve: ExchangeSize
) -> None:
    # (d) "max_messages" is checked before "max_bytes"
    max_messages, max_bytes = bounds
    sizes = [*older, last]
    if last.messages > max_messages:
        expected = "max_messages"
    elif last.bytes > max_bytes:
        expected = "max_bytes"
    else:
        select_window(sizes, max_messages=max_messages, max_bytes=max_bytes, reserve=reserve)
        return
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        select_window(sizes, max_messages=max_messages, max_bytes=max_bytes, reserve=reserve)
    assert caught.value.limit == expected
    assert caught.value.code == "DecisionHistoryLimitExceeded"


@PROPERTY
@given(bounds_st, reserve_st)
def test_no_exchange_gives_an_empty_window(bounds: tuple[int, int], reserve: ExchangeSize) -> None:
    # (e)
    max_messages, max_bytes = bounds
    assert select_window([], max_messages=max_messages, max_bytes=max_bytes, reserve=reserve) == 0


def test_everything_fits() -> None:
    sizes = [ExchangeSize(2, 10), ExchangeSize(3, 10), ExchangeSize(1, 10)]
    assert select_window(sizes, max_messages=6, max_bytes=30) == 0


def test_oldest_exchanges_leave_first() -> None:
    sizes = [ExchangeSize(2, 10), ExchangeSize(3, 10), ExchangeSize(1, 10)]
    assert select_window(sizes, max_messages=5, max_bytes=1_000) == 1
    assert select_window(sizes, max_messages=100, max_bytes=20) == 1
    assert select_window(sizes, max_messages=3, max_bytes=1_000) == 2


def test_an_older_exchange_that_fits_after_one_that_does_not_stays_out() -> None:
    # Only a suffix: a small old exchange never jumps over a big one.
    sizes = [ExchangeSize(1, 1), ExchangeSize(1, 500), ExchangeSize(1, 10)]
    assert select_window(sizes, max_messages=10, max_bytes=100) == 2


def test_reserve_limits_the_extension_but_never_evicts_the_last_exchange() -> None:
    sizes = [ExchangeSize(1, 10), ExchangeSize(4, 90)]
    assert select_window(sizes, max_messages=4, max_bytes=100, reserve=ExchangeSize(1, 50)) == 1
    assert select_window(sizes, max_messages=5, max_bytes=100, reserve=ExchangeSize(0, 0)) == 0
    assert select_window(sizes, max_messages=6, max_bytes=150, reserve=ExchangeSize(1, 50)) == 0


def test_exact_bounds_fit() -> None:
    sizes = [ExchangeSize(2, 40), ExchangeSize(2, 60)]
    assert select_window(sizes, max_messages=4, max_bytes=100) == 0
    assert select_window(sizes, max_messages=3, max_bytes=100) == 1
    assert select_window(sizes, max_messages=4, max_bytes=99) == 1


@pytest.mark.parametrize(
    ("last", "limit"),
    [
        (ExchangeSize(5, 10), "max_messages"),
        (ExchangeSize(2, 101), "max_bytes"),
        (ExchangeSize(5, 101), "max_messages"),
    ],
)
def test_limit_names_the_bound(last: ExchangeSize, limit: str) -> None:
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        select_window([ExchangeSize(1, 1), last], max_messages=4, max_bytes=100)
    assert caught.value.limit == limit
