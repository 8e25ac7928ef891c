"""A worker stopped after its final decision was saved (issue 29, item 7a).

The approved refund ran, the model's final decision was saved in history, and the
worker died before it removed its running checkpoint. ``resume(...,
worker_stopped=True)`` completes the invocation from the decision history holds:
the refund is not run again, the model is not asked again, the caller gets the
answer that is stored, and the checkpoint goes as on a normal completion. The
other moments of the same crash keep their own guarantees (a call that had not
started runs once; one that had started is answered as of unknown outcome).

In process, the kill is a BaseException raised by the checkpoint store at its
n-th write (``Dying``); across processes, a forked worker is SIGKILLed at random
moments (:class:`tests._zygote.Zygote`), on SQLite and PostgreSQL checkpoint stores.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._zygote import Zygote
from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider

from ._final_worker import NAMESPACE, answer, ask_refund, refund_program
from ._stores import Place, open_checkpoints

pytestmark = pytest.mark.filterwarnings("error")


class Killed(BaseException):
    """Stands for the process dying where it is raised."""


class Dying:
    """A checkpoint store that dies at its ``at``-th write (save or replace)."""

    def __init__(self, inner: Any, at: int) -> None:
        self.inner = inner
        self.at = at
        self.writes = 0

    def _write(self) -> None:
        self.writes += 1
        if self.writes == self.at:
            raise Killed

    async def save(self, checkpoint_id: str, checkpoint: dict[str, Any]) -> None:
        self._write()
        await self.inner.save(checkpoint_id, checkpoint)

    async def get(self, checkpoint_id: str) -> Any:
        return await self.inner.get(checkpoint_id)

    async def take(self, checkpoint_id: str) -> Any:
        return await self.inner.take(checkpoint_id)

    async def replace(self, checkpoint_id: str, checkpoint: Any, *, revision: int) -> bool:
        self._write()
        return bool(await self.inner.replace(checkpoint_id, checkpoint, revision=revision))

    async def list(self, *, run_id: str | None = None) -> Any:
        return await self.inner.list(run_id=run_id)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


async def pause(checkpoints: Any, history: HistoryConfig, effects: Path, run: str) -> str:
    """An invocation of ``run`` awaiting approval of its refund; its checkpoint id."""
    model = ScriptedProvider(ask_refund(run), history=history)
    paused = await Runtime(refund_program(model, effects), checkpoints).invoke(
        "support", input="refund A1", run_id=run
    )
    assert paused.status == "awaiting_approval"
    assert paused.checkpoint_id
    return paused.checkpoint_id


def program(model: ScriptedProvider, effects: Path) -> Program:
    return refund_program(model, effects)


async def test_a_worker_killed_after_its_final_decision_was_saved_completes_from_it(
    durable: Place, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.log"
    async with SqliteHistoryStore(tmp_path / "history.sqlite") as store:
        history = HistoryConfig(store=store, namespace=NAMESPACE)
        checkpoints = durable.checkpoints()
        checkpoint_id = await pause(checkpoints, history, effects, "run-1")

        # Writes of the approved resume: 1 claims, 2 records the refund started,
        # 3 its answer, 4 removes the running checkpoint once the final decision was
        # saved in history: the worker dies there.
        dying = ScriptedProvider(answer("run-1"), history=history)
        with pytest.raises(Killed):
            await Runtime(program(dying, effects), Dying(checkpoints, at=4)).resume(
                checkpoint_id, approvals={"r1": True}
            )
        assert lines(effects) == ["refund A1 run-1"]
        [row] = await checkpoints.list(run_id="run-1")
        assert row.status == "running"

        later = ScriptedProvider(ScriptedProvider.final("asked again"), history=history)
        result = await Runtime(program(later, effects), checkpoints).resume(
            row.checkpoint_id, worker_stopped=True
        )
        assert result.status == "completed", result.error
        assert result.output == "refunded A1 for run-1"  # what history holds
        assert later.requests == []  # the model was not asked again
        assert lines(effects) == ["refund A1 run-1"]  # the effect ran exactly once
        assert await checkpoints.list(run_id="run-1") == []
        assert [e["number"] for e in result.trace.of_kind("decision_recovered")] == [2]
        [conversation] = await store.list(NAMESPACE)
        assert not conversation.active


@pytest.mark.parametrize("at", [1, 2, 3, 4])
async def test_every_moment_of_an_approved_resume_recovers(
    durable: Place, tmp_path: Path, at: int
) -> None:
    effects = tmp_path / "effects.log"
    async with SqliteHistoryStore(tmp_path / "history.sqlite") as store:
        history = HistoryConfig(store=store, namespace=NAMESPACE)
        checkpoints = durable.checkpoints()
        checkpoint_id = await pause(checkpoints, history, effects, "run-2")
        dying = ScriptedProvider(answer("run-2"), history=history)
        with pytest.raises(Killed):
            await Runtime(program(dying, effects), Dying(checkpoints, at=at)).resume(
                checkpoint_id, approvals={"r1": True}
            )
        later = ScriptedProvider(answer("run-2"), history=history)
        runtime = Runtime(program(later, effects), checkpoints)
        [row] = await checkpoints.list(run_id="run-2")
        if at == 1:  # died claiming it: still awaiting approval
            assert row.status == "awaiting_approval"
            result = await runtime.resume(row.checkpoint_id, approvals={"r1": True})
        else:
            assert row.status == "running"
            result = await runtime.resume(row.checkpoint_id, worker_stopped=True)
        assert result.status == "completed", result.error
        assert result.output == "refunded A1 for run-2"
        assert lines(effects) == ["refund A1 run-2"]  # once, whatever the moment
        unknown = result.trace.of_kind("call_outcome_unknown")
        assert len(unknown) == (at == 3)  # it ran, its answer was never recorded
        assert len(later.requests) == (at != 4)
        assert await checkpoints.list(run_id="run-2") == []


KILLS = 16  # per store; seeded


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """One forking process for the module (its start costs seconds on a busy machine)."""
    with Zygote("tests.runtime._final_worker") as forking:
        yield forking


def test_random_kills_of_an_approved_resume_leave_no_failed_resume(
    durable: Place, tmp_path: Path, zygote: Zygote
) -> None:
    import asyncio

    rng = random.Random(297)
    effects = tmp_path / "effects.log"
    history_file = tmp_path / "history.sqlite"
    where = list(durable.argv()[1:])
    counts = {"killed": 0, "finished": 0, "awaiting_approval": 0, "running": 0, "done": 0}

    async def prepare(run: str) -> str:
        async with (
            SqliteHistoryStore(history_file, max_sessions=1024) as store,
            open_checkpoints(durable.kind, *where) as checkpoints,
        ):
            return await pause(
                checkpoints, HistoryConfig(store=store, namespace=NAMESPACE), effects, run
            )

    async def recover(run: str) -> None:
        async with (
            SqliteHistoryStore(history_file, max_sessions=1024) as store,
            open_checkpoints(durable.kind, *where) as checkpoints,
        ):
            history = HistoryConfig(store=store, namespace=NAMESPACE)
            later = ScriptedProvider(answer(run), history=history)
            runtime = Runtime(program(later, effects), checkpoints)
            rows = await checkpoints.list(run_id=run)
            if not rows:
                counts["done"] += 1
                return
            [row] = rows
            counts[row.status] += 1
            if row.status == "awaiting_approval":
                result = await runtime.resume(row.checkpoint_id, approvals={"r1": True})
            else:
                result = await runtime.resume(row.checkpoint_id, worker_stopped=True)
            assert result.status == "completed", (run, result.error)
            assert result.output == f"refunded A1 for {run}"
            assert await checkpoints.list(run_id=run) == []

    # Runs to the end: the first in the zygote (first-time costs, paid once), then
    # three forked; the kills are spread over the quickest one's span (one slow warm
    # run, on a busy machine, spread them past the end of most runs: 7 of 16 killed).
    spans = []
    for warm in range(4):
        run = f"warm-{warm}"
        checkpoint_id = asyncio.run(prepare(run))
        ended = zygote.run(
            "approve",
            durable.kind,
            where,
            str(history_file),
            str(effects),
            checkpoint_id,
            run,
            kill_after=None,
            fork=bool(warm),
        )
        assert (ended.killed, ended.code) == (False, 0)
        if warm:
            spans.append(ended.seconds)
    span = min(spans)
    for n in range(2 * KILLS):  # until KILLS runs were killed (a run may end first)
        if counts["killed"] == KILLS:
            break
        run = f"kill-{n}"
        checkpoint_id = asyncio.run(prepare(run))
        ended = zygote.run(
            "approve",
            durable.kind,
            where,
            str(history_file),
            str(effects),
            checkpoint_id,
            run,
            kill_after=rng.uniform(0, span * 1.05),
        )
        assert ended.code in (0, -9), ended
        counts["killed" if ended.killed else "finished"] += 1
        asyncio.run(recover(run))
        refunds = [line for line in lines(effects) if line.endswith(f" {run}")]
        assert len(refunds) <= 1, (run, refunds)  # never twice
    assert counts["killed"] >= KILLS // 2, counts
    print(f"{durable.kind}: {counts} (span {span * 1000:.0f} ms)")


async def test_a_delegate_killed_after_its_final_decision_was_saved_answers_from_it(
    durable: Place, tmp_path: Path
) -> None:
    async with SqliteHistoryStore(tmp_path / "history.sqlite") as store:
        history = HistoryConfig(store=store, namespace=NAMESPACE)
        checkpoints = durable.checkpoints()

        def delegating(parent: ScriptedProvider, child: ScriptedProvider) -> Program:
            program = Program()
            program.delegate("research", description="Ask the research agent.")
            program.agent("support", provider=parent, capabilities=("research",))
            program.agent("research", provider=child)
            return program

        # Writes: 1 records the delegate started, 2 its answer: the worker dies there,
        # after the delegate's final decision (its first) was saved in its history.
        parent = ScriptedProvider(
            ScriptedProvider.call("research", "d1", input="find it"), history=history
        )
        child = ScriptedProvider(ScriptedProvider.final("CHILD-ANSWER"), history=history)
        dying = Runtime(delegating(parent, child), Dying(checkpoints, at=2))
        with pytest.raises(Killed):
            await dying.invoke("support", run_id="run-3")
        [row] = await checkpoints.list(run_id="run-3")

        parent = ScriptedProvider(ScriptedProvider.final("done"), history=history)
        child = ScriptedProvider(ScriptedProvider.final("asked again"), history=history)
        result = await Runtime(delegating(parent, child), checkpoints).resume(
            row.checkpoint_id, worker_stopped=True
        )
        assert result.status == "completed", result.error
        assert child.requests == []  # the delegate's saved answer was taken
        [observation] = parent.requests[0].observations
        assert (observation.status, observation.result) == ("ok", "CHILD-ANSWER")
        assert len(result.trace.of_kind("decision_recovered")) == 1
        assert await checkpoints.list(run_id="run-3") == []
