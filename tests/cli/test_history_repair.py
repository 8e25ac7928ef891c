"""``touba history check`` and ``touba history repair`` on real stores.

A damaged conversation is written through the store's own ``transact`` (which
keeps any record as given: an exchange whose call has no result) or by editing a
SQLite row by hand (an unreadable row). ``check`` lists each problem and exits 1,
changing nothing; ``repair`` shows the fix and exits 1 without ``--yes``; with it,
the originals go to a 0600 backup in the export format first, then the repair,
after which ``check`` is clean. A reserved conversation is refused.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.cli.conftest import Server
from tests.cli.test_cli import _hold
from tests.cli.test_read_only import snapshot
from touba.cli._app import app
from touba.history import ConversationIdentity
from touba.history._record import join_record, new_head
from touba.history.sqlite import SqliteHistoryStore

runner = CliRunner()


def _record(namespace: str, *, damaged: bool) -> tuple[str, dict[str, Any]]:
    identity = ConversationIdentity(namespace, "openai", "m", "native", "run", "inv", "agent")
    head = new_head(identity)
    call = {"call_id": "c1", "name": "lookup", "arguments": {}}
    result = {**call, "kind": "result", "status": "ok", "result": "secret-result"}
    exchange: list[dict[str, Any]] = [{"kind": "decision", "calls": [call]}]
    if not damaged:
        exchange.append(result)
    exchanges = [exchange, [{"kind": "decision", "final": True, "output": "done"}]]
    head["stats"] = {
        "exchanges": 2,
        "messages": len(exchange) + 1,
        "bytes": sum(len(json.dumps(m, separators=(",", ":")).encode()) for m in exchange)
        + len(b'{"kind":"decision","final":true,"output":"done"}'),
    }
    return identity.key, join_record(head, exchanges)


async def _put(store: Any, *records: tuple[str, dict[str, Any]]) -> None:
    async with store:
        for key, record in records:

            async def put(_: Any, record: dict[str, Any] = record) -> tuple[dict[str, Any], None]:
                return record, None

            await store.transact(key, put)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    return directory / "history.sqlite"


def _seed(db: Path, *, healthy: bool = True, damaged: bool = True) -> tuple[str, str]:
    good, broken = _record("ok", damaged=False), _record("broken", damaged=True)
    chosen = [r for r, wanted in ((good, healthy), (broken, damaged)) if wanted]
    asyncio.run(_put(SqliteHistoryStore(db), *chosen))
    return good[0], broken[0]


def _rows(db: Path) -> list[Any]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT * FROM touba_history_messages ORDER BY id").fetchall()


def test_check_lists_each_problem_and_exits_1(db: Path) -> None:
    _good, broken = _seed(db)
    before = _rows(db)
    result = runner.invoke(app, ["history", "check", broken, "--db", str(db)])
    assert result.exit_code == 1, result.output
    assert "orphan_call" in result.output
    assert "has no result" in result.output
    assert "1 conversation(s) checked, 1 damaged" in result.output
    assert "secret-result" not in result.output
    assert _rows(db) == before  # reads only


def test_check_all_as_json(db: Path) -> None:
    _good, broken = _seed(db)
    result = runner.invoke(app, ["history", "check", "--all", "--db", str(db), "--json"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert data["checked"] == 2
    assert data["damaged"] == 1
    (found,) = data["conversations"]
    assert found["key"] == broken
    assert {p["kind"] for p in found["problems"]} == {"orphan_call"}


def test_check_of_healthy_conversations_exits_0(db: Path) -> None:
    good, _ = _seed(db, damaged=False)
    one = runner.invoke(app, ["history", "check", good, "--db", str(db)])
    assert one.exit_code == 0, one.output
    every = runner.invoke(app, ["history", "check", "--all", "--db", str(db)])
    assert every.exit_code == 0, every.output
    assert "1 conversation(s) checked, 0 damaged" in every.output


def test_check_needs_a_key_or_all(db: Path) -> None:
    good, _ = _seed(db)
    assert runner.invoke(app, ["history", "check", "--db", str(db)]).exit_code == 2
    both = runner.invoke(app, ["history", "check", good, "--all", "--db", str(db)])
    assert both.exit_code == 2


def test_check_finds_an_unreadable_row(db: Path) -> None:
    good, _ = _seed(db, damaged=False)
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE touba_history_messages SET body = 'garbage' WHERE body LIKE '%\"result\"%'"
        )
    result = runner.invoke(app, ["history", "check", good, "--db", str(db)])
    assert result.exit_code == 1
    assert "unreadable_row" in result.output
    assert "orphan_call" in result.output  # its call has lost its result


def test_repair_without_yes_shows_the_fix_and_changes_nothing(db: Path) -> None:
    _good, broken = _seed(db)
    before = _rows(db)
    result = runner.invoke(app, ["history", "repair", broken, "--db", str(db)])
    assert result.exit_code == 1, result.output
    assert "orphan_call" in result.output
    assert "1 result(s) added" in result.output
    assert "not applied: run again with --yes" in result.output
    assert _rows(db) == before


def test_repair_with_yes_keeps_the_originals_then_repairs(db: Path, tmp_path: Path) -> None:
    _good, broken = _seed(db)
    backup = tmp_path / "originals.jsonl"
    result = runner.invoke(
        app, ["history", "repair", broken, "--db", str(db), "--yes", "--backup", str(backup)]
    )
    assert result.exit_code == 0, result.output
    assert f"originals kept in {backup}" in result.output.replace("\n", "")
    assert "repaired: 1 problem(s) fixed (orphan_call)" in result.output
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    header, conversation, end = (json.loads(line) for line in backup.read_text().splitlines())
    assert header["format"] == "touba-export"
    assert header["version"] == 1
    assert header["selection"] == {"conversation": broken}
    assert conversation["kind"] == "conversation"
    assert conversation["key"] == broken
    assert conversation["identity"]["namespace"] == "broken"
    assert len(conversation["record"]["exchanges"][0]) == 1  # as it was: the orphan call
    assert end == {"kind": "end", "records": 1}
    check = runner.invoke(app, ["history", "check", "--all", "--db", str(db)])
    assert check.exit_code == 0, check.output
    shown = runner.invoke(app, ["history", "show", broken, "--db", str(db), "--json"])
    (decision, added) = json.loads(shown.output)["exchanges"][0]
    assert added["status"] == "error"
    assert added["error"] == "not run: repaired"
    assert added["call_id"] == decision["calls"][0]["call_id"]


def test_repair_refuses_an_existing_backup_file(db: Path, tmp_path: Path) -> None:
    _good, broken = _seed(db)
    backup = tmp_path / "there.jsonl"
    backup.write_text("keep me")
    before = _rows(db)
    result = runner.invoke(
        app, ["history", "repair", broken, "--db", str(db), "--yes", "--backup", str(backup)]
    )
    assert result.exit_code == 1
    assert "nothing was repaired" in result.output
    assert backup.read_text() == "keep me"
    assert _rows(db) == before


def test_repair_prints_its_default_backup_path(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _good, broken = _seed(db)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["history", "repair", broken, "--db", str(db), "--yes"])
    assert result.exit_code == 0, result.output
    (written,) = tmp_path.glob("touba-repair-*.jsonl")
    assert f"originals kept in {written.name}" in result.output
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


def test_repair_of_a_healthy_conversation_changes_nothing(db: Path) -> None:
    good, _ = _seed(db, damaged=False)
    before = _rows(db)
    result = runner.invoke(app, ["history", "repair", good, "--db", str(db), "--yes"])
    assert result.exit_code == 0, result.output
    assert "healthy: nothing to repair" in result.output
    assert _rows(db) == before


def test_repair_is_refused_while_a_worker_holds_the_conversation(db: Path, tmp_path: Path) -> None:
    _good, broken = _seed(db)
    _hold(db, broken)
    before = _rows(db)
    result = runner.invoke(
        app,
        ["history", "repair", broken, "--db", str(db), "--yes", "--backup", str(tmp_path / "b")],
    )
    assert result.exit_code == 1
    assert "DecisionHistoryBusy" in result.output
    assert _rows(db) == before


# -- PostgreSQL and Redis ---------------------------------------------------------------------


BACKENDS = [
    pytest.param("postgresql", marks=pytest.mark.postgres, id="postgresql"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]


@pytest.mark.parametrize("kind", BACKENDS)
def test_check_and_repair_on_postgres_and_redis(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    server: Server = request.getfixturevalue("pg" if kind == "postgresql" else "redis")
    if kind == "postgresql":
        from touba.history.postgres import PostgresHistoryStore

        store: Any = PostgresHistoryStore(server.address)
        options = ["--dsn", server.address]
    else:
        from touba.history.redis import RedisHistoryStore

        store = RedisHistoryStore(server.address, prefix=server.place)
        options = ["--redis-url", server.address, "--prefix", server.place]
    broken = _record("broken", damaged=True)
    asyncio.run(_put(store, broken, _record("ok", damaged=False)))
    check = runner.invoke(app, ["history", "check", "--all", *options])
    assert check.exit_code == 1, check.output
    assert "orphan_call" in check.output
    assert server.password not in check.output
    backup = tmp_path / "b.jsonl"
    repair = runner.invoke(
        app, ["history", "repair", broken[0], *options, "--yes", "--backup", str(backup)]
    )
    assert repair.exit_code == 0, repair.output
    again = runner.invoke(app, ["history", "check", "--all", *options])
    assert again.exit_code == 0, again.output
    assert "2 conversation(s) checked, 0 damaged" in again.output


def test_check_and_repair_without_yes_change_no_byte_mode_or_side_file(db: Path) -> None:
    _good, broken = _seed(db)
    before = snapshot(db.parent)
    for args in (
        ["check", "--all"],
        ["check", broken, "--json"],
        ["repair", broken],
    ):
        result = runner.invoke(app, ["history", *args, "--db", str(db)])
        assert result.exit_code == 1, result.output
    assert snapshot(db.parent) == before


def test_check_and_repair_refuse_a_store_of_the_other_kind(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    asyncio.run(_memory_store(directory / "memory.sqlite"))
    before = snapshot(directory)
    for args in (["check", "--all"], ["repair", "k", "--yes"]):
        result = runner.invoke(app, ["history", *args, "--db", str(directory / "memory.sqlite")])
        assert result.exit_code == 1, result.output
        assert "memory store" in result.output
    assert snapshot(directory) == before


async def _memory_store(path: Path) -> None:
    from touba.memory import SqliteMemoryStore

    async with SqliteMemoryStore(path):
        pass
