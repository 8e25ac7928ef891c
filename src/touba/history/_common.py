"""Pieces every built-in store shares: encoding, errors, reservations."""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
)
from touba.history._model import STORED_JSON_DEPTH, canonical_json, json_problem
from touba.history._record import is_split_record, split_record
from touba.history._store import LogWrite

__all__ = [
    "MAX_KEY_BYTES",
    "EncodedRecord",
    "Reservation",
    "busy",
    "check_capacity",
    "check_key",
    "check_limits_config",
    "check_sessions",
    "encode_checked_json",
    "encode_json",
    "encode_record",
    "iso",
    "recovered",
    "require_worker_stopped",
]

logger = logging.getLogger("touba.history")
MiB = 1024 * 1024
MAX_KEY_BYTES: Final = 512


def check_key(key: object) -> str:
    """The session key, as every built-in store accepts it, or ConfigurationError.

    A non-empty ``str`` of at most 512 UTF-8 bytes, without NUL and without lone
    surrogates: text that SQLite, PostgreSQL and Redis all keep exactly, so
    that one key means the same conversation in every store (``123`` is not
    ``"123"``). :func:`touba.history.conversation_key` always makes such keys.
    """
    if not isinstance(key, str):
        raise ConfigurationError(
            f"a session key must be a str, got {type(key).__name__}; use "
            "touba.history.conversation_key(...) to make one"
        )
    if not key:
        raise ConfigurationError("a session key must not be empty")
    if "\x00" in key:
        raise ConfigurationError("a session key must not contain NUL (\\x00)")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigurationError(
            "a session key must be valid Unicode text (it holds a lone surrogate)"
        ) from None
    if size > MAX_KEY_BYTES:
        raise ConfigurationError(
            f"a session key must be at most {MAX_KEY_BYTES} UTF-8 bytes, got {size}"
        )
    return key


def iso(timestamp: float | None) -> str | None:
    if timestamp is None or math.isinf(timestamp):
        return None
    return datetime.fromtimestamp(timestamp, UTC).isoformat()


def busy(key: str, detail: str = "") -> DecisionHistoryBusy:
    return DecisionHistoryBusy(
        f"conversation {key} is in use by another operation{detail}. Retry after it "
        "finishes; if its worker crashed, stop and check that worker, then call "
        "store.recover(key, worker_stopped=True)",
        session_key=key,
    )


def recovered(key: str, freed: bool) -> bool:
    """Log a freed reservation (the lifecycle event an operator looks for); return ``freed``."""
    if freed:
        logger.info(
            "recovered the reservation of conversation %s: its worker was declared stopped", key
        )
    return freed


def require_worker_stopped(worker_stopped: bool) -> None:
    if worker_stopped is not True:
        raise ConfigurationError(
            "recover() frees a reservation left by a crashed worker: stop that worker, "
            "check it is gone, then call recover(key, worker_stopped=True)"
        )


