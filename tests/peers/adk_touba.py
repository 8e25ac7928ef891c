"""Factories for the ADK contract suite (peers/adk): ToubaSessionService on one touba store.

``ADK_TOUBA_STORE`` names the store (``memory``, ``sqlite``, ``postgres``,
``redis``); :func:`make_service` is the suite's ``ADK_SESSION_SERVICE_FACTORY``
(``tests.peers.adk_touba:make_service``). Each call with the same ``tmp_path``
reopens the same data (SQLite: a private directory in it; PostgreSQL: a schema
named from it; Redis: a key prefix named from it), so the durable stores run
the suite's persistent tests too. ``ADK_TOUBA_RUN`` (set by
``tests/peers/run_adk.py``) tags the PostgreSQL schemas and Redis prefixes of
one run, which :func:`cleanup` removes at its end.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from touba.integrations.adk import ToubaSessionService

DIVERGENCES: dict[str, str] = {}  # none: ToubaSessionService passes every contract test

STORES = ("memory", "sqlite", "postgres", "redis")
DEFAULT_POSTGRES_DSN = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def suite_env(store: str, root: Path, **extra: str) -> dict[str, str]:
    """This process's environment with the suite's factory set to ``store``'s service
    (any ``ADK_SESSION_SERVICE_*`` of its own dropped), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADK_SESSION_SERVICE_")}
    env.update(
        ADK_SESSION_SERVICE_FACTORY="tests.peers.adk_touba:make_service",
        ADK_SESSION_SERVICE_PATH=str(root),
        ADK_SESSION_SERVICE_NAME=f"touba_{store}",
        ADK_SESSION_SERVICE_PERSISTENT="0" if store == "memory" else "1",
        ADK_TOUBA_STORE=store,
        **extra,
    )
    return env


def run_tag() -> str:
    """The tag of this run's schemas and prefixes (lower-case hex)."""
    return os.environ.get("ADK_TOUBA_RUN", "local")


def _name(tmp_path: Path) -> str:
    return hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]


def schema_prefix() -> str:
    """Every PostgreSQL schema of this run starts with it."""
    return f"touba_adk_peers_{run_tag()}_"


def redis_prefix() -> str:
    """Every Redis key of this run starts with it."""
    return f"touba-adk-peers:{run_tag()}:"


def open_service(store: str, tmp_path: Path) -> ToubaSessionService:
    """A ToubaSessionService on ``store``, on the data that ``tmp_path`` names."""
    if store == "memory":
        return ToubaSessionService.memory()
    if store == "sqlite":
        directory = tmp_path / "touba"
        directory.mkdir(mode=0o700, exist_ok=True)
        return ToubaSessionService.sqlite(directory / "adk.sqlite")
    if store == "postgres":
        import psycopg
        from psycopg import sql

        dsn = os.environ.get("TOUBA_POSTGRES_DSN", DEFAULT_POSTGRES_DSN)
        schema = schema_prefix() + _name(tmp_path)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        return ToubaSessionService.postgres(dsn, table_prefix=f"{schema}.adk")
    if store == "redis":
        url = os.environ.get("TOUBA_REDIS_URL", DEFAULT_REDIS_URL)
        return ToubaSessionService.redis(url, prefix=f"{redis_prefix()}{_name(tmp_path)}:")
    raise ValueError(f"ADK_TOUBA_STORE must be one of {', '.join(STORES)}, got {store!r}")


@contextlib.asynccontextmanager
async def make_service(tmp_path: Path) -> AsyncIterator[ToubaSessionService]:
    """The suite's factory: the store ``ADK_TOUBA_STORE`` names, closed at the end."""
    async with open_service(os.environ.get("ADK_TOUBA_STORE", "memory"), tmp_path) as service:
        yield service


def cleanup(store: str) -> None:
    """Drop this run's PostgreSQL schemas or Redis keys."""
    if store == "postgres":
        import psycopg
        from psycopg import sql

        dsn = os.environ.get("TOUBA_POSTGRES_DSN", DEFAULT_POSTGRES_DSN)
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s)",
                (schema_prefix(),),
            ).fetchall()
            for (schema,) in rows:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    elif store == "redis":
        import redis

        url = os.environ.get("TOUBA_REDIS_URL", DEFAULT_REDIS_URL)
        with redis.Redis.from_url(url) as client:
            keys = list(client.scan_iter(match=redis_prefix() + "*", count=1000))
            if keys:
                client.delete(*keys)
