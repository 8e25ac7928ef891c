"""The `touba` command: the demo runs offline, and `touba history` administers a store."""

import asyncio
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from touba.cli import _common
from touba.cli._app import app
from touba.history import ConversationIdentity, StoredConversation, StoreUsage
from touba.history._record import join_record, new_head
from touba.history.sqlite import SqliteHistoryStore

runner = CliRunner()


def _touba(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "touba.cli", *args], capture_output=True, text=True, env=env
    )


def test_demo_runs_offline_across_two_processes(tmp_path: Path) -> None:
    """Trimming, summary, an approval resumed by a new process, restart, busy."""
    state = tmp_path / ".touba"
    result = _touba("demo", "--dir", str(state))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    for name in ("history.sqlite", "checkpoints.sqlite"):
        assert stat.S_IMODE(os.stat(state / name).st_mode) == 0o600
    for expected in (
        "history_trimmed",
        "decision_history_summary",
        "awaiting_approval",
        "(same identity) -> completed; history messages found in SQLite",
        "the refund of D4 is approved and issued",
        "retains 6 exchanges, 11 messages",
        "DecisionHistoryBusy",
        "I opened the case 'Refund for order D4'",
    ):
        assert expected in out, expected
    assert "LOST" not in out
    second_visit, anonymous = out.split("session 2, user")[1].split("session 3, an anonymous")
    assert "open key events: Refund for order D4 (open)" in second_visit
    assert "open key events: none" in anonymous
    assert stat.S_IMODE(os.stat(state / "memory.sqlite").st_mode) == 0o600
    again = _touba("demo", "--dir", str(state))  # rerunnable
    assert again.returncode == 0, again.stderr


def test_demo_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    state = tmp_path / "shared"
    state.mkdir()
    state.chmod(0o777)
    result = runner.invoke(app, ["demo", "--dir", str(state)])
    assert result.exit_code == 1
    assert not (state / "history.sqlite").exists()


async def _seed(db: Path) -> str:
    identity = ConversationIdentity("ns", "openai", "m", "native", "run", "inv", "agent")
    head = new_head(identity)
    head["stats"] = {"exchanges": 1, "messages": 1, "bytes": 10}
    record = join_record(head, [[{"kind": "decision", "final": True, "output": "hi"}]])

    async def put(_):
        return record, None

    async with SqliteHistoryStore(db) as store:
        await store.transact(identity.key, put)
    return identity.key


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[Path, str]:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    db = directory / "history.sqlite"
    return db, asyncio.run(_seed(db))


def test_history_ls_show_rm(seeded: tuple[Path, str]) -> None:
    db, key = seeded
    listed = runner.invoke(app, ["history", "ls", "--db", str(db), "--namespace", "ns"])
    assert listed.exit_code == 0, listed.output
    assert "1 conversation(s)" in listed.output
    other = runner.invoke(app, ["history", "ls", "--db", str(db), "--namespace", "other"])
    assert "0 conversation(s)" in other.output
    shown = runner.invoke(app, ["history", "show", key, "--db", str(db)])
    assert shown.exit_code == 0, shown.output
    assert "invocation_id" in shown.output
    assert "final" in shown.output
    raw = runner.invoke(app, ["history", "show", key, "--db", str(db), "--json"])
    assert '"output": "hi"' in raw.output
    removed = runner.invoke(app, ["history", "rm", key, "--db", str(db)])
    assert removed.exit_code == 0
    assert "deleted" in removed.output
    missing = runner.invoke(app, ["history", "show", key, "--db", str(db)])
    assert missing.exit_code == 1


def test_history_commands_never_create_a_database(tmp_path: Path) -> None:
    db = tmp_path / "nothing.sqlite"
    result = runner.invoke(app, ["history", "ls", "--db", str(db)])
    assert result.exit_code == 1
    assert not db.exists()


CRASH = """
import asyncio, os, sys
from touba.history.sqlite import SqliteHistoryStore

async def main():
    store = SqliteHistoryStore(sys.argv[1])
    async def hang(record):
        print("holding", flush=True)
        await asyncio.sleep(60)
        return record, None
    await store.transact(sys.argv[2], hang)

asyncio.run(main())
"""


