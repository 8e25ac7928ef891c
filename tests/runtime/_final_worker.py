"""The approved resume that ``test_resume_final.py`` kills at random moments.

``approve(kind, where, history_file, effects_file, checkpoint_id)`` resumes a
checkpoint awaiting approval of one refund, approving it: the refund runs (its
effect, a line fsynced to ``effects_file``, names the run), then the model's final
decision is saved to history and the running checkpoint removed. Run in a process
forked by :class:`tests._zygote.Zygote`, SIGKILLed anywhere in between.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from tests._zygote import ready
from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider

from ._stores import open_checkpoints

NAMESPACE = "final-kills"


def effect(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def refund_program(provider: ScriptedProvider, effects: Path) -> Program:
    program = Program()

    @program.capability(requires_approval=True)
    async def refund(order_id: str, run: str) -> str:
        effect(effects, f"refund {order_id} {run}")
        return "refunded"

    program.agent("support", provider=provider, capabilities=("refund",))
    return program


def ask_refund(run: str) -> dict[str, Any]:
    return ScriptedProvider.call("refund", "r1", order_id="A1", run=run)


def answer(run: str) -> dict[str, Any]:
    return ScriptedProvider.final(f"refunded A1 for {run}")


def approve(
    kind: str, where: list[str], history: str, effects: str, checkpoint_id: str, run: str
) -> None:
    async def main() -> None:
        async with (
            open_checkpoints(kind, *where) as checkpoints,
            SqliteHistoryStore(history) as store,
        ):
            model = ScriptedProvider(
                answer(run), history=HistoryConfig(store=store, namespace=NAMESPACE)
            )
            runtime = Runtime(refund_program(model, Path(effects)), checkpoints)
            ready()
            result = await runtime.resume(checkpoint_id, approvals={"r1": True})
            assert result.status == "completed", result.error

    asyncio.run(main())
