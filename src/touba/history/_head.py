"""A conversation's head, read and written again at every decision, at the cost of
what changed.

Every decision reads the stored head (JSON text) and writes a new one. Most of
a head is its plot ring (:mod:`touba.history._plot`: 64 points of 14 numbers,
about 4 KB of a 4.7 KB head), of which a decision changes one point: parsing
and encoding the whole head each time cost more than the rest of the head
work together. A store object therefore keeps, per conversation, the head it
last wrote as a :class:`HeldHead` (the text, the parsed value, the text of each
plot point), and:

- the stored text is parsed (:func:`parse_head`) only when it is not the held
  text (:meth:`HeldHead.holds` compares it whole: whatever changed it, another
  process included, is seen); else the held head is copied;
- :func:`encode_head` reuses the text of the points it holds, byte-identical
  to :func:`~touba.history._model.canonical_json` of the whole head (any head it
  cannot reason about is encoded whole).

The parsed head is shared between the held copy and the transaction that reads
it, so its nested values are read-only (:mod:`touba.history._frozen`; changing
one raises ``TypeError``); the top-level dict is the caller's own.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Final

from touba.history._common import encode_checked_json
from touba.history._frozen import FrozenDict, FrozenList, parse_frozen
from touba.history._model import canonical_json
from touba.history._plot import PLOT_KEY

__all__ = ["HeldHead", "encode_head", "parse_head"]

# The plot's place in the head while the rest is encoded; control characters are
# always escaped, so this text appears nowhere else unless a value holds it too
# (then it is found twice and the head is encoded whole).
_MARK: Final = "\x00touba-plot\x00"
_MARKED: Final = canonical_json({PLOT_KEY: _MARK})[1:-1]  # "plot":"\u0000touba-plot\u0000"
_PLOT_KEYS: Final = ["decisions", "points"]
_PLAIN: Final = frozenset({str, int, float, bool, type(None)})


class HeldHead:
    """A head as stored: its text, its UTF-8 length, its parsed (frozen) value and,
    when it has a plot ring of the documented shape, the text of each point."""

    __slots__ = ("head", "points", "size", "text", "texts")

    def __init__(
        self,
        text: str,
        size: int,
        head: FrozenDict,
        points: FrozenList | None = None,
        texts: list[str] | None = None,
    ) -> None:
        self.text = text
        self.size = size
        self.head = head
        self.points = points
        self.texts = texts or []

    def holds(self, text: str) -> bool:
        """Whether ``text`` is this head's stored text (compared whole)."""
        return self.text is text or self.text == text

    def copy(self) -> dict[str, Any]:
        """The head: its top-level dict the caller's, its nested values read-only."""
        return dict(self.head)


def parse_head(text: str) -> dict[str, Any] | None:
    """The head stored as ``text`` (top-level dict the caller's, nested values
    read-only), or None when ``text`` is not a JSON object."""
    try:
        value = parse_frozen(text)
    except ValueError:
        return None
    return dict(value) if isinstance(value, dict) else None


def encode_head(head: Mapping[str, Any], held: HeldHead | None) -> HeldHead:
    """``head`` encoded as :func:`~touba.history._common.encode_checked_json` does
    (and refused with its typed error) and held for the next decision, reusing
    the text of the points it shares with ``held``."""
    plot: Any = head.get(PLOT_KEY)
    points = plot.get("points") if type(plot) is dict or type(plot) is FrozenDict else None
    if isinstance(points, list) and list(plot) == _PLOT_KEYS and type(plot["decisions"]) is int:
        try:
            spliced = _with_ring(head, plot["decisions"], points, held)
        except (TypeError, ValueError, RecursionError, OverflowError):
            spliced = None  # encoded whole below, which names the bad value
        if spliced is not None:
            return spliced
    text = encode_checked_json(head, "head")
    return HeldHead(text, len(text.encode("utf-8")), _frozen(head))


def _with_ring(
    head: Mapping[str, Any], decisions: int, points: list[Any], held: HeldHead | None
) -> HeldHead | None:
    """The head encoded around its ring: the rest in one encoding, the ring spliced
    in from the points' texts (held ones reused). None when the mark appears
    elsewhere in the head; raises what encoding raises."""
    shared = _shared(points, held)  # the leading points held with their text
    fresh = [_frozen(p) for p in points[shared:]]
    reused = held.texts[-shared:] if held is not None and shared else []
    texts = [*reused, *_texts(fresh)]
    frozen_points = FrozenList([*points[:shared], *fresh])
    rest = canonical_json({**head, PLOT_KEY: _MARK})
    if rest.count(_MARKED) != 1:
        return None
    ring = f'{{"decisions":{decisions},"points":[{",".join(texts)}]}}'
    text = rest.replace(_MARKED, f'"{PLOT_KEY}":{ring}')
    size = len(text.encode("utf-8"))  # raises on a lone surrogate: encoded whole then
    frozen_plot = FrozenDict(decisions=decisions, points=frozen_points)
    frozen = FrozenDict((k, frozen_plot if k == PLOT_KEY else _frozen(v)) for k, v in head.items())
    return HeldHead(text, size, frozen, frozen_points, texts)


def _shared(points: list[Any], held: HeldHead | None) -> int:
    """How many leading ``points`` are, object for object, the last points ``held``
    holds the text of (frozen: unchanged since that text was made)."""
    if held is None or held.points is None or not points:
        return 0
    old = held.points
    first = points[0]
    for start in range(len(old)):
        if old[start] is first:
            break
    else:
        return 0
    count = len(old) - start
    if count > len(points) or not all(map(operator.is_, points, old[start:])):
        return 0
    return count


def _texts(points: list[Any]) -> list[str]:
    """The JSON text of each of ``points``: when they are lists of numbers, bools and
    nulls (the documented shape), cut out of one encoding of them all."""
    if len(points) < 3:
        return [canonical_json(p) for p in points]
    text = canonical_json(points)
    # Every point a list, no string, no object, one "[" per point: then every "["
    # opens a point (none nests another), and "],[" parts two of them.
    if (
        not all(isinstance(p, list) for p in points)
        or '"' in text
        or "{" in text
        or text.count("[") != len(points) + 1
    ):
        return [canonical_json(p) for p in points]
    return [f"[{part}]" for part in text[2:-2].split("],[")]


def _frozen(value: Any) -> Any:
    """``value`` made read-only, keeping the parts that already are (frozen values
    hold only frozen values)."""
    kind = type(value)
    if kind in _PLAIN or kind is FrozenDict or kind is FrozenList:
        return value
    if isinstance(value, dict):
        return FrozenDict(
            {k: _frozen(v) if isinstance(v, dict | list | tuple) else v for k, v in value.items()}
        )
    if isinstance(value, list | tuple):
        return FrozenList([_frozen(v) if isinstance(v, dict | list | tuple) else v for v in value])
    return value
