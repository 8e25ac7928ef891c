"""kill -9 during ToubaSaver.aput on SQLite: the thread stays readable, each checkpoint
whole or absent, and the next put continues the log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import empty_checkpoint

from touba.integrations.langgraph import ToubaSaver

ROOT = Path(__file__).resolve().parents[3]


def kill_while_putting(path: Path, delay: float) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    with subprocess.Popen(
        [sys.executable, "-m", "tests.integrations.langgraph._crash_worker", str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    ) as process:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
async def test_kill_9_during_aput_leaves_every_checkpoint_whole_or_absent(
    private_dir: Path, delay: float
) -> None:
    path = private_dir / "graph.sqlite"
    kill_while_putting(path, delay)

    async with ToubaSaver.sqlite(path) as saver:
        thread: RunnableConfig = {"configurable": {"thread_id": "t"}}
        history = [t async for t in saver.alist(thread)]
        steps = [t.metadata["step"] for t in history]
        assert steps[-1] == 1
        assert steps == list(range(steps[0], 0, -1))  # no hole: each put whole or absent
        assert steps[0] >= 5
        for t in history:
            step = t.metadata["step"]
            messages = t.checkpoint["channel_values"]["messages"]
            assert [m.id for m in messages] == [
                f"{n}{x}" for n in range(1, step + 1) for x in "abc"
            ]
            assert t.checkpoint["channel_values"]["step"] == step
            assert [w[2] for w in t.pending_writes or []] in ([], [step])

        latest = history[0]
        checkpoint = empty_checkpoint()
        messages = [*latest.checkpoint["channel_values"]["messages"], HumanMessage("after", id="z")]
        checkpoint["channel_values"] = {"messages": messages}
        version = saver.get_next_version(
            str(latest.checkpoint["channel_versions"]["messages"]), None
        )
        checkpoint["channel_versions"] = {"messages": version}
        config = await saver.aput(latest.config, checkpoint, {"step": -9}, {"messages": version})

    async with ToubaSaver.sqlite(path) as fresh:
        again = await fresh.aget_tuple(config)
        assert again is not None
        assert [m.id for m in again.checkpoint["channel_values"]["messages"]][-2:] == [
            f"{steps[0]}c",
            "z",
        ]
