"""ToubaSessionService on PostgreSQL under a network that goes silent, cuts or lags (issue
29, item 2).

Through a loopback proxy (tests/_pg_deadlines.py), with ``deadline_seconds=1``: an
``append_event`` under a black hole fails with the retryable
``DecisionHistoryStoreUnavailable`` within the deadline + 1 s and stores nothing; once
the network is back the next append succeeds and every acknowledged event is there; an
append cut on its way is whole or absent; 50 ms of added round-trip time slows appends
without failing them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions
from google.genai import types

from tests._pg_deadlines import DEADLINE, Behind, behind_proxy, fails_in_time, timed_out
from touba.errors import ConfigurationError, DecisionHistoryStoreUnavailable
from touba.integrations.adk import ToubaSessionService

pytestmark = pytest.mark.postgres
APP = "app"


@pytest.fixture
def pg() -> Iterator[Behind]:
    with behind_proxy() as behind:
        yield behind


def service_of(pg: Behind, dsn: str | None = None) -> ToubaSessionService:
    return ToubaSessionService.postgres(
        dsn or pg.dsn, table_prefix=pg.table("adk"), deadline_seconds=DEADLINE
    )


def event(text: str, n: int) -> Event:
    return Event(
        author="agent",
        invocation_id="inv",
        content=types.Content(role="model", parts=[types.Part(text=text)]),
        actions=EventActions(state_delta={"n": n}),
    )


async def texts(pg: Behind, session_id: str) -> tuple[list[str], Any]:
    """The stored events' texts and state, read straight from the server."""
    async with service_of(pg, pg.direct) as direct:
        stored = await direct.get_session(app_name=APP, user_id="u", session_id=session_id)
    assert stored is not None
    found = [e.content.parts[0].text for e in stored.events if e.content and e.content.parts]
    return [text or "" for text in found], stored.state


def test_a_deadline_that_is_not_a_positive_number_is_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="deadline_seconds"):
        ToubaSessionService.postgres("postgresql://localhost/x", deadline_seconds=0)


async def test_an_append_under_a_black_hole_fails_typed_in_time_then_the_next_succeeds(
    pg: Behind,
) -> None:
    async with service_of(pg) as service:
        session = await service.create_session(app_name=APP, user_id="u", session_id="s")
        await service.append_event(session, event("one", 1))
        pg.proxy.black_hole()
        error = await fails_in_time(
            service.append_event(session, event("two", 2)), DecisionHistoryStoreUnavailable
        )
        assert timed_out(error)
        pg.proxy.restore()
        await service.append_event(session, event("three", 3))
    assert await texts(pg, "s") == (["one", "three"], {"n": 3})


async def test_an_append_cut_on_its_way_is_whole_or_absent(pg: Behind) -> None:
    async with service_of(pg) as service:
        session = await service.create_session(app_name=APP, user_id="u", session_id="s")
        appended, failures = [], 0
        for nth in range(1, 5):
            pg.proxy.cut_on(nth)
            try:
                await service.append_event(session, event(f"e{nth}", nth))
                appended.append(f"e{nth}")
            except DecisionHistoryStoreUnavailable:
                failures += 1
            pg.proxy.cut_on(0)
            assert (await texts(pg, "s"))[0] == appended
        assert failures >= 1
        await service.append_event(session, event("last", 9))


async def test_added_latency_slows_appends_without_failing_them(pg: Behind) -> None:
    async with service_of(pg) as service:
        session = await service.create_session(app_name=APP, user_id="u", session_id="s")
        pg.proxy.delay(50)
        for n in range(3):
            await service.append_event(session, event(f"e{n}", n))
    assert (await texts(pg, "s"))[0] == ["e0", "e1", "e2"]
