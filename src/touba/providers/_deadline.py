"""The deadline of one provider request (``deadline_seconds``, SPEC section 2).

Every provider takes ``deadline_seconds`` (default
:data:`~touba.history._deadline.PROVIDER_DEADLINE_SECONDS`, 120 s). The provider runs
each generation and each count of the context guard under :func:`request_deadline`,
an ``asyncio.timeout`` around the whole SDK call (its retries included), so a request
that gets no answer fails with a typed retryable error instead of hanging the worker,
whatever timeout the host's client has (none included). A streamed reply may last
longer than the deadline in total: the wire reads its events through :class:`Paced`,
which moves the deadline forward on every event, so the deadline bounds the silence
before the first event and between two events (the time the caller's sink takes is not
counted). Where the SDK has a per-request timeout, the wire also sends
:func:`capped_timeout` (the client's own timeout, no longer than the deadline), so the
SDK gives up first on its own terms where it can.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

from touba.errors import ToubaError

__all__ = ["Paced", "capped_timeout", "request_deadline"]

T = TypeVar("T")

_current: ContextVar[tuple[asyncio.Timeout, float] | None] = ContextVar(
    "touba_provider_deadline", default=None
)


@asynccontextmanager
async def request_deadline(
    seconds: float, failure: Callable[[], ToubaError]
) -> AsyncIterator[None]:
    """Run the body under a deadline of ``seconds``; past it, the body is cancelled and
    ``failure()`` raised, chained to the ``TimeoutError``. A :class:`Paced` stream read
    inside moves the deadline on each event."""
    scope = asyncio.timeout(seconds)
    try:
        async with scope:
            token = _current.set((scope, seconds))
            try:
                yield
            finally:
                _current.reset(token)
    except TimeoutError as e:
        if not scope.expired():
            raise  # not ours
        raise failure() from e


class Paced(Generic[T]):
    """``events`` read under the current request's deadline as a bound on silence: the
    deadline restarts before each event is awaited and is lifted while the consumer
    handles the event it got."""

    def __init__(self, events: AsyncIterable[T]) -> None:
        self._events = aiter(events)

    def __aiter__(self) -> Paced[T]:
        return self

    async def __anext__(self) -> T:
        current = _current.get()
        if current is None:
            return await anext(self._events)
        scope, seconds = current
        scope.reschedule(asyncio.get_running_loop().time() + seconds)
        event = await anext(self._events)
        scope.reschedule(None)
        return event


def capped_timeout(configured: Any, seconds: float) -> Any:
    """A per-request timeout for an httpx-based SDK: ``configured`` (the client's: a
    number of seconds, an ``httpx.Timeout`` or the like, or None for none) with each part
    no longer than ``seconds``. Anything else (an SDK sentinel) becomes ``seconds``."""
    if isinstance(configured, bool):
        return seconds
    if isinstance(configured, int | float):
        return min(float(configured), seconds)
    parts = ("connect", "read", "write", "pool")
    if configured is not None and all(hasattr(configured, p) for p in parts):
        limits = {p: getattr(configured, p) for p in parts}
        # the SDK's own Timeout class (httpx's, or a fork's such as httpx2)
        return type(configured)(
            **{p: seconds if v is None else min(v, seconds) for p, v in limits.items()}
        )
    return seconds
