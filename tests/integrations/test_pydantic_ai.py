"""pydantic-ai: FunctionModel tool loops never see an orphan; durable conversations."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.capabilities import ProcessHistory
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tests.integrations._crash import die_holding
from touba.errors import DecisionHistoryBusy, DecisionHistoryLimitExceeded
from touba.integrations.pydantic_ai import ToubaConversations, ToubaWindow, touba_history


def assert_no_orphan(messages: list[ModelMessage]) -> None:
    """Every ToolCallPart has its return (or retry) and every return its call; a request last."""
    calls = {p.tool_call_id for m in messages for p in m.parts if isinstance(p, ToolCallPart)}
    answers = {
        p.tool_call_id
        for m in messages
        for p in m.parts
        if isinstance(p, ToolReturnPart) or (isinstance(p, RetryPromptPart) and p.tool_name)
    }
    assert calls == answers
    assert isinstance(messages[0], ModelRequest)
    assert isinstance(messages[-1], ModelRequest)


def looping_model(seen: list[list[ModelMessage]], calls: int) -> FunctionModel:
    """Calls ``lookup`` (sometimes twice at once, sometimes with bad arguments) ``calls`` times."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(list(messages))
        step = len(seen)
        if step > calls:
            return ModelResponse(parts=[TextPart(f"done after {calls}")])
        if step % 5 == 0:  # a retry: the tool rejects its arguments
            return ModelResponse(parts=[ToolCallPart("lookup", {"order": "bad"}, f"r{step}")])
        parts = [ToolCallPart("lookup", {"order": step}, f"c{step}")]
        if step % 3 == 0:  # two calls in one response
            parts.append(ToolCallPart("lookup", {"order": -step}, f"d{step}"))
        return ModelResponse(parts=parts)

    return FunctionModel(model)


def agent_with(capability: Any, seen: list[list[ModelMessage]], calls: int) -> Agent[None, str]:
    agent = Agent(looping_model(seen, calls), capabilities=[capability], system_prompt="brief")

    @agent.tool_plain(retries=50)
    def lookup(order: int) -> str:
        return f"order {order}: shipped"

    return agent


@pytest.mark.parametrize("bounds", [{"max_messages": 4}, {"max_messages": 7}, {"max_bytes": 2000}])
@pytest.mark.parametrize("persisting", [True, False])
async def test_long_tool_loops_never_send_an_orphan(
    bounds: dict[str, int], persisting: bool
) -> None:
    seen: list[list[ModelMessage]] = []
    capability = (
        ProcessHistory(touba_history(**bounds))
        if persisting
        else ToubaWindow(max_messages=bounds.get("max_messages"), max_bytes=bounds.get("max_bytes"))
    )
    agent = agent_with(capability, seen, calls=30)
    history: list[ModelMessage] = []
    for turn in range(3):
        result = await agent.run(f"turn {turn}", message_history=history)
        history = result.all_messages()
        seen.clear() if turn < 2 else None
    assert len(seen) == 31
    for sent in seen:
        assert_no_orphan(sent)
        assert sum(isinstance(p, SystemPromptPart) for p in sent[0].parts) == 1  # kept
        prompt = [p for m in sent for p in m.parts if isinstance(p, UserPromptPart)]
        assert prompt[-1].content == "turn 2"  # the current input is always there
    assert max(len(s) for s in seen) <= bounds.get("max_messages", 10**6) + 1


async def test_the_last_exchange_must_fit() -> None:
    seen: list[list[ModelMessage]] = []
    agent = agent_with(ProcessHistory(touba_history(max_messages=1)), seen, calls=3)
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await agent.run("go")
    assert caught.value.limit == "max_messages"


