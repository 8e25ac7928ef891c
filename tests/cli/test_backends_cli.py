"""Every `touba` command on PostgreSQL (``--dsn`` / ``TOUBA_DSN``) and the history ones on Redis.

Each test has a store of its own (a fresh schema, a fresh key prefix: see
``conftest.py``) reached by an address with a password, and checks that the
password never shows in what the command prints.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from tests.cli.conftest import Server
from tests.cli.test_cli import crash_holding
from tests.cli.test_events_cli import CONFIG, WORKER_MODEL, end_without_extracting
from touba.cli._app import app
from touba.cli._common import redact
from touba.history import ConversationIdentity, StoredConversation
from touba.history._record import join_record, new_head
from touba.memory import KeyEventService, owner_for
from touba.testing import ScriptedProvider

runner = CliRunner()
MiB = 1024 * 1024
WORKER = "tests.cli.test_events_cli:worker_program"


def invoke(server: Server, *args: str, code: int = 0, **env: str | None) -> Result:
    """Run a command; it must exit with ``code`` and never print the server's password."""
    result = runner.invoke(app, list(args), env={"COLUMNS": "500", **env})
    assert result.exit_code == code, result.output
    for text in (result.output, result.stdout, result.stderr):
        assert server.password not in text.replace("\n", "")
    return result


def chat(server: Server, *args: str, input: str) -> Result:
    result = runner.invoke(app, ["chat", *args], env={"COLUMNS": "500"}, input=input)
    assert result.exit_code == 0, result.output
    assert server.password not in result.output.replace("\n", "")
    return result


# -- history: PostgreSQL and Redis ----------------------------------------------------------


def _history_store(kind: str, server: Server, table: str | None = None) -> Any:
    if kind == "postgresql":
        from touba.history.postgres import PostgresHistoryStore

        return PostgresHistoryStore(server.address, table=table or "touba_history")
    from touba.history.redis import RedisHistoryStore

    return RedisHistoryStore(server.address, prefix=server.place)


async def _seed(store: Any, namespaces: tuple[str, ...] = ("ns", "other")) -> tuple[str, list[Any]]:
    keys = []
    async with store:
        for namespace in namespaces:
            identity = ConversationIdentity(namespace, "openai", "m", "native", "run", "inv", "a")
            head = new_head(identity)
            head["stats"] = {"exchanges": 1, "messages": 1, "bytes": 10}
            record = join_record(head, [[{"kind": "decision", "final": True, "output": "hi"}]])

            async def put(_: Any, record: dict[str, Any] = record) -> tuple[dict[str, Any], None]:
                return record, None

            await store.transact(identity.key, put)
            keys.append(identity.key)
        rows = await store.list()
    return keys[0], rows


def _usage(
    rows: list[StoredConversation], max_sessions: int = 128, max_bytes: int = 32 * MiB
) -> str:
    used = sum(row.bytes for row in rows)
    return f"store usage: {len(rows)}/{max_sessions} conversations, {used}/{max_bytes} bytes"


def _options(kind: str, server: Server) -> list[str]:
    if kind == "postgresql":
        return ["--dsn", server.address]
    return ["--redis-url", server.address, "--prefix", server.place]


