"""`touba copy`: SQLite, PostgreSQL and Redis, created targets, reruns, conflicts, verify."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from tests.cli.conftest import Server
from tests.cli.test_cli import CRASH, crash_holding
from touba.cli._app import app
from touba.history import ConversationIdentity
from touba.history._record import join_record, new_head
from touba.history.sqlite import SqliteHistoryStore

runner = CliRunner()


def record(n: int) -> dict[str, Any]:
    who = ConversationIdentity("ns", "openai", "m", "native", f"r{n}", "i", "agent")
    head = {**new_head(who), "created_at": "2026-01-01T00:00:00+00:00"}
    head["updated_at"] = head["created_at"]
    return join_record(head, [[{"role": "assistant", "n": n}, {"role": "tool"}]])


def seed(path: Path, count: int, offset: int = 0) -> None:
    async def go() -> None:
        async with SqliteHistoryStore(path) as store:
            for n in range(offset, offset + count):

                async def put(_: Any, n: int = n) -> tuple[Any, None]:
                    return record(n), None

                await store.transact(f"k{n}", put)

    asyncio.run(go())


def contents(path: Path) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with SqliteHistoryStore(path, create=False) as store:
            return {row.key: await store.read(row.key) for row in await store.list()}

    return asyncio.run(go())


def copy(*args: str, code: int = 0, password: str | None = None) -> Result:
    result = runner.invoke(app, ["copy", *args], env={"COLUMNS": "200"})
    assert result.exit_code == code, result.output
    if password is not None:
        assert password not in result.output.replace("\n", "")
    return result


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.sqlite"
    seed(path, 3)
    return path


def test_sqlite_to_a_new_sqlite_file_then_a_rerun(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target.sqlite"
    first = copy("--from-db", str(source), "--to-db", str(target), "--verify")
    assert f"created history store at {target}" in first.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert "│ copied                │ 3 " in first.stdout
    assert "verify: clean; 3 of 3 record(s) equal" in first.stdout
    assert contents(target) == contents(source)

    again = copy("--from-db", str(source), "--to-db", str(target), "--verify")
    assert "created" not in again.stderr
    assert "│ copied                │ 0 " in again.stdout
    assert "│ already in the target │ 3 " in again.stdout
    assert len(contents(target)) == 3


def test_a_conflict_is_left_untouched_and_fails_the_command(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target.sqlite"
    seed(target, 1, offset=7)  # k7

    async def other() -> None:
        async with SqliteHistoryStore(target) as store:

            async def put(_: Any) -> tuple[Any, None]:
                return record(99), None

            await store.transact("k1", put)

    asyncio.run(other())
    result = copy("--from-db", str(source), "--to-db", str(target), "--verify", code=1)
    assert "conflict: k1" in result.stdout
    assert "verify: 1 mismatch(es); 2 of 3 record(s) equal (target holds 4)" in result.stdout
    assert "different: k1" in result.stdout
    assert contents(target)["k1"] == record(99)


def test_active_conversations_are_listed_or_copied_inactive(source: Path, tmp_path: Path) -> None:
    crash_holding([sys.executable, "-c", CRASH, str(source), "k2"])
    target = tmp_path / "target.sqlite"
    skipped = copy("--from-db", str(source), "--to-db", str(target), "--verify")
    assert "active: k2" in skipped.stdout
    assert "1 active not copied" in skipped.stdout
    assert set(contents(target)) == {"k0", "k1"}
    copied = copy("--from-db", str(source), "--to-db", str(target), "--include-active", "--json")
    data = json.loads(copied.stdout)
    assert data["copy"]["copied_active"] == ["k2"]
    assert data["copy"]["copied"] == {"conversation": 1}
    assert contents(target)["k2"] == record(2)


@pytest.mark.parametrize(
    "args",
    [
        ["--to-db", "x.sqlite"],
        ["--from-db", "a", "--from-dsn", "postgresql://h/db", "--to-db", "b"],
        ["--from-db", "a", "--from-table", "t", "--to-db", "b"],
        ["--from-db", "a", "--to-db", "b", "--to-prefix", "p:"],
        ["--from-db", "same.sqlite", "--to-db", "same.sqlite"],
    ],
)
def test_usage_errors(args: list[str]) -> None:
    result = runner.invoke(app, ["copy", *args])
    assert result.exit_code == 2, result.output
    assert "usage" in result.stderr


def test_a_missing_source_creates_nothing(tmp_path: Path) -> None:
    result = copy(
        "--from-db", str(tmp_path / "absent.sqlite"), "--to-db", str(tmp_path / "t"), code=1
    )
    assert "no history database" in result.stderr
    assert not (tmp_path / "t").exists()


@pytest.mark.postgres
@pytest.mark.redis
def test_sqlite_to_postgres_to_redis_and_back(
    source: Path, tmp_path: Path, pg: Server, redis: Server
) -> None:
    to_pg = copy("--from-db", str(source), "--to-dsn", pg.address, "--verify", password=pg.password)
    assert "created history table 'touba_history'" in to_pg.stderr
    assert "verify: clean" in to_pg.stdout

    to_redis = copy(
        "--from-dsn", pg.address, "--to-redis-url", redis.address, "--to-prefix", redis.place,
        "--verify", password=redis.password,
    )  # fmt: skip
    assert "writing a new history store under prefix" in to_redis.stderr
    assert "verify: clean; 3 of 3" in to_redis.stdout

    back = tmp_path / "back.sqlite"
    copy(
        "--from-redis-url", redis.address, "--from-prefix", redis.place, "--to-db", str(back),
        "--verify", password=redis.password,
    )  # fmt: skip
    assert contents(back) == contents(source)


def populated(tmp_path: Path) -> Path:
    """A deployment's three SQLite files (h.sqlite, memory.db, checkpoints.db) in a folder."""
    from tests.data._export_data import Deployment, populate

    async def go() -> Path:
        deployment = Deployment("sqlite", "sqlite", tmp_path)
        await populate(deployment)
        await deployment.memory.close()
        await deployment.stores.checkpoints.close()  # type: ignore[union-attr]
        await deployment.stores.resources.close()  # type: ignore[union-attr]
        for store in deployment.histories.made:
            await store.close()
        return deployment.dir

    return asyncio.run(go())


