"""ADK's ``Runner`` end to end on ``ToubaSessionService``, on every touba store.

The model is ADK's own ``Gemini`` class on a google-genai client pointed at touba's
fake Gemini server (loopback, the real wire format), so every request ADK builds from
the stored session is checked by the fake's validators: a tool loop, a tool that needs
the user's confirmation (the run pauses, the user confirms or rejects, the run
resumes), a streamed run (and one cut midway), ADK's compaction (with a confirmation
pending across it), two users with their own sessions and user/app state, two
``run_async`` at once on one session (without and with ``exclusive()``), and a store
reopened. Where ADK decides what is stored (compaction), the same conversation runs on
ADK's ``InMemorySessionService`` too and must come out the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest
from google import genai
from google.adk.agents import LlmAgent, RunConfig
from google.adk.agents.run_config import StreamingMode  # type: ignore[attr-defined]
from google.adk.apps.app import App, EventsCompactionConfig
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.events import Event
from google.adk.models import Gemini
from google.adk.runners import Runner
from google.adk.sessions import BaseSessionService, InMemorySessionService, Session
from google.adk.sessions.base_session_service import GetSessionConfig
from google.adk.tools.function_tool import FunctionTool
from google.adk.tools.tool_context import ToolContext
from google.genai import types

from tests.integrations.adk_runner.conftest import Store
from touba.errors import DecisionHistoryBusy, ToubaError
from touba.testing.fakes import (
    FakeGeminiServer,
    StreamKnobs,
    gemini_function_call,
    gemini_text,
)

APP = "shop"
CONFIRM = "adk_request_confirmation"

T = TypeVar("T")


def say(text: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=text)])


def confirm(call_id: str, confirmed: bool) -> types.Content:
    answer = types.FunctionResponse(id=call_id, name=CONFIRM, response={"confirmed": confirmed})
    return types.Content(role="user", parts=[types.Part(function_response=answer)])


class Shop:
    """The tools, recording what they were really called with."""

    def __init__(self) -> None:
        self.looked_up: list[str] = []
        self.refunded: list[str] = []

    def tools(self) -> list[Any]:
        def lookup_order(order_id: str, tool_context: ToolContext) -> dict[str, str]:
            """Look up an order."""
            self.looked_up.append(order_id)
            state = tool_context.state
            state["user:orders_seen"] = [*state.get("user:orders_seen", []), order_id]
            state["app:lookups"] = state.get("app:lookups", 0) + 1
            state["last_order"] = order_id
            state["temp:scratch"] = f"looking at {order_id}"
            return {"order_id": order_id, "status": "shipped"}

        def refund(order_id: str) -> dict[str, Any]:
            """Refund an order (asks the user first)."""
            self.refunded.append(order_id)
            return {"order_id": order_id, "refunded": True}

        return [lookup_order, FunctionTool(refund, require_confirmation=True)]


def make_runner(client: genai.Client, service: BaseSessionService, shop: Shop) -> Runner:
    agent = LlmAgent(
        name="support",
        model=Gemini(model="gemini-2.5-flash", client=client),
        instruction="Check orders; refund them when asked.",
        tools=shop.tools(),
    )
    return Runner(agent=agent, app_name=APP, session_service=service)


@pytest.fixture
def shop() -> Shop:
    return Shop()


@pytest.fixture
async def runner(gemini_client: genai.Client, service: Any, shop: Shop) -> AsyncIterator[Runner]:
    made = make_runner(gemini_client, service, shop)
    yield made
    await made.close()


async def run(
    runner: Runner,
    user_id: str,
    session_id: str,
    message: types.Content,
    config: RunConfig | None = None,
) -> list[Event]:
    events = runner.run_async(
        user_id=user_id, session_id=session_id, new_message=message, run_config=config
    )
    return [event async for event in events]


async def stored(service: BaseSessionService, user_id: str, session_id: str) -> Session:
    session = await service.get_session(app_name=APP, user_id=user_id, session_id=session_id)
    assert session is not None
    return session


def call_names(events: list[Event]) -> list[str]:
    return [call.name or "" for event in events for call in event.get_function_calls()]


def sent_contents(srv: FakeGeminiServer) -> list[Any]:
    """What the last generateContent request sent: its ``contents`` (validated by the fake)."""
    contents = srv.requests_to("generate_content")[-1].body["contents"]
    assert isinstance(contents, list)
    return contents


def parts_of(contents: list[Any], key: str) -> list[Any]:
    return [part[key] for content in contents for part in content["parts"] if key in part]


def user_texts(session: Session) -> list[str]:
    return [
        part.text
        for event in session.events
        if event.author == "user" and event.content and event.content.parts
        for part in event.content.parts
        if part.text
    ]


def lookup_loop(srv: FakeGeminiServer, orders: list[str], answer: str) -> None:
    for order in orders:
        srv.script_response(gemini_function_call("lookup_order", {"order_id": order}))
    srv.script_response(gemini_text(answer))


async def test_a_tool_loop_is_stored_as_it_ran(
    runner: Runner, service: Any, gemini_server: FakeGeminiServer, shop: Shop
) -> None:
    lookup_loop(gemini_server, ["A0", "A1", "A2"], "All three shipped.")
    session = await service.create_session(app_name=APP, user_id="u1")
    events = await run(runner, "u1", session.id, say("Check A0 to A2"))

    assert shop.looked_up == ["A0", "A1", "A2"]
    assert call_names(events) == ["lookup_order"] * 3
    assert events[-1].content is not None
    assert events[-1].content.parts
    assert events[-1].content.parts[0].text == "All three shipped."
    # the store holds the user's message and every event the run yielded, in order
    kept = await stored(service, "u1", session.id)
    assert kept.events[1:] == [event for event in events if not event.partial]
    assert user_texts(kept) == ["Check A0 to A2"]
    assert kept.state["last_order"] == "A2"
    assert kept.state["user:orders_seen"] == ["A0", "A1", "A2"]
    assert "temp:scratch" not in kept.state
    assert all("temp:scratch" not in e.actions.state_delta for e in kept.events)
    # each model request of the loop was built from what the service returned
    contents = sent_contents(gemini_server)
    assert [c["args"]["order_id"] for c in parts_of(contents, "functionCall")] == ["A0", "A1", "A2"]
    assert [r["response"]["order_id"] for r in parts_of(contents, "functionResponse")] == [
        "A0",
        "A1",
        "A2",
    ]
    assert len(gemini_server.requests_to("generate_content")) == 4

    # a second turn gets the whole history; the newest events alone read back as asked
    gemini_server.script_response(gemini_text("You're welcome."))
    await run(runner, "u1", session.id, say("Thanks"))
    assert len(sent_contents(gemini_server)) == len(contents) + 2  # the answer, the thanks
    kept = await stored(service, "u1", session.id)
    recent = await service.get_session(
        app_name=APP,
        user_id="u1",
        session_id=session.id,
        config=GetSessionConfig(num_recent_events=2),
    )
    assert recent is not None
    assert recent.events == kept.events[-2:]
    assert user_texts(recent) == ["Thanks"]


@pytest.mark.parametrize("confirmed", [True, False])
async def test_a_confirmation_pauses_the_run_until_the_user_answers(
    store: Store,
    service: Any,
    runner: Runner,
    gemini_client: genai.Client,
    gemini_server: FakeGeminiServer,
    shop: Shop,
    confirmed: bool,
) -> None:
    gemini_server.script_response(gemini_function_call("refund", {"order_id": "A1"}))
    gemini_server.script_response(gemini_text("Done." if confirmed else "Not refunded."))
    session = await service.create_session(app_name=APP, user_id="u1")
    paused = await run(runner, "u1", session.id, say("Refund A1"))

    # the run stops on ADK's confirmation request, the tool not run
    (request,) = [c for e in paused for c in e.get_function_calls() if c.name == CONFIRM]
    assert request.id is not None
    assert any(request.id in (e.long_running_tool_ids or ()) for e in paused)
    assert shop.refunded == []
    assert len(gemini_server.requests_to("generate_content")) == 1

    # the user answers later, to another runner on a service opened anew
    # (on a persistent store, a new service object on the same data)
    answering = store.open() if store.persistent else service
    later = make_runner(gemini_client, answering, shop)
    try:
        pending = await stored(answering, "u1", session.id)
        assert pending.events == (await stored(service, "u1", session.id)).events
        resumed = await run(later, "u1", session.id, confirm(request.id, confirmed))
    finally:
        await later.close()
        if answering is not service:
            await answering.close()

    assert shop.refunded == (["A1"] if confirmed else [])
    responses = [r for e in resumed for r in e.get_function_responses() if r.name == "refund"]
    assert len(responses) == 1
    assert responses[0].response is not None
    if confirmed:
        assert responses[0].response == {"order_id": "A1", "refunded": True}
    else:
        assert responses[0].response == {"error": "This tool call is rejected."}
    assert resumed[-1].content is not None
    assert resumed[-1].content.parts
    assert resumed[-1].content.parts[0].text == ("Done." if confirmed else "Not refunded.")
    # the model saw the call and the tool's real answer
    sent = parts_of(sent_contents(gemini_server), "functionResponse")
    assert sent[-1]["name"] == "refund"
    assert sent[-1]["response"] == responses[0].response
    kept = await stored(service, "u1", session.id)
    assert [e.id for e in kept.events][-len(resumed) :] == [e.id for e in resumed]
    assert kept.events[-len(resumed) :] == resumed


async def test_a_streamed_run_stores_whole_events_only(
    runner: Runner, service: Any, gemini_server: FakeGeminiServer, shop: Shop
) -> None:
    streaming = RunConfig(streaming_mode=StreamingMode.SSE)
    gemini_server.script_response(gemini_function_call("lookup_order", {"order_id": "A0"}))
    gemini_server.script_response(gemini_text("Order A0 has shipped, it left on Monday."))
    session = await service.create_session(app_name=APP, user_id="u1")
    events = await run(runner, "u1", session.id, say("A0?"), streaming)
    assert any(e.partial for e in events)  # the answer came in pieces
    whole = [e for e in events if not e.partial]
    kept = await stored(service, "u1", session.id)
    # as written: ADK's streaming gives ModelContent, which any JSON store reads back as the
    # Content it is a subclass of (pydantic's == tells the two classes apart)
    assert [e.model_dump() for e in kept.events[1:]] == [e.model_dump() for e in whole]
    assert whole[-1].content is not None
    assert whole[-1].content.parts
    assert whole[-1].content.parts[0].text == "Order A0 has shipped, it left on Monday."

    # a stream cut before its end: the run fails, and no piece of its answer is stored
    gemini_server.script_response(
        gemini_text("This answer never arrives whole."), stream=StreamKnobs(cut_after=2)
    )
    with pytest.raises(httpx.RemoteProtocolError):  # the SDK's error, as ADK raises it
        await run(runner, "u1", session.id, say("And A1?"), streaming)
    after = await stored(service, "u1", session.id)
    assert after.events[: len(kept.events)] == kept.events
    added = after.events[len(kept.events) :]
    assert user_texts(after)[-1] == "And A1?"
    assert added[0].author == "user"
    assert not any(e.partial for e in added)
    assert not any(e.content and e.content.parts for e in added[1:])  # no half answer
    assert all(e.error_code for e in added[1:])  # the failure, as ADK records it
    assert shop.looked_up == ["A0"]


async def on_adks_service(
    conversation: Callable[[BaseSessionService, genai.Client, FakeGeminiServer], Awaitable[T]],
) -> T:
    """``conversation`` run on ADK's InMemorySessionService, with a model server of its own."""
    with FakeGeminiServer() as reference_server:
        reference_client = genai.Client(
            api_key="sk-test", http_options=types.HttpOptions(base_url=reference_server.base_url)
        )
        try:
            return await conversation(InMemorySessionService(), reference_client, reference_server)
        finally:
            await reference_client.aio.aclose()