BACKENDS = [
    pytest.param("postgresql", marks=pytest.mark.postgres, id="postgresql"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]


@pytest.fixture(params=BACKENDS)
def history(request: pytest.FixtureRequest) -> tuple[str, Server]:
    """A backend and the test's PostgreSQL schema or Redis prefix (the fixture of that name)."""
    kind: str = request.param
    server: Server = request.getfixturevalue("pg" if kind == "postgresql" else "redis")
    return kind, server


def test_history_ls_show_rm_with_usage(history: tuple[str, Server]) -> None:
    kind, server = history
    key, rows = asyncio.run(_seed(_history_store(kind, server)))
    options = _options(kind, server)
    listed = invoke(server, "history", "ls", *options).output
    assert "2 conversation(s)" in listed
    assert key in listed
    assert _usage(rows) in listed
    only = invoke(server, "history", "ls", *options, "-n", "ns", "--max-sessions", "4").output
    assert "1 conversation(s)" in only
    assert _usage(rows, max_sessions=4) + " (50% full)" in only  # usage is store-wide
    shown = invoke(server, "history", "show", key, *options).output
    assert "invocation_id" in shown
    assert "final" in shown
    raw = invoke(server, "history", "show", key, *options, "--json").output
    assert '"output": "hi"' in raw
    assert "deleted" in invoke(server, "history", "rm", key, *options).output
    invoke(server, "history", "show", key, *options, code=1)
    assert "no conversation" in invoke(server, "history", "rm", key, *options, code=1).output
    assert "purged 0 expired" in invoke(server, "history", "purge", *options).output


CRASH = """
import asyncio, sys
from touba.history.postgres import PostgresHistoryStore
from touba.history.redis import RedisHistoryStore

async def main():
    kind, address, place, key = sys.argv[1:]
    if kind == "postgresql":
        store = PostgresHistoryStore(address)
    else:
        store = RedisHistoryStore(address, prefix=place)
    async def hang(record):
        print("holding", flush=True)
        await asyncio.sleep(60)
        return record, None
    await store.transact(key, hang)

asyncio.run(main())
"""


def test_history_recover_frees_a_crashed_workers_reservation(history: tuple[str, Server]) -> None:
    kind, server = history
    key, _ = asyncio.run(_seed(_history_store(kind, server), ("ns",)))
    args = [sys.executable, "-c", CRASH, kind, server.address, server.place, key]
    crash_holding(args)
    options = _options(kind, server)
    busy = invoke(server, "history", "show", key, *options, code=1)
    assert "DecisionHistoryBusy" in busy.output
    assert "pid" in invoke(server, "history", "ls", *options).output
    refused = runner.invoke(app, ["history", "recover", key, *options], input="n\n")
    assert refused.exit_code == 1
    confirmed = runner.invoke(app, ["history", "recover", key, *options], input="y\n")
    assert confirmed.exit_code == 0, confirmed.output
    assert "reservation freed" in confirmed.output
    invoke(server, "history", "show", key, *options)
    again = invoke(server, "history", "recover", key, *options, "--worker-stopped", code=1)
    assert "no reservation" in again.output


@pytest.mark.postgres
def test_history_on_postgres_reads_touba_dsn_and_a_named_table(pg: Server) -> None:
    table = f"{pg.place}.app_history"  # schema-qualified, as an application may name it
    key, rows = asyncio.run(_seed(_history_store("postgresql", pg, table)))
    listed = invoke(pg, "history", "ls", "--table", table, TOUBA_DSN=pg.address).output
    assert "2 conversation(s)" in listed
    assert _usage(rows) in listed
    shown = invoke(pg, "history", "show", key, "--table", table, TOUBA_DSN=pg.address)
    assert "final" in shown.output
    missing = invoke(pg, "history", "ls", code=1, TOUBA_DSN=pg.address)  # touba_history
    assert "no touba history table 'touba_history' at" in missing.output
    assert redact(pg.address) in missing.output


@pytest.mark.postgres
def test_history_commands_never_create_postgres_tables(pg: Server) -> None:
    import psycopg

    for command in (["ls"], ["show", "k"], ["rm", "k"], ["purge"]):
        result = invoke(pg, "history", *command, "--dsn", pg.address, code=1)
        assert "nothing was created" in result.output
    with psycopg.connect(pg.address) as conn:
        count = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (pg.place,)
        ).fetchone()
    assert count == (0,)


# -- events, worker and chat: PostgreSQL ------------------------------------------------------


def _memory(pg: Server, prefix: str = "touba_memory") -> Any:
    from touba.memory.postgres import PostgresMemoryStore

    return PostgresMemoryStore(pg.address, prefix=prefix)


async def _seed_events(store: Any) -> tuple[str, str]:
    async with store:
        service = KeyEventService(store, CONFIG)
        alice = owner_for("alice", "s-1")
        refund = await service.create(alice, "refund", "Refund order A1", "broken", "s-1")
        await service.update(alice, refund.id, status="closed", details="paid", session_id="s-3")
        await service.create(alice, "account issue", "Locked out", "", "s-2")
        anonymous = owner_for(None, "anon-1")
        hidden = await service.create(anonymous, "refund", "Anonymous refund", "", "anon-1")
    return refund.id, hidden.id


