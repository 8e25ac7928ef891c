"""kill -9 in the middle of an invocation, then resume from another process (issue 8, section 3).

A real worker process (``_crash_worker``) runs over SQLite checkpoints and
history and is killed with SIGKILL while a capability call runs, or while the
model decides; this process then finds its checkpoint by run id and resumes
it. A started call is answered as of unknown outcome and never run again; a
call whose answer was recorded is sent to the model, and history's
reservation of the dead worker is freed by the resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from touba.errors import InvocationBusy
from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.runtime import Runtime, SqliteCheckpointStore
from touba.testing import ScriptedProvider

from ._crash_worker import NAMESPACE, RUN_ID, crash_program, effects

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs SIGKILL")
ROOT = Path(__file__).resolve().parents[2]


def kill_when_blocked(directory: Path, mode: str) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime._crash_worker", str(directory), mode],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while "blocked" not in effects(directory):
            if worker.poll() is not None:
                raise AssertionError(f"the worker exited early: {worker.stderr.read()!r}")  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise AssertionError("the worker never reached its blocking point")
            time.sleep(0.02)
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.wait(timeout=30)
        if worker.stderr is not None:
            worker.stderr.close()
    assert worker.returncode == -signal.SIGKILL


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return state


async def test_a_call_running_when_its_worker_was_killed_is_reported_uncertain(
    directory: Path,
) -> None:
    kill_when_blocked(directory, "call")
    assert effects(directory) == ["refund A1", "blocked"]
    async with (
        SqliteCheckpointStore(directory / "checkpoints.sqlite") as checkpoints,
        SqliteHistoryStore(directory / "history.sqlite") as store,
    ):
        model = ScriptedProvider(
            {"action": "final", "output": "I could not confirm the refund; checking."},
            history=HistoryConfig(store=store, namespace=NAMESPACE),
        )
        runtime = Runtime(crash_program(model, directory, block_in_refund=False), checkpoints)
        [row] = await checkpoints.list(run_id=RUN_ID)
        assert row.status == "running"
        with pytest.raises(InvocationBusy):
            await runtime.resume(row.checkpoint_id)
        result = await runtime.resume(row.checkpoint_id, worker_stopped=True)
        assert result.status == "completed", result.error
    assert effects(directory) == ["refund A1", "blocked"]  # never run again
    [observation] = model.requests[0].observations
    assert (observation.call_id, observation.status) == ("r1", "error")
    assert "outcome of this call" in str(observation.error)
    assert [e["call_id"] for e in result.trace.of_kind("call_outcome_unknown")] == ["r1"]


async def test_a_worker_killed_while_the_model_decides_loses_no_answer(directory: Path) -> None:
    kill_when_blocked(directory, "decide")
    assert effects(directory) == ["lookup A1", "blocked"]
    async with (
        SqliteCheckpointStore(directory / "checkpoints.sqlite") as checkpoints,
        SqliteHistoryStore(directory / "history.sqlite") as store,
    ):
        [conversation] = await store.list(NAMESPACE)
        assert conversation.active  # the dead worker's reservation
        model = ScriptedProvider(
            {"action": "final", "output": "A1 was delivered."},
            history=HistoryConfig(store=store, namespace=NAMESPACE),
        )
        runtime = Runtime(crash_program(model, directory, block_in_refund=False), checkpoints)
        [row] = await checkpoints.list(run_id=RUN_ID)
        result = await runtime.resume(row.checkpoint_id, worker_stopped=True)
        assert result.status == "completed", result.error
        assert await checkpoints.list() == []
    assert effects(directory) == ["lookup A1", "blocked"]
    [observation] = model.requests[0].observations
    assert (observation.call_id, observation.status) == ("l1", "ok")
    assert observation.result == {"order_id": "A1", "status": "delivered"}
