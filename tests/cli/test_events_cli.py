"""`touba events`, `touba worker` and `touba chat` on a SQLite memory store."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from touba import ChatSession, KeyEventsConfig, MemoryConfig
from touba.cli import _common
from touba.cli._app import app
from touba.memory import ExtractionQueue, KeyEventService, SqliteMemoryStore, owner_for
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider

runner = CliRunner()
CONFIG = KeyEventsConfig(enabled=True, types=("refund", "account issue"))
WORKER_MODEL = ScriptedProvider()
APPROVAL_MODEL = ScriptedProvider()
REFUNDS: list[str] = []


def worker_program() -> Program:
    """The program `touba worker --program tests.cli.test_events_cli:worker_program` loads."""
    program = Program()
    program.agent(
        "assistant",
        provider=WORKER_MODEL,
        kind="agent",
        memory=MemoryConfig(key_events=CONFIG),
    )
    return program


@pytest.fixture
def db(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    return directory / "memory.db"


def invoke(*args: str, input: str | None = None) -> str:
    result = runner.invoke(app, list(args), input=input, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


async def _seed(db: Path) -> tuple[str, str]:
    async with SqliteMemoryStore(db) as store:
        service = KeyEventService(store, CONFIG)
        alice = owner_for("alice", "s-1")
        refund = await service.create(alice, "refund", "Refund order A1", "broken", "s-1")
        await service.update(alice, refund.id, status="in_progress", session_id="s-2")
        await service.update(alice, refund.id, status="closed", details="paid", session_id="s-3")
        await service.create(alice, "account issue", "Locked out", "", "s-2")
        anonymous = owner_for(None, "anon-1")
        hidden = await service.create(anonymous, "refund", "Anonymous refund", "", "anon-1")
        return refund.id, hidden.id


def test_events_ls_lists_a_users_open_events_or_all_of_them(db: Path) -> None:
    refund_id, _ = asyncio.run(_seed(db))
    listed = invoke("events", "ls", "--db", str(db), "--user", "alice")
    assert "Locked out" in listed
    assert refund_id not in listed  # closed
    assert "1 event(s) not closed" in listed
    every = invoke("events", "ls", "--db", str(db), "--user", "alice", "--all")
    assert refund_id in every
    assert "2 event(s) of user:alice" in every
    in_session = invoke("events", "ls", "--db", str(db), "-u", "alice", "-s", "s-2", "--all")
    assert "Locked out" in in_session
    assert refund_id not in in_session  # created in s-1


def test_events_ls_by_session_shows_what_that_session_sees(db: Path) -> None:
    _, hidden_id = asyncio.run(_seed(db))
    anonymous = invoke("events", "ls", "--db", str(db), "--session", "anon-1")
    assert hidden_id in anonymous
    assert "session:anon-1" in anonymous
    other = invoke("events", "ls", "--db", str(db), "--session", "anon-2")
    assert "0 event(s)" in other  # the FAQ: another anonymous session does not find it
    missing = runner.invoke(app, ["events", "ls", "--db", str(db)])
    assert missing.exit_code == 2
    assert "--user" in missing.output


def test_events_show_prints_an_event_and_its_update_history(db: Path) -> None:
    refund_id, _ = asyncio.run(_seed(db))
    shown = invoke("events", "show", refund_id, "--db", str(db))
    for expected in ("user:alice", "Refund order A1", "closed", "paid", "in_progress", "s-3"):
        assert expected in shown
    assert "2 update(s)" in shown
    as_owner = invoke("events", "show", refund_id, "--db", str(db), "--user", "alice")
    assert "2 update(s)" in as_owner
    other_owner = runner.invoke(app, ["events", "show", refund_id, "--db", str(db), "-u", "bob"])
    assert other_owner.exit_code == 1  # another owner's id reads as not found
    unknown = runner.invoke(app, ["events", "show", "ke_nope", "--db", str(db)])
    assert unknown.exit_code == 1
    assert "no key event ke_nope" in unknown.output


def test_events_commands_never_create_a_database(tmp_path: Path) -> None:
    missing = tmp_path / "absent.db"
    result = runner.invoke(app, ["events", "ls", "--db", str(missing), "--user", "a"])
    assert result.exit_code == 1
    assert "no memory database" in result.output
    assert not missing.exists()


async def end_without_extracting(store: Any, *, max_attempts: int = 5) -> str:
    """A session of an Agent on ``store`` ends and its process dies before any extraction."""
    model = ScriptedProvider(ScriptedProvider.final("Noted, I passed it on."))
    program = Program()
    program.agent("assistant", provider=model, kind="agent", memory=MemoryConfig(key_events=CONFIG))
    async with store:
        session = ChatSession(
            Runtime(program),
            "assistant",
            "u-7",
            store=store,
            extract_in_background=False,
            queue=ExtractionQueue(store, max_attempts=max_attempts),
        )
        await session.send("My parcel A1 arrived broken, I want a refund")
        job = await session.end()
        assert job is not None
    return job.id


def test_a_queued_job_survives_the_crash_and_touba_worker_once_runs_it(db: Path) -> None:
    job_id = asyncio.run(end_without_extracting(SqliteMemoryStore(db)))
    pending = invoke("events", "jobs", "--db", str(db), "--status", "pending")
    assert job_id in pending
    op = {"kind": "create", "type": "refund", "title": "Refund A1", "details": "broken"}
    WORKER_MODEL.add(ScriptedProvider.final({"ops": [op]}))
    program = "tests.cli.test_events_cli:worker_program"
    ran = invoke("worker", "--db", str(db), "--once", "--program", program)
    assert "done: 1 created" in ran
    assert "1 job attempt(s) run" in ran
    assert "Refund A1" in invoke("events", "ls", "--db", str(db), "--user", "u-7")
    again = invoke("worker", "--db", str(db), "--once", "--program", program)
    assert "0 job attempt(s) run" in again  # done once, never run twice
    assert "arrived broken" in str(WORKER_MODEL.requests[-1].input)


def test_a_job_the_worker_cannot_run_fails_visibly_and_can_be_requeued(db: Path) -> None:
    job_id = asyncio.run(end_without_extracting(SqliteMemoryStore(db), max_attempts=1))
    wrong = "tests.cli.test_events_cli:other_program"
    ran = invoke("worker", "--db", str(db), "--once", "--program", wrong)
    assert "failed after 1 attempt(s)" in ran
    assert "'assistant' is not defined in this worker's program" in ran
    failed = invoke("events", "jobs", "--db", str(db), "--status", "failed")
    assert job_id in failed
    assert "1/1" in failed
    assert "is pending again" in invoke("events", "requeue", job_id, "--db", str(db))
    WORKER_MODEL.add(ScriptedProvider.final({"ops": []}))
    right = "tests.cli.test_events_cli:worker_program"
    assert "done: 0 created" in invoke("worker", "--db", str(db), "--once", "-p", right)
    refused = runner.invoke(app, ["events", "requeue", job_id, "--db", str(db)])
    assert refused.exit_code == 1
    assert "only a failed job" in refused.output


def test_worker_needs_a_program(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOUBA_PROGRAM", raising=False)
    result = runner.invoke(app, ["worker", "--db", str(db), "--once"])
    assert result.exit_code == 2
    assert "--program" in result.output
    bad = runner.invoke(app, ["worker", "--db", str(db), "--once", "--program", "nope"])
    assert bad.exit_code == 2
    assert "module:attr" in bad.output
    absent = runner.invoke(app, ["worker", "--db", str(db), "--program", "no_such_mod:x"])
    assert absent.exit_code == 2
    assert "cannot import" in absent.output


def test_chat_repl_remembers_turns_and_keeps_key_events_across_sessions(db: Path) -> None:
    base = ["chat", "--db", str(db), "--program", "demo", "--agent", "support", "-u", "ada"]
    first = invoke(*base, input="hello\nI want a refund for B2\nwhat now?\n/events\n/quit\n")
    assert "I was given 0 earlier turn(s)" in first
    assert "create_key_event" in first
    assert "I opened the case 'Refund for order B2'" in first
    assert "I was given 2 earlier turn(s); open key events: Refund for order B2" in first
    assert "[refund] Refund for order B2 (open)" in first
    second = invoke(*base, input="hi again\n")  # a new session of the same user
    assert "I was given 0 earlier turn(s); open key events: Refund for order B2" in second
    preview = invoke(*base, "--preview", input="hello\nhello again\n")
    assert "open key events: none" in preview  # preview: blank memory, no injection
    assert "I was given 1 earlier" not in preview
    anonymous = invoke(*base[:-2], input="hi\n")
    assert "open key events: none" in anonymous


def test_chat_end_extracts_the_key_events_of_an_agent_kind_session(db: Path) -> None:
    base = ["chat", "--db", str(db), "--program", "demo", "--agent", "assistant", "-u", "bo"]
    ended = invoke(*base, input="Where is C3? I need a refund for C3\n/end\n")
    assert "session ended" in ended
    assert "done: 1 created" in ended
    listed = invoke("events", "ls", "--db", str(db), "--user", "bo")
    assert "Refund for order C3" in listed
    assert "0 job attempt(s) run" in invoke("worker", "--db", str(db), "--once", "-p", "demo")


def test_chat_asks_for_approval_then_stores_the_turn(db: Path) -> None:
    APPROVAL_MODEL.add(
        ScriptedProvider.call("refund", order_id="A1"), ScriptedProvider.final("Refunded A1.")
    )
    base = ["chat", "--db", str(db), "-p", "tests.cli.test_events_cli:approval_program"]
    chatted = invoke(*base, "--agent", "support", input="Refund A1 please\ny\n")
    assert 'approve refund({"order_id":"A1"})? [y/N]' in chatted
    assert "refund(" in chatted
    assert "agent> Refunded A1." in chatted


def test_chat_offers_to_retry_a_turn_that_failed_after_its_calls_ran(db: Path) -> None:
    def down(request: object, messages: object) -> dict[str, object]:
        raise RuntimeError("503")

    REFUNDS.clear()
    APPROVAL_MODEL.add(
        ScriptedProvider.call("refund", order_id="A2"), down, ScriptedProvider.final("Refunded A2.")
    )
    base = ["chat", "--db", str(db), "-p", "tests.cli.test_events_cli:approval_program"]
    chatted = invoke(*base, "--agent", "support", input="Refund A2 please\ny\n\n")
    assert "AgentDecisionProviderUnavailable" in chatted
    assert "retry it? [Y/n]" in chatted
    assert "agent> Refunded A2." in chatted
    assert REFUNDS == ["A2"]  # the retry did not run the refund again


def test_chat_exits_non_zero_when_a_failed_turn_is_not_retried(db: Path) -> None:
    def down(request: object, messages: object) -> dict[str, object]:
        raise RuntimeError("503")

    REFUNDS.clear()
    APPROVAL_MODEL.add(ScriptedProvider.call("refund", order_id="A3"), down)
    base = ["chat", "--db", str(db), "-p", "tests.cli.test_events_cli:approval_program"]
    result = runner.invoke(
        app, [*base, "--agent", "support"], input="Refund A3\ny\nn\n", env={"COLUMNS": "200"}
    )
    assert result.exit_code == 1
    assert "not retried" in result.output
    assert REFUNDS == ["A3"]


def approval_program() -> Program:
    program = Program()

    @program.capability(requires_approval=True)
    async def refund(order_id: str) -> str:
        REFUNDS.append(order_id)
        return f"refunded {order_id}"

    program.agent("support", provider=APPROVAL_MODEL, capabilities=("refund",))
    return program


def other_program() -> Program:
    program = Program()
    program.agent("support", provider=WORKER_MODEL)
    return program


def test_events_ls_show_and_jobs_print_json(db: Path) -> None:
    refund_id, _ = asyncio.run(_seed(db))
    listed = json.loads(invoke("events", "ls", "--db", str(db), "-u", "alice", "--all", "--json"))
    assert listed["owner"] == "user:alice"
    assert {e["id"] for e in listed["events"]} >= {refund_id}
    shown = json.loads(invoke("events", "show", refund_id, "--db", str(db), "--json"))
    assert (shown["status"], shown["details"]) == ("closed", "paid")
    assert [c["new"] for u in shown["history"] for c in u["changes"]][:1] == ["in_progress"]
    job_id = asyncio.run(end_without_extracting(SqliteMemoryStore(db)))
    jobs = json.loads(invoke("events", "jobs", "--db", str(db), "--json"))["jobs"]
    assert [(j["id"], j["status"]) for j in jobs] == [(job_id, "pending")]
    assert "lease_token" not in jobs[0]


def test_a_done_job_no_longer_shows_an_error_of_an_earlier_attempt(db: Path) -> None:
    job_id = asyncio.run(end_without_extracting(SqliteMemoryStore(db)))
    with closing(sqlite3.connect(db)) as conn, conn:  # a row written by an older touba
        conn.execute(
            "UPDATE touba_memory_jobs SET status = 'done', last_error = 'TimeoutError: old'"
            " WHERE id = ?",
            (job_id,),
        )
    listed = invoke("events", "jobs", "--db", str(db))
    assert job_id in listed
    assert "TimeoutError" not in listed
    (job,) = json.loads(invoke("events", "jobs", "--db", str(db), "--json"))["jobs"]
    assert job["last_error"] is None


def test_events_ls_piped_never_cuts_an_id(db: Path) -> None:
    refund_id, _ = asyncio.run(_seed(db))
    result = runner.invoke(
        app, ["events", "ls", "--db", str(db), "-u", "alice", "--all"], env={"COLUMNS": "30"}
    )
    assert any(refund_id in line for line in result.output.splitlines())


def test_worker_once_over_many_jobs_shows_a_progress_bar_on_a_terminal(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(3):
        asyncio.run(end_without_extracting(SqliteMemoryStore(db)))
    for _ in range(3):
        WORKER_MODEL.add(ScriptedProvider.final({"ops": []}))
    screen = io.StringIO()
    monkeypatch.setattr(_common, "errors", Console(file=screen, force_terminal=True, width=100))
    ran = invoke(
        "worker", "--db", str(db), "--once", "-p", "tests.cli.test_events_cli:worker_program"
    )
    assert "3 job attempt(s) run" in ran
    assert "extraction jobs" in screen.getvalue()
    assert "3/3" in screen.getvalue()


def test_chat_handles_its_commands_itself(db: Path) -> None:
    base = ["chat", "--db", str(db), "--program", "demo", "--agent", "support", "-u", "cy"]
    chatted = invoke(*base, input="/help\n/nope\n/etc/hosts is empty\n/quit\n")
    for command in ("/help", "/events", "/end", "/quit"):
        assert f"  {command}: " in chatted
    assert "unknown command /nope (not sent to the agent)" in chatted
    assert "I was given 0 earlier turn(s)" in chatted  # only the last line was a message
    assert chatted.count("agent>") == 1
    assert "left; continue with --session" in chatted


def test_chat_refuses_an_ended_session_before_its_banner(db: Path) -> None:
    base = ["chat", "--db", str(db), "-p", "demo", "-a", "support", "-u", "di", "-s", "s-ended"]
    assert "session ended" in invoke(*base, "--new", input="hello\n/end\n")
    again = runner.invoke(app, base, input="hello again\n", env={"COLUMNS": "200"})
    assert again.exit_code == 1
    assert "session s-ended has ended" in again.output
    assert "/help" not in again.output  # no banner, no prompt
    assert "you>" not in again.output


def test_chat_exits_non_zero_when_a_turn_failed(db: Path) -> None:
    def down(request: object, messages: object) -> dict[str, object]:
        raise RuntimeError("503")

    APPROVAL_MODEL.add(down, ScriptedProvider.final("Back again."))
    base = ["chat", "--db", str(db), "-p", "tests.cli.test_events_cli:approval_program"]
    result = runner.invoke(
        app, [*base, "--agent", "support"], input="hello\nstill there?\n", env={"COLUMNS": "200"}
    )
    assert result.exit_code == 1
    assert "AgentDecisionProviderUnavailable" in result.output
    assert "agent> Back again." in result.output  # the session went on
    assert "1 turn(s) failed" in result.output
