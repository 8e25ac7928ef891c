"""LangGraph graphs end to end on ``ToubaSaver``, on every touba store.

A ``StateGraph`` tool loop (``ToolNode``, ``tools_condition``) under each durability
mode, LangChain's ``create_agent``, an ``interrupt()`` answered by
``Command(resume=...)`` (in the graph, and in a subgraph with a checkpoint namespace of
its own), time travel (the state history, a replay from an earlier checkpoint,
``update_state`` forks, a message replaced and one removed), threads run at once and a
reopened store, driven by a scripted chat model. Each scenario runs twice, once on
LangGraph's own ``InMemorySaver`` and once on ``ToubaSaver``, and what the graph shows
(states, their order, ``next``, the metadata LangGraph writes) must be the same; each
test also checks what it expects outright. Sync tests use the saver's sync methods,
async tests its async ones. One test watches the store's backend: each step of a real
graph appends only the messages it added to the thread's log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import pytest
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    ToolMessage,
)
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command, Durability, StateSnapshot, interrupt

from tests.integrations.langgraph_graphs.conftest import Store
from touba.integrations.langgraph import ToubaSaver
from touba.integrations.langgraph._backend import PutCheckpoint, PutResult, SaverBackend

Saver = BaseCheckpointSaver[Any]


class ScriptedModel(GenericFakeChatModel):
    """langchain-core's fake chat model, answering with tool calls as scripted."""

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self


def calls(*orders: str, tool_name: str = "lookup") -> AIMessage:
    return AIMessage(
        "",
        id=f"ai-{tool_name}-{'-'.join(orders)}",
        tool_calls=[
            {"name": tool_name, "args": {"order_id": o}, "id": f"call-{o}"} for o in orders
        ],
    )


def says(text: str) -> AIMessage:
    return AIMessage(text, id=f"ai-{text}")


def asks(text: str) -> HumanMessage:
    return HumanMessage(text, id=f"human-{text}")


@tool
def lookup(order_id: str) -> str:
    """Look up an order."""
    return f"{order_id} shipped"


@tool
def refund(order_id: str) -> str:
    """Refund an order, once a person approves it."""
    answer = interrupt({"approve_refund": order_id})
    return f"{order_id} refunded" if answer == "approved" else f"{order_id} not refunded"


def tool_loop(
    model: GenericFakeChatModel, checkpointer: Saver | None, tools: Sequence[Any] = (lookup,)
) -> CompiledStateGraph[Any, Any, Any, Any]:
    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(list(tools)))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


def script(*replies: AIMessage) -> ScriptedModel:
    return ScriptedModel(messages=iter(replies))


def thread(name: str) -> RunnableConfig:
    return {"configurable": {"thread_id": name}}


def seen(messages: Sequence[BaseMessage]) -> list[tuple[Any, ...]]:
    """A message list as the graph means it, ids of ToolNode's own messages aside."""
    shown: list[tuple[Any, ...]] = []
    for m in messages:
        tool_calls = [(c["name"], c["args"], c["id"]) for c in getattr(m, "tool_calls", [])]
        answer = m.tool_call_id if isinstance(m, ToolMessage) else None
        shown.append((type(m).__name__, m.content, tool_calls, answer))
    return shown


def snapshot(state: StateSnapshot) -> tuple[Any, ...]:
    """What a checkpoint shows a user, checkpoint ids and timestamps aside."""
    metadata = state.metadata or {}
    interrupts = [i.value for i in state.interrupts]
    messages = seen(state.values.get("messages", []))
    return (messages, state.next, metadata.get("step"), metadata.get("source"), interrupts)


def both(store: Store, scenario: Callable[[Saver], Any]) -> Any:
    """The scenario on InMemorySaver and on the store: the same result, returned."""
    expected = scenario(InMemorySaver())
    with store.open() as saver:  # the sync methods, closed by close()
        got = scenario(saver)
    assert got == expected
    return got


async def both_async(store: Store, scenario: Callable[[Saver], Awaitable[Any]]) -> Any:
    expected = await scenario(InMemorySaver())
    async with store.open() as saver:  # the async methods, closed by aclose()
        got = await scenario(saver)
    assert got == expected
    return got


