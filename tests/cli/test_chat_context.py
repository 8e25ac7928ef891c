"""`touba chat`'s /context and --json: what each turn's invocation was given."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from touba.cli._app import app

runner = CliRunner()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    return directory / "memory.db"


def chat(db: Path, *extra: str, input: str) -> tuple[str, str]:
    result = runner.invoke(
        app,
        ["chat", "--db", str(db), "--program", "demo", "--agent", "support", "-u", "ada", *extra],
        input=input,
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def test_context_says_what_the_last_turn_was_given(db: Path) -> None:
    out, _ = chat(db, input="/context\nhello\nwhere is A1?\n/context\n/quit\n")
    assert "no turn stored yet in this session" in out
    assert (
        "turn 2: given turn 1 (full trace, no tool call); short-term memory 30 turns (1 with "
        "full trace), from the program; key events: none open"
    ) in out
    assert "  system prompt " in out
    assert "  decision 1: history window " in out
    assert "  decision history deleted when the turn was stored" in out
    assert "/context: what the last stored turn was given" in chat(db, input="/help\n")[0]


def test_json_prints_each_turn_with_its_context_and_people_text_on_stderr(db: Path) -> None:
    out, err = chat(db, "--json", input="hello\nwhere is A1?\n/context\n")
    first, second, context = (json.loads(line) for line in out.splitlines())
    assert (first["turn"], first["status"], first["user"]) == (1, "completed", "hello")
    assert first["context"]["turns"] == []
    assert second["context"]["turns"] == [{"number": 1, "full_trace": True, "calls": 0}]
    assert second["context"]["settings"]["source"] == "program"
    assert second["trace"][0][0]["name"] == "lookup_order"
    assert context == second["context"]  # /context in JSON: the last record
    assert "you>" in err  # the prompts went to standard error
    assert "agent>" in err
