"""Checkpoints in the runtime: contents, versions, private files, resuming elsewhere.

The store contract (every store, atomicity, other processes) is test_checkpoint_stores.py.
"""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from touba.errors import ConfigurationError, DecisionHistoryStorageUnsafe
from touba.runtime import MemoryCheckpointStore, Program, Runtime, SqliteCheckpointStore
from touba.testing import ScriptedProvider

from ._durable import FIRST_STEP, build, history
from ._helpers import final
from ._stores import ROOT, subprocess_env


async def test_the_checkpoint_holds_identity_observations_pending_budgets_and_trace() -> None:
    store = MemoryCheckpointStore()
    ledger: list[str] = []
    program = Program()

    @program.capability(max_calls=3)
    async def lookup_invoice(invoice: str) -> dict[str, str]:
        ledger.append(invoice)
        return {"invoice": invoice}

    @program.capability(requires_approval=True)
    async def pay(invoice: str) -> str:
        return "paid"

    model = ScriptedProvider(FIRST_STEP)
    program.agent("billing", provider=model, capabilities=("lookup_invoice", "pay"))
    result = await Runtime(program, checkpoints=store).invoke("billing", input="x", run_id="r")
    checkpoint = await store.get(result.checkpoint_id or "")
    assert checkpoint is not None
    assert checkpoint["version"] == 1
    assert checkpoint["checkpoint_id"] == result.checkpoint_id
    assert (checkpoint["run_id"], checkpoint["invocation_id"], checkpoint["agent_ref"]) == (
        "r",
        result.invocation_id,
        "billing",
    )
    assert checkpoint["input"] == "x"
    assert checkpoint["decisions"] == 1
    assert checkpoint["calls_used"] == {"lookup_invoice": 1}
    assert [c["call_id"] for c in checkpoint["calls"]] == ["c1", "c2"]
    assert checkpoint["done"] == [
        {
            "call_id": "c1",
            "name": "lookup_invoice",
            "arguments": {"invoice": "I-1"},
            "status": "ok",
            "result": {"invoice": "I-1"},
        }
    ]
    assert checkpoint["pending"] == [
        {
            "kind": "approval",
            "call": {"call_id": "c2", "name": "pay", "arguments": {"invoice": "I-1"}},
        }
    ]
    assert [e["kind"] for e in checkpoint["trace"]][-1] == "awaiting_approval"
    assert json.loads(json.dumps(checkpoint)) == checkpoint


async def test_a_checkpoint_of_another_version_is_refused() -> None:
    store = MemoryCheckpointStore()
    model = ScriptedProvider(FIRST_STEP)
    runtime = build(model, store, [])
    result = await runtime.invoke("billing")
    checkpoint = await store.take(result.checkpoint_id or "")
    assert checkpoint is not None
    await store.save("future", checkpoint | {"version": 99})
    with pytest.raises(ConfigurationError, match="version 99"):
        await runtime.resume("future")
    await store.save("broken", {"version": 1, "pending": "nope"})
    with pytest.raises(ConfigurationError, match="malformed"):
        await runtime.resume("broken")


def _modes(path: Path) -> set[int]:
    files = [Path(str(path) + suffix) for suffix in ("", "-wal", "-shm", "-journal")]
    return {stat.S_IMODE(f.stat().st_mode) for f in files if f.exists()}


async def test_sqlite_store_files_are_private(private_dir: Path) -> None:
    """The store contract itself runs in test_checkpoint_stores.py, on every store."""
    path = private_dir / "checkpoints.sqlite"
    async with SqliteCheckpointStore(path) as store:
        await store.save("a", {"version": 1, "run_id": "r", "text": "é"})
        await store.replace("a", {"version": 1}, revision=0)
    assert _modes(path) == {0o600}


def test_sqlite_store_refuses_unsafe_locations(tmp_path: Path, private_dir: Path) -> None:
    target = private_dir / "real.sqlite"
    target.touch(mode=0o600)
    link = private_dir / "link.sqlite"
    link.symlink_to(target)
    with pytest.raises(DecisionHistoryStorageUnsafe, match="symbolic link"):
        SqliteCheckpointStore(link)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(DecisionHistoryStorageUnsafe, match="writable by group"):
        SqliteCheckpointStore(shared / "checkpoints.sqlite")
    assert not (shared / "checkpoints.sqlite").exists()
    with pytest.raises(ConfigurationError, match="exactly one"):
        SqliteCheckpointStore()


async def _pause_in_subprocess(directory: Path, mode: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "tests.runtime._durable", str(directory), mode]
    done = await asyncio.to_thread(
        subprocess.run,
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),  # this checkout's touba, not whichever is installed
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    paused: dict[str, Any] = json.loads(done.stdout)
    assert paused["status"] == "awaiting_approval"
    assert paused["pending"] == ["c2"]
    assert paused["ledger"] == ["lookup I-1"]
    return paused


async def _resume_here(directory: Path, mode: str, paused: dict[str, Any]) -> Any:
    config, history_store = history(directory, mode)
    model = ScriptedProvider(final("paid"), history=config)
    ledger: list[str] = []
    try:
        async with SqliteCheckpointStore(directory / "checkpoints.sqlite") as checkpoints:
            runtime = build(model, checkpoints, ledger)
            result = await runtime.resume(paused["checkpoint_id"], approvals={"c2": True})
    finally:
        if history_store is not None:
            await history_store.close()
    assert result.status == "completed"
    assert result.output == "paid"
    assert (result.run_id, result.invocation_id) == ("run-durable", paused["invocation_id"])
    assert ledger == ["pay I-1"]  # the lookup ran in the other process, once
    return result, model


async def test_resume_in_another_process_with_sqlite_history(private_dir: Path) -> None:
    paused = await _pause_in_subprocess(private_dir, "sqlite")
    result, model = await _resume_here(private_dir, "sqlite", paused)
    events = [e["event"] for e in result.trace.of_kind("history_event")]
    assert "resumed_without_messages" not in events
    roles = [m["role"] for m in model.sent[0]]
    assert roles == ["system", "user", "assistant", "tool", "tool"]  # the old call, paired
    assert [m["tool_call_id"] for m in model.sent[0][3:]] == ["c1", "c2"]
    # The trace carries on from the other process's entries.
    kinds = [e.kind for e in result.trace]
    assert kinds[0] == "invocation_started"
    assert kinds.index("awaiting_approval") < kinds.index("invocation_resumed")


async def test_resume_in_a_fresh_process_whose_history_was_ram_only(private_dir: Path) -> None:
    paused = await _pause_in_subprocess(private_dir, "ram")
    result, model = await _resume_here(private_dir, "ram", paused)
    events = [e["event"] for e in result.trace.of_kind("history_event")]
    assert "resumed_without_messages" in events
    sent = model.sent[0]
    assert all(m["role"] in ("system", "user") for m in sent)  # never an orphan tool result
    data = sent[-1]["content"]
    assert "lookup_invoice" in data
    assert "paid" in data
