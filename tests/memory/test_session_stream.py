"""``ChatSession.stream``: a turn's events as they happen; a stopped stream stores no half turn.

Each way of stopping (leaving the ``async with``, ``break``, the consumer's task
cancelled) on SQLite and PostgreSQL memory stores: the turn is ``cancelled``, not
stored, the vendor's response closed, the session usable at once by ``send`` and
``stream``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests._providers import openai_sdk
from tests.memory._chat import Scripted, build_runtime, memory, open_store
from touba import ChatSession, DecisionCompleted, InvocationFinished, TextDelta, ToolCallStarted
from touba.errors import ConfigurationError
from touba.memory import ChatStream, MemoryStore
from touba.providers.openai import create_openai_decision_provider
from touba.runtime import MemoryCheckpointStore, Runtime
from touba.testing.fakes import (
    FakeOpenAIServer,
    StreamKnobs,
    openai_function_call,
    openai_text,
)

REPLY = "Your order A1 left the warehouse this morning and arrives tomorrow."
SLOW = StreamKnobs(event_delay=0.05)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, private_dir: Path) -> AsyncIterator[MemoryStore]:
    pg = request.getfixturevalue("pg_prefix") if request.param == "postgres" else None
    async with open_store(request.param, private_dir, pg) as opened:
        yield opened


@pytest.fixture
async def client(openai_server: FakeOpenAIServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_sdk(openai_server) as sdk:
        yield sdk


def _runtime(client: openai.AsyncOpenAI, **options: Any) -> Runtime:
    return build_runtime(
        create_openai_decision_provider(model="gpt-test", client=client), **options
    )


async def _history(session: ChatSession) -> list[tuple[str, tuple[str, ...]]]:
    turns = await session.store.recent_turns(session.session_id, 10)
    return [(t.user, t.replies) for t in turns]


async def test_a_streamed_turn_yields_the_runtimes_events_and_is_stored_as_send_stores_it(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI, store: MemoryStore
) -> None:
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    openai_server.script_response(openai_text(REPLY))
    async with ChatSession(_runtime(client), "support", "u-1", store=store) as session:
        async with session.stream("Where is A1?") as stream:
            events = [event async for event in stream]
        turn = stream.turn
        assert turn.status == "completed"
        assert turn.reply == REPLY
        texts = [e.text for e in events if isinstance(e, TextDelta)]
        assert len(texts) > 1
        assert "".join(texts) == REPLY
        assert [type(e).__name__ for e in events if not isinstance(e, TextDelta)] == [
            "DecisionCompleted",
            "ToolCallStarted",
            "ToolCallFinished",
            "DecisionCompleted",
            "InvocationFinished",
        ]
        assert events[-1] == InvocationFinished(turn.result)
        assert turn.stored is not None
        assert turn.stored.replies == (REPLY,)
        assert [c.name for g in turn.stored.trace for c in g] == ["lookup_order"]
        assert turn.stored.context is not None  # the record of what it was given
        # the next turn, sent, sees the streamed one as its memory
        openai_server.script_response(openai_text("You asked about A1."))
        second = await session.send("What did I ask?")
        assert second.stored is not None
        assert second.stored.index == 1
        assert REPLY in str(openai_server.requests_to("responses")[-1].body)
        assert await _history(session) == [
            ("Where is A1?", (REPLY,)),
            ("What did I ask?", ("You asked about A1.",)),
        ]


async def test_the_streamed_turns_context_record_is_the_one_send_stores(
    store: MemoryStore,
) -> None:
    sent, streamed = Scripted(), Scripted()
    for model in (sent, streamed):
        model.say("first")
        model.say("second")
    one = ChatSession(build_runtime(sent), "support", "u-1", store=store)
    other = ChatSession(build_runtime(streamed), "support", "u-2", store=store)
    async with one, other:
        await one.send("hello")
        plain = await one.send("again")
        await other.send("hello")
        async with other.stream("again") as stream:
            async for _event in stream:
                pass
    assert plain.stored is not None
    assert stream.turn.stored is not None
    assert plain.stored.context is not None
    assert stream.turn.stored.context is not None
    apart = {"conversation_key"}  # names this session's conversation: another session's
    assert {k: v for k, v in stream.turn.stored.context.items() if k not in apart} == {
        k: v for k, v in plain.stored.context.items() if k not in apart
    }
    assert (
        stream.turn.stored.context["conversation_key"] != plain.stored.context["conversation_key"]
    )


async def _until_text(stream: ChatStream) -> None:
    async for event in stream:
        if isinstance(event, TextDelta):
            return
    raise AssertionError("no text streamed")


async def _assert_cancelled_and_usable(
    session: ChatSession, stream: ChatStream, server: FakeOpenAIServer, left: float
) -> None:
    turn = stream.turn
    assert turn.status == "cancelled"
    assert turn.cancelled
    assert turn.stored is None
    assert turn.replies == ()
    record = server.wait_stream_end()
    assert record.outcome == "client_closed"
    assert record.closed_at is not None
    assert record.closed_at - left < 0.1
    assert await _history(session) == []  # no half turn
    meta = await session.store.get_session(session.session_id)
    assert meta is not None
    assert meta.turns == 0
    assert session.pending_checkpoint is None
    # usable at once: a send, then a stream
    server.script_response(openai_text("Here again."))
    after = await session.send("Still there?")
    assert "Where is A1?" not in str(server.requests_to("responses")[-1].body)  # not given
    assert after.status == "completed"
    assert after.stored is not None
    assert after.stored.index == 0
    server.script_response(openai_text("Yes."))
    async with session.stream("Sure?") as again:
        async for _event in again:
            pass
    assert again.turn.status == "completed"
    assert await _history(session) == [("Still there?", ("Here again.",)), ("Sure?", ("Yes.",))]


async def test_leaving_the_async_with_cancels_the_turn(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI, store: MemoryStore
) -> None:
    openai_server.script_response(openai_text(REPLY), stream=SLOW)
    async with ChatSession(_runtime(client), "support", "u-1", store=store) as session:
        async with session.stream("Where is A1?") as stream:
            await _until_text(stream)
        left = time.monotonic()
        await _assert_cancelled_and_usable(session, stream, openai_server, left)


async def test_breaking_out_of_the_events_cancels_the_turn(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI, store: MemoryStore
) -> None:
    openai_server.script_response(openai_text(REPLY), stream=SLOW)
    async with ChatSession(_runtime(client), "support", "u-1", store=store) as session:
        pieces = []
        async with session.stream("Where is A1?") as stream:
            async for event in stream:
                if isinstance(event, TextDelta):
                    pieces.append(event.text)
                    if len(pieces) == 2:
                        break
        left = time.monotonic()
        assert "".join(pieces) != REPLY
        await _assert_cancelled_and_usable(session, stream, openai_server, left)


async def test_cancelling_the_consumers_task_cancels_the_turn(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI, store: MemoryStore
) -> None:
    openai_server.script_response(openai_text(REPLY), stream=SLOW)
    async with ChatSession(_runtime(client), "support", "u-1", store=store) as session:
        seen = asyncio.Event()
        streams: list[ChatStream] = []

        async def consume() -> None:
            async with session.stream("Where is A1?") as stream:
                streams.append(stream)
                async for event in stream:
                    if isinstance(event, TextDelta):
                        seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        left = time.monotonic()
        await _assert_cancelled_and_usable(session, streams[0], openai_server, left)


async def test_a_stop_after_calls_ran_stores_nothing_and_runs_no_call_twice(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI, store: MemoryStore
) -> None:
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    openai_server.script_response(openai_text(REPLY), stream=SLOW)
    async with ChatSession(_runtime(client), "support", "u-1", store=store) as session:
        async with session.stream("Where is A1?") as stream:
            async for event in stream:
                if isinstance(event, TextDelta):
                    break
                if isinstance(event, ToolCallStarted):
                    assert event.name == "lookup_order"
        left = time.monotonic()
        await _assert_cancelled_and_usable(session, stream, openai_server, left)


async def test_a_stop_once_the_invocation_ended_is_too_late_the_turn_is_stored(
    store: MemoryStore,
) -> None:
    model = Scripted()
    model.say("done")
    async with ChatSession(build_runtime(model), "support", store=store) as session:
        async with session.stream("hi") as stream:
            async for event in stream:
                if isinstance(event, DecisionCompleted):
                    break  # InvocationFinished not read yet: the turn has ended anyway
        assert stream.turn.status == "completed"
        assert stream.turn.stored is not None
        assert await _history(session) == [("hi", ("done",))]


async def test_a_turn_awaiting_approval_streams_then_blocks_the_session_as_send_does(
    store: MemoryStore,
) -> None:
    model = Scripted()
    model.call("refund", order_id="A1")
    model.say("refunded")
    runtime = build_runtime(model, approval=True, checkpoints=MemoryCheckpointStore())
    async with ChatSession(runtime, "support", "u-1", store=store) as session:
        async with session.stream("refund A1") as stream:
            events = [event async for event in stream]
        assert [type(e).__name__ for e in events][-2:] == ["ApprovalRequired", "InvocationFinished"]
        assert stream.turn.status == "awaiting_approval"
        assert session.pending_checkpoint == stream.turn.result.checkpoint_id
        with pytest.raises(ConfigurationError, match="awaits approval"):
            async with session.stream("another"):
                pass
        done = await session.resume({stream.turn.result.pending[0].call_id: True})
        assert done.status == "completed"
        assert done.stored is not None


async def test_misuse_is_refused_before_anything_runs(store: MemoryStore) -> None:
    model = Scripted()
    model.say("one")
    async with ChatSession(
        build_runtime(model, config=memory()), "support", store=store
    ) as session:
        with pytest.raises(ConfigurationError, match="non-empty"):
            session.stream("  ")
        stream = session.stream("hi")
        with pytest.raises(ConfigurationError, match="enter the stream"):
            await stream.__anext__()
        with pytest.raises(ConfigurationError, match="not finished"):
            _ = stream.turn
        async with stream:
            async for _event in stream:
                pass
        with pytest.raises(ConfigurationError, match="only once"):
            async with stream:
                pass
        assert stream.turn.reply == "one"
        await session.end()
        with pytest.raises(ConfigurationError, match="has ended"):
            async with session.stream("hi again"):
                pass
        assert model.requests
        assert len(model.requests) == 1


async def test_a_model_that_does_not_stream_gives_its_plain_text_reply_whole(
    store: MemoryStore,
) -> None:
    model = Scripted()  # a function provider: no streaming wire
    model.call("lookup_order", order_id="A1")
    model.say("A1 has shipped.")
    session = ChatSession(build_runtime(model), "support", store=store)
    async with session, session.stream("Where is A1?") as stream:
        events = [event async for event in stream]
    texts = [e for e in events if isinstance(e, TextDelta)]
    assert [t.text for t in texts] == ["A1 has shipped."]  # one piece, before its decision
    assert events.index(texts[0]) < max(
        i for i, e in enumerate(events) if isinstance(e, DecisionCompleted)
    )
    assert stream.turn.reply == "A1 has shipped."


@pytest.mark.parametrize("durable", [False, True])
@pytest.mark.parametrize("stop", ["during the first decision", "after a call ran"])
async def test_a_cancelled_turns_decision_history_is_kept_only_for_its_checkpoint(
    openai_server: FakeOpenAIServer,
    client: openai.AsyncOpenAI,
    store: MemoryStore,
    private_dir: Path,
    durable: bool,
    stop: str,
) -> None:
    """The runtime keeps a checkpoint of a stopped turn once a call ran (in RAM or on
    disk): its resume needs the decision history, which stays. A turn stopped during its
    first decision keeps nothing: its history is deleted, as a stored turn's."""
    from touba.history import HistoryConfig, MemoryHistoryStore
    from touba.runtime import SqliteCheckpointStore

    history = MemoryHistoryStore()
    provider = create_openai_decision_provider(
        model="gpt-test", client=client, history=HistoryConfig(store=history, namespace="chat")
    )
    checkpoints = (
        SqliteCheckpointStore(filename=private_dir / "checkpoints.db")
        if durable
        else MemoryCheckpointStore()
    )
    called = stop == "after a call ran"
    if called:
        openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    openai_server.script_response(openai_text(REPLY), stream=SLOW)
    runtime = build_runtime(provider, checkpoints=checkpoints)
    try:
        async with ChatSession(runtime, "support", "u-1", store=store) as session:
            seen: list[str] = []
            async with session.stream("Where is A1?") as stream:
                async for event in stream:
                    if isinstance(event, TextDelta):
                        seen.append(event.invocation_id)
                        break
            turn = stream.turn
            assert turn.status == "cancelled"
            assert turn.stored is None
            assert [turn.result.invocation_id] == seen
            assert turn.result.trace.entries[-1].kind == "decision_cancelled"
            kept = await history.list("chat")
            if called:  # the checkpoint may be resumed: it needs the history
                assert turn.result.checkpoint_id is not None
                assert [c.key for c in kept] != []
            else:  # nothing can resume it: deleted, as a stored turn's
                assert turn.result.checkpoint_id is None
                assert kept == []
    finally:
        if isinstance(checkpoints, SqliteCheckpointStore):
            await checkpoints.close()


