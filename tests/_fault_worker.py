"""Disk faults injected into touba's SQLite stores, from inside a process run by ``fiu-run``.

``fiu-run -x -f "" python -m tests._fault_worker SCENARIO DIRECTORY`` runs one
scenario over SQLite files in DIRECTORY and prints what it saw as one JSON
line. libfiu's POSIX preload makes real system calls fail (``pwrite`` with
ENOSPC, EIO or EROFS, ``fdatasync`` with EIO, ``open`` with EROFS); a
scenario turns a fault point on at an exact moment through libfiu's own
``fiu_enable`` (already loaded by the preload), so Python's own imports and
the store's setup run unharmed. Nothing in touba is mocked: SQLite itself
meets the failing calls. ``tests/_disk_faults.py`` runs the scenarios.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
)
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore
from touba.runtime import SqliteCheckpointStore, SqliteResourceBinding
from touba.runtime._resources import ResourceAddress

WRITE = "posix/io/rw/pwrite"
SYNC = "posix/io/sync/fdatasync"
OPEN = "posix/io/oc/open"
ONETIME = 1  # libfiu's FIU_ONETIME: the point fails once, then disables itself


class Faults:
    """libfiu's control functions, as loaded by ``fiu-run -x``."""

    def __init__(self) -> None:
        if "fiu_posix_preload" not in os.environ.get("LD_PRELOAD", ""):
            raise SystemExit("run this module under `fiu-run -x`")
        lib = ctypes.CDLL(None)
        self._enable = lib.fiu_enable
        self._enable.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint]
        self._random = lib.fiu_enable_random
        self._random.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_uint,
            ctypes.c_float,
        ]
        self._disable = lib.fiu_disable
        self._disable.argtypes = [ctypes.c_char_p]

    def enable(self, name: str, error: int, *, once: bool = False) -> None:
        """Make the call behind ``name`` fail with ``error`` (always, or once)."""
        assert self._enable(name.encode(), 1, error, ONETIME if once else 0) == 0

    def enable_random(self, name: str, error: int, probability: float) -> None:
        assert self._random(name.encode(), 1, error, 0, probability) == 0

    def disable(self, *names: str) -> None:
        for name in names:
            self._disable(name.encode())

    @contextmanager
    def failing(self, name: str, error: int) -> Iterator[None]:
        self.enable(name, error)
        try:
            yield
        finally:
            self.disable(name)


FAULTS: Faults


def describe(error: BaseException | None) -> dict[str, Any] | None:
    """What a test needs to know of an error: its type, message and driver cause."""
    if error is None:
        return None
    cause = error.__cause__
    return {
        "type": type(error).__name__,
        "message": str(error),
        "touba": type(error).__module__ == "touba.errors",
        "cause": None if cause is None else type(cause).__name__,
        "cause_code": getattr(cause, "sqlite_errorname", None),
        "notes": getattr(error, "__notes__", []),
    }


def refused_open(make: Callable[[], Any]) -> dict[str, Any] | None:
    """What ``make()`` (opening a store) fails with while the file system is read-only,
    described; None when it opens."""
    with FAULTS.failing(OPEN, errno.EROFS):
        try:
            make()
        except Exception as e:
            return describe(e)
    return None


async def outcome(action: Awaitable[Any]) -> dict[str, Any] | None:
    try:
        await action
    except Exception as e:
        return describe(e)
    return None


# -- decision history ------------------------------------------------------------------

IDENTITY = ConversationIdentity("faults", "openai", "m", "native", "run-1", "inv-1", "agent")
CALL = CapabilityCall("c1", "lookup", {"order_id": "A1"})
ANSWER = [Observation("c1", "lookup", {"order_id": "A1"}, "ok", {"status": "shipped"})]


def model(before_reply: Callable[[], None] = lambda: None) -> Callable[..., Any]:
    """A provider double; ``before_reply`` runs inside the decision (key reserved)."""

    async def generate(window: HistoryWindow) -> DecisionMessage:
        before_reply()
        return DecisionMessage(text="done", final=True)

    return generate


