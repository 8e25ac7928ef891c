"""The checkpoint store contract, run over every store (RAM, SQLite, PostgreSQL).

Then what only a durable store promises (other processes, reopening, close),
SQLite's layout and migration, and PostgreSQL's own rules (construction,
schema, failures, a worker killed mid-write).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import signal
import sqlite3
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests._services import DEFAULT_POSTGRES_DSN
from tests._sqlite import set_schema_version
from touba.errors import CheckpointStoreUnavailable, ConfigurationError
from touba.runtime import (
    CheckpointStore,
    MemoryCheckpointStore,
    SqliteCheckpointStore,
)
from touba.testing import ScriptedProvider

from ._durable import FIRST_STEP, build
from ._helpers import final
from ._stores import ROOT, Place, postgres_sql, race_in_processes, subprocess_env

# -- the contract, on every store -----------------------------------------------------------


async def test_save_get_take(where: Place) -> None:
    store = where.checkpoints()
    assert isinstance(store, CheckpointStore)
    assert getattr(store, "durable", True) is where.durable
    checkpoint = {"version": 1, "run_id": "r", "x": [1, 2.5, None, True], "text": "é \u0000 😀"}
    await store.save("a", checkpoint)
    copy = await store.get("a")
    assert copy == checkpoint
    assert copy is not None
    copy["x"].append(3)  # a detached copy
    assert await store.get("a") == checkpoint
    assert await store.take("a") == checkpoint
    assert await store.take("a") is None
    assert await store.get("a") is None
    assert await store.get("never") is None


async def test_a_duplicate_id_is_refused_and_the_first_kept(where: Place) -> None:
    store = where.checkpoints()
    await store.save("a", {"v": 1})
    with pytest.raises(ConfigurationError, match="already exists"):
        await store.save("a", {"v": 2})
    with pytest.raises(ConfigurationError, match="already exists"):
        await where.checkpoints().save("a", {"v": 3})  # another handle, same storage
    assert await store.get("a") == {"v": 1}


@pytest.mark.parametrize(
    "bad",
    [{"object": object()}, {"lone surrogate": "\ud800"}, {"set": {1, 2}}],
    ids=["object", "surrogate", "set"],
)
async def test_what_is_not_json_is_refused_and_nothing_stored(where: Place, bad: Any) -> None:
    store = where.checkpoints()
    with pytest.raises(ConfigurationError, match="JSON"):
        await store.save("bad", bad)
    assert await store.get("bad") is None
    assert await store.list() == []
    await store.save("good", {"revision": 0})
    with pytest.raises(ConfigurationError, match="JSON"):
        await store.replace("good", bad, revision=0)
    assert await store.get("good") == {"revision": 0}


async def test_concurrent_takers_have_exactly_one_winner(where: Place) -> None:
    handles = [where.checkpoints() for _ in range(4)]
    for i in range(5):
        await handles[0].save(f"c{i}", {"n": i})
    for i in range(5):
        taken = await asyncio.gather(*(h.take(f"c{i}") for h in handles for _ in range(4)))
        assert [t for t in taken if t is not None] == [{"n": i}]


async def test_replace_is_a_compare_and_swap_on_the_revision(where: Place) -> None:
    store = where.checkpoints()
    await store.save("a", {"status": "awaiting_approval"})  # no revision field: 0
    assert await store.replace("a", {"revision": 1, "v": "x"}, revision=1) is False
    assert await store.get("a") == {"status": "awaiting_approval"}
    assert await store.replace("a", {"revision": 1, "v": "first"}, revision=0) is True
    assert await store.replace("a", {"revision": 1, "v": "stale"}, revision=0) is False
    assert await store.get("a") == {"revision": 1, "v": "first"}
    assert await store.replace("a", None, revision=0) is False  # stale removal: kept
    assert await store.get("a") == {"revision": 1, "v": "first"}
    assert await store.replace("a", None, revision=1) is True
    assert await store.get("a") is None
    assert await store.replace("a", None, revision=1) is False


async def test_replace_never_creates(where: Place) -> None:
    store = where.checkpoints()
    assert await store.replace("missing", {"revision": 1}, revision=0) is False
    assert await store.get("missing") is None
    assert await store.list() == []


@pytest.mark.parametrize("odd", ["3", True, 1.5, None, [1]])
async def test_a_revision_that_is_not_an_integer_counts_as_zero(where: Place, odd: Any) -> None:
    store = where.checkpoints()
    await store.save("a", {"revision": odd})
    assert (await store.list())[0].revision == 0
    assert await store.replace("a", {"revision": 1}, revision=1) is False
    assert await store.replace("a", {"revision": 1}, revision=0) is True


async def test_replace_refuses_a_revision_that_is_not_an_int(where: Place) -> None:
    store = where.checkpoints()
    await store.save("a", {})
    with pytest.raises(ConfigurationError, match="revision must be an int"):
        await store.replace("a", {}, revision="0")
    assert await store.get("a") == {}


async def test_concurrent_replacers_of_one_revision_have_one_winner(where: Place) -> None:
    handles = [where.checkpoints() for _ in range(4)]
    await handles[0].save("a", {"revision": 0})
    moves = [
        h.replace("a", {"revision": 1, "by": f"{n}-{i}"}, revision=0)
        for n, h in enumerate(handles)
        for i in range(4)
    ]
    outcomes = await asyncio.gather(*moves)
    assert outcomes.count(True) == 1
    stored = await handles[0].get("a")
    assert stored is not None
    assert stored["revision"] == 1
    removals = await asyncio.gather(*(h.replace("a", None, revision=1) for h in handles))
    assert removals.count(True) == 1
    assert await handles[0].get("a") is None


async def test_list_describes_checkpoints_oldest_first(where: Place) -> None:
    store = where.checkpoints()
    await store.save(
        "first",
        {"run_id": "r1", "invocation_id": "i1", "agent_ref": "billing", "revision": 2},
    )
    await store.save("second", {"run_id": "r2", "status": "running"})
    await store.save("third", {"run_id": "r1", "agent_ref": 7, "status": ["odd"]})
    await store.save("fourth", {"run_id": 5})
    listed = await store.list()
    assert [i.checkpoint_id for i in listed] == ["first", "second", "third", "fourth"]
    first, second, third, fourth = listed
    assert (first.run_id, first.invocation_id, first.agent_ref) == ("r1", "i1", "billing")
    assert (first.status, first.revision) == ("awaiting_approval", 2)
    assert (second.status, second.revision) == ("running", 0)
    assert (third.agent_ref, third.status) == (None, "awaiting_approval")  # not str: absent
    assert fourth.run_id is None
    assert [i.checkpoint_id for i in await store.list(run_id="r1")] == ["first", "third"]
    assert await store.list(run_id="5") == []
    assert await store.list(run_id="nobody") == []
    for info in listed:
        created, updated = (datetime.fromisoformat(t) for t in (info.created_at, info.updated_at))
        assert created.tzinfo is not None
        assert created == updated

    assert await store.replace("first", {"run_id": "r3", "revision": 3}, revision=2)
    moved = (await store.list(run_id="r3"))[0]
    assert (moved.checkpoint_id, moved.revision, moved.created_at) == (
        "first",
        3,
        first.created_at,
    )
    assert datetime.fromisoformat(moved.updated_at) >= datetime.fromisoformat(first.updated_at)
    assert [i.checkpoint_id for i in await store.list(run_id="r1")] == ["third"]
    await store.take("third")
    assert [i.checkpoint_id for i in await store.list()] == ["first", "second", "fourth"]


async def test_a_paused_invocation_resumes_from_the_store(where: Place) -> None:
    model = ScriptedProvider(FIRST_STEP, final("paid"))
    ledger: list[str] = []
    paused = await build(model, where.checkpoints(), ledger).invoke("billing", run_id="r")
    assert paused.status == "awaiting_approval"
    assert paused.checkpoint_id is not None
    listed = {i.checkpoint_id: i for i in await where.checkpoints().list(run_id="r")}
    assert listed[paused.checkpoint_id].agent_ref == "billing"
    resumed = await build(model, where.checkpoints(), ledger).resume(
        paused.checkpoint_id, approvals={"c2": True}
    )
    assert (resumed.status, resumed.output) == ("completed", "paid")
    assert ledger == ["lookup I-1", "pay I-1"]


# -- durable stores -------------------------------------------------------------------------


async def test_takers_in_several_processes_have_exactly_one_winner(durable: Place) -> None:
    store = durable.checkpoints()
    count = 30
    for i in range(count):
        await store.save(f"item-{i}", {"n": i})
    won = await race_in_processes(durable, "checkpoints", count)
    every = [item for items in won for item in items]
    assert sorted(every) == sorted(f"item-{i}" for i in range(count))  # each once, none lost
    assert await store.list() == []


async def test_checkpoints_survive_reopening(durable: Place) -> None:
    store = durable.checkpoints()
    await store.save("a", {"revision": 0, "text": "é"})
    await store.close()
    with pytest.raises(ConfigurationError, match="closed"):
        await store.get("a")
    await store.close()  # idempotent
    async with durable.checkpoints() as reopened:
        assert await reopened.get("a") == {"revision": 0, "text": "é"}
        assert await reopened.replace("a", {"revision": 1}, revision=0)
    with pytest.raises(ConfigurationError, match="closed"):
        await reopened.take("a")
    assert await durable.checkpoints().take("a") == {"revision": 1}


# -- SQLite -----------------------------------------------------------------------------------

_V1_BEFORE_UPDATED_AT = (
    "CREATE TABLE touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE touba_checkpoints (
        id TEXT PRIMARY KEY, run_id TEXT, invocation_id TEXT, agent_ref TEXT,
        created_at TEXT NOT NULL, body TEXT NOT NULL)""",
    "INSERT INTO touba_meta VALUES ('checkpoint_schema_version', '1')",
)
_OLD_INSERT = (
    "INSERT INTO touba_checkpoints (id, run_id, invocation_id, agent_ref, created_at, body) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)


def _sqlite_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    return directory


async def test_sqlite_file_of_the_first_version_one_layout_is_migrated(tmp_path: Path) -> None:
    path = _sqlite_dir(tmp_path) / "checkpoints.sqlite"
    path.touch(mode=0o600)
    old = sqlite3.connect(path)
    for statement in _V1_BEFORE_UPDATED_AT:
        old.execute(statement)
    old.execute(_OLD_INSERT, ("old", "r", "i", "a", "2026-01-01T00:00:00+00:00", '{"run_id":"r"}'))
    old.commit()
    async with SqliteCheckpointStore(path) as store:
        (info,) = await store.list(run_id="r")
        assert info.updated_at == info.created_at == "2026-01-01T00:00:00+00:00"
        assert await store.replace("old", {"run_id": "r", "revision": 1}, revision=0)
        (info,) = await store.list()
        assert info.updated_at > info.created_at
        # An older touba sharing the file still inserts its own way, and is read back.
        old.execute(
            _OLD_INSERT,
            ("older", "r", None, None, "2026-01-02T00:00:00+00:00", '{"run_id":"r"}'),
        )
        old.commit()
        assert [i.checkpoint_id for i in await store.list(run_id="r")] == ["old", "older"]
    indexes = {row[1] for row in old.execute("PRAGMA index_list(touba_checkpoints)")}
    assert "touba_checkpoints_run" in indexes
    version = old.execute("SELECT value FROM touba_meta").fetchall()
    assert version == [("1",)]  # still version 1: older touba keeps reading it
    old.close()


async def test_sqlite_store_refuses_another_schema_version(tmp_path: Path) -> None:
    path = _sqlite_dir(tmp_path) / "checkpoints.sqlite"
    await SqliteCheckpointStore(path).close()
    set_schema_version(path, "checkpoint_schema_version", "99")
    with pytest.raises(ConfigurationError, match="version '99'"):
        SqliteCheckpointStore(path)


async def test_sqlite_damaged_row_is_refused_untouched(tmp_path: Path) -> None:
    path = _sqlite_dir(tmp_path) / "checkpoints.sqlite"
    async with SqliteCheckpointStore(path) as store:
        await store.save("a", {})
        conn = sqlite3.connect(path)
        conn.execute("UPDATE touba_checkpoints SET body = 'not json'")
        conn.commit()
        conn.close()
        for attempt in (store.get("a"), store.replace("a", {}, revision=0), store.list()):
            with pytest.raises(ConfigurationError, match="not a JSON object"):
                await attempt


def test_memory_store_is_not_durable() -> None:
    assert MemoryCheckpointStore.durable is False
    assert SqliteCheckpointStore.durable is True


# -- PostgreSQL -------------------------------------------------------------------------------


def _postgres() -> Any:
    from touba.runtime import PostgresCheckpointStore

    return PostgresCheckpointStore


@pytest.mark.parametrize(
    "name", ["", "touba-checkpoints", "1abc", "a.b.c", 'x"; DROP TABLE y; --', "t" * 49, 7]
)
def test_postgres_unsafe_table_name_is_refused(name: Any) -> None:
    with pytest.raises(ConfigurationError, match="table must be a plain identifier"):
        _postgres()(DEFAULT_POSTGRES_DSN, table=name)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, "exactly one"),
        ({"dsn": DEFAULT_POSTGRES_DSN, "pool": "p"}, "exactly one"),
        ({"pool": "postgresql://x"}, "pool must be a psycopg_pool.AsyncConnectionPool"),
        ({"dsn": "not a dsn"}, "not a valid PostgreSQL connection string"),
        ({"dsn": 5}, "dsn must be a str"),
    ],
)
def test_postgres_misconfiguration_is_refused_at_construction(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        _postgres()(**options)


@pytest.mark.parametrize(
    "module", ["touba.runtime._checkpoint_postgres", "touba.runtime._resource_postgres"]
)
def test_postgres_missing_driver_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=r'pip install "touba\[postgres\]"'):
        importlib.import_module(module)