@pytest.mark.postgres
def test_events_ls_and_show_on_postgres(pg: Server) -> None:
    refund_id, hidden_id = asyncio.run(_seed_events(_memory(pg)))
    dsn = ["--dsn", pg.address]
    listed = invoke(pg, "events", "ls", *dsn, "--user", "alice").output
    assert "Locked out" in listed
    assert "1 event(s) not closed" in listed
    every = invoke(pg, "events", "ls", *dsn, "--user", "alice", "--all").output
    assert refund_id in every
    assert hidden_id in invoke(pg, "events", "ls", *dsn, "--session", "anon-1").output
    shown = invoke(pg, "events", "show", refund_id, *dsn).output  # owner looked up
    for expected in ("user:alice", "Refund order A1", "closed", "paid", "1 update(s)"):
        assert expected in shown
    invoke(pg, "events", "show", refund_id, *dsn, "-u", "bob", code=1)
    assert "no key event ke_nope" in invoke(pg, "events", "show", "ke_nope", *dsn, code=1).output
    from_env = invoke(pg, "events", "ls", "-u", "alice", TOUBA_DSN=pg.address).output
    assert "Locked out" in from_env


@pytest.mark.postgres
def test_events_on_a_named_prefix_and_never_creating_tables(pg: Server) -> None:
    import psycopg

    prefix = f"{pg.place}.app_memory"
    refund_id, _ = asyncio.run(_seed_events(_memory(pg, prefix)))
    shown = invoke(pg, "events", "show", refund_id, "--dsn", pg.address, "--prefix", prefix)
    assert "Refund order A1" in shown.output
    for command in (["ls", "-u", "alice"], ["show", refund_id], ["jobs"], ["requeue", "j"]):
        missing = invoke(pg, "events", *command, "--dsn", pg.address, code=1).output
        assert "no touba memory tables with prefix 'touba_memory'" in missing
    missing = invoke(pg, "worker", "--once", "-p", WORKER, code=1, TOUBA_DSN=pg.address).output
    assert "nothing was created" in missing
    with psycopg.connect(pg.address) as conn:
        found = conn.execute("SELECT to_regclass('touba_memory_meta')").fetchone()
    assert found == (None,)


@pytest.mark.postgres
def test_worker_jobs_and_requeue_on_postgres(pg: Server) -> None:
    job_id = asyncio.run(end_without_extracting(_memory(pg), max_attempts=1))
    dsn = ["--dsn", pg.address]
    assert job_id in invoke(pg, "events", "jobs", *dsn, "--status", "pending").output
    wrong = "tests.cli.test_events_cli:other_program"
    ran = invoke(pg, "worker", *dsn, "--once", "--program", wrong).output
    assert "failed after 1 attempt(s)" in ran
    assert f" on {redact(pg.address)}" in ran
    assert job_id in invoke(pg, "events", "jobs", *dsn, "--status", "failed").output
    assert "is pending again" in invoke(pg, "events", "requeue", job_id, *dsn).output
    op = {"kind": "create", "type": "refund", "title": "Refund A1", "details": "broken"}
    WORKER_MODEL.add(ScriptedProvider.final({"ops": [op]}))
    done = invoke(pg, "worker", "--once", "-p", WORKER, TOUBA_DSN=pg.address).output
    assert "done: 1 created" in done
    assert "Refund A1" in invoke(pg, "events", "ls", *dsn, "--user", "u-7").output
    again = invoke(pg, "worker", *dsn, "--once", "-p", WORKER).output
    assert "0 job attempt(s) run" in again


@pytest.mark.postgres
def test_chat_on_postgres_keeps_key_events_across_sessions(pg: Server) -> None:
    base = ["--dsn", pg.address, "--program", "demo", "--agent", "support", "-u", "ada"]
    first = chat(pg, *base, input="hello\nI want a refund for B2\n/events\n/quit\n").output
    assert "I opened the case 'Refund for order B2'" in first
    assert "[refund] Refund for order B2 (open)" in first
    second = chat(pg, *base, input="hi again\n").output
    assert "I was given 0 earlier turn(s); open key events: Refund for order B2" in second
    ended = runner.invoke(
        app,
        ["chat", "-p", "demo", "-a", "assistant", "-u", "bo"],
        input="Where is C3? I need a refund for C3\n/end\n",
        env={"COLUMNS": "500", "TOUBA_DSN": pg.address},
    )
    assert ended.exit_code == 0, ended.output
    assert "done: 1 created" in ended.output
    assert pg.password not in ended.output
    assert (
        "Refund for order C3" in invoke(pg, "events", "ls", "--dsn", pg.address, "-u", "bo").output
    )
