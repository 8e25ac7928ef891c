"""A chat conversation as an append-only log of turns (record version 2), as pure functions.

Used by the pydantic-ai integration (:mod:`touba.integrations.pydantic_ai`),
whose messages split into the :class:`~touba.integrations._turns.TurnUnit`\\ s
of :mod:`touba.integrations._turns`: a turn opens with an input unit (a user
request) and goes on with exchanges. A record is::

    {"kind": ..., "version": 2, "namespace": ..., "conversation_id": ...,
     "exchanges": [[message, ...], ...],  # one stored exchange per turn
     "incomplete": [[start, stop, bytes], ...],  # incomplete units of closed turns
     "system": [[index, [part, ...]], ...],  # the system prompt parts of each request
     "messages": int, "bytes": int, "created_at": iso8601, "updated_at": iso8601}

Indices are positions in the whole conversation. Splitting a list into units
only ever changes its last unit, and a turn is closed for good once the next
input opens: so a stored turn is never rewritten, and what the window needs
of a closed turn is in the head (its incomplete units, if any) and in the
store's sizes of its exchange. Only the last turn is read whole, to split it
into units again. A window bounded by ``max_messages`` reads the sizes of at
most that many earlier turns (each earlier turn opens with an input, one
complete message at least), one bounded by ``max_bytes`` alone the sizes of
the last :data:`CHUNK` turns, then of four times as many while it keeps all it
weighed; then the messages of the turns it keeps. System prompts of messages
left out are in the head, to be moved into the window.

Version 1 records (``"items": [...]`` in one piece) are read whole, and the
next write stores them in version 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from touba.errors import DecisionHistoryRecordInvalid
from touba.history import ExchangeSize
from touba.integrations._cut import UNBOUNDED, Unit
from touba.integrations._items_log import Legacy
from touba.integrations._records import (
    check_owner,
    check_retained,
    corrupt,
    exchange_objects,
    foreign_kind,
    log_head,
    now,
    record_items,
)
from touba.integrations._turns import TurnUnit

__all__ = [
    "LOG_VERSION",
    "Extend",
    "check_head",
    "earlier_units",
    "extend",
    "new_head",
    "record_of",
    "reach",
    "stored_messages",
    "wider",
]

LOG_VERSION: Final = 2
Record = dict[str, Any]
System = Sequence[tuple[int, list[Record]]]  # (index, system prompt parts) per request


def new_head(kind: str, namespace: str, conversation_id: str) -> Record:
    fields: Record = {"incomplete": [], "system": [], "messages": 0, "bytes": 0}
    return log_head(kind, LOG_VERSION, namespace, conversation_id, **fields)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_head(head: Mapping[str, Any], *, kind: str, namespace: str, conversation_id: str) -> None:
    """Refuse a record that is not this conversation's, or that this touba cannot read.

    Raises :class:`~touba.integrations._items_log.Legacy` for a version 1
    record (to be read whole), ``DecisionHistoryRecordInvalid`` or
    ``DecisionHistoryMismatch`` otherwise.
    """
    if head.get("kind") != kind:
        raise foreign_kind(kind)
    if head.get("version") == 1:
        raise Legacy
    check_owner(head, namespace=namespace, conversation_id=conversation_id)
    if head.get("version") != LOG_VERSION:
        raise DecisionHistoryRecordInvalid(
            f"the stored {kind} record has version {head.get('version')!r}; this touba reads "
            f"versions 1 and {LOG_VERSION}. Upgrade touba (or delete the record); it was not "
            "modified"
        )
    incomplete, system = head.get("incomplete"), head.get("system")
    if not (
        isinstance(incomplete, list)
        and all(
            isinstance(r, list) and len(r) == 3 and all(_is_int(v) for v in r) for r in incomplete
        )
        and isinstance(system, list)
        and all(
            isinstance(s, list)
            and len(s) == 2
            and _is_int(s[0])
            and isinstance(s[1], list)
            and all(isinstance(p, dict) for p in s[1])
            for s in system
        )
        and _is_int(head.get("messages"))
        and _is_int(head.get("bytes"))
    ):
        raise corrupt(kind, "its incomplete, system, messages or bytes fields")


def stored_messages(
    record: Record, *, kind: str, namespace: str, conversation_id: str
) -> list[Record]:
    """Every message of a whole record of either version, checked."""
    try:
        check_head(record, kind=kind, namespace=namespace, conversation_id=conversation_id)
    except Legacy:
        return record_items(record, kind=kind, namespace=namespace, conversation_id=conversation_id)
    return exchange_objects(record, kind)


CHUNK: Final = 16  # earlier turns a window bounded by bytes alone reads first


def reach(count: int, *, max_messages: int, max_bytes: int) -> int:
    """The first of ``count`` stored turns whose size a window may need: with
    ``max_messages``, the last one and at most ``max_messages`` before it (each
    opens with an input, one message counted in the bounds); with ``max_bytes``
    alone, a first guess of :data:`CHUNK` turns, which :func:`wider` widens while
    the window keeps the oldest turn read; unbounded, all of them."""
    if max_messages != UNBOUNDED:
        return max(0, count - 1 - max_messages)
    if max_bytes != UNBOUNDED:
        return max(0, count - 1 - CHUNK)
    return 0


def wider(count: int, first: int, *, max_messages: int, max_bytes: int) -> int:
    """The turn to read sizes from once a window kept turn ``first`` whole: four
    times as many earlier turns (``first`` itself when no bound left any out)."""
    if max_messages != UNBOUNDED or max_bytes == UNBOUNDED:
        return first  # (reach was exact)
    return max(0, count - 1 - 4 * (count - 1 - first))


def earlier_units(
    head: Mapping[str, Any], first: int, sizes: Sequence[ExchangeSize], stop: int
) -> list[TurnUnit]:
    """Units standing for the closed turns ``first`` .. ``first + len(sizes) - 1``, the
    last of which ends at message ``stop``: each turn's complete runs of messages
    around its incomplete units, the run opening a turn marked as its input. A turn's
    complete size is given whole to its first complete run: the window weighs an
    earlier turn only as a whole."""
    spans: list[tuple[int, int]] = []
    for size in reversed(sizes):
        spans.append((stop - size.messages, stop))
        stop -= size.messages
    spans.reverse()
    if spans and spans[0][0] < 0:
        raise ValueError("the stored turns hold more messages than the record counts")
    low = spans[0][0] if spans else 0
    incomplete = sorted((a, b, w) for a, b, w in head["incomplete"] if b > low)
    units: list[TurnUnit] = []
    pointer = 0
    for (start, end), size in zip(spans, sizes, strict=True):
        inside: list[tuple[int, int, int]] = []
        while pointer < len(incomplete) and incomplete[pointer][1] <= end:
            if incomplete[pointer][0] >= start:
                inside.append(incomplete[pointer])
            pointer += 1
        weight = ExchangeSize(
            size.messages - sum(b - a for a, b, _ in inside),
            size.bytes - sum(w for *_, w in inside),
        )
        at, opening = start, True
        for a, b, bytes_ in [*inside, (end, end, 0)]:
            if a > at:
                units.append(TurnUnit(Unit(at, a, True, weight), is_input=opening))
                weight = ExchangeSize(0, 0)
            if b > a:
                units.append(TurnUnit(Unit(a, b, False, ExchangeSize(b - a, bytes_)), False))
            at, opening = b, False
    return units


@dataclass(frozen=True, slots=True)
class Extend:
    head: Record
    rows: list[tuple[int, Record]]


def extend(
    head: Record,
    count: int,
    units: Sequence[TurnUnit],
    offset: int,
    kept: int,
    added: Sequence[Record],
    sizes: Sequence[int],
    system: System,
    *,
    max_retained_bytes: int,
) -> Extend:
    """Append ``added`` to a log of ``count`` turns.

    ``units`` split the last stored turn's ``kept`` messages followed by
    ``added`` (local indices; the last turn starts at message ``offset``),
    ``sizes`` are the bytes of each of ``added``, ``system`` the system prompt
    parts of the requests among them (local indices). An input unit after the
    first opens a new turn; the turns it closes keep their incomplete units in
    the head. Refused whole past ``max_retained_bytes``.
    """
    size = head["bytes"] + sum(sizes)
    check_retained(size, max_retained_bytes)
    turn = max(count - 1, 0)
    incomplete = list(head["incomplete"])
    closing: list[Unit] = []  # the incomplete units of the turn being written
    rows: list[tuple[int, Record]] = []
    for u in units:
        if u.is_input and u.unit.start > 0:  # a new turn: the one before is closed
            incomplete += [[offset + c.start, offset + c.stop, c.size.bytes] for c in closing]
            closing, turn = [], turn + 1
        if not u.unit.complete:
            closing.append(u.unit)
        rows.extend((turn, added[i - kept]) for i in range(max(u.unit.start, kept), u.unit.stop))
    if len(rows) != len(added):
        raise ValueError("the units must cover the last turn and what is added")
    out = dict(head)
    out.update(
        incomplete=incomplete,
        system=[*head["system"], *([offset + i, parts] for i, parts in system)],
        messages=head["messages"] + len(added),
        bytes=size,
        updated_at=now(),
    )
    return Extend(out, rows)


def record_of(
    old: Record | None,
    messages: Sequence[Record],
    units: Sequence[TurnUnit],
    sizes: Sequence[int],
    system: System,
    *,
    kind: str,
    namespace: str,
    conversation_id: str,
    max_retained_bytes: int,
) -> Record | None:
    """The version 2 record holding ``messages`` whole (None when empty): what a
    store that only offers ``transact``, or a version 1 record's next write, keeps."""
    if not messages:
        return None
    head = new_head(kind, namespace, conversation_id)
    head["created_at"] = (old or {}).get("created_at", head["created_at"])
    planned = extend(
        head, 0, units, 0, 0, messages, sizes, system, max_retained_bytes=max_retained_bytes
    )
    record = planned.head
    exchanges: list[list[Record]] = []
    for index, message in planned.rows:
        if index == len(exchanges):
            exchanges.append([])
        exchanges[index].append(message)
    record["exchanges"] = exchanges
    return record