def compacted_view(session: Session) -> list[tuple[Any, ...]]:
    """A session's events as the model will see them: authors, texts, compactions."""
    view: list[tuple[Any, ...]] = []
    for event in session.events:
        compaction = event.actions.compaction
        summary = compaction.compacted_content if compaction is not None else event.content
        texts = [p.text for p in (summary.parts or []) if p.text] if summary else []
        view.append((event.author, compaction is not None, texts))
    return view


@pytest.mark.filterwarnings("ignore:.*EventsCompactionConfig.*:UserWarning")
async def test_compaction_summaries_are_stored_and_sent_as_with_adks_service(
    service: Any, gemini_client: genai.Client, gemini_server: FakeGeminiServer
) -> None:
    """ADK's sliding-window compaction (its summaries are events of their own) on the
    store, turn for turn as on ADK's InMemorySessionService."""

    async def conversation(
        sessions: BaseSessionService, client: genai.Client, srv: FakeGeminiServer
    ) -> tuple[list[tuple[Any, ...]], list[Any]]:
        agent = LlmAgent(name="support", model=Gemini(model="gemini-2.5-flash", client=client))
        config = EventsCompactionConfig(compaction_interval=2, overlap_size=1)
        app = App(name=APP, root_agent=agent, events_compaction_config=config)
        session = await sessions.create_session(app_name=APP, user_id="u1")
        async with Runner(app=app, session_service=sessions) as runner:
            for n in range(5):
                srv.script_response(gemini_text(f"answer {n}"))
                if n % 2 == 1:  # every second turn, ADK asks the model for a summary
                    srv.script_response(gemini_text(f"summary up to {n}"))
                await run(runner, "u1", session.id, say(f"question {n}"))
        kept = await stored(sessions, "u1", session.id)
        return compacted_view(kept), sent_contents(srv)

    expected = await on_adks_service(conversation)
    got = await conversation(service, gemini_client, gemini_server)
    assert got == expected
    view, last_request = got
    assert [c for c in view if c[1]] == [
        ("user", True, ["summary up to 1"]),
        ("user", True, ["summary up to 3"]),
    ]
    sent = parts_of(last_request, "text")
    assert sent[-1] == "question 4"
    assert "summary up to 3" in " ".join(sent)
    assert "question 0" not in " ".join(sent)  # compacted away from the request, kept stored
    assert ("user", False, ["question 0"]) in view


