"""`touba agents settings show|history|reset AGENT` on SQLite and PostgreSQL.

``show`` and ``history`` only read (a store of the wrong kind, a foreign or missing
file is refused and no byte or mode changes); ``reset`` asks first unless ``--yes``
and records its actor (``cli`` or ``--actor``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from tests.cli.conftest import Server
from tests.cli.test_read_only import _stores, add_foreign_files, refused, run_on, snapshot
from touba.cli._agents import describe
from touba.cli._app import app
from touba.memory import KeyEventsConfig, MemoryConfig, MemoryConfigChange, SqliteMemoryStore
from touba.runtime import Program
from touba.testing import ScriptedProvider

runner = CliRunner()
ONE = MemoryConfig(short_term_turns=1, full_context_turns=0)
TWO = MemoryConfig(short_term_turns=2, key_events=KeyEventsConfig(enabled=True, types=("a",)))
READS = (["agents", "settings", "show", "support"], ["agents", "settings", "history", "support"])
RESET = ["agents", "settings", "reset", "support"]


def bare_program() -> Program:
    """A program whose agent gives no MemoryConfig (``--program`` loads it)."""
    program = Program()
    program.agent("plain", provider=ScriptedProvider())
    return program


def invoke(*args: str, code: int = 0, input: str | None = None, **env: str) -> Result:
    result = runner.invoke(app, list(args), input=input, env={"COLUMNS": "300", **env})
    assert result.exit_code == code, result.output
    return result


@pytest.fixture
def db(private_dir: Path) -> Path:
    return private_dir / "memory.sqlite"


async def _save(store: Any, *changes: tuple[MemoryConfig, str]) -> None:
    async with store:
        for config, actor in changes:
            await store.save_memory_config("support", config, actor=actor)


async def _read(store: Any) -> tuple[MemoryConfig | None, list[MemoryConfigChange]]:
    async with store:
        saved = await store.load_memory_config("support")
        return saved, await store.memory_config_history("support", limit=100)


def test_show_says_where_the_settings_come_from(db: Path) -> None:
    asyncio.run(_save(SqliteMemoryStore(db)))  # an empty store
    nothing = invoke("agents", "settings", "show", "support", "--db", str(db)).output
    assert "nothing saved" in nothing
    assert "Give --program module:attr" in nothing
    raw = json.loads(
        invoke("agents", "settings", "show", "support", "--db", str(db), "--json").output
    )
    assert (raw["source"], raw["config"], raw["program_config"]) == (None, None, None)
    program = invoke("agents", "settings", "show", "support", "--db", str(db), "-p", "demo").output
    assert "the program's MemoryConfig (nothing saved)" in program
    assert "short-term 30 turns · full context 1 turn · key events on: refund" in program
    asyncio.run(_save(SqliteMemoryStore(db), (ONE, "operator")))
    saved = invoke("agents", "settings", "show", "support", "--db", str(db), "-p", "demo").output
    assert "saved in the panel (operator) at 20" in saved
    assert "+00:00; they win over the program's" in saved
    assert f"settings: {describe(ONE)}" in saved
    assert "program's settings (not in effect): short-term 30 turns" in saved
    raw = json.loads(
        invoke("agents", "settings", "show", "support", "--db", str(db), "--json").output
    )
    assert raw["source"] == "saved"
    assert raw["saved_by"] == "operator"
    assert raw["config"]["short_term_turns"] == 1
    assert raw["saved_at"].endswith("+00:00")
    bare = "tests.cli.test_agents_settings_cli:bare_program"
    defaults = invoke("agents", "settings", "show", "plain", "--db", str(db), "-p", bare).output
    assert "the defaults (the program gives no MemoryConfig, and nothing is saved)" in defaults
    assert f"settings: {describe(MemoryConfig())}" in defaults
    unknown = invoke("agents", "settings", "show", "nobody", "--db", str(db), "-p", "demo", code=1)
    assert "no agent named nobody" in unknown.output


def test_history_lists_every_change_newest_first(db: Path) -> None:
    asyncio.run(_save(SqliteMemoryStore(db), (ONE, "operator"), (TWO, "deploy-bot")))
    listed = invoke("agents", "settings", "history", "support", "--db", str(db)).output
    lines = [line for line in listed.splitlines() if "deploy-bot" in line or "operator" in line]
    assert "deploy-bot" in lines[0]
    assert describe(ONE) in lines[0]
    assert describe(TWO) in lines[0]
    assert "operator" in lines[1]
    assert "nothing saved (the program's)" in lines[1]
    assert "2 change(s), newest first" in listed
    raw = json.loads(
        invoke("agents", "settings", "history", "support", "--db", str(db), "--json").output
    )
    assert [c["actor"] for c in raw["changes"]] == ["deploy-bot", "operator"]
    assert raw["changes"][1]["before"] is None
    assert raw["changes"][0]["after"]["key_events"] == {"enabled": True, "types": ["a"]}
    limited = invoke("agents", "settings", "history", "support", "--db", str(db), "--limit", "1")
    assert "1 change(s)" in limited.output


def test_reset_asks_first_and_records_the_cli_as_its_actor(db: Path) -> None:
    asyncio.run(_save(SqliteMemoryStore(db), (ONE, "operator")))
    for answer in ("n\n", "\n"):
        declined = invoke(*RESET, "--db", str(db), input=answer, code=1)
        assert "nothing done" in declined.output
    assert asyncio.run(_read(SqliteMemoryStore(db)))[0] == ONE
    done = invoke(*RESET, "--db", str(db), input="y\n").output
    assert "the settings saved for support were deleted" in done
    saved, history = asyncio.run(_read(SqliteMemoryStore(db)))
    assert saved is None
    assert (history[0].actor, history[0].before, history[0].after) == ("cli", ONE, None)
    again = invoke(*RESET, "--db", str(db), "--yes").output
    assert "nothing to reset" in again
    assert len(asyncio.run(_read(SqliteMemoryStore(db)))[1]) == 2


def test_reset_with_yes_and_an_actor_and_a_bad_actor(db: Path) -> None:
    asyncio.run(_save(SqliteMemoryStore(db), (ONE, "operator")))
    before = snapshot(db.parent)
    for bad in ("", "x" * 65, "a\tb"):
        refused_actor = invoke(*RESET, "--db", str(db), "--yes", "--actor", bad, code=2)
        assert "--actor" in refused_actor.output
    assert snapshot(db.parent) == before
    invoke(*RESET, "--db", str(db), "-y", "--actor", "alice@ops")
    saved, history = asyncio.run(_read(SqliteMemoryStore(db)))
    assert saved is None
    assert history[0].actor == "alice@ops"


# -- only reading, and the wrong kind of store ------------------------------------------------


@pytest.fixture
def files(private_dir: Path) -> Path:
    asyncio.run(_stores(private_dir))
    add_foreign_files(private_dir)
    return private_dir


@pytest.mark.parametrize("command", [*READS, [*RESET, "--yes"]], ids=" ".join)
def test_the_wrong_kind_a_foreign_or_a_missing_file_is_refused_unchanged(
    files: Path, command: list[str]
) -> None:
    message = "this file holds a touba history store, not a memory store: did you mean"
    refused(files, command, "history.sqlite", message)
    refused(files, command, "app.sqlite", "this SQLite file has no touba tables")
    refused(files, command, "notes.txt", "this file is not a SQLite database")
    refused(files, command, "absent.sqlite", "no memory database at")
    assert not (files / "absent.sqlite").exists()


@pytest.mark.parametrize("command", READS, ids=" ".join)
def test_show_and_history_change_nothing(files: Path, command: list[str]) -> None:
    asyncio.run(_save(SqliteMemoryStore(files / "memory.sqlite"), (ONE, "operator")))
    for db in ("memory.sqlite", "both.sqlite"):
        before = snapshot(files)
        result, after = run_on(files, command, db)
        assert result.exit_code == 0, result.output
        assert after == before, (command, db)
    os.chmod(files / "memory.sqlite", 0o644)
    refused(files, command, "memory.sqlite", "(mode 644)")
    os.chmod(files / "memory.sqlite", 0o600)
    with closing(sqlite3.connect(files / "memory.sqlite")) as conn:
        conn.execute("UPDATE touba_meta SET value = '2' WHERE name = 'memory_schema_version'")
        conn.commit()
    refused(files, command, "memory.sqlite", "memory schema version 2")


# -- PostgreSQL ---------------------------------------------------------------------------------


def _pg(pg: Server, prefix: str = "touba_memory") -> Any:
    from touba.memory.postgres import PostgresMemoryStore

    return PostgresMemoryStore(pg.address, prefix=prefix)


def _no_password(pg: Server, result: Result) -> Result:
    for text in (result.output, result.stdout, result.stderr):
        assert pg.password not in text.replace("\n", "")
    return result


@pytest.mark.postgres
def test_show_history_and_reset_on_postgres(pg: Server) -> None:
    prefix = f"{pg.place}.app_memory"
    store = ["--dsn", pg.address, "--prefix", prefix]
    asyncio.run(_save(_pg(pg, prefix), (ONE, "operator"), (TWO, "api")))
    shown = _no_password(pg, invoke("agents", "settings", "show", "support", *store))
    assert "saved by api at" in shown.output
    listed = _no_password(pg, invoke("agents", "settings", "history", "support", *store))
    assert "2 change(s)" in listed.output
    _no_password(pg, invoke(*RESET, *store, "--yes"))
    saved, history = asyncio.run(_read(_pg(pg, prefix)))
    assert saved is None
    assert [c.actor for c in history] == ["cli", "api", "operator"]
    from_env = invoke(
        "agents", "settings", "show", "support", "--prefix", prefix, TOUBA_DSN=pg.address
    )
    assert "nothing saved" in _no_password(pg, from_env).output


@pytest.mark.postgres
def test_no_postgres_tables_are_created(pg: Server) -> None:
    import psycopg

    for command in (*READS, [*RESET, "--yes"]):
        missing = _no_password(pg, invoke(*command, "--dsn", pg.address, code=1))
        assert "no touba memory tables with prefix 'touba_memory'" in missing.output
    with psycopg.connect(pg.address) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (pg.place,)
        ).fetchone()
    assert found == (0,)
