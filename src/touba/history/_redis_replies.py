"""How ``RedisHistoryStore`` reads the replies of its scripts and the rows it stores.

Redis answers in bytes or text (as the client decodes responses or not); every value
that came from the store is checked as it is read: a row, an exchange entry or a head
of another shape is damaged (``DecisionHistoryRecordInvalid``), never trusted.
A message row is ``[exchange,bytes,message]``, the message left as its stored JSON
text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from touba.errors import DecisionHistoryRecordInvalid
from touba.history._backend import Write
from touba.history._common import iso
from touba.history._model import parse_json
from touba.history._store import Record, StoredConversation

__all__ = [
    "LIST_FIELDS",
    "appends",
    "damaged",
    "entries",
    "head",
    "listed",
    "loads",
    "ms_iso",
    "opt_text",
    "row",
    "rows",
    "text",
]

# The head fields list.lua returns (its ARGV after P and the purge flag).
LIST_FIELDS: Final = (
    "key",
    "identity",
    "messages",
    "bytes",
    "updated_at",
    "expires_at",
    "split",
    "worker_id",
    "pid",
    "host",
    "since",
)


def text(value: Any) -> str:
    """A reply as text, whether or not the client decodes responses."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def opt_text(value: Any) -> str | None:
    """A reply as text, None kept."""
    return None if value is None else text(value)


def damaged(what: str) -> DecisionHistoryRecordInvalid:
    """The refusal of a stored value that is not what touba wrote (``what`` says which)."""
    return DecisionHistoryRecordInvalid(
        f"{what} of this conversation in Redis is damaged; it was not modified. Inspect it "
        "with `touba history show` or delete the conversation"
    )


def loads(value: Any) -> Any:
    """A stored JSON value, parsed (damaged when it is not JSON)."""
    try:
        return parse_json(text(value))
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged("a stored value (not valid JSON)") from e


def head(value: Any) -> Record:
    """A stored head: always a JSON object (a record is a dict), else it was tampered with."""
    parsed = loads(value)
    if not isinstance(parsed, dict):
        raise damaged(f"the stored head (a JSON {type(parsed).__name__}, not an object)")
    return parsed


def rows(raw: Sequence[Any], exchanges: int) -> list[tuple[int, int, str]]:
    """Stored rows ``[exchange,bytes,message]`` as (exchange, bytes, message text),
    the message left unparsed (the shared layer parses it, or finds it unchanged);
    a row of another shape or naming an exchange outside 0 .. ``exchanges - 1`` is
    damaged."""
    out = []
    for value in raw:
        try:
            row = value.decode("utf-8") if isinstance(value, bytes) else value
            first = row.index(",")
            second = row.index(",", first + 1)
            exchange, size = int(row[1:first]), int(row[first + 1 : second])
            body = row[second + 1 : -1]
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise damaged("a stored message row") from None
        if row[0] != "[" or row[-1] != "]" or not 0 <= exchange < exchanges:
            raise damaged("a stored message row")
        out.append((exchange, size, body))
    return out


def entries(value: Any, count: int) -> list[int]:
    """The claim's exchange entries: first row, messages, bytes of each."""
    entries = loads(value)
    if (
        not isinstance(entries, list)
        or len(entries) != 3 * count
        or (entries and set(map(type, entries)) != {int})
    ):
        raise damaged("an exchange entry")
    return entries


def row(exchange: int, size: int, message: str) -> str:
    """A message row as stored: ``[exchange,bytes,message]``."""
    return f"[{exchange},{size},{message}]"


def appends(write: Write) -> list[str | int]:
    """An append's ARGV for commit.lua and append_if.lua: drop, n, then (exchange,
    bytes, row) per message."""
    flat: list[str | int] = [write.dropped, len(write.rows)]
    for _seq, exchange, size, body in write.rows:
        flat += [exchange, size, row(exchange, size, body)]
    return flat


def ms_iso(value: Any) -> str | None:
    """A stored time in milliseconds (Redis's clock) as an ISO string, None kept."""
    return None if value is None else iso(int(text(value)) / 1000)


def listed(reply: Sequence[Any], namespace: str | None) -> list[StoredConversation]:
    """list.lua's reply (``LIST_FIELDS``, the active and the expired flags, per
    conversation) as the conversations of ``namespace`` (every one for None),
    sorted by key."""
    width = len(LIST_FIELDS) + 2
    out = []
    for i in range(0, len(reply), width):
        values = dict(zip(LIST_FIELDS, reply[i : i + width], strict=False))
        active = int(reply[i + width - 2]) == 1
        expired = int(reply[i + width - 1]) == 1
        identity: Any = loads(values["identity"]) if values["identity"] else None
        if namespace is not None and (identity or {}).get("namespace") != namespace:
            continue
        holder = None
        if active:
            holder = {
                "worker_id": opt_text(values["worker_id"]),
                "pid": int(text(values["pid"])) if values["pid"] is not None else None,
                "host": opt_text(values["host"]),
                "since": ms_iso(values["since"]),
            }
        has_record = values["split"] is not None
        out.append(
            StoredConversation(
                key=json.loads(text(values["key"])),
                identity=identity if isinstance(identity, dict) else None,
                messages=int(text(values["messages"])) if has_record else 0,
                bytes=int(text(values["bytes"])) if has_record else 0,
                updated_at=ms_iso(values["updated_at"] or values["since"]) or "",
                expires_at=ms_iso(values["expires_at"]),
                active=active,
                reservation=holder,
                expired=expired,
            )
        )
    out.sort(key=lambda conversation: conversation.key)
    return out