# ------------------------------------------------------------------ the tool loop


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
async def test_a_tool_loop_keeps_each_thread(store: Store, durability: Durability) -> None:
    async def scenario(saver: Saver) -> Any:
        model = script(
            calls("A0"),
            calls("A1", "A2"),  # two calls in one step
            says("All three shipped."),
            calls("A3"),
            says("A3 shipped too."),
            says("Hello, B."),
        )
        graph = tool_loop(model, saver)

        async def turn(text: str, name: str) -> Any:
            return await graph.ainvoke(
                {"messages": [asks(text)]}, thread(name), durability=durability
            )

        first = await turn("Check A0 to A2", "a")
        second = await turn("And A3?", "a")
        other = await turn("Hi", "b")
        history = [snapshot(s) async for s in graph.aget_state_history(thread("a"))]
        latest = await graph.aget_state(thread("a"))
        return (
            seen(first["messages"]),
            seen(second["messages"]),
            seen(other["messages"]),
            (
                history,
                snapshot(latest),
            ),
        )

    first, second, other, (history, latest) = await both_async(store, scenario)
    assert [m[0] for m in first] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "AIMessage",
        "ToolMessage",
        "ToolMessage",
        "AIMessage",
    ]
    assert [m[1] for m in first if m[0] == "ToolMessage"] == [
        "A0 shipped",
        "A1 shipped",
        "A2 shipped",
    ]
    assert second[: len(first)] == first  # the second turn goes on from the stored first
    assert second[len(first) :] == [
        ("HumanMessage", "And A3?", [], None),
        ("AIMessage", "", [("lookup", {"order_id": "A3"}, "call-A3")], None),
        ("ToolMessage", "A3 shipped", [], "call-A3"),
        ("AIMessage", "A3 shipped too.", [], None),
    ]
    assert other == [("HumanMessage", "Hi", [], None), ("AIMessage", "Hello, B.", [], None)]
    assert latest[0] == second
    assert latest[1] == ()
    # newest first: each checkpoint shows the messages of its step, one step at a time
    assert history[0] == latest
    if durability == "exit":  # one checkpoint per run, at its end
        assert [(len(h[0]), h[2]) for h in reversed(history)] == [(7, 5), (11, 10)]
    else:
        assert [len(h[0]) for h in reversed(history)] == [0, 1, 2, 3, 4, 6, 7, 7, 8, 9, 10, 11]
        assert [h[2] for h in reversed(history)] == list(range(-1, 11))
        assert [h[3] for h in history].count("input") == 2  # one per turn


def test_create_agent_keeps_its_conversation(store: Store) -> None:
    def scenario(saver: Saver) -> Any:
        model = script(calls("A1"), says("A1 shipped."), says("You're welcome."), says("Hi."))
        agent = create_agent(model, [lookup], system_prompt="You check orders.", checkpointer=saver)
        agent.invoke({"messages": [asks("Check A1")]}, thread("a"))
        agent.invoke({"messages": [asks("Thanks")]}, thread("a"))
        agent.invoke({"messages": [asks("Hello")]}, thread("b"))
        states = [agent.get_state(thread(t)) for t in ("a", "b")]
        history = [snapshot(s) for s in agent.get_state_history(thread("a"))]
        return [snapshot(s) for s in states], history

    (a, b), history = both(store, scenario)
    assert a[0] == [
        ("HumanMessage", "Check A1", [], None),
        ("AIMessage", "", [("lookup", {"order_id": "A1"}, "call-A1")], None),
        ("ToolMessage", "A1 shipped", [], "call-A1"),
        ("AIMessage", "A1 shipped.", [], None),
        ("HumanMessage", "Thanks", [], None),
        ("AIMessage", "You're welcome.", [], None),
    ]
    assert b[0] == [("HumanMessage", "Hello", [], None), ("AIMessage", "Hi.", [], None)]
    assert history[0] == a
    assert len(history) > 6


# ------------------------------------------------------------- interrupt, resume


