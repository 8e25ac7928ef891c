"""`touba export` and `touba import` on real stores: SQLite files, and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.cli.conftest import Server
from tests.data._export_data import conversation, save
from touba.cli._app import app
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore
from touba.runtime import SqliteCheckpointStore

runner = CliRunner()


def make_source(where: Path) -> list[str]:
    """A deployment of three SQLite files holding users u1 and u2; its store options."""

    async def fill() -> None:
        async with (
            SqliteMemoryStore(where / "memory.db") as memory,
            SqliteHistoryStore(where / "history.db") as history,
            SqliteCheckpointStore(where / "checkpoints.db") as checkpoints,
        ):
            for user, sid in (("u1", "a"), ("u2", "b")):
                owner = f"user:{user}"
                await memory.open_session(sid, owner=owner, agent_ref="support", mode="live")
                await memory.append_turn(sid, user=f"hello {user}", replies=["hi"])
                await memory.create_event(
                    owner=owner, type="task", title="T", details="", session_id=sid
                )
                await save(history, f"app:{sid}", conversation(sid, "i"))
                await checkpoints.save(f"cp-{sid}", {"run_id": sid})

    asyncio.run(fill())
    return options(where)


def options(where: Path) -> list[str]:
    return [
        "--db",
        str(where / "memory.db"),
        "--history-db",
        str(where / "history.db"),
        "--checkpoints-db",
        str(where / "checkpoints.db"),
    ]


def make_empty(where: Path) -> list[str]:
    """The same three stores, created empty (import never creates a store)."""

    async def create() -> None:
        async with (
            SqliteMemoryStore(where / "memory.db"),
            SqliteHistoryStore(where / "history.db"),
            SqliteCheckpointStore(where / "checkpoints.db"),
        ):
            pass

    asyncio.run(create())
    return options(where)


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    source, target = tmp_path / "source", tmp_path / "target"
    for place in (source, target):
        place.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    return source, target


def counts(output: str) -> dict[str, tuple[int, int]]:
    """The kind -> (added, present) rows of `touba import`'s table."""
    found = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 3 and cells[1].isdigit():
            found[cells[0]] = (int(cells[1]), int(cells[2]))
    return found


def test_export_a_user_to_a_private_file_then_import_it_twice(
    places: tuple[Path, Path],
) -> None:
    source, target = places
    given = make_source(source)
    out = source / "u1.jsonl"

    exported = runner.invoke(app, ["export", *given, "--user", "u1", "-o", str(out)])

    assert exported.exit_code == 0, exported.output
    assert "exported 5 records" in exported.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert "u2" not in out.read_text()
    into = make_empty(target)
    first = runner.invoke(app, ["import", str(out), *into])
    assert first.exit_code == 0, first.output
    expected = {"session": 1, "turn": 1, "key_event": 1, "conversation": 1, "checkpoint": 1}
    assert counts(first.stdout) == {k: (n, 0) for k, n in expected.items()}
    second = runner.invoke(app, ["import", str(out), *into])
    assert second.exit_code == 0, second.output
    assert counts(second.stdout) == {k: (0, n) for k, n in expected.items()}
    assert "imported 0 records; 5 were already there" in second.stdout
    again = runner.invoke(app, ["export", *into, "--user", "u1"])
    assert again.stdout.splitlines()[1:] == out.read_text().splitlines()[1:]


def test_export_writes_to_stdout_by_default(places: tuple[Path, Path]) -> None:
    source, _ = places
    given = make_source(source)

    result = runner.invoke(app, ["export", *given, "--conversation", "app:b"])

    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["selection"] == {"conversation": "app:b"}
    assert [line.get("key") for line in lines[1:]] == ["app:b", None]


@pytest.mark.parametrize(
    "selection",
    [[], ["--user", "u1", "--session", "a"]],
    ids=["none", "two"],
)
def test_export_needs_exactly_one_selection(
    places: tuple[Path, Path], selection: list[str]
) -> None:
    source, _ = places
    result = runner.invoke(app, ["export", *make_source(source), *selection])
    assert result.exit_code == 2
    assert "exactly one of --user" in result.stderr


def test_a_damaged_file_is_refused_with_its_line_and_nothing_imported(
    places: tuple[Path, Path],
) -> None:
    source, target = places
    given = make_source(source)
    out = source / "all.jsonl"
    assert runner.invoke(app, ["export", *given, "--user", "u1", "-o", str(out)]).exit_code == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join([*lines[:2], '{"kind": "turn"\n', *lines[3:]]))
    into = make_empty(target)

    result = runner.invoke(app, ["import", str(out), *into])

    assert result.exit_code == 1
    assert "ExportFileInvalid" in result.stderr
    assert "line 3" in result.stderr
    assert "hello" not in result.stderr
    listed = runner.invoke(app, ["export", *into, "--user", "u1"])
    assert listed.stdout.splitlines()[1:] == ['{"kind":"end","records":0}']


def test_a_conversation_over_the_bound_given_is_refused(places: tuple[Path, Path]) -> None:
    source, target = places
    given = make_source(source)
    out = source / "all.jsonl"
    assert runner.invoke(app, ["export", *given, "--user", "u1", "-o", str(out)]).exit_code == 0

    result = runner.invoke(
        app, ["import", str(out), *make_empty(target), "--max-retained-bytes", "10"]
    )

    assert result.exit_code == 1
    assert "ImportLimitExceeded" in result.stderr
    assert "max_retained_bytes=10" in result.stderr


@pytest.mark.postgres
def test_from_sqlite_into_postgresql_without_printing_the_password(
    places: tuple[Path, Path], pg: Server
) -> None:
    source, _ = places
    given = make_source(source)
    out = source / "u1.jsonl"
    assert runner.invoke(app, ["export", *given, "--user", "u1", "-o", str(out)]).exit_code == 0

    async def create() -> None:
        from touba.history.postgres import PostgresHistoryStore
        from touba.memory.postgres import PostgresMemoryStore
        from touba.runtime import PostgresCheckpointStore

        stores: list[Any] = [
            PostgresMemoryStore(pg.address),
            PostgresHistoryStore(pg.address),
            PostgresCheckpointStore(pg.address),
        ]
        for store in stores:
            await store.open()
            await store.close()

    asyncio.run(create())
    into = ["--dsn", pg.address, "--history-dsn", pg.address, "--checkpoints-dsn", pg.address]

    result = runner.invoke(app, ["import", str(out), *into])

    assert result.exit_code == 0, result.output
    assert "imported 5 records" in result.stdout
    assert pg.password not in result.output
    again = runner.invoke(app, ["export", *into, "--user", "u1"])
    assert again.stdout.splitlines()[1:] == out.read_text().splitlines()[1:]
