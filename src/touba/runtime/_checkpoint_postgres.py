"""``PostgresCheckpointStore``: checkpoints in a PostgreSQL table that many workers share.

Layout (schema version 1), every name derived from ``table`` and quoted with
``psycopg.sql.Identifier``:

- ``<table>``: one row per checkpoint. ``body`` is the checkpoint as the
  canonical JSON text every checkpoint store keeps (``text``, not ``jsonb``:
  jsonb would reorder keys and refuse ``\\u0000``). ``run_id``,
  ``invocation_id``, ``agent_ref``, ``status`` and ``revision`` are copied
  from the body on every write, for ``list`` and the compare-and-swap;
  ``created_at`` and ``updated_at`` come from the server's clock; ``seq``
  numbers the rows in creation order, which ``list`` follows. An index on
  ``(run_id, seq)`` serves ``list(run_id=...)``.
- ``<table>_meta``: the schema version. A table of another version, or a
  table of that name that is not touba's, is refused untouched
  (ConfigurationError).

Atomicity: each method is one statement in one READ COMMITTED transaction,
and no transaction stays open between calls. ``save`` inserts only if the id
is new; ``take`` is ``DELETE ... RETURNING``, so of concurrent takers in any
number of processes exactly one gets the row (the others wait on its lock,
then find nothing); ``replace`` is ``UPDATE``/``DELETE ... WHERE id = %s AND
revision = %s``, and a replacer that waited on the row re-checks the
revision the winner committed. A worker killed during a call leaves the
server to roll its transaction back: a checkpoint is always as its last
committed write.

PostgreSQL text cannot hold NUL: an id, ``run_id``, ``invocation_id``,
``agent_ref`` or ``status`` containing ``\\x00`` is refused with
ConfigurationError before anything is written (lookups of such an id find
nothing). A revision must fit in 64 bits.

Encryption at rest (``encryption=``, :mod:`touba.runtime._sealing`): ``body``
is sealed, bound to the table and the checkpoint id; the columns above that
``list`` and ``replace`` read (id, ``run_id``, ``invocation_id``, ``agent_ref``,
``status``, ``revision``, dates) stay plaintext, so ``list`` opens nothing.

Errors: a connection or schema problem while opening raises
``ConfigurationError`` chained to the driver's error; a lost server, broken
connection or pool timeout during use raises ``CheckpointStoreUnavailable``
(transient), chained. Pool, schema check and that conversion are the ones
every touba PostgreSQL store shares (:mod:`touba.history._pg`).
"""

from __future__ import annotations

import builtins
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any, Final, LiteralString

try:
    from psycopg import sql
    from psycopg_pool import AsyncConnectionPool
except ImportError as e:  # pragma: no cover - exercised in a test with psycopg hidden
    raise ImportError(
        "touba.runtime.PostgresCheckpointStore needs psycopg 3 and psycopg-pool: "
        'pip install "touba[postgres]"'
    ) from e

from touba._encryption import Encryption
from touba.errors import CheckpointStoreUnavailable, ConfigurationError
from touba.history._deadline import STORE_DEADLINE_SECONDS
from touba.history._model import JSON
from touba.history._pg import (
    OwnedPool,
    PooledStore,
    Row,
    Schema,
    has_nul,
    row,
    rows,
    run,
    table_parts,
)
from touba.runtime._checkpoints import (
    PURGE_BATCH,
    CheckpointInfo,
    check_revision,
    decode_checkpoint,
    duplicate_checkpoint,
    encode_checkpoint,
    identity_of,
    owned_ids,
    owned_sealed,
    purge_cutoff,
    revision_of,
    status_of,
)
from touba.runtime._sealing import Cursor, RowSeal, check_batch, rotate

__all__ = ["SCHEMA_VERSION", "PostgresCheckpointStore"]

SCHEMA_VERSION: Final = 1
_INT64: Final = range(-(2**63), 2**63)


