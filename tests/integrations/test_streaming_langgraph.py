"""LangGraph ``stream_mode="messages"`` with touba's window.

The fake chat model streams a reply that says how many messages it was sent,
word by word (and its tool calls as tool-call chunks): the streamed chunks are
then those of the model call that got the window, and the graph's state must
still keep every message.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from tests.integrations.test_langgraph import assert_no_orphan, lookup
from touba.integrations.langgraph import ToubaWindowMiddleware, touba_pre_model_hook

CALLS = 6


class Streaming(BaseChatModel):
    """Calls ``lookup`` ``CALLS`` times, then answers; each reply says what it was sent."""

    seen: list[list[BaseMessage]]

    @property
    def _llm_type(self) -> str:
        return "touba-test-streaming"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    def _chunks(self, messages: list[BaseMessage]) -> list[AIMessageChunk]:
        self.seen.append(list(messages))
        step = len(self.seen)
        words = f"call {step} was sent {len(messages)} messages".split(" ")
        chunks = [AIMessageChunk(content=w if i == 0 else f" {w}") for i, w in enumerate(words)]
        if step <= CALLS:
            args = json.dumps({"i": step})
            chunks.append(
                AIMessageChunk(
                    content="",
                    tool_call_chunks=[
                        {"name": "lookup", "args": args, "id": f"c{step}", "index": 0}
                    ],
                )
            )
        return chunks

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        whole = AIMessageChunk(content="")
        for chunk in self._chunks(messages):
            whole += chunk
        message = AIMessage(content=whole.content, tool_calls=whole.tool_calls)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages):
            if run_manager is not None:
                run_manager.on_llm_new_token(
                    str(chunk.content), chunk=ChatGenerationChunk(message=chunk)
                )
            yield ChatGenerationChunk(message=chunk)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages):
            await asyncio.sleep(0)
            if run_manager is not None:
                await run_manager.on_llm_new_token(
                    str(chunk.content), chunk=ChatGenerationChunk(message=chunk)
                )
            yield ChatGenerationChunk(message=chunk)


def streamed(agent: Any, run: str) -> tuple[list[tuple[AIMessageChunk, dict[str, Any]]], Any]:
    """The model's streamed chunks (with their metadata) and the graph's last state."""
    request: Any = {"messages": [HumanMessage("look things up")]}
    modes = ["messages", "values"]
    items: list[tuple[str, Any]] = []
    if run == "sync":
        items = list(agent.stream(request, stream_mode=modes))
    else:

        async def collect() -> None:
            async for item in agent.astream(request, stream_mode=modes):
                items.append(item)

        asyncio.run(collect())
    chunks = [
        (message, meta)
        for mode, (message, meta) in (i for i in items if i[0] == "messages")
        if isinstance(message, AIMessageChunk)
    ]
    states = [value for mode, value in items if mode == "values"]
    return chunks, states[-1]


def assert_streamed_windows(
    model: Streaming, chunks: list[tuple[AIMessageChunk, dict[str, Any]]], state: Any, lead: int
) -> None:
    calls: dict[str, AIMessageChunk] = {}
    counts: dict[str, int] = {}
    for chunk, _meta in chunks:
        assert chunk.id is not None
        calls[chunk.id] = calls[chunk.id] + chunk if chunk.id in calls else chunk
        counts[chunk.id] = counts.get(chunk.id, 0) + 1
    assert len(model.seen) == CALLS + 1
    assert len(calls) == CALLS + 1  # one stream per model call, none repeated or lost
    for step, (sent, reply) in enumerate(zip(model.seen, calls.values(), strict=True), 1):
        assert_no_orphan(sent)
        assert len(sent) <= lead + 1 + 4  # the window was applied to this call
        assert reply.content == f"call {step} was sent {len(sent)} messages"  # ... and streamed
        assert counts[str(reply.id)] >= 6  # word by word, not whole
        assert [c["id"] for c in reply.tool_calls] == ([f"c{step}"] if step <= CALLS else [])
    assert len(model.seen[-1]) == lead + 1 + 4  # the bound was reached
    assert len(state["messages"]) == 1 + CALLS * 2 + 1  # the state keeps everything
    assert state["messages"][-1].content == f"call {CALLS + 1} was sent {lead + 5} messages"


@pytest.mark.parametrize("run", ["sync", "async"])
def test_create_agent_streams_messages_of_the_windowed_call(run: str) -> None:
    from langchain.agents import create_agent

    model = Streaming(seen=[])
    agent = create_agent(
        model,
        [lookup],
        system_prompt="You look things up.",
        middleware=[ToubaWindowMiddleware(max_messages=4)],
    )
    chunks, state = streamed(agent, run)
    assert {meta["langgraph_node"] for _, meta in chunks} == {"model"}
    assert_streamed_windows(model, chunks, state, lead=1)


@pytest.mark.parametrize("run", ["sync", "async"])
def test_create_react_agent_streams_messages_of_the_windowed_call(run: str) -> None:
    with warnings.catch_warnings():  # create_react_agent is deprecated in favour of langchain's
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

        model = Streaming(seen=[])
        agent = create_react_agent(
            model, [lookup], pre_model_hook=touba_pre_model_hook(max_messages=4)
        )
    chunks, state = streamed(agent, run)
    assert {meta["langgraph_node"] for _, meta in chunks} == {"agent"}
    assert_streamed_windows(model, chunks, state, lead=0)
