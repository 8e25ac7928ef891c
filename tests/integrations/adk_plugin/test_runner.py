"""ToubaContextPlugin under ADK's Runner: Gemini on touba's fake Gemini server, ADK's own
InMemorySessionService. The model sees the window; the session keeps every event."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from google import genai
from google.adk.agents import LlmAgent
from google.adk.agents.callback_context import CallbackContext
from google.adk.apps import App
from google.adk.events import Event
from google.adk.models import Gemini
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.plugins import BasePlugin
from google.adk.runners import Runner
from google.adk.sessions import InMemorySessionService
from google.adk.tools.function_tool import FunctionTool
from google.genai import types

from touba.errors import DecisionHistoryLimitExceeded
from touba.history import HistoryEvent
from touba.integrations.adk import ToubaContextPlugin
from touba.testing.fakes import FakeGeminiServer, gemini_function_call, gemini_text

TRANSFERS: list[int] = []


def lookup(order: str) -> dict[str, str]:
    """Look an order up."""
    return {"order": order, "status": "shipped " + "x" * 200}


def transfer(amount: int) -> str:
    """Send money (asks the user first)."""
    TRANSFERS.append(amount)
    return f"sent {amount}"


class Before(BasePlugin):
    """Records how many contents ADK built, before the window is cut."""

    def __init__(self) -> None:
        super().__init__("before")
        self.built: list[int] = []

    async def before_model_callback(
        self, *, callback_context: CallbackContext, llm_request: LlmRequest
    ) -> LlmResponse | None:
        self.built.append(len(llm_request.contents))
        return None


@pytest.fixture
def srv() -> Iterator[FakeGeminiServer]:
    with FakeGeminiServer() as server:
        yield server


def runner_for(
    srv: FakeGeminiServer, plugin: ToubaContextPlugin, **agent: Any
) -> tuple[Runner, InMemorySessionService, Before]:
    client = genai.Client(api_key="test", http_options=types.HttpOptions(base_url=srv.base_url))
    llm = Gemini(model="gemini-2.5-flash", client=client)
    tools = [lookup, FunctionTool(transfer, require_confirmation=True)]
    root = LlmAgent(name="support", model=llm, tools=tools, **agent)
    sessions = InMemorySessionService()
    before = Before()
    runner = Runner(
        app=App(name="shop", root_agent=root, plugins=[before, plugin]), session_service=sessions
    )
    return runner, sessions, before


async def say(runner: Runner, session_id: str, message: types.Content) -> list[Event]:
    return [
        event
        async for event in runner.run_async(
            user_id="ann", session_id=session_id, new_message=message
        )
    ]


def text(value: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=value)])


def sent(srv: FakeGeminiServer) -> list[list[dict[str, Any]]]:
    requests = srv.requests_to("generate_content")
    assert all(r.status == 200 for r in requests)  # the fake accepted every window
    return [r.body["contents"] for r in requests]


async def test_the_model_sees_the_window_and_the_session_keeps_everything(
    srv: FakeGeminiServer,
) -> None:
    events: list[HistoryEvent] = []
    runner, sessions, before = runner_for(
        srv, ToubaContextPlugin(max_messages=6, on_event=events.append)
    )
    session = await sessions.create_session(app_name="shop", user_id="ann")
    for turn in range(5):
        srv.script_response(gemini_function_call("lookup", {"order": f"A{turn}"}))
        srv.script_response(gemini_function_call("lookup", {"order": f"B{turn}"}))
        srv.script_response(gemini_text(f"both shipped {turn}"))
        await say(runner, session.id, text(f"where are A{turn} and B{turn}?"))
    bodies = sent(srv)
    assert len(bodies) == 15
    assert max(len(b) for b in bodies) <= 7  # six messages and the newest input
    assert before.built[-1] > len(bodies[-1])  # ADK built more; the model got the window
    assert "where are A0" not in str(bodies[-1])
    stored = await sessions.get_session(app_name="shop", user_id="ann", session_id=session.id)
    assert stored is not None
    assert len(stored.events) == 5 * 6  # input, two calls, two results, the answer
    assert "where are A0" in str(stored.events[0].content)
    assert any(e.kind == "history_trimmed" for e in events)
    await runner.close()


async def test_a_pending_confirmation_left_out_of_the_window_can_still_be_answered(
    srv: FakeGeminiServer,
) -> None:
    # adk-python #4740: compaction summarised away a pending confirmation, and answering
    # it failed. The window only changes what the model sees: the answer still works.
    TRANSFERS.clear()
    runner, sessions, _ = runner_for(srv, ToubaContextPlugin(max_messages=4))
    session = await sessions.create_session(app_name="shop", user_id="ann")
    srv.script_response(gemini_function_call("transfer", {"amount": 5}))
    events = await say(runner, session.id, text("send 5 to Bob"))
    (request_id,) = [
        call.id
        for event in events
        for call in event.get_function_calls()
        if call.name == "adk_request_confirmation"
    ]
    for turn in range(4):  # the user chats on; the pending turn leaves the window
        srv.script_response(gemini_text(f"reply {turn}"))
        await say(runner, session.id, text(f"by the way {turn}"))
    assert "send 5 to Bob" not in str(sent(srv)[-1])
    srv.script_response(gemini_text("Sent."))
    answer = types.FunctionResponse(
        id=request_id, name="adk_request_confirmation", response={"confirmed": True}
    )
    await say(
        runner, session.id, types.Content(role="user", parts=[types.Part(function_response=answer)])
    )
    assert TRANSFERS == [5]
    last = sent(srv)[-1]
    flat = str(last)
    assert "send 5 to Bob" in flat  # the call's turn is the current one again
    assert "sent 5" in flat  # with the tool's result next to its call
    stored = await sessions.get_session(app_name="shop", user_id="ann", session_id=session.id)
    assert stored is not None
    assert any(
        call.name == "adk_request_confirmation"
        for event in stored.events
        for call in event.get_function_calls()
    )
    await runner.close()


async def test_the_dynamic_instruction_is_not_taken_for_the_users_input(
    srv: FakeGeminiServer,
) -> None:
    # With static_instruction and instruction, ADK puts the instruction in the contents,
    # after the last tool result: the current input must still be sent.
    runner, sessions, _ = runner_for(
        srv,
        ToubaContextPlugin(max_messages=3),
        static_instruction="You help with orders.",
        instruction="Be brief.",
    )
    session = await sessions.create_session(app_name="shop", user_id="ann")
    for k in range(3):
        srv.script_response(gemini_function_call("lookup", {"order": f"C{k}"}))
    srv.script_response(gemini_text("all shipped"))
    await say(runner, session.id, text("check C0, C1 and C2"))
    bodies = sent(srv)
    for body in bodies:
        assert "check C0, C1 and C2" in str(body)
        assert "Be brief." in str(body)
    assert len(bodies[-1]) == 1 + 2 + 1  # input, the last exchange, the instruction
    await runner.close()


async def test_a_last_exchange_over_the_bound_is_refused_before_the_model(
    srv: FakeGeminiServer,
) -> None:
    runner, sessions, _ = runner_for(srv, ToubaContextPlugin(max_bytes=300))
    session = await sessions.create_session(app_name="shop", user_id="ann")
    srv.script_response(gemini_function_call("lookup", {"order": "D1"}))
    with pytest.raises(RuntimeError) as caught:
        await say(runner, session.id, text("where is D1?"))
    assert isinstance(caught.value.__cause__, DecisionHistoryLimitExceeded)
    assert caught.value.__cause__.limit == "max_bytes"
    assert len(sent(srv)) == 1  # the request with the oversized result never went out
    await runner.close()
