"""ADK's Runner on ToubaSessionService: a tool loop for two users, and a second run refused.

The model is a scripted ``BaseLlm`` (no network): it calls the tool, then answers
with what the tool returned.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from google.adk.agents import LlmAgent
from google.adk.models._capabilities import LlmCapabilities
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.genai import types
from pydantic import Field

from tests.integrations.adk.conftest import BackendOpener
from touba.errors import DecisionHistoryBusy, DecisionHistoryLimitExceeded
from touba.integrations.adk import ToubaSessionService
from touba.integrations.adk._backend import AdkLimits

APP = "shop"


class ScriptedModel(BaseLlm):
    """Calls ``order_status`` once per turn, then answers with its result."""

    model: str = "scripted"
    calls: list[str] = Field(default_factory=list)
    called: Any = None  # an asyncio.Event set at each call
    gate: Any = None  # an asyncio.Event the test may hold the calls on

    @property
    def capabilities(self) -> LlmCapabilities:
        return LlmCapabilities(output_schema_and_tools=False)

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        last = llm_request.contents[-1]
        self.calls.append(last.role or "")
        if self.called is not None:
            self.called.set()
        if self.gate is not None:
            await self.gate.wait()
        response = next(
            (p.function_response for p in last.parts or [] if p.function_response), None
        )
        if response is None:
            order = next(p.text for p in last.parts or [] if p.text)
            part = types.Part(
                function_call=types.FunctionCall(name="order_status", args={"order": order})
            )
        else:
            part = types.Part(text=f"Your order is {response.response['result']}.")  # type: ignore[index]
        yield LlmResponse(content=types.Content(role="model", parts=[part]))


def order_status(order: str) -> str:
    """The status of an order."""
    return f"{order}: shipped"


def message(text: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=text)])


def runner(service: ToubaSessionService, model: ScriptedModel) -> Runner:
    agent = LlmAgent(name="support", model=model, tools=[order_status], output_key="answer")
    return Runner(agent=agent, app_name=APP, session_service=service)


async def run(r: Runner, user: str, session: str, text: str) -> list[Any]:
    return [
        e async for e in r.run_async(user_id=user, session_id=session, new_message=message(text))
    ]


async def test_a_tool_loop_for_two_users_is_stored_and_read_back(
    open_backend: BackendOpener,
) -> None:
    service = ToubaSessionService(open_backend())
    model = ScriptedModel()
    r = runner(service, model)
    for user in ("ann", "bob"):
        await service.create_session(app_name=APP, user_id=user, session_id="s1")
        await run(r, user, "s1", f"A-{user}")
        await run(r, user, "s1", f"B-{user}")
    for user in ("ann", "bob"):
        stored = await service.get_session(app_name=APP, user_id=user, session_id="s1")
        assert stored is not None
        kinds = [
            "call"
            if e.get_function_calls()
            else "result"
            if e.get_function_responses()
            else e.author
            for e in stored.events
        ]
        assert kinds == ["user", "call", "result", "support"] * 2
        assert stored.state == {"answer": f"Your order is B-{user}: shipped."}
        texts = [
            e.content.parts[0].text
            for e in stored.events
            if e.author == "support" and e.content and e.content.parts and e.content.parts[0].text
        ]
        assert texts == [f"Your order is A-{user}: shipped.", f"Your order is B-{user}: shipped."]
    # reopened (a durable store): the same sessions
    if open_backend.persistent:
        again = ToubaSessionService(open_backend())
        listed = await again.list_sessions(app_name=APP)
        assert [(s.user_id, s.id, len(s.events)) for s in listed.sessions] == [
            ("ann", "s1", 0),
            ("bob", "s1", 0),
        ]


async def test_a_second_run_on_a_held_session_is_refused_before_its_model_call(
    open_backend: BackendOpener,
) -> None:
    service = ToubaSessionService(open_backend())
    first_model, second_model = ScriptedModel(), ScriptedModel()
    first_model.gate, first_model.called = asyncio.Event(), asyncio.Event()
    await service.create_session(app_name=APP, user_id="ann", session_id="s1")

    async def first_run() -> list[Any]:
        async with service.exclusive(app_name=APP, user_id="ann", session_id="s1"):
            return await run(runner(service, first_model), "ann", "s1", "first")

    first = asyncio.create_task(first_run(), context=contextvars.Context())
    await first_model.called.wait()  # the first run is at its model call
    second = asyncio.create_task(
        run(runner(service, second_model), "ann", "s1", "second"), context=contextvars.Context()
    )
    with pytest.raises(DecisionHistoryBusy):
        await second
    assert second_model.calls == []  # refused before it cost a model call
    first_model.gate.set()
    await first
    stored = await service.get_session(app_name=APP, user_id="ann", session_id="s1")
    assert stored is not None
    assert [e.author for e in stored.events] == ["user", "support", "support", "support"]
    assert stored.state == {"answer": "Your order is first: shipped."}
    # the session is free again: the next run goes through
    await run(runner(service, second_model), "ann", "s1", "second")


async def test_a_full_session_stops_the_run_before_its_model_call(
    open_backend: BackendOpener,
) -> None:
    service = ToubaSessionService(open_backend(limits=AdkLimits(max_session_bytes=3_000)))
    model = ScriptedModel()
    await service.create_session(app_name=APP, user_id="ann", session_id="s1")
    await run(runner(service, model), "ann", "s1", "first")  # ~4 events, under 3,000 bytes
    calls = len(model.calls)
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await run(runner(service, model), "ann", "s1", "second " + "x" * 2_000)
    assert caught.value.limit == "max_retained_bytes"
    assert len(model.calls) == calls  # no model call for the refused run
    stored = await service.get_session(app_name=APP, user_id="ann", session_id="s1")
    assert stored is not None
    assert len(stored.events) == 4
