"""Fork and rewind of chat sessions, on SQLite and PostgreSQL memory stores.

The store's primitives (``fork_session``, ``rewind_session``) at every turn of
hypothesis-generated sessions whose turns hold tool loops (several calls per
decision, several decisions per turn): a fork holds turns 1..k whole, the original
reads the same before and after; a rewind keeps turns 1..k whole and the next turn
is k + 1. Then ``ChatSession.fork`` / ``rewind`` over the runtime with the scripted
model: the next turn of a fork (or of a rewound session) is sent the kept turns,
and only them; a rewind is refused while a turn runs or awaits approval.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.memory._chat import Scripted, build_runtime, memory, open_store
from tests.memory.conftest import MakeStore
from touba import ChatSession
from touba.errors import ConfigurationError
from touba.memory import KeyEventService, StoredTurn, owner_for
from touba.memory._sql import SqlMemoryStore
from touba.providers._types import TraceCall
from touba.runtime import MemoryCheckpointStore

# -- the store's primitives ------------------------------------------------------------------

CALLS = st.builds(
    TraceCall,
    call_id=st.uuids().map(str),
    name=st.sampled_from(["lookup_order", "refund"]),
    arguments=st.fixed_dictionaries({"order_id": st.text(max_size=5)}),
    status=st.sampled_from(["ok", "error", "denied"]),
    result=st.none() | st.text(max_size=8) | st.lists(st.integers(), max_size=3),
    error=st.none() | st.text(max_size=8),
)
TURNS = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=12),
        st.lists(st.text(max_size=10), max_size=3),
        st.lists(st.lists(CALLS, min_size=1, max_size=3), max_size=3),  # decisions' calls
        st.none() | st.fixed_dictionaries({"turns_sent": st.integers(0, 30)}),
    ),
    min_size=1,
    max_size=6,
)


def _whole(turn: StoredTurn) -> tuple[Any, ...]:
    """A turn without the session it belongs to."""
    return (
        turn.index,
        turn.user,
        turn.replies,
        turn.trace,
        turn.invocation_id,
        turn.created_at,
        turn.context,
    )


async def _state(store: SqlMemoryStore, session_id: str) -> tuple[Any, ...]:
    """Everything a store shows of one session."""
    return (
        await store.get_session(session_id),
        await store.list_turns(session_id, limit=1000),
    )


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(turns=TURNS)
async def test_fork_and_rewind_at_every_turn_keep_whole_turns(
    store: SqlMemoryStore, turns: list[Any]
) -> None:
    session = f"s-{uuid.uuid4().hex}"
    await store.open_session(session, owner="user:u", agent_ref="support", mode="live")
    for number, (user, replies, trace, context) in enumerate(turns):
        await store.append_turn(
            session,
            user=user,
            replies=replies,
            trace=trace,
            invocation_id=f"inv-{number}",
            context=context,
        )
    before = await _state(store, session)
    original = before[1]
    for k in range(-1, len(turns) + 2):
        copy = f"{session}-fork-{k}"
        if not 1 <= k <= len(turns):
            with pytest.raises(ConfigurationError, match="at_turn"):
                await store.fork_session(session, copy, at_turn=k, owner="user:u")
            assert await store.get_session(copy) is None
            continue
        meta = await store.fork_session(session, copy, at_turn=k, owner="user:u")
        assert (meta.session_id, meta.owner, meta.agent_ref, meta.mode) == (
            copy,
            "user:u",
            "support",
            "live",
        )
        assert (meta.turns, meta.ended_at) == (k, None)
        forked = await store.list_turns(copy, limit=1000)
        assert [_whole(t) for t in forked] == [_whole(t) for t in original[:k]]
        assert all(t.session_id == copy for t in forked)
        assert await _state(store, session) == before  # the original, unchanged

        # a rewind of the copy at every turn up to k
        held = k
        for kept in range(k, -1, -1):
            assert await store.rewind_session(copy, to_turn=kept) == held - kept
            left = await store.list_turns(copy, limit=1000)
            assert [_whole(t) for t in left] == [_whole(t) for t in original[:kept]]
            assert (await store.get_session(copy)).turns == kept  # type: ignore[union-attr]
            held = kept
        added = await store.append_turn(copy, user="again", replies=["ok"])
        assert added.index == 0
        assert await _state(store, session) == before


async def test_rewind_keeps_the_first_turns_and_numbers_the_next(store: SqlMemoryStore) -> None:
    await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
    for n in range(4):
        await store.append_turn("s", user=f"q{n}", replies=[f"a{n}"])
    assert await store.rewind_session("s", to_turn=4) == 0
    assert await store.rewind_session("s", to_turn=2) == 2
    assert [t.user for t in await store.recent_turns("s", 10)] == ["q0", "q1"]
    turn = await store.append_turn("s", user="q2 again", replies=[])
    assert turn.index == 2
    for wrong in (-1, 4, True, 1.5, "1"):
        with pytest.raises(ConfigurationError):
            await store.rewind_session("s", to_turn=wrong)  # type: ignore[arg-type]
    assert [t.user for t in await store.recent_turns("s", 10)] == ["q0", "q1", "q2 again"]
    with pytest.raises(ConfigurationError, match="never opened"):
        await store.rewind_session("absent", to_turn=0)
    await store.end_session("s")
    with pytest.raises(ConfigurationError, match="has ended"):
        await store.rewind_session("s", to_turn=1)
    assert len(await store.recent_turns("s", 10)) == 3


async def test_fork_refusals_write_nothing(make_store: MakeStore) -> None:
    store = make_store()
    await store.open_session("s", owner="user:u", agent_ref="a", mode="preview")
    await store.append_turn("s", user="q", replies=["a"])
    await store.open_session("taken", owner="user:u", agent_ref="a", mode="live")
    with pytest.raises(ConfigurationError, match="already exists"):
        await store.fork_session("s", "taken", at_turn=1, owner="user:u")
    assert await store.list_turns("taken") == ()
    with pytest.raises(ConfigurationError, match="never opened"):
        await store.fork_session("absent", "new", at_turn=1, owner="user:u")
    for name, value in (("new_session_id", ""), ("owner", " ")):
        arguments = {"new_session_id": "new", "owner": "user:u", name: value}
        with pytest.raises(ConfigurationError, match=name):
            await store.fork_session("s", at_turn=1, **arguments)
    assert await store.get_session("new") is None
    await store.end_session("s")
    meta = await store.fork_session("s", "new", at_turn=1, owner="user:u")  # an ended one forks
    assert (meta.mode, meta.ended_at, meta.turns) == ("preview", None, 1)
    reopened = make_store()  # another connection sees the committed copy
    assert [t.user for t in await reopened.recent_turns("new", 5)] == ["q"]


# -- ChatSession over the runtime ----------------------------------------------------------------

# Each turn: the decisions' parallel calls (order ids), then a final answer.
CHAT = st.lists(
    st.lists(st.lists(st.sampled_from(["A1", "B2", "C3"]), min_size=1, max_size=3), max_size=2),
    min_size=1,
    max_size=4,
)


def _script(model: Scripted, decisions: list[list[str]], answer: str) -> None:
    for orders in decisions:
        model.calls(*(("lookup_order", {"order_id": order}) for order in orders))
    model.say(answer)


def _sent(model: Scripted) -> list[tuple[str, tuple[str, ...], Any]]:
    """The earlier turns the last request carried: user, replies and whole trace."""
    return [(t.user, t.replies, t.trace) for t in model.requests[-1].prior_turns]


def _kept(turns: tuple[StoredTurn, ...]) -> list[tuple[str, tuple[str, ...], Any]]:
    return [(t.user, t.replies, t.trace) for t in turns]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(chat=CHAT)
async def test_a_fork_continues_with_the_kept_turns_only(
    backend: str, request: pytest.FixtureRequest, private_dir: Path, chat: list[Any]
) -> None:
    pg = request.getfixturevalue("pg_prefix") if backend == "postgres" else None
    model = Scripted()
    # every earlier turn sent with its whole trace
    runtime = build_runtime(model, config=memory(short_term_turns=30, full_context_turns=5))
    async with open_store(backend, private_dir, pg) as store:
        original = ChatSession(runtime, "support", "u-1", f"s-{uuid.uuid4().hex}", store=store)
        async with original:
            for number, decisions in enumerate(chat):
                _script(model, decisions, f"answer {number}")
                await original.send(f"question {number}")
            stored = await store.list_turns(original.session_id, limit=100)
            before = (await store.get_session(original.session_id), stored)
            for k in range(1, len(chat) + 1):
                async with await original.fork(k) as fork:
                    assert fork.session_id != original.session_id
                    assert (fork.owner, fork.agent, fork.mode) == ("user:u-1", "support", "live")
                    model.say("continued")
                    turn = await fork.send("and now?")
                    assert turn.stored is not None
                    assert turn.stored.index == k
                    assert _sent(model) == _kept(stored[:k])
                    # a rewind of the fork at every earlier turn: the next turn sees those
                    for kept in range(k, -1, -1):
                        await fork.rewind(kept)
                        model.say("again")
                        turn = await fork.send("once more")
                        assert turn.stored is not None
                        assert turn.stored.index == kept
                        assert _sent(model) == _kept(stored[:kept])
                        await fork.rewind(kept)
                after = await store.list_turns(original.session_id, limit=100)
                assert (await store.get_session(original.session_id), after) == before


async def test_an_anonymous_session_forks_into_an_anonymous_session(
    private_dir: Path,
) -> None:
    model = Scripted()
    runtime = build_runtime(model)
    async with (
        open_store("sqlite", private_dir) as store,
        ChatSession(runtime, "support", None, "anon", store=store) as session,
    ):
        model.say("hello")
        await session.send("hi")
        fork = await session.fork(1, session_id="anon-2")
        async with fork:
            assert fork.owner == owner_for(None, "anon-2")
            meta = await store.get_session("anon-2")
            assert meta is not None
            assert meta.owner == "session:anon-2"
        # reopened as any anonymous session is
        async with ChatSession(runtime, "support", None, "anon-2", store=store) as again:
            model.say("still here")
            turn = await again.send("hello again")
            assert turn.stored is not None
            assert turn.stored.index == 1
        with pytest.raises(ConfigurationError, match="already exists"):
            await session.fork(1, session_id="anon-2")


async def test_key_events_are_neither_forked_nor_rewound(private_dir: Path) -> None:
    model = Scripted()
    runtime = build_runtime(model)
    async with (
        open_store("sqlite", private_dir) as store,
        ChatSession(runtime, "support", "u-9", "s", store=store) as session,
    ):
        model.say("noted")
        await session.send("my order A1 is late")
        events = KeyEventService(store, memory().key_events)
        await events.create("user:u-9", "refund", "Refund A1", "late", session_id="s")
        model.say("ok")
        await session.send("thanks")
        async with await session.fork(1) as fork:
            model.say("forked")
            await fork.send("hello")
            assert "Refund A1" in (model.requests[-1].instructions or "")
        await session.rewind(0)
        assert [e.title for e in await store.query_events("user:u-9")] == ["Refund A1"]


async def test_a_rewind_is_refused_while_a_turn_awaits_approval(private_dir: Path) -> None:
    model = Scripted()
    checkpoints = MemoryCheckpointStore()
    runtime = build_runtime(model, approval=True, checkpoints=checkpoints)
    async with (
        open_store("sqlite", private_dir) as store,
        ChatSession(runtime, "support", "u", "s", store=store) as session,
    ):
        model.say("hi")
        await session.send("hello")
        model.call("refund", order_id="A1")
        paused = await session.send("refund A1")
        assert paused.status == "awaiting_approval"
        with pytest.raises(ConfigurationError, match="awaits approval"):
            await session.rewind(0)
        # another process's object sees the checkpoint in the runtime's store
        async with ChatSession(runtime, "support", "u", "s", store=store) as other:
            with pytest.raises(ConfigurationError, match="checkpoint"):
                await other.rewind(0)
        # a fork of the stored turns is allowed: the paused turn is not copied
        async with await session.fork(1) as fork:
            assert [t.user for t in await store.recent_turns(fork.session_id, 5)] == ["hello"]
        model.say("refunded")
        done = await session.resume({paused.result.pending[0].call_id: True})
        assert done.status == "completed"
        assert await session.rewind(1) == 1
        assert [t.user for t in await store.recent_turns("s", 5)] == ["hello"]


async def test_a_rewind_is_refused_while_a_turn_runs_and_when_closed(private_dir: Path) -> None:
    model = Scripted()
    runtime = build_runtime(model)
    async with open_store("sqlite", private_dir) as store:
        session = ChatSession(runtime, "support", "u", "s", store=store)
        async with session:
            model.say("one")
            await session.send("first")
            model.say("two")
            async with session.stream("second") as stream:
                with pytest.raises(ConfigurationError, match="is running"):
                    await session.rewind(0)
                async for _event in stream:
                    pass
            assert [t.user for t in await store.recent_turns("s", 5)] == ["first", "second"]
            with pytest.raises(ConfigurationError, match="out of range"):
                await session.rewind(3)
            with pytest.raises(ConfigurationError, match="out of range"):
                await session.fork(3)
        with pytest.raises(ConfigurationError, match="closed"):
            await session.rewind(0)
        with pytest.raises(ConfigurationError, match="closed"):
            await session.fork(1)
        async with ChatSession(runtime, "support", "u", "s", store=store) as again:
            await again.end()
            with pytest.raises(ConfigurationError, match="has ended"):
                await again.rewind(0)
            async with await again.fork(2) as fork:  # an ended session still forks
                meta = await store.get_session(fork.session_id)
                assert meta is not None
                assert meta.turns == 2
