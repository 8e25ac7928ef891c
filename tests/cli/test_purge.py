"""`touba purge` and `touba worker`'s retention, on SQLite stores with data at known ages."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.cli.conftest import Server
from touba.cli._app import app
from touba.memory import SqliteMemoryStore
from touba.runtime import Program, SqliteCheckpointStore

runner = CliRunner()


def empty_program() -> Program:
    """The program `touba worker --program tests.cli.test_purge:empty_program` loads."""
    return Program()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    return directory


def invoke(*args: str) -> str:
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


class _Clock:
    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


async def _seed(state: Path) -> None:
    """Thirty-day-old turns, a closed event and an ended session; a one-day-old turn; an
    old failed checkpoint, an old running one and a young one."""
    now = datetime.now(UTC)
    clock = _Clock(now - timedelta(days=30))
    async with SqliteMemoryStore(state / "memory.db", clock=clock) as store:
        await store.open_session("old", owner="user:u", agent_ref="a", mode="live")
        await store.append_turn("old", user="old words", replies=["r"])
        await store.append_turn("old", user="more old words", replies=["r"])
        await store.end_session("old")
        event = await store.create_event(
            owner="user:u", type="t", title="old case", details="", session_id="old"
        )
        await store.update_event("user:u", event.id, {"status": "closed"}, session_id="old")
        clock.at = now - timedelta(days=1)
        await store.open_session("new", owner="user:u", agent_ref="a", mode="live")
        await store.append_turn("new", user="new words", replies=["r"])
    async with SqliteCheckpointStore(state / "checkpoints.db") as checkpoints:
        await checkpoints.save("old-failed", {"status": "failed"})
        await checkpoints.save("old-running", {"status": "running"})
        await checkpoints.save("young", {})
    with closing(sqlite3.connect(state / "checkpoints.db")) as conn, conn:
        old = (now - timedelta(days=30)).isoformat()
        conn.execute(
            "UPDATE touba_checkpoints SET created_at = ?, updated_at = ? WHERE id LIKE 'old-%'",
            (old, old),
        )


def _rows(path: Path, table: str) -> int:
    with closing(sqlite3.connect(path)) as conn:
        return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])  # noqa: S608


def _counts(state: Path) -> tuple[int, int, int, int]:
    memory = state / "memory.db"
    return (
        _rows(memory, "touba_memory_turns"),
        _rows(memory, "touba_memory_sessions"),
        _rows(memory, "touba_memory_events"),
        _rows(state / "checkpoints.db", "touba_checkpoints"),
    )


def test_purge_dry_run_counts_and_deletes_nothing_then_purge_deletes_exactly_that(
    state: Path,
) -> None:
    asyncio.run(_seed(state))
    where = ["--db", str(state / "memory.db"), "--checkpoints-db", str(state / "checkpoints.db")]
    bounds = ["--turns-days", "7", "--events-closed-days", "7", "--checkpoints-days", "7"]
    before = _counts(state)
    assert before == (3, 2, 1, 3)
    dry = invoke("purge", *where, *bounds, "--dry-run")
    assert "would remove" in dry
    assert "dry run: 6 would be removed; nothing was deleted" in dry
    assert _counts(state) == before
    as_json = json.loads(invoke("purge", *where, *bounds, "--dry-run", "--json"))
    assert as_json["dry_run"] is True
    assert as_json["counts"] == {
        "memory": {
            "turns": 2,
            "sessions": 1,
            "extraction_jobs": 0,
            "key_events": 1,
            "key_event_updates": 1,
        },
        "checkpoints": {"checkpoints": 1},
    }
    done = invoke("purge", *where, *bounds)
    assert "removed 6 in all" in done
    for line in ("chat turns", "ended sessions left empty", "closed key events"):
        assert line in done
    assert _counts(state) == (1, 1, 0, 2)
    # no content in the output
    assert "old words" not in dry + done
    assert "old case" not in dry + done
    again = json.loads(invoke("purge", *where, *bounds, "--json"))
    assert again["total"] == 0


def test_purge_without_bounds_changes_nothing(state: Path) -> None:
    asyncio.run(_seed(state))
    before = _counts(state)
    out = invoke("purge", "--db", str(state / "memory.db"))
    assert "removed 0 in all" in out
    assert _counts(state) == before


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_a_bad_bound_is_a_usage_error(state: Path, bad: str) -> None:
    asyncio.run(_seed(state))
    result = runner.invoke(app, ["purge", "--db", str(state / "memory.db"), "--turns-days", bad])
    assert result.exit_code == 2, result.output
    assert "--turns-days" in result.output
    assert _counts(state)[0] == 3


def test_purge_needs_a_store_and_never_creates_one(state: Path) -> None:
    result = runner.invoke(app, ["purge", "--turns-days", "1"])
    assert result.exit_code == 2
    missing = state / "missing.db"
    result = runner.invoke(app, ["purge", "--db", str(missing), "--turns-days", "1"])
    assert result.exit_code == 1
    assert not missing.exists()


def test_the_worker_applies_its_retention_and_reports_counts(state: Path) -> None:
    asyncio.run(_seed(state))
    program = "tests.cli.test_purge:empty_program"
    out = invoke(
        "worker",
        "--db",
        str(state / "memory.db"),
        "--once",
        "--program",
        program,
        "--turns-days",
        "7",
        "--checkpoints-days",
        "7",
        "--checkpoints-db",
        str(state / "checkpoints.db"),
    )
    assert "retention: 4 removed" in out
    assert "memory turns 2" in out
    assert "checkpoints checkpoints 1" in out
    assert _counts(state) == (1, 1, 1, 2)
    result = runner.invoke(
        app,
        [
            "worker",
            "--db",
            str(state / "memory.db"),
            "--once",
            "--program",
            program,
            "--checkpoints-days",
            "7",
        ],
    )
    assert result.exit_code == 2
    assert "--checkpoints-db" in result.output


@pytest.mark.postgres
def test_purge_on_postgresql_memory_and_checkpoints(pg: Server) -> None:
    from touba.memory.postgres import PostgresMemoryStore
    from touba.runtime import PostgresCheckpointStore

    now = datetime.now(UTC)
    prefix = f"{pg.place}.app_memory"

    async def seed() -> None:
        clock = _Clock(now - timedelta(days=30))
        async with PostgresMemoryStore(pg.address, prefix=prefix, clock=clock) as store:
            await store.open_session("old", owner="user:u", agent_ref="a", mode="live")
            await store.append_turn("old", user="old words", replies=["r"])
            clock.at = now
            await store.append_turn("old", user="new words", replies=["r"])
        async with PostgresCheckpointStore(pg.address) as checkpoints:
            await checkpoints.save("c", {"status": "failed"})

    async def left() -> list[str]:
        async with PostgresMemoryStore(pg.address, prefix=prefix) as store:
            return [t.user for t in await store.recent_turns("old", 10)]

    asyncio.run(seed())
    where = ["--dsn", pg.address, "--prefix", prefix, "--checkpoints-dsn", pg.address]
    dry = runner.invoke(app, ["purge", *where, "--turns-days", "7", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert pg.password not in dry.output
    assert json.loads(dry.stdout)["counts"] == {
        "memory": {"turns": 1, "sessions": 0, "extraction_jobs": 0}
    }
    done = runner.invoke(
        app, ["purge", *where, "--turns-days", "7", "--checkpoints-days", "0.5", "--json"]
    )
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["counts"]["checkpoints"] == {"checkpoints": 0}  # young
    assert asyncio.run(left()) == ["new words"]
