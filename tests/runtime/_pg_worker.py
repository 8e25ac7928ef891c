"""Worker processes of the PostgreSQL-only end-to-end test (``test_postgres_e2e.py``).

``python -m tests.runtime._pg_worker ACTION DSN NAME EFFECTS [ARG]`` runs one
step against PostgreSQL alone (checkpoints, history, chat memory, key
events in tables named after NAME) and prints one JSON line:

- ``pause``: invoke the billing agent; it looks an invoice up and asks to pay
  it, which needs approval;
- ``resume CHECKPOINT``: approve and resume that checkpoint;
- ``chat SESSION``: one chat turn of user ``u-1`` in SESSION; ``chat-end
  SESSION``: one more, then end the session (its extraction job is queued
  for ``touba worker``, never run in process).

``worker_program`` is what ``touba worker --program`` loads in a third process.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from touba import ChatSession, KeyEventsConfig, MemoryConfig
from touba.history import HistoryConfig
from touba.history.postgres import PostgresHistoryStore
from touba.memory.postgres import PostgresMemoryStore
from touba.runtime import PostgresCheckpointStore, Program, Runtime
from touba.testing import ScriptedProvider

KEY_EVENTS = KeyEventsConfig(enabled=True, types=("refund",))
EXTRACTED = {"kind": "create", "type": "refund", "title": "Refund parcel A1", "details": "broken"}


def worker_program() -> Program:
    """The program of ``touba worker``: its model answers one extraction."""
    program = Program()
    model = ScriptedProvider(ScriptedProvider.final({"ops": [EXTRACTED]}))
    program.agent(
        "assistant", provider=model, kind="agent", memory=MemoryConfig(key_events=KEY_EVENTS)
    )
    return program


def _program(provider: ScriptedProvider, effects: Path) -> Program:
    program = Program()

    def effect(line: str) -> None:
        with open(effects, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    @program.capability
    async def lookup_invoice(invoice: str) -> dict[str, str]:
        effect(f"lookup {invoice}")
        return {"invoice": invoice, "amount": "12.00"}

    @program.capability(requires_approval=True)
    async def pay(invoice: str) -> str:
        effect(f"pay {invoice}")
        return "paid"

    program.agent("billing", provider=provider, capabilities=("lookup_invoice", "pay"))
    program.agent(
        "assistant", provider=provider, kind="agent", memory=MemoryConfig(key_events=KEY_EVENTS)
    )
    return program


def _calls(*calls: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "action": "call",
        "calls": [{"call_id": i, "name": n, "arguments": a} for i, n, a in calls],
    }


async def main(action: str, dsn: str, name: str, effects: Path, arg: str | None) -> dict[str, Any]:
    steps: dict[str, list[Any]] = {
        "pause": [
            _calls(("c1", "lookup_invoice", {"invoice": "I-1"}), ("c2", "pay", {"invoice": "I-1"}))
        ],
        "resume": [ScriptedProvider.final("Paid I-1.")],
        "chat": [ScriptedProvider.final("Sorry to hear that. Which order?")],
        "chat-end": [ScriptedProvider.final("I passed your refund request on.")],
    }
    async with (
        PostgresCheckpointStore(dsn, table=f"{name}_cp") as checkpoints,
        PostgresHistoryStore(dsn, table=f"{name}_h") as history,
        PostgresMemoryStore(dsn, prefix=f"{name}_m") as memory,
    ):
        provider = ScriptedProvider(
            *steps[action], history=HistoryConfig(store=history, namespace="e2e")
        )
        runtime = Runtime(_program(provider, effects), checkpoints)
        if action == "pause":
            result = await runtime.invoke("billing", input="Pay I-1", run_id="run-pg")
            return {"status": result.status, "checkpoint_id": result.checkpoint_id}
        if action == "resume":
            assert arg is not None
            result = await runtime.resume(arg, approvals={"c2": True})
            conversations = len(await history.list("e2e"))
            return {
                "status": result.status,
                "output": result.output,
                "conversations": conversations,
            }
        async with ChatSession(
            runtime, "assistant", "u-1", arg, store=memory, extract_in_background=False
        ) as session:
            text = "My parcel A1 arrived broken" if action == "chat" else "I want a refund"
            turn = await session.send(text)
            prior = [t.user for t in provider.requests[0].prior_turns]
            job = await session.end() if action == "chat-end" else None
            return {"status": turn.status, "prior": prior, "job": job.id if job else None}


if __name__ == "__main__":
    action, dsn, name, effects, *rest = sys.argv[1:]
    out = asyncio.run(main(action, dsn, name, Path(effects), rest[0] if rest else None))
    print(json.dumps(out))
