"""The Redis store's Lua scripts as package data (``touba/history/lua/*.lua``).

The SHA1 touba computes from each file is the digest EVALSHA sends, and the real
server's ``SCRIPT LOAD`` answers it; includes of shared pieces expand at load time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from importlib.resources import files
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from tests._services import redis_url
from touba.history import _lua
from touba.history._lua import load
from touba.history.redis import RedisHistoryStore

SCRIPTS = sorted(
    entry.name.removesuffix(".lua")
    for entry in files("touba.history").joinpath("lua").iterdir()
    if entry.name.endswith(".lua") and not entry.name.startswith("_")
)


@pytest.fixture
async def raw() -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url())
    yield client
    await client.aclose()


def test_every_script_has_its_includes_in_place() -> None:
    assert len(SCRIPTS) == 13
    for name in SCRIPTS:
        script = load(name)
        assert script.name == name
        assert "--@include" not in script.text
        assert script.source == script.text.encode("utf-8")
    # the prelude every store script starts with is one file, written once
    prelude = files("touba.history").joinpath("lua/_prelude.lua").read_text("utf-8")
    assert sum(prelude in load(name).text for name in SCRIPTS) == len(SCRIPTS) - 1
    assert load("claim") is load("claim")  # read once


@pytest.mark.redis
async def test_the_server_answers_the_digest_touba_computes_for_each_script(
    raw: Redis,
) -> None:
    for name in SCRIPTS:
        script = load(name)
        assert await raw.script_load(script.source) == script.sha, name


@pytest.mark.redis
async def test_the_store_sends_the_digests_touba_computes() -> None:
    async with RedisHistoryStore(redis_url(), prefix="touba-test-lua:") as store:
        registered = [v for v in vars(store).values() if isinstance(v, AsyncScript)]
    assert sorted(script.sha for script in registered) == sorted(load(n).sha for n in SCRIPTS)


def test_an_include_is_of_a_piece_and_only_in_a_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_lua, "_FOLDER", tmp_path)
    (tmp_path / "_piece.lua").write_text("local a = 1\n")
    (tmp_path / "_nested.lua").write_text("--@include _piece.lua\n")
    (tmp_path / "_open.lua").write_text("local b = 2")
    (tmp_path / "other.lua").write_text("return 1\n")
    (tmp_path / "ok.lua").write_text("--@include _piece.lua\nreturn a\n")
    assert "".join(_lua._lines("ok.lua", piece=False)) == "local a = 1\nreturn a\n"
    for text in ("--@include _nested.lua\n", "--@include other.lua\n", "--@include _open.lua\n"):
        (tmp_path / "bad.lua").write_text(text)
        with pytest.raises(ValueError, match="lua/"):
            _lua._lines("bad.lua", piece=False)
