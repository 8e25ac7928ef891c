"""`touba history ls` on a terminal of 80 columns: shortened keys, `--wide` for whole
ones, and the short form taken back by `show`, `rm` and `recover`."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.cli.test_cli import _hold
from touba.cli._app import app
from touba.cli._history import shorten
from touba.history import ConversationIdentity
from touba.history._record import join_record, new_head
from touba.history.sqlite import SqliteHistoryStore

runner = CliRunner()
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


async def _seed(db: Path, count: int) -> list[str]:
    keys = []
    async with SqliteHistoryStore(db) as store:
        for index in range(count):
            identity = ConversationIdentity(
                "ns", "openai", "m", "native", "run", f"inv-{index}", "customer-support"
            )
            head = new_head(identity)
            head["stats"] = {"exchanges": 1, "messages": 1, "bytes": 10}
            record = join_record(head, [[{"kind": "decision", "final": True, "output": "hi"}]])

            async def put(
                _: dict[str, Any] | None, record: dict[str, Any] = record
            ) -> tuple[dict[str, Any] | None, None]:
                return record, None

            await store.transact(identity.key, put)
            keys.append(identity.key)
    return keys


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[Path, list[str]]:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    db = directory / "history.sqlite"
    return db, asyncio.run(_seed(db, 3))


def _on_a_terminal(*args: str, columns: int = 80) -> list[str]:
    """The lines `touba ARGS` prints on a terminal of ``columns`` columns."""
    master, slave = os.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm"}
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "touba.cli", *args], stdout=slave, stderr=slave, env=env
        )
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the command ended: the terminal closed
                break
            if not chunk:
                break
            out += chunk
        assert child.wait(timeout=30) == 0, out
    finally:
        os.close(master)
    return ANSI.sub("", out.decode()).replace("\r", "").splitlines()


def test_ls_fits_80_columns_with_keys_shortened_in_the_middle(
    seeded: tuple[Path, list[str]],
) -> None:
    db, keys = seeded
    _hold(db, keys[0])
    lines = _on_a_terminal("history", "ls", "--db", str(db))
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    for key in keys:
        rows = [line for line in lines if line.startswith(shorten(key)) and "held" not in line]
        (row,) = rows  # one line each
        assert "customer-support" in row
        assert key not in "\n".join(lines)
    assert shorten(keys[0]) == keys[0][:10] + "…" + keys[0][-10:]
    assert f"{shorten(keys[0])} is held by pid " in "\n".join(lines)
    assert "3 conversation(s)" in lines


def test_ls_wide_prints_whole_keys_one_row_per_line(seeded: tuple[Path, list[str]]) -> None:
    db, keys = seeded
    lines = _on_a_terminal("history", "ls", "--db", str(db), "--wide")
    for key in keys:
        (row,) = [line for line in lines if key in line]
        assert "customer-support" in row
        assert "inv-" in row  # every column
    assert "…" not in "\n".join(lines)


def test_show_rm_and_recover_take_the_short_key(seeded: tuple[Path, list[str]]) -> None:
    db, keys = seeded
    short = shorten(keys[1])
    shown = runner.invoke(app, ["history", "show", short, "--db", str(db)])
    assert shown.exit_code == 0, shown.output
    assert "invocation_id: inv-1" in shown.output
    _hold(db, keys[2])
    recovered = runner.invoke(
        app, ["history", "recover", shorten(keys[2]), "--db", str(db), "--worker-stopped"]
    )
    assert recovered.exit_code == 0, recovered.output
    assert "reservation freed" in recovered.output
    assert "deleted" in runner.invoke(app, ["history", "rm", short, "--db", str(db)]).output
    gone = runner.invoke(app, ["history", "show", short, "--db", str(db)])
    assert gone.exit_code == 1
    assert f"no conversation {short}" in gone.output


def test_a_short_key_that_names_several_conversations_is_refused(
    seeded: tuple[Path, list[str]],
) -> None:
    db, keys = seeded
    both = keys[0][:4] + "…"  # every key of the store starts so
    refused = runner.invoke(app, ["history", "rm", both, "--db", str(db)])
    assert refused.exit_code == 1
    assert "names 3 conversations" in refused.output
    assert "--wide" in refused.output
    listed = runner.invoke(app, ["history", "ls", "--db", str(db), "--json"])
    assert listed.output.count('"key"') == 3  # nothing was removed


def test_a_whole_key_holding_an_ellipsis_is_taken_as_it_is(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    db = directory / "history.sqlite"

    async def seed() -> None:
        async with SqliteHistoryStore(db) as store:
            for key in ("chat…42", "chat-with-ada-42"):  # an application's own session keys

                async def put(
                    _: dict[str, Any] | None, key: str = key
                ) -> tuple[dict[str, Any] | None, None]:
                    return {"note": key}, None

                await store.transact(key, put)

    asyncio.run(seed())
    shown = runner.invoke(app, ["history", "show", "chat…42", "--db", str(db), "--json"])
    assert shown.exit_code == 0, shown.output
    assert '"note": "chat…42"' in shown.output
