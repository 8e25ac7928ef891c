"""What touba's PostgreSQL stores share: names, the pool, the schema check, one transaction.

Used by :mod:`touba.history.postgres`, :mod:`touba.memory.postgres` and the
runtime's PostgreSQL stores (checkpoints, resources); it sits in ``history``
because that is the lowest layer with a PostgreSQL store, as
:mod:`touba.history._files` does for SQLite.

- **Names.** A table is ``name`` or ``schema.name``, each part a plain
  identifier, always composed with ``psycopg.sql.Identifier`` (never
  formatted into SQL text). Derived names (``<table>_meta``, indexes) keep
  the same parts.
- **Pool.** Either the host's ``AsyncConnectionPool`` (it opens and closes
  it) or one made from ``dsn``: one direct connection first, which fails
  fast with the server's own message where a pool would retry quietly until
  its timeout, then a pool of 1 to 4 connections that the store closes.
  Its connections are in autocommit mode, READ COMMITTED by default, and the
  calls beyond 4 at a time wait for a place in the store, not inside the
  pool (whose waits cost a task and a timer each). A host's pool is sized by
  its host: give it at least as many connections as conversations decided at
  once.
- **Schema.** ``<table>_meta`` holds the schema version. Tables are created
  on first use under a transaction-level advisory lock, so concurrent
  openers create them once. A table of an older version that the store
  knows how to migrate is upgraded in place, in that same transaction; a
  table of that name without its ``_meta``, or of another version, is
  refused and left untouched.
- **Transactions.** Each call is one READ COMMITTED transaction, whatever
  the connection's default; on the store's own pool, a call of a single
  statement is sent alone (:meth:`OwnedPool.statement`): one round trip.
- **Errors.** A driver error while opening is a ``ConfigurationError``; a
  lost server, a pool timeout or a broken connection during use becomes the
  store's own transient error, in :meth:`OwnedPool.transaction` and
  :meth:`OwnedPool.statement` only, chained with ``raise ... from``.
- **Closing.** ``close()`` refuses new calls, lets running ones finish, then
  closes the pool it made (never the host's).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

try:
    import psycopg
    from psycopg import AsyncConnection, IsolationLevel, sql
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.rows import tuple_row
    from psycopg_pool import AsyncConnectionPool
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'touba\'s PostgreSQL stores need psycopg 3 and psycopg-pool: pip install "touba[postgres]"'
    ) from e

from touba._closing import AsyncClosing
from touba.errors import ConfigurationError, ToubaError

__all__ = [
    "FAILURES",
    "Conn",
    "OwnedPool",
    "PooledStore",
    "Row",
    "Schema",
    "check_source",
    "has_nul",
    "lock_key",
    "read_committed",
    "row",
    "rows",
    "run",
    "table_parts",
]

logger = logging.getLogger("touba.history")
OPEN_TIMEOUT: Final = 10.0
POOL_SIZE: Final = 4  # most connections of a store's own pool (it opens 1 first)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
Row = tuple[Any, ...]
Conn = AsyncConnection[Any]
Query = sql.SQL | sql.Composed | bytes  # bytes: rendered once (see the stores)

#: Driver failures during use that mean "the server or the link failed, retry later".
#: ``PoolTimeout`` and ``PoolClosed`` are ``OperationalError`` subclasses.
FAILURES: Final = (psycopg.OperationalError, psycopg.InterfaceError)


def table_parts(
    table: object, *, example: str, argument: str = "table", longest: int = 48
) -> tuple[str, ...]:
    """``table`` or ``schema.table`` as identifier parts of at most ``longest``
    characters; anything else is refused, naming the ``argument`` it was given as."""
    parts = table.split(".") if isinstance(table, str) else []
    if not 1 <= len(parts) <= 2 or not all(_NAME.fullmatch(p) and len(p) <= longest for p in parts):
        raise ConfigurationError(
            f"{argument} must be a plain identifier such as {example!r} or "
            f"'myschema.{example}' (letters, digits, underscores; at most {longest} "
            f"characters each, not starting with a digit), got {table!r}"
        )
    return tuple(parts)


def lock_key(text: str) -> int:
    """A stable advisory-lock key (signed 64-bit) named by ``text``."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def has_nul(*values: object) -> bool:
    """True when a str among ``values`` holds NUL, which PostgreSQL text cannot store."""
    return any(isinstance(v, str) and "\x00" in v for v in values)


