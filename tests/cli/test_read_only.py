"""Commands refuse a store of the wrong kind, and the read commands change nothing.

Each command is run on a file of the other kind, on another application's SQLite
file (mode 0644), on a file that is not a database and on a missing one: it exits
1 with one line saying what the file is, and every file of the directory keeps its
bytes and mode, with no ``-wal``/``-shm``/``-journal`` file added. PostgreSQL: a
memory prefix given to ``touba history`` and a history table given to ``touba
events`` are refused the same way, and no table is created.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tests.cli.conftest import Server
from touba.cli._app import app
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore
from touba.testing._conformance_base import messages, save_record, touba_record

runner = CliRunner()
WORKER = "tests.cli.test_events_cli:worker_program"
HISTORY_READS = (["history", "ls"], ["history", "show", "k"])
HISTORY_WRITES = (
    ["history", "rm", "k"],
    ["history", "recover", "k", "--worker-stopped"],
    ["history", "purge"],
)
MEMORY_READS = (["events", "ls", "-u", "a"], ["events", "show", "ke_x"], ["events", "jobs"])
MEMORY_WRITES = (
    ["events", "requeue", "j"],
    ["worker", "--once", "-p", WORKER],
    ["chat", "--program", "demo", "--agent", "support"],
)
Snapshot = dict[str, tuple[str, int]]


def snapshot(directory: Path) -> Snapshot:
    """Every file of ``directory``: its sha256 and its mode."""
    return {
        path.name: (hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_mode)
        for path in sorted(directory.iterdir())
    }


async def _stores(directory: Path) -> None:
    async with SqliteHistoryStore(directory / "history.sqlite"):
        pass
    async with SqliteMemoryStore(directory / "memory.sqlite"):
        pass
    async with (
        SqliteHistoryStore(directory / "both.sqlite"),
        SqliteMemoryStore(directory / "both.sqlite"),
    ):
        pass


@pytest.fixture
def files(private_dir: Path) -> Path:
    """A history file, a memory file, one holding both, another application's SQLite
    file (0644) and a text file (0644)."""
    asyncio.run(_stores(private_dir))
    add_foreign_files(private_dir)
    return private_dir


def add_foreign_files(directory: Path) -> None:
    """``app.sqlite``, another application's database, and ``notes.txt``, both 0644."""
    with closing(sqlite3.connect(directory / "app.sqlite")) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL)")
        conn.execute("INSERT INTO orders (total) VALUES (9.5)")
        conn.commit()
    (directory / "notes.txt").write_text("not a database\n")
    for name in ("app.sqlite", "notes.txt"):
        os.chmod(directory / name, 0o644)


def run_on(directory: Path, command: list[str], db: str) -> tuple[Result, Snapshot]:
    """``command --db directory/db``; the result and the directory's snapshot after."""
    result = runner.invoke(app, [*command, "--db", str(directory / db)], input="")
    return result, snapshot(directory)


def refused(directory: Path, command: list[str], db: str, message: str) -> None:
    """``command`` on ``db`` exits 1 with ``message`` in one line, changing no file."""
    before = snapshot(directory)
    result, after = run_on(directory, command, db)
    assert result.exit_code == 1, (command, result.output)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert message in lines[0], (command, result.output)
    assert after == before, command


@pytest.mark.parametrize("command", [*HISTORY_READS, *HISTORY_WRITES], ids=" ".join)
def test_history_commands_refuse_a_memory_file(files: Path, command: list[str]) -> None:
    message = "this file holds a touba memory store, not a history store: did you mean"
    refused(files, command, "memory.sqlite", message)


@pytest.mark.parametrize("command", [*MEMORY_READS, *MEMORY_WRITES], ids=" ".join)
def test_memory_commands_refuse_a_history_file(files: Path, command: list[str]) -> None:
    message = "this file holds a touba history store, not a memory store: did you mean"
    refused(files, command, "history.sqlite", message)


ALL = [*HISTORY_READS, *HISTORY_WRITES, *MEMORY_READS, *MEMORY_WRITES]


@pytest.mark.parametrize("command", ALL, ids=" ".join)
def test_every_command_refuses_another_applications_file(files: Path, command: list[str]) -> None:
    refused(files, command, "app.sqlite", "this SQLite file has no touba tables")
    refused(files, command, "notes.txt", "this file is not a SQLite database")


@pytest.mark.parametrize("command", [c for c in ALL if c[0] != "chat"], ids=" ".join)
def test_every_command_refuses_a_missing_file(files: Path, command: list[str]) -> None:
    kind = "history" if command[0] == "history" else "memory"
    refused(files, command, "absent.sqlite", f"no {kind} database at")
    assert not (files / "absent.sqlite").exists()


def test_chat_still_creates_a_new_memory_file_and_says_so(files: Path) -> None:
    command = ["chat", "--program", "demo", "--agent", "support"]
    result, _ = run_on(files, command, "new.sqlite")
    assert result.exit_code == 0, result.output
    assert "memory_schema_version" in _meta(files / "new.sqlite")
    assert f"created memory store at {files / 'new.sqlite'}" in result.stderr.replace("\n", "")
    again, _ = run_on(files, command, "new.sqlite")
    assert again.exit_code == 0, again.output
    assert "created memory store" not in again.stderr


