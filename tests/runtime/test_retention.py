"""What a finished invocation leaves in its providers' history stores (issue 8, section 1).

``Runtime(retain_finished_history=True)`` (the default) keeps finished
conversations until they expire; ``False`` deletes an invocation's, its
delegates' included, as soon as it completes or fails for good, and never
while it awaits approval or can be resumed. ``ChatSession`` deletes a turn's
once the turn is stored, unless ``retain_decision_history=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from touba import ChatSession
from touba.errors import ConfigurationError
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.memory import SqliteMemoryStore
from touba.providers import DecisionRequest
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider

from ._helpers import final, step

NAMESPACE = "retention"


def down(request: DecisionRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    raise RuntimeError("503")


def programs(
    store: MemoryHistoryStore, lead: list[Any], helper: list[Any]
) -> tuple[Program, ScriptedProvider]:
    history = HistoryConfig(store=store, namespace=NAMESPACE)
    model = ScriptedProvider(*lead, history=history)
    program = Program()

    @program.capability
    async def lookup(order_id: str) -> str:
        return "shipped"

    @program.capability(requires_approval=True)
    async def refund(order_id: str) -> str:
        return "refunded"

    program.delegate("checker")
    program.agent("lead", provider=model, capabilities=("lookup", "refund", "checker"))
    program.agent(
        "checker",
        provider=ScriptedProvider(*helper, history=history),
        capabilities=("lookup",),
    )
    return program, model


async def held(store: MemoryHistoryStore) -> int:
    return len(await store.list(NAMESPACE))


def checked_lookup(store: MemoryHistoryStore) -> Program:
    """The lead asks its delegate "checker", which looks order A1 up, then both answer."""
    program, _ = programs(
        store,
        [step(("d1", "checker", {"input": "A1"})), final("ok")],
        [step(("l1", "lookup", {"order_id": "A1"})), final("shipped")],
    )
    return program


async def test_by_default_finished_conversations_stay_until_they_expire() -> None:
    store = MemoryHistoryStore()
    program = checked_lookup(store)
    result = await Runtime(program).invoke("lead")
    assert result.status == "completed"
    assert await held(store) == 2  # the lead's and its delegate's


async def test_without_retention_a_completed_invocation_and_its_delegates_leave_nothing() -> None:
    store = MemoryHistoryStore()
    program = checked_lookup(store)
    result = await Runtime(program, retain_finished_history=False).invoke("lead")
    assert result.status == "completed"
    assert await held(store) == 0


async def test_without_retention_a_paused_invocation_keeps_its_history_until_it_ends() -> None:
    store = MemoryHistoryStore()
    program, model = programs(
        store, [step(("r1", "refund", {"order_id": "A1"})), final("refunded")], []
    )
    runtime = Runtime(program, retain_finished_history=False)
    paused = await runtime.invoke("lead")
    assert paused.status == "awaiting_approval"
    assert await held(store) == 1
    done = await runtime.resume(paused.checkpoint_id or "", approvals={"r1": True})
    assert done.status == "completed"
    assert model.requests[-1].observations[0].result == "refunded"  # resumed with its messages
    assert await held(store) == 0


async def test_without_retention_a_resumable_failure_keeps_its_history() -> None:
    store = MemoryHistoryStore()
    program, _ = programs(
        store, [step(("l1", "lookup", {"order_id": "A1"})), down, final("ok")], []
    )
    runtime = Runtime(program, retain_finished_history=False)
    failed = await runtime.invoke("lead")
    assert failed.status == "failed"
    assert failed.checkpoint_id is not None
    assert await held(store) == 1
    with pytest.raises(ConfigurationError, match="can still be resumed"):
        await runtime.discard_history(failed)
    done = await runtime.resume(failed.checkpoint_id)
    assert done.status == "completed"
    assert await held(store) == 0


async def test_without_retention_a_failure_for_good_leaves_nothing() -> None:
    store = MemoryHistoryStore()
    program, _ = programs(store, [step(("x1", "no_such_capability", {}))], [])
    result = await Runtime(program, retain_finished_history=False).invoke("lead")
    assert result.status == "failed"
    assert not result.error or not result.error.retryable
    assert await held(store) == 0


async def test_discard_history_deletes_one_result_s_conversations() -> None:
    store = MemoryHistoryStore()
    program, _ = programs(
        store, [step(("d1", "checker", {"input": "A1"})), final("ok")], [final("fine")]
    )
    runtime = Runtime(program)
    result = await runtime.invoke("lead")
    assert await held(store) == 2
    assert await runtime.discard_history(result) == 2
    assert await held(store) == 0
    assert await runtime.discard_history(result) == 0  # nothing left: not an error


def test_retain_finished_history_must_be_a_bool() -> None:
    with pytest.raises(ConfigurationError, match="retain_finished_history"):
        Runtime(Program(), retain_finished_history="no")  # type: ignore[arg-type]


async def test_a_chat_session_keeps_no_finished_turn_unless_asked(tmp_path: Path) -> None:
    store = MemoryHistoryStore()
    program, _ = programs(
        store,
        [
            step(("l1", "lookup", {"order_id": "A1"})),
            final("shipped"),
            final("again"),
            step(("r1", "refund", {"order_id": "A1"})),
            final("refunded"),
            final("kept"),
        ],
        [],
    )
    runtime = Runtime(program)
    async with SqliteMemoryStore(tmp_path / "memory.sqlite") as memory:
        session = ChatSession(runtime, "lead", "u-1", store=memory)
        await session.send("where is A1?")
        await session.send("and now?")
        assert await held(store) == 0
        paused = await session.send("refund it")
        assert paused.status == "awaiting_approval"
        assert await held(store) == 1  # kept while the turn awaits approval
        await session.resume({"r1": True})
        assert await held(store) == 0
        keeping = ChatSession(runtime, "lead", "u-1", store=memory, retain_decision_history=True)
        await keeping.send("hello")
        assert await held(store) == 1
