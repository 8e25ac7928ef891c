"""ToubaSession on touba's stores, and a Runner.run through the fake OpenAI server."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

from tests.integrations._crash import die_holding
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
)
from touba.history import MemoryHistoryStore
from touba.history.sqlite import SqliteHistoryStore
from touba.integrations.openai_agents import ToubaSession
from touba.testing.fakes import FakeOpenAIServer
from touba.testing.fakes.openai import (
    openai_function_call,
    openai_reasoning,
    openai_text,
    validate_openai_responses_request,
)


def user(text: str) -> Any:
    return {"role": "user", "content": text}


def said(text: str) -> Any:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call(call_id: str) -> Any:
    return {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": "{}"}


def output(call_id: str) -> Any:
    return {"type": "function_call_output", "call_id": call_id, "output": "ok"}


TOOL_TURN: list[Any] = [user("where?"), call("c1"), output("c1"), said("shipped")]


async def test_items_round_trip_pop_and_clear(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")
    assert await session.get_items() == []
    await session.add_items(TOOL_TURN)
    assert await session.get_items() == TOOL_TURN
    assert await session.pop_item() == said("shipped")
    assert await session.get_items() == TOOL_TURN[:3]
    await session.clear_session()
    assert await session.get_items() == []
    assert await session.pop_item() is None


async def test_limit_cuts_whole_exchanges_never_an_orphan(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")
    await session.add_items(TOOL_TURN)
    assert await session.get_items(limit=2) == [said("shipped")]  # SQLiteSession: [output, said]
    assert await session.get_items(limit=3) == TOOL_TURN[1:]
    assert await session.get_items(limit=0) == []


async def test_pending_call_is_kept_but_never_returned(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")
    await session.add_items([user("refund A1"), call("c9")])  # awaiting approval
    assert await session.get_items() == [user("refund A1")]
    await session.add_items([output("c9")])
    assert await session.get_items() == [user("refund A1"), call("c9"), output("c9")]


async def test_bounds_refuse_rather_than_send_nothing(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns", max_messages=2)
    await session.add_items([user("a"), call("c1"), output("c1"), call("c2"), output("c2")])
    assert await session.get_items() == [call("c2"), output("c2")]
    narrow = ToubaSession("s1", store=store, namespace="ns", max_bytes=10)
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await narrow.get_items()
    assert caught.value.limit == "max_bytes"


async def test_namespaces_and_sessions_never_see_each_other(store: Any) -> None:
    a = ToubaSession("same-id", store=store, namespace="tenant-a")
    b = ToubaSession("same-id", store=store, namespace="tenant-b")
    await a.add_items([user("secret of a")])
    assert await b.get_items() == []
    assert a.session_key != b.session_key
    assert await ToubaSession("other", store=store, namespace="tenant-a").get_items() == []


async def test_an_operation_meeting_another_is_refused(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")
    await session.add_items([user("hello")])
    refused: list[type[BaseException]] = []

    async def concurrent(record: Any) -> tuple[Any, None]:
        for operation in (session.get_items(), session.add_items([user("x")]), session.pop_item()):
            with pytest.raises(DecisionHistoryBusy):
                await operation
            refused.append(DecisionHistoryBusy)
        return record, None

    await store.transact(session.session_key, concurrent)
    assert len(refused) == 3
    assert await session.get_items() == [user("hello")]


async def test_a_run_meeting_another_operation_is_refused_before_the_model(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")
    agent = Agent(name="a", model="gpt-never-called")

    async def other_worker(record: Any) -> tuple[Any, None]:
        with pytest.raises(DecisionHistoryBusy):
            await Runner.run(
                agent, "hi", session=session, run_config=RunConfig(tracing_disabled=True)
            )
        return record, None

    await store.transact(session.session_key, other_worker)


async def test_recover_after_a_worker_was_killed_holding_the_session(
    store: Any, backend: str, private_dir: Path, store_name: str
) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")
    await session.add_items(TOOL_TURN)
    die_holding(backend, private_dir, store_name, session.session_key)
    with pytest.raises(DecisionHistoryBusy):
        await session.get_items()
    assert await store.recover(session.session_key, worker_stopped=True) is True
    assert await session.get_items() == TOOL_TURN


async def test_a_full_store_refuses_atomically(store_factory: Any) -> None:
    async with store_factory(max_sessions=1) as store:
        first = ToubaSession("first", store=store, namespace="ns")
        second = ToubaSession("second", store=store, namespace="ns")
        await first.add_items([user("kept")])
        with pytest.raises(DecisionHistoryLimitExceeded) as caught:
            await second.add_items([user("refused")])
        assert caught.value.limit == "max_sessions"
        assert await second.get_items() == []
        assert await first.get_items() == [user("kept")]


async def test_retained_bytes_refused_atomically(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns", max_retained_bytes=200)
    await session.add_items([user("short")])
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await session.add_items([user("x" * 300), user("y")])
    assert caught.value.limit == "max_retained_bytes"
    assert await session.get_items() == [user("short")]


async def test_items_that_are_not_json_are_refused_before_writing(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")
    with pytest.raises(TypeError):
        await session.add_items([user("fine"), user(object())])  # type: ignore[arg-type]
    assert await session.get_items() == []


async def test_a_record_of_another_kind_is_never_overwritten(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")

    async def foreign(record: Any) -> tuple[Any, None]:
        return {"kind": "someone-else", "data": 1}, None

    await store.transact(session.session_key, foreign)
    for operation in (session.get_items(), session.add_items([user("x")]), session.clear_session()):
        with pytest.raises(DecisionHistoryRecordInvalid):
            await operation


def test_configuration_is_checked_at_construction() -> None:
    store = MemoryHistoryStore()
    with pytest.raises(ConfigurationError):
        ToubaSession("", store=store, namespace="ns")
    with pytest.raises(ConfigurationError):
        ToubaSession("s", store=store, namespace="")
    with pytest.raises(ConfigurationError):
        ToubaSession("s", store=store, namespace="ns", max_messages=0)
    with pytest.raises(ConfigurationError):
        ToubaSession("s", store=object(), namespace="ns")  # type: ignore[arg-type]


async def test_sqlite_file_is_private(private_dir: Path) -> None:
    path = private_dir / "sessions.sqlite"
    async with SqliteHistoryStore(path) as store:
        await ToubaSession("s1", store=store, namespace="ns").add_items([user("hi")])
        for name in os.listdir(private_dir):
            assert stat.S_IMODE(os.stat(private_dir / name).st_mode) == 0o600, name


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_sessions_expire(kind: str, private_dir: Path) -> None:
    now = [1_000_000.0]
    store: Any = (
        MemoryHistoryStore(ttl_seconds=60, clock=lambda: now[0])
        if kind == "memory"
        else SqliteHistoryStore(private_dir / "s.sqlite", ttl_seconds=60, clock=lambda: now[0])
    )
    async with store:
        session = ToubaSession("s1", store=store, namespace="ns")
        await session.add_items([user("hi")])
        now[0] += 59
        assert await session.get_items() == [user("hi")]  # every operation is activity
        now[0] += 59
        assert await session.get_items() == [user("hi")]
        now[0] += 61
        assert await session.get_items() == []  # expired 60 s after its last operation


# the Agents SDK end to end -------------------------------------------------------------


@function_tool
def lookup_order(order_id: str) -> str:
    """Look up an order."""
    return json.dumps({"order_id": order_id, "status": "shipped"})


async def test_runner_through_the_fake_openai_server_trims_without_orphans(
    private_dir: Path,
) -> None:
    with FakeOpenAIServer() as srv:
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="sk-test", max_retries=0)
        model = OpenAIResponsesModel(model="gpt-4.1-mini", openai_client=client)
        agent = Agent(name="support", instructions="Help.", tools=[lookup_order], model=model)
        config = RunConfig(tracing_disabled=True)
        for i in range(6):  # a tool loop: reasoning + call, six times, then an answer
            srv.script_response(
                openai_reasoning("checking"), openai_function_call("lookup_order", {"order_id": i})
            )
        srv.script_response(openai_text("All six shipped."))
        srv.script_response(openai_text("You're welcome."))
        async with SqliteHistoryStore(private_dir / "sessions.sqlite") as store:
            session = ToubaSession("user-42", store=store, namespace="support", max_messages=8)
            first = await Runner.run(
                agent, "Check orders 0 to 5", session=session, run_config=config
            )
            assert first.final_output == "All six shipped."
            second = await Runner.run(agent, "Thanks!", session=session, run_config=config)
            assert second.final_output == "You're welcome."
            stored = await ToubaSession("user-42", store=store, namespace="support").get_items()
        await client.close()
        assert len(stored) == 1 + 6 * 3 + 1 + 1 + 1  # every item retained
        requests = srv.requests_to("responses")
        assert [r.status for r in requests] == [200] * 8
        for request in requests:
            assert validate_openai_responses_request(request.body, ledger=srv.ledger) == []
        last_input = requests[-1].body["input"]
        # history trimmed to 8 items: the answer and two (reasoning, call, output) exchanges...
        assert len(last_input) == 7 + 1
        assert [i.get("type") for i in last_input[:3]] == [
            "reasoning",
            "function_call",
            "function_call_output",
        ]
        assert last_input[-1] == {"role": "user", "content": "Thanks!"}


async def test_exclusive_holds_the_session_for_a_whole_run(store: Any) -> None:
    """Two runs on one session: the second, while the first is inside its tool call
    (between its model calls), is refused before it calls the model."""
    import asyncio

    inside, release = asyncio.Event(), asyncio.Event()

    @function_tool
    async def slow_lookup(order_id: str) -> str:
        """Look up an order, slowly."""
        inside.set()
        await release.wait()
        return "shipped"

    with FakeOpenAIServer() as srv:
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="sk-test", max_retries=0)
        model = OpenAIResponsesModel(model="gpt-4.1-mini", openai_client=client)
        agent = Agent(name="support", tools=[slow_lookup], model=model)
        config = RunConfig(tracing_disabled=True)
        srv.script_response(openai_function_call("slow_lookup", {"order_id": "A1"}))
        srv.script_response(openai_text("A1 shipped."))
        first_session = ToubaSession("user-1", store=store, namespace="ns")
        second_session = ToubaSession("user-1", store=store, namespace="ns")  # another worker

        async def first_run() -> Any:
            async with first_session.exclusive():
                return await Runner.run(
                    agent, "Where is A1?", session=first_session, run_config=config
                )

        running = asyncio.create_task(first_run())
        await inside.wait()
        with pytest.raises(DecisionHistoryBusy):
            async with second_session.exclusive():
                await Runner.run(agent, "And B2?", session=second_session, run_config=config)
        with pytest.raises(DecisionHistoryBusy):  # nor a run without exclusive()
            await Runner.run(agent, "And B2?", session=second_session, run_config=config)
        assert len(srv.requests_to("responses")) == 1  # only the first run's first call
        release.set()
        result = await running
        await client.close()
    assert result.final_output == "A1 shipped."
    stored = await second_session.get_items()
    assert stored[0] == {"role": "user", "content": "Where is A1?"}
    assert [i.get("type") for i in stored[1:3]] == ["function_call", "function_call_output"]


async def test_a_run_that_fails_inside_exclusive_saves_nothing(store: Any) -> None:
    session = ToubaSession("s1", store=store, namespace="ns")
    await session.add_items([user("before")])
    seen: list[Any] = []

    async def failing_run() -> None:
        async with session.exclusive():
            await session.add_items([user("during")])
            seen.extend(await session.get_items())
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError):
        await failing_run()
    assert seen == [user("before"), user("during")]
    assert await session.get_items() == [user("before")]
    async with session.exclusive():
        with pytest.raises(ConfigurationError, match="already held"):
            async with session.exclusive():
                pass
        await session.add_items([user("after")])
    assert await session.get_items() == [user("before"), user("after")]