@pytest.mark.parametrize("answer", ["approved", "refused"])
async def test_an_interrupt_waits_in_the_store_for_its_answer(store: Store, answer: str) -> None:
    async def scenario(saver: Saver, reopen: Callable[[], ToubaSaver] | None) -> Any:
        model = script(calls("A1", tool_name="refund"), says("Done."))
        graph = tool_loop(model, saver, tools=[refund])
        paused = await graph.ainvoke({"messages": [asks("Refund A1")]}, thread("a"))
        waiting = await graph.aget_state(thread("a"))

        async def answer_on(resuming: Saver) -> Any:
            later = tool_loop(model, resuming, tools=[refund])
            done = await later.ainvoke(Command(resume=answer), thread("a"))
            return done, [snapshot(s) async for s in later.aget_state_history(thread("a"))]

        if reopen is None:
            done, history = await answer_on(saver)
        else:  # the answer comes later, to a graph on a saver opened anew
            fresh = reopen()
            try:
                done, history = await answer_on(fresh)
            finally:
                await fresh.aclose()
        interrupts = [i.value for i in paused["__interrupt__"]]
        return interrupts, snapshot(waiting), seen(done["messages"]), history

    reopen = store.open if store.persistent else None
    expected = await scenario(InMemorySaver(), None)
    saver = store.open()
    try:
        got = await scenario(saver, reopen)
    finally:
        await saver.aclose()
    assert got == expected
    interrupts, waiting, done, history = got
    assert interrupts == [{"approve_refund": "A1"}]
    assert waiting[1] == ("tools",)
    assert waiting[4] == [{"approve_refund": "A1"}]
    assert done[-2:] == [
        (
            "ToolMessage",
            f"A1 {'refunded' if answer == 'approved' else 'not refunded'}",
            [],
            "call-A1",
        ),
        ("AIMessage", "Done.", [], None),
    ]
    assert history[0][0] == done


async def test_a_subgraph_pauses_and_resumes_in_its_own_namespace(store: Store) -> None:
    async def scenario(saver: Saver) -> Any:
        model = script(calls("A1", tool_name="refund"), says("Refund handled."))
        support = tool_loop(model, None, tools=[refund])  # a subgraph: the parent's saver

        def wrap_up(state: MessagesState) -> dict[str, Any]:
            return {"messages": [says("Anything else?")]}

        parent = StateGraph(MessagesState)
        parent.add_node("support", support)
        parent.add_node("wrap_up", wrap_up)
        parent.add_edge(START, "support")
        parent.add_edge("support", "wrap_up")
        graph = parent.compile(checkpointer=saver)

        paused = await graph.ainvoke({"messages": [asks("Refund A1")]}, thread("a"))
        outer = await graph.aget_state(thread("a"), subgraphs=True)
        (task,) = outer.tasks
        inner = task.state
        assert isinstance(inner, StateSnapshot)
        namespaced = inner.config["configurable"]["checkpoint_ns"].startswith("support:")
        done = await graph.ainvoke(Command(resume="approved"), thread("a"))
        history = [snapshot(s) async for s in graph.aget_state_history(thread("a"))]
        return (
            [i.value for i in paused["__interrupt__"]],
            snapshot(outer),
            snapshot(inner),
            namespaced,
            seen(done["messages"]),
            history,
        )

    interrupts, outer, inner, namespaced, done, history = await both_async(store, scenario)
    assert interrupts == [{"approve_refund": "A1"}]
    assert outer[0] == [("HumanMessage", "Refund A1", [], None)]  # the parent waits on support
    assert outer[1] == ("support",)
    assert namespaced
    assert inner[0] == [  # the subgraph's own checkpoint, paused before its tool's answer
        ("HumanMessage", "Refund A1", [], None),
        ("AIMessage", "", [("refund", {"order_id": "A1"}, "call-A1")], None),
    ]
    assert inner[1] == ("tools",)
    assert done == [
        ("HumanMessage", "Refund A1", [], None),
        ("AIMessage", "", [("refund", {"order_id": "A1"}, "call-A1")], None),
        ("ToolMessage", "A1 refunded", [], "call-A1"),
        ("AIMessage", "Refund handled.", [], None),
        ("AIMessage", "Anything else?", [], None),
    ]
    assert history[0][0] == done


