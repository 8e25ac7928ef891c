"""The guard's cut search: same answer as one-at-a-time, bounded count requests."""

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from touba.errors import ConfigurationError, ProviderContextWindowExceeded
from touba.providers._guard import (
    ContextConfig,
    find_cut,
    largest_fitting_count,
    reserve_tokens,
)


def one_at_a_time(counts: list[int], limit: int) -> int | None:
    for drop, count in enumerate(counts):
        if count <= limit:
            return drop
    return None


@st.composite
def scenarios(draw):
    units = draw(st.integers(min_value=0, max_value=60))
    weights = draw(st.lists(st.integers(1, 5000), min_size=units, max_size=units))
    base = draw(st.integers(1, 4000))
    last = draw(st.integers(1, 4000))
    # tokens roughly proportional to bytes, with noise; counts never grow as more is dropped
    ratio = draw(st.floats(0.1, 1.0))
    noise = draw(st.lists(st.integers(0, 50), min_size=units + 1, max_size=units + 1))
    counts = []
    for drop in range(units + 1):
        kept = sum(weights[drop:])
        counts.append(int((base + last + kept) * ratio) + noise[drop])
    for i in range(units - 1, -1, -1):  # enforce monotonicity
        counts[i] = max(counts[i], counts[i + 1])
    limit = draw(st.integers(0, max(counts) + 10))
    return weights, base + last + sum(weights), counts, limit


@settings(max_examples=400, deadline=None)
@given(scenarios(), st.none() | st.integers(min_value=-2, max_value=70))
def test_cut_equals_one_at_a_time_within_count_budget(scenario, hint) -> None:
    """Whatever the hint (absent, right, wrong, out of range), the answer is exact."""
    weights, request_bytes, counts, limit = scenario
    asked: list[int] = []

    async def measure(drop: int) -> int:
        asked.append(drop)
        return int(counts[drop])

    async def cut() -> int:
        return await find_cut(weights, request_bytes, measure, limit, hint=hint)

    expected = one_at_a_time(counts, limit)
    n = len(weights) + 1  # exchanges in the window: the droppable ones and the last
    if expected is None:
        with pytest.raises(ProviderContextWindowExceeded):
            asyncio.run(cut())
    else:
        assert asyncio.run(cut()) == expected
    without_hint = hint is None or not 0 < hint <= len(weights)
    budget = 1 if expected == 0 and without_hint else 2 + math.ceil(math.log2(n))
    assert len(asked) <= budget, (asked, n)
    assert len(asked) == len(set(asked)), "a drop level is never counted twice"


def test_everything_fits_costs_one_count() -> None:
    asked = []

    async def measure(drop: int) -> int:
        asked.append(drop)
        return 100

    assert asyncio.run(find_cut([10, 10, 10], 100, measure, 1000)) == 0
    assert asked == [0]


def test_sliding_window_costs_two_counts() -> None:
    """The common case: one new exchange pushes exactly one old one out."""
    weights = [400] * 20
    counts = [4000 - 100 * d for d in range(21)]
    asked = []

    async def measure(drop: int) -> int:
        asked.append(drop)
        return counts[drop]

    assert asyncio.run(find_cut(weights, 16000, measure, 3950)) == 1
    assert asked == [0, 1]


def test_sliding_window_with_the_last_cut_as_hint_costs_two_counts() -> None:
    """In a tool loop the cut moves by one exchange: the hint and its neighbour settle it."""
    weights = [400] * 30
    for previous_cut, true_cut, expected_counts in [(5, 6, 2), (5, 5, 2), (9, 8, 3)]:
        counts = [10_000] * (true_cut) + [100] * (31 - true_cut)
        asked: list[int] = []

        async def measure(drop: int, counts=counts, asked=asked) -> int:
            asked.append(drop)
            return int(counts[drop])

        got = asyncio.run(find_cut(weights, 12_000, measure, 3_000, hint=previous_cut))
        assert got == true_cut
        assert len(asked) == expected_counts, asked


def test_reserve_formula() -> None:
    config = ContextConfig(context_window_tokens=32768)
    assert reserve_tokens(1000, config, 1000) == math.ceil(1000 * 1.2) + 512 + 1000
    limit = largest_fitting_count(config, 1000)
    assert reserve_tokens(limit, config, 1000) <= 32768 < reserve_tokens(limit + 1, config, 1000)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"context_window_tokens": 0},
        {"context_window_tokens": True},
        {"context_window_tokens": 1000, "input_token_multiplier": 0.5},
        {"context_window_tokens": 1000, "input_token_multiplier": float("nan")},
        {"context_window_tokens": 1000, "safety_margin_tokens": -1},
    ],
)
def test_context_config_refuses_bad_values(kwargs) -> None:
    with pytest.raises(ConfigurationError):
        ContextConfig(**kwargs)
