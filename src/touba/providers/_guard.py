"""The context guard (SPEC section 4): reserve formula and the cut search.

Pure logic over a ``measure(drop)`` callback that counts the full request with
the ``drop`` oldest droppable units removed (prior chat turns first, then the
oldest exchanges). Counts never grow when more is dropped, so the smallest
fitting ``drop`` is found with a predicted first probe, then bisection: at
most ``2 + ceil(log2(n))`` counts for ``n`` exchanges in the window, ``1`` when
everything fits and ``2`` when the prediction is right.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from touba.errors import ConfigurationError, ProviderContextWindowExceeded

__all__ = ["ContextConfig", "find_cut", "largest_fitting_count", "reserve_tokens"]


@dataclass(frozen=True, slots=True)
class ContextConfig:
    """A host ceiling on the request: the model name is never used to guess it."""

    context_window_tokens: int
    input_token_multiplier: float = 1.2
    safety_margin_tokens: int = 512

    def __post_init__(self) -> None:
        window = self.context_window_tokens
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigurationError(
                f"ContextConfig.context_window_tokens must be a positive int, got {window!r}"
            )
        multiplier = self.input_token_multiplier
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, int | float)
            or not math.isfinite(multiplier)
            or multiplier < 1
        ):
            raise ConfigurationError(
                "ContextConfig.input_token_multiplier must be a finite number >= 1 (a margin "
                f"over the provider's count), got {multiplier!r}"
            )
        margin = self.safety_margin_tokens
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ConfigurationError(
                f"ContextConfig.safety_margin_tokens must be an int >= 0, got {margin!r}"
            )


def reserve_tokens(count: int, config: ContextConfig, max_output_tokens: int) -> int:
    """``ceil(count * input_token_multiplier) + safety_margin_tokens + max_output_tokens``."""
    return (
        math.ceil(count * config.input_token_multiplier)
        + config.safety_margin_tokens
        + max_output_tokens
    )


def largest_fitting_count(config: ContextConfig, max_output_tokens: int) -> int:
    """The largest input count whose reserve fits the window (-1 if none does)."""
    room = config.context_window_tokens - config.safety_margin_tokens - max_output_tokens
    count = math.floor(room / config.input_token_multiplier)
    while count >= 0 and reserve_tokens(count, config, max_output_tokens) > (
        config.context_window_tokens
    ):
        count -= 1
    while reserve_tokens(count + 1, config, max_output_tokens) <= config.context_window_tokens:
        count += 1
    return count


async def find_cut(
    unit_bytes: Sequence[int],
    request_bytes: int,
    measure: Callable[[int], Awaitable[int]],
    limit: int,
) -> int:
    """Return the smallest ``drop`` (0..len(unit_bytes)) with ``measure(drop) <= limit``.

    ``unit_bytes`` weigh the droppable units, oldest first; ``request_bytes``
    weighs the whole request, used with the first count to predict how many
    units must go. Raises :class:`ProviderContextWindowExceeded` when even
    dropping them all does not fit.
    """
    first = await measure(0)
    if first <= limit:
        return 0
    units = len(unit_bytes)
    low, high = 0, units + 1  # measure(low) > limit; high == units + 1 means "none fits"
    if units:
        predicted = _predict(unit_bytes, request_bytes, first, limit)
        if await measure(predicted) <= limit:
            high = predicted
        else:
            low = predicted
    while high - low > 1:
        middle = (low + high) // 2
        if await measure(middle) <= limit:
            high = middle
        else:
            low = middle
    if high > units:
        raise ProviderContextWindowExceeded(
            "even the minimal request (instructions, capabilities, input, the last exchange "
            "and the current observations) does not fit context_window_tokens with the "
            "reserve; raise ContextConfig.context_window_tokens (within the model's real "
            "window), lower max_output_tokens, or shorten instructions and results"
        )
    return high


def _predict(unit_bytes: Sequence[int], request_bytes: int, first: int, limit: int) -> int:
    """How many units to drop, assuming tokens are proportional to bytes."""
    tokens_per_byte = first / max(request_bytes, 1)
    excess = first - limit
    dropped = 0.0
    for index, size in enumerate(unit_bytes, start=1):
        dropped += size * tokens_per_byte
        if dropped >= excess:
            return index
    return len(unit_bytes)