@pytest.mark.filterwarnings("ignore:.*EventsCompactionConfig.*:UserWarning")
async def test_a_pending_confirmation_survives_compaction_as_with_adks_service(
    service: Any, gemini_client: genai.Client, gemini_server: FakeGeminiServer
) -> None:
    """Compaction after every turn while a tool waits for the user's confirmation
    (adk-python #4740): the paused call is still there to confirm, on the store as on
    ADK's InMemorySessionService."""

    async def conversation(
        sessions: BaseSessionService, client: genai.Client, srv: FakeGeminiServer
    ) -> tuple[list[str], list[tuple[Any, ...]], list[str]]:
        shop = Shop()
        agent = LlmAgent(
            name="support",
            model=Gemini(model="gemini-2.5-flash", client=client),
            tools=shop.tools(),
        )
        config = EventsCompactionConfig(compaction_interval=1, overlap_size=0)
        app = App(name=APP, root_agent=agent, events_compaction_config=config)
        session = await sessions.create_session(app_name=APP, user_id="u1")
        async with Runner(app=app, session_service=sessions) as runner:
            srv.script_response(gemini_text("Hello."))
            srv.script_response(gemini_text("summary of the greeting"))
            await run(runner, "u1", session.id, say("Hi"))
            srv.script_response(gemini_function_call("refund", {"order_id": "A1"}))
            paused = await run(runner, "u1", session.id, say("Refund A1"))
            (request,) = [c for e in paused for c in e.get_function_calls() if c.name == CONFIRM]
            assert request.id is not None
            srv.script_response(gemini_text("Refunded."))
            srv.script_response(gemini_text("summary of the refund"))
            resumed = await run(runner, "u1", session.id, confirm(request.id, True))
        kept = await stored(sessions, "u1", session.id)
        answers = [p.text for e in resumed if e.content for p in e.content.parts or [] if p.text]
        return shop.refunded, compacted_view(kept), answers

    expected = await on_adks_service(conversation)
    got = await conversation(service, gemini_client, gemini_server)
    assert got == expected
    refunded, view, answers = got
    assert refunded == ["A1"]
    assert answers == ["Refunded."]
    assert [c[2] for c in view if c[1]] == [["summary of the greeting"], ["summary of the refund"]]


