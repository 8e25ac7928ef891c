"""LangGraph graphs running on ToubaSaver, on every store: a tool loop, an interrupt resumed
with ``Command(resume=...)``, time travel (replay from an earlier checkpoint, a fork by
``update_state``), LangChain's ``create_agent``, and the sync API (``graph.invoke``)."""

from __future__ import annotations

import asyncio
import operator
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command, interrupt

from touba.integrations.langgraph import ToubaSaver
from touba.integrations.langgraph._backend import SaverBackend


@tool
def lookup(query: str) -> str:
    """Look something up."""
    return f"found {query}"


def model(state: MessagesState) -> dict[str, list[AnyMessage]]:
    """A scripted model: calls ``lookup`` once per question, then answers."""
    last = state["messages"][-1]
    if isinstance(last, HumanMessage):
        n = len(state["messages"])
        call = {"name": "lookup", "args": {"query": str(last.content)}, "id": f"call-{n}"}
        return {"messages": [AIMessage("", tool_calls=[call])]}
    assert isinstance(last, ToolMessage)
    return {"messages": [AIMessage(f"answer: {last.content}")]}


def tool_loop() -> StateGraph[MessagesState]:
    builder = StateGraph(MessagesState)
    builder.add_node("model", model)
    builder.add_node("tools", ToolNode([lookup]))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder


@pytest.fixture
async def saver(backend: SaverBackend) -> AsyncIterator[ToubaSaver]:
    async with ToubaSaver(backend) as s:
        yield s


def config(thread_id: str, **extra: Any) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, **extra}}


def ask(text: str, id: str) -> Any:
    """A graph input adding one human message."""
    return {"messages": [HumanMessage(text, id=id)]}


def texts(messages: list[AnyMessage]) -> list[str]:
    return [f"{type(m).__name__}:{m.content}" for m in messages]


async def test_a_tool_loop_matches_in_memory_saver_step_for_step(saver: ToubaSaver) -> None:
    ours = tool_loop().compile(checkpointer=saver)
    theirs = tool_loop().compile(checkpointer=InMemorySaver())
    for turn in range(4):
        question = ask(f"q{turn}", id=f"h{turn}")
        a = await ours.ainvoke(question, config("t1"))
        b = await theirs.ainvoke(question, config("t1"))
        assert texts(a["messages"]) == texts(b["messages"])
    assert len(a["messages"]) == 16

    history = [s async for s in ours.aget_state_history(config("t1"))]
    reference = [s async for s in theirs.aget_state_history(config("t1"))]
    assert [texts(s.values["messages"]) for s in history] == [
        texts(s.values["messages"]) for s in reference
    ]
    assert [(s.metadata or {}).get("step") for s in history] == [
        (s.metadata or {}).get("step") for s in reference
    ]

    # a second saver on the same store (a new process, say) reads the same state cold
    state = await ours.aget_state(config("t1"))
    assert texts(state.values["messages"]) == texts(a["messages"])


async def test_an_interrupt_resumes_with_command(saver: ToubaSaver) -> None:
    def approve(state: MessagesState) -> Any:
        answer = interrupt({"question": "approve the lookup?"})
        return ask(f"approved: {answer}", id="approval")

    builder = StateGraph(MessagesState)
    builder.add_node("approve", approve)
    builder.add_node("model", model)
    builder.add_node("tools", ToolNode([lookup]))
    builder.add_edge(START, "approve")
    builder.add_edge("approve", "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")

    outcomes = []
    for checkpointer in (saver, InMemorySaver()):
        graph = builder.compile(checkpointer=checkpointer)
        first = await graph.ainvoke(ask("q", id="h"), config("t2"))
        assert "__interrupt__" in first
        state = await graph.aget_state(config("t2"))
        assert state.next == ("approve",)
        assert state.tasks[0].interrupts[0].value == {"question": "approve the lookup?"}
        done = await graph.ainvoke(Command(resume="yes"), config("t2"))
        assert (await graph.aget_state(config("t2"))).next == ()
        outcomes.append(texts(done["messages"]))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0] == [
        "HumanMessage:q",
        "HumanMessage:approved: yes",
        "AIMessage:",
        "ToolMessage:found approved: yes",
        "AIMessage:answer: found approved: yes",
    ]


async def test_time_travel_replays_and_forks_without_touching_the_original(
    saver: ToubaSaver,
) -> None:
    graph = tool_loop().compile(checkpointer=saver)
    await graph.ainvoke(ask("q0", id="h0"), config("t3"))
    await graph.ainvoke(ask("q1", id="h1"), config("t3"))
    original = texts((await graph.aget_state(config("t3"))).values["messages"])

    history = [s async for s in graph.aget_state_history(config("t3"))]
    after_first = next(s for s in history if texts(s.values["messages"]) == original[:4])
    # replay: continue from the end of the first turn with another question
    forked = await graph.ainvoke(ask("other", id="h-other"), after_first.config)
    assert texts(forked["messages"]) == [
        *original[:4],
        "HumanMessage:other",
        "AIMessage:",
        "ToolMessage:found other",
        "AIMessage:answer: found other",
    ]
    # a fork by update_state from the same point
    fork_config = await graph.aupdate_state(
        after_first.config, {"messages": [AIMessage("edited", id="edit")]}
    )
    fork = await graph.aget_state(fork_config)
    assert texts(fork.values["messages"]) == [*original[:4], "AIMessage:edited"]
    # the original branch still reads whole
    branch = next(s for s in history if texts(s.values["messages"]) == original)
    again = await graph.aget_state(branch.config)
    assert texts(again.values["messages"]) == original


