"""Contents and requests as ADK builds them, for the plugin's tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.adk.agents.callback_context import CallbackContext
from google.adk.agents.invocation_context import InvocationContext
from google.adk.agents.llm_agent import LlmAgent
from google.adk.models.llm_request import LlmRequest
from google.adk.sessions import InMemorySessionService, Session
from google.genai import types


def user(text: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=text)])


def model(text: str) -> types.Content:
    return types.Content(role="model", parts=[types.Part(text=text)])


def calls(*names: str, ids: Sequence[str | None] | None = None) -> types.Content:
    """A model turn calling ``names`` (ids None: stripped, as ADK does for Gemini)."""
    ids = ids or [None] * len(names)
    parts = [
        types.Part(function_call=types.FunctionCall(name=n, id=i, args={"n": k}))
        for k, (n, i) in enumerate(zip(names, ids, strict=True))
    ]
    return types.Content(role="model", parts=parts)


def results(*names: str, ids: Sequence[str | None] | None = None, pad: int = 0) -> types.Content:
    ids = ids or [None] * len(names)
    parts = [
        types.Part(
            function_response=types.FunctionResponse(name=n, id=i, response={"result": "r" * pad})
        )
        for n, i in zip(names, ids, strict=True)
    ]
    return types.Content(role="user", parts=parts)


def confirmation_call(conf_id: str, original: str, original_id: str) -> types.Content:
    """ADK's ``adk_request_confirmation`` call for the call ``original_id``."""
    call = types.FunctionCall(
        name="adk_request_confirmation",
        id=conf_id,
        args={
            "originalFunctionCall": {"name": original, "id": original_id, "args": {}},
            "toolConfirmation": {"hint": "approve?", "confirmed": False},
        },
    )
    return types.Content(role="model", parts=[types.Part(function_call=call)])


def confirmation_answer(conf_id: str, *, confirmed: bool = True) -> types.Content:
    response = types.FunctionResponse(
        name="adk_request_confirmation", id=conf_id, response={"confirmed": confirmed}
    )
    return types.Content(role="user", parts=[types.Part(function_response=response)])


async def callback_context(
    app_name: str = "app", user_id: str = "u", session_id: str = "s"
) -> CallbackContext:
    """A CallbackContext on a real (in-memory) ADK session."""
    sessions = InMemorySessionService()
    session: Session = await sessions.create_session(
        app_name=app_name, user_id=user_id, session_id=session_id
    )
    context = InvocationContext(
        session_service=sessions,
        invocation_id="inv",
        agent=LlmAgent(name="agent"),
        session=session,
    )
    return CallbackContext(context)


def request(contents: Sequence[types.Content], **kwargs: Any) -> LlmRequest:
    return LlmRequest(contents=list(contents), **kwargs)
