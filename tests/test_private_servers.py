"""The private servers of tests/_private_servers.py: a committed write survives kill -9."""

from __future__ import annotations

import psycopg
import redis

from tests._private_servers import private_postgres_or_skip, private_redis_or_skip


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
