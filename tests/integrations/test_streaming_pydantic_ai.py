"""pydantic-ai ``agent.run_stream`` with touba's window and ``ToubaConversations``.

The model is pydantic-ai's ``FunctionModel`` with a stream function (text
deltas and tool-call deltas). A run cancelled mid-stream or mid-tool must leave
the conversation resumable (pydantic-ai #7977): nothing of it stored when the
block ends with the cancellation, and what ``RunCancelled`` hands back, when
saved, taken by the next run with a new prompt without running a tool again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai import Agent, CancellationToken, RunCancelled
from pydantic_ai.capabilities import ProcessHistory
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel

from tests.integrations.test_pydantic_ai import assert_no_orphan
from touba.errors import DecisionHistoryBusy
from touba.integrations.pydantic_ai import ToubaConversations, ToubaWindow, touba_history

WORDS = ["All ", "shipped", "."]


def prompts(messages: list[ModelMessage]) -> list[str]:
    return [
        str(p.content)
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, UserPromptPart)
    ]


def streaming_model(
    seen: list[list[ModelMessage]], gate: asyncio.Event | None = None
) -> FunctionModel:
    """Calls ``lookup`` once per user request, then streams ``WORDS`` (waiting for ``gate``
    after the first word, when given)."""

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
        seen.append(list(messages))
        last = messages[-1]
        if isinstance(last, ModelRequest) and any(
            isinstance(p, UserPromptPart) for p in last.parts
        ):
            n = len(seen)
            call: DeltaToolCalls = {
                0: DeltaToolCall(name="lookup", json_args=f'{{"order": {n}}}', tool_call_id=f"c{n}")
            }
            yield call
            return
        for index, word in enumerate(WORDS):
            if index == 1 and gate is not None:
                await gate.wait()
            yield word

    return FunctionModel(stream_function=stream)


def tool_agent(model: FunctionModel, ran: list[int], **kwargs: Any) -> Agent[None, str]:
    agent: Agent[None, str] = Agent(model, **kwargs)

    @agent.tool_plain
    async def lookup(order: int) -> str:
        """Look up an order."""
        ran.append(order)
        return "shipped"

    return agent


@pytest.mark.parametrize("window", ["capability", "processor"])
async def test_run_stream_streams_the_window_and_saves_every_message(
    store: Any, window: str
) -> None:
    seen: list[list[ModelMessage]] = []
    ran: list[int] = []
    trim = (
        ToubaWindow(max_messages=4)
        if window == "capability"
        else ProcessHistory(touba_history(max_messages=4))
    )
    agent = tool_agent(streaming_model(seen), ran, capabilities=[trim])
    conversations = ToubaConversations(store, namespace="shop")
    for turn in range(3):
        async with conversations.open("user-1") as conversation:
            async with agent.run_stream(
                f"order {turn}?", message_history=conversation.messages
            ) as result:
                chunks = [text async for text in result.stream_text(delta=True, debounce_by=None)]
            conversation.extend(result.new_messages())
        assert chunks == WORDS
        assert_no_orphan(seen[-1][:-1] if isinstance(seen[-1][-1], ModelResponse) else seen[-1])
    stored = await conversations.messages("user-1")
    if window == "capability":  # the run keeps every message; the store receives all of them
        assert len(stored) == 12
        assert prompts(stored) == ["order 0?", "order 1?", "order 2?"]
    calls = [p.tool_call_id for m in stored for p in m.parts if isinstance(p, ToolCallPart)]
    returns = [p.tool_call_id for m in stored for p in m.parts if isinstance(p, ToolReturnPart)]
    assert calls == returns == sorted(set(calls), key=calls.index)  # each once, paired
    assert ran == [int(c[1:]) for c in calls]  # each tool ran once
    # What each request sent is the window: never over 4 messages besides the request.
    assert all(len(messages) <= 5 for messages in seen)
    assert prompts(seen[-1]) == ["order 2?"]


async def test_a_run_cancelled_mid_stream_stores_nothing_and_the_conversation_goes_on(
    store: Any,
) -> None:
    seen: list[list[ModelMessage]] = []
    ran: list[int] = []
    gate = asyncio.Event()
    agent = tool_agent(streaming_model(seen, gate), ran)
    conversations = ToubaConversations(store, namespace="shop")
    async with conversations.open("user-2") as conversation:
        async with agent.run_stream("first?", message_history=conversation.messages) as result:
            gate.set()
            async for _ in result.stream_text():
                pass
        conversation.extend(result.new_messages())
    before = await conversations.messages("user-2")
    gate.clear()
    got: list[str] = []
    first = asyncio.Event()

    async def consume() -> None:
        async with conversations.open("user-2") as conversation:
            async with agent.run_stream("second?", message_history=conversation.messages) as r:
                async for text in r.stream_text(delta=True, debounce_by=None):
                    got.append(text)
                    first.set()
            conversation.extend(r.new_messages())  # never reached

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 5)
    await asyncio.sleep(0.05)  # (the stream would go on now if it could)
    assert got == ["All "]  # mid-stream: the first delta is out, the rest waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await conversations.messages("user-2") == before  # nothing half stored
    gate.set()
    async with conversations.open("user-2") as conversation:  # not left reserved
        async with agent.run_stream("third?", message_history=conversation.messages) as result:
            assert [t async for t in result.stream_text(delta=True, debounce_by=None)] == WORDS
        conversation.extend(result.new_messages())
    assert prompts(await conversations.messages("user-2")) == ["first?", "third?"]


async def test_a_run_cancelled_mid_stream_by_its_token_keeps_what_it_streamed(
    store: Any,
) -> None:
    seen: list[list[ModelMessage]] = []
    ran: list[int] = []
    gate = asyncio.Event()
    agent = tool_agent(streaming_model(seen, gate), ran, capabilities=[ToubaWindow()])
    conversations = ToubaConversations(store, namespace="shop")
    token = CancellationToken()
    got: list[str] = []
    first = asyncio.Event()

    async def run() -> None:
        async with conversations.open("user-4") as conversation:
            try:
                async with agent.run_stream(
                    "first?", message_history=conversation.messages, cancellation_token=token
                ) as result:
                    async for text in result.stream_text(delta=True, debounce_by=None):
                        got.append(text)
                        first.set()
            except RunCancelled as e:
                conversation.extend(e.new_messages())

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 5)
    token.cancel()
    await asyncio.wait_for(task, 5)
    assert got == ["All "]
    stored = await conversations.messages("user-4")
    last = stored[-1]
    assert isinstance(last, ModelResponse)
    assert last.state == "interrupted"  # the reply as far as it streamed
    assert_no_orphan(stored[:-1])
    gate.set()
    async with conversations.open("user-4") as conversation:
        async with agent.run_stream("again?", message_history=conversation.messages) as result:
            assert [t async for t in result.stream_text(delta=True, debounce_by=None)] == WORDS
        conversation.extend(result.new_messages())
    assert len(ran) == 2  # the first run's tool is not run again
    assert prompts(await conversations.messages("user-4")) == ["first?", "again?"]


@pytest.mark.parametrize("how", ["token", "task"])
async def test_a_run_cancelled_mid_tool_leaves_the_conversation_resumable(
    store: Any, how: str
) -> None:
    seen: list[list[ModelMessage]] = []
    ran: list[str] = []
    started, release = asyncio.Event(), asyncio.Event()
    agent: Agent[None, str] = Agent(streaming_model(seen), capabilities=[ToubaWindow()])

    @agent.tool_plain
    async def lookup(order: int) -> str:
        """Look up an order, slowly the first time."""
        ran.append(f"start {order}")
        if order == 1:
            started.set()
            await release.wait()
        ran.append(f"end {order}")
        return "shipped"

    conversations = ToubaConversations(store, namespace="shop")
    token = CancellationToken()
    kept: list[ModelMessage] = []

    async def run() -> None:
        async with conversations.open("user-3") as conversation:
            try:
                async with agent.run_stream(
                    "where is 1?",
                    message_history=conversation.messages,
                    cancellation_token=token if how == "token" else None,
                ) as result:
                    async for _ in result.stream_text():
                        pass
            except RunCancelled as e:  # the application's own cancel: keep what it did
                kept.extend(e.new_messages())
                conversation.extend(e.new_messages())
            except asyncio.CancelledError as e:  # the task's: keep it too, then propagate
                cancelled = RunCancelled.from_cancellation(e)
                assert cancelled is not None
                kept.extend(cancelled.new_messages())
                conversation.extend(cancelled.new_messages())
                raise

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 5)
    if how == "token":
        token.cancel()
        await asyncio.wait_for(task, 5)
        assert kept  # what the run completed (the call, the interruption) is stored
        assert await conversations.messages("user-3") == kept
    else:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert kept  # handed back, but the block ended with the cancellation: nothing stored
        assert await conversations.messages("user-3") == []

    async with conversations.open("user-3") as conversation:  # resumable with a new prompt
        async with agent.run_stream("and 2?", message_history=conversation.messages) as result:
            assert [t async for t in result.stream_text(delta=True, debounce_by=None)] == WORDS
        conversation.extend(result.new_messages())
    assert ran[:3] == ["start 1", "start 2", "end 2"]  # the interrupted tool is not run again
    stored = await conversations.messages("user-3")
    assert prompts(stored) == (["where is 1?", "and 2?"] if how == "token" else ["and 2?"])
    sent = seen[-2]  # the resumed run's first request: the interrupted call, closed out
    assert_no_orphan(sent)
    if how == "token":
        assert [p.tool_call_id for m in sent for p in m.parts if isinstance(p, ToolCallPart)] == [
            "c1"
        ]
    # A later run sends no half of the interrupted exchange (pydantic-ai closes it out only
    # at the end of a history) and no empty request of it.
    async with conversations.open("user-3") as conversation:
        assert all(m.parts for m in conversation.messages)
        async with agent.run_stream("and 3?", message_history=conversation.messages) as result:
            assert [t async for t in result.stream_text(delta=True, debounce_by=None)] == WORDS
        conversation.extend(result.new_messages())
    assert_no_orphan(seen[-2])
    with pytest.raises(DecisionHistoryBusy):  # (the reservation works as for run)
        async with conversations.open("user-3"), conversations.open("user-3"):
            pass


def test_the_interrupted_request_goes_with_the_calls_it_interrupts() -> None:
    """Once a turn follows it, the exchange a cancelled run left (its calls, the empty
    interrupted request) is sent neither whole nor in part: pydantic-ai closes calls out
    only at the end of a history, and an empty request is no user turn."""
    u1 = ModelRequest(parts=[UserPromptPart("where is 1?")])
    called = ModelResponse(parts=[ToolCallPart("lookup", {"order": 1}, "c1")])
    interrupted = ModelRequest(parts=[], state="interrupted")
    u2 = ModelRequest(parts=[UserPromptPart("and 2?")])
    window = touba_history()([u1, called, interrupted, u2])
    assert window == [u1, u2]
