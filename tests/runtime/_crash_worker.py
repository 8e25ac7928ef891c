"""A worker process that the crash tests kill -9 in the middle of a call or a decision.

``python -m tests.runtime._crash_worker DIRECTORY MODE``: runs the support
agent over SQLite checkpoints and history in DIRECTORY, and blocks (for the
test to kill it) inside the refund call (MODE ``call``) or inside the second
decision, after a lookup was answered (MODE ``decide``). Each effect of a
capability is a line appended to ``effects.log``, fsynced, before it returns.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.providers import DecisionRequest
from touba.runtime import Program, Runtime, SqliteCheckpointStore
from touba.testing import ScriptedProvider

RUN_ID = "run-crash"
NAMESPACE = "crash-tests"


def effect(directory: Path, line: str) -> None:
    with open(directory / "effects.log", "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def effects(directory: Path) -> list[str]:
    path = directory / "effects.log"
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def crash_program(provider: ScriptedProvider, directory: Path, *, block_in_refund: bool) -> Program:
    program = Program()

    @program.capability
    async def lookup_order(order_id: str) -> dict[str, str]:
        effect(directory, f"lookup {order_id}")
        return {"order_id": order_id, "status": "delivered"}

    @program.capability
    async def refund(order_id: str) -> str:
        effect(directory, f"refund {order_id}")
        if block_in_refund:
            effect(directory, "blocked")
            await asyncio.sleep(3600)
        return "refunded"

    program.agent("support", provider=provider, capabilities=("lookup_order", "refund"))
    return program


def call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"action": "call", "calls": [{"call_id": call_id, "name": name, "arguments": arguments}]}


async def main(directory: Path, mode: str) -> None:
    def thinking(request: DecisionRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
        effect(directory, "blocked")
        time.sleep(3600)  # the model "thinks" while holding the conversation
        raise AssertionError("killed before")

    if mode == "call":
        steps: list[Any] = [call("r1", "refund", order_id="A1")]
    else:
        steps = [call("l1", "lookup_order", order_id="A1"), thinking]
    async with (
        SqliteCheckpointStore(directory / "checkpoints.sqlite") as checkpoints,
        SqliteHistoryStore(directory / "history.sqlite") as store,
    ):
        provider = ScriptedProvider(*steps, history=HistoryConfig(store=store, namespace=NAMESPACE))
        program = crash_program(provider, directory, block_in_refund=True)
        await Runtime(program, checkpoints).invoke("support", input="refund A1", run_id=RUN_ID)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
