"""Put checkpoints into a ToubaSaver SQLite file forever, until killed (see test_crash.py).

    python -m tests.integrations.langgraph._crash_worker PATH

Step n's checkpoint holds 3n messages of ~4 KB (its parent's and three new ones) and
metadata ``{"step": n}``; "ready" is printed after step 5, then steps continue.
"""

from __future__ import annotations

import asyncio
import sys

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import empty_checkpoint

from touba.integrations.langgraph import ToubaSaver


async def main(path: str) -> None:
    async with ToubaSaver.sqlite(path) as saver:
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


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