def check_source(owner: str, dsn: object, pool: object) -> None:
    """Refuse, at construction, anything but exactly one valid ``dsn`` or open-able pool."""
    if (dsn is None) == (pool is None):
        raise ConfigurationError(
            f"{owner} takes exactly one of dsn= (a connection string) or "
            "pool= (a psycopg_pool.AsyncConnectionPool)"
        )
    if dsn is not None:
        if not isinstance(dsn, str):
            raise ConfigurationError(f"dsn must be a str, got {type(dsn).__name__}")
        try:
            conninfo_to_dict(dsn)
        except psycopg.Error as e:
            raise ConfigurationError(f"dsn is not a valid PostgreSQL connection string: {e}") from e
    if pool is not None and not isinstance(pool, AsyncConnectionPool):
        raise ConfigurationError(
            f"pool must be a psycopg_pool.AsyncConnectionPool, got {type(pool).__name__}"
        )


async def rows(conn: Conn, query: Query, params: Sequence[Any] = ()) -> list[Row]:
    """Every row ``query`` returns (none for a statement without result)."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return await cur.fetchall() if cur.description else []


async def row(conn: Conn, query: Query, params: Sequence[Any] = ()) -> Row | None:
    """The first row ``query`` returns, or None."""
    found = await rows(conn, query, params)
    return found[0] if found else None


async def run(conn: Conn, query: Query, params: Sequence[Any] = ()) -> int:
    """Execute ``query``; the number of rows it touched."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return cur.rowcount


@asynccontextmanager
async def read_committed(conn: Conn) -> AsyncIterator[None]:
    """One READ COMMITTED transaction, whatever the connection's default."""
    async with conn.transaction():
        if conn.isolation_level != IsolationLevel.READ_COMMITTED:
            # Every store relies on each statement seeing what committed before it.
            await run(conn, sql.SQL("SET TRANSACTION ISOLATION LEVEL READ COMMITTED"))
        yield


async def _configure(conn: Conn) -> None:
    """A connection of a store's own pool: READ COMMITTED for the transactions it
    begins and, in autocommit mode, for the statements that are a transaction
    of their own (:meth:`OwnedPool.statement`)."""
    await conn.set_isolation_level(IsolationLevel.READ_COMMITTED)
    await conn.set_autocommit(True)
    await conn.execute("SET default_transaction_isolation TO 'read committed'")


@dataclass(frozen=True, slots=True)
class Schema:
    """A store's tables: created once, or checked and refused untouched.

    ``table`` is the name as the host gave it (for messages), ``main`` the
    table whose presence without ``meta`` marks a foreign table, ``create``
    the statements making every table but ``meta``, ``what`` the kind of
    data ("history", "checkpoint"), ``lock`` the advisory lock serialising
    openers, ``mismatch`` the error for another schema version.
    """

    table: str
    main: sql.Identifier
    meta: sql.Identifier
    create: Sequence[Query]
    version: int
    what: str
    lock: int
    mismatch: type[ToubaError] = ConfigurationError
    migrations: Mapping[int, Sequence[Query]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        parts: tuple[str, ...],
        create: Sequence[Query],
        *,
        version: int,
        what: str,
        mismatch: type[ToubaError] = ConfigurationError,
        migrations: Mapping[int, Sequence[Query]] | None = None,
    ) -> Schema:
        """The schema whose main table is ``parts`` (``create`` makes every table but
        ``<table>_meta``, which :meth:`prepare` makes). ``migrations[v]`` turns tables
        of version ``v`` into version ``v + 1`` in place."""
        *schema, name = parts
        table = ".".join(parts)
        return cls(
            table=table,
            main=sql.Identifier(*schema, name),
            meta=sql.Identifier(*schema, f"{name}_meta"),
            create=create,
            version=version,
            what=what,
            lock=lock_key(f"touba.{what}.postgres:schema:{table}"),
            mismatch=mismatch,
            migrations=dict(migrations or {}),
        )

    async def prepare(self, conn: Conn, owner: str, *, create: bool = True) -> None:
        """Create the tables, or check the ones there; in the caller's transaction.

        ``create=False``: refuse (``ConfigurationError``, nothing created) when
        the tables are not there."""
        await run(conn, sql.SQL("SELECT pg_advisory_xact_lock(%s)"), (self.lock,))
        found = await row(
            conn,
            sql.SQL("SELECT current_setting('server_encoding'), to_regclass(%s), to_regclass(%s)"),
            (self.main.as_string(conn), self.meta.as_string(conn)),
        )
        assert found is not None
        encoding, main, meta = found
        if encoding != "UTF8":
            raise ConfigurationError(
                f"the database uses the {encoding} encoding; {owner} needs a UTF8 database to "
                "keep any text exactly"
            )
        if meta is None and main is not None:
            raise ConfigurationError(
                f"table {self.table!r} exists but is not touba's: not a touba {self.what} "
                f"table (no {self.meta.as_string(conn)}); nothing was modified. Choose "
                "another name"
            )
        if meta is None and not create:
            raise ConfigurationError(
                f"{owner}(create=False): there is no touba {self.what} table "
                f"{self.table!r} in this database; nothing was created. Check the name and "
                "the DSN, or pass create=True to create the store"
            )
        if meta is None:
            for statement in self.create:
                await run(conn, statement)
            make_meta = sql.SQL("CREATE TABLE {} (name text PRIMARY KEY, value text NOT NULL)")
            await run(conn, make_meta.format(self.meta))
            insert = sql.SQL("INSERT INTO {} (name, value) VALUES ('schema_version', %s)")
            await run(conn, insert.format(self.meta), (str(self.version),))
            return
        query = sql.SQL("SELECT value FROM {} WHERE name = 'schema_version'").format(self.meta)
        stored = await row(conn, query)
        version = None if stored is None else stored[0]
        if version is not None and version.isdigit() and self._upgradable(int(version)):
            for step in range(int(version), self.version):
                for statement in self.migrations[step]:
                    await run(conn, statement)
            update = sql.SQL("UPDATE {} SET value = %s WHERE name = 'schema_version'")
            await run(conn, update.format(self.meta), (str(self.version),))
            logger.info("upgraded table %s to schema version %s", self.table, self.version)
            return
        if version != str(self.version):
            raise self.mismatch(
                f"table {self.table!r} has touba {self.what} schema version {version!r}; this "
                f"touba reads version {self.version}. Upgrade touba or use another table; "
                "nothing was modified"
            )

    def _upgradable(self, version: int) -> bool:
        """True when ``migrations`` lead from ``version`` to this one."""
        return version < self.version and all(
            v in self.migrations for v in range(version, self.version)
        )


