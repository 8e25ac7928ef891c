"""Fixtures for the CLI on PostgreSQL and Redis: a store of the test's own, behind a password.

``pg`` is a fresh schema (``touba_cli_<random>``, dropped with everything in it
at teardown) reached by a DSN whose ``search_path`` is that schema, so the
commands' default table names never collide between tests. ``redis`` is a key
prefix of the test's own (``touba-cli-test:<uuid>:``, its keys deleted at
teardown). Both addresses carry a password, the configured one or, when the
server's address has none, a made-up one that trust auth (PostgreSQL) and a
server without ``requirepass`` (Redis) ignore, so that a test can check that
no output ever shows it. Without a reachable server these tests are skipped,
except under ``CI=true`` (see ``tests/_services.py``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

from tests._services import postgres_dsn, redis_url

MADE_UP_PASSWORD = "Sw0rdfish-not-4-print"


@dataclass(frozen=True, slots=True)
class Server:
    """An address of a store of this test alone, and the password it carries."""

    address: str
    password: str
    place: str  # the schema (PostgreSQL) or the key prefix (Redis)


def _with_password(url: str) -> tuple[str, str]:
    """``url`` (URL form) and its password, a made-up one added if it has none."""
    parts = urlsplit(url)
    if parts.password:
        return url, parts.password
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}:{quote(MADE_UP_PASSWORD, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc)), MADE_UP_PASSWORD


def _postgres_address(base: str, schema: str) -> tuple[str, str]:
    """A DSN to ``base``'s database with a password and ``search_path`` = ``schema``."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    if "://" in base:
        dsn, password = _with_password(base)
        separator = "&" if urlsplit(dsn).query else "?"
        return f"{dsn}{separator}options=-csearch_path%3D{schema}", password
    password = str(conninfo_to_dict(base).get("password") or MADE_UP_PASSWORD)
    return make_conninfo(base, password=password, options=f"-csearch_path={schema}"), password


@pytest.fixture
def pg() -> Iterator[Server]:
    import psycopg
    from psycopg import sql

    base = postgres_dsn()
    schema = f"touba_cli_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    dsn, password = _postgres_address(base, schema)
    try:
        yield Server(dsn, password, schema)
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def redis() -> Iterator[Server]:
    from redis.asyncio import Redis

    url, password = _with_password(redis_url())
    prefix = f"touba-cli-test:{uuid.uuid4().hex}:"
    try:
        yield Server(url, password, prefix)
    finally:

        async def clean() -> None:
            client = Redis.from_url(url)
            keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
            if keys:
                await client.delete(*keys)
            await client.aclose()

        asyncio.run(clean())
