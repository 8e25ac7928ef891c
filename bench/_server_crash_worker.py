"""One worker of ``bench/server_crashes.py``: writes to a store while its server is killed.

``python -m bench._server_crash_worker CONFIG_JSON`` runs one kind of write in a loop
until the file ``stop`` names exists, then prints one JSON line (its ops and the errors
it saw, by class). Every write it saw acknowledged is appended to its own ``acks`` file,
one JSON line each, flushed and fsynced before the next write starts: what the driver
later checks against the store is exactly what this process was told was saved.

Kinds (``kind``):

- ``decide``: one conversation's decisions through ``DecisionHistory.step`` (the
  history layer the runtime uses) on a PostgreSQL or Redis history store; each decision
  calls a capability whose call id is new (``<name>-<n>``), the next one answers it.
- ``transact``: ``store.transact`` on a plain record, appending ``n`` to a list.
- ``chat``: chat turns through ``ChatSession.send`` (a ``Runtime`` whose scripted model
  answers at once) over a PostgreSQL memory store and history store.
- ``events``: updates of one key event (``update_event`` with an ``op_id``).

Errors: an error of a class in ``TYPED`` is what the store promises while its server is
down or restarting; anything else is recorded whole (``untyped``). A write still running
after ``op_seconds`` is cancelled and counted in ``timeouts``: a hang (the deadlines of
issue 29 item 2 bound it in the store; until then this bound is the worker's own). After
an error the worker reads the stored state again (a write whose reply was lost may have
been saved) and, on its own conversation found busy, calls ``recover(...,
worker_stopped=True)`` as its operator would (no write of its own runs then).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

from touba.errors import DecisionHistoryBusy, ToubaError
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
)

TYPED = ("DecisionHistoryStoreUnavailable", "DecisionHistoryBusy", "MemoryStoreUnavailable")
TOOL = "lookup"


def identity(name: str) -> ConversationIdentity:
    """The conversation of decision worker ``name``."""
    return ConversationIdentity("crashes", "scripted", "m", "native", "run", name, "agent")


class Worker:
    """The loop every kind shares: ops, acknowledgements, errors, the stop file."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config["name"]
        self.stop = Path(config["stop"])
        self.op_seconds: float = config["op_seconds"]
        self.pause: float = config.get("pause", 0.0)
        self._acks: TextIO = open(config["acks"], "a", encoding="utf-8")  # noqa: SIM115
        self.ops = 0
        self.acked = 0
        self.errors: Counter[str] = Counter()
        self.untyped: list[str] = []
        self.timeouts = 0
        self.recovered = 0
        self.slowest_failure = 0.0  # seconds of the longest op that failed

    def ack(self, entry: dict[str, Any]) -> None:
        self._acks.write(json.dumps(entry) + "\n")
        self._acks.flush()
        os.fsync(self._acks.fileno())
        self.acked += 1

    async def attempt(self, op: Awaitable[Any]) -> tuple[bool, Any]:
        """Await one op under the worker's bound; (True, its result) or (False, the error)."""
        self.ops += 1
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.op_seconds):
                return True, await op
        except TimeoutError as e:
            self.timeouts += 1
            return False, e
        except Exception as e:
            self.saw(e)
            self.slowest_failure = max(self.slowest_failure, time.monotonic() - started)
            return False, e

    def saw(self, error: BaseException) -> None:
        name = type(error).__name__
        if isinstance(error, ToubaError) and name in TYPED:
            self.errors[name] += 1
        else:
            self.untyped.append(f"{name}: {error}"[:500])

    def running(self) -> bool:
        return not self.stop.exists()

    async def rest(self, failed: bool) -> None:
        await asyncio.sleep(0.05 if failed else self.pause)

    def report(self) -> dict[str, Any]:
        self._acks.close()
        return {
            "name": self.name,
            "kind": self.config["kind"],
            "ops": self.ops,
            "acked": self.acked,
            "errors": dict(self.errors),
            "untyped": self.untyped,
            "timeouts": self.timeouts,
            "recovered": self.recovered,
            "slowest_failure": round(self.slowest_failure, 2),
        }


def history_store(config: dict[str, Any]) -> Any:
    if config["server"] == "postgres":
        from touba.history.postgres import PostgresHistoryStore

        return PostgresHistoryStore(config["address"], table=config["table"])
    from touba.history.redis import RedisHistoryStore

    return RedisHistoryStore(config["address"], prefix=config["prefix"])