async def started(directory: Path) -> tuple[SqliteHistoryStore, DecisionHistory, Any]:
    store = SqliteHistoryStore(directory / "history.sqlite")
    history = DecisionHistory(HistoryConfig(store=store, namespace="faults"))

    async def first(window: HistoryWindow) -> DecisionMessage:
        return DecisionMessage(calls=(CALL,))

    await history.step(IDENTITY, [], first)
    return store, history, await store.read(IDENTITY.key)


async def history_after(
    store: SqliteHistoryStore, history: DecisionHistory, before: Any
) -> dict[str, Any]:
    """The state once the disk works again: kept? free? does the decision go through?"""
    read = None
    try:
        kept = await store.read(IDENTITY.key) == before
    except Exception as e:
        kept, read = False, describe(e)
    recovered = False
    if read is not None:  # held: the error said to recover
        recovered = await store.recover(IDENTITY.key, worker_stopped=True)
        kept = await store.read(IDENTITY.key) == before
    retried = await outcome(history.step(IDENTITY, ANSWER, model()))
    final = await store.read(IDENTITY.key)
    return {
        "kept": kept,
        "read_before_recover": read,
        "recovered": recovered,
        "retry": retried,
        "saved": final is not None and final["pending"] == [] and len(final["exchanges"]) == 2,
    }


async def history_save(directory: Path, name: str, error: int, once: bool) -> dict[str, Any]:
    """The fault strikes the save (the key is reserved, the model answered)."""
    store, history, before = await started(directory)
    failed = await outcome(
        history.step(IDENTITY, ANSWER, model(lambda: FAULTS.enable(name, error, once=once)))
    )
    FAULTS.disable(name)
    return {"error": failed, **await history_after(store, history, before)}


async def history_save_stuck_live(directory: Path) -> dict[str, Any]:
    """The save and its release both fail; once the disk works again, the same worker
    decides again without ``recover`` (its store object releases its own reservation
    first), while another worker found the key held until then."""
    store, history, before = await started(directory)
    failed = await outcome(
        history.step(IDENTITY, ANSWER, model(lambda: FAULTS.enable(WRITE, errno.EIO)))
    )
    FAULTS.disable(WRITE)
    other = SqliteHistoryStore(directory / "history.sqlite")
    held = await outcome(other.read(IDENTITY.key))
    kept = await other.read_saved(IDENTITY.key) == before
    retried = await outcome(history.step(IDENTITY, ANSWER, model()))
    final = await other.read_saved(IDENTITY.key)
    free = not any(row.active for row in await other.list())
    await other.close()
    await store.close()
    return {
        "error": failed,
        "held_for_others": held,
        "kept": kept,
        "retry": retried,
        "free": free,
        "saved": final is not None and final["pending"] == [] and len(final["exchanges"]) == 2,
    }


RANDOM_POINTS: Final = (WRITE, SYNC, "posix/io/rw/pread")
Decide = Callable[[HistoryWindow], Awaitable[DecisionMessage]]


def _lookup(turn: int) -> tuple[CapabilityCall, Decide]:
    """Turn ``turn``'s call, and the model that decides it."""
    call = CapabilityCall(f"c{turn}", "lookup", {"turn": turn})

    async def generate(window: HistoryWindow) -> DecisionMessage:
        return DecisionMessage(calls=(call,))

    return call, generate


def _random_faults() -> None:
    """Writes, syncs and reads fail with EIO 4 % of the time, until ``FAULTS.disable``."""
    for point in RANDOM_POINTS:
        FAULTS.enable_random(point, errno.EIO, 0.04)


def _answers(stored: dict[str, Any] | None) -> list[Observation]:
    """What the next decision sends: an answer to each call the stored record awaits."""
    if stored is None:
        return []
    return [
        Observation(p["call_id"], "lookup", {"turn": int(p["call_id"][1:])}, "ok", 0)
        for p in stored["pending"]
    ]


