"""``touba rekey``: a SQLite history store rotated from k1 to k2 from the command line."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.history.test_encryption_stores import K1, K2, converse, identity
from touba import Encryption
from touba.cli._app import app
from touba.history.sqlite import SqliteHistoryStore

runner = CliRunner()


def _keys_file(tmp_path: Path, keys: dict[str, bytes], mode: int = 0o600) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({k: base64.b64encode(v).decode() for k, v in keys.items()}))
    path.chmod(mode)
    return path


async def _seed(db: Path, conversations: int) -> None:
    async with SqliteHistoryStore(db, encryption=Encryption({"k1": K1}, "k1")) as store:
        for n in range(conversations):
            await converse(store, identity(n), 2)


def test_rekey_rotates_every_conversation(tmp_path: Path) -> None:
    db = tmp_path / "history.sqlite"
    asyncio.run(_seed(db, 5))
    keys = _keys_file(tmp_path, {"k1": K1, "k2": K2})
    args = ["rekey", "--history-db", str(db), "--keys-file", str(keys), "--current", "k2"]
    result = runner.invoke(app, [*args, "--batch", "2", "--json"])
    assert result.exit_code == 0, result.output
    outcome = json.loads(result.stdout)
    assert outcome["resealed_conversations"] == 5
    assert outcome["values_by_key_id"] == {"k2": 5 * 4}
    assert outcome["left"] == 0
    assert base64.b64encode(K1).decode() not in result.output

    async def read_with_new_key_only() -> None:
        async with SqliteHistoryStore(db, encryption=Encryption({"k2": K2}, "k2")) as store:
            for n in range(5):
                assert await store.read(identity(n).key) is not None

    asyncio.run(read_with_new_key_only())
    again = runner.invoke(app, args)  # nothing left: a second run re-seals nothing
    assert again.exit_code == 0, again.output
    assert "re-sealed 0 conversation(s) with k2" in again.stdout


@pytest.mark.parametrize("problem", ["group-readable", "symlink", "unknown current", "not base64"])
def test_rekey_refuses_a_bad_keys_file(tmp_path: Path, problem: str) -> None:
    db = tmp_path / "history.sqlite"
    asyncio.run(_seed(db, 1))
    keys = _keys_file(tmp_path, {"k1": K1, "k2": K2})
    current = "k2"
    said = {
        "group-readable": "chmod 600",
        "symlink": "not a symbolic link",
        "unknown current": "is not a key id",
        "not base64": "'k1'",
    }[problem]
    if problem == "group-readable":
        keys.chmod(0o640)
    elif problem == "symlink":
        link = tmp_path / "link.json"
        os.symlink(keys, link)
        keys = link
    elif problem == "unknown current":
        current = "k3"
    else:
        keys.write_text(json.dumps({"k1": "not base64!", "k2": base64.b64encode(K2).decode()}))
    result = runner.invoke(
        app, ["rekey", "--history-db", str(db), "--keys-file", str(keys), "--current", current]
    )
    assert result.exit_code == 1
    assert said in " ".join(result.output.split())
    for secret in (K1, K2):
        assert base64.b64encode(secret).decode() not in result.output


def test_rekey_needs_one_store(tmp_path: Path) -> None:
    keys = _keys_file(tmp_path, {"k1": K1})
    result = runner.invoke(app, ["rekey", "--keys-file", str(keys), "--current", "k1"])
    assert result.exit_code == 2


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
def test_rekey_on_postgres_and_redis(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("pg" if kind == "postgres" else "redis")
    old = Encryption({"k1": K1}, "k1")

    async def seed() -> None:
        if kind == "postgres":
            from touba.history.postgres import PostgresHistoryStore

            store: Any = PostgresHistoryStore(server.address, encryption=old)
        else:
            from touba.history.redis import RedisHistoryStore

            store = RedisHistoryStore(server.address, prefix=server.place, encryption=old)
        async with store:
            for n in range(3):
                await converse(store, identity(n), 2)

    asyncio.run(seed())
    keys = _keys_file(tmp_path, {"k1": K1, "k2": K2})
    where = (
        ["--history-dsn", server.address]
        if kind == "postgres"
        else ["--redis-url", server.address, "--history-prefix", server.place]
    )
    args = ["rekey", *where, "--keys-file", str(keys), "--current", "k2", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    outcome = json.loads(result.stdout)
    assert outcome["resealed_conversations"] == 3
    assert outcome["values_by_key_id"] == {"k2": 3 * 4}
    assert server.password not in result.output
