"""Retry-safe resume (issue 8, section 3): a failure never loses a checkpoint, no call runs twice.

In process, over the RAM and the SQLite checkpoint stores; the crash cases
(kill -9 of a real process) are in ``test_crash_resume.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from touba.errors import (
    AgentBudgetExceeded,
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    InvocationBusy,
    ToubaError,
)
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.history.sqlite import SqliteHistoryStore
from touba.providers import DecisionRequest
from touba.runtime import (
    CheckpointStore,
    MemoryCheckpointStore,
    Program,
    Runtime,
    SqliteCheckpointStore,
)
from touba.testing import ScriptedProvider

from ._helpers import final, step

Step = dict[str, Any] | Callable[[DecisionRequest, list[dict[str, Any]]], dict[str, Any]]


def down(request: DecisionRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    raise RuntimeError("503 from the provider")


@pytest.fixture(params=["memory", "sqlite"])
async def checkpoints(request: pytest.FixtureRequest, private_dir: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryCheckpointStore()
        return
    async with SqliteCheckpointStore(private_dir / "checkpoints.sqlite") as store:
        yield store


def refund_program(
    model: ScriptedProvider, log: list[str], *, max_calls: int = 1, max_decisions: int = 16
) -> Program:
    program = Program()

    @program.capability
    async def lookup_order(order_id: str) -> dict[str, str]:
        log.append(f"lookup {order_id}")
        return {"order_id": order_id, "status": "delivered"}

    @program.capability(requires_approval=True, max_calls=max_calls)
    async def refund(order_id: str) -> str:
        log.append(f"refund {order_id}")
        return "refunded"

    program.agent(
        "support",
        provider=model,
        capabilities=("lookup_order", "refund"),
        max_decisions=max_decisions,
    )
    return program


def model(*steps: Step, history: HistoryConfig | None = None) -> ScriptedProvider:
    return ScriptedProvider(*steps, history=history)


async def test_a_provider_error_after_an_approved_refund_keeps_a_resumable_checkpoint(
    checkpoints: CheckpointStore,
) -> None:
    log: list[str] = []
    scripted = model(step(("r1", "refund", {"order_id": "A1"})), down, final("refunded A1"))
    runtime = Runtime(refund_program(scripted, log), checkpoints)
    paused = await runtime.invoke("support", input="refund A1")
    assert paused.status == "awaiting_approval"

    failed = await runtime.resume(paused.checkpoint_id or "", approvals={"r1": True})
    assert failed.status == "failed"
    assert isinstance(failed.error, AgentDecisionProviderUnavailable)
    assert failed.error.retryable
    assert failed.checkpoint_id not in (None, paused.checkpoint_id)
    assert log == ["refund A1"]

    done = await runtime.resume(failed.checkpoint_id or "")
    assert done.status == "completed", done.error
    assert done.output == "refunded A1"
    assert log == ["refund A1"]  # exactly once
    assert done.invocation_id == paused.invocation_id
    [last] = scripted.requests[-1:]
    assert [(o.call_id, o.status, o.result) for o in last.observations] == [
        ("r1", "ok", "refunded")
    ]
    with pytest.raises(ConfigurationError, match="already resumed"):
        await runtime.resume(failed.checkpoint_id or "")
    assert [e.kind for e in done.trace].count("invocation_failed") == 1


async def test_the_budgets_used_survive_the_retry(checkpoints: CheckpointStore) -> None:
    log: list[str] = []
    scripted = model(
        step(("r1", "refund", {"order_id": "A1"})),
        down,
        step(("r2", "refund", {"order_id": "A1"})),  # max_calls=1: a second refund is denied
        final("done"),
    )
    runtime = Runtime(refund_program(scripted, log), checkpoints)
    paused = await runtime.invoke("support")
    failed = await runtime.resume(paused.checkpoint_id or "", approvals={"r1": True})
    done = await runtime.resume(failed.checkpoint_id or "")
    assert done.status == "completed"
    assert log == ["refund A1"]
    [denial] = done.trace.of_kind("denial")
    assert denial["call_id"] == "r2"


async def test_a_retryable_failure_before_any_call_leaves_nothing_to_resume(
    checkpoints: CheckpointStore,
) -> None:
    runtime = Runtime(refund_program(model(down), []), checkpoints)
    result = await runtime.invoke("support")
    assert result.status == "failed"
    assert result.checkpoint_id is None  # nothing happened: invoke again
    assert await checkpoints.list() == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("failing", "error"),
    [
        (step(("x", "no_such_capability", {})), AgentDecisionProviderSchemaViolation),
        (step(("l2", "lookup_order", {"order_id": "A2"})), AgentBudgetExceeded),
    ],
)
async def test_a_failure_for_good_removes_the_checkpoint(
    checkpoints: CheckpointStore, failing: Step, error: type[ToubaError]
) -> None:
    log: list[str] = []
    scripted = model(step(("l1", "lookup_order", {"order_id": "A1"})), failing)
    runtime = Runtime(refund_program(scripted, log, max_decisions=2), checkpoints)
    result = await runtime.invoke("support")
    assert result.status == "failed"
    assert isinstance(result.error, error)
    assert not result.error.retryable
    assert result.checkpoint_id is None
    assert await checkpoints.list() == []  # type: ignore[attr-defined]
    assert log == ["lookup A1"]


async def test_a_full_history_store_is_a_retryable_failure_of_the_invocation(
    checkpoints: CheckpointStore,
) -> None:
    store = MemoryHistoryStore(max_sessions=1)
    history = HistoryConfig(store=store, namespace="retry")
    log: list[str] = []
    scripted = model(
        step(("l1", "lookup_order", {"order_id": "A1"})),
        final("ok"),
        final("never sent"),
        history=history,
    )
    runtime = Runtime(refund_program(scripted, log), checkpoints)
    first = await runtime.invoke("support")
    assert first.status == "completed"
    other = await runtime.invoke("support")  # a second conversation: the store is full
    assert len(scripted.sent) == 2  # refused before its generation: nothing paid
    assert isinstance(other.error, DecisionHistoryLimitExceeded)
    assert other.error.limit == "max_sessions"
    assert other.error.retryable
    assert other.checkpoint_id is None  # refused at its first decision: nothing ran


class FailingAt:
    """A checkpoint store that dies (a BaseException, like a killed process) at its
    n-th ``replace``, after which nothing more is written."""

    def __init__(self, inner: CheckpointStore, at: int) -> None:
        self.inner = inner
        self.at = at
        self.replaces = 0

    async def save(self, checkpoint_id: str, checkpoint: dict[str, Any]) -> None:
        await self.inner.save(checkpoint_id, checkpoint)

    async def get(self, checkpoint_id: str) -> dict[str, Any] | None:
        return await self.inner.get(checkpoint_id)

    async def take(self, checkpoint_id: str) -> dict[str, Any] | None:
        return await self.inner.take(checkpoint_id)

    async def replace(
        self, checkpoint_id: str, checkpoint: dict[str, Any] | None, *, revision: int
    ) -> bool:
        self.replaces += 1
        if self.replaces == self.at:
            raise Killed
        return await self.inner.replace(checkpoint_id, checkpoint, revision=revision)  # type: ignore[attr-defined, no-any-return]

    async def list(self, *, run_id: str | None = None) -> Any:
        return await self.inner.list(run_id=run_id)  # type: ignore[attr-defined]


class Killed(BaseException):
    """Stands for the process dying where it is raised."""


async def test_an_approval_claimed_by_a_worker_that_died_before_starting_runs_once(
    private_dir: Path,
) -> None:
    async with SqliteCheckpointStore(private_dir / "checkpoints.sqlite") as store:
        log: list[str] = []
        scripted = model(step(("r1", "refund", {"order_id": "A1"})))
        paused = await Runtime(refund_program(scripted, log), store).invoke("support")

        # The resuming worker claims the checkpoint (replace 1) and dies when it
        # records the approved refund as started (replace 2): it never ran.
        dying = Runtime(refund_program(model(final("never")), log), FailingAt(store, at=2))
        with pytest.raises(Killed):
            await dying.resume(paused.checkpoint_id or "", approvals={"r1": True})
        assert log == []

        later = Runtime(refund_program(model(final("refunded")), log), store)
        [row] = await store.list()
        assert (row.checkpoint_id, row.status) == (paused.checkpoint_id, "running")
        with pytest.raises(InvocationBusy, match="worker_stopped=True"):
            await later.resume(row.checkpoint_id)
        done = await later.resume(row.checkpoint_id, worker_stopped=True)
        assert done.status == "completed", done.error
        assert log == ["refund A1"]  # the approval was not lost, and it ran once
        assert await store.list() == []


async def test_a_call_started_by_a_worker_that_died_is_answered_as_unknown(
    private_dir: Path,
) -> None:
    async with SqliteCheckpointStore(private_dir / "checkpoints.sqlite") as store:
        log: list[str] = []
        first = model(step(("l1", "lookup_order", {"order_id": "A1"})))
        # replace 1 is the write after the calls, which dies: l1 ran but its answer was
        # never recorded (the journal was created by a save, before l1 started).
        runtime = Runtime(refund_program(first, log), FailingAt(store, at=1))
        with pytest.raises(Killed):
            await runtime.invoke("support", run_id="run-7")
        assert log == ["lookup A1"]

        second = model(final("checked"))
        later = Runtime(refund_program(second, log), store)
        [row] = await store.list(run_id="run-7")
        done = await later.resume(row.checkpoint_id, worker_stopped=True)
        assert done.status == "completed"
        assert log == ["lookup A1"]  # never run again
        [observation] = second.requests[0].observations
        assert (observation.call_id, observation.status) == ("l1", "error")
        assert "unknown" in str(observation.error)
        [unknown] = done.trace.of_kind("call_outcome_unknown")
        assert unknown["call_id"] == "l1"


async def test_a_stop_saved_before_its_journal_was_removed_supersedes_it(
    private_dir: Path,
) -> None:
    async with SqliteCheckpointStore(private_dir / "checkpoints.sqlite") as store:
        log: list[str] = []
        scripted = model(
            step(("l1", "lookup_order", {"order_id": "A1"})),
            step(("r1", "refund", {"order_id": "A1"})),
        )
        # Replaces: 1 after l1's answer, 2 removes the journal once the pause is saved.
        runtime = Runtime(refund_program(scripted, log), FailingAt(store, at=2))
        with pytest.raises(Killed):
            await runtime.invoke("support", run_id="run-8")
        rows = {r.status: r for r in await store.list(run_id="run-8")}
        assert set(rows) == {"running", "awaiting_approval"}
        later = Runtime(refund_program(model(final("ok")), log), store)
        with pytest.raises(ConfigurationError, match="superseded"):
            await later.resume(rows["running"].checkpoint_id, worker_stopped=True)
        done = await later.resume(rows["awaiting_approval"].checkpoint_id, approvals={"r1": True})
        assert done.status == "completed"
        assert log == ["lookup A1", "refund A1"]


async def test_a_worker_declared_stopped_while_alive_stops_at_its_next_write(
    private_dir: Path,
) -> None:
    async with (
        SqliteCheckpointStore(private_dir / "checkpoints.sqlite") as store,
        SqliteHistoryStore(private_dir / "history.sqlite") as history_store,
    ):
        history = HistoryConfig(store=history_store, namespace="lost")
        release = asyncio.Event()
        started = asyncio.Event()
        log: list[str] = []

        def slow_program(scripted: ScriptedProvider) -> Program:
            program = Program()

            @program.capability
            async def slow_lookup(order_id: str) -> str:
                log.append(f"lookup {order_id}")
                started.set()
                await release.wait()
                return "delivered"

            program.agent("support", provider=scripted, capabilities=("slow_lookup",))
            return program

        zombie_model = model(
            step(("s1", "slow_lookup", {"order_id": "A1"})), final("zombie"), history=history
        )
        zombie = asyncio.create_task(
            Runtime(slow_program(zombie_model), store).invoke("support", run_id="run-9")
        )
        await started.wait()  # the zombie is inside its call, not holding the history
        rescuer_model = model(final("rescued"), history=history)
        other = slow_program(rescuer_model)
        [row] = await store.list(run_id="run-9")
        rescued = await Runtime(other, store).resume(row.checkpoint_id, worker_stopped=True)
        assert rescued.status == "completed"
        assert rescued.output == "rescued"
        assert [e["call_id"] for e in rescued.trace.of_kind("call_outcome_unknown")] == ["s1"]
        release.set()  # the zombie's call ends; its next write finds the journal claimed
        result = await zombie
        assert result.status == "failed"
        assert isinstance(result.error, InvocationBusy)
        assert len(zombie_model.requests) == 1  # it did not decide again
        assert log == ["lookup A1"]
        assert await store.list() == []
