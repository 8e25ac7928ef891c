"""``TOUBA_STORE_DEADLINE``: the deadline of every PostgreSQL store a command opens (issue 29,
item 2). Unset, the stores' default; a positive number of seconds, that; anything else is
refused naming the variable, before any store is used."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.cli.conftest import Server
from touba.cli._app import app
from touba.cli._stores import DEADLINE_ENV, store_deadline
from touba.errors import ConfigurationError
from touba.history._deadline import STORE_DEADLINE_SECONDS


def test_the_variable_sets_the_deadline_and_its_absence_keeps_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DEADLINE_ENV, raising=False)
    assert store_deadline() == STORE_DEADLINE_SECONDS
    monkeypatch.setenv(DEADLINE_ENV, " 2.5 ")
    assert store_deadline() == 2.5


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf", "nan"])
def test_a_value_that_is_not_a_positive_number_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(DEADLINE_ENV, value)
    with pytest.raises(ConfigurationError, match=DEADLINE_ENV):
        store_deadline()


@pytest.mark.postgres
def test_a_command_on_postgresql_refuses_a_bad_deadline_and_takes_a_good_one(
    pg: Server,
) -> None:
    runner = CliRunner()
    command = ["history", "ls", "--dsn", pg.address]
    refused = runner.invoke(app, command, env={"COLUMNS": "500", DEADLINE_ENV: "soon"})
    assert refused.exit_code == 1, refused.output
    assert DEADLINE_ENV in refused.output
    assert pg.password not in refused.output
    plain = runner.invoke(app, command, env={"COLUMNS": "500", DEADLINE_ENV: None})
    given = runner.invoke(app, command, env={"COLUMNS": "500", DEADLINE_ENV: "3"})
    assert (given.exit_code, given.output) == (plain.exit_code, plain.output)
    assert DEADLINE_ENV not in given.output
