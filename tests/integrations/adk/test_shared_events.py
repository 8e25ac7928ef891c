"""``share_events=True``: whole reads reuse decoded events while their stored JSON is unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from google.adk.events.event import Event
from google.adk.sessions import Session
from google.adk.sessions.base_session_service import GetSessionConfig
from google.genai import types

from tests.integrations.adk.conftest import BackendOpener
from touba.errors import ConfigurationError
from touba.integrations.adk import ToubaSessionService
from touba.integrations.adk._events import SharedEvents, encode

APP = "app"


def text_event(text: str, **fields: Any) -> Event:
    return Event(
        author="agent",
        invocation_id="inv",
        content=types.Content(role="model", parts=[types.Part(text=text)]),
        **fields,
    )


async def whole(service: ToubaSessionService, session_id: str) -> Session:
    got = await service.get_session(app_name=APP, user_id="u", session_id=session_id)
    assert got is not None
    return got


def texts(session: Session) -> list[str | None]:
    return [
        e.content.parts[0].text if e.content and e.content.parts else None for e in session.events
    ]


async def test_the_default_hands_out_new_events_each_read(open_backend: BackendOpener) -> None:
    service = ToubaSessionService(open_backend())
    session = await service.create_session(app_name=APP, user_id="u", session_id="s")
    await service.append_event(session, text_event("a"))
    first, second = await whole(service, "s"), await whole(service, "s")
    assert first.events == second.events
    assert first.events[0] is not second.events[0]


async def test_shared_whole_reads_reuse_events_but_not_the_session_list_or_state(
    open_backend: BackendOpener,
) -> None:
    service = ToubaSessionService(open_backend(), share_events=True)
    session = await service.create_session(
        app_name=APP, user_id="u", session_id="s", state={"k": 1}
    )
    for text in ("a", "b"):
        await service.append_event(session, text_event(text))
    first, second = await whole(service, "s"), await whole(service, "s")
    assert [id(e) for e in first.events] == [id(e) for e in second.events]
    assert first is not second
    assert first.events is not second.events
    assert first.state is not second.state
    first.events.pop()
    first.state["k"] = 2
    third = await whole(service, "s")
    assert texts(third) == ["a", "b"]
    assert third.state["k"] == 1


async def test_a_new_event_is_decoded_and_the_others_reused(open_backend: BackendOpener) -> None:
    service = ToubaSessionService(open_backend(), share_events=True)
    session = await service.create_session(app_name=APP, user_id="u", session_id="s")
    await service.append_event(session, text_event("a"))
    before = await whole(service, "s")
    await service.append_event(before, text_event("b"))
    after = await whole(service, "s")
    assert texts(after) == ["a", "b"]
    assert after.events[0] is before.events[0]
    assert after.events[1] is not before.events[1]  # the appended object stays the caller's


async def test_an_event_stored_again_under_the_same_id_is_read_again(
    open_backend: BackendOpener,
) -> None:
    # another service (another process) deletes the session and writes it again, reusing
    # the event's id and timestamp: only the JSON text tells the two apart
    backend = open_backend()
    shared = ToubaSessionService(backend, share_events=True)
    other = ToubaSessionService(backend)
    session = await other.create_session(app_name=APP, user_id="u", session_id="s")
    await other.append_event(session, text_event("old", id="e1", timestamp=10.0))
    assert texts(await whole(shared, "s")) == ["old"]
    await other.delete_session(app_name=APP, user_id="u", session_id="s")
    session = await other.create_session(app_name=APP, user_id="u", session_id="s")
    await other.append_event(session, text_event("new", id="e1", timestamp=10.0))
    assert texts(await whole(shared, "s")) == ["new"]


async def test_a_recent_read_uses_kept_events_without_replacing_them(
    open_backend: BackendOpener,
) -> None:
    service = ToubaSessionService(open_backend(), share_events=True)
    session = await service.create_session(app_name=APP, user_id="u", session_id="s")
    for n in range(5):
        await service.append_event(session, text_event(f"e{n}", timestamp=float(n + 1)))
    full = await whole(service, "s")
    recent = await service.get_session(
        app_name=APP, user_id="u", session_id="s", config=GetSessionConfig(num_recent_events=2)
    )
    assert recent is not None
    assert recent.events == full.events[-2:]
    assert recent.events[0] is full.events[-2]
    again = await whole(service, "s")
    assert [id(e) for e in again.events] == [id(e) for e in full.events]


def test_the_kept_events_stay_within_their_character_budget() -> None:
    datas = {f"s{n}": encode(text_event("x" * 100, id=f"e{n}")) for n in range(4)}
    size = max(len(d) for d in datas.values())
    shared = SharedEvents(max_chars=2 * size)
    first = {
        key: shared.events(key, [(f"e{key[1:]}", data)], key, whole=True)[0]
        for key, data in datas.items()
    }
    # only the two most recent sessions are kept: s0 and s1 were dropped, in that order
    for key, data in datas.items():
        again = shared.events(key, [(f"e{key[1:]}", data)], key, whole=False)[0]
        assert (again is first[key]) == (key in ("s2", "s3"))
    # one character under s0 itself (the events' JSON lengths differ with their timestamps)
    big = SharedEvents(max_chars=len(datas["s0"]) - 1)
    one = big.events("s", [("e0", datas["s0"])], "s", whole=True)[0]
    assert big.events("s", [("e0", datas["s0"])], "s", whole=True)[0] is not one


def test_share_events_must_be_a_bool() -> None:
    with pytest.raises(ConfigurationError, match="share_events"):
        ToubaSessionService.memory(share_events=1)  # type: ignore[arg-type]