class OwnedPool:
    """A store's pool (its own or the host's), its checked schema and its calls in progress.

    ``unavailable`` turns a driver failure during use into the store's typed
    error; it is called in :meth:`transaction` and :meth:`statement` only.
    """

    def __init__(
        self,
        owner: str,
        *,
        dsn: str | None,
        pool: AsyncConnectionPool[Any] | None,
        schema: Schema,
        unavailable: Callable[[Exception], ToubaError],
        create: bool = True,
    ) -> None:
        check_source(owner, dsn, pool)
        self._create = create
        self._owner = owner
        self._dsn = dsn
        self._pool = pool
        self._owns_pool = pool is None
        self._schema = schema
        self._unavailable = unavailable
        self._open_lock = asyncio.Lock()
        self._users = 0  # calls in progress, which close() lets finish
        self._idle = asyncio.Event()
        self._idle.set()
        self._ready = False
        self._closed = False
        # Calls holding one of the own pool's connections, at most POOL_SIZE:
        # waiting here costs a future, where a wait inside psycopg_pool (every
        # connection taken) costs a task and a timer (measured: 8 conversations
        # on 4 connections decided 30 % slower without it).
        self._slots = asyncio.Semaphore(POOL_SIZE) if pool is None else None

    def check_open(self) -> None:
        """Raise ConfigurationError once ``close()`` has begun."""
        if self._closed:
            raise ConfigurationError(f"this {self._owner} is closed; create a new one")

    async def open(self) -> None:
        """Connect and create (or check) the tables; idempotent.

        Raises ConfigurationError (the driver's error chained) when the server
        cannot be reached or the tables cannot be created, and the schema's
        error for a foreign table or another version.
        """
        self.check_open()
        if self._ready:
            return
        async with self._open_lock:
            await self._open_locked()

    async def _open_locked(self) -> None:
        self.check_open()
        if self._ready:  # another caller opened it while this one waited
            return
        try:
            pool = await self._open_pool()
            async with pool.connection() as conn, read_committed(conn):
                await self._schema.prepare(conn, self._owner, create=self._create)
        except BaseException as e:
            if self._owns_pool:
                await self._drop_own_pool()
            if isinstance(e, psycopg.Error):
                # The one place driver errors while opening become touba errors.
                raise ConfigurationError(
                    f"{self._owner} could not open table {self._schema.table!r}: {e}. "
                    "Check that the server is reachable, the credentials and database "
                    "are right, and the role may create tables (or that they exist)"
                ) from e
            raise
        self._ready = True
        logger.info("%s opened table %s", self._owner, self._schema.table)

    async def close(self) -> None:
        """Refuse new calls, let running ones finish, then close the pool if it was
        made here (a pool given by the host stays open). Idempotent."""
        self._closed = True
        await self._idle.wait()
        async with self._open_lock:
            self._ready = False
            if self._owns_pool:
                await self._drop_own_pool()

    async def _open_pool(self) -> AsyncConnectionPool[Any]:
        if self._pool is not None:
            if self._pool.closed:
                raise ConfigurationError(
                    f"the pool given to {self._owner} is not open: create it with open=False, "
                    "then `await pool.open()` before using the store"
                )
            return self._pool
        assert self._dsn is not None
        options: dict[str, Any] = {}
        if "connect_timeout" not in conninfo_to_dict(self._dsn):
            options["connect_timeout"] = int(OPEN_TIMEOUT)
        probe = await psycopg.AsyncConnection.connect(self._dsn, **options)  # fails fast
        await probe.close()
        self._pool = AsyncConnectionPool(
            self._dsn,
            open=False,
            min_size=1,
            max_size=POOL_SIZE,
            name=f"touba-{self._schema.what}-{self._schema.table}",
            configure=_configure,
        )
        await self._pool.open(wait=True, timeout=OPEN_TIMEOUT)
        return self._pool

    async def _drop_own_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    @asynccontextmanager
    async def using(self) -> AsyncIterator[None]:
        """One public call: refused once closing, awaited by ``close()`` otherwise."""
        self.check_open()
        self._users += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._users -= 1
            if not self._users:
                self._idle.set()

    @asynccontextmanager
    async def call(self) -> AsyncIterator[Conn]:
        """One public call that is one transaction: :meth:`using` around
        :meth:`transaction` (refused once closing; failures as there)."""
        async with self.using(), self.transaction() as conn:
            yield conn

    def transaction(self) -> AbstractAsyncContextManager[Conn]:
        """One READ COMMITTED transaction on a pooled connection, opening first if needed.

        A driver failure (server gone, broken connection, pool timeout) raises
        the store's ``unavailable`` error, chained; the transaction was rolled
        back, unless the link failed during its COMMIT, when it may have
        committed.
        """
        return self._connection(alone=False)

    def statement(self) -> AbstractAsyncContextManager[Conn]:
        """A pooled connection for one statement that is a whole transaction.

        On the store's own pool (autocommit, READ COMMITTED by default) the
        statement commits by itself: one round trip instead of three (BEGIN,
        the statement, COMMIT). On a pool given by the host, whose settings
        are its own, it runs in a READ COMMITTED transaction as
        :meth:`transaction` does. Failures as in :meth:`transaction`; a
        statement whose reply was lost may have committed.
        """
        return self._connection(alone=True)

    @asynccontextmanager
    async def _connection(self, *, alone: bool) -> AsyncIterator[Conn]:
        """A pooled connection in a READ COMMITTED transaction, or bare for a
        statement ``alone`` on the own pool (see :meth:`statement`)."""
        if not self._ready:
            await self.open()
        pool = self._pool
        if pool is None:  # only a caller that outlived close() can get here
            raise ConfigurationError(f"this {self._owner} is closed; create a new one")
        try:
            async with self._slot(), pool.connection() as conn:
                if alone and self._owns_pool and conn.autocommit:
                    yield conn
                else:
                    async with read_committed(conn):
                        yield conn
        except FAILURES as e:
            # The one place driver failures during use become touba errors.
            raise self._unavailable(e) from e

    def _slot(self) -> AbstractAsyncContextManager[Any]:
        """A place among the own pool's connections (nothing to take from a host's pool,
        which others may use too)."""
        return self._slots if self._slots is not None else contextlib.nullcontext()


class PooledStore(AsyncClosing):
    """The lifecycle every PostgreSQL store shares, over its :class:`OwnedPool`."""

    _pg: OwnedPool

    async def open(self) -> None:
        """Connect and create (or check) the tables; idempotent, also done on first use.

        ConfigurationError when the server cannot be reached (the driver's
        error chained), the tables are not touba's, or the store is closed; a
        store may raise its own typed error for another schema version.
        """
        await self._pg.open()

    async def close(self) -> None:
        """Refuse new calls, let running ones finish, then close the pool if this store
        made it (a pool given by you stays open). Idempotent; later calls raise
        ConfigurationError."""
        await self._pg.close()

    async def _enter(self) -> None:
        await self.open()
