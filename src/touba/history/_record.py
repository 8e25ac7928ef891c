"""The versioned record of one conversation, and its split into head + rows.

A record is a JSON dict::

    {
      "kind": "touba.decision_history", "version": 1,
      "identity": {namespace, provider, model, decision_interface,
                   run_id, invocation_id, agent_ref},
      "exchanges": [[message, ...], ...],   # oldest first, never trimmed
      "pending": [{"call_id": ..., "name": ...}, ...],  # calls of the last
                                            # exchange awaiting observations
      "summary": null | {"text", "covered_exchanges", "fingerprint", "bytes"},
      "stats": {"exchanges": int, "messages": int, "bytes": int},
      "created_at": iso8601, "updated_at": iso8601
    }

The reservation that protects a record while a worker holds it lives beside
the record in the store, not inside it. Built-in stores keep the *head* (the
record without ``exchanges``) in one place and the messages as appended rows,
so a decision costs the same whatever the retained history.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from touba.errors import DecisionHistoryMismatch, DecisionHistoryRecordInvalid
from touba.history._identity import IDENTITY_FIELDS, ConversationIdentity

__all__ = [
    "RECORD_KIND",
    "RECORD_VERSION",
    "check_head",
    "is_split_record",
    "join_record",
    "new_head",
    "now_iso",
    "split_record",
]

RECORD_KIND: Final = "touba.decision_history"
TOUBA_KINDS: Final = "touba."  # the kinds of touba's own records
RECORD_VERSION: Final = 1


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def new_head(identity: ConversationIdentity) -> dict[str, Any]:
    stamp = now_iso()
    return {
        "kind": RECORD_KIND,
        "version": RECORD_VERSION,
        "identity": identity.as_dict(),
        "pending": [],
        "summary": None,
        "stats": {"exchanges": 0, "messages": 0, "bytes": 0},
        "created_at": stamp,
        "updated_at": stamp,
    }


def check_head(
    head: Mapping[str, Any],
    identity: ConversationIdentity,
    *,
    exchange_count: int | None = None,
) -> None:
    """Refuse a head this touba cannot read, or one of another conversation.

    ``exchange_count`` (how many exchanges the store holds) must agree with the
    head's stats. A head still carrying ``exchanges`` is a record the store could
    not split into messages, so its body is unreadable.
    """
    if head.get("kind") != RECORD_KIND:
        raise DecisionHistoryRecordInvalid(
            "the stored value under this session key is not a touba decision history "
            "record; it was not modified. Use another namespace or delete the key"
        )
    version = head.get("version")
    if version != RECORD_VERSION:
        raise DecisionHistoryRecordInvalid(
            f"the stored decision history record has version {version!r}; this touba "
            f"reads version {RECORD_VERSION}. Upgrade touba (or delete the record); it "
            "was not modified"
        )
    stored = head.get("identity")
    stats = head.get("stats")
    pending = head.get("pending")
    if (
        not isinstance(stored, Mapping)
        or not isinstance(pending, list)
        or not all(
            isinstance(p, Mapping)
            and isinstance(p.get("call_id"), str)
            and isinstance(p.get("name"), str)
            for p in pending
        )
        or not isinstance(stats, Mapping)
        or not all(isinstance(stats.get(k), int) for k in ("exchanges", "messages", "bytes"))
        or "exchanges" in head
        or (exchange_count is not None and exchange_count != stats["exchanges"])
        or (exchange_count == 0 and pending)
    ):
        raise DecisionHistoryRecordInvalid(
            "the stored decision history record is corrupt (identity, pending, stats or "
            "exchanges missing or inconsistent); it was not modified. Inspect it with "
            "`touba history show`"
        )
    expected = identity.as_dict()
    differing = [f for f in IDENTITY_FIELDS if stored.get(f) != expected[f]]
    if differing:
        raise DecisionHistoryMismatch(
            "the record found under this session key belongs to another conversation "
            f"(fields differ: {', '.join(differing)}); it was not modified"
        )


def is_split_record(record: Mapping[str, Any]) -> bool:
    """Whether a record has touba's shape, so a store may keep its messages as rows.

    touba's own records (a ``kind`` starting with ``touba.``: decision history,
    and the integrations' conversations, see :mod:`touba.integrations`) whose
    ``exchanges`` are lists of message objects; anything else is kept whole.
    """
    exchanges = record.get("exchanges")
    kind = record.get("kind")
    return (
        isinstance(kind, str)
        and kind.startswith(TOUBA_KINDS)
        and isinstance(exchanges, list)
        and all(
            isinstance(ex, list) and ex and all(isinstance(m, dict) for m in ex) for ex in exchanges
        )
    )


def split_record(record: Mapping[str, Any]) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """Head and exchanges of a touba-shaped record (see :func:`is_split_record`)."""
    head = {k: v for k, v in record.items() if k != "exchanges"}
    return head, list(record["exchanges"])


def join_record(head: Mapping[str, Any], exchanges: list[list[dict[str, Any]]]) -> dict[str, Any]:
    record = dict(head)
    record["exchanges"] = exchanges
    return record
