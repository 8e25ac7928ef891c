"""Put checkpoints into a ToubaSaver forever, until killed; and what the crash tests
(test_crash.py on SQLite, test_redis.py on Redis) check afterwards.

    python -m tests.integrations.langgraph._crash_worker sqlite PATH
    python -m tests.integrations.langgraph._crash_worker redis URL PREFIX

Step n's checkpoint holds 3n messages of ~4 KB (its parent's and three new ones) and
metadata ``{"step": n}``; "ready" is printed after step 5, then steps continue.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import empty_checkpoint

from touba.integrations.langgraph import ToubaSaver

ROOT = Path(__file__).resolve().parents[3]


def opened(store: str, *args: str) -> ToubaSaver:
    """The saver the worker writes to: ``sqlite PATH`` or ``redis URL PREFIX``."""
    if store == "sqlite":
        return ToubaSaver.sqlite(args[0])
    return ToubaSaver.redis(args[0], prefix=args[1])


async def main(store: str, *args: str) -> None:
    async with opened(store, *args) as saver:
        config: RunnableConfig = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
        messages: list[AnyMessage] = []
        version: str | None = None
        step = 0
        while True:
            step += 1
            messages = [
                *messages,
                HumanMessage(f"{step}a " + "x" * 4000, id=f"{step}a"),
                AIMessage(f"{step}b " + "y" * 4000, id=f"{step}b"),
                HumanMessage(f"{step}c " + "z" * 4000, id=f"{step}c"),
            ]
            version = saver.get_next_version(version, None)
            checkpoint = empty_checkpoint()
            checkpoint["channel_values"] = {"messages": messages, "step": step}
            checkpoint["channel_versions"] = {"messages": version, "step": version}
            config = await saver.aput(
                config, checkpoint, {"step": step}, {"messages": version, "step": version}
            )
            await saver.aput_writes(config, [("step", step)], f"task-{step}")
            if step == 5:
                print("ready", flush=True)


def kill_while_putting(delay: float, store: str, *args: str) -> None:
    """Run the worker on ``store``, and kill -9 it ``delay`` seconds after step 5."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    with subprocess.Popen(
        [sys.executable, "-m", "tests.integrations.langgraph._crash_worker", store, *args],
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


async def check_and_put_after(saver: ToubaSaver) -> tuple[RunnableConfig, int]:
    """Every checkpoint the killed worker left is whole, with no hole in the steps; then
    a put continuing the newest one. Its config, and the newest step."""
    thread: RunnableConfig = {"configurable": {"thread_id": "t"}}
    history = [t async for t in saver.alist(thread)]
    steps = [t.metadata["step"] for t in history]
    assert steps[-1] == 1
    assert steps == list(range(steps[0], 0, -1))  # no hole: each put whole or absent
    assert steps[0] >= 5
    for t in history:
        step = t.metadata["step"]
        messages = t.checkpoint["channel_values"]["messages"]
        assert [m.id for m in messages] == [f"{n}{x}" for n in range(1, step + 1) for x in "abc"]
        assert t.checkpoint["channel_values"]["step"] == step
        assert [w[2] for w in t.pending_writes or []] in ([], [step])

    latest = history[0]
    checkpoint = empty_checkpoint()
    messages = [*latest.checkpoint["channel_values"]["messages"], HumanMessage("after", id="z")]
    checkpoint["channel_values"] = {"messages": messages}
    version = saver.get_next_version(str(latest.checkpoint["channel_versions"]["messages"]), None)
    checkpoint["channel_versions"] = {"messages": version}
    config = await saver.aput(latest.config, checkpoint, {"step": -9}, {"messages": version})
    return config, steps[0]


async def check_reopened(saver: ToubaSaver, config: RunnableConfig, newest: int) -> None:
    """A saver opened afresh reads the put :func:`check_and_put_after` made."""
    again = await saver.aget_tuple(config)
    assert again is not None
    ids = [m.id for m in again.checkpoint["channel_values"]["messages"]]
    assert ids[-2:] == [f"{newest}c", "z"]


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
