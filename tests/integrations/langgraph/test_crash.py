"""kill -9 during ToubaSaver.aput on SQLite: the thread stays readable, each checkpoint
whole or absent, and the next put continues the log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.langgraph._crash_worker import (
    check_and_put_after,
    check_reopened,
    kill_while_putting,
)
from touba.integrations.langgraph import ToubaSaver


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
async def test_kill_9_during_aput_leaves_every_checkpoint_whole_or_absent(
    private_dir: Path, delay: float
) -> None:
    path = private_dir / "graph.sqlite"
    kill_while_putting(delay, "sqlite", str(path))
    async with ToubaSaver.sqlite(path) as saver:
        config, newest = await check_and_put_after(saver)
    async with ToubaSaver.sqlite(path) as fresh:
        await check_reopened(fresh, config, newest)
