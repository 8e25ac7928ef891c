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
- **Deadlines.** Each call on a connection (:meth:`OwnedPool.transaction`,
  :meth:`OwnedPool.statement`) is bounded by the store's ``deadline_seconds``,
  from asking for a place to the pool's taking the connection back: the
  wait for a place and for a connection (``PoolTimeout``), then every
  statement and the COMMIT. When the time is up during a statement the
  connection's socket is shut down (:class:`_Watchdog`): psycopg's wait
  wakes at once with a broken connection, which the pool discards, where
  cancelling the task would make psycopg send a cancel request on a new
  connection and wait for it (up to 10 s: a silent network swallows that
  too). The call fails with :class:`DeadlineExceeded`, which the store turns
  into its retryable error. A store step of several calls (a history
  reservation, a save) shares one deadline (:meth:`OwnedPool.round`), and
  after a call of a public call fails, the next call of that public call on
  that store (the release that a failure triggers) gets only what is left of
  the failed one's deadline: a release after a timeout is not attempted, and
  the failed operation still ends within its deadline. After a deadline
  failure or a broken connection, the store's own pool is replaced on the
  next call (its idle connections may be as silent as the one that failed,
  and psycopg_pool's reconnection backs off for seconds), the old one
  closed in the background. The own pool's connections also carry libpq's
  ``connect_timeout``, TCP keepalives and ``tcp_user_timeout`` derived from
  the deadline (unless the DSN sets them), so the kernel gives up on a
  silent peer too. Opening (connecting, checking or creating the tables) is
  bounded by ``max(deadline_seconds, OPEN_TIMEOUT)``. A host's pool is never
  replaced: its waits and statements are bounded the same way (a wait for one
  of its connections also by the pool's own ``timeout`` when that is shorter:
  its owner chose it), and a connection cut at its deadline goes back to it
  broken, to be discarded.
- **Errors.** A driver error while opening is a ``ConfigurationError``; a
  lost server, a pool timeout, a deadline exceeded or a broken connection
  during use becomes the store's own transient error, in
  :meth:`OwnedPool.transaction` and :meth:`OwnedPool.statement` only,
  chained with ``raise ... from``.
- **Closing.** ``close()`` refuses new calls, lets running ones finish, then
  closes the pool it made (never the host's).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import re
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final

try:
    import psycopg
    from psycopg import AsyncConnection, IsolationLevel, sql
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.rows import tuple_row
    from psycopg_pool import AsyncConnectionPool, PoolTimeout
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'touba\'s PostgreSQL stores need psycopg 3 and psycopg-pool: pip install "touba[postgres]"'
    ) from e

from touba._closing import AsyncClosing
from touba.errors import ConfigurationError, ToubaError
from touba.history._deadline import STORE_DEADLINE_SECONDS, check_deadline

__all__ = [
    "FAILURES",
    "Conn",
    "DeadlineExceeded",
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
#: ``PoolTimeout``, ``PoolClosed`` and :class:`DeadlineExceeded` are ``OperationalError``
#: subclasses.
FAILURES: Final = (psycopg.OperationalError, psycopg.InterfaceError)
_LINK_OPTIONS: Final = ("keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count")


class DeadlineExceeded(psycopg.OperationalError):
    """A call on a store's connection that outlived the store's ``deadline_seconds``:
    no place, no connection or no answer in time (the connection, if it had one, was
    shut down and discarded). A driver failure like the others: the store raises its
    retryable typed error, chained to this one."""


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


def _configurer(deadline: float) -> Callable[[Conn], Any]:
    """The ``configure`` of a store's own pool: READ COMMITTED for the transactions a
    connection begins and, in autocommit mode, for the statements that are a
    transaction of their own (:meth:`OwnedPool.statement`); its one statement bounded
    by ``deadline`` (a pool worker would otherwise wait on a silent link for good)."""

    async def configure(conn: Conn) -> None:
        await conn.set_isolation_level(IsolationLevel.READ_COMMITTED)
        await conn.set_autocommit(True)
        with _Watchdog(conn, asyncio.get_running_loop().time() + deadline):
            await conn.execute("SET default_transaction_isolation TO 'read committed'")

    return configure


def _link_options(dsn: str, deadline: float) -> dict[str, Any]:
    """libpq settings of the own pool's connections, from ``deadline``, for those the
    DSN leaves unset: ``connect_timeout`` (whole seconds, at least 2, as libpq
    counts), TCP keepalives that find a silent idle peer in about twice the
    deadline, and ``tcp_user_timeout`` (libpq 12+: the kernel drops a connection
    whose data stays unacknowledged that long)."""
    given = conninfo_to_dict(dsn)
    seconds = max(1, math.ceil(deadline))
    options: dict[str, Any] = {
        "connect_timeout": _connect_timeout("", deadline),
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": max(1, math.ceil(deadline / 3)),
        "keepalives_count": 3,
    }
    if psycopg.pq.version() >= 120000:
        options["tcp_user_timeout"] = math.ceil(deadline * 1000)
    if any(name in given for name in _LINK_OPTIONS):  # the DSN's own keepalive policy
        options = {k: v for k, v in options.items() if k not in _LINK_OPTIONS}
    return {k: v for k, v in options.items() if k not in given}


def _connect_timeout(dsn: str, deadline: float) -> int:
    """The DSN's ``connect_timeout``, else the deadline in whole seconds, at least 2
    (libpq's own floor)."""
    given = conninfo_to_dict(dsn).get("connect_timeout") if dsn else None
    if given is not None and str(given).strip().lstrip("-").isdigit():
        return max(2, int(given))
    return max(2, math.ceil(deadline))


class _Watchdog:
    """Shuts ``conn``'s socket down at ``until`` (the loop's clock) unless stopped first.

    A statement waiting on a silent network then fails at once with a broken
    connection (an ``OperationalError``) that the pool discards. Cancelling the
    task instead would make psycopg send a cancel request on a new connection
    (swallowed too) and wait up to 10 s. A task its host is already cancelling,
    stuck in that very request, is cancelled once more (:attr:`recancelled`;
    the caller takes that request back with ``Task.uncancel``).
    """

    __slots__ = ("_handle", "_task", "conn", "fired", "recancelled")

    def __init__(self, conn: Conn, until: float) -> None:
        self.conn = conn
        self._task = asyncio.current_task()
        self._handle = asyncio.get_running_loop().call_at(until, self._fire)
        self.fired = False
        self.recancelled = False

    def __enter__(self) -> _Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.cancel()
        if self.fired:  # even when the call ended just in time: never reuse a cut socket
            self.conn.pgconn.finish()

    def _fire(self) -> None:
        self.fired = True
        with contextlib.suppress(OSError, psycopg.Error):
            fd = self.conn.pgconn.socket  # raises once the connection is closed
            with socket.socket(fileno=os.dup(fd)) as sock:  # the duplicate only is closed
                sock.shutdown(socket.SHUT_RDWR)
        task = self._task
        if task is not None and not task.done() and task.cancelling():
            self.recancelled = True
            task.cancel()


@dataclass(slots=True, eq=False)
class _Budget:
    """One public call on one store (:meth:`OwnedPool.using`), for its task: the
    deadline in force for its next connection when a round is open (``rounds``)
    or a call just failed (``until``: what is left of the failed one's)."""

    owner: OwnedPool
    task: asyncio.Task[Any] | None
    until: float | None = None
    rounds: int = 0


_BUDGET: ContextVar[_Budget | None] = ContextVar("touba_pg_budget", default=None)


@contextlib.contextmanager
def _budget_scope(budget: _Budget) -> Iterator[_Budget]:
    previous = _BUDGET.get()
    _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.set(previous)


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
    ``deadline`` bounds each of those calls (see the module docstring).
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
        deadline: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        check_source(owner, dsn, pool)
        self.deadline = check_deadline(deadline, owner=owner)
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
        # The own pool after a deadline failure or a broken connection: replaced on
        # the next call; the replaced ones close in the background (awaited by close()).
        self._suspect = False
        self._retiring: set[asyncio.Task[None]] = set()

    def check_open(self) -> None:
        """Raise ConfigurationError once ``close()`` has begun."""
        if self._closed:
            raise ConfigurationError(f"this {self._owner} is closed; create a new one")

    async def open(self) -> None:
        """Connect and create (or check) the tables; idempotent.

        Raises ConfigurationError (the driver's error chained) when the server
        cannot be reached or the tables cannot be created, and the schema's
        error for a foreign table or another version. Bounded by
        ``max(deadline, OPEN_TIMEOUT)`` for each of its waits.
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
        limit = max(self.deadline, OPEN_TIMEOUT)
        try:
            pool = await self._open_pool(limit)
            async with pool.connection(timeout=limit) as conn:
                with _Watchdog(conn, asyncio.get_running_loop().time() + limit):
                    async with read_committed(conn):
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
        while self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def _open_pool(self, limit: float) -> AsyncConnectionPool[Any]:
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
            options["connect_timeout"] = max(2, math.ceil(limit))
        probe = await psycopg.AsyncConnection.connect(self._dsn, **options)  # fails fast
        await probe.close()
        self._pool = self._new_pool()
        await self._pool.open(wait=True, timeout=limit)
        return self._pool

    def _new_pool(self) -> AsyncConnectionPool[Any]:
        assert self._dsn is not None
        return AsyncConnectionPool(
            self._dsn,
            open=False,
            min_size=1,
            max_size=POOL_SIZE,
            name=f"touba-{self._schema.what}-{self._schema.table}",
            kwargs=_link_options(self._dsn, self.deadline),
            configure=_configurer(self.deadline),
        )

    async def _renew_pool(self) -> None:
        """Replace the own pool (suspect since a deadline failure or a broken
        connection) with a new one, whose first connection is made at once; the old
        one closes in the background, its connections in use when they come back."""
        self._suspect = False
        old, self._pool = self._pool, self._new_pool()
        await self._pool.open(wait=False)
        if old is not None:
            self._retire(old)
        logger.info("%s replaced its PostgreSQL pool after a failed call", self._owner)

    def _retire(self, pool: AsyncConnectionPool[Any]) -> None:
        # Long enough for its workers' connection attempts to end.
        wait = _connect_timeout(self._dsn or "", self.deadline) + 1.0
        task = asyncio.create_task(pool.close(timeout=wait))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

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
            with _budget_scope(_Budget(self, asyncio.current_task())):
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

    @asynccontextmanager
    async def round(self) -> AsyncIterator[None]:
        """One step of a store made of several calls (a reservation, a save): all of
        them within one ``deadline`` from here. Nested rounds are the outer one's.
        When the step fails, the next call of the same public call on this store
        (the release the failure triggers) gets only what is left of it."""
        budget = self._budget()
        with contextlib.ExitStack() as scope:
            if budget is None:  # outside a public call: a scope of its own
                budget = scope.enter_context(_budget_scope(_Budget(self, asyncio.current_task())))
            if not budget.rounds:
                start = asyncio.get_running_loop().time() + self.deadline
                budget.until = start if budget.until is None else min(start, budget.until)
            budget.rounds += 1
            done = False
            try:
                yield
                done = True
            finally:
                budget.rounds -= 1
                if done and not budget.rounds:
                    budget.until = None

    def _budget(self) -> _Budget | None:
        budget = _BUDGET.get()
        if budget is None or budget.owner is not self or budget.task is not asyncio.current_task():
            return None
        return budget

    def _until(self, budget: _Budget | None) -> float:
        """When the next call must be over: ``deadline`` from now, or sooner within a
        round, or after a failed call (whose leftover serves this one call only)."""
        until = asyncio.get_running_loop().time() + self.deadline
        if budget is not None and budget.until is not None:
            until = min(until, budget.until)
            if not budget.rounds:
                budget.until = None
        return until

    def transaction(self) -> AbstractAsyncContextManager[Conn]:
        """One READ COMMITTED transaction on a pooled connection, opening first if needed.

        A driver failure (server gone, broken connection, pool timeout, the
        deadline exceeded) raises the store's ``unavailable`` error, chained; the
        transaction was rolled back, unless the link failed during its COMMIT,
        when it may have committed.
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
        statement ``alone`` on the own pool (see :meth:`statement`), all of it
        (places, connection, statements, COMMIT) within the deadline."""
        if not self._ready:
            await self.open()
        budget = self._budget()
        until = self._until(budget)
        if self._suspect and self._pool is not None:
            await self._renew_pool()
        pool = self._pool
        if pool is None:  # only a caller that outlived close() can get here
            raise ConfigurationError(f"this {self._owner} is closed; create a new one")
        watch: _Watchdog | None = None
        hosts_wait = False  # a host's pool's own timeout, shorter than the deadline, bounds it
        try:
            async with self._slot(until):
                # The pool's wait: what is left once a place is taken, and never more than
                # a host's pool's own timeout (its owner chose how long a caller waits).
                wait = self._left(until)
                hosts_wait = not self._owns_pool and pool.timeout < wait
                async with pool.connection(timeout=pool.timeout if hosts_wait else wait) as conn:
                    with _Watchdog(conn, until) as watch:
                        if alone and self._owns_pool and conn.autocommit:
                            yield conn
                        else:
                            async with read_committed(conn):
                                yield conn
        except FAILURES as e:
            # The one place driver failures during use become touba errors.
            if budget is not None:
                budget.until = until  # what the rest of this public call may use
            error: Exception = e
            if watch is None and isinstance(e, PoolTimeout) and hosts_wait:
                pass  # the host's pool's own timeout: its error says so
            elif isinstance(e, PoolTimeout) or (watch is not None and watch.fired):
                error = self._exceeded(e, "no answer" if watch else "no connection from the pool")
            self._suspect_after(pool, watch, timed_out=error is not e)
            raise self._unavailable(error) from error
        except BaseException:  # a cancellation (its host's), or an error of the caller's
            self._suspect_after(pool, watch, timed_out=False)
            if watch is not None and watch.recancelled:
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()  # ours: the host's own cancellation goes on
            raise

    def _suspect_after(
        self, pool: AsyncConnectionPool[Any], watch: _Watchdog | None, *, timed_out: bool
    ) -> None:
        """After a failed call: the own pool is replaced on the next call when the
        call timed out or its connection broke (its other connections may have lived
        through the same outage), unless it was replaced since."""
        broken = watch is not None and (watch.fired or watch.conn.closed)
        if self._owns_pool and pool is self._pool and (timed_out or broken):
            self._suspect = True

    def _left(self, until: float) -> float:
        """Seconds left before ``until``; DeadlineExceeded when none."""
        left = until - asyncio.get_running_loop().time()
        if left <= 0:
            raise self._exceeded(None, "no time left (a call before it failed)")
        return left

    def _exceeded(self, cause: BaseException | None, what: str) -> DeadlineExceeded:
        error = DeadlineExceeded(f"{what} within deadline_seconds={self.deadline:g}")
        error.__cause__ = cause
        return error

    @asynccontextmanager
    async def _slot(self, until: float) -> AsyncIterator[None]:
        """A place among the own pool's connections, waited for until ``until`` (nothing
        to take from a host's pool, which others may use too)."""
        if self._slots is None:
            self._left(until)
            yield
            return
        try:
            async with asyncio.timeout_at(until):
                await self._slots.acquire()
        except TimeoutError as e:
            raise self._exceeded(None, "no free connection") from e
        try:
            yield
        finally:
            self._slots.release()


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
