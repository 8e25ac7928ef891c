"""An erase killed midway (``kill -9``) is finished by a rerun: nothing of the user left.

The child process (``tests/data/_erase_child.py``) erases over real SQLite files with one
store slowed at a point; the test kills it there, then reruns the erase in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data._world import Deployment, marker
from touba.data import erase_user, verify_erased

ALICE, BOB = "alice-7f3", "bob-2c1"
ROOT = Path(__file__).resolve().parents[2]


def _kill_at(point: str, directory: Path) -> None:
    """Run the child erasing ALICE; ``kill -9`` it once it reached ``point``."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.data._erase_child", point, str(directory), ALICE],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not (directory / "at-point").exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never reached its point"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL
        assert b"finished" not in out
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


@pytest.mark.parametrize("point", ["after_histories", "in_memory_transaction"])
async def test_an_erase_killed_midway_is_finished_by_a_rerun(point: str, tmp_path: Path) -> None:
    world = Deployment("sqlite", tmp_path)
    await world.open()
    try:
        await world.populate(ALICE)
        await world.populate(BOB)
        bob = await verify_erased(BOB, world.stores)
        everything = await verify_erased(ALICE, world.stores)
    finally:
        await world.close()
    directory = tmp_path / "private"
    _kill_at(point, directory)

    stores = await world.open()
    try:
        halfway = await verify_erased(ALICE, stores)
        if point == "after_histories":
            assert "history" not in halfway  # erased before the kill
        assert halfway["memory"] == everything["memory"]  # the sessions stay until the end
        receipt = await erase_user(ALICE, stores)
        assert receipt.counts["memory"] == everything["memory"]
        assert await verify_erased(ALICE, stores) == {}
        assert await verify_erased(BOB, stores) == bob
    finally:
        await world.close()
    rows = world.sqlite_rows()
    assert not [r for r in rows if ALICE in r or marker(ALICE) in r]
    data = world.file_bytes()
    assert marker(ALICE).encode() not in data
    assert ALICE.encode() not in data