async def test_a_message_replaced_by_id_and_one_removed_read_back_right(
    saver: ToubaSaver,
) -> None:
    from langchain_core.messages import RemoveMessage

    graph = tool_loop().compile(checkpointer=saver)
    await graph.ainvoke(ask("q0", id="h0"), config("t4"))
    await graph.aupdate_state(config("t4"), ask("Q0!", id="h0"))
    state = await graph.aget_state(config("t4"))
    assert texts(state.values["messages"])[0] == "HumanMessage:Q0!"
    await graph.aupdate_state(config("t4"), {"messages": [RemoveMessage(id="h0")]})
    state = await graph.aget_state(config("t4"))
    assert len(state.values["messages"]) == 3
    assert "HumanMessage:Q0!" not in texts(state.values["messages"])
    fresh = ToubaSaver(saver.backend)  # no cache: everything from the store
    cold = await fresh.aget_tuple(config("t4"))
    assert cold is not None
    assert texts(cold.checkpoint["channel_values"]["messages"]) == texts(state.values["messages"])


def test_sync_invoke_from_a_thread(saver: ToubaSaver) -> None:
    graph = tool_loop().compile(checkpointer=saver)
    out = graph.invoke(ask("s0", id="s0"), config("t5"))
    assert texts(out["messages"])[-1] == "AIMessage:answer: found s0"
    out = graph.invoke(ask("s1", id="s1"), config("t5"))
    assert len(out["messages"]) == 8
    assert len(list(graph.get_state_history(config("t5")))) == 10

    seen: list[int] = []

    def other() -> None:
        state = graph.get_state(config("t5"))
        seen.append(len(state.values["messages"]))

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen == [8]


async def test_sync_call_inside_the_stores_loop_is_refused(saver: ToubaSaver) -> None:
    from touba.errors import ConfigurationError

    await saver.aget_tuple(config("t6"))  # binds the store to this loop
    with pytest.raises(ConfigurationError, match="await the async method"):
        saver.get_tuple(config("t6"))


async def test_create_agent_with_a_fake_model(saver: ToubaSaver) -> None:
    from langchain.agents import create_agent

    class Fake(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Fake:
            return self

    replies = iter(
        [
            AIMessage("", tool_calls=[{"name": "lookup", "args": {"query": "x"}, "id": "c1"}]),
            AIMessage("done"),
        ]
    )
    agent = create_agent(Fake(messages=replies), [lookup], checkpointer=saver)
    out = await agent.ainvoke(ask("go", id="g"), config("t7"))
    assert texts(out["messages"]) == [
        "HumanMessage:go",
        "AIMessage:",
        "ToolMessage:found x",
        "AIMessage:done",
    ]
    again = await asyncio.wait_for(saver.aget_tuple(config("t7")), 10)
    assert again is not None
    assert len(again.checkpoint["channel_values"]["messages"]) == 4


def extend(state: list[str], writes: Any) -> list[str]:
    """A batching-invariant reducer for the DeltaChannel test."""
    return [*state, *(item for batch in writes for item in batch)]


class DeltaState(TypedDict):
    log: Annotated[list[str], DeltaChannel(extend, snapshot_frequency=3)]
    count: Annotated[int, operator.add]


async def test_a_delta_channel_rebuilds_as_with_in_memory_saver(saver: ToubaSaver) -> None:
    def step(state: DeltaState) -> Any:
        return {"log": [f"entry {state['count']}"], "count": 1}

    def more(state: DeltaState) -> str:
        return "step" if state["count"] < 7 else "__end__"

    builder = StateGraph(DeltaState)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_conditional_edges("step", more)

    results = []
    for checkpointer in (saver, InMemorySaver()):
        graph = builder.compile(checkpointer=checkpointer)
        out = await graph.ainvoke({"log": ["start"], "count": 0}, config("t8"))
        history = [s.values async for s in graph.aget_state_history(config("t8"))]
        results.append((out, history))
    assert results[0] == results[1]
    assert results[0][0]["log"] == ["start", *(f"entry {i}" for i in range(7))]


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_asyncio_run_then_sync_calls(store: str, private_dir: Path) -> None:
    """A saver first used under asyncio.run (whose loop then closes) serves sync calls."""
    saver = ToubaSaver.memory() if store == "memory" else ToubaSaver.sqlite(private_dir / "g.db")

    async def first() -> None:
        graph = tool_loop().compile(checkpointer=saver)
        await graph.ainvoke(ask("a0", id="a0"), config("t9"))

    asyncio.run(first())
    with saver:
        graph = tool_loop().compile(checkpointer=saver)
        out = graph.invoke(ask("a1", id="a1"), config("t9"))
        assert len(out["messages"]) == 8


def test_the_clone_langgraph_compiles_with_shares_the_store_loop_and_close(
    private_dir: Path,
) -> None:
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    strict = JsonPlusSerializer(allowed_msgpack_modules=[("tests", "Other")])
    saver = ToubaSaver.sqlite(private_dir / "clone.db", serde=strict)
    clone = saver.with_allowlist({("tests", "Custom")})
    assert clone is not saver
    assert isinstance(clone, ToubaSaver)
    graph = tool_loop().compile(checkpointer=clone)
    graph.invoke(ask("c0", id="c0"), config("t10"))  # starts the saver's loop thread
    threads = [t for t in threading.enumerate() if t.name == "touba-langgraph-loop"]
    assert threads
    assert saver.get_tuple(config("t10")) is not None  # the same store, the same loop
    saver.close()
    assert not any(t.is_alive() for t in threads)
    from touba.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="closed"):
        clone.get_tuple(config("t10"))