def check_limits_config(*, max_sessions: int, max_store_bytes: int, ttl_seconds: float) -> None:
    for name, value in (("max_sessions", max_sessions), ("max_store_bytes", max_store_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int | float):
        raise ConfigurationError(f"ttl_seconds must be a number, got {ttl_seconds!r}")
    if not ttl_seconds > 0:
        raise ConfigurationError(f"ttl_seconds must be > 0, got {ttl_seconds!r}")


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """A record ready to store: a head and, for touba records, message rows."""

    head: str
    split: bool
    exchanges: list[list[str]]
    messages: int
    bytes: int


def encode_checked_json(value: Any, what: str) -> str:
    """:func:`encode_json` for what the history layer built from checked values.

    The log path's heads and messages come from observations, decisions and
    data that ``DecisionHistory.step`` (and the integrations) refused by path
    where they entered, so the walk is skipped: JSON encoding and UTF-8 still
    refuse anything unstorable, and only then is the value walked, for the
    path in the error. Per-decision cost stays that of encoding.
    """
    try:
        text = canonical_json(value)
        text.encode("utf-8")  # a lone surrogate encodes to JSON but is no text
    except (TypeError, ValueError, RecursionError, OverflowError):
        return encode_json(value, what)
    return text


def appended_bodies(write: LogWrite) -> list[tuple[int, str, int]]:
    """(exchange, compact JSON, UTF-8 bytes) of each message ``write`` appends:
    its ``bodies`` when given (one per message), else encoded here
    (:func:`encode_checked_json`). Text that is not storable UTF-8 is refused
    by path, as :func:`encode_json` does."""
    bodies = write.bodies
    if bodies is not None and len(bodies) != len(write.append):
        raise ValueError(
            f"LogWrite.bodies holds {len(bodies)} text(s) for {len(write.append)} appended "
            "message(s); nothing was saved"
        )
    rows = []
    for position, (index, message) in enumerate(write.append):
        body = encode_checked_json(message, "message") if bodies is None else bodies[position]
        try:
            size = len(body.encode("utf-8"))
        except UnicodeEncodeError as e:
            encode_json(message, "message")  # raises, naming the bad value
            raise ValueError(  # the message is fine: the text given for it is not
                f"LogWrite.bodies[{position}] is not storable UTF-8 text (it does not "
                "encode the message it stands for); nothing was saved"
            ) from e
        rows.append((index, body, size))
    return rows


def encode_json(value: Any, what: str) -> str:
    """Compact JSON of ``value``, refusing what JSON or UTF-8 cannot hold.

    ``what`` names the value in the error (``"record"``, ``"message"``...);
    :class:`DecisionHistoryRecordInvalid` names the path of the bad value.
    """
    problem = json_problem(value, what, max_depth=STORED_JSON_DEPTH)
    if problem is not None:
        raise DecisionHistoryRecordInvalid(
            f"{problem}; a record must be JSON data, and nothing was saved"
        )
    return canonical_json(value)


def encode_record(record: dict[str, Any]) -> EncodedRecord:
    """Encode a record returned by an operation; refuse anything not JSON."""
    if not isinstance(record, dict):
        raise DecisionHistoryRecordInvalid(
            f"an operation returned a {type(record).__name__}, not a dict record; nothing was saved"
        )
    if not is_split_record(record):
        head = encode_json(record, "record")
        return EncodedRecord(head, False, [], 0, len(head.encode("utf-8")))
    head_dict, exchanges = split_record(record)
    head = encode_json(head_dict, "record")
    rows = [
        [encode_json(m, f'record["exchanges"][{i}][{j}]') for j, m in enumerate(ex)]
        for i, ex in enumerate(exchanges)
    ]
    size = len(head.encode("utf-8")) + sum(len(m.encode("utf-8")) for ex in rows for m in ex)
    return EncodedRecord(head, True, rows, sum(len(ex) for ex in rows), size)


def check_capacity(
    *,
    is_new: bool,
    sessions: int,
    max_sessions: int,
    store_bytes_after: int,
    max_store_bytes: int,
) -> None:
    """Refuse a write that would overflow the store; never evict to make room."""
    if is_new:
        check_sessions(sessions, max_sessions)
    if store_bytes_after > max_store_bytes:
        raise DecisionHistoryLimitExceeded(
            f"this write would bring the store to {store_bytes_after} bytes, over "
            f"max_store_bytes={max_store_bytes}; nothing was written. Delete finished "
            "conversations or raise max_store_bytes",
            limit="max_store_bytes",
        )


def check_sessions(sessions: int, max_sessions: int) -> None:
    """Refuse a new conversation when ``sessions`` places (records and reservations
    of new keys) are already held; never evict to make room."""
    if sessions >= max_sessions:
        raise DecisionHistoryLimitExceeded(
            f"the store already holds max_sessions={max_sessions} conversations; nothing "
            "was written. Delete finished conversations, wait for them to expire, or raise "
            "max_sessions",
            limit="max_sessions",
        )


def new_token() -> str:
    """A reservation's token, or a record's version: never repeats."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Reservation:
    """Who holds a conversation: enough to find and stop a crashed worker."""

    token: str
    worker_id: str
    pid: int
    host: str
    since: float

    @classmethod
    def new(cls, worker_id: str) -> Reservation:
        return cls(new_token(), worker_id, os.getpid(), socket.gethostname(), time.time())

    def describe(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "pid": self.pid,
            "host": self.host,
            "since": iso(self.since),
        }