async def test_postgres_unreachable_server_is_a_configuration_error_at_open() -> None:
    store = _postgres()("postgresql://postgres@127.0.0.1:1/test?connect_timeout=2")
    with pytest.raises(ConfigurationError, match="could not open") as info:
        await store.open()
    import psycopg

    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    await store.close()


@pytest.mark.postgres
async def test_postgres_schema_is_created_once_and_versioned(pg: Place) -> None:
    dsn, table = pg.where
    await asyncio.gather(*(pg.checkpoints().open() for _ in range(3)))
    assert await postgres_sql(dsn, "SELECT name, value FROM {meta}", table) == [
        ("schema_version", "1")
    ]


@pytest.mark.postgres
async def test_postgres_other_schema_version_is_refused_untouched(pg: Place) -> None:
    dsn, table = pg.where
    await pg.checkpoints().save("a", {"v": 1})
    await postgres_sql(dsn, "UPDATE {meta} SET value = '2'", table)
    with pytest.raises(ConfigurationError, match="schema version '2'"):
        await pg.checkpoints().get("a")
    assert await postgres_sql(dsn, "SELECT id, body FROM {t}", table) == [("a", '{"v":1}')]


@pytest.mark.postgres
async def test_postgres_foreign_table_is_refused_untouched(pg: Place) -> None:
    dsn, table = pg.where
    await postgres_sql(dsn, "CREATE TABLE {t} (x integer)", table)
    with pytest.raises(ConfigurationError, match="not a touba checkpoint table"):
        await pg.checkpoints().open()
    assert await postgres_sql(dsn, "SELECT count(*) FROM {t}", table) == [(0,)]


