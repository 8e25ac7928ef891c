"""The commands over a user's data on ENCRYPTED stores: ``--keys-file`` / ``--current``.

Every store of a deployment (memory, decision histories, checkpoints, resources) is
sealed; each command reads and writes it with the keys of ``--keys-file``; without
them, or with the wrong ones, it is refused with a line naming ``--keys-file`` (exit
1, no traceback); no key is ever printed.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from tests.cli.conftest import Server
from tests.data._world import Deployment, marker
from tests.history.test_encryption_stores import K1, K2, converse, identity
from touba import Encryption
from touba.cli._app import app
from touba.data import verify_erased
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore

runner = CliRunner()
ALICE, BOB = "alice-e41", "bob-e42"
K3 = bytes(range(64, 96))
KEYS_SHOWN = [base64.b64encode(k).decode() for k in (K1, K2, K3)]


def invoke(*args: str, code: int = 0, input: str | None = None) -> Result:
    result = runner.invoke(app, list(args), input=input, env={"COLUMNS": "300", "TOUBA_DSN": None})
    assert result.exit_code == code, result.output
    for key in KEYS_SHOWN:  # no key, whatever the outcome
        assert key not in result.output
    assert "Traceback" not in result.output
    return result


def keys_file(tmp_path: Path, keys: dict[str, bytes], name: str = "keys.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({k: base64.b64encode(v).decode() for k, v in keys.items()}))
    path.chmod(0o600)
    return path


class Sealed(Deployment):
    """The test world with its SQLite decision-history store sealed too."""

    async def open(self) -> Any:
        stores = await super().open()
        if self.kind != "sqlite":
            return stores
        plain: Any = stores.histories[0]
        await plain.close()
        history = SqliteHistoryStore(self.path("history"), encryption=self.encryption)
        self.closers = [s for s in self.closers if s is not plain] + [history]
        self.stores = dataclasses.replace(stores, histories=(history,))
        return self.stores


async def _populate(world: Deployment, *users: str) -> None:
    await world.open()
    try:
        for user in users:
            await world.populate(user)
    finally:
        await world.close()


async def _left(world: Deployment, user: str) -> dict[str, dict[str, int]]:
    await world.open()
    try:
        return await verify_erased(user, world.stores)
    finally:
        await world.close()


@pytest.fixture
def world(tmp_path: Path) -> Sealed:
    deployment = Sealed("sqlite", tmp_path, encryption=Encryption({"k1": K1}, "k1"))
    asyncio.run(_populate(deployment, ALICE, BOB))
    return deployment


def stores_of(world: Deployment) -> list[str]:
    d = world.tmp_path / "private"
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


def raw_text(path: Path) -> str:
    """Every value of every table of a SQLite file, as text."""
    with sqlite3.connect(path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return " ".join(
            str(row)
            for table in tables
            for row in conn.execute(f'SELECT * FROM "{table}"')  # noqa: S608
        )


def test_the_world_is_sealed_at_rest(world: Sealed) -> None:
    for name in ("memory", "history", "checkpoints", "resources"):
        assert marker(ALICE) not in raw_text(world.path(name)), name


def test_users_erase_and_verify_with_keys(world: Sealed, tmp_path: Path) -> None:
    keys = keys_file(tmp_path, {"k1": K1})
    invoke("users", "erase", ALICE, *stores_of(world), "--keys-file", str(keys), "--yes")
    invoke("users", "verify", ALICE, *stores_of(world), "--keys-file", str(keys))
    assert asyncio.run(_left(world, ALICE)) == {}
    assert asyncio.run(_left(world, BOB)) != {}  # the other user's data stays


def test_export_needs_the_keys_and_import_reseals(world: Sealed, tmp_path: Path) -> None:
    keys = keys_file(tmp_path, {"k1": K1})
    refused = invoke("export", "--user", ALICE, *stores_of(world), code=1)
    assert "--keys-file" in " ".join(refused.output.split())
    assert marker(ALICE) not in refused.output
    out = tmp_path / "alice.jsonl"
    invoke("export", "--user", ALICE, *stores_of(world), "--keys-file", str(keys), "-o", str(out))
    assert marker(ALICE) in out.read_text()  # the export is the user's plaintext
    invoke("users", "erase", ALICE, *stores_of(world), "--keys-file", str(keys), "--yes")
    invoke("import", str(out), *stores_of(world), "--keys-file", str(keys))
    for name in ("memory", "history", "checkpoints", "resources"):
        assert marker(ALICE) not in raw_text(world.path(name)), name  # sealed again
    assert asyncio.run(_left(world, ALICE)) != {}


def test_purge_history_and_events_with_keys(world: Sealed, tmp_path: Path) -> None:
    keys = ["--keys-file", str(keys_file(tmp_path, {"k1": K1}))]
    d = world.tmp_path / "private"
    invoke("purge", *stores_of(world), *keys, "--turns-days", "30", "--traces-days", "1")
    shown = invoke("events", "ls", "--user", ALICE, "--db", str(d / "memory.db"), *keys)
    assert f"{marker(ALICE)} refund" in shown.output
    refused = invoke("events", "ls", "--user", ALICE, "--db", str(d / "memory.db"), code=1)
    assert "--keys-file" in " ".join(refused.output.split())
    assert marker(ALICE) not in refused.output
    history = ["--db", str(d / "history.db")]
    listed = invoke("history", "ls", *history, *keys, "--json")
    conversations = json.loads(listed.stdout)["conversations"]
    assert conversations
    key = conversations[0]["key"]
    invoke("history", "show", key, *history, *keys)
    invoke("history", "check", "--all", *history, *keys)
    invoke("history", "repair", key, *history, *keys)
    invoke("history", "rm", key, *history, *keys)


def test_history_show_without_or_with_wrong_keys_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "history.db"

    async def seed() -> str:
        async with SqliteHistoryStore(db, encryption=Encryption({"k1": K1}, "k1")) as store:
            await converse(store, identity(1), 2)
        return identity(1).key

    key = asyncio.run(seed())
    none = invoke("history", "show", key, "--db", str(db), code=1)
    assert "--keys-file" in " ".join(none.output.split())
    wrong = keys_file(tmp_path, {"k1": K2})  # the right id, another key
    bad = invoke("history", "show", key, "--db", str(db), "--keys-file", str(wrong), code=1)
    assert "--keys-file" in " ".join(bad.output.split())
    good = keys_file(tmp_path, {"k1": K1}, "good.json")
    invoke("history", "show", key, "--db", str(db), "--keys-file", str(good))


def test_a_bad_keys_file_or_current_is_refused(world: Sealed, tmp_path: Path) -> None:
    two = keys_file(tmp_path, {"k1": K1, "k2": K2})
    several = invoke("users", "verify", ALICE, *stores_of(world), "--keys-file", str(two), code=1)
    assert "--current" in " ".join(several.output.split())
    invoke("users", "verify", ALICE, *stores_of(world), "--current", "k1", code=2)
    shared = keys_file(tmp_path, {"k1": K1}, "shared.json")
    shared.chmod(0o644)
    loose = invoke("users", "verify", ALICE, *stores_of(world), "--keys-file", str(shared), code=1)
    assert "chmod 600" in " ".join(loose.output.split())
    both = ["--keys-file", str(two), "--current", "k1"]
    invoke("users", "verify", BOB, *stores_of(world), *both, code=1)  # Bob's data is left


def test_copy_plain_to_encrypted_then_encrypted_to_other_keys(tmp_path: Path) -> None:
    plain = Deployment("sqlite", tmp_path / "plain")
    (tmp_path / "plain").mkdir()
    asyncio.run(_populate(plain, ALICE))
    src = plain.tmp_path / "private"
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    keys = keys_file(tmp_path, {"k1": K1})
    invoke(
        "copy",
        "--from-db",
        str(src / "history.db"),
        "--to-db",
        str(out / "history.db"),
        "--from-memory-db",
        str(src / "memory.db"),
        "--to-memory-db",
        str(out / "memory.db"),
        "--from-checkpoints-db",
        str(src / "checkpoints.db"),
        "--to-checkpoints-db",
        str(out / "checkpoints.db"),
        "--to-keys-file",
        str(keys),
        "--verify",
    )
    for name in ("history", "memory", "checkpoints"):
        assert marker(ALICE) not in raw_text(out / f"{name}.db"), name

    async def read(path: Path, encryption: Encryption) -> str:
        async with SqliteMemoryStore(path, encryption=encryption) as memory:
            events = await memory.query_events(f"user:{ALICE}", include_closed=True)
            return events[0].title

    assert marker(ALICE) in asyncio.run(read(out / "memory.db", Encryption({"k1": K1}, "k1")))
    refused = invoke("events", "ls", "--user", ALICE, "--db", str(out / "memory.db"), code=1)
    assert "--keys-file" in " ".join(refused.output.split())

    again = tmp_path / "again"
    again.mkdir(mode=0o700)
    other = keys_file(tmp_path, {"k3": K3}, "other.json")
    invoke(
        "copy",
        "--from-db",
        str(out / "history.db"),
        "--to-db",
        str(again / "history.db"),
        "--from-memory-db",
        str(out / "memory.db"),
        "--to-memory-db",
        str(again / "memory.db"),
        "--from-keys-file",
        str(keys),
        "--to-keys-file",
        str(other),
        "--verify",
    )
    assert marker(ALICE) in asyncio.run(read(again / "memory.db", Encryption({"k3": K3}, "k3")))
    with pytest.raises(Exception, match="key"):
        asyncio.run(read(again / "memory.db", Encryption({"k1": K1}, "k1")))


def test_rekey_reseals_every_store(world: Sealed, tmp_path: Path) -> None:
    both = keys_file(tmp_path, {"k1": K1, "k2": K2})
    result = invoke(
        "rekey", *stores_of(world), "--keys-file", str(both), "--current", "k2", "--json"
    )
    outcome = json.loads(result.stdout)
    assert outcome["left"] == 0
    assert set(outcome["resealed_rows"]) == {"memory", "checkpoints", "resources"}
    assert all(n > 0 for n in outcome["resealed_rows"].values())
    only_new = keys_file(tmp_path, {"k2": K2}, "new.json")  # the old key no longer needed
    invoke("users", "erase", ALICE, *stores_of(world), "--keys-file", str(only_new), "--yes")
    world.encryption = Encryption({"k2": K2}, "k2")
    assert asyncio.run(_left(world, ALICE)) == {}
    assert asyncio.run(_left(world, BOB)) != {}


def test_panel_refuses_a_bad_keys_file_before_serving(tmp_path: Path) -> None:
    shared = keys_file(tmp_path, {"k1": K1})
    shared.chmod(0o640)
    db = tmp_path / "memory.db"
    result = invoke("panel", "--db", str(db), "--keys-file", str(shared), code=1)
    assert "chmod 600" in " ".join(result.output.split())
    invoke("panel", "--db", str(db), "--current", "k1", code=2)


@pytest.mark.postgres
def test_users_erase_on_encrypted_postgres_memory(pg: Server, tmp_path: Path) -> None:
    world = Deployment("postgres", tmp_path, encryption=Encryption({"k1": K1}, "k1"))
    asyncio.run(_populate(world, ALICE, BOB))
    try:
        memory = ["--dsn", world_dsn(), "--prefix", f"{world.root}.touba_memory"]
        refused = invoke("events", "ls", "--user", ALICE, *memory, code=1)
        assert "--keys-file" in " ".join(refused.output.split())
        keys = ["--keys-file", str(keys_file(tmp_path, {"k1": K1}))]
        shown = invoke("events", "ls", "--user", ALICE, *memory, *keys)
        assert f"{marker(ALICE)} refund" in shown.output
        invoke("users", "erase", ALICE, *memory, *keys, "--yes")
        invoke("users", "verify", ALICE, *memory, *keys)
    finally:
        asyncio.run(world.cleanup())


def world_dsn() -> str:
    from tests._services import postgres_dsn

    return postgres_dsn()
