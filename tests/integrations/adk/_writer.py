"""A writer killed (kill -9) while it appends to an ADK session, for the crash test.

``python -m tests.integrations.adk._writer KIND DIRECTORY NAME``: opens the
test's store (``conftest.make_opener``), holds session ``app/u/s`` with
``exclusive()``, prints ``writing`` after its first append, and appends
events (each with a state delta) until the test kills it.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions
from google.genai import types

from tests.integrations.adk.conftest import make_opener
from touba.integrations.adk import ToubaSessionService


async def main(kind: str, directory: str, name: str) -> None:
    opener, _ = make_opener(kind, Path(directory), name)
    service = ToubaSessionService(opener())
    session = await service.get_session(app_name="app", user_id="u", session_id="s")
    assert session is not None
    async with service.exclusive(app_name="app", user_id="u", session_id="s"):
        n = 0
        while True:
            n += 1
            text = f"event {n} " + "x" * 2000
            event = Event(
                author="agent",
                invocation_id="crash",
                content=types.Content(role="model", parts=[types.Part(text=text)]),
                actions=EventActions(state_delta={"n": n, "user:n": n}),
            )
            await service.append_event(session, event)
            if n == 1:
                print("writing", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
