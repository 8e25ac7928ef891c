"""A program shared by a test and the subprocess that pauses it (``python -m``).

``python -m tests.runtime._durable DIRECTORY HISTORY`` invokes the billing
agent until it awaits approval, with a SQLite checkpoint store in DIRECTORY
and a SQLite (``HISTORY=sqlite``) or RAM-only (``HISTORY=ram``) history, then
prints the result's identity as JSON and exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.runtime import CheckpointStore, Program, Runtime, SqliteCheckpointStore
from touba.testing import ScriptedProvider

FIRST_STEP = {
    "action": "call",
    "calls": [
        {"call_id": "c1", "name": "lookup_invoice", "arguments": {"invoice": "I-1"}},
        {"call_id": "c2", "name": "pay", "arguments": {"invoice": "I-1"}},
    ],
}


def build(model: ScriptedProvider, checkpoints: CheckpointStore, ledger: list[str]) -> Runtime:
    program = Program()

    @program.capability
    async def lookup_invoice(invoice: str) -> dict[str, str]:
        ledger.append(f"lookup {invoice}")
        return {"invoice": invoice, "amount": "12.00"}

    @program.capability(requires_approval=True)
    async def pay(invoice: str) -> str:
        ledger.append(f"pay {invoice}")
        return "paid"

    program.agent("billing", provider=model, capabilities=("lookup_invoice", "pay"))
    return Runtime(program, checkpoints=checkpoints)


def history(directory: Path, mode: str) -> tuple[HistoryConfig | None, SqliteHistoryStore | None]:
    if mode == "ram":
        return None, None
    store = SqliteHistoryStore(directory / "history.sqlite")
    return HistoryConfig(store=store, namespace="billing-app"), store


async def pause(directory: Path, mode: str) -> dict[str, Any]:
    config, history_store = history(directory, mode)
    ledger: list[str] = []
    async with SqliteCheckpointStore(directory / "checkpoints.sqlite") as checkpoints:
        runtime = build(ScriptedProvider(FIRST_STEP, history=config), checkpoints, ledger)
        result = await runtime.invoke("billing", input="pay I-1", run_id="run-durable")
    if history_store is not None:
        await history_store.close()
    return {
        "status": result.status,
        "checkpoint_id": result.checkpoint_id,
        "invocation_id": result.invocation_id,
        "pending": [c.call_id for c in result.pending],
        "ledger": ledger,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(pause(Path(sys.argv[1]), sys.argv[2]))))
