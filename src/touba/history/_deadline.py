"""Deadlines: how long one store operation or one provider request may take.

Every networked store (PostgreSQL, Redis, and the integrations built on them) and every
provider takes ``deadline_seconds=``: the longest one operation may wait on the network
before it fails with that store's (or provider's) retryable typed error, so a network
that goes silent (packets dropped, no RST) fails a worker's call instead of hanging it.
The defaults are here, so that the docs, the stores and the tests name one value.

It sits in ``history``, the lowest layer with a networked store; providers import it
from there.
"""

from __future__ import annotations

import math
from typing import Final

from touba.errors import ConfigurationError

__all__ = ["PROVIDER_DEADLINE_SECONDS", "STORE_DEADLINE_SECONDS", "check_deadline"]

STORE_DEADLINE_SECONDS: Final = 10.0
"""One store operation: a reservation, a save, a read, a release (seconds)."""

PROVIDER_DEADLINE_SECONDS: Final = 120.0
"""One provider request; for a streamed reply, the longest silence between two events."""


def check_deadline(value: object, *, owner: str, name: str = "deadline_seconds") -> float:
    """``value`` as a float of seconds, else ``ConfigurationError`` naming ``owner``.

    A deadline is a positive, finite number of seconds (an int or a float, not a bool).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"{owner}: {name} must be a number of seconds, got {type(value).__name__}"
        )
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"{owner}: {name} must be positive and finite, got {value!r}")
    return seconds
