"""``async with`` for what touba opens: leaving the block closes it, whatever the block raised.

Below every layer (it imports nothing of touba's), so any store, pool or session can use it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncClosing"]


class AsyncClosing:
    """``async with x:`` awaits ``x._enter()`` (nothing by default), then ``x.close()`` on the
    way out; a subclass supplies ``close`` (and ``_enter`` when it opens something)."""

    __slots__ = ()

    async def close(self) -> None:
        """Release what the object holds (each subclass says what and how)."""
        raise NotImplementedError

    async def _enter(self) -> None:
        """What entering the block does before handing the object over."""

    async def __aenter__(self) -> Self:
        await self._enter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
