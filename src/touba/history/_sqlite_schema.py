"""The SQLite history store's file: its tables, triggers and migration.

Layout (schema version 2, recorded in ``touba_meta``):

- ``touba_history_sessions``: one row per key, with a compact integer ``id``:
  the record's head (the whole record when it is not touba-shaped,
  ``split = 0``), sizes, expiry, identity and namespace (for ``list``), the
  record's ``version`` (the token of the reservation that saved it) and the
  reservation (``token``, ``worker_id``, ``pid``, ``host``, ``since``).
  ``head IS NULL`` marks a reservation on a key that has no record yet: it
  holds that conversation's place among ``max_sessions`` (taken in the
  reservation's write transaction, so two processes cannot both take the last
  one) and vanishes when released.
- ``touba_history_messages``: one row per message of a touba record (``conv``,
  the conversation's id, ``seq``, ``exchange``, ``bytes``, ``body``), indexed on
  ``(conv, exchange, seq, bytes)``: a tail or its sizes cost the rows read, and
  a decision appends rows without rewriting any.
- ``touba_history_usage``: one row, the places held (rows of the sessions
  table) and the bytes they retain, kept exact by triggers in the transaction
  of every statement that changes them, so capacity costs one row read
  whatever the number of conversations (``BEGIN IMMEDIATE`` already
  serialises the writers of the file). Deleting a conversation's row deletes
  its messages (a trigger too), and any change to a conversation's messages,
  whoever makes it, clears its ``version``. A reservation gives a cleared
  version its own token, and a save keeps its token as the version only if
  the version is still that one, so an edit made while the model was called
  is seen by the next decision too.

New files use 8 KiB pages (1 KiB messages fill them with little waste); a
file of version 1 (key text in every message row and index entry) is
migrated in place, in one transaction, when first opened; a file of another
version is refused untouched. Upgrade every process sharing a file together.
"""

from __future__ import annotations

import sqlite3
from typing import Final

from touba.errors import DecisionHistoryRecordInvalid
from touba.history._sqlite import transaction

__all__ = ["PAGE_SIZE", "SCHEMA_VERSION", "check_schema", "init_schema", "stored_version"]

SCHEMA_VERSION: Final = 2
PAGE_SIZE: Final = 8192  # bytes per page of a new file
_VERSION_NAME = "history_schema_version"

