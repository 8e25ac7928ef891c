"""Every part on PostgreSQL alone, across processes (issue 8, section 4).

Separate Python processes share nothing but the PostgreSQL server: one pauses
an invocation for approval and another resumes it; two processes run chat
turns of the same user's session (the second sees the first's turn); a third
process, ``touba worker``, extracts the session's key events. Checkpoints,
decision history, chat memory and key events are all PostgreSQL stores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests._services import postgres_dsn

pytestmark = pytest.mark.postgres
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def place() -> Iterator[tuple[str, str]]:
    dsn, name = postgres_dsn(), f"e2e_{uuid.uuid4().hex[:8]}"
    yield dsn, name
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
            "AND tablename LIKE %s",
            (f"{name}%",),
        ).fetchall()
        for (table,) in rows:
            conn.execute(f'DROP TABLE IF EXISTS "{table}" CASCADE')


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TOUBA_DSN", None)
    env["COLUMNS"] = "200"  # rich tables at full width
    return env


def _run_module(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m *argv`` from the repository root, with its output."""
    return subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def worker(action: str, dsn: str, name: str, effects: Path, *extra: str) -> dict[str, Any]:
    done = _run_module("tests.runtime._pg_worker", action, dsn, name, str(effects), *extra)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def touba(*args: str) -> str:
    done = _run_module("touba.cli", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_an_approval_paused_in_one_process_is_resumed_in_another(
    place: tuple[str, str], tmp_path: Path
) -> None:
    dsn, name = place
    effects = tmp_path / "effects.log"
    paused = worker("pause", dsn, name, effects)
    assert paused["status"] == "awaiting_approval"
    assert effects.read_text().splitlines() == ["lookup I-1"]
    resumed = worker("resume", dsn, name, effects, paused["checkpoint_id"])
    assert resumed == {"status": "completed", "output": "Paid I-1.", "conversations": 1}
    assert effects.read_text().splitlines() == ["lookup I-1", "pay I-1"]
    with psycopg.connect(dsn) as conn:
        left = conn.execute(f'SELECT count(*) FROM "{name}_cp"').fetchone()  # noqa: S608
    assert left == (0,)  # consumed


def test_chat_turns_from_two_processes_and_key_events_from_touba_worker(
    place: tuple[str, str], tmp_path: Path
) -> None:
    dsn, name = place
    effects = tmp_path / "effects.log"
    session = str(uuid.uuid4())
    first = worker("chat", dsn, name, effects, session)
    assert (first["status"], first["prior"]) == ("completed", [])
    second = worker("chat-end", dsn, name, effects, session)
    assert second["status"] == "completed"
    assert second["prior"] == ["My parcel A1 arrived broken"]  # the other process's turn
    assert second["job"]

    program = "tests.runtime._pg_worker:worker_program"
    memory = ["--dsn", dsn, "--prefix", f"{name}_m"]
    ran = touba("worker", *memory, "--once", "--program", program)
    assert "done: 1 created" in ran
    listed = touba("events", "ls", *memory, "--user", "u-1")
    assert "Refund parcel A1" in listed
