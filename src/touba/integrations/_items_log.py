"""An Agents SDK session's items as an append-only log of exchanges (record version 2).

A session record is::

    {"kind": "touba.openai_agents.session", "version": 2, "namespace": ..., "conversation_id": ...,
     "exchanges": [[item, ...], ...],  # the items grouped as _responses_items groups them
     "incomplete": [int, ...],         # indices of the exchanges that are not complete
     "items": int, "bytes": int, "created_at": iso8601, "updated_at": iso8601}

The grouping only ever changes its last exchange: an item joins the last
exchange or opens a new one, and an earlier exchange's completeness is
final once a later one opens (:mod:`touba.integrations._responses_items`).
So a built-in store keeps the exchanges as appended rows (the record is one
of touba's own, see :func:`touba.history._record.is_split_record`), and:

- ``add_items`` reads the last exchange only, regroups it with the new items
  and appends them (:func:`plan_append`);
- ``get_items`` reads the sizes of the exchanges a bound can reach, then the
  messages of those it returns (:func:`plan_read`), never the whole list;
- ``pop_item`` drops the newest item (``LogWrite.drop_last``) where the
  store offers it (:func:`plan_pop`).

Version 1 records (``"items": [...]`` in one piece) are read as they are and
rewritten in version 2 by the next write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from touba.errors import DecisionHistoryRecordInvalid
from touba.history import ExchangeSize, message_bytes
from touba.integrations._cut import UNBOUNDED, fit_suffix
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
from touba.integrations._responses_items import exchange_bounds as group

__all__ = [
    "LOG_VERSION",
    "Legacy",
    "check_head",
    "new_head",
    "plan_append",
    "plan_pop",
    "plan_read",
    "plan_wider",
    "record_of",
    "select",
    "whole_items",
]

LOG_VERSION: Final = 2
Record = dict[str, Any]
Item = Mapping[str, Any]


class Legacy(Exception):
    """A version 1 record met on the log path: the operation takes the whole-record path."""


def new_head(kind: str, namespace: str, conversation_id: str) -> Record:
    return log_head(kind, LOG_VERSION, namespace, conversation_id, incomplete=[], items=0, bytes=0)


def check_head(head: Mapping[str, Any], *, kind: str, namespace: str, conversation_id: str) -> None:
    """Refuse a record that is not this session's, or that this touba cannot read.

    Raises :class:`Legacy` for a version 1 record (read whole, rewritten).
    """
    if head.get("kind") != kind:
        raise foreign_kind(kind)
    version = head.get("version")
    if version == 1:
        raise Legacy
    if version != LOG_VERSION:
        raise DecisionHistoryRecordInvalid(
            f"the stored {kind} record has version {version!r}; this touba reads versions 1 "
            f"and {LOG_VERSION}. Upgrade touba (or delete the record); it was not modified"
        )
    incomplete = head.get("incomplete")
    if (
        not isinstance(incomplete, list)
        or not all(isinstance(i, int) for i in incomplete)
        or not all(isinstance(head.get(k), int) for k in ("items", "bytes"))
    ):
        raise corrupt(kind, "its incomplete, items or bytes fields")
    check_owner(head, namespace=namespace, conversation_id=conversation_id)


def whole_items(
    record: Record | None, *, kind: str, namespace: str, conversation_id: str
) -> list[Record]:
    """The items of a whole record of either version (``[]`` for None), checked."""
    if record is None:
        return []
    try:
        check_head(record, kind=kind, namespace=namespace, conversation_id=conversation_id)
    except Legacy:
        return record_items(record, kind=kind, namespace=namespace, conversation_id=conversation_id)
    return exchange_objects(record, kind)


def record_of(
    old: Record | None,
    items: list[Record],
    *,
    kind: str,
    namespace: str,
    conversation_id: str,
    max_retained_bytes: int,
) -> Record | None:
    """The version 2 record holding ``items`` (None when empty), refused whole past
    ``max_retained_bytes``."""
    if not items:
        return None
    size = sum(message_bytes(i) for i in items)
    check_retained(size, max_retained_bytes)
    units = group(items)
    head = new_head(kind, namespace, conversation_id)
    head["created_at"] = (old or {}).get("created_at", head["created_at"])
    head["incomplete"] = [n for n, unit in enumerate(units) if not unit.complete]
    head["items"] = len(items)
    head["bytes"] = size
    head["exchanges"] = [list(items[u.start : u.stop]) for u in units]
    return head


@dataclass(frozen=True, slots=True)
class Append:
    head: Record
    rows: list[tuple[int, Record]]
    bodies: list[str] | None = None  # the compact JSON of each row's item, when known


def plan_append(
    head: Record,
    count: int,
    last: Sequence[Record],
    new: Sequence[Record],
    *,
    max_retained_bytes: int,
    texts: Sequence[str] | None = None,
) -> Append:
    """Append ``new`` to a log of ``count`` exchanges whose last holds ``last``
    (``texts``: the compact JSON of each of ``new``, as ``dump_item_texts`` made it,
    so that nothing is encoded twice)."""
    if texts is None:
        size = head["bytes"] + sum(message_bytes(i) for i in new)
    else:
        size = head["bytes"] + sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    check_retained(size, max_retained_bytes)
    base = max(count - 1, 0)
    units = group([*last, *new])
    rows: list[tuple[int, Record]] = []
    incomplete = [i for i in head["incomplete"] if i < base]
    for offset, unit in enumerate(units):
        if not unit.complete:
            incomplete.append(base + offset)
        first = max(unit.start, len(last))
        rows.extend((base + offset, new[p - len(last)]) for p in range(first, unit.stop))
    out = dict(head)
    out.update(incomplete=incomplete, items=head["items"] + len(new), bytes=size, updated_at=now())
    # Every item of ``new`` is one row, in order: the texts are the rows' bodies.
    return Append(out, rows, None if texts is None else list(texts))


def plan_pop(head: Record, count: int, last: Sequence[Record]) -> tuple[Record, Record]:
    """The head after the newest item (the last of ``last``) is dropped, and that item."""
    item = last[-1]
    rest = list(last[:-1])
    index = count - 1
    incomplete = [i for i in head["incomplete"] if i < index]
    if rest and not group(rest)[0].complete:
        incomplete.append(index)
    out = dict(head)
    out.update(
        incomplete=incomplete,
        items=head["items"] - 1,
        bytes=head["bytes"] - message_bytes(item),
        updated_at=now(),
    )
    return out, item


READ_CHUNK: Final = 32  # exchanges a read bounded by bytes alone weighs first


def plan_read(
    head: Record, count: int, *, limit: int | None, max_messages: int, max_bytes: int
) -> int:
    """The first exchange whose sizes a read needs: no bound reaches further back.

    Each exchange holds at least one item, so ``limit`` or ``max_messages`` items
    never span more complete exchanges than that; incomplete ones are skipped. The
    last complete exchange is always read: it must fit the bounds, even for ``limit=0``.
    Bounded by ``max_bytes`` alone, a first guess of :data:`READ_CHUNK` exchanges,
    which :func:`plan_wider` widens while the read keeps all it weighed.
    """
    reach = min(UNBOUNDED if limit is None else max(limit, 1), max_messages)
    if reach == UNBOUNDED:
        reach = READ_CHUNK if max_bytes != UNBOUNDED else count
    return max(0, count - reach - len(head["incomplete"]))


def plan_wider(
    head: Record,
    count: int,
    first: int,
    chosen: Sequence[int],
    *,
    limit: int | None,
    max_messages: int,
    max_bytes: int,
) -> int:
    """Where to read sizes from once ``chosen`` (exchanges from ``first`` on) is known:
    ``first`` when no exchange before it could join (the read stopped on one that did
    not fit, or a bound on items already made ``first`` exact), else four times as far
    back."""
    if first == 0 or min(UNBOUNDED if limit is None else limit, max_messages) != UNBOUNDED:
        return first
    incomplete = set(head["incomplete"])
    if not chosen or any(n not in incomplete for n in range(first, chosen[0])):
        return first  # a complete exchange read was left out: none older fits
    return max(0, count - 4 * (count - first))


def select(
    head: Record,
    first: int,
    sizes: Sequence[ExchangeSize],
    *,
    limit: int | None,
    max_messages: int,
    max_bytes: int,
) -> list[int]:
    """The exchanges to return, oldest first, by :func:`select_items`'s rules."""
    incomplete = set(head["incomplete"])
    complete = [first + n for n in range(len(sizes)) if first + n not in incomplete]
    weights = [sizes[n - first] for n in complete]
    start = fit_suffix(weights, max_messages=max_messages, max_bytes=max_bytes, required=True)
    if limit is not None:
        if limit <= 0:
            return []
        start += fit_suffix(
            weights[start:], max_messages=limit, max_bytes=UNBOUNDED, required=False
        )
    return complete[start:]