class _Statements:
    """Every statement of the store, composed once from the table's identifiers."""

    def __init__(self, parts: tuple[str, ...]) -> None:
        *schema, name = parts
        names = {
            "t": sql.Identifier(*schema, name),
            "run_idx": sql.Identifier(f"{name}_run_idx"),
        }

        def q(text: LiteralString) -> sql.Composed:
            return sql.SQL(text).format(**names)

        self.create = [
            q(
                "CREATE TABLE {t} ("
                " id text PRIMARY KEY,"
                " seq bigint GENERATED ALWAYS AS IDENTITY,"
                " run_id text,"
                " invocation_id text,"
                " agent_ref text,"
                " status text NOT NULL,"
                " revision bigint NOT NULL,"
                " created_at timestamptz NOT NULL,"
                " updated_at timestamptz NOT NULL,"
                " body text NOT NULL)"
            ),
            q("CREATE INDEX {run_idx} ON {t} (run_id, seq)"),
        ]
        self.insert = q(
            "INSERT INTO {t} (id, run_id, invocation_id, agent_ref, status, revision,"
            " created_at, updated_at, body) VALUES (%s, %s, %s, %s, %s, %s, now(), now(), %s)"
            " ON CONFLICT (id) DO NOTHING"
        )
        self.get = q("SELECT body FROM {t} WHERE id = %s")
        self.take = q("DELETE FROM {t} WHERE id = %s RETURNING body")
        self.replace = q(
            "UPDATE {t} SET run_id = %s, invocation_id = %s, agent_ref = %s, status = %s,"
            " revision = %s, updated_at = now(), body = %s WHERE id = %s AND revision = %s"
        )
        self.remove = q("DELETE FROM {t} WHERE id = %s AND revision = %s")
        columns = (
            "SELECT id, run_id, invocation_id, agent_ref, status, revision, created_at,"
            " updated_at FROM {t}"
        )
        self.list_all = q(columns + " ORDER BY seq")
        self.list_run = q(columns + " WHERE run_id = %s ORDER BY seq")
        # ``purge_before``: not running, last written before %s; the outer condition is
        # checked again on a row another transaction changed meanwhile (a claim).
        self.count_old = q("SELECT COUNT(*) FROM {t} WHERE status <> 'running' AND updated_at < %s")
        self.delete_old = q(
            "DELETE FROM {t} WHERE status <> 'running' AND updated_at < %s AND id IN"
            " (SELECT id FROM {t} WHERE status <> 'running' AND updated_at < %s LIMIT %s)"
        )
        self.owned_rows = q(
            "SELECT id, run_id, invocation_id, agent_ref, status, revision, created_at,"
            " updated_at, body FROM {t} ORDER BY seq"
        )
        self.erase = q("DELETE FROM {t} WHERE id = ANY(%s)")
        self.stale = q(
            "SELECT id, body FROM {t} WHERE (CAST(%s AS TEXT) IS NULL OR id > %s)"
            " AND substr(body, 1, %s) <> %s ORDER BY id LIMIT %s FOR UPDATE"
        )
        self.reseal = q("UPDATE {t} SET body = %s WHERE id = %s")


def _fields(checkpoint_id: str, checkpoint: dict[str, JSON]) -> tuple[Any, ...]:
    """The columns copied from ``checkpoint``, refused when PostgreSQL cannot keep them."""
    identity = identity_of(checkpoint)
    status, revision = status_of(checkpoint), revision_of(checkpoint)
    if has_nul(checkpoint_id, *identity, status):
        raise ConfigurationError(
            "PostgreSQL text cannot hold NUL (\\x00): the checkpoint id, run_id, "
            "invocation_id, agent_ref and status must not contain it; nothing was written"
        )
    if revision not in _INT64:
        raise ConfigurationError(
            f"a checkpoint's revision must fit in 64 bits, got {revision}; nothing was written"
        )
    return (*identity, status, revision)


def _unavailable(e: Exception) -> CheckpointStoreUnavailable:
    return CheckpointStoreUnavailable(
        f"PostgreSQL failed ({type(e).__name__}: {e}). Check the server and retry; the "
        "operation was rolled back unless the connection broke while it committed "
        "(store.get tells)"
    )


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


def _info(found: Row) -> CheckpointInfo:
    checkpoint_id, run_id, invocation_id, agent_ref, status, revision, created, updated = found
    return CheckpointInfo(
        checkpoint_id=checkpoint_id,
        run_id=run_id,
        invocation_id=invocation_id,
        agent_ref=agent_ref,
        status=status,
        revision=revision,
        created_at=_iso(created),
        updated_at=_iso(updated),
    )


