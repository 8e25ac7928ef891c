"""The test proxy itself: it relays, delays, counts round trips, cuts and black-holes."""

from __future__ import annotations

import socket
import time

import psycopg
import pytest

from tests._netproxy import NetProxy, net_proxy
from tests._services import postgres_address, postgres_dsn


def _pg(dsn: str) -> tuple[str, int]:
    return postgres_address(dsn)


def test_it_relays_and_counts_one_round_trip_per_query() -> None:
    host, port = _pg(postgres_dsn())
    with net_proxy(host, port) as proxy, psycopg.connect(proxy.dsn(postgres_dsn())) as conn:
        conn.autocommit = True
        proxy.reset_counts()
        for _ in range(5):
            assert conn.execute("select 1").fetchone() == (1,)
        assert proxy.round_trips == 5


def test_delay_adds_the_round_trip_time() -> None:
    host, port = _pg(postgres_dsn())
    with net_proxy(host, port) as proxy, psycopg.connect(proxy.dsn(postgres_dsn())) as conn:
        conn.autocommit = True
        proxy.delay(40)
        start = time.monotonic()
        for _ in range(5):
            conn.execute("select 1")
        assert time.monotonic() - start >= 5 * 0.040


def test_a_black_hole_answers_nothing_and_restore_lets_new_connections_through() -> None:
    host, port = _pg(postgres_dsn())
    with net_proxy(host, port) as proxy:
        proxy.black_hole()
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=0.3)
        sock.sendall(b"hello")
        with pytest.raises(TimeoutError):
            sock.recv(10)  # silent, not closed
        sock.close()
        proxy.restore()
        with psycopg.connect(proxy.dsn(postgres_dsn()), connect_timeout=3) as conn:
            assert conn.execute("select 2").fetchone() == (2,)


def test_refuse_resets_open_and_new_connections_until_restore() -> None:
    host, port = _pg(postgres_dsn())
    with net_proxy(host, port) as proxy, psycopg.connect(proxy.dsn(postgres_dsn())) as conn:
        conn.autocommit = True
        proxy.refuse()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
        start = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(proxy.dsn(postgres_dsn()), connect_timeout=5)
        assert time.monotonic() - start < 4  # reset at once, not left to time out
        proxy.restore()
        with psycopg.connect(proxy.dsn(postgres_dsn()), connect_timeout=3) as again:
            assert again.execute("select 3").fetchone() == (3,)


def test_cut_on_resets_the_connection_that_sends_the_chunk() -> None:
    host, port = _pg(postgres_dsn())
    with net_proxy(host, port) as proxy, psycopg.connect(proxy.dsn(postgres_dsn())) as conn:
        conn.autocommit = True
        proxy.cut_on(1)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")


def test_it_refuses_a_target_beyond_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        NetProxy("192.0.2.1", 5432)