async def decide(worker: Worker) -> None:
    store = history_store(worker.config)
    history = DecisionHistory(HistoryConfig(store=store, namespace="crashes"))
    me = identity(worker.name)
    pending: list[Observation] = []
    stale = False  # after an error: read what is stored before the next decision
    n = 0
    while worker.running():
        if stale:
            ok, stored = await worker.attempt(store.read(me.key))
            if not ok:
                if isinstance(stored, DecisionHistoryBusy):
                    await own_busy(worker, store, me.key)
                await worker.rest(True)
                continue
            pending = [] if stored is None else [answer(p["call_id"]) for p in stored["pending"]]
            stale = False
        n += 1
        call = CapabilityCall(f"{worker.name}-{n}", TOOL, {"n": n})

        async def generate(window: HistoryWindow, call: CapabilityCall = call) -> DecisionMessage:
            return DecisionMessage(calls=(call,))

        ok, error = await worker.attempt(history.step(me, pending, generate))
        if ok:
            worker.ack({"call_id": call.call_id})
            pending = [answer(call.call_id)]
        else:
            stale = True
            if isinstance(error, DecisionHistoryBusy):
                await own_busy(worker, store, me.key)
        await worker.rest(not ok)
    await store.close()


def answer(call_id: str) -> Observation:
    n = int(call_id.rsplit("-", 1)[1])
    return Observation(call_id, TOOL, {"n": n}, "ok", {"n": n})


async def own_busy(worker: Worker, store: Any, key: str) -> None:
    """Our own conversation answered busy: no op of ours runs, so its reservation is a
    leftover of an op the crash interrupted (issue 29, 7c): recover it, as an operator
    would with ``touba history recover``."""
    ok, done = await worker.attempt(store.recover(key, worker_stopped=True))
    if ok and done:
        worker.recovered += 1


async def transact(worker: Worker) -> None:
    store = history_store(worker.config)
    key = f"transact:{worker.name}"
    n = 0
    while worker.running():
        n += 1

        async def append(record: dict[str, Any] | None, n: int = n) -> tuple[Any, int]:
            values = [] if record is None else list(record["values"])
            return {"values": [*values, n]}, n

        ok, error = await worker.attempt(store.transact(key, append))
        if ok:
            worker.ack({"n": n})
        elif isinstance(error, DecisionHistoryBusy):
            await own_busy(worker, store, key)
        await worker.rest(not ok)
    await store.close()


async def chat(worker: Worker) -> None:
    from touba import ChatSession
    from touba.memory import PostgresMemoryStore
    from touba.runtime import Program, Runtime
    from touba.testing import ScriptedProvider

    config = worker.config
    history = HistoryConfig(store=history_store(config), namespace="chat")

    def final(request: Any, messages: Any) -> dict[str, Any]:
        return ScriptedProvider.final("noted")

    provider = ScriptedProvider(*([final] * 100_000), history=history)
    program = Program()
    program.agent("support", provider=provider, instructions="Answer.")
    runtime = Runtime(program)
    memory = PostgresMemoryStore(dsn=config["address"], prefix=config["memory_prefix"])
    session = ChatSession(runtime, "support", worker.name, worker.name, store=memory)
    n = 0
    while worker.running():
        n += 1
        text = f"{worker.name} says {n}"
        resume = session.pending_checkpoint is not None
        ok, turn = await worker.attempt(session.resume() if resume else session.send(text))
        if ok:
            if turn.stored is not None:
                worker.ack({"index": turn.stored.index, "user": turn.stored.user})
            elif turn.result.error is not None:
                worker.saw(turn.result.error)
                ok = False
        await worker.rest(not ok)
    await session.close()
    await memory.close()
    await history.store.close()  # type: ignore[union-attr]


async def events(worker: Worker) -> None:
    from touba.memory import PostgresMemoryStore

    config = worker.config
    memory = PostgresMemoryStore(dsn=config["address"], prefix=config["memory_prefix"])
    owner = f"user:{worker.name}"
    event_id: str | None = None
    while event_id is None and worker.running():
        ok, created = await worker.attempt(
            memory.create_event(
                owner=owner,
                type="ticket",
                title="crashes",
                details="v0",
                session_id=worker.name,
                op_id=f"{worker.name}-create",
            )
        )
        if ok:
            event_id = created.id
            worker.ack({"event_id": event_id})
        await worker.rest(not ok)
    n = 0
    while event_id is not None and worker.running():
        n += 1
        op_id, details = f"{worker.name}-{n}", f"v{n}"
        ok, _ = await worker.attempt(
            memory.update_event(
                owner, event_id, {"details": details}, session_id=worker.name, op_id=op_id
            )
        )
        if ok:
            worker.ack({"op_id": op_id, "details": details})
        await worker.rest(not ok)
    await memory.close()


KINDS: dict[str, Callable[[Worker], Awaitable[None]]] = {
    "decide": decide,
    "transact": transact,
    "chat": chat,
    "events": events,
}


async def main(config: dict[str, Any]) -> dict[str, Any]:
    worker = Worker(config)
    started = time.monotonic()
    try:
        await KINDS[config["kind"]](worker)
    except Exception as e:  # a failure outside an op (setup, close): reported, not hidden
        worker.untyped.append(f"outside an op: {type(e).__name__}: {e}"[:500])
    report = worker.report()
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