async def test_two_users_have_their_own_sessions_and_user_state(
    runner: Runner, service: Any, gemini_server: FakeGeminiServer
) -> None:
    await service.create_session(app_name=APP, user_id="u1", session_id="s1")
    with pytest.raises(AlreadyExistsError):
        await service.create_session(app_name=APP, user_id="u1", session_id="s1")
    await service.create_session(app_name=APP, user_id="u1", session_id="s2")
    await service.create_session(app_name=APP, user_id="u2", session_id="s1")  # same id, other user

    turns = [("u1", "s1", ["A1", "A2"]), ("u2", "s1", ["B1"]), ("u1", "s2", ["A3"])]
    for user_id, session_id, orders in turns:
        lookup_loop(gemini_server, orders, f"checked {orders}")
        await run(runner, user_id, session_id, say(f"check {orders}"))

    u1_s1, u1_s2 = await stored(service, "u1", "s1"), await stored(service, "u1", "s2")
    u2_s1 = await stored(service, "u2", "s1")
    # user: state is shared by one user's sessions, and only theirs
    assert u1_s1.state["user:orders_seen"] == ["A1", "A2", "A3"]
    assert u1_s2.state["user:orders_seen"] == ["A1", "A2", "A3"]
    assert u2_s1.state["user:orders_seen"] == ["B1"]
    assert await service.get_user_state(app_name=APP, user_id="u2") == {"orders_seen": ["B1"]}
    # app: state by every user of the app; unprefixed state by its session only
    assert {s.state["app:lookups"] for s in (u1_s1, u1_s2, u2_s1)} == {4}
    assert (u1_s1.state["last_order"], u1_s2.state["last_order"]) == ("A2", "A3")
    assert u2_s1.state["last_order"] == "B1"
    # each session holds its own conversation
    assert user_texts(u1_s1) == ["check ['A1', 'A2']"]
    assert user_texts(u2_s1) == ["check ['B1']"]
    assert user_texts(u1_s2) == ["check ['A3']"]
    # the last model request (u1's s2) carried none of the other sessions' events
    orders = [c["args"]["order_id"] for c in parts_of(sent_contents(gemini_server), "functionCall")]
    assert orders == ["A3"]

    listed = await service.list_sessions(app_name=APP, user_id="u1")
    assert [s.id for s in listed.sessions] == ["s1", "s2"]  # least recently updated first
    assert all(s.events == [] for s in listed.sessions)
    everyone = await service.list_sessions(app_name=APP, user_id=None)
    assert sorted((s.user_id, s.id) for s in everyone.sessions) == [
        ("u1", "s1"),
        ("u1", "s2"),
        ("u2", "s1"),
    ]
    await service.delete_session(app_name=APP, user_id="u2", session_id="s1")
    assert await service.get_session(app_name=APP, user_id="u2", session_id="s1") is None
    assert (await stored(service, "u1", "s1")).events == u1_s1.events


