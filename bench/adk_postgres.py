"""ToubaSessionService on PostgreSQL against ADK's own ``DatabaseSessionService``, side by side.

ADK's ``DatabaseSessionService`` (SQLAlchemy, here on PostgreSQL through psycopg 3)
stores events as rows too, but ``get_session`` with ``num_recent_events`` has no
index on ``(session, timestamp)`` to read the newest k by (adk-python #4827), and
its ``list_sessions`` reads the user states of the app one session at a time.
touba's PostgreSQL backend reads the newest k backwards on ``(sid, ts,
event_id)`` in the statement that reads the session and both states, and lists
an app in one statement.

Sessions holding N = 10, 100, 1,000 and 5,000 events of ~1 KiB (built through
each service's own ``append_event``) run in interleaved rounds (every system and
size once per round): one agent step, ``get_session(num_recent_events=20)`` then
``append_event`` of a 1 KiB event; then a whole ``get_session`` at each size;
then ``list_sessions`` of an app holding 5,000 sessions (50 users). Printed: the
median of each in ms, touba's then ADK's, and their ratio (touba / ADK), with
each system's growth from the smallest to the largest session. Both use the
same server, each in a schema of its own, dropped at the end. Benchmarks are
not tests: nothing here asserts a time.

    .venv/bin/python bench/adk_postgres.py [--quick] [--sizes 10,100,1000,5000]
        [--rounds 30] [--sessions 5000]

Needs the PostgreSQL server of ``TOUBA_POSTGRES_DSN`` (default
postgresql://postgres@127.0.0.1:5432/test) and ``sqlalchemy[asyncio]`` (the
``dev`` extra).
"""

from __future__ import annotations

import functools
import os
import sys
import uuid
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from google.adk.sessions import BaseSessionService
from google.adk.sessions.database_session_service import DatabaseSessionService
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from bench._adk import APP, USER, compare, one_event, run
from touba.integrations.adk import ToubaSessionService

DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def sqlalchemy_url(dsn: str) -> str:
    """The SQLAlchemy URL (psycopg 3, async) of a libpq DSN."""
    info = conninfo_to_dict(dsn)
    user = info.get("user", "postgres")
    password = f":{info['password']}" if info.get("password") else ""
    host, port = info.get("host", "127.0.0.1"), info.get("port", "5432")
    return f"postgresql+psycopg://{user}{password}@{host}:{port}/{info.get('dbname', 'test')}"


async def fill(service: BaseSessionService, session_id: str, n: int, t0: float) -> None:
    session = await service.create_session(app_name=APP, user_id=USER, session_id=session_id)
    for i in range(n):
        await service.append_event(session, one_event(i, t0 + i))


async def main(sizes: list[int], rounds: int, sessions: int) -> None:
    tag = uuid.uuid4().hex[:8]
    ours_schema, theirs_schema = f"touba_bench_adk_{tag}", f"adk_bench_{tag}"
    try:
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            for schema in (ours_schema, theirs_schema):
                await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    except psycopg.OperationalError as e:
        print(f"bench/adk_postgres.py skipped: PostgreSQL is not reachable at {DSN} ({e})")
        return
    touba = ToubaSessionService.postgres(DSN, table_prefix=f"{ours_schema}.adk")
    adk = DatabaseSessionService(
        sqlalchemy_url(DSN), connect_args={"options": f"-csearch_path={theirs_schema}"}
    )
    try:
        fills = (functools.partial(fill, touba), functools.partial(fill, adk))
        await compare(touba, adk, fills, sizes, rounds, sessions)
    finally:
        await touba.close()
        await adk.close()
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            for schema in (ours_schema, theirs_schema):
                await conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


if __name__ == "__main__":
    run(__doc__ or "", main)