def test_earlier_turns_leave_whole_and_incomplete_exchanges_never_go() -> None:
    process = touba_history(max_messages=4)
    messages: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("sys"), UserPromptPart("one")]),
        ModelResponse(parts=[ToolCallPart("t", {}, "abandoned")]),  # never answered
        ModelRequest(parts=[UserPromptPart("two")]),
        ModelResponse(parts=[TextPart("answer two")]),
        ModelRequest(parts=[UserPromptPart("three")]),
        ModelResponse(parts=[ToolCallPart("t", {}, "c3")]),
        ModelRequest(parts=[ToolReturnPart("t", "ok", "c3")]),
    ]
    window = process(messages)
    assert [type(m).__name__ for m in window] == [
        "ModelRequest",
        "ModelResponse",
        "ModelRequest",
        "ModelResponse",
        "ModelRequest",
    ]
    assert window[0].parts[0] is messages[0].parts[0]  # the system prompt, moved
    assert window[0].parts[1] is messages[2].parts[0]  # "two"
    assert_no_orphan(window)
    unbounded = touba_history()(messages)
    assert all(
        not isinstance(p, ToolCallPart) or p.tool_call_id != "abandoned"
        for m in unbounded
        for p in m.parts
    )


async def test_durable_conversation_keeps_every_message(store: Any) -> None:
    seen: list[list[ModelMessage]] = []
    agent = agent_with(ToubaWindow(max_messages=6), seen, calls=12)
    conversations = ToubaConversations(store, namespace="support")
    for turn in range(2):
        seen.clear()
        async with conversations.open("user-42") as conversation:
            result = await agent.run(f"turn {turn}", message_history=conversation.messages)
            conversation.extend(result.new_messages())
        for sent in seen:
            assert_no_orphan(sent)
    stored = await conversations.messages("user-42")
    assert len(stored) == 2 * (1 + 12 * 2 + 1)  # prompt, 12 exchanges, answer: all retained
    assert_no_orphan([*stored, ModelRequest(parts=[UserPromptPart("next")])])


async def test_a_second_run_on_the_same_conversation_is_refused(store: Any) -> None:
    conversations = ToubaConversations(store, namespace="support")
    async with conversations.open("user-42") as conversation:
        conversation.extend([ModelRequest(parts=[UserPromptPart("hi")])])
        with pytest.raises(DecisionHistoryBusy):
            async with conversations.open("user-42"):
                pass
        async with conversations.open("someone-else"):
            pass  # other conversations are free
    assert len(await conversations.messages("user-42")) == 1


async def test_concurrent_runs_one_wins_one_is_refused(store: Any) -> None:
    conversations = ToubaConversations(store, namespace="support")
    gate = asyncio.Event()

    async def run(text: str) -> str:
        async with conversations.open("user-42") as conversation:
            await gate.wait()
            conversation.extend([ModelRequest(parts=[UserPromptPart(text)])])
        return text

    first = asyncio.create_task(run("first"))
    await asyncio.sleep(0.2)
    second = asyncio.create_task(run("second"))
    results = await asyncio.gather(second, return_exceptions=True)
    gate.set()
    assert await first == "first"
    assert isinstance(results[0], DecisionHistoryBusy)
    stored = await conversations.messages("user-42")
    assert [p.content for m in stored for p in m.parts] == ["first"]  # type: ignore[union-attr]


async def test_an_exception_in_the_block_writes_nothing(store: Any) -> None:
    conversations = ToubaConversations(store, namespace="support")

    async def failing_run() -> None:
        async with conversations.open("user-42") as conversation:
            conversation.extend([ModelRequest(parts=[UserPromptPart("lost")])])
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError):
        await failing_run()
    assert await conversations.messages("user-42") == []
    async with conversations.open("user-42"):
        pass  # and the reservation was released


async def test_recover_after_a_worker_was_killed_in_a_run(
    store: Any, backend: str, private_dir: Path, store_name: str
) -> None:
    conversations = ToubaConversations(store, namespace="support")
    async with conversations.open("user-42") as conversation:
        conversation.extend([ModelRequest(parts=[UserPromptPart("kept")])])
    die_holding(backend, private_dir, store_name, conversations.key("user-42"))
    with pytest.raises(DecisionHistoryBusy):
        async with conversations.open("user-42"):
            pass
    assert await store.recover(conversations.key("user-42"), worker_stopped=True)
    async with conversations.open("user-42") as conversation:
        assert len(conversation.messages) == 1
