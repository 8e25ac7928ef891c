"""The preview chat, streamed: server-sent events of one preview turn.

``POST /agents/{name}/preview/stream`` (the form of the preview box, checked
for its CSRF token here and its Origin by the application, as every action)
answers ``text/event-stream``, read by the panel's own script
(``static/panel.js``, a ``fetch`` whose body it parses: no inline script, the
CSP unchanged). Events, each one ``data:`` line of JSON:

- ``delta`` ``{"text": ...}``: a piece of the agent's reply, as the model
  writes it (the script adds it with ``textContent``: never parsed as HTML);
- ``call`` ``{"name": ..., "status": ...}``: a call of the agent answered;
- ``done`` ``{"html": ...}``: the transcript, rendered (and escaped) by the
  server as the non-streamed preview renders it, with the turn's problem if
  any; the last event.

Decisions:

- **A client that leaves cancels the turn.** The response watches the
  connection while it streams: when the client disconnects (the tab closed,
  the fetch aborted), the turn is cancelled at once, not at the next write
  (:meth:`~touba.memory.ChatSession.stream`: nothing of it is stored, the
  preview session usable by the next turn). Starlette's ``StreamingResponse``
  does so only on servers of ASGI spec < 2.4 (uvicorn today); on others it
  notices at its next write, which may come long after (a slow tool call).
- A preview approves nothing: a call that needs approval is refused, as in the
  non-streamed preview.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Final

from fastapi import APIRouter, Request, Response
from starlette.types import Receive, Scope, Send

from touba.errors import ToubaError
from touba.memory import ChatTurn
from touba.panel._routes import PAGE_SIZE, _agent, _form, _operator, _panel, preview_session
from touba.panel._state import Panel
from touba.runtime import AgentDefinition, TextDelta, ToolCallFinished

__all__ = ["EventStream", "router"]

router = APIRouter()

_HEADERS: Final = {"x-accel-buffering": "no"}  # a proxy in front must not hold events back


def frame(event: str, data: object) -> bytes:
    """One server-sent event: its name and one ``data:`` line of JSON."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class EventStream(Response):
    """``text/event-stream`` of the frames ``produce()`` yields; the client's leaving
    cancels ``produce`` at once (see the module docstring)."""

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[], AsyncIterator[bytes]]) -> None:
        # Not Response.__init__: it would declare an empty body (content-length: 0).
        self.status_code = 200
        self.background = None
        self.init_headers(_HEADERS)
        self._produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def stream() -> None:
            async for chunk in self._produce():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        producer = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((producer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                task.cancel()
            for task in (producer, watcher):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task  # the turn cancelled (client gone) or finished


@router.post("/agents/{name}/preview/stream")
async def preview_stream(request: Request, name: str) -> Response:
    """One preview turn as server-sent events (see the module docstring)."""
    panel = _panel(request)
    agent = _agent(panel, name)
    form = await _form(request)
    session = _operator(request)
    text = form.get("message", "")
    preview_id = session.previews.setdefault(agent.name, f"preview-{uuid.uuid4().hex}")

    async def produce() -> AsyncIterator[bytes]:
        problem = "Type a message first." if not text.strip() else None
        if problem is None:
            async for chunk in _turn(panel, agent, preview_id, text):
                if isinstance(chunk, bytes):
                    yield chunk
                else:
                    problem = chunk or None
        turns = await panel.memory.list_turns(preview_id, limit=PAGE_SIZE)
        html = panel.templates.get_template("_preview.html").render(
            preview_turns=turns, problem=problem, agent=agent
        )
        yield frame("done", {"html": html})

    return EventStream(produce)


async def _turn(
    panel: Panel, agent: AgentDefinition, preview_id: str, text: str
) -> AsyncIterator[bytes | str]:
    """The frames of one streamed preview turn, then its problem ("" when none)."""
    try:
        async with preview_session(panel, agent, preview_id) as chat:
            async with chat.stream(text) as stream:
                async for event in stream:
                    if isinstance(event, TextDelta) and event.agent == agent.name:
                        yield frame("delta", {"text": event.text})
                    elif isinstance(event, ToolCallFinished) and event.agent == agent.name:
                        yield frame("call", {"name": event.name, "status": event.status})
            turn: ChatTurn = stream.turn
            while turn.status == "awaiting_approval":
                turn = await chat.resume({c.call_id: False for c in turn.result.pending})
    except ToubaError as e:
        yield f"{e.code}: {e.message}"
        return
    error = turn.result.error
    yield f"{error.code}: {error.message}" if turn.status == "failed" and error else ""
