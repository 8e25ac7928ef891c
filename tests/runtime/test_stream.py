"""``Runtime.stream`` / ``stream_resume``: typed events in order, then invoke's result."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tests._providers import openai_sdk
from touba import (
    ApprovalRequired,
    DecisionCompleted,
    InvocationFinished,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from touba.errors import ConfigurationError
from touba.providers.openai import create_openai_decision_provider
from touba.runtime import Program, Runtime, StreamEvent
from touba.testing import ScriptedProvider
from touba.testing.fakes import (
    FakeOpenAIServer,
    StreamKnobs,
    openai_function_call,
    openai_text,
)

from ._helpers import final, kinds, step

REPLY = "Order A1 left the warehouse this morning."


def _program(provider: Any) -> Program:
    program = Program()

    @program.capability(permissions=("orders:read",))
    async def lookup(order_id: str) -> str:
        return "shipped"

    program.agent("support", provider=provider, capabilities=("lookup",), grants=("orders:read",))
    return program


@pytest.fixture
async def client(openai_server: FakeOpenAIServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_sdk(openai_server) as sdk:
        yield sdk


def _script(srv: FakeOpenAIServer, **knobs: Any) -> None:
    srv.script_response(openai_function_call("lookup", {"order_id": "A1"}, call_id="c1"))
    srv.script_response(openai_text(REPLY), **knobs)


async def test_a_stream_yields_typed_events_then_the_result_invoke_returns(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    _script(openai_server)
    provider = create_openai_decision_provider(model="gpt-test", client=client)
    runtime = Runtime(_program(provider))
    async with runtime.stream("support", input="Where is A1?", run_id="r1") as stream:
        events: list[StreamEvent] = [event async for event in stream]
    result = stream.result
    assert result.status == "completed"
    assert result.output == REPLY
    texts = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(t.text for t in texts) == REPLY
    assert len(texts) > 1  # pieces, as the model wrote them
    assert {(t.agent, t.invocation_id) for t in texts} == {("support", result.invocation_id)}
    shapes = [type(e).__name__ for e in events if not isinstance(e, TextDelta)]
    assert shapes == [
        "DecisionCompleted",
        "ToolCallStarted",
        "ToolCallFinished",
        "DecisionCompleted",
        "InvocationFinished",
    ]
    first, started, finished, last, end = (e for e in events if not isinstance(e, TextDelta))
    assert first == DecisionCompleted(False, "support", result.invocation_id)
    assert (started.call_id, started.name, started.arguments) == (  # type: ignore[union-attr]
        "c1",
        "lookup",
        {"order_id": "A1"},
    )
    assert isinstance(finished, ToolCallFinished)
    assert (finished.call_id, finished.status) == ("c1", "ok")
    assert isinstance(last, DecisionCompleted)
    assert last.final
    assert events.index(last) > events.index(texts[-1])  # the text came before its decision
    assert end == InvocationFinished(result)
    # the same run as invoke: the trace of invoke, the requests streamed
    _script(openai_server)
    plain = await runtime.invoke("support", input="Where is A1?", run_id="r2")
    assert kinds(plain) == kinds(result)
    assert [r.body.get("stream", False) for r in openai_server.requests_to("responses")] == [
        True,
        True,
        False,
        False,
    ]


async def test_approval_required_then_stream_resume_continues() -> None:
    program = Program()

    @program.capability(requires_approval=True)
    async def pay(invoice: str) -> str:
        return "paid"

    model = ScriptedProvider(step(("p1", "pay", {"invoice": "I-1"})), final("paid I-1"))
    program.agent("billing", provider=model, capabilities=("pay",))
    runtime = Runtime(program)
    async with runtime.stream("billing", input="pay I-1") as stream:
        events = [event async for event in stream]
    paused = stream.result
    assert paused.status == "awaiting_approval"
    assert [type(e).__name__ for e in events] == [
        "DecisionCompleted",
        "ApprovalRequired",
        "InvocationFinished",
    ]
    assert events[1] == ApprovalRequired(paused.checkpoint_id or "", paused.pending)
    async with runtime.stream_resume(paused.checkpoint_id or "", {"p1": True}) as resumed:
        after = [event async for event in resumed]
    assert resumed.result.status == "completed"
    assert resumed.result.output == "paid I-1"
    started = [e for e in after if isinstance(e, ToolCallStarted)]
    assert [(e.call_id, e.name) for e in started] == [("p1", "pay")]
    assert isinstance(after[-1], InvocationFinished)


async def test_a_provider_that_does_not_stream_gives_its_text_whole() -> None:
    model = ScriptedProvider(step(("c1", "lookup", {"order_id": "A1"})), final("A1 shipped"))
    runtime = Runtime(_program(model))
    async with runtime.stream("support", input="A1?") as stream:
        events = [event async for event in stream]
    assert stream.result.output == "A1 shipped"
    assert [e.final for e in events if isinstance(e, DecisionCompleted)] == [False, True]


async def test_the_result_is_known_only_at_the_end(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    _script(openai_server)
    runtime = Runtime(_program(create_openai_decision_provider(model="m", client=client)))
    stream = runtime.stream("support", input="A1?")
    with pytest.raises(ConfigurationError, match="enter the stream"):
        await stream.__anext__()
    async with stream:
        with pytest.raises(ConfigurationError, match="not finished"):
            _ = stream.result
        async for _event in stream:
            pass
    assert stream.result.status == "completed"


async def test_leaving_early_closes_the_vendors_response_within_100_ms(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    _script(openai_server, stream=StreamKnobs(event_delay=0.05))
    runtime = Runtime(_program(create_openai_decision_provider(model="m", client=client)))
    async with runtime.stream("support", input="A1?") as stream:
        async for event in stream:
            if isinstance(event, TextDelta):
                break
    left = time.monotonic()
    record = openai_server.wait_stream_end()
    assert record.outcome == "client_closed"
    assert record.closed_at is not None
    assert record.closed_at - left < 0.1
    with pytest.raises(ConfigurationError):
        _ = stream.result


async def test_a_slow_consumer_loses_nothing(
    openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    long_reply = "word " * 400  # 250 pieces: more than the stream's buffer
    openai_server.script_response(openai_text(long_reply))
    runtime = Runtime(_program(create_openai_decision_provider(model="m", client=client)))
    pieces = []
    async with runtime.stream("support", input="A1?") as stream:
        async for event in stream:
            if isinstance(event, TextDelta):
                pieces.append(event.text)
                if len(pieces) % 50 == 0:
                    await asyncio.sleep(0.01)
    assert "".join(pieces) == long_reply
    assert stream.result.output == long_reply


async def test_a_delegates_events_carry_its_own_agent_and_invocation() -> None:
    program = Program()

    @program.capability()
    async def pay(invoice: str) -> str:
        return "paid"

    program.delegate("billing")
    parent = ScriptedProvider(step(("d1", "billing", {"input": "pay"})), final("done"))
    child = ScriptedProvider(step(("p1", "pay", {"invoice": "I-1"})), final("paid"))
    program.agent("main", provider=parent, capabilities=("billing",))
    program.agent("billing", provider=child, capabilities=("pay",))
    async with Runtime(program).stream("main") as stream:
        events = [event async for event in stream]
    result = stream.result
    assert result.status == "completed"
    child_ids = {  # the delegate's own invocation id
        str(e["child_invocation_id"]) for e in result.trace.of_kind("sub_invocation_started")
    }
    started = [(e.name, e.agent, e.invocation_id) for e in events if isinstance(e, ToolCallStarted)]
    [child_id] = child_ids
    assert started == [
        ("billing", "main", result.invocation_id),
        ("pay", "billing", child_id),
    ]
    decided = [(e.agent, e.final) for e in events if isinstance(e, DecisionCompleted)]
    assert decided == [("main", False), ("billing", False), ("billing", True), ("main", True)]


async def test_a_second_stream_on_a_busy_conversation_is_refused() -> None:
    from touba.errors import DecisionHistoryBusy
    from touba.providers import DecisionRequest

    with FakeOpenAIServer() as srv:
        srv.script_response(openai_text(REPLY), stream=StreamKnobs(event_delay=0.02))
        async with openai_sdk(srv) as sdk:
            provider = create_openai_decision_provider(model="m", client=sdk)
            request = DecisionRequest(run_id="r", invocation_id="i", agent_ref="a", input="x")

            async def sink(delta: object) -> None:
                pass

            first = asyncio.create_task(provider.decide(request, sink=sink))
            await asyncio.sleep(0.05)
            with pytest.raises(DecisionHistoryBusy):
                await provider.decide(request, sink=sink)
            assert (await first).text == REPLY
