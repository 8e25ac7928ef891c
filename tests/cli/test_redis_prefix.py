"""`touba history --redis-url` on a prefix that holds nothing: said, as a missing
PostgreSQL table is, and nothing is written."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from tests.cli.conftest import Server
from tests.cli.test_backends_cli import _history_store, _seed
from touba.cli._app import app
from touba.cli._common import redact

runner = CliRunner()
pytestmark = pytest.mark.redis


def _keys(server: Server) -> list[bytes]:
    from redis.asyncio import Redis

    async def scan() -> list[bytes]:
        client = Redis.from_url(server.address)
        try:
            return [k async for k in client.scan_iter(match=server.place + "*", count=1000)]
        finally:
            await client.aclose()

    return asyncio.run(scan())


@pytest.mark.parametrize(
    "command",
    [
        ("ls",),
        ("show", "some-key"),
        ("rm", "some-key"),
        ("recover", "some-key", "--worker-stopped"),
        ("purge",),
    ],
)
def test_a_prefix_that_holds_nothing_is_refused_and_left_empty(
    redis: Server, command: tuple[str, ...]
) -> None:
    name, *rest = command
    args = ["history", name, *rest, "--redis-url", redis.address, "--prefix", redis.place]
    result = runner.invoke(app, args, env={"COLUMNS": "500"})
    assert result.exit_code == 1, result.output
    out = " ".join(result.output.split())
    assert (
        f"no touba history keys under prefix {redis.place!r} at {redact(redis.address)}: "
        "nothing was created; check --redis-url and --prefix"
    ) in out
    assert redis.password not in out
    assert _keys(redis) == []  # the check wrote nothing


def test_a_prefix_that_holds_a_store_is_opened(redis: Server) -> None:
    key, _ = asyncio.run(_seed(_history_store("redis", redis), ("ns",)))
    options = ["--redis-url", redis.address, "--prefix", redis.place]
    listed = runner.invoke(app, ["history", "ls", *options], env={"COLUMNS": "500"})
    assert listed.exit_code == 0, listed.output
    assert "1 conversation(s)" in listed.output
    assert key in listed.output
    other = runner.invoke(app, ["history", "ls", *options[:2], "--prefix", redis.place + "x:"])
    assert other.exit_code == 1
    assert "no touba history keys under prefix" in other.output
