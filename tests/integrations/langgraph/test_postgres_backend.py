"""What only the PostgreSQL saver backend has: shared tables, locks, a server that can fail.

The store-independent contract is test_backend.py's (run on PostgreSQL too); here: puts of
different threads never wait for each other, a put is one transaction (a connection cut
or a worker killed in the middle leaves nothing of it), the schema (created once by
concurrent openers, a foreign table refused), names PostgreSQL cannot hold, and the
errors a failing server gives.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._services import postgres_dsn
from tests.integrations.langgraph.test_backend import KEY, T, blob, items, messages, put_request
from tests.integrations.langgraph.test_backend import latest as latest_of
from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.integrations.langgraph._backend import (
    ChannelBlob,
    HeldLog,
    ListQuery,
    LogAppend,
    Span,
    WriteRecord,
)
from touba.integrations.langgraph._postgres import PostgresSaverBackend

psycopg = pytest.importorskip("psycopg")
from psycopg import sql  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Place:
    """A schema of the test's own on the test server, and the backends opened in it."""

    dsn: str
    schema: str
    opened: list[PostgresSaverBackend]

    @property
    def prefix(self) -> str:
        return f"{self.schema}.lg"

    def backend(self, application: str | None = None) -> PostgresSaverBackend:
        dsn = (
            self.dsn
            if application is None
            else make_conninfo(self.dsn, application_name=application)
        )
        opened = PostgresSaverBackend(dsn, table_prefix=self.prefix)
        self.opened.append(opened)
        return opened

    def table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.schema, f"lg_{name}")

    async def admin(self) -> Any:
        return await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)

    async def hold(self, holder: Any, checkpoint_id: str, thread_id: str = T) -> None:
        """Begin a transaction on ``holder`` holding the checkpoint row ``checkpoint_id``
        of ``thread_id`` (inserted, not committed): a put of that id waits on its lock."""
        await holder.execute("BEGIN")
        await holder.execute(
            sql.SQL(
                "INSERT INTO {} (thread_id, ns, checkpoint_id, type, checkpoint,"
                " metadata_type, metadata, metadata_json, versions, logs)"
                " VALUES (%s, '', %s, 't', '', 't', '', '{{}}', '{{}}', '{{}}')"
            ).format(self.table("checkpoints")),
            (thread_id, checkpoint_id),
        )

    async def count(self, name: str) -> int:
        return await _count(self.dsn, sql.SQL("SELECT count(*) FROM {}").format(self.table(name)))


