"""ChatSession end to end: turns over the runtime, memory, key events, approvals, extraction."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.memory._chat import (
    BACKENDS,
    INSTRUCTIONS,
    Scripted,
    build_runtime,
    memory,
    open_model,
    open_store,
)
from touba import ChatSession
from touba.errors import ConfigurationError
from touba.memory import (
    ChatTurn,
    ExtractionJob,
    ExtractionQueue,
    ExtractionWorker,
    KeyEventService,
    MemoryStore,
    StoredTurn,
    owner_for,
    parse_ops,
)
from touba.memory._key_events import TOOL_NAMES
from touba.runtime import MemoryCheckpointStore, Program, Runtime


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, private_dir: Path) -> AsyncIterator[MemoryStore]:
    """A real-clock store (background retries wait real time), on both backends."""
    pg = request.getfixturevalue("pg_prefix") if request.param == "postgres" else None
    async with open_store(request.param, private_dir, pg) as opened:
        yield opened


@pytest.fixture
async def sqlite_store(private_dir: Path) -> AsyncIterator[MemoryStore]:
    async with open_store("sqlite", private_dir) as opened:
        yield opened


@pytest.fixture
def model() -> Scripted:
    return Scripted()


async def eventually(condition: Callable[[], bool], seconds: float = 2.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition did not become true in time")


def fast_queue(store: MemoryStore, **options: Any) -> ExtractionQueue:
    return ExtractionQueue(store, base_delay_seconds=0.01, max_delay_seconds=0.05, **options)


# -- turns -----------------------------------------------------------------------------------


async def test_a_turn_is_one_invocation_stored_with_its_replies_and_trace(
    model: Scripted, store: MemoryStore
) -> None:
    model.call("lookup_order", order_id="A1")
    model.say("A1 has shipped.")
    session = ChatSession(build_runtime(model), "support", "u-42", "s-1", store=store)
    turn = await session.send("Where is A1?")
    assert isinstance(turn, ChatTurn)
    assert (turn.status, turn.reply, turn.replies) == ("completed", "A1 has shipped.", turn.replies)
    assert turn.result.output == "A1 has shipped."
    assert turn.result.run_id == "s-1"
    stored = turn.stored
    assert isinstance(stored, StoredTurn)
    assert (stored.index, stored.user, stored.replies) == (0, "Where is A1?", ("A1 has shipped.",))
    [[call]] = stored.trace
    assert (call.name, call.arguments, call.status) == ("lookup_order", {"order_id": "A1"}, "ok")
    assert call.result == {"order_id": "A1", "status": "shipped"}
    assert stored.invocation_id == turn.result.invocation_id
    assert await store.recent_turns("s-1", 10) == (stored,)
    first = model.requests[0]
    assert (first.input, first.prior_turns, first.instructions) == (
        "Where is A1?",
        (),
        INSTRUCTIONS,
    )
    await session.close()


async def test_prior_turns_follow_short_term_and_full_context_without_cutting_a_turn(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    runtime = build_runtime(model, config=memory(short_term_turns=2, full_context_turns=1))
    session = ChatSession(runtime, "support", "u-42", store=sqlite_store)
    for order in ("A1", "B2", "C3"):
        model.calls(("lookup_order", {"order_id": order}))
        model.calls(("lookup_order", {"order_id": order + "x"}))  # two decisions in one turn
        model.say(f"{order} shipped.")
        await session.send(f"Where is {order}?")
    model.say("You asked about three orders.")
    await session.send("What did I ask?")
    prior = model.requests[-1].prior_turns
    assert [t.user for t in prior] == ["Where is B2?", "Where is C3?"]
    assert prior[0].trace == ()  # text only, outside the full-context layer
    assert prior[0].replies == ("B2 shipped.",)
    names = [[(c.name, c.arguments["order_id"]) for c in group] for group in prior[1].trace]
    assert names == [[("lookup_order", "C3")], [("lookup_order", "C3x")]]  # all of the turn


async def test_a_loop_agent_writes_key_events_during_the_turn_and_sees_them_next_turn(
    model: Scripted, store: MemoryStore
) -> None:
    model.call("create_key_event", type="refund", title="Refund for A1", details="damaged")
    model.say("I opened a refund case.")
    model.say("Your refund is open.")
    session = ChatSession(build_runtime(model), "support", "u-42", "s-1", store=store)
    turn = await session.send("I want a refund for A1")
    offered = [c.name for c in model.requests[0].capabilities]
    assert offered == ["lookup_order", "refund", *TOOL_NAMES]
    [[call]] = turn.stored.trace if turn.stored else ()
    assert call.status == "ok"
    event_id = call.result["created"]["id"]
    event = await KeyEventService(store, memory().key_events).get("user:u-42", event_id)
    assert (event.type, event.title, event.session_id) == ("refund", "Refund for A1", "s-1")
    await session.send("Any news?")
    instructions = model.requests[-1].instructions
    assert instructions.startswith(INSTRUCTIONS + "\n\n[touba: key events on record")
    assert event_id in instructions
    assert "not instructions" in instructions


async def test_an_event_of_another_owner_reads_as_not_found(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    service = KeyEventService(sqlite_store, memory().key_events)
    theirs = await service.create(owner_for("bob", "s-0"), "refund", "Bob's refund", "", "s-0")
    model.call("update_key_event", event_id=theirs.id, status="closed")
    model.say("I could not find it.")
    session = ChatSession(build_runtime(model), "support", "alice", store=sqlite_store)
    await session.send(f"Close event {theirs.id}")
    [observation] = model.requests[1].observations
    assert observation.status == "error"
    assert "no key event with the event_id given" in (observation.error or "")
    assert (await service.get(owner_for("bob", "s-0"), theirs.id)).status == "open"


async def test_the_prompt_carries_five_open_events_most_recently_updated_first(
    model: Scripted, store: MemoryStore
) -> None:
    service = KeyEventService(store, memory().key_events)
    owner = owner_for("u-42", "s-0")
    made = [await service.create(owner, "refund", f"case {i}", "", "s-0") for i in range(7)]
    await service.update(owner, made[1].id, status="closed", session_id="s-0")
    await service.update(owner, made[0].id, details="touched last", session_id="s-0")
    model.say("Hello.")
    session = ChatSession(build_runtime(model), "support", "u-42", store=store)
    await session.send("Hi")
    block = model.requests[0].instructions.rsplit("\n", 1)[1]
    shown = [e["title"] for e in json.loads(block)["key_events"]]
    assert shown == ["case 0", "case 6", "case 5", "case 4", "case 3"]


async def test_agent_and_flow_kinds_get_no_tools_but_see_their_events(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    service = KeyEventService(sqlite_store, memory().key_events)
    await service.create(owner_for("u-42", "s-0"), "refund", "Refund for A1", "", "s-0")
    # A flow's model step offers no capability at all (touba.runtime._flow).
    offered = {"agent": ["lookup_order", "refund"], "flow": []}
    for kind in ("agent", "flow"):
        model.say("Hello.")
        runtime = build_runtime(model, kind=kind)
        await ChatSession(runtime, "support", "u-42", store=sqlite_store).send("Hi")
        request = model.requests[-1]
        assert [c.name for c in request.capabilities] == offered[kind]
        assert "Refund for A1" in request.instructions


async def test_a_failed_turn_is_stored_only_when_calls_ran(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    session = ChatSession(build_runtime(model), "support", "u-42", store=sqlite_store)
    model.fail()
    failed = await session.send("Hello?")
    assert (failed.status, failed.stored, failed.replies) == ("failed", None, ())
    assert failed.result.checkpoint_id is None  # nothing ran: the user may simply send again
    model.call("lookup_order", order_id="A1")
    model.fail()
    after_call = await session.send("Where is A1?")
    # The provider failed after a call ran: a retryable failure keeps a checkpoint, and
    # the turn waits for its retry instead of being stored half done.
    assert (after_call.status, after_call.stored) == ("failed", None)
    assert after_call.result.checkpoint_id is not None
    assert session.pending_checkpoint == after_call.result.checkpoint_id
    with pytest.raises(ConfigurationError, match="retry"):
        await session.send("Anything new?")
    model.say("A1 has shipped.")
    retried = await session.resume()
    assert retried.status == "completed"
    assert retried.stored is not None
    assert retried.stored.replies == ("A1 has shipped.",)
    assert [[c.name for c in g] for g in retried.stored.trace] == [["lookup_order"]]
    assert len(await sqlite_store.recent_turns(session.session_id, 10)) == 1


async def test_calls_a_stopped_invocation_never_ran_are_not_stored_as_orphans(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    program = Program()

    @program.capability
    async def lookup_order(order_id: str) -> str:
        return "shipped"

    program.agent(
        "support",
        provider=model.provider,
        capabilities=("lookup_order",),
        max_decisions=2,
        memory=memory(),
    )
    session = ChatSession(Runtime(program), "support", "u-42", store=sqlite_store)
    model.call("lookup_order", order_id="A1")
    model.call("lookup_order", order_id="B2")  # its decision is the last: not run
    turn = await session.send("Where are A1 and B2?")
    assert turn.status == "failed"
    assert turn.stored is not None
    [[ran]] = turn.stored.trace
    assert (ran.arguments, ran.status) == ({"order_id": "A1"}, "ok")


# -- approvals ---------------------------------------------------------------------------------


async def test_a_turn_awaiting_approval_is_stored_once_resumed(
    model: Scripted, store: MemoryStore
) -> None:
    runtime = build_runtime(model, approval=True)
    session = ChatSession(runtime, "support", "u-42", store=store)
    model.calls(("lookup_order", {"order_id": "A1"}), ("refund", {"order_id": "A1"}))
    paused = await session.send("Refund A1")
    assert (paused.status, paused.stored) == ("awaiting_approval", None)
    [pending] = paused.result.pending
    assert session.pending_checkpoint == paused.result.checkpoint_id
    assert await store.recent_turns(session.session_id, 10) == ()
    with pytest.raises(ConfigurationError, match="awaits approval"):
        await session.send("Hello?")
    with pytest.raises(ConfigurationError, match="awaits approval"):
        await session.end()
    model.say("Refunded.")
    turn = await session.resume({pending.call_id: True})
    assert (turn.status, turn.user, turn.replies) == ("completed", "Refund A1", ("Refunded.",))
    assert turn.stored is not None
    [[lookup, refund]] = turn.stored.trace
    assert (lookup.status, refund.status, refund.result) == ("ok", "ok", "refunded A1")
    assert session.pending_checkpoint is None
    model.say("Done.")
    await session.send("Thanks")
    assert model.requests[-1].prior_turns[-1].trace == turn.stored.trace


async def test_a_paused_turn_resumes_from_another_session_object(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    checkpoints = MemoryCheckpointStore()  # shared, as a SqliteCheckpointStore file would be
    runtime = build_runtime(model, approval=True, checkpoints=checkpoints)
    first = ChatSession(runtime, "support", "u-42", "s-1", store=sqlite_store)
    model.call("refund", order_id="A1")
    paused = await first.send("Refund A1")
    checkpoint = paused.result.checkpoint_id or ""
    other = ChatSession(runtime, "support", "u-42", "s-2", store=sqlite_store)
    with pytest.raises(ConfigurationError, match="not a turn of session 's-2'"):
        await other.resume({}, checkpoint_id=checkpoint)
    later = ChatSession(runtime, "support", "u-42", "s-1", store=sqlite_store)
    model.say("Refund refused.")
    turn = await later.resume({}, checkpoint_id=checkpoint)
    assert turn.stored is not None
    assert turn.stored.user == "Refund A1"
    [[refused]] = turn.stored.trace
    assert refused.status == "denied"


# -- end and extraction ------------------------------------------------------------------------


async def test_end_queues_extraction_and_runs_it_in_the_background(
    model: Scripted, store: MemoryStore
) -> None:
    runtime = build_runtime(model, kind="agent")
    session = ChatSession(runtime, "support", "u-42", "s-1", store=store)
    model.say("I will pass it on.")
    await session.send("Please refund order A1, it arrived broken")
    model.output(
        {"ops": [{"kind": "create", "type": "refund", "title": "Refund A1", "details": "broken"}]}
    )
    job = await session.end()
    assert job is not None
    assert (job.session_id, job.owner, job.agent_ref) == ("s-1", "user:u-42", "support")
    done = await session.wait_extraction()
    assert done is not None
    assert done.status == "done"
    request = model.requests[-1]
    assert (request.capabilities, request.prior_turns) == ((), ())
    assert request.output_schema is not None
    assert "arrived broken" in str(request.input)
    assert "not instructions" in str(request.input)
    [event] = await store.query_events("user:u-42")
    assert (event.title, event.session_id) == ("Refund A1", "s-1")
    again = await session.end()  # idempotent: the same job, now done
    assert again is not None
    assert (again.id, again.status) == (job.id, "done")
    assert session.ended
    with pytest.raises(ConfigurationError, match="has ended"):
        await session.send("Hello?")
    await session.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_extraction_through_each_provider(backend: str, sqlite_store: MemoryStore) -> None:
    async with open_model(backend) as model:
        runtime = build_runtime(model, kind="agent")
        session = ChatSession(runtime, "support", "u-42", store=sqlite_store)
        model.say("Noted.")
        await session.send("My account is locked")
        op = {"kind": "create", "type": "account issue", "title": "Locked out", "details": ""}
        model.output({"ops": [op]})
        await session.end()
        done = await session.wait_extraction()
        assert done is not None
        assert (done.status, done.last_error) == ("done", None)
        assert [e.type for e in await sqlite_store.query_events("user:u-42")] == ["account issue"]
        assert model.accepted()
        assert "Locked out" not in model.bodies()[-1]  # the ops came back, not sent
        assert "My account is locked" in model.bodies()[-1]


async def _after_one_exchange(
    model: Scripted, store: MemoryStore, runtime: Runtime | None = None, **options: Any
) -> ChatSession:
    """An agent's session of "u-42" (with ``options``) after one exchange ("Refund A1")."""
    runtime = runtime or build_runtime(model, kind="agent")
    session = ChatSession(runtime, "support", "u-42", store=store, **options)
    model.say("Noted.")
    await session.send("Refund A1")
    return session


