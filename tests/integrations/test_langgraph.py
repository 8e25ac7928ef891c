"""LangChain trimmer with langchain-core's fake chat model; LangChain's ``create_agent`` with
``ToubaWindowMiddleware`` and LangGraph's deprecated ``create_react_agent`` with the hook."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool

from touba.errors import ConfigurationError, DecisionHistoryLimitExceeded
from touba.integrations.langgraph import (
    ToubaWindowMiddleware,
    touba_pre_model_hook,
    touba_trimmer,
    trim_messages,
)


def assert_no_orphan(messages: list[BaseMessage]) -> None:
    calls = {c["id"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls}
    answers = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
    assert calls == answers


def loop(turns: int, calls: int) -> list[BaseMessage]:
    messages: list[BaseMessage] = [SystemMessage("be brief")]
    for t in range(turns):
        messages.append(HumanMessage(f"turn {t}"))
        for c in range(calls):
            ids = [f"{t}-{c}"] + ([f"{t}-{c}b"] if c % 3 == 0 else [])
            messages.append(
                AIMessage(
                    "", tool_calls=[{"name": "lookup", "args": {"i": c}, "id": i} for i in ids]
                )
            )
            messages.extend(ToolMessage(f"result {i}", tool_call_id=i) for i in ids)
        messages.append(AIMessage(f"answer {t}"))
    return messages


@pytest.mark.parametrize("bound", [3, 4, 7, 20])
def test_every_prefix_of_a_long_conversation_trims_without_orphans(bound: int) -> None:
    messages = loop(turns=3, calls=8)
    trim = touba_trimmer(max_messages=bound)
    for end in range(2, len(messages) + 1):
        prefix = messages[:end]
        window = trim(prefix)
        assert_no_orphan(window)
        assert window[0] is messages[0]  # the system message stays first
        assert isinstance(window[1], HumanMessage)  # the window opens on a user input
        calls = {c["id"] for m in prefix if isinstance(m, AIMessage) for c in m.tool_calls}
        answered = {m.tool_call_id for m in prefix if isinstance(m, ToolMessage)}
        if calls == answered:  # else the last exchange is still waiting: it is not sent
            assert window[-1] is prefix[-1]  # the last complete exchange is always sent
        humans = [m for m in prefix if isinstance(m, HumanMessage)]
        assert humans[-1] in window
        assert len(window) - 2 <= bound


def test_the_last_exchange_must_fit() -> None:
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        trim_messages(loop(turns=1, calls=1)[:5], max_messages=2)  # a call with two results
    assert caught.value.limit == "max_messages"


def test_orphans_in_the_input_never_go_out() -> None:
    messages: list[BaseMessage] = [
        HumanMessage("one"),
        AIMessage("", tool_calls=[{"name": "t", "args": {}, "id": "abandoned"}]),
        HumanMessage("two"),
        ToolMessage("late", tool_call_id="gone"),
        AIMessage("answer"),
    ]
    window = trim_messages(messages)
    assert_no_orphan(window)
    assert [m.content for m in window] == ["one", "two", "answer"]


@tool
def lookup(i: int) -> str:
    """Look up something."""
    return f"result {i}"


class Recording(GenericFakeChatModel):
    """langchain-core's fake chat model, keeping every list of messages it was sent."""

    seen: list[list[BaseMessage]]

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> Any:
        self.seen.append(list(messages))
        return super()._generate(messages, *args, **kwargs)


def ten_lookups() -> Recording:
    replies = [
        AIMessage("", tool_calls=[{"name": "lookup", "args": {"i": i}, "id": f"c{i}"}])
        for i in range(10)
    ] + [AIMessage("done")]
    return Recording(messages=iter(replies), seen=[])


def assert_windows(seen: list[list[BaseMessage]], *, lead: int) -> None:
    assert len(seen) == 11
    for sent in seen:
        assert_no_orphan(sent)
        assert sent[lead].content == "look up ten things"
        assert len(sent) <= lead + 1 + 4
    assert len(seen[-1]) == lead + 1 + 4  # the bound was reached, and kept


@pytest.mark.parametrize("run", ["sync", "async"])
def test_create_agent_with_the_window_middleware(run: str) -> None:
    from langchain.agents import create_agent

    model = ten_lookups()
    agent = create_agent(
        model,
        [lookup],
        system_prompt="You look things up.",
        middleware=[ToubaWindowMiddleware(max_messages=4)],
    )
    request: Any = {"messages": [HumanMessage("look up ten things")]}
    state = agent.invoke(request) if run == "sync" else asyncio.run(agent.ainvoke(request))
    assert_windows(model.seen, lead=1)
    assert all(isinstance(sent[0], SystemMessage) for sent in model.seen)  # sent apart, kept
    assert len(state["messages"]) == 1 + 10 * 2 + 1  # the agent's state keeps everything


def test_the_middleware_checks_its_bounds_when_built() -> None:
    with pytest.raises(ConfigurationError):
        ToubaWindowMiddleware(max_messages=0)


def test_create_react_agent_with_the_pre_model_hook() -> None:
    with warnings.catch_warnings():  # create_react_agent is deprecated in favour of langchain's
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

    model = ten_lookups()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = create_react_agent(
            model, [lookup], pre_model_hook=touba_pre_model_hook(max_messages=4)
        )
    state = agent.invoke({"messages": [HumanMessage("look up ten things")]})
    assert_windows(model.seen, lead=0)
    assert len(state["messages"]) == 1 + 10 * 2 + 1  # the graph's state keeps everything
