"""The PostgreSQL server behind a :class:`~tests._netproxy.NetProxy`, for the deadline tests.

Every PostgreSQL store's deadline tests (``tests/*/test_pg_deadlines.py``) use
:func:`behind_proxy`: a schema of the test's own on the test server (dropped
afterwards), the proxy in front of the server, the DSN through the proxy for the
store under test and the direct one for checking what was stored.
:func:`fails_in_time` is the issue's bound: a call under a black hole fails with
the store's retryable typed error within its deadline plus one second.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql

from tests._netproxy import NetProxy, net_proxy
from tests._services import postgres_address, postgres_dsn
from touba.errors import ToubaError
from touba.history._pg import DeadlineExceeded

__all__ = ["DEADLINE", "GRACE", "Behind", "behind_proxy", "fails_in_time", "timed_out"]

DEADLINE = 1.0  # the stores' deadline_seconds in these tests
GRACE = 1.0  # the bound: a call fails within its deadline + 1 s
E = TypeVar("E", bound=ToubaError)


@dataclass(frozen=True)
class Behind:
    """A schema of the test's own, reached through ``proxy`` (``dsn``) or not (``direct``)."""

    proxy: NetProxy
    dsn: str
    direct: str
    schema: str

    def table(self, name: str) -> str:
        """``name`` in the test's schema."""
        return f"{self.schema}.{name}"


@contextmanager
def behind_proxy() -> Iterator[Behind]:
    """The test server behind a new proxy, with a schema dropped at the end."""
    direct = postgres_dsn()
    schema = "dl" + uuid.uuid4().hex[:12]
    with psycopg.connect(direct, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        with net_proxy(*postgres_address(direct)) as proxy:
            yield Behind(proxy, proxy.dsn(direct), direct, schema)
    finally:
        with psycopg.connect(direct, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def fails_in_time(call: Awaitable[Any], error: type[E]) -> E:
    """Await ``call``: it must raise ``error``, retryable, within DEADLINE + GRACE."""
    start = time.monotonic()
    with pytest.raises(error) as caught:
        await call
    took = time.monotonic() - start
    assert took < DEADLINE + GRACE, f"{error.__name__} after {took:.2f} s"
    assert caught.value.retryable
    return caught.value


def timed_out(error: BaseException) -> bool:
    """True when ``error``'s chain holds the deadline's own failure."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, DeadlineExceeded):
            return True
        seen = seen.__cause__
    return False