def _meta(path: Path) -> dict[str, str]:
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return dict(conn.execute("SELECT name, value FROM touba_meta").fetchall())


@pytest.mark.parametrize("command", [*HISTORY_READS, *MEMORY_READS], ids=" ".join)
def test_read_commands_change_nothing_in_a_store_of_their_kind(
    files: Path, command: list[str]
) -> None:
    own = "history.sqlite" if command[0] == "history" else "memory.sqlite"
    for db in (own, "both.sqlite"):
        before = snapshot(files)
        result, after = run_on(files, command, db)
        assert result.exit_code in (0, 1), result.output  # 1: no such key, event or job
        assert "this file" not in result.output, result.output  # not refused
        assert after == before, (command, db)


def add_expired_conversation(path: Path) -> str:
    """Save a conversation in the history file ``path`` that expires at once; its key."""
    key, record = touba_record("expired-ns", [messages(1)])

    async def save() -> None:
        async with SqliteHistoryStore(path, ttl_seconds=0.2) as store:
            await save_record(store, key, record)

    asyncio.run(save())
    time.sleep(0.3)
    return key


def stored_keys(path: Path) -> list[str]:
    """The keys of every row of the history file ``path``, expired ones included."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return [str(r[0]) for r in conn.execute("SELECT key FROM touba_history_sessions")]


def test_history_ls_and_show_leave_an_expired_conversation_stored(files: Path) -> None:
    key = add_expired_conversation(files / "history.sqlite")
    before = snapshot(files)
    listed, after = run_on(files, ["history", "ls"], "history.sqlite")
    assert listed.exit_code == 0, listed.output
    assert "0 conversation(s)" in listed.output
    assert "1 expired conversation(s) still stored" in listed.output
    assert after == before
    shown, after = run_on(files, ["history", "show", key], "history.sqlite")
    assert shown.exit_code == 1, shown.output  # expired: not shown, and not purged
    assert "absent or expired" in shown.output
    assert after == before
    assert stored_keys(files / "history.sqlite") == [key]
    raw, _ = run_on(files, ["history", "ls", "--json"], "history.sqlite")
    assert '"expired": 1' in raw.output


def test_read_commands_refuse_what_opening_would_chmod_or_migrate(files: Path) -> None:
    os.chmod(files / "history.sqlite", 0o644)
    refused(files, ["history", "ls"], "history.sqlite", "(mode 644)")
    os.chmod(files / "history.sqlite", 0o600)
    with closing(sqlite3.connect(files / "memory.sqlite")) as conn:
        conn.execute("UPDATE touba_meta SET value = '1' WHERE name = 'memory_schema_version'")
        conn.commit()
    refused(files, ["events", "jobs"], "memory.sqlite", "memory schema version 1")


# -- PostgreSQL -------------------------------------------------------------------------


def _pg_tables(pg: Server) -> list[str]:
    import psycopg

    with psycopg.connect(pg.address) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (pg.place,)
        ).fetchall()
    return [str(row[0]) for row in rows]


async def _pg_stores(pg: Server) -> None:
    from touba.history.postgres import PostgresHistoryStore
    from touba.memory.postgres import PostgresMemoryStore

    async with PostgresHistoryStore(pg.address), PostgresMemoryStore(pg.address):
        pass


def _pg_refused(pg: Server, command: list[str], message: str) -> None:
    before = _pg_tables(pg)
    result = runner.invoke(app, [*command, "--dsn", pg.address], input="")
    assert result.exit_code == 1, (command, result.output)
    assert message in result.output.replace("\n", ""), (command, result.output)
    assert pg.password not in result.output.replace("\n", "")
    assert _pg_tables(pg) == before


@pytest.mark.postgres
def test_postgres_stores_of_the_other_kind_are_refused(pg: Server) -> None:
    import psycopg

    asyncio.run(_pg_stores(pg))
    with psycopg.connect(pg.address) as conn:
        conn.execute("CREATE TABLE app_orders (id integer PRIMARY KEY)")
    for command in [*HISTORY_READS, *HISTORY_WRITES]:
        _pg_refused(pg, [*command, "--table", "touba_memory"], "a touba memory store, not a")
        _pg_refused(pg, [*command, "--table", "app_orders"], "this table is not touba's")
    for command in [*MEMORY_READS, *MEMORY_WRITES[:2]]:
        _pg_refused(pg, [*command, "--prefix", "touba_history"], "a touba history store, not a")
    chat = [*MEMORY_WRITES[2], "--prefix", "touba_history"]
    _pg_refused(pg, chat, "a touba history store, not a memory store")


@pytest.mark.postgres
def test_chat_says_when_it_creates_its_postgres_memory_store(pg: Server) -> None:
    command = ["chat", "--program", "demo", "--agent", "support", "--dsn", pg.address]
    first = runner.invoke(app, command, input="")
    assert first.exit_code == 0, first.output
    assert "created memory store at" in first.stderr
    assert "(tables touba_memory_*)" in first.stderr.replace("\n", "")
    assert pg.password not in first.stderr
    assert "touba_memory_sessions" in _pg_tables(pg)
    again = runner.invoke(app, command, input="")
    assert again.exit_code == 0, again.output
    assert "created memory store" not in again.stderr
