"""``touba demo``: an offline support scenario on the embedded defaults.

SQLite under a private ``.touba/`` directory and a scripted model. A support
agent checks four orders (its history is trimmed by complete exchanges and
summarised), then asks to refund one: the refund needs approval, so the
invocation stops with a durable checkpoint. A *new process* resumes it with
the approval; the conversation is then read back from the file, with every
exchange retained, and a second worker is refused while a first one holds it.
Last, chat sessions: a key event a user's session opens is in the system
prompt of that user's next session, and not in an anonymous visitor's.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from touba.cli._common import console, print_table, private_directory, run
from touba.cli._common import table as make_table
from touba.errors import DecisionHistoryBusy
from touba.history import HistoryConfig, SummaryRequest
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import ChatSession, SqliteMemoryStore
from touba.runtime import InvocationResult, Program, Runtime, SqliteCheckpointStore
from touba.testing import ScriptedProvider

NAMESPACE = "touba-demo"
AGENT = "support"
ORDERS = {"A1": "shipped", "B2": "in transit", "C3": "delivered", "D4": "refund requested"}


async def summarize(request: SummaryRequest) -> str:
    """A deterministic summariser (no model call), for an offline demo."""
    looked_up = [
        f"{m['arguments'].get('order_id')}={m.get('result', {}).get('status')}"
        for exchange in request.turns
        for m in exchange
        if m.get("kind") == "result"
    ]
    previous = f"{request.previous_summary} " if request.previous_summary else ""
    return f"{previous}Looked up: {', '.join(looked_up)}."[: request.max_bytes]


def _steps(resuming: bool) -> list[dict[str, Any]]:
    """What the scripted model answers: lookups and a refund, or (resumed) the final word."""
    if resuming:
        return [ScriptedProvider.final("Orders checked; the refund of D4 is approved and issued.")]
    lookups = [ScriptedProvider.call("lookup_order", order_id=o) for o in ORDERS]
    return [*lookups, ScriptedProvider.call("refund_order", order_id="D4", amount=42)]


def _program(store: SqliteHistoryStore, resuming: bool, on_event: Any = None) -> Program:
    program = Program()

    @program.capability(permissions=("orders:read",))
    async def lookup_order(order_id: str) -> dict[str, str]:
        """Look up the status of an order."""
        return {"status": ORDERS.get(order_id, "unknown")}

    @program.capability(permissions=("orders:refund",), requires_approval=True)
    async def refund_order(order_id: str, amount: int) -> dict[str, Any]:
        """Refund an order (a person approves it first)."""
        return {"refunded": order_id, "amount": amount}

    history = HistoryConfig(
        store=store,
        namespace=NAMESPACE,
        max_messages=4,
        summarize=summarize,
        max_summary_bytes=512,
        on_event=on_event,
    )
    program.agent(
        AGENT,
        provider=ScriptedProvider(*_steps(resuming), history=history),
        instructions="You are a support agent. Check every order, refund what is due.",
        capabilities=("lookup_order", "refund_order"),
        grants=("orders:read", "orders:refund"),
    )
    return program


def _events_table(result: InvocationResult) -> Table:
    table = make_table("history event", "messages", "bytes", "details", title="Trace (no content)")
    for entry in result.trace:
        if entry.kind != "history_event":
            continue
        data = dict(entry.data)
        kind = data.pop("event")
        details = {
            k: v for k, v in data.items() if k not in ("session_key", "message_count", "bytes")
        }
        table.add_row(
            str(kind),
            str(data.get("message_count")),
            str(data.get("bytes")),
            ", ".join(f"{k}={v}" for k, v in details.items()),
        )
    return table


async def _first_process(directory: Path, run_id: str) -> InvocationResult:
    async with AsyncExitStack() as stack:
        store = await stack.enter_async_context(SqliteHistoryStore(directory / "history.sqlite"))
        checkpoints = await stack.enter_async_context(
            SqliteCheckpointStore(directory / "checkpoints.sqlite")
        )
        runtime = Runtime(_program(store, resuming=False), checkpoints=checkpoints)
        result = await runtime.invoke(
            AGENT, "Where are my orders A1, B2, C3 and D4?", run_id=run_id
        )
    for entry in result.trace:
        if entry.kind == "call":
            console.print(f"[cyan]model[/] calls {entry.get('name')}({entry.get('arguments')})")
    print_table(_events_table(result))
    return result


async def _resume(directory: Path, checkpoint_id: str, call_id: str) -> None:
    """The second process: same files, a new Runtime, the approval."""
    async with AsyncExitStack() as stack:
        store = await stack.enter_async_context(SqliteHistoryStore(directory / "history.sqlite"))
        checkpoints = await stack.enter_async_context(
            SqliteCheckpointStore(directory / "checkpoints.sqlite")
        )
        runtime = Runtime(_program(store, resuming=True), checkpoints=checkpoints)
        result = await runtime.resume(checkpoint_id, approvals={call_id: True})
    lost = any(e.get("event") == "resumed_without_messages" for e in result.trace)
    console.print(
        f"resumed invocation {result.invocation_id[:8]}… (same identity) -> {result.status}; "
        f"history messages {'LOST' if lost else 'found in SQLite'}"
    )
    console.print(f"[bold green]agent[/]: {result.output}")


async def _read_back(directory: Path, run_id: str) -> str:
    """After both processes closed: open the file and read the conversation."""
    async with SqliteHistoryStore(directory / "history.sqlite") as store:
        (row,) = [
            r for r in await store.list(NAMESPACE) if (r.identity or {}).get("run_id") == run_id
        ]
        record = await store.read(row.key)
    assert record is not None
    stats, summary = record["stats"], record["summary"]
    console.print(
        f"conversation {row.key[:24]}… retains {stats['exchanges']} exchanges, "
        f"{stats['messages']} messages, {stats['bytes']} bytes (trimming deleted nothing); "
        f"its summary covers {summary['through'] if summary else 0} of them"
    )
    return row.key


async def _busy(directory: Path, key: str) -> None:
    db = directory / "history.sqlite"
    async with SqliteHistoryStore(db) as first, SqliteHistoryStore(db) as second:
        holding, release = asyncio.Event(), asyncio.Event()

        async def hold(record: dict[str, Any] | None) -> tuple[dict[str, Any] | None, None]:
            holding.set()
            await release.wait()
            return record, None

        task = asyncio.create_task(first.transact(key, hold))
        await holding.wait()
        try:
            await second.read(key)
        except DecisionHistoryBusy as e:
            console.print(f"a second worker while the first holds it: [yellow]{e.code}[/]")
        finally:
            release.set()
            await task


async def _key_events(directory: Path) -> str:
    """Two sessions of one user, then an anonymous one (SPEC section 9)."""
    from touba.cli._demo_program import build_program

    user = f"u-{uuid.uuid4().hex[:6]}"
    runtime = Runtime(build_program())
    async with SqliteMemoryStore(directory / "memory.sqlite") as store:
        visits = (
            (user, "I want a refund for order D4, please."),
            (user, "Hello again, any news?"),
            (None, "Hello, any news?"),
        )
        for number, (user_id, text) in enumerate(visits, start=1):
            async with ChatSession(runtime, "support", user_id, store=store) as session:
                turn = await session.send(text)
                await session.end()
            who = f"user {user_id}" if user_id else "an anonymous visitor"
            console.print(f"session {number}, {who}: [cyan]{text}[/]")
            console.print(f"  [bold green]agent[/]: {turn.reply}")
    return user


async def _clean(directory: Path) -> None:
    async with SqliteHistoryStore(directory / "history.sqlite") as store:
        for row in await store.list(NAMESPACE):
            if not row.active:
                await store.delete(row.key)


def _demo(directory: Path) -> None:
    directory = private_directory(directory)
    run(_clean(directory))
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    console.rule("1. The agent checks four orders (window: 4 messages, summary on)")
    result = run(_first_process(directory, run_id))
    (pending,) = result.pending
    console.print(
        f"[yellow]{result.status}[/]: {pending.name}({dict(pending.arguments)}) waits for a "
        f"person; checkpoint {result.checkpoint_id} is saved in checkpoints.sqlite"
    )
    console.rule("2. A new process approves and resumes it")
    assert result.checkpoint_id is not None
    command = [
        sys.executable,
        "-m",
        "touba.cli",
        "demo",
        "--dir",
        str(directory),
        "--resume",
        result.checkpoint_id,
        "--approve",
        pending.call_id,
    ]
    subprocess.run(command, check=True)
    console.rule("3. After restart: read the conversation back from SQLite")
    key = run(_read_back(directory, run_id))
    console.rule("4. Two workers on one conversation")
    run(_busy(directory, key))
    console.rule("5. Key events across sessions (a loop agent writes them during the turn)")
    user = run(_key_events(directory))
    console.print(
        f"\nInspect it yourself: touba history ls --db {directory / 'history.sqlite'}\n"
        f"                     touba events ls --db {directory / 'memory.sqlite'} --user {user}"
    )


def demo(
    directory: Annotated[
        Path, typer.Option("--dir", help="Private state directory (created 0700).")
    ] = Path(".touba"),
    resume: Annotated[str | None, typer.Option(hidden=True)] = None,
    approve: Annotated[str | None, typer.Option(hidden=True)] = None,
) -> None:
    """Run the offline demo: trimming, summary, approval across processes, restart, busy."""
    if resume is not None:  # the demo's second process
        run(_resume(directory, resume, approve or ""))
        return
    _demo(directory)