@pytest.mark.postgres
async def test_postgres_schema_qualified_table_and_a_given_pool(pg: Place) -> None:
    import psycopg
    from psycopg import sql
    from psycopg_pool import AsyncConnectionPool

    dsn = pg.where[0]
    schema = f"touba_s_{pg.table()[8:]}"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                dsn, open=False, min_size=1, max_size=2
            )
            await pool.open()
            try:
                async with _postgres()(pool=pool, table=f"{schema}.cp") as store:
                    await store.save("a", {"run_id": "r"})
                assert not pool.closed  # the host's pool stays open
                async with _postgres()(pool=pool, table=f"{schema}.cp") as store:
                    assert await store.take("a") == {"run_id": "r"}
            finally:
                await pool.close()
            with pytest.raises(ConfigurationError, match="not open"):
                await _postgres()(pool=pool, table=f"{schema}.cp").open()
        finally:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.mark.postgres
async def test_postgres_nul_in_ids_is_refused_before_writing(pg: Place) -> None:
    store = pg.checkpoints()
    with pytest.raises(ConfigurationError, match="NUL"):
        await store.save("a\x00", {})
    with pytest.raises(ConfigurationError, match="NUL"):
        await store.save("a", {"run_id": "r\x00"})
    with pytest.raises(ConfigurationError, match="64 bits"):
        await store.save("a", {"revision": 2**63})
    assert await store.list() == []
    assert await store.get("a\x00") is None
    assert await store.take("a\x00") is None
    assert await store.replace("a\x00", None, revision=0) is False
    assert await store.list(run_id="r\x00") == []
    await store.save("a", {"revision": 0})
    assert await store.replace("a", {}, revision=2**64) is False


