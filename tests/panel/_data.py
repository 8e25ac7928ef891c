"""What the panel tests put in the stores: hostile text, conversations, a crashed worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
    SummaryRequest,
)
from touba.memory import KeyEventsConfig, KeyEventService
from touba.providers._types import TraceCall

HOSTILE = "<script>alert(1)</script>"
HOSTILE_IMG = '<img src=x onerror="alert(2)">'
NAMESPACE = "panel-test"
TYPES = ("refund", "account issue")
ROOT = Path(__file__).resolve().parents[2]


async def seed_memory(memory: Any) -> dict[str, Any]:
    """A live session of alice with hostile text everywhere, an anonymous and a preview one."""
    await memory.open_session("s-1", owner="user:alice", agent_ref="support", mode="live")
    call = TraceCall("c1", "lookup_order", {"order_id": HOSTILE_IMG}, "ok", {"note": HOSTILE})
    await memory.append_turn("s-1", user=f"hi {HOSTILE}", replies=[f"reply {HOSTILE}"])
    await memory.append_turn("s-1", user="where is A1?", replies=["shipped"], trace=[[call]])
    service = KeyEventService(memory, KeyEventsConfig(enabled=True, types=TYPES))
    event = await service.create("user:alice", "refund", HOSTILE, f"details {HOSTILE_IMG}", "s-1")
    await memory.open_session("anon-1", owner="session:anon-1", agent_ref="support", mode="live")
    await memory.append_turn("anon-1", user="hello", replies=["hi"])
    await memory.open_session("p-1", owner="session:p-1", agent_ref="support", mode="preview")
    return {"event": event}


def identity(invocation: str = "inv-1", run_id: str = HOSTILE) -> ConversationIdentity:
    return ConversationIdentity(
        NAMESPACE,
        "scripted",
        "m",
        "native",
        run_id=run_id,
        invocation_id=invocation,
        agent_ref="support",
    )


async def summarize(request: SummaryRequest) -> str:
    return f"{len(request.turns)} exchanges before"


async def seed_conversation(store: Any, invocation: str = "inv-1", decisions: int = 6) -> str:
    """A conversation of ``decisions`` decisions, trimmed and summarised; its key."""
    history = DecisionHistory(
        HistoryConfig(
            store=store,
            namespace=NAMESPACE,
            max_messages=4,
            summarize=summarize,
            max_summary_bytes=256,
        )
    )
    who = identity(invocation)
    observations: list[Observation] = []
    for step in range(decisions):
        final = step == decisions - 1

        async def model(window: HistoryWindow, step: int = step, final: bool = final) -> Any:
            if final:
                return DecisionMessage(text=HOSTILE, output=HOSTILE, final=True)
            call = CapabilityCall(f"c{step}", "lookup_order", {"order_id": HOSTILE})
            return DecisionMessage(text="looking", calls=(call,))

        decision = await history.step(who, observations, model)
        observations = [
            Observation(c.call_id, c.name, c.arguments, "ok", {"status": HOSTILE})
            for c in decision.calls
        ]
    return who.key


CRASHING_WORKER = """
import asyncio, sys
from touba.history import DecisionHistory, HistoryConfig, Observation
from touba.history.sqlite import SqliteHistoryStore
from tests.panel._data import NAMESPACE, identity

async def main(path):
    store = SqliteHistoryStore(path)
    history = DecisionHistory(HistoryConfig(store=store, namespace=NAMESPACE))
    async def model(window):
        print("reserved", flush=True)
        await asyncio.sleep(3600)  # killed with SIGKILL here, holding the reservation
    observations = [Observation("c0", "lookup_order", {"order_id": "A1"}, "ok", {"s": 1})]
    await history.step(identity("inv-crash", run_id="run-crash"), observations, model)

asyncio.run(main(sys.argv[1]))
"""


async def crashed_reservation(path: Path) -> str:
    """A conversation whose worker was killed with SIGKILL inside a decision; its key.

    A first decision is saved in this process; a real second process then
    reserves the conversation for the next decision and is ``kill -9``-ed
    while it holds it.
    """
    from touba.history.sqlite import SqliteHistoryStore

    who = identity("inv-crash", run_id="run-crash")
    async with SqliteHistoryStore(path) as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace=NAMESPACE))

        async def model(window: HistoryWindow) -> DecisionMessage:
            call = CapabilityCall("c0", "lookup_order", {"order_id": "A1"})
            return DecisionMessage(text="looking", calls=(call,))

        await history.step(who, [], model)
    root = ROOT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    worker = subprocess.Popen(  # noqa: ASYNC220 - read from a thread below
        [sys.executable, "-c", CRASHING_WORKER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )
    assert worker.stdout is not None
    line = await asyncio.to_thread(worker.stdout.readline)
    assert line.strip() == "reserved", line
    os.kill(worker.pid, signal.SIGKILL)
    await asyncio.to_thread(worker.wait)
    worker.stdout.close()
    return who.key