async def test_a_cancelled_turns_calls_are_journaled_and_resume_continues_exactly_once(
    openai_server: FakeOpenAIServer,
    client: openai.AsyncOpenAI,
    store: MemoryStore,
    private_dir: Path,
) -> None:
    """The runtime keeps a ``cancelled`` checkpoint of the stopped turn (a call ran): the
    turn's result names it, and ``resume(checkpoint_id=...)`` finishes that turn, running
    no call twice, and stores it."""
    from touba.runtime import Program, SqliteCheckpointStore

    ran: list[str] = []
    program = Program()

    @program.capability(permissions=("orders:read",))
    async def lookup_order(order_id: str) -> str:
        """Find an order."""
        ran.append(order_id)
        return "shipped"

    provider = create_openai_decision_provider(model="gpt-test", client=client)
    program.agent(
        "support",
        provider=provider,
        capabilities=("lookup_order",),
        grants=("orders:read",),
        memory=memory(),
    )
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    openai_server.script_response(openai_text(REPLY), stream=SLOW)
    openai_server.script_response(openai_text("A1 has shipped."))
    async with SqliteCheckpointStore(filename=private_dir / "checkpoints.db") as checkpoints:
        runtime = Runtime(program, checkpoints)
        async with ChatSession(runtime, "support", "u-1", store=store) as session:
            async with session.stream("Where is A1?") as stream:
                async for event in stream:
                    if isinstance(event, TextDelta):
                        break
            assert stream.turn.status == "cancelled"
            assert stream.turn.stored is None
            assert ran == ["A1"]
            [kept] = await checkpoints.list(run_id=session.session_id)
            assert kept.status == "cancelled"
            assert stream.turn.result.checkpoint_id == kept.checkpoint_id
            turn = await session.resume(checkpoint_id=kept.checkpoint_id)
            assert turn.status == "completed"
            assert turn.reply == "A1 has shipped."
            assert ran == ["A1"]  # not run again
            assert turn.stored is not None
            assert [[c.name for c in g] for g in turn.stored.trace] == [["lookup_order"]]
            assert await checkpoints.list(run_id=session.session_id) == []