async def _backends(dsn: str, application: str) -> list[tuple[int, str | None]]:
    import psycopg

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT pid, wait_event_type FROM pg_stat_activity WHERE application_name = %s",
            (application,),
        )
        return await cur.fetchall()


@pytest.mark.postgres
async def test_postgres_lost_connection_is_checkpoint_store_unavailable(pg: Place) -> None:
    import psycopg
    from psycopg.conninfo import make_conninfo

    dsn, table = pg.where
    application = f"touba-lost-{table}"
    store = _postgres()(make_conninfo(dsn, application_name=application), table=table)
    pg.opened.append(store)
    await store.save("a", {"v": 1})
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (application,),
        )
    with pytest.raises(CheckpointStoreUnavailable, match="PostgreSQL failed") as info:
        await store.get("a")  # the pool's one connection was cut
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert info.value.retryable
    assert await pg.checkpoints().get("a") == {"v": 1}


CRASHING_WORKER = """
import asyncio, sys
from touba.runtime import PostgresCheckpointStore

async def main(dsn, table):
    store = PostgresCheckpointStore(dsn, table=table)
    await store.save("kept", {"revision": 0, "v": "committed before the kill"})
    await store.save("busy", {"revision": 0})
    revision = 0
    while True:
        new = {"revision": revision + 1, "payload": "x" * 20000}
        assert await store.replace("busy", new, revision=revision)
        revision += 1
        print(revision, flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.postgres
async def test_postgres_worker_killed_mid_write_leaves_the_last_commit(pg: Place) -> None:
    """SIGKILL a worker whose replace is inside its transaction (held by a row lock here):
    what it committed survives, its open write is rolled back, nothing is half-written."""
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    dsn, table = pg.where
    application = f"touba-crash-{table}"
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CRASHING_WORKER,
        make_conninfo(dsn, application_name=application),
        table,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=subprocess_env(),
    )
    assert worker.stdout is not None
    try:
        for _ in range(3):  # a few replaces committed
            line = await asyncio.wait_for(worker.stdout.readline(), 30)
            assert line.strip().isdigit(), (line, worker.returncode)
        async with await psycopg.AsyncConnection.connect(dsn) as blocker:
            locked = await blocker.execute(
                sql.SQL("SELECT revision, body FROM {} WHERE id = 'busy' FOR UPDATE").format(
                    sql.Identifier(table)
                )
            )
            row = await locked.fetchone()
            assert row is not None
            revision, body = row
            for _ in range(200):  # until the worker's next UPDATE waits on our lock
                if any(wait == "Lock" for _, wait in await _backends(dsn, application)):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the worker never blocked inside its transaction")
            worker.send_signal(signal.SIGKILL)
            await worker.wait()
            await blocker.rollback()  # release: the dead worker's UPDATE may now run, uncommitted
        for _ in range(200):  # the server notices the client is gone and rolls back
            if not await _backends(dsn, application):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the dead worker's backend did not go away")
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
    assert worker.returncode == -signal.SIGKILL
    store = pg.checkpoints()
    assert await store.get("kept") == {"revision": 0, "v": "committed before the kill"}
    busy = await store.get("busy")
    assert busy == {"revision": revision, "payload": "x" * 20000}
    assert busy == json.loads(body)
    listed = {i.checkpoint_id: i.revision for i in await store.list()}
    assert listed == {"kept": 0, "busy": revision}
    assert await store.replace("busy", None, revision=revision) is True  # nothing holds it