@pytest.fixture
async def pg() -> AsyncIterator[Place]:
    dsn = postgres_dsn()
    schema = "lgpg" + uuid.uuid4().hex[:12]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    place = Place(dsn, schema, [])
    try:
        yield place
    finally:
        for opened in place.opened:
            await opened.close()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def _count(dsn: str, query: Any, *params: object) -> int:
    """The count a one-row, one-column query answers, on a connection of its own."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(query, params)
        found = await cur.fetchone()
        assert found is not None
        return int(found[0])


async def _waiting_on_a_lock(dsn: str, application: str) -> bool:
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
        "AND wait_event_type = 'Lock'"
    )
    return await _count(dsn, query, application) > 0


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(400):
        if await check():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never happened: {what}")


async def _cut(dsn: str, application: str) -> int:
    """Terminate every server backend of ``application``; how many there were."""
    query = (
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s"
    )
    return await _count(dsn, query, application)


# --- concurrency ---------------------------------------------------------------------


async def test_puts_of_different_threads_never_wait_on_each_other(pg: Place) -> None:
    """Thread A's log row is held by another transaction: A's put waits for it, and puts
    of thread B (appends, blobs, writes) go through meanwhile."""
    application = f"touba-lg-wait-{pg.schema}"
    backend = pg.backend(application)
    a = await backend.put(put_request("0001", thread_id="A", logs=[messages((), "a0")]))
    b = await backend.put(put_request("0001", thread_id="B", logs=[messages((), "b0")]))

    async with await pg.admin() as holder, holder.transaction():
        await holder.execute(
            sql.SQL("SELECT 1 FROM {} WHERE thread_id = 'A' FOR UPDATE").format(pg.table("logs"))
        )
        blocked = asyncio.create_task(
            backend.put(
                put_request(
                    "0002",
                    thread_id="A",
                    parent_id="0001",
                    logs=[messages(a.spans["messages"], "a1")],
                )
            )
        )
        await _until(lambda: _waiting_on_a_lock(pg.dsn, application), "A's put waits")
        spans = b.spans["messages"]
        for n in range(2, 6):
            result = await asyncio.wait_for(
                backend.put(
                    put_request(
                        f"000{n}",
                        thread_id="B",
                        parent_id=f"000{n - 1}",
                        logs=[messages(spans, f"b{n - 1}")],
                        versions={"k": str(n)},
                        blobs=[ChannelBlob("k", str(n), blob(str(n)))],
                    )
                ),
                timeout=30,
            )
            spans = result.spans["messages"]
            await asyncio.wait_for(
                backend.put_writes("B", "", f"000{n}", [WriteRecord("t", 0, "x", blob("w"))]),
                timeout=30,
            )
        assert not blocked.done()
    assert (await asyncio.wait_for(blocked, timeout=30)).spans["messages"] == (Span(0, 2),)
    page = await backend.get("B", "", None, {})
    assert [r.record.checkpoint_id for r in page.rows] == ["0005"]
    assert spans == (Span(0, 5),)


async def test_concurrent_puts_on_one_thread_append_one_after_the_other(pg: Place) -> None:
    """Twenty puts of one thread at once, from four connections: each lands at its own
    place, nothing is lost or written twice."""
    backend = pg.backend()
    await backend.put(put_request("0000", logs=[messages(())]))
    results = await asyncio.gather(
        *(
            backend.put(put_request(f"{n + 1:04d}", logs=[messages((), f"m{n}", f"n{n}")]))
            for n in range(20)
        )
    )
    starts = sorted(r.spans["messages"][0].start for r in results)
    assert starts == list(range(0, 40, 2))
    page = await backend.list(ListQuery(thread_id=T), {})
    entries = page.logs[KEY].entries
    for n, result in enumerate(results):
        assert result.spans["messages"] == (Span(starts_of(result), starts_of(result) + 2),)
        position = starts_of(result)
        assert [entries[position][1], entries[position + 1][1]] == [b"m%d" % n, b"n%d" % n]
    assert await pg.count("entries") == 40


def starts_of(result: Any) -> int:
    return int(result.spans["messages"][0].start)


# --- one transaction per put ---------------------------------------------------------


async def test_a_put_cut_in_its_transaction_leaves_nothing_and_is_retryable(pg: Place) -> None:
    """A put is one transaction: held after it appended its entries and grew its log (its
    checkpoint row waits for another transaction's uncommitted row of that key), its
    connection cut: DecisionHistoryStoreUnavailable (retryable, chained), and neither
    its entries, nor the log's new length, nor its blobs or checkpoint remain."""
    application = f"touba-lg-cut-{pg.schema}"
    backend = pg.backend(application)
    one = await backend.put(put_request("0001", logs=[messages((), "a", "b")]))
    async with await pg.admin() as holder:
        await pg.hold(holder, "0002")  # rolled back below, once the put is dead
        put = asyncio.create_task(
            backend.put(
                put_request(
                    "0002",
                    parent_id="0001",
                    logs=[messages(one.spans["messages"], "c", "d", "e")],
                    versions={"k": "2"},
                    blobs=[ChannelBlob("k", "2", blob("K2"))],
                )
            )
        )
        await _until(lambda: _waiting_on_a_lock(pg.dsn, application), "the put waits")
        assert await _cut(pg.dsn, application) >= 1
        with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
            await put
        assert caught.value.retryable
        assert isinstance(caught.value.__cause__, psycopg.Error)
        await holder.execute("ROLLBACK")
    assert await pg.count("entries") == 2
    assert await pg.count("blobs") == 0
    page = await latest_of(backend)
    assert [r.record.checkpoint_id for r in page.rows] == ["0001"]
    assert page.logs[KEY].state == one.logs["messages"]
    # the store goes on: the retried put lands where the cut one would have
    again = await backend.put(
        put_request("0002", parent_id="0001", logs=[messages(one.spans["messages"], "c")])
    )
    assert again.spans["messages"] == (Span(0, 3),)


CRASHING_WORKER = """
import asyncio, sys
from touba.integrations.langgraph._backend import LogAppend, PutCheckpoint, ChannelBlob

from touba.integrations.langgraph._postgres import PostgresSaverBackend

async def main(dsn, prefix):
    backend = PostgresSaverBackend(dsn, table_prefix=prefix)
    spans = ()
    for n in range(1, 1000):
        items = tuple(("json", f"m{n}.{i}".encode()) for i in range(3))
        result = await backend.put(PutCheckpoint(
            thread_id="t", checkpoint_ns="", checkpoint_id=f"{n:06d}",
            parent_id=None if n == 1 else f"{n - 1:06d}",
            checkpoint=("json", b"{}"), metadata=("json", b"{}"), metadata_json="{}",
            run_id=None, versions={"k": str(n)},
            blobs=(ChannelBlob("k", str(n), ("json", b"x" * 20000)),),
            logs=(LogAppend("messages", spans, items),),
        ))
        spans = result.spans["messages"]
        print(n, flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_a_worker_killed_inside_a_put_leaves_it_whole_or_absent(pg: Place) -> None:
    """SIGKILL a worker whose 5th put is in the middle of its statement (its checkpoint
    row waiting on another transaction's uncommitted row of that key): every checkpoint
    reads back whole, the 5th included if the server finished the statement (a put is
    one statement, which the server completes or rolls back as a whole), with no entry,
    blob or log length of a put that is absent; the log goes on from its end."""
    application = f"touba-lg-crash-{pg.schema}"
    backend = pg.backend()
    await backend.put(put_request("000000", thread_id="t"))  # creates the tables
    async with await pg.admin() as holder:
        await pg.hold(holder, "000005", "t")  # rolled back below, once the put is dead
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CRASHING_WORKER,
            make_conninfo(pg.dsn, application_name=application),
            pg.prefix,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            assert worker.stdout is not None
            done = [await worker.stdout.readline() for _ in range(4)]
            assert [d.strip() for d in done] == [b"1", b"2", b"3", b"4"]
            await _until(lambda: _waiting_on_a_lock(pg.dsn, application), "put 5 waits")
            worker.send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(worker.wait(), 30) == -signal.SIGKILL
        finally:
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
        await holder.execute("ROLLBACK")
    # the server ends the dead worker's session once it finds the client gone
    await _until(lambda: _gone(pg.dsn, application), "the worker's session ends")
    page = await backend.list(ListQuery(thread_id="t"), {})
    stored = len(page.rows) - 1  # puts that are there, past the first one
    assert stored in (4, 5)
    assert [r.record.checkpoint_id for r in page.rows] == [
        f"{n:06d}" for n in range(stored, -1, -1)
    ]
    for row in page.rows[:-1]:
        n = int(row.record.checkpoint_id)
        spans = row.record.logs["messages"]
        assert spans == (Span(0, 3 * n),)
        texts = [page.logs[KEY_T].entries[p][1].decode() for p in range(3 * n)]
        assert texts == [f"m{k}.{i}" for k in range(1, n + 1) for i in range(3)]
        assert row.blobs["k"] == ("json", b"x" * 20000)
    state = page.logs[KEY_T].state
    assert state is not None
    assert state.length == 3 * stored
    assert await pg.count("entries") == 3 * stored
    assert await pg.count("blobs") == stored
    head = page.rows[0].record.logs["messages"]
    nxt = await backend.put(
        put_request(
            "000099", thread_id="t", parent_id=f"{stored:06d}", logs=[messages(head, "after")]
        )
    )
    assert nxt.spans["messages"] == (Span(0, 3 * stored + 1),)


KEY_T = KEY.__class__("t", "", "messages")


async def _gone(dsn: str, application: str) -> bool:
    query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
    return await _count(dsn, query, application) == 0


# --- schema and names ----------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "a.b.c", "1lg", "lg-x", "lg x", "a" * 48, 7])
def test_a_table_prefix_that_is_not_an_identifier_is_refused_at_construction(
    prefix: Any,
) -> None:
    with pytest.raises(ConfigurationError, match="table_prefix"):
        PostgresSaverBackend("postgresql://127.0.0.1/test", table_prefix=prefix)


async def test_openers_at_once_create_the_tables_once(pg: Place) -> None:
    backends = [pg.backend() for _ in range(4)]
    await asyncio.gather(
        *(b.put(put_request(f"000{i}", thread_id=f"t{i}")) for i, b in enumerate(backends))
    )
    assert len((await backends[0].list(ListQuery(), {})).rows) == 4


async def test_a_foreign_table_of_that_name_is_refused_untouched(pg: Place) -> None:
    async with await pg.admin() as conn:
        await conn.execute(sql.SQL("CREATE TABLE {} (x int)").format(pg.table("checkpoints")))
        await conn.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(pg.table("checkpoints")))
    with pytest.raises(ConfigurationError, match="not touba's"):
        await pg.backend().put(put_request("0001"))
    assert await pg.count("checkpoints") == 1


async def test_an_unreachable_server_is_a_configuration_error() -> None:
    backend = PostgresSaverBackend(
        "postgresql://postgres@127.0.0.1:1/test?connect_timeout=2", table_prefix="lg"
    )
    try:
        with pytest.raises(ConfigurationError, match="could not open"):
            await backend.get(T, "", None, {})
    finally:
        await backend.close()


@pytest.mark.parametrize(
    ("field", "request_of"),
    [
        ("thread_id", lambda: put_request("0001", thread_id="a\x00")),
        ("checkpoint_ns", lambda: put_request("0001", ns="x\x00")),
        ("checkpoint_id", lambda: put_request("00\x0001")),
        ("channels", lambda: put_request("0001", logs=[LogAppend("m\x00", (), items("a"))])),
        ("versions", lambda: put_request("0001", versions={"k": "1\x00"})),
        ("run_id", lambda: put_request("0001", run_id="r\x00")),
    ],
)
async def test_names_with_nul_are_refused_naming_the_field_and_nothing_is_written(
    pg: Place, field: str, request_of: Callable[[], Any]
) -> None:
    backend = pg.backend()
    await backend.put(put_request("0000", logs=[messages((), "a")]))
    with pytest.raises(ConfigurationError, match=field):
        await backend.put(request_of())
    with pytest.raises(ConfigurationError, match="task_id"):
        await backend.put_writes(T, "", "0000", [WriteRecord("t\x00", 0, "x", blob("v"))])
    assert await pg.count("checkpoints") == 1
    assert await pg.count("entries") == 1
    assert await pg.count("writes") == 0
    # reads and deletes of such names find nothing
    assert (await backend.get("a\x00", "", None, {})).rows == ()
    assert (await backend.list(ListQuery(thread_id="a\x00"), {})).rows == ()
    await backend.delete_thread("a\x00")
    await backend.delete_for_runs(["r\x00"])
    await backend.prune(["a\x00"], "keep_latest")
    await backend.copy_thread("a\x00", "b")
    with pytest.raises(ConfigurationError, match="target_thread_id"):
        await backend.copy_thread(T, "b\x00")


# --- failures ------------------------------------------------------------------------


async def test_a_connection_cut_between_calls_fails_one_call_then_the_store_goes_on(
    pg: Place,
) -> None:
    application = f"touba-lg-between-{pg.schema}"
    backend = pg.backend(application)
    await backend.put(put_request("0001", logs=[messages((), "a")]))
    assert await _cut(pg.dsn, application) >= 1
    with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
        await backend.get(T, "", None, {})
    assert caught.value.retryable
    page = await backend.get(T, "", None, {})
    assert [r.record.checkpoint_id for r in page.rows] == ["0001"]


async def test_entries_already_at_a_logs_end_are_record_invalid_and_nothing_is_written(
    pg: Place,
) -> None:
    """A row at the position the log says is free (damaged tables) is refused, never
    overwritten: DecisionHistoryRecordInvalid, and the put leaves nothing."""
    backend = pg.backend()
    one = await backend.put(put_request("0001", logs=[messages((), "a")]))
    async with await pg.admin() as conn:
        await conn.execute(
            sql.SQL("INSERT INTO {} VALUES (%s, '', 'messages', 1, 'json', 'stray')").format(
                pg.table("entries")
            ),
            (T,),
        )
    with pytest.raises(DecisionHistoryRecordInvalid):
        await backend.put(
            put_request("0002", parent_id="0001", logs=[messages(one.spans["messages"], "b")])
        )
    page = await latest_of(backend)
    assert [r.record.checkpoint_id for r in page.rows] == ["0001"]
    assert page.logs[KEY].state == one.logs["messages"]


async def test_a_warm_read_after_many_steps_returns_only_the_new_entries(pg: Place) -> None:
    backend = pg.backend()
    spans: tuple[Span, ...] = ()
    result = None
    for n in range(50):
        result = await backend.put(
            put_request(f"{n:04d}", parent_id=None, logs=[messages(spans, f"m{n}")])
        )
        spans = result.spans["messages"]
    assert result is not None
    state = result.logs["messages"]
    await backend.put(put_request("0050", logs=[messages(spans, "new")]))
    page = await latest_of(backend, held={"messages": HeldLog(state.token, state.length)})
    assert dict(page.logs[KEY].entries) == {50: blob("new")}


# --- through ToubaSaver --------------------------------------------------------------


async def test_a_missing_log_entry_is_record_invalid_through_the_saver(pg: Place) -> None:
    """An entry deleted behind the store's back (a damaged table) is an error naming its
    position, never a shorter message list."""
    from tests.integrations.langgraph.test_saver import Thread, message
    from touba.integrations.langgraph import ToubaSaver

    backend = pg.backend()
    thread = Thread(ToubaSaver(backend))
    await thread.put([message(i) for i in range(5)])
    async with await pg.admin() as conn:
        await conn.execute(sql.SQL("DELETE FROM {} WHERE position = 2").format(pg.table("entries")))
    with pytest.raises(DecisionHistoryRecordInvalid, match="position 2 of its 'messages' log"):
        await ToubaSaver(backend).aget_tuple(thread.config)
    with pytest.raises(DecisionHistoryRecordInvalid):
        [t async for t in ToubaSaver(backend).alist(None)]


async def test_langgraph_checkpoint_conformance_is_full_on_postgres() -> None:
    """langgraph-checkpoint-conformance's validate() on ToubaSaver.postgres: every
    capability, the extended ones included (``make peers`` runs the same suite)."""
    from langgraph.checkpoint.conformance import checkpointer_test, validate
    from langgraph.checkpoint.conformance.report import ProgressCallbacks

    from tests.peers import langgraph_savers

    postgres_dsn()
    registered = checkpointer_test(name="ToubaSaver.postgres")(langgraph_savers.postgres)
    report = await validate(registered, progress=ProgressCallbacks.quiet())
    failures = {cap: r.failures for cap, r in report.results.items() if r.failures}
    assert failures == {}
    assert all(r.detected and r.passed is True for r in report.results.values())
    assert report.conformance_level() == "FULL"
    assert sum(r.tests_passed for r in report.results.values()) == 81


async def test_a_lock_timeout_is_retryable_and_leaves_nothing(pg: Place) -> None:
    """A put that waits past the server's ``lock_timeout`` (set in the DSN) raises
    DecisionHistoryStoreUnavailable (retryable, chained), writes nothing, and the same
    put succeeds once the lock is gone."""
    backend = PostgresSaverBackend(
        make_conninfo(pg.dsn, options="-c lock_timeout=200"), table_prefix=pg.prefix
    )
    pg.opened.append(backend)
    one = await backend.put(put_request("0001", logs=[messages((), "a")]))
    again = put_request("0002", parent_id="0001", logs=[messages(one.spans["messages"], "b")])
    async with await pg.admin() as holder:
        await holder.execute("BEGIN")
        await holder.execute(sql.SQL("SELECT 1 FROM {} FOR UPDATE").format(pg.table("logs")))
        with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
            await backend.put(again)
        assert caught.value.retryable
        assert isinstance(caught.value.__cause__, psycopg.errors.LockNotAvailable)
        await holder.execute("ROLLBACK")
    assert await pg.count("entries") == 1
    assert (await backend.put(again)).spans["messages"] == (Span(0, 2),)


async def test_a_put_cancelled_while_it_waits_leaves_nothing_and_the_store_goes_on(
    pg: Place,
) -> None:
    """asyncio cancels a put inside its transaction (held on a lock): nothing of it is
    stored, and the connection it held serves the next calls."""
    application = f"touba-lg-cancel-{pg.schema}"
    backend = pg.backend(application)
    one = await backend.put(put_request("0001", logs=[messages((), "a")]))
    again = put_request("0002", parent_id="0001", logs=[messages(one.spans["messages"], "b")])
    async with await pg.admin() as holder:
        await pg.hold(holder, "0002")
        put = asyncio.create_task(backend.put(again))
        await _until(lambda: _waiting_on_a_lock(pg.dsn, application), "the put waits")
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        await holder.execute("ROLLBACK")
    assert await pg.count("entries") == 1
    results = await asyncio.gather(*(backend.get(T, "", None, {}) for _ in range(6)))
    assert {r.rows[0].record.checkpoint_id for r in results} == {"0001"}
    assert (await backend.put(again)).spans["messages"] == (Span(0, 2),)


async def test_the_longest_prefix_names_every_table_and_index_in_full(pg: Place) -> None:
    """47 characters: ``<prefix>_checkpoints_run`` is 63, PostgreSQL's longest name, so
    nothing is truncated (two prefixes never share a name)."""
    prefix = "p" * 47
    backend = PostgresSaverBackend(pg.dsn, table_prefix=f"{pg.schema}.{prefix}")
    pg.opened.append(backend)
    await backend.put(put_request("0001", logs=[messages((), "a")], run_id="r"))
    assert [r.record.checkpoint_id for r in (await backend.get(T, "", None, {})).rows] == ["0001"]
    async with await pg.admin() as conn:
        cur = await conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind IN ('r', 'i') AND c.relname LIKE 'p%%'",
            (pg.schema,),
        )
        names = {r[0] for r in await cur.fetchall()}
    assert f"{prefix}_checkpoints_run" in names
    assert {f"{prefix}_{t}" for t in ("checkpoints", "blobs", "writes", "logs", "entries")} <= names


# --- cost: what the server reads --------------------------------------------------------


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan."""
    return [plan, *(n for child in plan.get("Plans", []) for n in _nodes(child))]


async def _plan(pg: Place, query: Any, params: Any) -> list[dict[str, Any]]:
    """The nodes of ``query`` as the server ran it, in a transaction rolled back."""
    async with await pg.admin() as conn:
        await conn.execute("BEGIN")
        cur = await conn.execute(sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + query, params)
        found = await cur.fetchone()
        await conn.execute("ROLLBACK")
    assert found is not None
    return _nodes(found[0][0]["Plan"])


def _read(nodes: list[dict[str, Any]], table: str) -> int:
    """Rows the plan's scans of ``table`` visited (returned or filtered out)."""
    return sum(
        (n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n["Actual Loops"]
        for n in nodes
        if n.get("Relation Name") == table and "Scan" in n["Node Type"]
    )


async def test_a_put_and_a_warm_read_touch_only_what_the_step_added(pg: Place) -> None:
    """On threads of 2,000 entries, the server's own account (EXPLAIN ANALYZE) of a put
    of 3 messages: no scan of any table, no node producing more than 3 rows; of a get
    (and a list's entry read) by a caller holding all but those 3: 3 entries read, by
    index."""
    from touba.integrations.langgraph._postgres import _appends, _get_params, _put_params

    backend = pg.backend()
    many = tuple(f"m{i}" for i in range(2000))
    for thread in ("other", T):
        first = await backend.put(put_request("0001", thread_id=thread, logs=[messages((), *many)]))
    async with await pg.admin() as conn:
        for table in ("entries", "logs", "checkpoints", "blobs"):
            await conn.execute(sql.SQL("ANALYZE {}").format(pg.table(table)))

    step = put_request(
        "0002",
        parent_id="0001",
        logs=[messages(first.spans["messages"], "a", "b", "c")],
        versions={"k": "2"},
        blobs=[ChannelBlob("k", "2", blob("K2"))],
    )
    nodes = await _plan(
        pg, backend._sql.put, _put_params(step, _appends(step), backend._lock(step.thread_id))
    )
    assert not [n for n in nodes if "Scan" in n["Node Type"] and "Relation Name" in n]
    assert max(n["Actual Rows"] * n["Actual Loops"] for n in nodes) <= 3

    await backend.put(step)
    held = {"messages": HeldLog(first.logs["messages"].token, 2000)}
    nodes = await _plan(pg, backend._sql.get_latest, _get_params(T, "", None, held))
    entries = "lg_entries"
    assert _read(nodes, entries) == 3
    assert not [
        n for n in nodes if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == entries
    ]
    page = await latest_of(backend, held=held)
    assert sorted(page.logs[KEY].entries) == [2000, 2001, 2002]
    # a list's entries: one index range per span, from what is held
    nodes = await _plan(pg, backend._sql.entries_of, ([0], [T], [""], ["messages"], [2000], [2003]))
    assert _read(nodes, entries) == 3


async def test_a_thread_deleted_during_a_put_is_deleted_whole(pg: Place) -> None:
    """delete_thread waits for a put of the thread in progress (held mid-statement), then
    removes everything, the put's rows included: no entry outlives its log, and the next
    put starts the thread over."""
    application = f"touba-lg-delete-{pg.schema}"
    backend = pg.backend(application)
    one = await backend.put(put_request("0001", logs=[messages((), "a", "b")]))
    async with await pg.admin() as holder:
        await pg.hold(holder, "0002")
        put = asyncio.create_task(
            backend.put(
                put_request("0002", parent_id="0001", logs=[messages(one.spans["messages"], "c")])
            )
        )
        await _until(lambda: _waiting_on_a_lock(pg.dsn, application), "the put waits")
        deleting = asyncio.create_task(backend.delete_thread(T))
        await asyncio.sleep(0.2)
        assert not deleting.done()  # it waits for the put
        await holder.execute("ROLLBACK")
    await asyncio.wait_for(put, timeout=30)
    await asyncio.wait_for(deleting, timeout=30)
    for table in ("checkpoints", "entries", "logs", "blobs"):
        assert await pg.count(table) == 0, table
    again = await backend.put(put_request("0003", logs=[messages((), "new")]))
    assert again.spans["messages"] == (Span(0, 1),)


async def test_a_prune_during_a_write_leaves_no_write_behind(pg: Place) -> None:
    """prune waits for a put_writes of the thread in progress (held mid-statement by a
    row another transaction is inserting), then removes what it wrote for a checkpoint it
    prunes: no pending write outlives its checkpoint."""
    application = f"touba-lg-writes-{pg.schema}"
    backend = pg.backend(application)
    await backend.put(put_request("0001"))
    await backend.put(put_request("0002", parent_id="0001"))
    write = WriteRecord("task", 0, "ch", blob("w"))
    async with await pg.admin() as holder:
        await holder.execute("BEGIN")
        await holder.execute(
            sql.SQL(
                "INSERT INTO {} (thread_id, ns, checkpoint_id, task_id, idx, channel, type,"
                " data, task_path) VALUES (%s, '', '0001', 'task', 0, 'ch', 'json', '', '')"
            ).format(pg.table("writes")),
            (T,),
        )
        writing = asyncio.create_task(backend.put_writes(T, "", "0001", [write]))
        await _until(lambda: _waiting_on_a_lock(pg.dsn, application), "the write waits")
        pruning = asyncio.create_task(pg.backend().prune([T], "keep_latest"))
        await asyncio.sleep(0.2)
        assert not pruning.done()  # it waits for the write
        await holder.execute("ROLLBACK")
    await asyncio.wait_for(writing, timeout=30)
    await asyncio.wait_for(pruning, timeout=30)
    assert await pg.count("checkpoints") == 1
    assert await pg.count("writes") == 0
