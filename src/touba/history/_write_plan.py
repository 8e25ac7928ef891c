"""Write planning: what a save stores, encoded and measured before the backend is called.

A record returned to ``transact`` replaces whatever was stored (:func:`whole`:
``Write.rewrite``). A :class:`~touba.history.LogWrite` becomes a new head and
rows appended after the stored ones, checked first (:func:`appended`); the
head is encoded against the one held, so an unchanged head is not encoded
twice, and the totals are computed from what the reservation returned, so a
save needs no read. ``LogWrite.drop_last`` removes the newest messages, and
what goes must be weighed before the save (:class:`Drop`): under a
reservation from the rows the claim brought (content mode) or else read from
the store (:func:`read_drop`); without a reservation from the cached tail
alone (:func:`optimistic_drop`): in content mode from the texts the backend
compares, otherwise from the tail the version proves current, each message
weighed as touba stores it, which the backend's ``save_if`` checks against
the rows it deletes.
"""

from __future__ import annotations

from typing import NamedTuple

from touba.history._backend import Backend, Reserved, Rows, Seen, Write, damaged, identity_columns
from touba.history._common import appended_bodies, encode_record
from touba.history._head import HeldHead, encode_head
from touba.history._model import canonical_json
from touba.history._store import LogWrite, Record, check_appends
from touba.history._tail_cache import Tail

__all__ = [
    "Drop",
    "appended",
    "brought",
    "drop_of",
    "held_drop",
    "optimistic_drop",
    "read_drop",
    "whole",
]


def brought(tail: Tail | None, start: int, stop: int) -> Rows | None:
    """Content mode: the rows of exchanges ``start`` .. ``stop - 1`` as the claim that
    built ``tail`` brought them (None when it did not bring them all)."""
    if tail is None or tail.texts is None or tail.count != stop or tail.bodies_first > start:
        return None
    first = tail.bodies_first
    return [
        (exchange, len(body.encode("utf-8", "surrogatepass")), body)
        for exchange in range(start, stop)
        for body in tail.texts[exchange - first]
    ]


class Drop(NamedTuple):
    """What a ``LogWrite.drop_last`` removes: the exchanges left, the bytes the
    dropped messages weigh, and the exchange and bytes of each, in stored order."""

    exchanges: int
    bytes: int
    rows: list[tuple[int, int]]


def held_drop(tail: Tail, known: Reserved, count: int) -> Drop | None:
    """Not in content mode: the drop of the newest ``count`` messages of a tail the
    version proves current, each weighed as touba stores it (its canonical JSON),
    which the backend's ``save_if`` checks against what it deletes (None: the tail
    does not hold them all)."""
    if tail.count != known.exchanges or count > known.messages:
        return None
    rows: list[tuple[int, int]] = []  # newest first
    exchange = tail.count - 1
    while len(rows) < count:
        if exchange < tail.bodies_first:
            return None
        records = tail.records[exchange - tail.bodies_first]
        if not records:
            return None
        for record in reversed(records):
            rows.append((exchange, len(canonical_json(record).encode("utf-8", "surrogatepass"))))
            if len(rows) == count:
                break
        exchange -= 1
    rows.reverse()
    first = rows[0][0]
    kept = len(tail.records[first - tail.bodies_first]) - sum(1 for e, _ in rows if e == first)
    return Drop(first + 1 if kept else first, sum(size for _e, size in rows), rows)


def drop_of(rows: Rows, count: int, start: int) -> Drop:
    """The drop of the newest ``count`` of ``rows`` (those of exchanges ``start`` ..,
    in stored order; every stored exchange holds a message)."""
    kept = rows[: len(rows) - count]
    gone = [(exchange, size) for exchange, size, _body in rows[len(kept) :]]
    exchanges = kept[-1][0] + 1 if kept else start
    return Drop(exchanges, sum(size for _exchange, size in gone), gone)


