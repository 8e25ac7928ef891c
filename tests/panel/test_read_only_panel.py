"""``touba panel`` opens its stores as the read-only commands do.

Given its two SQLite files swapped, another application's file, a text file or a
missing file, it refuses to start (exit 1, one line saying what the file is) and
every file of the directory keeps its bytes and mode, with no side file added;
served over its right files, its pages change neither. PostgreSQL: a history
table given as the memory prefix is refused and no table is created.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlencode

import pytest

from tests.cli.conftest import Server
from tests.cli.conftest import pg as pg_schema  # noqa: F401 - a fixture, used by name
from tests.cli.test_read_only import (
    add_expired_conversation,
    add_foreign_files,
    snapshot,
    stored_keys,
)
from tests.panel._data import seed_memory
from tests.panel._serve import panel_env, serve
from tests.panel.test_cli_panel import request as get
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore


async def _stores(directory: Path) -> None:
    async with SqliteMemoryStore(directory / "memory.sqlite") as store:
        await seed_memory(store)
    async with SqliteHistoryStore(directory / "history.sqlite"):
        pass


@pytest.fixture
def files(private_dir: Path) -> Path:
    asyncio.run(_stores(private_dir))
    add_foreign_files(private_dir)
    return private_dir


def _panel(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``touba panel ARGS``, which must exit by itself (a refusal) within a minute."""
    command = [sys.executable, "-m", "touba.cli", "panel", "--program", "demo", *args]
    return subprocess.run(
        [*command, "--port", "0"],
        cwd=cwd,
        env=panel_env(COLUMNS="500"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


CASES = [
    (["--db", "history.sqlite", "--history-db", "memory.sqlite"], "not a memory store"),
    (["--db", "memory.sqlite", "--history-db", "memory.sqlite"], "not a history store"),
    (["--db", "app.sqlite"], "this SQLite file has no touba tables"),
    (["--db", "memory.sqlite", "--history-db", "app.sqlite"], "no touba tables"),
    (["--db", "notes.txt"], "this file is not a SQLite database"),
    (["--db", "memory.sqlite", "--history-db", "absent.sqlite"], "no history database at"),
    (["--db", "absent.sqlite"], "no memory database at"),
]


@pytest.mark.parametrize(("args", "message"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_the_panel_refuses_a_wrong_store_and_changes_no_file(
    files: Path, args: list[str], message: str
) -> None:
    before = snapshot(files)
    done = _panel(files, *args)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert message in lines[0]
    assert done.stdout == ""  # no token URL: it never served
    assert snapshot(files) == before


def test_the_panel_swapped_stores_say_which_option_was_meant(files: Path) -> None:
    swapped = _panel(files, "--db", "history.sqlite", "--history-db", "memory.sqlite")
    assert "did you mean --history-db?" in swapped.stderr
    history_as_memory = _panel(files, "--db", "memory.sqlite", "--history-db", "memory.sqlite")
    assert "did you mean --db" in history_as_memory.stderr


def test_pages_served_over_the_right_stores_change_neither(files: Path) -> None:
    before = snapshot(files)
    args = ["--db", "memory.sqlite", "--history-db", "history.sqlite", "--program", "demo"]
    with serve(args, files) as served:
        login = get(served.base, "/?" + served.login.split("?", 1)[1])
        cookie = login.getheader("set-cookie", "").split(";", 1)[0]
        for page in ("/", "/users", "/jobs"):
            assert get(served.base, page, cookie).status == 200, page
    assert snapshot(files) == before


def test_history_pages_leave_an_expired_conversation_stored(files: Path) -> None:
    key = add_expired_conversation(files / "history.sqlite")
    before = snapshot(files)
    args = ["--db", "memory.sqlite", "--history-db", "history.sqlite", "--program", "demo"]
    with serve(args, files) as served:
        login = get(served.base, "/?" + served.login.split("?", 1)[1])
        cookie = login.getheader("set-cookie", "").split(";", 1)[0]
        for page in ("/", "/conversations"):
            assert get(served.base, page, cookie).status == 200, page
        shown = get(served.base, "/conversation?" + urlencode({"key": key}), cookie)
        assert shown.status == 404  # expired: not shown, and not purged either
    assert snapshot(files) == before
    assert stored_keys(files / "history.sqlite") == [key]


@pytest.mark.postgres
def test_the_panel_refuses_a_postgres_history_table_as_its_memory_store(
    request: pytest.FixtureRequest, files: Path
) -> None:
    import psycopg

    pg: Server = request.getfixturevalue("pg_schema")
    from touba.history.postgres import PostgresHistoryStore

    async def make() -> None:
        async with PostgresHistoryStore(pg.address):
            pass

    asyncio.run(make())
    done = _panel(files, "--dsn", pg.address, "--prefix", "touba_history")
    assert done.returncode == 1, done.stderr
    assert "a touba history store, not a memory store" in done.stderr.replace("\n", "")
    assert pg.password not in done.stderr
    with psycopg.connect(pg.address) as conn:
        found = conn.execute("SELECT to_regclass('touba_history_sessions')").fetchone()
    assert found == (None,)
