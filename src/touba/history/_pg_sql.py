"""The SQL of ``PostgresHistoryStore``: every statement named, composed once per table.

Layout, every name derived from ``table`` and quoted with
``psycopg.sql.Identifier`` (never formatted into SQL text):

- ``<table>``: one row per key. ``head`` is the record without its exchanges,
  as JSON text (the whole record when it does not have touba's shape), with
  its sizes, expiry, ``version`` (the token of the reservation whose save
  wrote it) and the reservation (``token``, ``worker_id``, ``pid``, ``host``,
  ``since``). A row whose ``head`` is NULL is a bare reservation of
  a key that has no record yet; it holds that conversation's place among
  ``max_sessions`` until it is saved or released.
- ``<table>_messages``: the messages of touba records, one row each (``seq``
  within the conversation, ``exchange``, ``bytes``, JSON ``body``).
  ``transact_log`` only appends rows; snapshots read only the range asked.
  Triggers on it clear the conversation's ``version`` on any insert, update
  or delete made outside touba's own saving transactions (which mark
  themselves with the transaction-local setting ``touba.saving``), so rows
  edited behind the store's back are read again at the next reservation. A
  reservation gives a NULL version the reservation's token, and a save
  stores its own token only where the version is still the one reserved: an
  edit made while the model was called is seen as well.
  This guards against accidents, not against a client of the database that
  means to hide an edit: one that sets ``touba.saving`` in its own
  transaction, or writes ``version`` itself, is trusted like touba.
- ``<table>_usage``: 64 counter rows (shards) whose sums are the places held
  and the bytes retained, kept exact by triggers on ``<table>`` in the
  transaction of every statement that changes them (``usage()`` is their
  sum); each also holds the room it may still grow by on its own (``seats``,
  ``room``) with the limits it was shared out under. A change is counted,
  and a growth takes its room, in a shard that no other transaction holds
  (``FOR UPDATE SKIP LOCKED``, the key's own, ``hashtext(key) & 63``, first):
  writers of different keys never queue for a counter row, whatever their
  keys hash to. Only the sums mean something, so any shard will do.
- ``<table>_meta``: the schema version (6; a table of version 1 or 2 gains the
  shards and their triggers, one of version 1, 2 or 3 the version column
  and the messages' triggers, one of version 4 the triggers that count
  in a free shard, and one of version 5 the function that takes a growth's
  room, in place when first opened). A table of another
  version, or a table of that name that is not touba's, is refused untouched.

Each statement is a template below (``{t}``, ``{m}``, ``{u}``: the tables;
the other names: indexes, triggers, functions and the fragments that
:func:`statements` composes), composed into :class:`Statements` once per
table name and shared by every store object of that table. The statements of every decision
are rendered to bytes once (names are plain identifiers, ``table_parts``, so
quoting them needs no connection), and psycopg then caches their parse by
these bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final, LiteralString

from psycopg import sql

from touba.history._pg import lock_key

__all__ = ["SCHEMA_VERSION", "SHARDS", "Statements", "statements"]

SCHEMA_VERSION: Final = 6
SHARDS: Final = 64  # usage counter rows (a power of two: a key's is hashtext(key) & 63)

# -- the schema --------------------------------------------------------------------------

TABLES: Final[tuple[LiteralString, ...]] = (
    "CREATE TABLE {t} ("
    " key text PRIMARY KEY,"
    " namespace text,"
    " identity text,"
    " head text,"
    " split boolean NOT NULL DEFAULT false,"
    " exchanges integer NOT NULL DEFAULT 0,"
    " messages integer NOT NULL DEFAULT 0,"
    " bytes bigint NOT NULL DEFAULT 0,"
    " updated_at timestamptz,"
    " expires_at timestamptz,"
    " token text,"
    " worker_id text,"
    " pid integer,"
    " host text,"
    " since timestamptz,"
    " version text)",
    "CREATE INDEX {t_exp} ON {t} (expires_at)",
    "CREATE TABLE {m} ("
    " key text NOT NULL REFERENCES {t} (key) ON DELETE CASCADE,"
    " seq integer NOT NULL,"
    " exchange integer NOT NULL,"
    " bytes integer NOT NULL,"
    " body text NOT NULL,"
    " PRIMARY KEY (key, seq))",
    "CREATE INDEX {m_ex} ON {m} (key, exchange)",
)
# The shard a trigger counts a change in (any shard keeps the sums exact): of the
# shards no other transaction has locked (SKIP LOCKED: it never waits), the first
# from the one the key hashes to; only when another transaction holds every one,
# the key's own, waiting for it.
_PICK: Final = (
    " s := coalesce((SELECT p.shard FROM {u} AS p"
    "  ORDER BY (p.shard - (hashtext(k) & {mask})) & {mask} LIMIT 1 FOR UPDATE SKIP LOCKED),"
    "  hashtext(k) & {mask});"
)
# Rows inserted or deleted are counted per statement, all in one shard; what a
# statement frees goes back to that shard's room.
COUNT: Final = (
    "CREATE OR REPLACE FUNCTION {count}() RETURNS trigger LANGUAGE plpgsql AS $touba$"  # noqa: S608
    " DECLARE n bigint; b bigint; k text; s integer;"
    " BEGIN"
    "  IF TG_OP = 'INSERT' THEN"
    "   SELECT count(*), coalesce(sum(bytes), 0), min(key) INTO n, b, k FROM new_rows;"
    "  ELSE"
    "   SELECT count(*), coalesce(sum(bytes), 0), min(key) INTO n, b, k FROM old_rows;"
    "  END IF;"
    "  IF n = 0 THEN RETURN NULL; END IF;" + _PICK + "  IF TG_OP = 'INSERT' THEN"
    "   UPDATE {u} SET sessions = sessions + n, bytes = bytes + b WHERE shard = s;"
    "  ELSE"
    "   UPDATE {u} SET sessions = sessions - n, bytes = bytes - b,"
    "    seats = seats + n, room = room + b WHERE shard = s;"
    "  END IF;"
    "  RETURN NULL;"
    " END $touba$"
)
# A row updated is counted only when its bytes change (a save; never a
# reservation or a release), or its key (a place freed, another taken).
COUNT_ROW: Final = (
    "CREATE OR REPLACE FUNCTION {count_row}() RETURNS trigger LANGUAGE plpgsql AS $touba$"  # noqa: S608
    " DECLARE k text := NEW.key; s integer;"
    " BEGIN" + _PICK + "  IF OLD.key = NEW.key THEN"
    "   UPDATE {u} SET bytes = bytes + NEW.bytes - OLD.bytes,"
    "    room = room + greatest(OLD.bytes - NEW.bytes, 0) WHERE shard = s;"
    "  ELSE"
    "   UPDATE {u} SET bytes = bytes + NEW.bytes - OLD.bytes, seats = seats + 1,"
    "    room = room + OLD.bytes WHERE shard = s;"
    "  END IF;"
    "  RETURN NULL;"
    " END $touba$"
)
# Version 3: SHARDS counter rows, whose sums are the places held and the
# bytes retained, kept by triggers on {t} in the transaction of every
# statement that changes them; with the room each shard may still grow by
# on its own (``seats``, ``room``) and the limits that room was shared out
# under (NULL: none, so every growth is checked exactly). Version 5: a
# change is counted in a shard no other transaction holds (``_PICK``),
# where version 3 counted it in the key's own.
SHARD_USAGE: Final[tuple[LiteralString, ...]] = (
    "CREATE TABLE {u} (shard integer PRIMARY KEY, sessions bigint NOT NULL,"
    " bytes bigint NOT NULL, seats bigint NOT NULL DEFAULT 0,"
    " room bigint NOT NULL DEFAULT 0, max_sessions bigint, max_bytes bigint)",
    "INSERT INTO {u} (shard, sessions, bytes)"
    " SELECT s, count(h.key), coalesce(sum(h.bytes), 0)"
    " FROM generate_series(0, {mask}) AS s"
    " LEFT JOIN {t} AS h ON hashtext(h.key) & {mask} = s GROUP BY s",
    COUNT,
    COUNT_ROW,
    "CREATE TRIGGER {tr_ins} AFTER INSERT ON {t} REFERENCING NEW TABLE AS new_rows"
    " FOR EACH STATEMENT EXECUTE FUNCTION {count}()",
    "CREATE TRIGGER {tr_upd} AFTER UPDATE ON {t} FOR EACH ROW"
    " WHEN (OLD.bytes <> NEW.bytes OR OLD.key <> NEW.key)"
    " EXECUTE FUNCTION {count_row}()",
    "CREATE TRIGGER {tr_del} AFTER DELETE ON {t} REFERENCING OLD TABLE AS old_rows"
    " FOR EACH STATEMENT EXECUTE FUNCTION {count}()",
)
# Version 4: any change to a conversation's messages clears its
# ``version``, except in touba's own saving transactions (which set
# ``touba.saving`` for their length, then store their token as the
# version): rows edited, added or deleted by anyone else make the next
# reservation read the tail again.
VERSIONS: Final[tuple[LiteralString, ...]] = (
    "CREATE FUNCTION {changed}() RETURNS trigger LANGUAGE plpgsql AS $touba$"
    " BEGIN"
    "  IF TG_OP = 'INSERT' THEN"
    "   UPDATE {t} SET version = NULL WHERE version IS NOT NULL"
    "    AND key IN (SELECT key FROM new_rows);"
    "  ELSIF TG_OP = 'DELETE' THEN"
    "   UPDATE {t} SET version = NULL WHERE version IS NOT NULL"
    "    AND key IN (SELECT key FROM old_rows);"
    "  ELSE"
    "   UPDATE {t} SET version = NULL WHERE version IS NOT NULL"
    "    AND key IN (SELECT key FROM old_rows UNION SELECT key FROM new_rows);"
    "  END IF;"
    "  RETURN NULL;"
    " END $touba$",
    "CREATE TRIGGER {tr_m_ins} AFTER INSERT ON {m} REFERENCING NEW TABLE AS new_rows"
    " FOR EACH STATEMENT WHEN ({not_saving}) EXECUTE FUNCTION {changed}()",
    "CREATE TRIGGER {tr_m_upd} AFTER UPDATE ON {m}"
    " REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows"
    " FOR EACH STATEMENT WHEN ({not_saving}) EXECUTE FUNCTION {changed}()",
    "CREATE TRIGGER {tr_m_del} AFTER DELETE ON {m} REFERENCING OLD TABLE AS old_rows"
    " FOR EACH STATEMENT WHEN ({not_saving}) EXECUTE FUNCTION {changed}()",
)
# Version 1 had no counters, version 2 a single row: both gain the shards.
UPGRADE_TO_3: Final[tuple[LiteralString, ...]] = (
    "DROP TRIGGER IF EXISTS {tr_ins} ON {t}",
    "DROP TRIGGER IF EXISTS {tr_upd} ON {t}",
    "DROP TRIGGER IF EXISTS {tr_del} ON {t}",
    "DROP FUNCTION IF EXISTS {count}()",
    "DROP FUNCTION IF EXISTS {count_row}()",
    "DROP TABLE IF EXISTS {u}",
    *SHARD_USAGE,
)
UPGRADE_TO_4: Final[tuple[LiteralString, ...]] = (
    "ALTER TABLE {t} ADD COLUMN version text",
    *VERSIONS,
)
# Version 4 counted each change in the shard its key hashes to: writers of two
# keys of one shard queued for its row.
UPGRADE_TO_5: Final[tuple[LiteralString, ...]] = (COUNT, COUNT_ROW)
# Version 6: a growth's room is taken by ``TAKE`` (below), a function, where version
# 5 took it with ``UPDATE {u} ... WHERE shard = (SELECT ... FOR UPDATE SKIP LOCKED)``.
UPGRADE_TO_6: Final[tuple[LiteralString, ...]] = ("{take_definition}",)

# -- fragments folded into statements ----------------------------------------------------

NOT_SAVING: Final = "coalesce(current_setting('touba.saving', true), '') = ''"
# Marks a transaction as touba's own save (for its length): folded into
# its first statement as ``, {saving}``.
SAVING: Final = "(SELECT set_config('touba.saving', 'on', true)) AS v"
# Taken before any row lock by every statement that can change the
# counters (see touba.history.postgres); folded into such a statement as
# ``USING {shared}``, it costs no round trip of its own.
SHARED: Final = "(SELECT pg_advisory_xact_lock_shared({})) AS g"

# -- capacity ----------------------------------------------------------------------------

LOCK_SHARED: Final = "SELECT pg_advisory_xact_lock_shared({lock})"
LOCK_EXCLUSIVE: Final = "SELECT pg_advisory_xact_lock({lock})"
USAGE: Final = "SELECT coalesce(sum(sessions), 0), coalesce(sum(bytes), 0) FROM {u}"
# Takes ``amount`` from the seats (``seat``) or the room of a shard that has it,
# under limits no larger than ``lim`` (the writer's), and that no other transaction
# holds (SKIP LOCKED: it never waits), the first from the one the key ``k`` hashes
# to; returns that shard, or NULL when there is none (nor when ``amount`` is not
# positive), and the writer then checks exactly. A function, not
# ``UPDATE {u} ... WHERE shard = (SELECT ... FOR UPDATE SKIP LOCKED)``: under READ
# COMMITTED that UPDATE reads the rows in its statement's snapshot; when another
# writer had committed a change to the shard it locked since then (the common case
# with several writers), the UPDATE rechecked its condition on the newest version and
# updated nothing, so the write saw no room in a store with a GiB free and took the
# exclusive path, queuing the other writers (issue 29: up to 57 waits in 3 seconds of
# 8 writers, tests/history/test_pg_no_queue.py). Here the UPDATE is a statement of
# its own, whose snapshot is taken after the lock: it updates the row locked.
TAKE: Final = (
    "CREATE OR REPLACE FUNCTION {take}(seat boolean, amount bigint, lim bigint, k text)"
    " RETURNS integer LANGUAGE plpgsql AS $touba$"
    " DECLARE s integer;"
    " BEGIN"
    "  IF amount <= 0 THEN RETURN NULL; END IF;"
    "  IF seat THEN"
    "   SELECT p.shard INTO s FROM {u} AS p WHERE p.seats >= amount AND p.max_sessions <= lim"
    "    ORDER BY (p.shard - (hashtext(k) & {mask})) & {mask} LIMIT 1 FOR UPDATE SKIP LOCKED;"
    "   UPDATE {u} SET seats = seats - amount WHERE shard = s;"
    "  ELSE"
    "   SELECT p.shard INTO s FROM {u} AS p WHERE p.room >= amount AND p.max_bytes <= lim"
    "    ORDER BY (p.shard - (hashtext(k) & {mask})) & {mask} LIMIT 1 FOR UPDATE SKIP LOCKED;"
    "   UPDATE {u} SET room = room - amount WHERE shard = s;"
    "  END IF;"
    "  RETURN s;"
    " END $touba$"
)
# A new key's place, from a shard's seats (no row: none). Parameters: max_sessions,
# the key.
TAKE_SEAT: Final = "SELECT WHERE {take}(true, 1, %s, %s) IS NOT NULL"
# Shares out what is free: ``seats`` and ``room`` to each shard, one more to
# the first ones for the remainder, under these limits (NULL: the store
# holds more than that limit, so there is no room to share).
SHARE: Final = (
    "UPDATE {u} SET seats = %s + (shard < %s)::int, room = %s + (shard < %s)::int,"
    " max_sessions = %s, max_bytes = %s"
)

# -- reservation -------------------------------------------------------------------------

PURGE_KEY: Final = (
    "DELETE FROM {t} AS h USING {shared}"
    " WHERE h.key = %s AND h.token IS NULL AND h.expires_at <= now()"
)
# Reserves a live conversation and reads, in the same statement, the
# usage (this conversation counted) and what ``Read`` asks of its tail
# (nothing when the version given is the stored one): first the row
# (part 0: exchanges, messages, bytes, head, split, version, sessions and
# bytes of the store), then (part 1) (exchange, messages, bytes) of the
# exchanges whose sizes only are read, then (part 2) (exchange, seq,
# bytes, body) of each message read. A NULL version becomes the
# reservation's token (see the Backend docstring; RETURNING shows the
# new one). Parameters: the reservation, its token again, the key (twice), the
# cached version, then how many trailing exchanges' sizes, and bodies,
# to read (twice).
# The row is claimed only as this statement's snapshot shows it (the same
# xmin): under READ COMMITTED an UPDATE that waited for the row lock
# claims the row's newest version (another worker's decision saved
# meanwhile), while the messages below are read from the snapshot taken
# before that save; it would return a head counting exchanges its rows
# lack, which looks like a damaged record. Such a claim claims nothing
# and the caller reserves through CLAIM, whose reads follow in statements
# of their own (issue 29, 7b).
CLAIM_LIVE: Final = (
    "WITH c AS (UPDATE {t} SET token = %s, worker_id = %s, pid = %s, host = %s,"
    "  since = %s, version = coalesce(version, %s)"
    "  WHERE key = %s AND token IS NULL AND head IS NOT NULL AND expires_at > now()"
    "  AND xmin = (SELECT xmin FROM {t} WHERE key = %s)"
    "  RETURNING key, head, split, exchanges, messages, bytes, version,"
    "  split AND NOT coalesce(version = %s, false) AS reads)"
    " SELECT 0, c.exchanges, c.messages, c.bytes, c.head, c.split, c.version,"
    "  u.sessions, u.bytes FROM c,"
    "  (SELECT coalesce(sum(sessions), 0) AS sessions,"
    "   coalesce(sum(bytes), 0) AS bytes FROM {u}) AS u"
    " UNION ALL"
    " SELECT 1, m.exchange, count(*), sum(m.bytes), NULL, NULL, NULL, NULL, NULL"
    "  FROM c JOIN {m} AS m ON m.key = c.key"
    "  WHERE c.reads AND m.exchange >= c.exchanges - %s"
    "  AND m.exchange < c.exchanges - %s GROUP BY m.exchange"
    " UNION ALL"
    " SELECT 2, m.exchange, m.seq, m.bytes, m.body, NULL, NULL, NULL, NULL"
    "  FROM c JOIN {m} AS m ON m.key = c.key"
    "  WHERE c.reads AND m.exchange >= c.exchanges - %s"
    " ORDER BY 1, 2, 3"
)
# ``reserve``'s read without a reservation (``peek``), for an operation that only
# reads: one statement, so the row and its messages come from one snapshot. The
# expiry is renewed (reading is activity) on the row as read, unreserved; if a writer
# changed it meanwhile, that writer's save renewed it. Rows: the head row (0) with
# ``held`` and ``gone`` (nothing live), then sizes (1) and messages (2) as CLAIM_LIVE's.
PEEK: Final = (
    "WITH h AS (SELECT key, head, split, exchanges, messages, bytes, version,"
    "  token IS NOT NULL AS held, head IS NULL OR expires_at <= now() AS gone"
    "  FROM {t} WHERE key = %s),"
    " live AS (SELECT * FROM h WHERE NOT held AND NOT gone AND split),"
    " renewed AS (UPDATE {t} AS r SET updated_at = now(),"
    "  expires_at = now() + make_interval(secs => %s) FROM live"
    "  WHERE r.key = live.key AND r.token IS NULL"
    "  AND r.version IS NOT DISTINCT FROM live.version RETURNING r.key)"
    " SELECT 0, h.exchanges, h.messages, h.bytes, h.head, h.split, h.version, h.held,"
    "  h.gone, u.sessions, u.bytes FROM h,"
    "  (SELECT coalesce(sum(sessions), 0) AS sessions,"
    "   coalesce(sum(bytes), 0) AS bytes FROM {u}) AS u"
    " UNION ALL"
    " SELECT 1, m.exchange, count(*), sum(m.bytes), NULL, NULL, NULL, NULL, NULL, NULL, NULL"
    "  FROM live JOIN {m} AS m ON m.key = live.key"
    "  WHERE NOT coalesce(live.version = %s, false)"
    "  AND m.exchange >= live.exchanges - %s AND m.exchange < live.exchanges - %s"
    "  GROUP BY m.exchange"
    " UNION ALL"
    " SELECT 2, m.exchange, m.seq, m.bytes, m.body, NULL, NULL, NULL, NULL, NULL, NULL"
    "  FROM live JOIN {m} AS m ON m.key = live.key"
    "  WHERE NOT coalesce(live.version = %s, false) AND m.exchange >= live.exchanges - %s"
    " ORDER BY 1, 2, 3"
)
CLAIM: Final = (
    "INSERT INTO {t} AS h (key, token, worker_id, pid, host, since, version)"
    " SELECT %s, %s, %s, %s, %s, %s, %s FROM {shared}"
    " ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token,"
    " worker_id = EXCLUDED.worker_id, pid = EXCLUDED.pid, host = EXCLUDED.host,"
    " since = EXCLUDED.since, version = coalesce(h.version, EXCLUDED.version)"
    " WHERE h.token IS NULL"
    " RETURNING h.head, h.split, h.exchanges, h.messages, h.bytes, h.version"
)
HOLDER: Final = "SELECT worker_id, pid, host, since FROM {t} WHERE key = %s"
RELEASE_BARE: Final = (
    "DELETE FROM {t} AS h USING {shared} WHERE h.key = %s AND h.token = %s AND h.head IS NULL"
)
RELEASE: Final = (
    "UPDATE {t} SET token = NULL, worker_id = NULL, pid = NULL, host = NULL,"
    " since = NULL WHERE key = %s AND token = %s"
)
RECOVER: Final = (
    "UPDATE {t} SET token = NULL, worker_id = NULL, pid = NULL, host = NULL,"
    " since = NULL WHERE key = %s AND token IS NOT NULL RETURNING head IS NULL"
)

# -- saving ------------------------------------------------------------------------------

PURGE_ALL: Final = (
    "DELETE FROM {t} WHERE key IN (SELECT key FROM {t}"
    " WHERE token IS NULL AND expires_at <= now() FOR UPDATE SKIP LOCKED)"
)
LOCK_ROW: Final = (
    "SELECT h.token, h.head, h.split, h.exchanges, h.messages, h.bytes"
    " FROM {t} AS h, {shared}, {saving} WHERE h.key = %s FOR UPDATE OF h"
)
DELETE_MESSAGES: Final = "DELETE FROM {m} WHERE key = %s"
DROP_MESSAGES: Final = "DELETE FROM {m} WHERE key = %s AND seq >= %s"
SAVE: Final = (
    "UPDATE {t} SET namespace = %s, identity = %s, head = %s, split = %s,"
    " exchanges = %s, messages = %s, bytes = %s, updated_at = now(),"
    " expires_at = now() + make_interval(secs => %s),"
    " version = CASE WHEN %s OR version IS NOT DISTINCT FROM %s THEN token END,"
    " token = NULL, worker_id = NULL, pid = NULL, host = NULL, since = NULL"
    " WHERE key = %s"
)
# A save that grows, taking its growth from a shard's room (no row: no room).
# Parameters: the growth, max_store_bytes, the key, then SAVE's.
SAVE_IN_ROOM: Final = (
    "WITH taken AS (SELECT {take}(false, %s, %s, %s) AS shard) "  # noqa: S608 - constant text
    + SAVE
    + " AND EXISTS (SELECT FROM taken WHERE shard IS NOT NULL)"
)


def _append(
    *, held: LiteralString, version: LiteralString, durable: bool = True, drop: bool = False
) -> LiteralString:
    """A log write in one statement (see ``APPEND``): the row locked where ``held``
    (its parameters first), then its growth taken, the row saved with ``version`` (one
    parameter) and the reservation cleared, then its messages added (the two
    fragments are constants of this module). Not ``durable``: its transaction
    commits with ``synchronous_commit = off`` (a server crash may undo it). With
    ``drop``: the messages from a seq on are deleted first, and the row saved,
    only if they are as many and weigh as much as given (parameters after
    ``held``'s: key, seq, count, bytes, key, seq)."""
    lock = "WITH held AS (SELECT h.key FROM {t} AS h, {shared}, {saving} WHERE h.key = %s"
    dropping: LiteralString = ""
    weighed: LiteralString = ""
    if drop:
        dropping = (
            " weighed AS (SELECT FROM {m} WHERE key = %s AND seq >= %s"
            "  AND EXISTS (SELECT FROM held) HAVING count(*) = %s"
            "  AND coalesce(sum(bytes), 0) = %s),"
            " gone AS (DELETE FROM {m} WHERE key = %s AND seq >= %s"
            "  AND EXISTS (SELECT FROM weighed)),"
        )
        weighed = " AND EXISTS (SELECT FROM weighed)"
    return (
        lock  # noqa: S608 - constant text
        + " AND "
        + held
        + " FOR UPDATE OF h),"
        + dropping
        + " taken AS (SELECT {take}(false, %s, %s, %s) AS shard"
        "  WHERE EXISTS (SELECT FROM held)),"
        " saved AS (UPDATE {t} AS h SET namespace = %s, identity = %s, head = %s,"
        "  split = true, exchanges = %s, messages = %s, bytes = %s, updated_at = now(),"
        "  expires_at = now() + make_interval(secs => %s), token = NULL,"
        "  worker_id = NULL, pid = NULL, host = NULL, since = NULL, version = "
        + version
        + "  FROM held WHERE h.key = held.key"
        "  AND (%s <= 0 OR EXISTS (SELECT FROM taken WHERE shard IS NOT NULL))"
        + weighed
        + "  RETURNING h.key),"
        " added AS (INSERT INTO {m} (key, seq, exchange, bytes, body)"
        "  SELECT %s, * FROM unnest(%b::int[], %b::int[], %b::int[], %b::text[])"
        "  WHERE EXISTS (SELECT FROM saved))"
        " SELECT (SELECT count(*) FROM held), (SELECT count(*) FROM saved)"
        + ("" if durable else " FROM (SELECT set_config('synchronous_commit', 'off', true)) AS q")
    )


# One statement per appended decision, a transaction by itself: the row
# locked if this reservation still holds it, then (when it grows) its
# growth taken from the room of a shard no other writer holds (so the row
# is locked before the shard), then the row saved if it does not grow or its growth was
# taken, then its messages added. Each step is gated on the one
# before, so a save without room changes nothing. Returns (held, saved).
APPEND: Final = _append(
    held="h.token = %s",
    version="CASE WHEN h.version IS NOT DISTINCT FROM %s THEN h.token END",
)
# The same write without a reservation (``save_if``): the row locked only if
# it is unreserved, live, at the version and with the head given (two
# parameters), then given the new version. Returns (held, saved).
_UNRESERVED: Final = "h.token IS NULL AND h.version = %s AND h.head = %s AND h.expires_at > now()"
APPEND_UNRESERVED: Final = _append(held=_UNRESERVED, version="%s")
# The same for a write that only renews the expiry (the head unchanged,
# nothing added): committed without waiting for the WAL's flush.
RENEW_UNRESERVED: Final = _append(held=_UNRESERVED, version="%s", durable=False)
# A drop without a reservation (a pop): its newest messages deleted only if
# they are as many, and weigh as much, as the write says (computed from the
# cached tail); nothing appended in the same statement.
DROP_UNRESERVED: Final = _append(held=_UNRESERVED, version="%s", drop=True)
INSERT_MESSAGES: Final = (
    "INSERT INTO {m} (key, seq, exchange, bytes, body)"
    " SELECT %s, * FROM unnest(%b::int[], %b::int[], %b::int[], %b::text[])"
)
DELETE_RESERVED: Final = "DELETE FROM {t} AS h USING {shared} WHERE h.key = %s AND h.token = %s"

# -- reading -----------------------------------------------------------------------------

READ_ROW: Final = (
    "SELECT token, head, split, coalesce(expires_at <= now(), false) FROM {t}"
    " WHERE key = %s FOR SHARE"
)
ALL_MESSAGES: Final = "SELECT exchange, bytes, body FROM {m} WHERE key = %s ORDER BY exchange, seq"
RANGE_ROWS: Final = (
    "SELECT exchange, bytes, body FROM {m}"
    " WHERE key = %s AND exchange >= %s AND exchange < %s ORDER BY exchange, seq"
)
RANGE_SIZES: Final = (
    "SELECT exchange, count(*), sum(bytes) FROM {m}"
    " WHERE key = %s AND exchange >= %s AND exchange < %s"
    " GROUP BY exchange ORDER BY exchange"
)
DELETE_ROW: Final = "SELECT token FROM {t} WHERE key = %s FOR UPDATE"
# ``delete``'s common case in one statement: an unreserved conversation goes, and
# whether it was live (an expired one is purged: it was absent).
DELETE_UNRESERVED: Final = (
    "DELETE FROM {t} AS h USING {shared} WHERE h.key = %s AND h.token IS NULL"
    " RETURNING coalesce(h.expires_at > now(), true)"
)
DELETE: Final = "DELETE FROM {t} AS h USING {shared} WHERE h.key = %s"
_LISTED: Final = (
    "SELECT key, identity, messages, bytes, updated_at, expires_at, token IS NOT NULL,"
    " worker_id, pid, host, since, coalesce(expires_at <= now(), false) FROM {t}"
)
LIST_ALL: Final = _LISTED + " ORDER BY key"
LIST_NAMESPACE: Final = _LISTED + " WHERE namespace = %s ORDER BY key"
# The panel's page: the conversations held or not expired, the newest first.
_LIVE: Final = " WHERE token IS NOT NULL OR expires_at > now()"
LIST_RECENT: Final = (
    _LISTED + _LIVE + " ORDER BY coalesce(updated_at, since) DESC, key LIMIT %s OFFSET %s"
)
COUNT_RECENT: Final = "SELECT count(*) FROM {t}" + _LIVE  # noqa: S608 - constant text

# -- encryption at rest (touba.history._sealed) ------------------------------------------

# Keys after a cursor of records holding a value that is not a token of the
# current key (its prefix given), for ``rekey``.
STALE: Final = (
    'SELECT h.key FROM {t} AS h WHERE h.head IS NOT NULL AND h.key COLLATE "C" > %s'
    " AND (NOT starts_with(h.head, %s) OR EXISTS (SELECT 1 FROM {m} AS m"
    " WHERE m.key = h.key AND NOT starts_with(m.body, %s)))"
    ' ORDER BY h.key COLLATE "C" LIMIT %s'
)
# Stored heads and messages per key id (NULL: not sealed).
KEY_IDS: Final = (
    "SELECT CASE WHEN starts_with(v, 'tbe1.') THEN split_part(v, '.', 2) END, count(*)"
    " FROM (SELECT head AS v FROM {t} WHERE head IS NOT NULL"
    " UNION ALL SELECT body FROM {m}) AS s GROUP BY 1"
)


# -- one table's statements --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Statements:
    """Every statement of one history table, composed from its identifiers.

    Past the three tables, each field is the template of the same name in
    capitals (``create``: ``TABLES``, ``SHARD_USAGE`` and ``VERSIONS``); the
    ``bytes`` ones are the statements of every decision, rendered once.
    """

    table: sql.Identifier
    messages_table: sql.Identifier
    usage_table: sql.Identifier
    # the schema (``Schema.create`` and its migrations)
    create: tuple[sql.Composed, ...]
    upgrade_to_3: tuple[sql.Composed, ...]
    upgrade_to_4: tuple[sql.Composed, ...]
    upgrade_to_5: tuple[sql.Composed, ...]
    upgrade_to_6: tuple[sql.Composed, ...]
    # capacity
    lock_shared: sql.Composed
    lock_exclusive: sql.Composed
    usage: sql.Composed
    take_seat: sql.Composed
    share: sql.Composed
    # reservation
    purge_key: sql.Composed
    claim_live: bytes
    peek: bytes
    claim: sql.Composed
    holder: sql.Composed
    release_bare: sql.Composed
    release: sql.Composed
    recover: sql.Composed
    # saving
    purge_all: sql.Composed
    lock_row: sql.Composed
    delete_messages: sql.Composed
    drop_messages: sql.Composed
    save: sql.Composed
    save_in_room: sql.Composed
    append: bytes
    append_unreserved: bytes
    renew_unreserved: bytes
    drop_unreserved: bytes
    insert_messages: bytes
    delete_reserved: sql.Composed
    # reading
    read_row: sql.Composed
    all_messages: sql.Composed
    range_rows: bytes
    range_sizes: bytes
    delete_row: sql.Composed
    delete_unreserved: sql.Composed
    delete: sql.Composed
    list_all: sql.Composed
    list_namespace: sql.Composed
    list_recent: sql.Composed
    count_recent: sql.Composed
    # encryption at rest
    stale: sql.Composed
    key_ids: sql.Composed


@functools.cache
def statements(parts: tuple[str, ...]) -> Statements:
    """The statements of the table named by ``parts`` (checked by ``table_parts``),
    composed on the first call for that name and shared afterwards."""
    *schema, name = parts
    t = sql.Identifier(*schema, name)
    m = sql.Identifier(*schema, f"{name}_messages")
    u = sql.Identifier(*schema, f"{name}_usage")
    lock = sql.Literal(lock_key(f"touba.history.postgres:usage:{'.'.join(parts)}"))
    names: dict[str, sql.Composable] = {
        "t": t,
        "m": m,
        "u": u,
        "t_exp": sql.Identifier(f"{name}_exp_idx"),
        "m_ex": sql.Identifier(f"{name}_msg_ex_idx"),
        "count": sql.Identifier(*schema, f"{name}_usage_count"),
        "count_row": sql.Identifier(*schema, f"{name}_usage_count_row"),
        "changed": sql.Identifier(*schema, f"{name}_messages_changed"),
        "mask": sql.Literal(SHARDS - 1),
        "not_saving": sql.SQL(NOT_SAVING),
        "saving": sql.SQL(SAVING),
        "lock": lock,
        "shared": sql.SQL(SHARED).format(lock),
    }
    names["take"] = sql.Identifier(*schema, f"{name}_usage_take")
    names["take_definition"] = sql.SQL(TAKE).format(u=u, take=names["take"], mask=names["mask"])
    for event in ("ins", "upd", "del"):
        names[f"tr_{event}"] = sql.Identifier(f"{name}_usage_{event}")
        names[f"tr_m_{event}"] = sql.Identifier(f"{name}_msg_{event}")

    def q(text: LiteralString) -> sql.Composed:
        return sql.SQL(text).format(**names)

    def hot(text: LiteralString) -> bytes:
        return q(text).as_bytes(None)

    def each(texts: tuple[LiteralString, ...]) -> tuple[sql.Composed, ...]:
        return tuple(q(text) for text in texts)

    return Statements(
        table=t,
        messages_table=m,
        usage_table=u,
        create=each((*TABLES, *SHARD_USAGE, TAKE, *VERSIONS)),
        upgrade_to_3=each(UPGRADE_TO_3),
        upgrade_to_4=each(UPGRADE_TO_4),
        upgrade_to_5=each(UPGRADE_TO_5),
        upgrade_to_6=each(UPGRADE_TO_6),
        lock_shared=q(LOCK_SHARED),
        lock_exclusive=q(LOCK_EXCLUSIVE),
        usage=q(USAGE),
        take_seat=q(TAKE_SEAT),
        share=q(SHARE),
        purge_key=q(PURGE_KEY),
        claim_live=hot(CLAIM_LIVE),
        peek=hot(PEEK),
        claim=q(CLAIM),
        holder=q(HOLDER),
        release_bare=q(RELEASE_BARE),
        release=q(RELEASE),
        recover=q(RECOVER),
        purge_all=q(PURGE_ALL),
        lock_row=q(LOCK_ROW),
        delete_messages=q(DELETE_MESSAGES),
        drop_messages=q(DROP_MESSAGES),
        save=q(SAVE),
        save_in_room=q(SAVE_IN_ROOM),
        append=hot(APPEND),
        append_unreserved=hot(APPEND_UNRESERVED),
        renew_unreserved=hot(RENEW_UNRESERVED),
        drop_unreserved=hot(DROP_UNRESERVED),
        insert_messages=hot(INSERT_MESSAGES),
        delete_reserved=q(DELETE_RESERVED),
        read_row=q(READ_ROW),
        all_messages=q(ALL_MESSAGES),
        range_rows=hot(RANGE_ROWS),
        range_sizes=hot(RANGE_SIZES),
        delete_row=q(DELETE_ROW),
        delete_unreserved=q(DELETE_UNRESERVED),
        delete=q(DELETE),
        list_all=q(LIST_ALL),
        list_namespace=q(LIST_NAMESPACE),
        list_recent=q(LIST_RECENT),
        count_recent=q(COUNT_RECENT),
        stale=q(STALE),
        key_ids=q(KEY_IDS),
    )