def appended(
    reserved: Reserved,
    head_bytes: int,
    write: LogWrite,
    held: HeldHead | None,
    dropped: Drop | None = None,
) -> tuple[Write, HeldHead]:
    """A log write: a new head and messages after the stored ones (checked first),
    and the new head held; ``head_bytes`` is the stored head's UTF-8 length,
    ``held`` the stored head when this store object holds it, ``dropped`` what
    :func:`read_drop` found for ``write.drop_last``."""
    count = reserved.exchanges if reserved.split else 0
    stored = reserved.messages if reserved.split else 0
    dropped_bytes = drop = dropped_from = 0
    if dropped is not None:
        drop = write.drop_last
        count, dropped_bytes = dropped.exchanges, dropped.bytes
        dropped_from = dropped.rows[0][0]
        stored -= drop
    check_appends(count, write.append)
    head = encode_head(write.head, held)
    rows: list[tuple[int, int, int, str]] = []
    for index, body, size in appended_bodies(write):
        rows.append((stored + len(rows), index, size, body))
    namespace, identity = identity_columns(write.head)
    kept = reserved.bytes - head_bytes if reserved.head is not None else 0
    total = kept + head.size + sum(row[2] for row in rows) - dropped_bytes
    encoded = Write(
        head=head.text,
        split=True,
        namespace=namespace,
        identity=identity,
        exchanges=max([count, *(index + 1 for index, _ in write.append)]),
        messages=stored + len(rows),
        bytes=total,
        rows=rows,
        rewrite=False,
        is_new=reserved.head is None,
        growth=total - reserved.bytes,
        seen=reserved.version,
        dropped=drop,
        dropped_from=dropped_from,
        dropped_bytes=dropped_bytes,
    )
    return encoded, head


def whole(record: Record, reserved: Reserved) -> Write:
    """A record returned to ``transact``, replacing whatever was stored."""
    encoded = encode_record(record)
    namespace, identity = identity_columns(record) if encoded.split else (None, None)
    rows: list[tuple[int, int, int, str]] = []
    for exchange, messages in enumerate(encoded.exchanges):
        rows.extend((len(rows), exchange, len(body.encode("utf-8")), body) for body in messages)
    return Write(
        head=encoded.head,
        split=encoded.split,
        namespace=namespace,
        identity=identity,
        exchanges=len(encoded.exchanges),
        messages=encoded.messages,
        bytes=encoded.bytes,
        rows=rows,
        rewrite=True,
        is_new=reserved.head is None,
        growth=encoded.bytes - reserved.bytes,
        seen=reserved.version,
    )


def optimistic_drop(
    backend: Backend, content: bool, known: Reserved, write: LogWrite, tail: Tail, seen: Seen | None
) -> Drop | None:
    """What ``write.drop_last`` removes, from the tail alone, for an optimistic
    write: in content mode, where the rows the operation read (those that go
    included) are compared as text by the backend, sizes and all; else from
    the tail the version proves current (:func:`held_drop`: the backend checks
    the sizes). None: nothing dropped, or the reserved path must decide."""
    count = write.drop_last
    if count <= 0 or not getattr(backend, "drops", False):
        return None
    if not content:
        return held_drop(tail, known, count)
    if seen is None:
        return None
    if count > known.messages or len(seen.rows) < count:
        return None  # the rows that go were not all read
    start = max(0, known.exchanges - count)
    rows = brought(tail, start, known.exchanges)
    if rows is None or len(rows) < count:
        return None
    return drop_of(rows, count, start)


async def read_drop(
    backend: Backend, content: bool, key: str, reserved: Reserved, count: int, tail: Tail | None
) -> Drop | None:
    """For ``LogWrite.drop_last=count``: what goes, read from the store (None
    when nothing is dropped); in content mode from ``tail`` when the claim
    brought those rows (the backend's save checks them against the head
    again). ``ValueError`` when the backend cannot drop or holds fewer messages."""
    if count <= 0:  # nothing to drop (as in the RAM store)
        return None
    if not getattr(backend, "drops", False):
        raise ValueError(
            "drop_last refused: this store only appends (check log_drops(store) first); "
            "nothing was saved"
        )
    if not reserved.split or count > reserved.messages:
        raise ValueError(f"drop_last={count} refused: the conversation holds fewer messages")
    # Every stored exchange holds a message: the last ``count`` hold all that go.
    start = max(0, reserved.exchanges - count)
    rows = brought(tail, start, reserved.exchanges) if content else None
    if rows is None:
        rows = await backend.read_rows(key, start, reserved.exchanges)
    if len(rows) < count:  # fewer than the head says: the rows were changed behind it
        raise damaged(key, "the stored record", backend.label)
    return drop_of(rows, count, start)