async def history_random_live(directory: Path) -> dict[str, Any]:
    """Random write, sync and read faults over many decisions of one live worker that
    never calls ``recover``: no decision is ever refused busy (the worker frees its own
    reservation whenever a failed release left it), nothing lost, no ghost."""
    store = SqliteHistoryStore(directory / "history.sqlite")
    history = DecisionHistory(HistoryConfig(store=store, namespace="faults"))
    busy: list[str] = []
    untyped: list[str] = []
    failures = successes = stuck = 0
    pending: list[Observation] = []
    for turn in range(120):
        call, generate = _lookup(turn)
        _random_faults()
        try:
            await history.step(IDENTITY, pending, generate)
            pending = [Observation(call.call_id, "lookup", {"turn": turn}, "ok", turn)]
            successes += 1
        except Exception as e:
            failures += 1
            if type(e).__name__ == "DecisionHistoryBusy":
                busy.append(str(e))
            elif type(e).__module__ != "touba.errors":
                untyped.append(f"{type(e).__name__}: {e}")
            stuck += "could not be released" in str(e)
        finally:
            FAULTS.disable(*RANDOM_POINTS)
        stored = await store.read_saved(IDENTITY.key)  # what the next decision builds on
        pending = _answers(stored)
    last = await outcome(history.step(IDENTITY, pending, model()))  # the disk works
    if last is None:
        successes += 1
    elif last["type"] == "DecisionHistoryBusy":
        busy.append(last["message"])
    stored = await store.read_saved(IDENTITY.key)
    await store.close()
    return {
        "busy": busy,
        "untyped": untyped,
        "failures": failures,
        "successes": successes,
        "last": last,
        "stuck": stuck,
        "exchanges": 0 if stored is None else len(stored["exchanges"]),
        "stats": None if stored is None else stored["stats"]["exchanges"],
    }


async def history_reserve(directory: Path) -> dict[str, Any]:
    """The fault strikes the reservation itself: nothing is held, nothing to recover."""
    store, history, before = await started(directory)
    with FAULTS.failing(WRITE, errno.EROFS):
        failed = await outcome(history.step(IDENTITY, ANSWER, model()))
    return {"error": failed, **await history_after(store, history, before)}


async def history_open(directory: Path) -> dict[str, Any]:
    return {"error": refused_open(lambda: SqliteHistoryStore(directory / "history.sqlite"))}


async def history_random(directory: Path) -> dict[str, Any]:
    """Random write, sync and read faults over many decisions: every failure typed,
    nothing corrupt, the key free whenever its error did not say to recover."""
    store = SqliteHistoryStore(directory / "history.sqlite")
    history = DecisionHistory(HistoryConfig(store=store, namespace="faults"))
    untyped: list[str] = []
    unsaid: list[str] = []  # held keys whose error message does not say so
    failures = successes = recoveries = 0
    pending: list[Observation] = []
    for turn in range(150):
        call, generate = _lookup(turn)
        _random_faults()
        try:
            await history.step(IDENTITY, pending, generate)
            pending = [Observation(call.call_id, "lookup", {"turn": turn}, "ok", turn)]
            successes += 1
        except Exception as e:
            failures += 1
            if type(e).__module__ != "touba.errors":
                untyped.append(f"{type(e).__name__}: {e}")
            FAULTS.disable(*RANDOM_POINTS)
            if "could not be released" in " ".join(getattr(e, "__notes__", [])):
                unsaid.append(f"{type(e).__name__}: {e}")  # a store error says it itself
            if "could not be released" in str(e):
                recoveries += int(await store.recover(IDENTITY.key, worker_stopped=True))
            try:
                stored = await store.read(IDENTITY.key)  # never busy here, never corrupt
            except Exception as late:
                raise AssertionError(f"after {describe(e)}: {late!r}") from late
            pending = _answers(stored)
        finally:
            FAULTS.disable(*RANDOM_POINTS)
    stored = await store.read(IDENTITY.key)
    await store.close()
    return {
        "untyped": untyped,
        "unsaid": unsaid,
        "failures": failures,
        "successes": successes,
        "recoveries": recoveries,
        "exchanges": 0 if stored is None else len(stored["exchanges"]),
        "stats": None if stored is None else stored["stats"]["exchanges"],
    }


# -- chat memory -----------------------------------------------------------------------


