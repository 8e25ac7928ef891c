"""How the panel writes times, sizes and counts: one function each, a Jinja filter each.

Decisions (documented here because they are behaviour):

- **Times** are written in UTC, in one format with its zone,
  ``2026-01-05 09:00:00 UTC``, wherever they come from: the memory stores'
  aware datetimes, or the ISO strings of the decision-history stores. The
  stores keep UTC, and the panel may run on a server in another zone than
  its operator's: a time that says its zone cannot be misread. A naive
  datetime (no store gives one) is taken as UTC; nothing, or an empty
  string, is ``-``; a string that is not ISO is shown as it is.
- **Sizes** are binary (``32 MiB``, ``1.5 KiB``, ``512 B``): what the stores'
  limits (``max_store_bytes``) are set in. One decimal below 10, none above.
- **Counts** carry their noun, in the right form: ``1 turn``, ``2 turns``,
  ``0 turns``, ``1,234 key events``; an irregular plural is given
  (``plural(n, "summary", "summaries")``), the rest follow the English rules.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

from jinja2 import Environment

__all__ = ["count_of", "register", "size", "when"]

TIME_FORMAT: Final = "%Y-%m-%d %H:%M:%S UTC"
_UNITS: Final = ("KiB", "MiB", "GiB", "TiB", "PiB")


def when(moment: datetime | str | None) -> str:
    """``moment`` in UTC as ``2026-01-05 09:00:00 UTC``; ``-`` for None or ``""``."""
    if moment is None or moment == "":
        return "-"
    if isinstance(moment, str):
        try:
            parsed = datetime.fromisoformat(moment)
        except ValueError:
            return moment
        moment = parsed
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime(TIME_FORMAT)


def size(count: int | float | None) -> str:
    """A number of bytes as people read it: ``512 B``, ``1.5 KiB``, ``32 MiB``."""
    if count is None:
        return "-"
    value = float(count)
    if abs(value) < 1024:
        return f"{int(value)} B"
    power = 0
    while power < len(_UNITS) - 1 and abs(value) >= 1024**2:
        value /= 1024
        power += 1
    value /= 1024
    unit = _UNITS[power]
    shown = f"{value:.1f}".removesuffix(".0") if abs(value) < 10 else f"{value:.0f}"
    return f"{shown} {unit}"


def count_of(count: int | None, singular: str, plural: str | None = None) -> str:
    """``count`` with its noun in the right form: ``1 turn``, ``2 turns``, ``0 turns``.

    ``plural`` for an irregular noun; otherwise ``-s``, ``-es`` after s, x, z, ch
    and sh, ``-ies`` after a consonant and y. The last word of a compound takes
    it (``key event`` → ``key events``).
    """
    if count is None:
        return "-"
    noun = singular if count == 1 else (plural or _plural(singular))
    return f"{count:,} {noun}"


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in ("", "a", "e", "i", "o", "u"):
        return noun[:-1] + "ies"
    return noun + "s"


def register(env: Environment) -> None:
    """Give ``env`` the filters ``when``, ``size`` and ``plural`` (``{{ n | plural("turn") }}``)."""
    env.filters["when"] = when
    env.filters["size"] = size
    env.filters["plural"] = count_of
