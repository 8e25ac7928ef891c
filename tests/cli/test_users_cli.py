"""`touba users erase USER` and `touba users verify USER` over every store of a deployment.

``erase`` asks first unless ``--yes`` (a refusal erases nothing), prints the receipt as a
table or ``--json`` without the user id; ``verify`` exits 1 while something is left.
Nothing is created: a missing file is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tests.cli.conftest import Server
from tests.data._world import Deployment, marker
from touba.cli._app import app
from touba.data import verify_erased

runner = CliRunner()
ALICE, BOB = "alice-7f3", "bob-2c1"


def invoke(*args: str, code: int = 0, input: str | None = None) -> Result:
    result = runner.invoke(app, list(args), input=input, env={"COLUMNS": "300", "TOUBA_DSN": None})
    assert result.exit_code == code, result.output
    return result


async def _populate(world: Deployment) -> None:
    await world.open()
    try:
        await world.populate(ALICE)
        await world.populate(BOB)
    finally:
        await world.close()


async def _left(world: Deployment, user: str) -> dict[str, dict[str, int]]:
    await world.open()
    try:
        return await verify_erased(user, world.stores)
    finally:
        await world.close()


@pytest.fixture
def world(tmp_path: Path) -> Deployment:
    deployment = Deployment("sqlite", tmp_path)
    asyncio.run(_populate(deployment))
    return deployment


def options(world: Deployment) -> list[str]:
    d = world.tmp_path / "private"
    assert d.is_dir()
    return [
        "--db",
        str(d / "memory.db"),
        "--history-db",
        str(d / "history.db"),
        "--checkpoints-db",
        str(d / "checkpoints.db"),
        "--resources-db",
        str(d / "resources.db"),
    ]


def test_erase_asks_first_and_a_no_erases_nothing(world: Deployment) -> None:
    before = asyncio.run(_left(world, ALICE))
    result = invoke("users", "erase", ALICE, *options(world), input="n\n", code=1)
    assert "to erase" in result.output
    assert "nothing erased" in result.output
    assert marker(ALICE) not in result.output
    assert asyncio.run(_left(world, ALICE)) == before


def test_erase_after_yes_prints_the_receipt_and_verify_then_passes(world: Deployment) -> None:
    bob = asyncio.run(_left(world, BOB))
    invoke("users", "verify", ALICE, *options(world), code=1)
    result = invoke("users", "erase", ALICE, *options(world), input="y\n")
    assert "erased" in result.output
    assert hashlib.sha256(ALICE.encode()).hexdigest() in result.output
    assert "turns" in result.output
    assert asyncio.run(_left(world, ALICE)) == {}
    assert asyncio.run(_left(world, BOB)) == bob
    verified = invoke("users", "verify", ALICE, *options(world))
    assert "nothing left" in verified.output
    again = invoke("users", "erase", ALICE, *options(world))  # nothing left: nothing asked
    assert "nothing to erase" in again.output


def test_erase_yes_json_never_names_the_user(world: Deployment) -> None:
    result = invoke("users", "erase", ALICE, *options(world), "--yes", "--json")
    receipt = json.loads(result.stdout)
    assert receipt["user_hash"] == hashlib.sha256(ALICE.encode()).hexdigest()
    assert receipt["counts"]["memory"]["sessions"] == 2
    assert receipt["counts"]["checkpoints"] == {"checkpoints": 2}
    assert ALICE not in result.output
    left = invoke("users", "verify", ALICE, *options(world), "--json")
    assert json.loads(left.stdout) == {}


def test_verify_lists_what_is_left_and_exits_1(world: Deployment) -> None:
    result = invoke("users", "verify", BOB, *options(world), "--json", code=1)
    left = json.loads(result.stdout)
    assert left["memory"]["turns"] == 4
    assert left["history"]["conversations"] == 3


def test_a_missing_store_is_refused_and_nothing_created(tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    invoke("users", "verify", ALICE, "--checkpoints-db", str(missing), code=1)
    assert not missing.exists()
    invoke("users", "verify", ALICE, code=2)  # no store at all
    invoke("users", "verify", ALICE, "--history-table", "t", code=2)


@pytest.mark.postgres
def test_erase_on_postgres(pg: Server, tmp_path: Path) -> None:
    world = Deployment("postgres", tmp_path)
    world.root = pg.place
    asyncio.run(_populate(world))
    common = [
        "--dsn",
        pg.address,
        "--history-dsn",
        pg.address,
        "--checkpoints-dsn",
        pg.address,
        "--resources-dsn",
        pg.address,
    ]
    result = invoke("users", "erase", ALICE, *common, "--yes", "--json")
    counts = json.loads(result.stdout)["counts"]
    assert set(counts) == {"memory", "history", "checkpoints", "resources"}
    assert pg.password not in result.output
    invoke("users", "verify", ALICE, *common)
    invoke("users", "verify", BOB, *common, code=1)
