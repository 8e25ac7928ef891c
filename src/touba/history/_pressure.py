"""When a store is nearly full: the rule of the ``history_store_pressure`` event.

A store is under pressure when it holds over 80 % of its ``max_sessions`` or
of its ``max_store_bytes`` (:func:`under_pressure`, exact integer arithmetic).
The event is let through at most once a minute per store *object*, however
many decision histories (providers) share that store: :data:`STORE_PRESSURE`
remembers, per store, when it last let one through. It holds stores weakly,
so a store that is gone is forgotten. Its ``clock`` is monotonic and may be
replaced (tests do).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Final

from touba.history._store import StoreUsage

__all__ = ["PRESSURE_INTERVAL_SECONDS", "STORE_PRESSURE", "PressureGate", "under_pressure"]

PRESSURE_INTERVAL_SECONDS: Final = 60.0


def under_pressure(usage: StoreUsage) -> bool:
    """Whether the store holds over 80 % of either of its limits."""
    return (
        5 * usage.sessions > 4 * usage.max_sessions or 5 * usage.bytes > 4 * usage.max_store_bytes
    )


class PressureGate:
    """Lets one pressure event per store through per ``interval`` seconds."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = PRESSURE_INTERVAL_SECONDS,
    ) -> None:
        self.clock = clock
        self.interval = interval
        self._last: weakref.WeakKeyDictionary[object, float] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # a store may serve several event loops

    def admit(self, store: object) -> bool:
        """True (and remembered) if no event for ``store`` went out in the interval.

        A store that cannot be held weakly or hashed is never admitted: without
        a memory of it, the once-a-minute promise could not be kept.
        """
        now = self.clock()
        with self._lock:
            try:
                last = self._last.get(store)
                if last is not None and now - last < self.interval:
                    return False
                self._last[store] = now
            except TypeError:
                return False
            return True


STORE_PRESSURE: Final = PressureGate()
"""The gate every :class:`~touba.history.DecisionHistory` shares."""
