"""The resource binding contract, run over every binding (RAM, SQLite, PostgreSQL).

Then what only a durable binding promises (other processes, reopening,
close), SQLite's file rules and PostgreSQL's own (schema, NUL, failures).
"""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from typing import Any

import pytest

from tests._services import DEFAULT_POSTGRES_DSN
from tests._sqlite import set_schema_version
from touba.errors import (
    ConfigurationError,
    DecisionHistoryStorageUnsafe,
    ResourceBindingUnavailable,
)
from touba.runtime import (
    InvocationContext,
    Program,
    ResourceAddress,
    ResourceBinding,
    Resources,
    Runtime,
    SqliteResourceBinding,
)

from ._helpers import RawProvider, calls, done
from ._stores import Place, postgres_sql, race_in_processes

HERE = ResourceAddress("notes", "user", "ada")
THERE = ResourceAddress("notes", "user", "bob")


# -- the contract, on every binding -----------------------------------------------------------


async def test_binding_contract(where: Place) -> None:
    binding = where.resources()
    assert isinstance(binding, ResourceBinding)
    assert await binding.get(HERE, "k") is None
    item = await binding.put(HERE, "k", {"a": [1, "é", 2.5, None]})
    assert item.value == {"a": [1, "é", 2.5, None]}
    assert item.updated_at.tzinfo is not None
    await binding.put(HERE, "k2", None)
    await binding.put(HERE, "j", 1)
    await binding.put(THERE, "k", "bob's")
    got = await binding.get(HERE, "k")
    assert got is not None
    assert (got.value, got.updated_at) == (item.value, item.updated_at)
    null = await binding.get(HERE, "k2")
    assert null is not None
    assert null.value is None  # a stored null is not a missing item
    assert await binding.keys(HERE, prefix="k", limit=10) == ["k", "k2"]
    assert await binding.keys(HERE, prefix="", limit=2) == ["j", "k"]
    assert await binding.delete(HERE, "k") is True
    assert await binding.delete(HERE, "k") is False
    other = await binding.get(THERE, "k")
    assert other is not None
    assert other.value == "bob's"


async def test_a_put_replaces_and_values_come_back_detached(where: Place) -> None:
    binding = where.resources()
    await binding.put(HERE, "k", {"v": 1})
    replaced = await binding.put(HERE, "k", {"v": [2], "text": "\u0000 😀"})
    got = await binding.get(HERE, "k")
    assert got is not None
    assert got.value == {"v": [2], "text": "\u0000 😀"}
    assert isinstance(got.value, dict)
    assert isinstance(got.value["v"], list)
    got.value["v"].append(3)
    again = await binding.get(HERE, "k")
    assert again is not None
    assert again.value == replaced.value == {"v": [2], "text": "\u0000 😀"}


async def test_addresses_are_kept_apart(where: Place) -> None:
    binding = where.resources()
    addresses = [
        HERE,
        ResourceAddress("notes", "session", "ada"),
        ResourceAddress("other", "user", "ada"),
        ResourceAddress("notes", "user", "ada2"),
    ]
    for n, address in enumerate(addresses):
        await binding.put(address, "k", n)
    for n, address in enumerate(addresses):
        item = await binding.get(address, "k")
        assert item is not None
        assert item.value == n
        assert await binding.keys(address, prefix="", limit=10) == ["k"]


async def test_keys_sort_by_code_point_and_match_the_prefix_literally(where: Place) -> None:
    binding = where.resources()
    names = ["b", "B", "é", "a", "ab", "a%b", "a_c", "Z", "a\\d", "zz"]
    for name in names:
        await binding.put(HERE, name, 0)
    assert await binding.keys(HERE, prefix="", limit=100) == sorted(names)
    assert await binding.keys(HERE, prefix="", limit=3) == sorted(names)[:3]
    assert await binding.keys(HERE, prefix="a%", limit=10) == ["a%b"]
    assert await binding.keys(HERE, prefix="a_", limit=10) == ["a_c"]
    assert await binding.keys(HERE, prefix="a\\", limit=10) == ["a\\d"]
    assert await binding.keys(HERE, prefix="A", limit=10) == []


async def test_concurrent_deleters_have_exactly_one_winner(where: Place) -> None:
    handles = [where.resources() for _ in range(4)]
    for i in range(5):
        await handles[0].put(HERE, f"k{i}", i)
    for i in range(5):
        outcomes = await asyncio.gather(
            *(h.delete(HERE, f"k{i}") for h in handles for _ in range(4))
        )
        assert outcomes.count(True) == 1
    assert await handles[0].keys(HERE, prefix="", limit=10) == []


async def test_concurrent_writers_of_one_key_leave_one_whole_value(where: Place) -> None:
    handles = [where.resources() for _ in range(4)]
    values = [{"by": n, "payload": [n] * 200} for n in range(16)]
    await asyncio.gather(*(handles[n % 4].put(HERE, "k", v) for n, v in enumerate(values)))
    item = await handles[0].get(HERE, "k")
    assert item is not None
    assert item.value in values


async def test_capabilities_use_the_binding(where: Place) -> None:
    program = Program()
    program.resource("notes", scopes=("user",), read=("r",), write=("w",))

    @program.capability(permissions=("w",))
    async def remember(text: str, resources: Resources) -> str:
        await resources["notes"].put("last", text)
        return "ok"

    @program.capability(permissions=("r",))
    async def recall(resources: Resources) -> Any:
        return await resources["notes"].get("last")

    provider = RawProvider(
        calls(("c1", "remember", {"text": "VIP"})), calls(("c2", "recall", {})), done("done")
    )
    program.agent("a", provider=provider, capabilities=("remember", "recall"), grants=("r", "w"))
    runtime = Runtime(program, resources=where.resources())
    result = await runtime.invoke("a", input="go", context=InvocationContext(user_id="ada"))
    assert result.status == "completed"
    observations = [dict(e.data) for e in result.trace.of_kind("observation")]
    assert [o["result"] for o in observations] == ["ok", "VIP"]
    item = await where.resources().get(HERE, "last")
    assert item is not None
    assert item.value == "VIP"