class PostgresCheckpointStore(PooledStore):
    """Checkpoints in PostgreSQL, durable and shared by every worker using the table.

    Give exactly one of ``dsn`` (the store creates, opens and closes its own
    pool of 1 to 4 connections) or ``pool`` (a
    ``psycopg_pool.AsyncConnectionPool`` you open and close). ``table`` is a
    plain identifier, optionally schema-qualified (``"app.checkpoints"``);
    anything else raises ConfigurationError at construction. Tables are
    created on first use, or by ``await store.open()`` (``async with`` opens
    too). Checkpoints hold the invocation's input, arguments, results and
    trace: ``encryption`` (a :class:`touba.Encryption`) seals each body at rest
    (see the module notes); a body that does not open raises
    ``DecisionHistoryRecordInvalid``; ``rekey()`` rotates keys.
    ``deadline_seconds`` (default 10) bounds each operation, waiting for a
    connection and every statement included: a network that goes silent fails it
    with ``CheckpointStoreUnavailable`` (retryable) within that time.
    """

    durable = True

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: AsyncConnectionPool[Any] | None = None,
        table: str = "touba_checkpoints",
        encryption: Encryption | None = None,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        parts = table_parts(table, example="touba_checkpoints")
        self._seal = RowSeal(encryption, "touba.checkpoints", table, "body")
        self._rekey_after: Cursor = None
        self._sql = _Statements(parts)
        self._pg = OwnedPool(
            "PostgresCheckpointStore",
            dsn=dsn,
            pool=pool,
            schema=Schema.of(parts, self._sql.create, version=SCHEMA_VERSION, what="checkpoint"),
            unavailable=_unavailable,
            deadline=deadline_seconds,
        )
        self.deadline_seconds = self._pg.deadline
        self.table = table

    async def save(self, checkpoint_id: str, checkpoint: dict[str, JSON]) -> None:
        """Store a new checkpoint, committed when this returns.

        ConfigurationError, with nothing written: the id exists (whoever saved
        it), the checkpoint is not JSON data, or a field cannot be kept (see
        the module notes). CheckpointStoreUnavailable when the server fails.
        """
        body = encode_checkpoint(checkpoint)
        fields = _fields(checkpoint_id, checkpoint)
        async with self._pg.call() as conn:
            sealed = self._seal.seal(body, checkpoint_id)
            inserted = await run(conn, self._sql.insert, (checkpoint_id, *fields, sealed))
        if not inserted:
            raise duplicate_checkpoint(checkpoint_id)

    async def get(self, checkpoint_id: str) -> dict[str, JSON] | None:
        """A detached copy, or None. CheckpointStoreUnavailable when the server fails."""
        if has_nul(checkpoint_id):
            return None
        async with self._pg.call() as conn:
            found = await row(conn, self._sql.get, (checkpoint_id,))
        return (
            None if found is None else decode_checkpoint(self._seal.open(found[0], checkpoint_id))
        )

    async def take(self, checkpoint_id: str) -> dict[str, JSON] | None:
        """Remove and return it in one statement: of concurrent takers, in any number of
        processes, exactly one gets it and the others None.

        CheckpointStoreUnavailable when the server fails: the checkpoint is
        then still there, unless the connection broke while committing.
        """
        if has_nul(checkpoint_id):
            return None
        async with self._pg.call() as conn:
            found = await row(conn, self._sql.take, (checkpoint_id,))
            # opened inside the transaction: a body that does not open is not taken
            body = None if found is None else self._seal.open(found[0], checkpoint_id)
        return decode_checkpoint(body)

    async def replace(
        self, checkpoint_id: str, checkpoint: dict[str, JSON] | None, *, revision: int
    ) -> bool:
        """Compare-and-swap on the stored ``revision`` (see
        :class:`~touba.runtime.CheckpointStore`), atomic across workers.

        True when it replaced (or, with None, removed) the checkpoint; False,
        changing nothing, when it is absent or at another revision. Never
        creates one. ConfigurationError when ``checkpoint`` is not JSON or a
        field cannot be kept (nothing changed); CheckpointStoreUnavailable
        when the server fails.
        """
        check_revision(revision)
        if checkpoint is None:
            body, fields = None, ()
        else:
            body, fields = encode_checkpoint(checkpoint), _fields(checkpoint_id, checkpoint)
        if has_nul(checkpoint_id) or revision not in _INT64:
            return False  # no stored checkpoint can have that id or revision
        async with self._pg.call() as conn:
            if body is None:
                changed = await run(conn, self._sql.remove, (checkpoint_id, revision))
            else:
                params = (*fields, self._seal.seal(body, checkpoint_id), checkpoint_id, revision)
                changed = await run(conn, self._sql.replace, params)
        return changed > 0

    async def list(self, *, run_id: str | None = None) -> list[CheckpointInfo]:
        """What each checkpoint is (never its content), oldest first; ``run_id``'s only
        when given. CheckpointStoreUnavailable when the server fails."""
        if run_id is not None and has_nul(run_id):
            return []
        async with self._pg.call() as conn:
            if run_id is None:
                found = await rows(conn, self._sql.list_all)
            else:
                found = await rows(conn, self._sql.list_run, (run_id,))
        return [_info(r) for r in found]

    async def purge_before(
        self, before: datetime, *, dry_run: bool = False, batch_size: int = PURGE_BATCH
    ) -> int:
        """Remove the checkpoints last written before ``before`` that no worker runs
        (see :func:`~touba.runtime._checkpoints.purge_cutoff`), at most ``batch_size``
        per transaction; how many (with ``dry_run``: how many would go, none removed).
        A checkpoint claimed meanwhile (now running) stays. ``updated_at`` is the
        server's clock. CheckpointStoreUnavailable when the server fails (the batches
        committed before stay done)."""
        cutoff, size = purge_cutoff(before, batch_size)
        if dry_run:
            async with self._pg.call() as conn:
                found = await row(conn, self._sql.count_old, (cutoff,))
            return 0 if found is None else int(found[0])
        total = 0
        while True:
            async with self._pg.call() as conn:
                removed = await run(conn, self._sql.delete_old, (cutoff, cutoff, size))
            total += removed
            if removed < size:
                return total

    # -- erasing one user (touba.erase_user) ---------------------------------------------

    async def owned_checkpoints(
        self, *, run_ids: Collection[str] = (), user: str | None = None
    ) -> builtins.list[CheckpointInfo]:
        """The checkpoints of one of ``run_ids`` (their ``run_id``, or their body's
        ``session_id``) or of ``user`` (their body's ``user_id``), oldest first; a
        damaged row is found by its ``run_id`` alone. With ``encryption=`` each body is
        opened: one that does not open, unless its ``run_id`` matches, raises
        ``DecisionHistoryRecordInvalid`` naming its id (a row is never skipped
        unread). Reads every row (checkpoints are the paused invocations: few).
        CheckpointStoreUnavailable when the server fails."""
        runs, who = owned_ids(run_ids, user)
        async with self._pg.call() as conn:
            found = await rows(conn, self._sql.owned_rows)
        return [_info(r[:8]) for r in found if self._owns(r, runs, who)]

    def _owns(self, found: Row, runs: frozenset[str], who: str | None) -> bool:
        """Whether an ``owned_rows`` row is one :meth:`owned_checkpoints` finds, its body
        opened (:func:`owned_sealed`: one that does not open raises)."""
        return owned_sealed(self._seal, str(found[0]), found[1], found[8], runs, who)

    async def erase_owned(self, *, run_ids: Collection[str] = (), user: str | None = None) -> int:
        """Delete the checkpoints :meth:`owned_checkpoints` finds (running ones too) in one
        transaction; return how many. The deleted rows stay in the table's dead tuples
        until PostgreSQL vacuums it. CheckpointStoreUnavailable (nothing deleted) when
        the server fails."""
        runs, who = owned_ids(run_ids, user)
        async with self._pg.call() as conn:
            found = await rows(conn, self._sql.owned_rows)
            ids = [r[0] for r in found if self._owns(r, runs, who)]
            if not ids:
                return 0
            return await run(conn, self._sql.erase, (ids,))

    async def rekey(self, *, batch: int = 100) -> int:
        """Re-seal with the current key up to ``batch`` checkpoints sealed with another,
        in one transaction (rows locked meanwhile); how many (0: rotation is done).
        Resumable: call it until it returns 0; older keys stay needed until then.
        ``ConfigurationError`` without ``encryption=`` or for a ``batch`` under 1;
        ``DecisionHistoryRecordInvalid`` (nothing changed) for a body that does not
        open."""
        check_batch(batch)
        stale = self._seal.stale()

        async def one_batch(after: Cursor) -> tuple[int, Cursor]:
            start = None if after is None else after[0]
            async with self._pg.call() as conn:
                found = await rows(conn, self._sql.stale, (start, start, *stale, batch))
                for checkpoint_id, body in found:
                    sealed = self._seal.again(body, checkpoint_id)
                    await run(conn, self._sql.reseal, (sealed, checkpoint_id))
            return len(found), ((found[-1][0],) if found else after)

        done, self._rekey_after = await rotate(one_batch, self._rekey_after, batch)
        return done