def test_history_recover_needs_confirmation(seeded: tuple[Path, str]) -> None:
    db, key = seeded
    _hold(db, key)
    busy = runner.invoke(app, ["history", "show", key, "--db", str(db)])
    assert busy.exit_code == 1
    assert "DecisionHistoryBusy" in busy.output
    refused = runner.invoke(app, ["history", "recover", key, "--db", str(db)], input="n\n")
    assert refused.exit_code == 1
    still = runner.invoke(app, ["history", "ls", "--db", str(db)])
    assert "pid" in still.output
    confirmed = runner.invoke(app, ["history", "recover", key, "--db", str(db)], input="y\n")
    assert confirmed.exit_code == 0, confirmed.output
    assert "reservation freed" in confirmed.output
    shown = runner.invoke(app, ["history", "show", key, "--db", str(db)])
    assert shown.exit_code == 0
    again = runner.invoke(app, ["history", "recover", key, "--db", str(db), "--worker-stopped"])
    assert "no reservation" in again.output


def test_history_purge(seeded: tuple[Path, str]) -> None:
    db, _ = seeded
    result = runner.invoke(app, ["history", "purge", "--db", str(db)])
    assert result.exit_code == 0
    assert "purged 0" in result.output


def test_history_ls_prints_the_store_usage_against_its_limits(seeded: tuple[Path, str]) -> None:
    db, _ = seeded

    async def rows() -> list[StoredConversation]:
        async with SqliteHistoryStore(db) as store:
            return await store.list()

    found = asyncio.run(rows())
    used = sum(row.bytes for row in found)
    listed = runner.invoke(app, ["history", "ls", "--db", str(db), "--max-store-bytes", "1000"])
    assert listed.exit_code == 0, listed.output
    assert f"store usage: {len(found)}/128 conversations, {used}/1000 bytes" in listed.output


async def test_the_usage_history_ls_prints_agrees_with_the_listed_rows(
    seeded: tuple[Path, str],
) -> None:
    """``touba history ls`` prints ``store.usage()``; it must agree with ``list()``."""
    db, _ = seeded
    async with SqliteHistoryStore(db, max_sessions=9) as store:
        rows = await store.list()
        assert await store.usage() == StoreUsage(
            len(rows), 9, sum(row.bytes for row in rows), 32 << 20
        )


def crash_holding(argv: list[str]) -> None:
    """Run a worker that reserves a key and says "holding", then kill it (a crash)."""
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "holding"
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _hold(db: Path, key: str) -> None:
    """Leave ``key`` reserved by a worker killed mid-decision (a crash)."""
    crash_holding([sys.executable, "-c", CRASH, str(db), key])


def test_history_ls_piped_prints_each_row_on_one_line_with_the_whole_key(
    seeded: tuple[Path, str],
) -> None:
    db, key = seeded
    narrow = runner.invoke(app, ["history", "ls", "--db", str(db)], env={"COLUMNS": "40"})
    assert narrow.exit_code == 0, narrow.output
    (row,) = [line for line in narrow.output.splitlines() if key in line]  # never cut
    assert "│ ns " in row
    assert "│ agent " in row
    assert "…" not in narrow.output


def test_history_ls_and_show_report_the_same_stored_bytes(seeded: tuple[Path, str]) -> None:
    db, key = seeded
    listed = runner.invoke(app, ["history", "ls", "--db", str(db), "--json"])
    assert listed.exit_code == 0, listed.output
    data = json.loads(listed.output)
    (row,) = data["conversations"]
    assert row["key"] == key
    assert data["usage"]["stored_bytes"] == row["stored_bytes"]
    shown = runner.invoke(app, ["history", "show", key, "--db", str(db)])
    assert f"{row['stored_bytes']} stored bytes (10 message bytes)" in shown.output
    table = runner.invoke(app, ["history", "ls", "--db", str(db)])
    assert f"│ {row['stored_bytes']} " in table.output


def test_history_rm_of_a_busy_conversation_points_to_recover(seeded: tuple[Path, str]) -> None:
    db, key = seeded
    _hold(db, key)
    refused = runner.invoke(app, ["history", "rm", key, "--db", str(db)])
    assert refused.exit_code == 1
    assert "DecisionHistoryBusy" in refused.output
    assert "touba history recover" in refused.output
    runner.invoke(app, ["history", "recover", key, "--db", str(db), "--worker-stopped"])
    assert "deleted" in runner.invoke(app, ["history", "rm", key, "--db", str(db)]).output


def test_history_purge_shows_a_spinner_on_a_terminal_only(
    seeded: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    db, _ = seeded
    screen = io.StringIO()
    monkeypatch.setattr(_common, "errors", Console(file=screen, force_terminal=True, width=80))
    result = runner.invoke(app, ["history", "purge", "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert "purging expired conversations" in screen.getvalue()
    assert "purging" not in result.output  # standard output stays clean