# -- durable bindings -------------------------------------------------------------------------


async def test_deleters_in_several_processes_have_exactly_one_winner(durable: Place) -> None:
    binding = durable.resources()
    count = 30
    for i in range(count):
        await binding.put(HERE, f"item-{i}", i)
    won = await race_in_processes(durable, "resources", count)
    every = [item for items in won for item in items]
    assert sorted(every) == sorted(f"item-{i}" for i in range(count))
    assert await binding.keys(HERE, prefix="", limit=100) == []


async def test_items_survive_reopening(durable: Place) -> None:
    binding = durable.resources()
    await binding.put(HERE, "A1", {"text": "VIP"})
    await binding.close()
    with pytest.raises(ConfigurationError, match="closed"):
        await binding.get(HERE, "A1")
    await binding.close()  # idempotent
    async with durable.resources() as reopened:
        item = await reopened.get(HERE, "A1")
        assert item is not None
        assert item.value == {"text": "VIP"}
    with pytest.raises(ConfigurationError, match="closed"):
        await reopened.put(HERE, "A1", 1)


# -- SQLite -----------------------------------------------------------------------------------


def _modes(path: Path) -> set[int]:
    files = [Path(str(path) + suffix) for suffix in ("", "-wal", "-shm", "-journal")]
    return {stat.S_IMODE(f.stat().st_mode) for f in files if f.exists()}


async def test_sqlite_binding_files_are_private(private_dir: Path) -> None:
    path = private_dir / "resources.db"
    async with SqliteResourceBinding(path) as binding:
        await binding.put(HERE, "A1", {"text": "VIP"})
    assert _modes(path) == {0o600}


def test_sqlite_binding_refuses_unsafe_places(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(DecisionHistoryStorageUnsafe, match="writable by group"):
        SqliteResourceBinding(shared / "resources.db")
    assert not (shared / "resources.db").exists()
    with pytest.raises(ConfigurationError, match="exactly one"):
        SqliteResourceBinding()


async def test_sqlite_binding_refuses_another_schema_version(private_dir: Path) -> None:
    path = private_dir / "resources.db"
    await SqliteResourceBinding(path).close()
    set_schema_version(path, "resource_schema_version", "99")
    with pytest.raises(ConfigurationError, match="version '99'"):
        SqliteResourceBinding(path)


# -- PostgreSQL -------------------------------------------------------------------------------


def _postgres() -> Any:
    from touba.runtime import PostgresResourceBinding

    return PostgresResourceBinding


@pytest.mark.parametrize("name", ["", "touba-resources", "a.b.c", 'x"; --', "t" * 49, None])
def test_postgres_unsafe_table_name_is_refused(name: Any) -> None:
    with pytest.raises(ConfigurationError, match="table must be a plain identifier"):
        _postgres()(DEFAULT_POSTGRES_DSN, table=name)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, "exactly one"),
        ({"pool": object()}, "pool must be a psycopg_pool.AsyncConnectionPool"),
        ({"dsn": "not a dsn"}, "not a valid PostgreSQL connection string"),
    ],
)
def test_postgres_misconfiguration_is_refused_at_construction(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        _postgres()(**options)


@pytest.mark.postgres
async def test_postgres_schema_is_versioned_and_refused_when_foreign_or_newer(pg: Place) -> None:
    dsn, table = pg.where
    await pg.resources().put(HERE, "k", 1)
    assert await postgres_sql(dsn, "SELECT name, value FROM {meta}", table) == [
        ("schema_version", "1")
    ]
    await postgres_sql(dsn, "UPDATE {meta} SET value = '2'", table)
    with pytest.raises(ConfigurationError, match="resource schema version '2'"):
        await pg.resources().open()
    await postgres_sql(dsn, "DROP TABLE {meta}", table)
    with pytest.raises(ConfigurationError, match="not a touba resource table"):
        await pg.resources().open()
    assert await postgres_sql(dsn, "SELECT key, value FROM {t}", table) == [("k", "1")]


@pytest.mark.postgres
async def test_postgres_nul_is_refused_before_writing(pg: Place) -> None:
    binding = pg.resources()
    for address, key in ((HERE, "a\x00"), (ResourceAddress("notes", "user", "a\x00"), "k")):
        with pytest.raises(ConfigurationError, match="NUL"):
            await binding.put(address, key, 1)
        assert await binding.get(address, key) is None
        assert await binding.delete(address, key) is False
    assert await binding.keys(HERE, prefix="a\x00", limit=10) == []
    assert await binding.keys(HERE, prefix="", limit=10) == []
    with pytest.raises(ConfigurationError, match="JSON"):
        await binding.put(HERE, "k", {"bad": object()})
    assert await binding.get(HERE, "k") is None


@pytest.mark.postgres
async def test_postgres_lost_connection_is_resource_binding_unavailable(pg: Place) -> None:
    import psycopg
    from psycopg.conninfo import make_conninfo

    dsn, table = pg.where
    application = f"touba-lost-{table}"
    binding = _postgres()(make_conninfo(dsn, application_name=application), table=table)
    pg.opened.append(binding)
    await binding.put(HERE, "k", 1)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (application,),
        )
    with pytest.raises(ResourceBindingUnavailable, match="PostgreSQL failed") as info:
        await binding.get(HERE, "k")
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert info.value.retryable