async def memory_append(directory: Path, name: str, error: int) -> dict[str, Any]:
    store = SqliteMemoryStore(directory / "memory.sqlite")
    await store.open_session("s1", owner="user:u", agent_ref="support", mode="live")
    await store.append_turn("s1", user="hello", replies=["hi"])
    FAULTS.enable(name, error, once=True)
    failed = await outcome(store.append_turn("s1", user="lost?", replies=["..."]))
    FAULTS.disable(name)
    kept = [t.user for t in await store.recent_turns("s1", 10)]
    retried = await outcome(store.append_turn("s1", user="again", replies=["ok"]))
    turns = [t.user for t in await store.recent_turns("s1", 10)]
    with FAULTS.failing(WRITE, errno.EIO):  # a persistent fault: every write refused
        persistent = await outcome(
            store.create_event(owner="user:u", type="t", title="x", details="", session_id="s1")
        )
    events = await store.query_events("user:u")
    await store.close()
    return {
        "error": failed,
        "kept": kept,
        "retry": retried,
        "turns": turns,
        "persistent": persistent,
        "events": len(events),
    }


async def memory_open(directory: Path) -> dict[str, Any]:
    return {"error": refused_open(lambda: SqliteMemoryStore(directory / "memory.sqlite"))}


# -- checkpoints and resources ---------------------------------------------------------


async def checkpoints(directory: Path, name: str, error: int) -> dict[str, Any]:
    store = SqliteCheckpointStore(directory / "checkpoints.sqlite")
    await store.save("a", {"step": 1, "revision": 0})
    with FAULTS.failing(name, error):
        save = await outcome(store.save("b", {"step": 1}))
        take = await outcome(store.take("a"))
        replace = await outcome(store.replace("a", {"step": 2, "revision": 1}, revision=0))
    result = {
        "save": save,
        "take": take,
        "replace": replace,
        "a": await store.get("a"),
        "b": await store.get("b"),
        "retry": await outcome(store.save("b", {"step": 1})),
    }
    await store.close()
    return result


async def resources(directory: Path, name: str, error: int) -> dict[str, Any]:
    binding = SqliteResourceBinding(directory / "resources.sqlite")
    address = ResourceAddress("notes", "user", "u1")
    await binding.put(address, "k", {"v": 1})
    with FAULTS.failing(name, error):
        put = await outcome(binding.put(address, "k", {"v": 2}))
        delete = await outcome(binding.delete(address, "k"))
    item = await binding.get(address, "k")
    result = {
        "put": put,
        "delete": delete,
        "value": None if item is None else item.value,
        "retry": await outcome(binding.put(address, "k", {"v": 3})),
    }
    await binding.close()
    return result


async def runtime_open(directory: Path) -> dict[str, Any]:
    return {
        "checkpoints": refused_open(lambda: SqliteCheckpointStore(directory / "c.sqlite")),
        "resources": refused_open(lambda: SqliteResourceBinding(directory / "r.sqlite")),
    }


SCENARIOS: dict[str, Callable[[Path], Coroutine[Any, Any, dict[str, Any]]]] = {
    "history-save-full-once": lambda d: history_save(d, WRITE, errno.ENOSPC, True),
    "history-save-sync-once": lambda d: history_save(d, SYNC, errno.EIO, True),
    "history-save-stuck": lambda d: history_save(d, WRITE, errno.EIO, False),
    "history-save-stuck-live": history_save_stuck_live,
    "history-reserve-readonly": history_reserve,
    "history-random-live": history_random_live,
    "history-open-readonly": history_open,
    "history-random": history_random,
    "memory-append-full": lambda d: memory_append(d, WRITE, errno.ENOSPC),
    "memory-append-sync": lambda d: memory_append(d, SYNC, errno.EIO),
    "memory-open-readonly": memory_open,
    "checkpoints-eio": lambda d: checkpoints(d, WRITE, errno.EIO),
    "checkpoints-full": lambda d: checkpoints(d, WRITE, errno.ENOSPC),
    "resources-eio": lambda d: resources(d, WRITE, errno.EIO),
    "resources-readonly": lambda d: resources(d, WRITE, errno.EROFS),
    "runtime-open-readonly": runtime_open,
}


def main() -> None:
    global FAULTS
    FAULTS = Faults()
    scenario, directory = sys.argv[1], Path(sys.argv[2])
    result: dict[str, Any] = asyncio.run(SCENARIOS[scenario](directory))
    print(json.dumps(result, default=repr))


if __name__ == "__main__":
    main()
