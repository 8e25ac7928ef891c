"""`touba history show` and `recover` on a reserved conversation: who holds it, whether
that process still runs here, and the exact command that frees it."""

from __future__ import annotations

import asyncio
import json
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.cli.test_cli import CRASH, _hold, _seed
from touba.cli._app import app

runner = CliRunner()


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[Path, str]:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    db = directory / "history.sqlite"
    return db, asyncio.run(_seed(db))


@pytest.fixture
def alive(seeded: tuple[Path, str]) -> Iterator[subprocess.Popen[str]]:
    """A worker that holds the seeded conversation and is still running."""
    db, key = seeded
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH, str(db), key], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "holding"
    yield child
    child.kill()
    child.wait()
    child.stdout.close()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_show_of_a_conversation_held_by_a_dead_worker(seeded: tuple[Path, str]) -> None:
    db, key = seeded
    _hold(db, key)  # the worker was killed while it held the conversation
    shown = runner.invoke(app, ["history", "show", key, "--db", str(db)], env={"COLUMNS": "300"})
    assert shown.exit_code == 1
    out = _flat(shown.output)
    assert f"DecisionHistoryBusy: conversation {key} is reserved by a worker" in out
    assert "invocation_id: inv" in out  # its metadata
    assert "stored: 1 messages" in out
    assert "worker: " in out
    assert f"on host {socket.gethostname()}" in out
    assert "since: " in out
    assert "is not running on this host: the worker is gone" in out
    command = f"touba history recover {key} --db {shlex.quote(str(db))}"
    assert command in out
    assert "store.recover" not in out  # no Python advice for an operator
    assert "worker_stopped=True" not in out
    recovered = runner.invoke(app, [*shlex.split(command)[1:], "--worker-stopped"])
    assert recovered.exit_code == 0, recovered.output
    assert "reservation freed" in recovered.output
    assert runner.invoke(app, ["history", "show", key, "--db", str(db)]).exit_code == 0


def test_show_of_a_conversation_held_by_a_running_worker(
    seeded: tuple[Path, str], alive: subprocess.Popen[str]
) -> None:
    db, key = seeded
    shown = runner.invoke(app, ["history", "show", key, "--db", str(db)], env={"COLUMNS": "300"})
    assert shown.exit_code == 1
    out = _flat(shown.output)
    assert f"pid: {alive.pid} on host {socket.gethostname()}" in out
    assert f"pid {alive.pid} is running on this host" in out
    raw = runner.invoke(app, ["history", "show", key, "--db", str(db), "--json"])
    assert raw.exit_code == 1
    data = json.loads(raw.stdout)
    assert data["reservation"]["pid"] == alive.pid
    assert data["holder_process"].startswith(f"pid {alive.pid} is running")
    assert data["recover_command"].startswith(f"touba history recover {key} --db ")


def test_recover_says_when_nothing_holds_the_conversation_before_asking(
    seeded: tuple[Path, str],
) -> None:
    db, key = seeded
    free = runner.invoke(app, ["history", "recover", key, "--db", str(db)], input="y\n")
    assert free.exit_code == 1
    assert f"no reservation on conversation {key}; nothing to recover" in _flat(free.output)
    assert "Have you stopped" not in free.output  # not asked
    absent = runner.invoke(app, ["history", "recover", "nope", "--db", str(db)], input="y\n")
    assert absent.exit_code == 1
    assert "(no such conversation)" in absent.output


def test_recover_shows_the_holder_before_asking(seeded: tuple[Path, str]) -> None:
    db, key = seeded
    _hold(db, key)
    refused = runner.invoke(app, ["history", "recover", key, "--db", str(db)], input="n\n")
    assert refused.exit_code == 1
    out = refused.output
    assert out.index("is not running on this host") < out.index("Have you stopped")
    assert "nothing done" in out
    busy = runner.invoke(app, ["history", "rm", key, "--db", str(db)], env={"COLUMNS": "300"})
    assert f"touba history recover {key} --db {shlex.quote(str(db))}" in _flat(busy.output)


def test_the_recover_command_repeats_the_store_options_never_a_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from touba.cli._holder import recover_command
    from touba.cli._stores import Backend

    monkeypatch.delenv("TOUBA_DSN", raising=False)
    dsn = "postgresql://app:s3cret@db/app"
    command, masked = recover_command(Backend("postgresql", dsn), "k 1", table="t")
    assert command == "touba history recover 'k 1' --dsn 'postgresql://app:***@db/app' --table t"
    assert masked
    monkeypatch.setenv("TOUBA_DSN", dsn)  # read from the environment: left to it
    assert recover_command(Backend("postgresql", dsn), "k")[0] == "touba history recover k"
    url = "redis://:pw@cache:6379/0"
    command, masked = recover_command(Backend("redis", url), "k", prefix="app:")
    assert (
        command == "touba history recover k --redis-url 'redis://:***@cache:6379/0' --prefix app:"
    )
    assert masked
    assert recover_command(Backend("redis", "redis://cache"), "k") == (
        "touba history recover k --redis-url redis://cache",
        False,
    )