# ------------------------------------------------------------------ time travel


def test_time_travel_replays_and_forks_from_earlier_checkpoints(store: Store) -> None:
    def scenario(saver: Saver) -> Any:
        model = script(
            calls("A0"),
            calls("A1"),
            says("Both shipped."),
            says("Replayed: both shipped."),  # the replay from after A0's answer
            calls("B1"),  # the fork that asks about B1 instead
            says("B1 shipped."),
        )
        graph = tool_loop(model, saver)
        original = graph.invoke({"messages": [asks("Check A0 and A1")]}, thread("a"))
        ended = graph.get_state(thread("a"))
        history = list(graph.get_state_history(thread("a")))
        # the checkpoint after A0's answer, before the model's next step
        (after_a0,) = [s for s in history if len(s.values.get("messages", [])) == 3]
        assert after_a0.next == ("agent",)

        # replay: go on from there, with the model answering otherwise this time
        replayed = graph.invoke(None, after_a0.config)
        # fork: a new user message written as if at that checkpoint, then go on
        forked_config = graph.update_state(
            after_a0.config, {"messages": [asks("Actually, check B1")]}
        )
        forked = graph.invoke(None, forked_config)
        fork_point = graph.get_state(forked_config)
        fork_parent = fork_point.parent_config
        assert fork_parent is not None
        # edit the fork's end: replace a message by its id, remove another
        fork_end = graph.get_state(thread("a"))
        edited_config = graph.update_state(
            fork_end.config,
            {
                "messages": [
                    HumanMessage("Check B1, please", id="human-Actually, check B1"),
                    RemoveMessage(id="ai-lookup-A0"),
                ]
            },
        )
        edited = graph.get_state(edited_config)
        # the first branch is still whole, read from its own checkpoint
        still = graph.get_state(ended.config)
        before = [snapshot(s) for s in graph.get_state_history(thread("a"), before=after_a0.config)]
        return (
            seen(original["messages"]),
            seen(replayed["messages"]),
            seen(forked["messages"]),
            snapshot(fork_point),
            fork_parent["configurable"]["checkpoint_id"] == checkpoint_id(after_a0.config),
            snapshot(fork_end),
            snapshot(edited),
            snapshot(still) == snapshot(ended),
            before,
            len(list(graph.get_state_history(thread("a")))),
        )

    result = both(store, scenario)
    original, replayed, forked, fork_point, forked_there, fork_end, edited, still_whole = result[:8]
    before, count = result[8:]
    prefix = original[:3]
    assert original[3:] == [
        ("AIMessage", "", [("lookup", {"order_id": "A1"}, "call-A1")], None),
        ("ToolMessage", "A1 shipped", [], "call-A1"),
        ("AIMessage", "Both shipped.", [], None),
    ]
    assert replayed == [*prefix, ("AIMessage", "Replayed: both shipped.", [], None)]
    assert forked == [
        *prefix,
        ("HumanMessage", "Actually, check B1", [], None),
        ("AIMessage", "", [("lookup", {"order_id": "B1"}, "call-B1")], None),
        ("ToolMessage", "B1 shipped", [], "call-B1"),
        ("AIMessage", "B1 shipped.", [], None),
    ]
    assert fork_point[0] == forked[:4]
    assert fork_point[3] == "update"
    assert forked_there  # the fork's parent is the checkpoint it was written at
    assert fork_end[0] == forked
    assert edited[0] == [
        prefix[0],
        prefix[2],
        ("HumanMessage", "Check B1, please", [], None),
        *forked[4:],
    ]
    assert edited[3] == "update"
    assert still_whole
    assert [len(b[0]) for b in before] == [2, 1, 0]  # older than the checkpoint, newest first
    assert count == 7 + 2 + 4 + 1  # the first run, the replay (a copy, a step), the fork, the edit


# ------------------------------------------------------- what each step stores