async def test_two_runs_at_once_on_one_session_never_corrupt_it(
    store: Store,
    runner: Runner,
    service: Any,
    gemini_server: FakeGeminiServer,
) -> None:
    # each answer waits, so both runs are in flight together
    gemini_server.script_response(gemini_text("first answer"), delay=1.0)
    gemini_server.script_response(gemini_text("second answer"), delay=1.0)
    session = await service.create_session(app_name=APP, user_id="u1")

    async def attempt(text: str) -> list[Event] | BaseException:
        try:
            return await run(runner, "u1", session.id, say(text))
        except (ToubaError, ValueError) as e:  # StaleSessionError is a ValueError
            return e

    outcomes = await asyncio.gather(attempt("one"), attempt("two"))
    finished = [o for o in outcomes if isinstance(o, list)]
    refused = [o for o in outcomes if not isinstance(o, list)]
    # both in flight together: the one behind is refused (ADK's in-memory service lets both
    # land, interleaved)
    assert len(finished) == 1, refused
    assert len(refused) == 1
    for error in refused:  # refused cleanly: a typed error, never a wrong answer
        assert type(error).__name__ in {"StaleSessionError", "DecisionHistoryBusy"}, error

    kept = await stored(service, "u1", session.id)
    ids = [e.id for e in kept.events]
    assert len(ids) == len(set(ids))
    # every event a finished run yielded is stored, in the order it was yielded
    for events in finished:
        mine = [e for e in kept.events if e.id in {y.id for y in events}]
        assert mine == [e for e in events if not e.partial]
    # nothing else but the runs' user messages
    yielded = {e.id for events in finished for e in events}
    others = [e for e in kept.events if e.id not in yielded]
    assert all(e.author == "user" for e in others)
    assert sorted(user_texts(kept)) in (["one"], ["two"], ["one", "two"])
    timestamps = [e.timestamp for e in kept.events]
    assert timestamps == sorted(timestamps)  # events read back in the order they happened

    # the session reads back whole from a service opened anew, and takes the next turn
    again = store.open() if store.persistent else service
    try:
        assert (await stored(again, "u1", session.id)).events == kept.events
    finally:
        if again is not service:
            await again.close()
    # a refused run may have been refused before its model call, its answer still queued
    answered = len(gemini_server.requests_to("generate_content"))
    gemini_server.script_response(gemini_text("third answer"))
    third = await run(runner, "u1", session.id, say("three"))
    assert third[-1].content is not None
    assert third[-1].content.parts
    assert (
        third[-1].content.parts[0].text
        == ["first answer", "second answer", "third answer"][answered]
    )
    assert (await stored(service, "u1", session.id)).events[len(kept.events) :][1:] == third


