"""The approvals tests' program: a refund that needs approval, counted, and a scripted model.

The same program runs in the test process and in a ``touba panel`` process
(``--program tests.panel._approvals:program``): every execution of
``refund`` is appended to ``refunds.log`` in ``$TOUBA_TEST_DIR`` (when set)
and to :data:`REFUNDS`, and the scripted model appends what each decision
was sent (its observations) to ``sent.jsonl`` there, so a test counts the
capability's runs and reads what the model saw whichever process ran them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from touba.memory import KeyEventsConfig, MemoryConfig
from touba.providers import DecisionRequest
from touba.runtime import Program, Runtime, SqliteCheckpointStore
from touba.testing import ScriptedProvider

DIR_ENV = "TOUBA_TEST_DIR"
REFUNDS: list[str] = []
ROOT = Path(__file__).resolve().parents[2]
_ORDER = re.compile(r"\b([A-Z]\d)\b")


def _directory() -> Path | None:
    found = os.environ.get(DIR_ENV)
    return Path(found) if found else None


def refunds_run(directory: Path) -> list[str]:
    """The orders ``refund`` ran for, in any process that logged to ``directory``."""
    path = directory / "refunds.log"
    return path.read_text().split() if path.exists() else []


def sent(directory: Path) -> list[dict[str, Any]]:
    """What each decision of the scripted model was sent (input and observations)."""
    path = directory / "sent.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def respond(request: DecisionRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Ask for a refund of the order the message names; once answered, say how it went."""
    directory = _directory()
    if directory is not None:
        seen = [
            {"name": o.name, "status": o.status, "error": o.error, "result": o.result}
            for o in request.observations
        ]
        line = {"input": request.input, "observations": seen, "resuming": request.resuming}
        with (directory / "sent.jsonl").open("a") as log:
            log.write(json.dumps(line) + "\n")
    if request.observations:
        [answer] = request.observations
        if answer.status == "ok":
            return ScriptedProvider.final(f"refund done: {answer.result}")
        return ScriptedProvider.final(f"no refund: {answer.error}")
    found = _ORDER.search(str(request.input))
    return ScriptedProvider.call("refund", order_id=found.group(1) if found else "A1")


def build_program(provider: Any = None, *, slow: bool = False) -> Program:
    """Agent ``support`` (a loop, key events off) with ``refund``, which needs approval.

    ``slow``: the refund announces itself on stdout and then hangs (a worker to kill).
    """
    program = Program()

    @program.capability(permissions=("orders:write",), requires_approval=True)
    async def refund(order_id: str) -> dict[str, str]:
        """Refund an order."""
        if slow:
            print("refunding", flush=True)
            await asyncio.sleep(3600)  # killed with SIGKILL here
        REFUNDS.append(order_id)
        directory = _directory()
        if directory is not None:
            with (directory / "refunds.log").open("a") as log:
                log.write(order_id + "\n")
        return {"order_id": order_id, "refunded": "yes"}

    program.agent(
        "support",
        provider=provider if provider is not None else ScriptedProvider(*[respond] * 100),
        instructions="You refund orders.",
        capabilities=("refund",),
        grants=("orders:write",),
        kind="loop",
        memory=MemoryConfig(key_events=KeyEventsConfig(enabled=False)),
    )
    return program


def program() -> Program:
    """The factory ``touba panel --program tests.panel._approvals:program`` loads."""
    return build_program()


def runtime() -> Runtime:
    """``--program tests.panel._approvals:runtime``: the application's Runtime, its durable
    checkpoint store (``checkpoints.sqlite`` in ``$TOUBA_TEST_DIR``) with it."""
    directory = _directory()
    assert directory is not None, f"set {DIR_ENV}"
    store = SqliteCheckpointStore(directory / "checkpoints.sqlite")  # closed at the exit
    return Runtime(build_program(), checkpoints=store)


CRASHING_RESUME = """
import asyncio, sys
from pathlib import Path
from touba import ChatSession, Runtime
from touba.memory import SqliteMemoryStore
from touba.runtime import SqliteCheckpointStore
from tests.panel._approvals import build_program

async def main(directory, session_id, checkpoint_id, call_id, user_id):
    directory = Path(directory)
    async with SqliteCheckpointStore(directory / "checkpoints.sqlite") as checkpoints, \\
            SqliteMemoryStore(directory / "memory.sqlite") as memory:
        runtime = Runtime(build_program(slow=True), checkpoints=checkpoints)
        async with ChatSession(runtime, "support", user_id, session_id, store=memory) as chat:
            await chat.resume({call_id: True}, checkpoint_id=checkpoint_id)

asyncio.run(main(*sys.argv[1:]))
"""


async def crash_while_resuming(
    directory: Path, session_id: str, checkpoint_id: str, call_id: str, user_id: str
) -> None:
    """A real second process approves the paused turn, starts the refund, and is
    ``kill -9``-ed inside it: the checkpoint stays ``running``, held by a dead worker."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    arguments = [str(directory), session_id, checkpoint_id, call_id, user_id]
    worker = subprocess.Popen(  # noqa: ASYNC220 - read from a thread below
        [sys.executable, "-c", CRASHING_RESUME, *arguments],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert worker.stdout is not None
    line = await asyncio.to_thread(worker.stdout.readline)
    assert line.strip() == "refunding", line
    os.kill(worker.pid, signal.SIGKILL)
    await asyncio.to_thread(worker.wait)
    worker.stdout.close()