class Spy:
    """The store's real backend, recording each put it forwards (an observer, not a fake)."""

    def __init__(self, inner: SaverBackend) -> None:
        self.inner = inner
        self.puts: dict[str, PutCheckpoint] = {}

    async def put(self, request: PutCheckpoint) -> PutResult:
        self.puts[request.checkpoint_id] = request
        return await self.inner.put(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_each_step_of_a_graph_logs_only_the_messages_it_added(store: Store) -> None:
    opened = store.open()
    spy = Spy(opened.backend)
    saver = ToubaSaver(cast(SaverBackend, spy))
    try:
        model = script(calls("A0"), calls("A1", "A2"), says("Done."), says("Hi again."))
        graph = tool_loop(model, saver)
        await graph.ainvoke({"messages": [asks("Check A0 to A2")]}, thread("a"))
        await graph.ainvoke({"messages": [asks("Hello")]}, thread("a"))
        history = [s async for s in graph.aget_state_history(thread("a"))]
        # a fork from an earlier checkpoint shares its prefix
        (early,) = [s for s in history if len(s.values.get("messages", [])) == 3]
        fork = await graph.aupdate_state(early.config, {"messages": [asks("Only A0, please")]})
        history.append(await graph.aget_state(fork))
    finally:
        await saver.aclose()

    appended = 0
    for state in history:
        request = spy.puts[checkpoint_id(state.config)]
        messages = state.values.get("messages", [])
        parent = [s for s in history if s.config == state.parent_config]
        before = parent[0].values.get("messages", []) if parent else []
        assert [m.id for m in messages[: len(before)]] == [m.id for m in before]
        logged = [log for log in request.logs if log.channel == "messages"]
        if not logged:  # a checkpoint with no messages yet (the graph's input step)
            assert messages == []
            continue
        (log,) = logged
        items = [saver.serde.loads_typed(item) for item in log.items]
        # the checkpoint names its parent's messages and appends only the new ones
        assert sum(span.end - span.start for span in log.base) == len(before)
        assert [m.id for m in items] == [m.id for m in messages[len(before) :]]
        appended += len(items)
    final = history[0].values["messages"]
    assert appended == len(final) + 1  # each message once, and the fork's own
    assert all(not any(b.channel == "messages" for b in spy.puts[c].blobs) for c in spy.puts)


# ------------------------------------------------------------------ a reopened store


def test_a_reopened_store_holds_every_checkpoint(persistent_store: Store) -> None:
    model = script(calls("A0"), says("A0 shipped."), says("You're welcome."))
    with persistent_store.open() as saver:
        graph = tool_loop(model, saver)
        graph.invoke({"messages": [asks("Check A0")]}, thread("a"))
        before = [snapshot(s) for s in graph.get_state_history(thread("a"))]
        configs = [s.config for s in graph.get_state_history(thread("a"))]

    with persistent_store.open() as saver:
        graph = tool_loop(model, saver)
        assert [snapshot(s) for s in graph.get_state_history(thread("a"))] == before
        assert [s.config for s in graph.get_state_history(thread("a"))] == configs
        state = graph.invoke({"messages": [asks("Thanks")]}, thread("a"))
        assert seen(state["messages"]) == [
            *before[0][0],
            ("HumanMessage", "Thanks", [], None),
            ("AIMessage", "You're welcome.", [], None),
        ]


async def test_threads_run_at_once_on_one_saver(store: Store) -> None:
    async def scenario(saver: Saver) -> Any:
        def graph_for(name: str) -> CompiledStateGraph[Any, Any, Any, Any]:
            return tool_loop(script(calls(f"{name}1"), says(f"{name} done.")), saver)

        names = [f"t{n}" for n in range(6)]
        runs = [
            graph_for(name).ainvoke({"messages": [asks(f"Check {name}1")]}, thread(name))
            for name in names
        ]
        finals = await asyncio.gather(*runs)
        return [seen(f["messages"]) for f in finals]

    finals = await both_async(store, scenario)
    assert [f[-1][1] for f in finals] == [f"t{n} done." for n in range(6)]
    assert all(len(f) == 4 for f in finals)


def checkpoint_id(config: RunnableConfig) -> str:
    return str(config["configurable"]["checkpoint_id"])
