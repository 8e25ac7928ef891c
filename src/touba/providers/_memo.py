"""Each exchange rendered once, not once per decision.

A decision sends the whole window, but between two decisions of a conversation
only its newest exchange changes: the history stores hand the others back as
the very same read-only tuples (one object per stored exchange, for as long
as they keep it cached). A wire whose rendering of an exchange depends on
that exchange and its interface only keeps what it rendered here, keyed by
the tuple itself, and renders an exchange again only when it is a new object.

What is kept is bounded by what the exchanges weigh (SPEC section 3's measure,
from the window's ``sizes``): two generations of at most ``max_bytes`` each;
when the young one fills, it becomes the old one and the previous old one is
dropped, so an exchange no decision used while ``max_bytes`` of others were
rendered is forgotten (and no longer kept alive by the memo). A rendering
taken from here is shared by every body that reuses it: the wires that use
the memo never change what they rendered once it is built (each body gets new
outer lists; the items in them are read, serialised, never edited).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from touba.history._common import MiB
from touba.history._engine import HistoryWindow
from touba.history._model import Message
from touba.providers._types import DecisionInterface

__all__ = ["ExchangeMemo", "rendered_exchanges"]

T = TypeVar("T")

Exchange = tuple[Message, ...]
_Entry = tuple[Exchange, DecisionInterface, T]


class ExchangeMemo(Generic[T]):
    """Renderings of recent exchanges, reused while the history hands back the same tuple."""

    def __init__(
        self, render: Callable[[Exchange, DecisionInterface], T], *, max_bytes: int = 4 * MiB
    ) -> None:
        self._render = render
        self.max_bytes = max_bytes
        self._young: dict[int, _Entry[T]] = {}
        self._old: dict[int, _Entry[T]] = {}
        self._young_bytes = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def rendered(self, window: HistoryWindow, interface: DecisionInterface) -> list[T]:
        """The window's exchanges rendered, in order (each one kept only when the
        window weighs it: ``sizes`` aligned with ``exchanges``, as the history's are)."""
        exchanges, sizes = window.exchanges, window.sizes
        if len(sizes) != len(exchanges):
            return [self._render(exchange, interface) for exchange in exchanges]
        return [
            self._one(exchange, size.bytes, interface)
            for exchange, size in zip(exchanges, sizes, strict=True)
        ]

    def _one(self, exchange: Exchange, weight: int, interface: DecisionInterface) -> T:
        key = id(exchange)
        entry = self._young.get(key)
        if entry is not None and entry[0] is exchange and entry[1] == interface:
            return entry[2]
        entry = self._old.get(key)
        if entry is None or entry[0] is not exchange or entry[1] != interface:
            entry = (exchange, interface, self._render(exchange, interface))
        if type(exchange) is tuple:
            self._keep(key, entry, weight)
        return entry[2]

    def _keep(self, key: int, entry: _Entry[T], weight: int) -> None:
        if self._young_bytes + weight > self.max_bytes and self._young:
            self._old, self._young, self._young_bytes = self._young, {}, 0
        self._young[key] = entry
        self._young_bytes += weight


def rendered_exchanges(
    window: HistoryWindow,
    interface: DecisionInterface,
    memo: ExchangeMemo[T] | None,
    render: Callable[[Exchange, DecisionInterface], T],
) -> list[T]:
    """The window's exchanges rendered: through ``memo``, or by ``render`` each time."""
    if memo is not None:
        return memo.rendered(window, interface)
    return [render(exchange, interface) for exchange in window.exchanges]
