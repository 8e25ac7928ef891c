"""ToubaSaver on SQLite against LangGraph's InMemorySaver and AsyncSqliteSaver.

A ``StateGraph`` tool loop (a scripted model node that calls a tool once per question,
LangGraph's ``ToolNode``, then an answer) runs on a thread that already holds N messages
of about 1 KB (10, 1,000, 5,000), with each saver in turn, interleaved. A "step" is one
super-step of the graph: one ``aput`` (and its ``aput_writes``) of the running loop; its
time is an ``ainvoke`` divided by the checkpoints it made (4 per question). Printed per N:
ms per step for each saver (median of the rounds) and ToubaSaver's ratio to each.

Then the bytes: for ToubaSaver, the bytes it hands its store per step (log items, blobs,
the checkpoint record, metadata, pending writes) against the bytes of the messages the
step added (LangGraph's serializer), and what SQLite wrote to the files (``wchar`` of
/proc/self/io: WAL pages and checkpoints); and the size of each SQLite file after 60
steps on a thread of 1,000 messages. Benchmarks are not tests: nothing here asserts.

    .venv/bin/python bench/langgraph_saver.py [--quick] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from touba.integrations.langgraph import ToubaSaver
from touba.integrations.langgraph._backend import PutCheckpoint, PutResult, WriteRecord
from touba.integrations.langgraph._sqlite import SqliteSaverBackend

BODY = "lorem ipsum dolor sit amet " * 38  # ~1 KB


@tool
def lookup(query: str) -> str:
    """Look something up."""
    return f"found {query[:20]} " + BODY


def model(state: MessagesState) -> dict[str, list[AnyMessage]]:
    last = state["messages"][-1]
    if isinstance(last, HumanMessage):
        call = {
            "name": "lookup",
            "args": {"query": str(last.content)[:40]},
            "id": f"c{len(state['messages'])}",
        }
        return {"messages": [AIMessage(BODY[:200], tool_calls=[call])]}
    assert isinstance(last, ToolMessage)
    return {"messages": [AIMessage("answer " + BODY)]}


def graph_with(saver: BaseCheckpointSaver[Any]) -> Any:
    builder = StateGraph(MessagesState)
    builder.add_node("model", model)
    builder.add_node("tools", ToolNode([lookup]))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=saver)


def conversation(n: int) -> list[AnyMessage]:
    out: list[AnyMessage] = []
    for i in range(n):
        kind = HumanMessage if i % 2 == 0 else AIMessage
        out.append(kind(f"{i} " + BODY, id=f"p{i}"))
    return out


def put_bytes(request: PutCheckpoint) -> int:
    """The bytes a put hands its backend: checkpoint, metadata, blobs and log items."""
    return (
        len(request.checkpoint[1])
        + len(request.metadata[1])
        + len(request.metadata_json)
        + sum(len(b.blob[1]) for b in request.blobs if b.blob is not None)
        + sum(len(d) for a in request.logs for _, d in a.items)
    )


def writes_bytes(writes: Sequence[WriteRecord]) -> int:
    """The bytes a put_writes hands its backend."""
    return sum(len(w.value[1]) for w in writes)


class Counting(SqliteSaverBackend):
    """The SQLite backend, counting the bytes ToubaSaver hands it."""

    handed = 0

    async def put(self, request: PutCheckpoint) -> PutResult:
        Counting.handed += put_bytes(request)
        return await super().put(request)

    async def put_writes(
        self, thread_id: str, checkpoint_ns: str, checkpoint_id: str, writes: Sequence[WriteRecord]
    ) -> None:
        Counting.handed += writes_bytes(writes)
        await super().put_writes(thread_id, checkpoint_ns, checkpoint_id, writes)


Opener = Callable[[Path], AbstractAsyncContextManager[BaseCheckpointSaver[Any]]]


@asynccontextmanager
async def touba(directory: Path) -> AsyncIterator[BaseCheckpointSaver[Any]]:
    async with ToubaSaver(Counting(directory / "touba.sqlite")) as saver:
        yield saver


@asynccontextmanager
async def in_memory(directory: Path) -> AsyncIterator[BaseCheckpointSaver[Any]]:
    yield InMemorySaver()


@asynccontextmanager
async def aiosqlite(directory: Path) -> AsyncIterator[BaseCheckpointSaver[Any]]:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    async with AsyncSqliteSaver.from_conn_string(str(directory / "langgraph.sqlite")) as saver:
        yield saver


SAVERS: dict[str, Opener] = {"touba": touba, "memory": in_memory, "aiosqlite": aiosqlite}


def written() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


async def prefill(graph: Any, config: RunnableConfig, n: int) -> None:
    await graph.aupdate_state(config, {"messages": conversation(n)})


async def question(graph: Any, config: RunnableConfig, i: int) -> int:
    """One question through the loop; the checkpoints it made."""
    message = HumanMessage(f"q{i} " + BODY[:300], id=f"q{i}")
    await graph.ainvoke({"messages": [message]}, config)
    return 4  # input, model, tools, model


Fill = Callable[[Any, RunnableConfig, int], Awaitable[None]]


async def side_by_side(
    savers: Mapping[str, BaseCheckpointSaver[Any]], n: int, rounds: int, fill: Fill = prefill
) -> dict[str, float]:
    """ms per super-step of the tool loop on each saver, on a thread ``fill`` gave n
    messages (median over rounds, the savers interleaved)."""
    graphs = {name: graph_with(saver) for name, saver in savers.items()}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    config: RunnableConfig = {"configurable": {"thread_id": f"bench-{n}"}}
    for graph in graphs.values():
        await fill(graph, config, n)
        await question(graph, config, -1)  # warm up
    for r in range(rounds):
        for name, graph in graphs.items():  # interleaved: side by side
            started = time.perf_counter()
            made = await question(graph, config, r)
            times[name].append((time.perf_counter() - started) * 1000 / made)
    return {name: statistics.median(values) for name, values in times.items()}


async def step_times(n: int, rounds: int) -> dict[str, float]:
    """ms per super-step for each saver at n messages (median over rounds)."""
    with tempfile.TemporaryDirectory() as tmp:
        async with AsyncExitStack() as stack:
            savers = {}
            for name, opener in SAVERS.items():
                (Path(tmp) / name).mkdir(mode=0o700)
                savers[name] = await stack.enter_async_context(opener(Path(tmp) / name))
            return await side_by_side(savers, n, rounds)


async def bytes_per_step(
    n: int, steps: int
) -> tuple[float, float, dict[str, float], dict[str, int]]:
    """For ToubaSaver at n messages: bytes handed to the store per step, bytes the step's
    new messages weigh, SQLite's file writes per step; then each SQLite file's size."""
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    serde = JsonPlusSerializer()
    sizes: dict[str, int] = {}
    handed = added = 0.0
    wrote: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("touba", "aiosqlite"):
            directory = Path(tmp) / name
            directory.mkdir(mode=0o700)
            async with SAVERS[name](directory) as saver:
                graph = graph_with(saver)
                config: RunnableConfig = {"configurable": {"thread_id": "bytes"}}
                await prefill(graph, config, n)
                Counting.handed = 0
                io_before = written()
                state = await graph.aget_state(config)
                count = len(state.values["messages"])
                made = 0
                i = 0
                while made < steps:
                    made += await question(graph, config, i)
                    i += 1
                io_after = written()
                wrote[name] = (io_after - io_before) / made
                if name == "touba":
                    state = await graph.aget_state(config)
                    new = state.values["messages"][count:]
                    added = sum(len(serde.dumps_typed(m)[1]) for m in new) / made
                    handed = Counting.handed / made
            sizes[name] = sum(
                f.stat().st_size for f in directory.iterdir() if f.name.endswith(("sqlite", "-wal"))
            )
    return handed, added, wrote, sizes


async def main(quick: bool, rounds: int) -> None:
    sizes_n = [10, 1000] if quick else [10, 1000, 5000]
    print("LangGraph tool loop, ms per super-step (median), thread of N messages of ~1 KB")
    print("(issue 28's targets: touba/memory <= 1.1 at 1,000 and 5,000; bytes <= 3x added)")
    print(
        f"{'N':>6}{'touba sqlite':>14}{'InMemorySaver':>15}{'AsyncSqlite':>13}"
        f"{'touba/memory':>14}{'touba/aiosqlite':>17}"
    )
    for n in sizes_n:
        t = await step_times(n, rounds if n < 5000 else max(2, rounds // 2))
        print(
            f"{n:>6}{t['touba']:>14.2f}{t['memory']:>15.2f}{t['aiosqlite']:>13.2f}"
            f"{t['touba'] / t['memory']:>14.2f}{t['touba'] / t['aiosqlite']:>17.2f}"
        )
    steps = 20 if quick else 60
    handed, added, wrote, sizes = await bytes_per_step(1000, steps)
    print(f"\nbytes per step at 1,000 messages ({steps} steps):")
    print(f"  messages the step added (serialized): {added:,.0f}")
    print(f"  ToubaSaver handed its store:          {handed:,.0f}  ({handed / added:.2f}x added)")
    for name, label in (("touba", "ToubaSaver"), ("aiosqlite", "AsyncSqliteSaver")):
        w = wrote[name]
        print(f"  {label + ' file writes (wchar):':<38}{w:,.0f}  ({w / added:.2f}x added)")
    print(f"file size after {steps} steps on a thread of 1,000 messages:")
    print(f"  ToubaSaver (SQLite):       {sizes['touba'] / 1e6:8.2f} MB")
    print(f"  AsyncSqliteSaver:          {sizes['aiosqlite'] / 1e6:8.2f} MB")
    print(f"  ratio touba / AsyncSqlite: {sizes['touba'] / sizes['aiosqlite']:8.3f}")


def run(main: Callable[[bool, int], Coroutine[Any, Any, None]], doc: str | None) -> None:
    """A LangGraph bench's command line: ``[--quick] [--rounds 5]``, then ``main``."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 10 and 1,000 only, 20 steps")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.quick, args.rounds))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    run(main, __doc__)
