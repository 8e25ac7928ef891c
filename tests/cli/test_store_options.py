"""How a command is given its store: exactly one backend, and no password ever printed.

These need no server: an unreachable one is a closed loopback port.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from touba.cli._app import app

runner = CliRunner()
PASSWORD = "Sw0rdfish-not-4-print"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Every command that opens a store.
STORE_COMMANDS = [
    ["history", "ls"],
    ["history", "show", "k"],
    ["history", "rm", "k"],
    ["history", "recover", "k", "--worker-stopped"],
    ["history", "purge"],
    ["events", "ls", "-u", "a"],
    ["events", "show", "ke_1"],
    ["events", "jobs"],
    ["events", "requeue", "j"],
    ["worker", "--once", "-p", "demo"],
    ["chat", "-p", "demo", "-a", "support"],
]


def _assert_hidden(output: str, password: str = PASSWORD) -> None:
    assert password not in output.replace("\n", "")


@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_an_unreachable_server_is_named_without_its_password(command: list[str]) -> None:
    dsn = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{_closed_port()}/test"
    result = runner.invoke(app, [*command, "--dsn", dsn], env={"COLUMNS": "500"})
    assert result.exit_code == 1, result.output
    assert "cannot open the" in result.output
    assert "postgresql://postgres:***@127.0.0.1:" in result.output
    assert "Connection refused" in result.output
    _assert_hidden(result.output)


def test_an_unreachable_redis_is_named_without_its_password() -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{_closed_port()}/0"
    result = runner.invoke(app, ["history", "ls", "--redis-url", url], env={"COLUMNS": "500"})
    assert result.exit_code == 1, result.output
    assert "cannot open the history store at redis://:***@127.0.0.1:" in result.output
    _assert_hidden(result.output)


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://postgres:{PASSWORD} x@127.0.0.1/test",  # the driver quotes it back
        f"host=127.0.0.1 password={PASSWORD} port=notaport",
        f"host=127.0.0.1 password='{PASSWORD}",
    ],
)
def test_a_malformed_dsn_is_refused_without_echoing_its_password(dsn: str) -> None:
    result = runner.invoke(app, ["history", "ls", "--dsn", dsn], env={"COLUMNS": "500"})
    assert result.exit_code == 1, result.output
    assert "cannot open the history store" in result.output
    _assert_hidden(result.output)


def test_help_never_shows_the_dsn_of_the_environment() -> None:
    dsn = f"postgresql://postgres:{PASSWORD}@127.0.0.1/test"
    for command in (["history", "ls"], ["events", "ls"], ["worker"], ["chat"]):
        result = runner.invoke(app, [*command, "--help"], env={"TOUBA_DSN": dsn, "COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "TOUBA_DSN" in result.output
        _assert_hidden(result.output)


@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_every_command_takes_exactly_one_store(command: list[str], tmp_path: Path) -> None:
    db = str(tmp_path / "absent.sqlite")
    dsn = f"postgresql://postgres:{PASSWORD}@127.0.0.1/test"
    none = runner.invoke(app, command, env={"TOUBA_DSN": None})
    assert none.exit_code == 2
    assert "--db PATH (SQLite)" in none.output
    assert "--dsn DSN or TOUBA_DSN (PostgreSQL)" in none.output
    assert ("--redis-url" in none.output) == (command[0] == "history")
    both = runner.invoke(app, [*command, "--db", db, "--dsn", dsn], env={"TOUBA_DSN": None})
    assert both.exit_code == 2
    assert "got --db and --dsn" in both.output
    from_env = runner.invoke(app, [*command, "--db", db], env={"TOUBA_DSN": dsn})
    assert from_env.exit_code == 2
    assert "got --db and --dsn (TOUBA_DSN is set)" in from_env.output
    for output in (none.output, both.output, from_env.output):
        _assert_hidden(output)
    assert not Path(db).exists()


def test_an_option_of_another_backend_is_refused(tmp_path: Path) -> None:
    db = str(tmp_path / "h.sqlite")
    for args, flag in (
        (["history", "ls", "--db", db, "--table", "t"], "--table"),
        (["history", "ls", "--dsn", "postgresql://h/db", "--prefix", "p:"], "--prefix"),
        (["events", "jobs", "--db", db, "--prefix", "p"], "--prefix"),
    ):
        result = runner.invoke(app, args, env={"TOUBA_DSN": None})
        assert result.exit_code == 2, result.output
        assert f"{flag} applies to a" in result.output