_META = "CREATE TABLE IF NOT EXISTS touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"
_TABLES = (
    """CREATE TABLE IF NOT EXISTS touba_history_sessions (
        id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, head TEXT,
        split INTEGER NOT NULL DEFAULT 0, namespace TEXT, identity TEXT,
        exchanges INTEGER NOT NULL DEFAULT 0, messages INTEGER NOT NULL DEFAULT 0,
        bytes INTEGER NOT NULL DEFAULT 0, updated_at REAL, expires_at REAL, version TEXT,
        token TEXT, worker_id TEXT, pid INTEGER, host TEXT, since REAL)""",
    "CREATE INDEX IF NOT EXISTS touba_history_sessions_expiry "
    "ON touba_history_sessions (expires_at)",
    "CREATE INDEX IF NOT EXISTS touba_history_sessions_namespace "
    "ON touba_history_sessions (namespace)",
    """CREATE TABLE IF NOT EXISTS touba_history_messages (
        id INTEGER PRIMARY KEY, conv INTEGER NOT NULL, seq INTEGER NOT NULL,
        exchange INTEGER NOT NULL, bytes INTEGER NOT NULL, body TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS touba_history_messages_tail "
    "ON touba_history_messages (conv, exchange, seq, bytes)",
)
# Created once the sessions table holds its rows (the usage row counts them).
_DERIVED = (
    """CREATE TABLE IF NOT EXISTS touba_history_usage (
        id INTEGER PRIMARY KEY CHECK (id = 0), sessions INTEGER NOT NULL,
        bytes INTEGER NOT NULL)""",
    "INSERT OR IGNORE INTO touba_history_usage "
    "SELECT 0, COUNT(*), COALESCE(SUM(bytes), 0) FROM touba_history_sessions",
    """CREATE TRIGGER IF NOT EXISTS touba_history_sessions_added
        AFTER INSERT ON touba_history_sessions BEGIN
        UPDATE touba_history_usage SET sessions = sessions + 1, bytes = bytes + NEW.bytes;
        END""",
    """CREATE TRIGGER IF NOT EXISTS touba_history_sessions_resized
        AFTER UPDATE OF bytes ON touba_history_sessions WHEN NEW.bytes IS NOT OLD.bytes BEGIN
        UPDATE touba_history_usage SET bytes = bytes + NEW.bytes - OLD.bytes;
        END""",
    """CREATE TRIGGER IF NOT EXISTS touba_history_sessions_removed
        AFTER DELETE ON touba_history_sessions BEGIN
        UPDATE touba_history_usage SET sessions = sessions - 1, bytes = bytes - OLD.bytes;
        DELETE FROM touba_history_messages WHERE conv = OLD.id;
        END""",
    """CREATE TRIGGER IF NOT EXISTS touba_history_messages_inserted
        AFTER INSERT ON touba_history_messages BEGIN
        UPDATE touba_history_sessions SET version = NULL WHERE id = NEW.conv;
        END""",
    """CREATE TRIGGER IF NOT EXISTS touba_history_messages_updated
        AFTER UPDATE ON touba_history_messages BEGIN
        UPDATE touba_history_sessions SET version = NULL WHERE id = NEW.conv;
        END""",
    """CREATE TRIGGER IF NOT EXISTS touba_history_messages_deleted
        AFTER DELETE ON touba_history_messages BEGIN
        UPDATE touba_history_sessions SET version = NULL WHERE id = OLD.conv;
        END""",
)
_V1_COLUMNS = (
    "key, head, split, namespace, identity, exchanges, messages, bytes, updated_at, "
    "expires_at, token, worker_id, pid, host, since"
)
# Version 1 kept the key text in every message row and index entry.
_MIGRATE_FROM_V1 = (
    "DROP INDEX IF EXISTS touba_history_sessions_expiry",
    "DROP INDEX IF EXISTS touba_history_sessions_namespace",
    "DROP INDEX IF EXISTS touba_history_messages_tail",
    "ALTER TABLE touba_history_sessions RENAME TO touba_history_sessions_v1",
    "ALTER TABLE touba_history_messages RENAME TO touba_history_messages_v1",
    *_TABLES,
    f"INSERT INTO touba_history_sessions ({_V1_COLUMNS}) "  # noqa: S608 - constant text
    f"SELECT {_V1_COLUMNS} FROM touba_history_sessions_v1 ORDER BY rowid",
    "INSERT INTO touba_history_messages (conv, seq, exchange, bytes, body) "
    "SELECT s.id, m.seq, m.exchange, m.bytes, m.body FROM touba_history_messages_v1 AS m "
    "JOIN touba_history_sessions AS s ON s.key = m.key ORDER BY m.id",
    "DROP TABLE touba_history_messages_v1",
    "DROP TABLE touba_history_sessions_v1",
    *_DERIVED,
)


def stored_version(conn: sqlite3.Connection) -> str | None:
    """The history schema version a file records (None for a file without touba's tables)."""
    sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'touba_meta'"
    if not conn.execute(sql).fetchone():
        return None
    row = conn.execute("SELECT value FROM touba_meta WHERE name = ?", (_VERSION_NAME,)).fetchone()
    return None if row is None else str(row[0])


def check_schema(conn: sqlite3.Connection) -> None:
    """Refuse a database written by a newer (or unknown) touba, reading only.

    ``DecisionHistoryRecordInvalid``, as for a record of a future version: the
    stored data is unreadable here, which no change of configuration fixes.
    """
    version = stored_version(conn)
    if version is not None and version not in ("1", str(SCHEMA_VERSION)):
        raise DecisionHistoryRecordInvalid(
            f"this SQLite file holds decision history schema version {version!r}; this touba "
            f"reads versions 1 and {SCHEMA_VERSION}. Upgrade touba or use another file; the "
            "file was not modified"
        )


def init_schema(conn: sqlite3.Connection) -> None:
    """Create the tables, or migrate a version-1 file, in one transaction; refuse a
    file of another version untouched (:func:`check_schema`)."""
    with transaction(conn):
        check_schema(conn)
        version = stored_version(conn)
        if version == str(SCHEMA_VERSION):
            return
        conn.execute(_META)
        for statement in _MIGRATE_FROM_V1 if version == "1" else (*_TABLES, *_DERIVED):
            conn.execute(statement)
        conn.execute(
            "INSERT OR REPLACE INTO touba_meta (name, value) VALUES (?, ?)",
            (_VERSION_NAME, str(SCHEMA_VERSION)),
        )
