"""Export then import with stores encrypted at rest: equal on each pair, plaintext never
written into an encrypted store, a token never read as plaintext.

The memory store's import primitives (sessions, turns, key events, their update
history, extraction jobs), the resource binding's ``scope_items`` / ``import_item`` and
the checkpoint store seal what they write for the row's new place, and open what they
read; a file exported from an encrypted store holds the plaintext (it is the user's
copy), and an import into an encrypted store holds none.
"""

from __future__ import annotations

import io
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

import touba
from tests.data._export_data import Deployment, export_bytes, populate, records_of
from touba.data import ImportReport, import_records
from touba.errors import DecisionHistoryRecordInvalid

PG = pytest.mark.postgres
K1 = touba.Encryption(keys={"k1": bytes(32)}, current="k1")
K2 = touba.Encryption(keys={"k2": bytes(range(32))}, current="k2")
KINDS_OF_RECORDS = {
    "session": 1,
    "turn": 3,
    "key_event": 2,
    "key_event_change": 2,
    "extraction_job": 1,
    "conversation": 2,
    "checkpoint": 1,
    "resource": 3,
}
# Plaintext that populate() writes into every sealed kind: a turn (and a resource value
# and a checkpoint), a key event's update, an extraction job's ops.
CONTENT = ("ünï", "\\u00fcn\\u00ef", "order 8", "From extraction", "lookup")


@pytest.fixture
async def deployments(tmp_path: Path) -> AsyncIterator[Callable[..., Deployment]]:
    made: list[Deployment] = []

    def make(kind: str, encryption: touba.Encryption | None) -> Deployment:
        made.append(Deployment(kind, "sqlite", tmp_path, encryption=encryption))
        return made[-1]

    yield make
    for deployment in made:
        await deployment.close()


def raw_rows(deployment: Deployment) -> list[str]:
    """Every row of the deployment's memory, checkpoint and resource tables, as text."""
    out: list[str] = []
    names = ["memory.db", "checkpoints.db"]
    if deployment.memory_kind == "sqlite":
        names.append("resources.db")
    for name in names:
        with closing(sqlite3.connect(deployment.dir / name)) as conn:
            tables = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            for (table,) in tables.fetchall():
                rows = conn.execute(f'SELECT * FROM "{table}"').fetchall()  # noqa: S608
                out.extend(f"{table}: {row!r}" for row in rows)
    pg = deployment._pg
    if pg is not None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(pg[0], autocommit=True) as conn:
            found = conn.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema() AND table_name LIKE %s",
                (f"{pg[1]}%",),
            ).fetchall()
            for (table,) in found:
                query = sql.SQL("SELECT t::text FROM {} t").format(sql.Identifier(table))
                out.extend(f"{table}: {r[0]}" for r in conn.execute(query).fetchall())
    return out


def plaintext_in(rows: list[str]) -> list[str]:
    return [r for r in rows if any(text in r for text in CONTENT)]


async def same_answers(a: Deployment, b: Deployment) -> None:
    """What the two stores answer for session s1 is equal (each read opens its rows)."""
    assert await b.memory.get_session("s1") == await a.memory.get_session("s1")
    assert await b.memory.list_turns("s1") == await a.memory.list_turns("s1")
    events = await a.memory.query_events("session:s1", include_closed=True)
    assert [e.id for e in await b.memory.query_events("session:s1", include_closed=True)] == [
        e.id for e in events
    ]
    for event in events:
        assert await b.memory.get_event(event.owner, event.id) == (
            await a.memory.get_event(event.owner, event.id)
        )
    assert await b.memory.list_jobs() == [
        j for j in await a.memory.list_jobs() if j.session_id == "s1"
    ]
    resources: Any = b.stores.resources
    origin: Any = a.stores.resources
    assert await resources.scope_items("session", "s1") == await origin.scope_items("session", "s1")
    checkpoints: Any = b.stores.checkpoints
    origin_checkpoints: Any = a.stores.checkpoints
    assert await checkpoints.get("cp-s1") == await origin_checkpoints.get("cp-s1")


PAIRS = [
    pytest.param(("sqlite", K1), ("sqlite", None), id="encrypted-sqlite->sqlite"),
    pytest.param(("sqlite", K1), ("postgres", None), id="encrypted-sqlite->pg", marks=PG),
    pytest.param(("sqlite", None), ("postgres", K1), id="sqlite->encrypted-pg", marks=PG),
    pytest.param(("postgres", None), ("sqlite", K2), id="pg->encrypted-sqlite", marks=PG),
    pytest.param(("sqlite", K1), ("postgres", K2), id="encrypted->encrypted-pg", marks=PG),
    pytest.param(("postgres", K2), ("sqlite", K1), id="encrypted-pg->encrypted", marks=PG),
]


@pytest.mark.parametrize(("source", "target"), PAIRS)
async def test_an_export_imported_between_encrypted_and_plain_stores_is_equal(
    deployments: Callable[..., Deployment], source: tuple[Any, Any], target: tuple[Any, Any]
) -> None:
    origin, destination = deployments(*source), deployments(*target)
    await populate(origin)
    if origin.encryption is not None:
        assert plaintext_in(raw_rows(origin)) == []
    exported = await export_bytes(origin.stores, session="s1")
    assert "ünï".encode() in exported or b"\\u00fc" in exported  # the user's copy: plaintext

    report = await import_records(destination.stores, io.BytesIO(exported))

    assert report == ImportReport(added=KINDS_OF_RECORDS, present={})
    assert records_of(await export_bytes(destination.stores, session="s1")) == records_of(exported)
    await same_answers(origin, destination)
    rows = raw_rows(destination)
    if destination.encryption is not None:
        assert plaintext_in(rows) == []
    else:
        assert plaintext_in(rows) != []  # the scan does see plaintext where there is some
    # Importing again changes nothing.
    again = await import_records(destination.stores, io.BytesIO(exported))
    assert again.added == {}
    assert sorted(raw_rows(destination)) == sorted(rows)


async def test_what_an_import_sealed_is_refused_by_a_store_opened_without_encryption(
    deployments: Callable[..., Deployment],
) -> None:
    """The imported rows are sealed (not plaintext that a plain store would read): the
    same files opened without ``encryption=`` refuse every kind."""
    from touba.memory import SqliteMemoryStore
    from touba.runtime import SqliteCheckpointStore, SqliteResourceBinding
    from touba.runtime._resources import ResourceAddress

    origin, destination = deployments("sqlite", None), deployments("sqlite", K1)
    await populate(origin)
    exported = await export_bytes(origin.stores, session="s1")
    await import_records(destination.stores, io.BytesIO(exported))

    async with SqliteMemoryStore(destination.dir / "memory.db") as memory:
        with pytest.raises(DecisionHistoryRecordInvalid):
            await memory.list_turns("s1")
        with pytest.raises(DecisionHistoryRecordInvalid):
            await memory.query_events("session:s1", include_closed=True)
        with pytest.raises(DecisionHistoryRecordInvalid):
            await memory.list_jobs()
    async with SqliteResourceBinding(destination.dir / "resources.db") as resources:
        with pytest.raises(DecisionHistoryRecordInvalid):
            await resources.scope_items("session", "s1")
        with pytest.raises(DecisionHistoryRecordInvalid):
            await resources.get(ResourceAddress("orders", "session", "s1"), "notes")
    async with SqliteCheckpointStore(destination.dir / "checkpoints.db") as checkpoints:
        with pytest.raises(DecisionHistoryRecordInvalid):
            await checkpoints.get("cp-s1")