async def test_a_run_held_with_exclusive_refuses_another_before_its_model_call(
    store: Store,
    runner: Runner,
    service: Any,
    gemini_client: genai.Client,
    gemini_server: FakeGeminiServer,
    shop: Shop,
) -> None:
    gemini_server.script_response(gemini_text("first answer"), delay=0.3)
    gemini_server.script_response(gemini_text("second answer"))
    session = await service.create_session(app_name=APP, user_id="u1")
    # the second run comes through another service on the same store (another process)
    other = store.open() if store.persistent else service
    other_runner = make_runner(gemini_client, other, shop)
    holding = asyncio.Event()

    async def first() -> list[Event]:
        async with service.exclusive(app_name=APP, user_id="u1", session_id=session.id):
            holding.set()
            return await run(runner, "u1", session.id, say("one"))

    async def second() -> BaseException | None:
        await holding.wait()
        try:
            await run(other_runner, "u1", session.id, say("two"))
        except DecisionHistoryBusy as e:
            return e
        return None

    try:
        done, refused = await asyncio.gather(first(), second())
        assert isinstance(refused, DecisionHistoryBusy), refused
        assert len(gemini_server.requests_to("generate_content")) == 1  # before its model call
        kept = await stored(other, "u1", session.id)
        assert user_texts(kept) == ["one"]  # nothing of the refused run stored
        assert kept.events[1:] == done
        # the block over, the second run goes on from the first
        later = await run(other_runner, "u1", session.id, say("two"))
        assert parts_of(sent_contents(gemini_server), "text") == ["one", "first answer", "two"]
        assert (await stored(service, "u1", session.id)).events[len(kept.events) + 1 :] == later
    finally:
        await other_runner.close()
        if other is not service:
            await other.close()


async def test_a_reopened_store_holds_the_same_session(
    persistent_store: Store,
    gemini_client: genai.Client,
    gemini_server: FakeGeminiServer,
    shop: Shop,
) -> None:
    first = persistent_store.open()
    runner = make_runner(gemini_client, first, shop)
    try:
        session = await first.create_session(app_name=APP, user_id="u1", state={"tier": "gold"})
        lookup_loop(gemini_server, ["A0", "A1"], "Both shipped.")
        await run(runner, "u1", session.id, say("Check A0 and A1"))
        before = await stored(first, "u1", session.id)
    finally:
        await runner.close()
        await first.close()

    second = persistent_store.open()
    runner = make_runner(gemini_client, second, shop)
    try:
        after = await stored(second, "u1", session.id)
        assert after == before
        assert after.state["tier"] == "gold"
        assert after.state["user:orders_seen"] == ["A0", "A1"]
        listed = await second.list_sessions(app_name=APP, user_id="u1")
        assert [(s.id, s.last_update_time) for s in listed.sessions] == [
            (session.id, before.last_update_time)
        ]
        # the conversation goes on where it was: the model is sent the stored history
        gemini_server.script_response(gemini_text("You're welcome."))
        more = await run(runner, "u1", session.id, say("Thanks"))
        contents = sent_contents(gemini_server)
        calls = parts_of(contents, "functionCall")
        assert [c["args"]["order_id"] for c in calls] == ["A0", "A1"]
        assert parts_of(contents, "text")[-1] == "Thanks"
        kept = await stored(second, "u1", session.id)
        assert kept.events[: len(before.events)] == before.events
        assert user_texts(kept) == ["Check A0 and A1", "Thanks"]
        assert kept.events[len(before.events) + 1 :] == more
    finally:
        await runner.close()
        await second.close()