def test_a_whole_deployment_to_new_sqlite_files_then_postgres(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    origin = populated(tmp_path)
    into = tmp_path / "into"
    into.mkdir(mode=0o700)
    common = [
        "--from-db", str(origin / "h.sqlite"),
        "--from-memory-db", str(origin / "memory.db"),
        "--from-checkpoints-db", str(origin / "checkpoints.db"),
    ]  # fmt: skip
    result = copy(
        *common,
        "--to-db", str(into / "h.sqlite"),
        "--to-memory-db", str(into / "memory.db"),
        "--to-checkpoints-db", str(into / "checkpoints.db"),
        "--verify",
    )  # fmt: skip
    for created in ("history store", "memory store", "checkpoint store"):
        assert f"created {created} at" in result.stderr
    for name in ("h.sqlite", "memory.db", "checkpoints.db"):
        assert stat.S_IMODE((into / name).stat().st_mode) == 0o600
    assert "│ session          │ 2      │ 0 " in result.stdout
    assert "│ checkpoint       │ 2      │ 0 " in result.stdout
    assert "verify: clean; 24 of 24 record(s) equal" in result.stdout

    again = copy(*common, "--to-db", str(into / "h.sqlite"), "--to-memory-db",
                 str(into / "memory.db"), "--to-checkpoints-db", str(into / "checkpoints.db"),
                 "--json")  # fmt: skip
    data = json.loads(again.stdout)
    assert sum(data["copy"]["copied"].values()) == 0
    assert sum(data["copy"]["already"].values()) == 24


@pytest.mark.postgres
def test_a_whole_deployment_to_postgres(tmp_path: Path, pg: Server) -> None:
    origin = populated(tmp_path)
    result = copy(
        "--from-db", str(origin / "h.sqlite"), "--to-dsn", pg.address,
        "--from-memory-db", str(origin / "memory.db"), "--to-memory-dsn", pg.address,
        "--from-checkpoints-db", str(origin / "checkpoints.db"), "--to-checkpoints-dsn",
        pg.address, "--verify", password=pg.password,
    )  # fmt: skip
    assert "created memory store at" in result.stderr
    assert "created checkpoint table 'touba_checkpoints'" in result.stderr
    assert "verify: clean; 24 of 24 record(s) equal" in result.stdout


def test_a_kind_given_on_one_side_only_is_a_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["copy", "--from-memory-db", str(tmp_path / "m.db")])
    assert result.exit_code == 2
    assert "give the memory store on both sides" in result.stderr