async def test_extraction_failures_are_retried_with_backoff_then_end_failed_and_visible(
    model: Scripted, store: MemoryStore
) -> None:
    queue = fast_queue(store, max_attempts=3)
    session = await _after_one_exchange(model, store, queue=queue)
    model.fail()
    model.output({"wrong": "shape"})
    model.fail()
    await session.end()
    job = await session.wait_extraction()
    assert job is not None
    assert (job.status, job.attempts) == ("failed", 3)
    assert "AgentDecisionProviderUnavailable" in (job.last_error or "")
    assert [j.id for j in await queue.list("failed")] == [job.id]
    assert await store.query_events("user:u-42") == []


async def _ended_unextracted(
    runtime: Runtime, model: Scripted, store: MemoryStore
) -> tuple[ChatSession, ExtractionJob]:
    """One exchange ("Refund A1"), then the session ends; its extraction job only queued."""
    session = await _after_one_exchange(model, store, runtime, extract_in_background=False)
    job = await session.end()
    assert job is not None
    return session, job


async def test_a_job_whose_worker_died_is_rerun_with_its_recorded_ops_once(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    runtime = build_runtime(model, kind="agent")
    _session, job = await _ended_unextracted(runtime, model, sqlite_store)
    dying = ExtractionQueue(sqlite_store, lease_seconds=0.01)
    claimed = await dying.claim("w-1", job_id=job.id)
    assert claimed is not None
    service = KeyEventService(sqlite_store, memory().key_events)
    ops = parse_ops([{"kind": "create", "type": "refund", "title": "Refund A1", "details": ""}])
    await dying.apply(claimed, ops, service)  # recorded and applied; then the worker dies
    await asyncio.sleep(0.02)  # its lease expires
    rerun = await ExtractionWorker(runtime, sqlite_store).run_job()
    assert rerun is not None
    assert (rerun.id, rerun.status, rerun.attempts) == (job.id, "done", 2)
    assert model.provider.remaining == 0  # the model was not asked again
    assert len(await sqlite_store.query_events("user:u-42")) == 1


async def test_close_stops_retrying_and_leaves_the_job_queued(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    queue = ExtractionQueue(sqlite_store, base_delay_seconds=60)
    session = await _after_one_exchange(model, sqlite_store, queue=queue)
    model.fail()
    await session.end()
    await asyncio.wait_for(session.close(), timeout=5)  # does not wait out the backoff
    job = await session.wait_extraction()
    assert job is not None
    assert (job.status, job.attempts) == ("pending", 1)


async def test_without_background_extraction_the_job_only_waits_in_the_queue(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    session, job = await _ended_unextracted(build_runtime(model, kind="flow"), model, sqlite_store)
    assert (await session.wait_extraction()) == job
    assert job.status == "pending"
    assert model.provider.remaining == 0


async def test_no_extraction_for_loop_agents_preview_inactive_events_or_empty_sessions(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    cases: list[tuple[Runtime, str]] = [
        (build_runtime(model, kind="loop"), "live"),
        (build_runtime(model, kind="agent"), "preview"),
        (build_runtime(model, kind="agent", config=memory(enabled=False)), "live"),
    ]
    for runtime, mode in cases:
        model.say("Hello.")
        session = ChatSession(runtime, "support", "u-42", store=sqlite_store, mode=mode)  # type: ignore[arg-type]
        await session.send("Hi")
        assert await session.end() is None
    empty = ChatSession(build_runtime(model, kind="agent"), "support", "u-42", store=sqlite_store)
    assert await empty.end() is None
    assert await ExtractionQueue(sqlite_store).list() == []


async def test_idle_seconds_end_the_session_after_inactivity(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    runtime = build_runtime(model, kind="agent")
    session = ChatSession(
        runtime,
        "support",
        "u-42",
        store=sqlite_store,
        idle_seconds=0.05,
        extract_in_background=False,
    )
    model.say("Hello.")
    await session.send("Hi")
    assert not session.ended
    await eventually(lambda: session.ended)
    meta = await sqlite_store.get_session(session.session_id)
    assert meta is not None
    assert meta.ended_at is not None
    assert session.extraction_job is not None
    await session.close()


async def test_async_with_opens_and_closes_without_ending(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    runtime = build_runtime(model)
    async with ChatSession(runtime, "support", None, "s-9", store=sqlite_store) as session:
        meta = await sqlite_store.get_session("s-9")
        assert meta is not None
        assert meta.owner == "session:s-9"
    assert not session.ended
    with pytest.raises(ConfigurationError, match="closed"):
        await session.send("Hi")
    model.say("Welcome back.")
    again = ChatSession(runtime, "support", None, "s-9", store=sqlite_store)
    assert (await again.send("Hi")).stored is not None


async def test_misuse_is_refused_at_construction(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    runtime = build_runtime(model)
    with pytest.raises(ConfigurationError, match="unknown agent"):
        ChatSession(runtime, "nobody", store=sqlite_store)
    with pytest.raises(ConfigurationError, match="store"):
        ChatSession(runtime, "support", store="memory.db")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="mode"):
        ChatSession(runtime, "support", store=sqlite_store, mode="debug")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="idle_seconds"):
        ChatSession(runtime, "support", store=sqlite_store, idle_seconds=0)
    with pytest.raises(ConfigurationError, match="user_id"):
        ChatSession(runtime, "support", "", store=sqlite_store)
    with pytest.raises(ConfigurationError, match="Runtime"):
        ChatSession(object(), "support", store=sqlite_store)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="non-empty"):
        await ChatSession(runtime, "support", store=sqlite_store).send("  ")
    program = Program()

    @program.capability
    async def create_key_event(type: str) -> str:
        return "mine"

    program.agent(
        "support", provider=model.provider, capabilities=("create_key_event",), memory=memory()
    )
    with pytest.raises(ConfigurationError, match="key-event tools"):
        ChatSession(Runtime(program), "support", store=sqlite_store)


async def test_a_preview_session_never_reopens_a_live_one(
    model: Scripted, sqlite_store: MemoryStore
) -> None:
    runtime = build_runtime(model)
    model.say("Hello.")
    await ChatSession(runtime, "support", "u-42", "s-1", store=sqlite_store).send("Hi")
    preview = ChatSession(runtime, "support", "u-42", "s-1", store=sqlite_store, mode="preview")
    with pytest.raises(ConfigurationError, match="already exists"):
        await preview.send("Hi")
