"""``touba check``: a diagnosis of the stores given, reading only.

Every kind of input (the right stores, the other kind, another application's
SQLite file, a text file, a missing file, a file readable by others, an older
schema version) gets its facts and, when something needs action, its problem
with the fix, exit 1; no file of the directory changes its bytes or mode and
none is added. A reservation left by a dead worker of this host is a problem
(with the ``touba history recover`` command); an expired conversation a note.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from tests.cli.conftest import Server
from tests.cli.test_read_only import add_expired_conversation, snapshot, stored_keys
from tests.cli.test_read_only import files as files  # a fixture, used by name
from touba.cli._app import app

runner = CliRunner()


def check(directory: Path, *args: str) -> tuple[Result, dict[str, Any]]:
    """``touba check ARGS --json`` in ``directory``: the result and its JSON."""
    old = os.getcwd()
    os.chdir(directory)
    try:
        result = runner.invoke(app, ["check", *args, "--json"])
    finally:
        os.chdir(old)
    return result, json.loads(result.stdout)


def test_healthy_stores_exit_0_with_their_facts(files: Path) -> None:
    before = snapshot(files)
    result, data = check(files, "--db", "memory.sqlite", "--history-db", "history.sqlite")
    assert result.exit_code == 0, result.output
    assert data["healthy"] is True
    memory, history = data["stores"]
    assert memory["store"] == "memory"
    assert memory["holds"] == {"memory": str(memory["current_schema_version"])}
    assert memory["opening_migrates"] is False
    assert memory["mode"] == "600"
    assert memory["unsafe_mode"] is False
    assert memory["sessions"] == 0
    assert history["conversations"] == 0
    assert history["reserved"] == []
    assert snapshot(files) == before
    text = runner.invoke(app, ["check", "--history-db", str(files / "history.sqlite")])
    assert text.exit_code == 0
    assert "(SQLite): healthy" in text.output
    assert "holds: touba history store (schema" in text.output


def _old_memory(directory: Path) -> None:
    with closing(sqlite3.connect(directory / "memory.sqlite")) as conn:
        conn.execute("UPDATE touba_meta SET value = '1' WHERE name = 'memory_schema_version'")
        conn.commit()


CASES: list[tuple[str, list[str], str, str]] = [
    (
        "history as memory",
        ["--db", "history.sqlite"],
        "holds a touba history store",
        "--history-db",
    ),
    ("memory as history", ["--history-db", "memory.sqlite"], "not a history store", "--db"),
    ("foreign", ["--history-db", "app.sqlite"], "no touba tables", "check --history-db"),
    ("text", ["--db", "notes.txt"], "not a SQLite database", "check --db"),
    ("missing", ["--db", "absent.sqlite"], "no file at absent.sqlite", "touba chat"),
    ("unsafe mode", ["--history-db", "history.sqlite"], "(mode 644)", "chmod 600"),
    ("old version", ["--db", "memory.sqlite"], "opening it migrates it", "touba chat --db"),
]


@pytest.mark.parametrize(("case", "args", "problem", "fix"), CASES, ids=[c[0] for c in CASES])
def test_each_problem_exits_1_with_its_fix_and_changes_nothing(
    files: Path, case: str, args: list[str], problem: str, fix: str
) -> None:
    if case == "unsafe mode":
        os.chmod(files / "history.sqlite", 0o644)
    if case == "old version":
        _old_memory(files)
    before = snapshot(files)
    result, data = check(files, *args)
    assert result.exit_code == 1, result.output
    assert data["healthy"] is False
    (store,) = data["stores"]
    assert any(problem in p["problem"] and fix in p["fix"] for p in store["problems"]), store
    assert snapshot(files) == before
    assert not (files / "absent.sqlite").exists()
    if case == "old version":
        assert store["opening_migrates"] is True
    if case == "foreign":  # another application's file: its mode 644 is not ours to fix
        assert store["unsafe_mode"] is True
        assert not any("chmod" in p["fix"] for p in store["problems"])


def test_usage_errors_exit_2(files: Path) -> None:
    assert runner.invoke(app, ["check"]).exit_code == 2
    both = ["check", "--history-db", "h", "--redis-url", "redis://x"]
    assert runner.invoke(app, both).exit_code == 2
    assert runner.invoke(app, ["check", "--db", "m", "--prefix", "p"]).exit_code == 2


_CRASH = """
import asyncio, os, sys
from touba.history.sqlite import SqliteHistoryStore

async def main():
    store = SqliteHistoryStore(sys.argv[1])
    async def hold(record):
        os._exit(0)  # the worker dies holding the reservation
    await store.transact("held-key", hold)

asyncio.run(main())
"""


def test_a_dead_workers_reservation_needs_recover_and_expired_ones_are_noted(
    files: Path,
) -> None:
    history = files / "history.sqlite"
    subprocess.run([sys.executable, "-c", _CRASH, str(history)], check=True, timeout=60)
    expired = add_expired_conversation(history)  # after: the worker's reservation purged
    before = snapshot(files)
    result, data = check(files, "--history-db", "history.sqlite")
    assert result.exit_code == 1, result.output
    (store,) = data["stores"]
    assert store["expired_waiting_for_purge"] == 1
    assert [r["key"] for r in store["reserved"]] == ["held-key"]
    (problem,) = store["problems"]
    assert "no longer running" in problem["problem"]
    assert problem["fix"] == "touba history recover held-key --db history.sqlite --worker-stopped"
    assert any("touba history purge --db history.sqlite" in n for n in store["notes"])
    assert snapshot(files) == before
    assert sorted(stored_keys(history)) == sorted([expired, "held-key"])


# -- PostgreSQL and Redis ----------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_stores_are_diagnosed_and_no_table_is_created(pg: Server) -> None:
    from tests.cli.test_read_only import _pg_stores, _pg_tables

    missing = runner.invoke(app, ["check", "--history-dsn", pg.address, "--json"])
    assert missing.exit_code == 1, missing.output
    assert "there is no touba history store" in missing.stdout
    assert _pg_tables(pg) == []
    asyncio.run(_pg_stores(pg))
    before = _pg_tables(pg)
    good = ["check", "--dsn", pg.address, "--history-dsn", pg.address, "--json"]
    result = runner.invoke(app, good)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [s["healthy"] for s in data["stores"]] == [True, True]
    assert pg.password not in result.stdout
    wrong = ["check", "--dsn", pg.address, "--prefix", "touba_history", "--json"]
    refused = runner.invoke(app, wrong)
    assert refused.exit_code == 1
    assert "holds a touba history store, not a memory store" in refused.stdout
    assert _pg_tables(pg) == before


@pytest.mark.redis
def test_redis_prefix_holding_nothing_needs_action(redis: Server) -> None:
    empty = runner.invoke(
        app, ["check", "--redis-url", redis.address, "--history-prefix", redis.place]
    )
    assert empty.exit_code == 1
    assert "nothing is stored under the prefix" in empty.output.replace("\n", "")
    assert redis.password not in empty.output

    async def save() -> None:
        from touba.history.redis import RedisHistoryStore
        from touba.testing._conformance_base import messages, save_record, touba_record

        key, record = touba_record(f"ns-{uuid.uuid4().hex[:6]}", [messages(1)])
        async with RedisHistoryStore(redis.address, prefix=redis.place) as store:
            await save_record(store, key, record)

    asyncio.run(save())
    args = ["check", "--redis-url", redis.address, "--history-prefix", redis.place, "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stores"][0]["conversations"] == 1
