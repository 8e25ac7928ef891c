"""The private servers of tests/_private_servers.py: a committed write survives kill -9."""

from __future__ import annotations

import glob
from pathlib import Path

import psycopg
import pytest
import redis

from tests._private_servers import PrivateRedis, private_postgres_or_skip, private_redis_or_skip


def test_a_private_postgres_keeps_a_commit_through_kill9_and_restarts_on_its_port() -> None:
    with private_postgres_or_skip() as server:
        with psycopg.connect(server.dsn, autocommit=True) as connection:
            connection.execute("create table kept (n int)")
            connection.execute("insert into kept values (1)")
        pid = server.pid
        server.kill9()
        down = not server.running  # (a name of its own: mypy keeps a property narrowed)
        assert down
        server.restart()
        assert server.running
        assert server.pid != pid
        assert server.kills == 1
        with psycopg.connect(server.dsn, autocommit=True) as connection:
            assert connection.execute("select n from kept").fetchall() == [(1,)]
            assert connection.execute("show fsync").fetchone() == ("on",)
    assert not server.running


def test_a_private_redis_keeps_an_acknowledged_write_through_kill9() -> None:
    with private_redis_or_skip() as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.set("kept", "1")
            server.kill9()
            server.restart()
            assert client.get("kept") == b"1"
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
        finally:
            client.close()
    assert not server.running


def _cut_inside_the_last_multi(server: PrivateRedis) -> None:
    """Cut the append-only file inside its last MULTI block (its EXEC and some bytes of
    the last command before it), as a crash in the middle of the write does."""
    [incr] = glob.glob(str(server.directory / "appendonlydir" / "*.incr.aof"))
    data = Path(incr).read_bytes()
    assert data.endswith(b"*1\r\n$4\r\nEXEC\r\n")
    Path(incr).write_bytes(data[: -len(b"*1\r\n$4\r\nEXEC\r\n") - 3])


SCRIPT = "redis.call('RPUSH', KEYS[1], ARGV[1]); redis.call('RPUSH', KEYS[1], ARGV[2])"


@pytest.mark.parametrize("truncated", ["yes", "no"])
def test_a_file_cut_inside_a_multi_block(truncated: str) -> None:
    """Redis 7.0 with ``aof-load-truncated yes`` keeps a cut block's complete commands
    in the file, MULTI included: the writes acknowledged after that restart join the
    unfinished block, and the next restart drops them all (or, when a later block's
    EXEC closes it, applies the cut block's commands: half of a script's write that
    was never acknowledged comes back, which is what touba's crash test met). With
    ``no``, ``start()`` repairs the file with redis-check-aof, which cuts before the
    MULTI: the cut block is gone for good and later writes are kept."""
    with private_redis_or_skip({"aof-load-truncated": truncated}) as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.rpush("l", "a")
            client.eval(SCRIPT, 1, "l", "b", "c")  # logged as MULTI, RPUSH, RPUSH, EXEC
            server.stop()
            _cut_inside_the_last_multi(server)
            server.start()
            assert client.lrange("l", 0, -1) == [b"a"]  # the cut block is not applied
            assert server.aof_fixes == (1 if truncated == "no" else 0)
            client.rpush("l", "d")
            server.kill9()
            server.restart()
            after = client.lrange("l", 0, -1)
        finally:
            client.close()
    if truncated == "yes":
        assert after == [b"a"]  # "d", acknowledged, is lost: the Redis behaviour touba warns of
    else:
        assert after == [b"a", b"d"]
