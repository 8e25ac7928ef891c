"""``touba demo``: an offline support scenario on the embedded defaults.

SQLite under a private ``.touba/`` directory and a scripted model: the
history is trimmed by complete exchanges, summarised, kept across a restart,
and a second worker is refused while the first holds the conversation.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from touba.cli._common import console, private_directory, run
from touba.errors import DecisionHistoryBusy
from touba.history import HistoryConfig, HistoryEvent, SummaryRequest
from touba.history.sqlite import SqliteHistoryStore
from touba.providers import CapabilitySpec, DecisionRequest, Observation
from touba.testing import ScriptedProvider

NAMESPACE = "touba-demo"
ORDERS = {"A1": "shipped", "B2": "in transit", "C3": "delivered", "D4": "refund pending"}
LOOKUP = CapabilitySpec(
    "lookup_order",
    "Look up the status of an order.",
    {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)


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


def _model(history: HistoryConfig) -> ScriptedProvider:
    """The scripted model: one lookup per order, then a final answer."""
    steps: list[dict[str, Any]] = [
        ScriptedProvider.call("lookup_order", order_id=o) for o in ORDERS
    ]
    steps.append(ScriptedProvider.final("All four orders checked; D4's refund is pending."))
    return ScriptedProvider(*steps, history=history)


async def _invoke(db: Path, run_id: str, events: list[HistoryEvent]) -> None:
    async with SqliteHistoryStore(db) as store:
        provider = _model(
            HistoryConfig(
                store=store,
                namespace=NAMESPACE,
                max_messages=4,
                summarize=summarize,
                max_summary_bytes=512,
                on_event=events.append,
            )
        )
        observations: list[Observation] = []
        while True:
            decision = await provider.decide(
                DecisionRequest(
                    run_id=run_id,
                    invocation_id="inv-1",
                    agent_ref="support",
                    instructions="You are a support agent. Check every order of the customer.",
                    input="Where are my orders A1, B2, C3 and D4?",
                    capabilities=(LOOKUP,),
                    observations=observations,
                )
            )
            if not decision.calls:
                console.print(f"[bold green]agent[/]: {decision.output}")
                return
            observations = [
                Observation(
                    c.call_id,
                    c.name,
                    c.arguments,
                    "ok",
                    {"status": ORDERS[str(c.arguments["order_id"])]},
                )
                for c in decision.calls
            ]
            console.print(
                f"[cyan]model[/] calls {decision.calls[0].name}({decision.calls[0].arguments})"
            )


def _events_table(events: list[HistoryEvent]) -> Table:
    table = Table("event", "messages", "bytes", "details", title="History events (no content)")
    for event in events:
        details = {
            k: v
            for k, v in event.to_dict().items()
            if k not in ("kind", "session_key", "message_count", "bytes")
        }
        table.add_row(
            event.kind,
            str(event.message_count),
            str(event.bytes),
            ", ".join(f"{k}={v}" for k, v in details.items()),
        )
    return table


async def _restart(db: Path, run_id: str) -> str:
    """A new process would do exactly this: open the file and read it back."""
    async with SqliteHistoryStore(db) as store:
        rows = [
            r for r in await store.list(NAMESPACE) if r.identity and r.identity["run_id"] == run_id
        ]
        (row,) = rows
        record = await store.read(row.key)
        assert record is not None
        stats = record["stats"]
        console.print(
            f"after restart: conversation {row.key[:24]}… holds {stats['exchanges']} exchanges, "
            f"{stats['messages']} messages, {stats['bytes']} bytes (trimming deleted nothing); "
            f"summary covers {record['summary']['through']} exchanges"
        )
        return row.key


async def _busy(db: Path, key: str) -> None:
    async with SqliteHistoryStore(db) as first, SqliteHistoryStore(db) as second:
        holding = asyncio.Event()
        release = asyncio.Event()

        async def hold(record: dict[str, Any] | None) -> tuple[dict[str, Any] | None, None]:
            holding.set()
            await release.wait()
            return record, None

        task = asyncio.create_task(first.transact(key, hold))
        await holding.wait()
        try:
            await second.read(key)
        except DecisionHistoryBusy as e:
            console.print(f"second worker while the first holds it: [yellow]{e.code}[/]")
        finally:
            release.set()
            await task


async def _demo(directory: Path) -> None:
    db = private_directory(directory) / "history.sqlite"
    async with SqliteHistoryStore(db) as store:  # start from a clean demo namespace
        for row in await store.list(NAMESPACE):
            if not row.active:
                await store.delete(row.key)
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    console.rule("1. An agent checks four orders (window: 4 messages, summary on)")
    events: list[HistoryEvent] = []
    await _invoke(db, run_id, events)
    console.print(_events_table(events))
    console.rule("2. Restart: read the conversation back from SQLite")
    key = await _restart(db, run_id)
    console.rule("3. Two workers on one conversation")
    await _busy(db, key)
    console.print(f"\nInspect it yourself: touba history ls --db {db}")


def demo(
    directory: Annotated[
        Path, typer.Option("--dir", help="Private state directory (created 0700).")
    ] = Path(".touba"),
) -> None:
    """Run the offline demo: trimming, summary, restart, busy (SQLite + scripted model)."""
    run(_demo(directory))
