"""The context guard (SPEC section 4): reserve formula and the cut search.

Pure logic over a ``measure(drop)`` callback that counts the full request with
the ``drop`` oldest droppable units removed (prior chat turns first, then the
summary and the oldest exchanges). Counts never grow when more is dropped, so
the smallest fitting ``drop`` is settled by a fitting count next to one that
does not fit: a first guess (the conversation's previous cut, or a prediction
from the first count and the units' sizes), its neighbour, then bisection. At
most ``2 + ceil(log2(n))`` counts for ``n`` exchanges in the window, ``1`` when
everything fits (and no previous cut says otherwise), ``2`` when the guess is
right.
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
    *,
    hint: int | None = None,
) -> int:
    """Return the smallest ``drop`` (0..len(unit_bytes)) with ``measure(drop) <= limit``.

    ``measure(drop)`` counts the request with the ``drop`` oldest units gone;
    counts never grow as more is dropped. ``unit_bytes`` weigh the droppable
    units (oldest first) and ``request_bytes`` the whole request: with the
    first count they predict the cut. ``hint`` is where the previous decision
    of the same conversation cut (a guess, verified like any other): in a
    tool loop the cut moves by one exchange at most, so probing the hint and
    its neighbour settles it in two counts. Every answer is confirmed by a
    fitting count next to one that does not fit, and at most
    ``2 + ceil(log2(len(unit_bytes) + 1))`` counts are made. Raises
    :class:`ProviderContextWindowExceeded` when even dropping everything
    droppable does not fit.
    """
    search = _Search(len(unit_bytes), measure, limit)
    if hint is not None and 0 < hint <= search.units:
        await search.walk(hint)
    elif not await search.probe(0) and search.units:
        await search.walk(_predict(unit_bytes, request_bytes, search.first_count, limit))
    return await search.bisect()


class _Search:
    """The smallest fitting drop lies in ``(low, high]``; ``high == units + 1`` is "none"."""

    def __init__(self, units: int, measure: Callable[[int], Awaitable[int]], limit: int) -> None:
        self.units = units
        self.low, self.high = -1, units + 1
        self.budget = 2 + math.ceil(math.log2(units + 1)) if units else 1
        self.counts = 0
        self.first_count = 0
        self._measure = measure
        self._limit = limit

    async def probe(self, drop: int) -> bool:
        count = await self._measure(drop)
        if not self.counts:
            self.first_count = count
        self.counts += 1
        fits = count <= self._limit
        if fits:
            self.high = min(self.high, drop)
        else:
            self.low = max(self.low, drop)
        return fits

    async def walk(self, guess: int, steps: int = 2) -> None:
        """Probe ``guess``, then step towards the answer while the count bound allows.

        A good guess is settled by its neighbour (two counts); a guess off by
        one more costs one more count; anything else is left to bisection.
        """
        fits = await self.probe(guess)
        for _ in range(steps):
            drop = guess - 1 if fits else guess + 1
            if not self.low < drop < self.high:
                return
            worst = max(drop - self.low, self.high - drop)  # outcomes left after the probe
            if self.counts + 1 + _bisections(worst) > self.budget:
                return
            if await self.probe(drop) != fits:
                return
            guess = drop

    async def bisect(self) -> int:
        while self.high - self.low > 1:
            await self.probe((self.low + self.high) // 2)
        if self.high > self.units:
            raise ProviderContextWindowExceeded(
                "even the minimal request (instructions, capabilities, input, the last "
                "exchange and the current observations) does not fit context_window_tokens "
                "with the reserve; raise ContextConfig.context_window_tokens (within the "
                "model's real window), lower max_output_tokens, or shorten instructions "
                "and results"
            )
        return self.high


def _bisections(candidates: int) -> int:
    """Counts a bisection needs to settle among ``candidates`` outcomes."""
    return math.ceil(math.log2(candidates)) if candidates > 1 else 0


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
