"""ToubaSessionService on each store against ADK's own InMemorySessionService.

Random sequences of create (with scoped and ``temp:`` state), append (with
state deltas of random JSON values), get (with random ``num_recent_events`` and
``after_timestamp``), list, delete and get_user_state, on two users and two
session ids: every answer (sessions with their state and events, refusals by
type) must be the one ADK's reference service gives.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from typing import Any

from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions
from google.adk.sessions import BaseSessionService, InMemorySessionService, Session
from google.adk.sessions.base_session_service import GetSessionConfig
from google.genai import types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integrations.adk.conftest import BackendOpener
from touba.integrations.adk import ToubaSessionService

APP = "diff"
USERS = ("u1", "u2")
IDS = ("s1", "s2")
KEYS = st.sampled_from(["k", "j", "app:a", "app:b", "user:u", "user:v", "temp:t"])
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=2), inner, max_size=2)
    ),
    max_leaves=4,
)
STATE = st.dictionaries(KEYS, JSON, max_size=3)
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("create"), st.sampled_from(USERS), st.sampled_from(IDS), STATE),
        st.tuples(st.just("append"), st.sampled_from(USERS), st.sampled_from(IDS), STATE),
        st.tuples(st.just("append"), st.sampled_from(USERS), st.sampled_from(IDS), STATE),
        st.tuples(
            st.just("get"),
            st.sampled_from(USERS),
            st.sampled_from(IDS),
            st.tuples(st.sampled_from([None, 0, 1, 2, 5]), st.sampled_from([None, 0, 2, 4])),
        ),
        st.tuples(st.just("list"), st.sampled_from((*USERS, None)), st.just(""), st.just(None)),
        st.tuples(st.just("delete"), st.sampled_from(USERS), st.sampled_from(IDS), st.just(None)),
        st.tuples(st.just("user_state"), st.sampled_from(USERS), st.just(""), st.just(None)),
    ),
    min_size=1,
    max_size=25,
)
_namespaces = itertools.count()


def _view(session: Session | None) -> Any:
    if session is None:
        return None
    return (session.user_id, session.id, session.state, session.events)


async def _answer(
    service: BaseSessionService,
    operation: tuple[str, str, str, Any],
    event: Event | None,
    base: float,
) -> Any:
    kind, user, sid, argument = operation
    try:
        if kind == "create":
            made = await service.create_session(
                app_name=APP, user_id=user, session_id=sid, state=copy.deepcopy(argument)
            )
            return _view(made)
        if kind == "append":
            assert event is not None
            session = await service.get_session(app_name=APP, user_id=user, session_id=sid)
            if session is None:
                session = Session(id=sid, app_name=APP, user_id=user)
            mine = copy.deepcopy(event)
            await service.append_event(session, mine)
            return (_view(session), mine)
        if kind == "get":
            recent, after = argument
            config = GetSessionConfig(
                num_recent_events=recent, after_timestamp=None if after is None else base + after
            )
            return _view(
                await service.get_session(app_name=APP, user_id=user, session_id=sid, config=config)
            )
        if kind == "list":
            listed = await service.list_sessions(app_name=APP, user_id=user or None)
            return [_view(s) for s in listed.sessions]
        if kind == "delete":
            await service.delete_session(app_name=APP, user_id=user, session_id=sid)
            return None
        return await service.get_user_state(app_name=APP, user_id=user)
    except Exception as e:  # the same refusal, typed, on both sides
        return type(e).__name__


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(operations=OPERATIONS)
def test_answers_as_adks_in_memory_service(
    open_backend: BackendOpener, operations: list[tuple[str, str, str, Any]]
) -> None:
    async def run() -> None:
        reference = InMemorySessionService()
        async with ToubaSessionService(open_backend(f"ex{next(_namespaces)}")) as service:
            base = time.time() + 1_000
            for n, operation in enumerate(operations):
                event = None
                if operation[0] == "append":
                    event = Event(
                        author="agent",
                        invocation_id=f"inv{n}",
                        timestamp=base + n,
                        content=types.Content(role="model", parts=[types.Part(text=f"m{n}")]),
                        actions=EventActions(state_delta=operation[3]),
                    )
                expected = await _answer(reference, operation, event, base)
                assert await _answer(service, operation, event, base) == expected, operation

    asyncio.run(run())
