"""A stopped stream leaves memory whole (issue 26, item 4), on every vendor's fake.

The consumer stops three ways (leaves the ``async with``, ``break``s its
``async for``, has its task cancelled) at four points (text streaming in the
first decision; between a decision and its calls; while a capability runs;
while a delegate streams, after its own call ran). After each: nothing of
the unfinished decision is stored (the history store holds what it held
before that decision), the trace ends with ``decision_cancelled``,
``stream.result`` says ``cancelled`` with a checkpoint exactly when calls ran,
and ``stream_resume`` of it continues exactly once (every capability ran at
most once, no saved decision is asked again, no ``recover`` needed).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests import test_telemetry  # installs the suite's in-memory tracer provider
from tests._providers import fake_server, vendor_provider
from touba import DecisionCompleted, TextDelta, ToolCallStarted
from touba.errors import AgentDecisionProviderUnavailable, ConfigurationError
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.providers import DecisionProvider
from touba.runtime import (
    InvocationResult,
    Program,
    Runtime,
    SqliteCheckpointStore,
    Step,
    StreamEvent,
)
from touba.testing.fakes import (
    FakeOpenAIServer,
    FakeProviderServer,
    StreamKnobs,
    anthropic_text,
    anthropic_tool_use,
    chat_tool_call,
    gemini_function_call,
    gemini_text,
    openai_function_call,
    openai_text,
)

VENDORS = ("openai", "compatible", "anthropic", "gemini")
WAYS = ("exit", "break", "cancel")
POINTS = ("text", "decided", "capability", "delegate")
SLOW = StreamKnobs(event_delay=0.05)
LONG = "This reply streams slowly, piece after piece, until the consumer stops it. " * 3
DONE = "All done."


# one vendor's fake, provider and scripted answers ---------------------------------------


def _provider(
    vendor: str, srv: FakeProviderServer, store: MemoryHistoryStore
) -> AbstractAsyncContextManager[DecisionProvider]:
    return vendor_provider(vendor, srv, HistoryConfig(store=store, namespace="cancel"))


def _call(vendor: str, srv: Any, name: str, arguments: dict[str, Any]) -> None:
    """Script one decision making one call (sent at once)."""
    if vendor == "openai":
        srv.script_response(openai_function_call(name, arguments))
    elif vendor == "compatible":
        srv.script_chat_completion(tool_calls=[chat_tool_call(name, arguments)])
    elif vendor == "anthropic":
        srv.script_response(anthropic_tool_use(name, arguments))
    else:
        srv.script_response(gemini_function_call(name, arguments))


def _text(vendor: str, srv: Any, text: str, knobs: StreamKnobs | None = None) -> None:
    """Script one plain-text final decision, streamed under ``knobs``."""
    if vendor == "openai":
        srv.script_response(openai_text(text), stream=knobs)
    elif vendor == "compatible":
        srv.script_chat_completion(text, stream=knobs)
    elif vendor == "anthropic":
        srv.script_response(anthropic_text(text), stream=knobs)
    else:
        srv.script_response(gemini_text(text), stream=knobs)


# the program: capabilities that count their runs ----------------------------------------


@dataclass
class World:
    runs: dict[str, int] = field(default_factory=dict)
    slow_started: asyncio.Event = field(default_factory=asyncio.Event)
    before: list[str] = field(default_factory=list)  # the store before the stopped decision
    store: MemoryHistoryStore = field(default_factory=MemoryHistoryStore)


async def _records(store: MemoryHistoryStore) -> list[str]:
    """Every stored conversation record, whole (times included: nothing may be rewritten)."""
    found = []
    for conversation in await store.list():
        record = await store.read(conversation.key)
        found.append(json.dumps(record, sort_keys=True, default=str))
    return sorted(found)


def _program(provider: DecisionProvider, world: World) -> Program:
    program = Program()

    @program.capability()
    async def lookup(q: str) -> str:
        world.runs["lookup"] = world.runs.get("lookup", 0) + 1
        world.before[:] = await _records(world.store)  # decided and stored: the next is not
        return f"{q} shipped"

    @program.capability()
    async def slow(q: str) -> str:
        world.runs["slow"] = world.runs.get("slow", 0) + 1
        world.before[:] = await _records(world.store)
        world.slow_started.set()
        await asyncio.sleep(30)
        return "never"

    program.delegate("helper", description="Looks things up")
    program.agent("support", provider=provider, capabilities=("lookup", "slow", "helper"))
    program.agent("helper", provider=provider, capabilities=("lookup",))
    return program


def _script(vendor: str, srv: Any, point: str) -> None:
    """The answers up to the stop, at ``point``."""
    if point == "text":
        _text(vendor, srv, LONG, SLOW)
    elif point == "decided":
        _call(vendor, srv, "lookup", {"q": "A"})
    elif point == "capability":
        _call(vendor, srv, "slow", {"q": "A"})
    else:
        _call(vendor, srv, "helper", {"input": "look A up"})
        _call(vendor, srv, "lookup", {"q": "A"})
        _text(vendor, srv, LONG, SLOW)


def _stops_here(point: str, world: World) -> Callable[[StreamEvent], bool]:
    def here(event: StreamEvent) -> bool:
        if point == "text":
            return isinstance(event, TextDelta)
        if point == "decided":
            return isinstance(event, DecisionCompleted) and not event.final
        if point == "capability":
            return isinstance(event, ToolCallStarted) and event.name == "slow"
        return isinstance(event, TextDelta) and event.agent == "helper"

    return here


async def _consume_and_stop(
    runtime: Runtime, way: str, here: Callable[[StreamEvent], bool], world: World, point: str
) -> InvocationResult:
    """Stream ``support`` and stop it ``way`` at the first event ``here`` accepts."""
    if point != "text":
        world.before[:] = []

    async def ready() -> None:
        if point == "capability":  # stop while it runs, not before it starts
            await asyncio.wait_for(world.slow_started.wait(), 5)
        if point == "decided" and not world.runs:  # the decision was stored: keep it
            world.before[:] = await _records(world.store)

    stream = runtime.stream("support", input="Where is A?", run_id="run-1")
    if point == "text":
        world.before[:] = await _records(world.store)
    if way == "exit":
        async with stream:
            while not here(await stream.__anext__()):
                pass
            await ready()
    elif way == "break":
        async with stream:
            async for event in stream:
                if here(event):
                    await ready()
                    break
    else:
        stopping = asyncio.Event()

        async def consumer() -> None:
            async with stream:
                async for event in stream:
                    if here(event):
                        await ready()
                        stopping.set()
                        await asyncio.sleep(30)

        task = asyncio.create_task(consumer())
        await asyncio.wait_for(stopping.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert stream.stopped
    return stream.result


def _script_rest(vendor: str, srv: Any, point: str) -> None:
    """The answers a resume needs after the stop at ``point``."""
    if point == "delegate":
        _text(vendor, srv, "A shipped")  # the helper's stopped decision, asked again
    _text(vendor, srv, DONE)


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("vendor", VENDORS)
async def test_a_stopped_stream_leaves_memory_whole_and_resumes_exactly_once(
    vendor: str, way: str, point: str
) -> None:
    world = World()
    with fake_server(vendor) as srv:
        _script(vendor, srv, point)
        async with _provider(vendor, srv, world.store) as provider:
            runtime = Runtime(_program(provider, world))
            stopped = await _consume_and_stop(runtime, way, _stops_here(point, world), world, point)
            await _check_stopped(stopped, world, point)
            requests, ran = len(srv.requests), sum(world.runs.values())
            if point == "text":  # nothing ran: nothing to resume; the next invoke works
                assert stopped.checkpoint_id is None
                assert (
                    await runtime.checkpoints.get(stopped.trace.entries[-1].invocation_id) is None
                )
                _text(vendor, srv, DONE)
                again = await runtime.invoke("support", input="Where is A?", run_id="run-1")
                assert (again.status, again.output) == ("completed", DONE)
                assert len(srv.requests) == requests + 1
                return
            assert stopped.checkpoint_id is not None
            _script_rest(vendor, srv, point)
            async with runtime.stream_resume(stopped.checkpoint_id) as resumed:
                events = [event async for event in resumed]
            result = resumed.result
            assert (result.status, result.output) == ("completed", DONE), result.error
            assert result.invocation_id == stopped.invocation_id
            # exactly once: each capability ran at most once, over stop and resume together
            assert world.runs == ({"slow": 1} if point == "capability" else {"lookup": 1})
            started = [e.name for e in events if isinstance(e, ToolCallStarted)]
            assert started == (["lookup"] if point == "decided" and not ran else [])
            # no decision saved before the stop was asked again: one request per answer
            rest = 2 if point == "delegate" else 1
            assert len(srv.requests) == requests + rest
            assert not any(e.kind == "decision_cancelled" for e in result.trace.entries[-3:])
            assert await runtime.checkpoints.get(stopped.checkpoint_id) is None  # consumed


async def _check_stopped(stopped: InvocationResult, world: World, point: str) -> None:
    assert stopped.status == "cancelled"
    assert stopped.output is None
    last = stopped.trace.entries[-1]
    assert last.kind == "decision_cancelled"
    assert (last.invocation_id, last.agent_ref) == (stopped.invocation_id, "support")
    assert last["checkpoint_id"] == stopped.checkpoint_id
    assert "text" not in last.data
    assert "output" not in last.data
    # nothing of the unfinished decision is stored, and no reservation is left behind
    assert await _records(world.store) == world.before
    if point == "text":
        assert (last["stage"], last["number"]) == ("deciding", 1)
        assert isinstance(last["deltas"], int)
        assert last["deltas"] >= 1
    elif point == "decided":
        # in RAM the journal does not wait: the call may have run, the next decision begun
        assert (last["stage"], last["number"]) in (("calls", 1), ("between", 1), ("deciding", 2))
        assert world.runs.get("lookup", 0) <= 1
    elif point == "capability":
        assert (last["stage"], last["number"], last["interrupted"]) == ("calls", 1, 1)
        [answer] = stopped.trace.of_kind("observation")
        assert answer["status"] == "error"
        assert "interrupted" in str(answer["error"])
    else:
        assert (last["stage"], last["number"]) == ("calls", 1)
        [child] = [e for e in stopped.trace.of_kind("decision_cancelled") if e is not last]
        assert child.agent_ref == "helper"
        assert (child["stage"], child["number"]) == ("deciding", 2)


# a durable checkpoint store: the journal's writes are not cut by the stop ---------------


@pytest.mark.parametrize("point", ["decided", "capability", "delegate"])
@pytest.mark.parametrize("way", WAYS)
async def test_a_stop_with_a_durable_store_leaves_a_cancelled_checkpoint_and_no_journal(
    way: str, point: str, tmp_path: Path
) -> None:
    world = World()
    checkpoints = SqliteCheckpointStore(str(tmp_path / "cp.db"))
    try:
        with FakeOpenAIServer() as srv:
            _script("openai", srv, point)
            async with _provider("openai", srv, world.store) as provider:
                runtime = Runtime(_program(provider, world), checkpoints)
                stopped = await _consume_and_stop(
                    runtime, way, _stops_here(point, world), world, point
                )
                await _check_stopped(stopped, world, point)
                assert stopped.checkpoint_id is not None
                last = stopped.trace.entries[-1]
                if point == "decided":  # stopped while the journal recorded the calls
                    assert (last["stage"], last["not_started"], world.runs) == ("calls", 1, {})
                saved = await checkpoints.list(run_id="run-1")
                assert [(c.checkpoint_id, c.status) for c in saved] == [
                    (stopped.checkpoint_id, "cancelled")
                ]  # and no running journal: a resume needs no worker_stopped
                _script_rest("openai", srv, point)
                result = await runtime.resume(stopped.checkpoint_id)
                assert (result.status, result.output) == ("completed", DONE), result.error
                assert world.runs == ({"slow": 1} if point == "capability" else {"lookup": 1})
                assert await checkpoints.list(run_id="run-1") == []
    finally:
        await checkpoints.close()


# a cancelled invoke, a stream that fails midway ------------------------------------------


async def test_a_cancelled_invoke_saves_the_same_checkpoint_then_raises() -> None:
    world = World()
    with FakeOpenAIServer() as srv:
        _script("openai", srv, "capability")
        async with _provider("openai", srv, world.store) as provider:
            runtime = Runtime(_program(provider, world))
            task = asyncio.create_task(runtime.invoke("support", input="A?", run_id="run-1"))
            await asyncio.wait_for(world.slow_started.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            [saved] = await runtime.checkpoints.list(run_id="run-1")  # type: ignore[attr-defined]
            assert saved.status == "cancelled"
            _text("openai", srv, DONE)
            result = await runtime.resume(saved.checkpoint_id)
            assert (result.status, result.output) == ("completed", DONE)
            assert world.runs == {"slow": 1}


@pytest.mark.parametrize("vendor", VENDORS)
async def test_a_stream_failing_midway_is_retryable_and_resumes_exactly_once(
    vendor: str,
) -> None:
    world = World()
    with fake_server(vendor) as srv:
        _call(vendor, srv, "lookup", {"q": "A"})
        _text(vendor, srv, LONG, StreamKnobs(cut_after=3))
        async with _provider(vendor, srv, world.store) as provider:
            runtime = Runtime(_program(provider, world))
            async with runtime.stream("support", input="A?", run_id="run-1") as stream:
                events = [event async for event in stream]
            failed = stream.result
            assert not stream.stopped
            assert failed.status == "failed"
            assert isinstance(failed.error, AgentDecisionProviderUnavailable)
            assert failed.error.retryable
            assert failed.checkpoint_id is not None
            assert not any(e.kind == "decision_cancelled" for e in failed.trace)
            assert await _records(world.store) == world.before  # nothing partial stored
            assert type(events[-1]).__name__ == "InvocationFinished"
            requests = len(srv.requests)
            _text(vendor, srv, DONE)
            result = await runtime.resume(failed.checkpoint_id)
            assert (result.status, result.output) == ("completed", DONE)
            assert world.runs == {"lookup": 1}
            assert len(srv.requests) == requests + 1


# a stopped resume, a stop before anything ran, approvals kept, the span -------------------


async def test_a_stopped_stream_resume_keeps_a_checkpoint_and_resumes_exactly_once() -> None:
    world = World()
    with FakeOpenAIServer() as srv:
        _script("openai", srv, "decided")
        _text("openai", srv, LONG, SLOW)
        async with _provider("openai", srv, world.store) as provider:
            runtime = Runtime(_program(provider, world))
            first = await _consume_and_stop(
                runtime, "break", _stops_here("text", world), world, "decided"
            )
            assert first.checkpoint_id is not None
            assert world.runs == {"lookup": 1}
            _text("openai", srv, LONG, SLOW)  # the resume is stopped too, mid-reply
            async with runtime.stream_resume(first.checkpoint_id) as again:
                async for event in again:
                    if isinstance(event, TextDelta):
                        break
            second = again.result
            assert second.status == "cancelled"
            assert second.checkpoint_id not in (None, first.checkpoint_id)
            assert second.trace.entries[-1]["stage"] == "deciding"
            assert await runtime.checkpoints.get(first.checkpoint_id) is None
            _text("openai", srv, DONE)
            result = await runtime.resume(second.checkpoint_id or "")
            assert (result.status, result.output) == ("completed", DONE)
            assert world.runs == {"lookup": 1}
            assert len(result.trace.of_kind("decision_cancelled")) == 2


async def test_a_stop_before_the_invocation_began_changes_nothing() -> None:
    world = World()
    with FakeOpenAIServer() as srv:
        _script("openai", srv, "decided")
        _text("openai", srv, LONG, SLOW)
        async with _provider("openai", srv, world.store) as provider:
            runtime = Runtime(_program(provider, world))
            stopped = await _consume_and_stop(
                runtime, "exit", _stops_here("text", world), world, "decided"
            )
            checkpoint_id = stopped.checkpoint_id or ""
            saved = await runtime.checkpoints.get(checkpoint_id)
            untouched = runtime.stream_resume(checkpoint_id)
            async with untouched:
                pass  # left at once: the resume never began
            assert untouched.stopped
            with pytest.raises(ConfigurationError, match="before its invocation began"):
                _ = untouched.result
            assert await runtime.checkpoints.get(checkpoint_id) == saved
            fresh = runtime.stream("support", input="A?")
            async with fresh:
                pass
            with pytest.raises(ConfigurationError, match="before its invocation began"):
                _ = fresh.result
            assert len(srv.requests) == 2


async def test_calls_awaiting_approval_stay_pending_in_the_cancelled_checkpoint() -> None:
    world = World()
    paid: list[str] = []
    with FakeOpenAIServer() as srv:
        srv.script_response(
            openai_function_call("pay", {"invoice": "I-1"}, call_id="p1"),
            openai_function_call("slow", {"q": "A"}, call_id="s1"),
        )
        async with _provider("openai", srv, world.store) as provider:
            program = _program(provider, world)

            @program.capability(requires_approval=True)
            async def pay(invoice: str) -> str:
                paid.append(invoice)
                return "paid"

            program.agent("billing", provider=provider, capabilities=("pay", "slow"))
            runtime = Runtime(program)
            async with runtime.stream("billing", input="pay I-1") as stream:
                async for event in stream:
                    if isinstance(event, ToolCallStarted):
                        await asyncio.wait_for(world.slow_started.wait(), 5)
                        break
            stopped = stream.result
            assert stopped.status == "cancelled"
            assert [c.call_id for c in stopped.pending] == ["p1"]
            with pytest.raises(ConfigurationError, match="not pending"):
                await runtime.resume(stopped.checkpoint_id or "", {"s1": True})
            _text("openai", srv, DONE)
            result = await runtime.resume(stopped.checkpoint_id or "", {"p1": True})
            assert (result.status, result.output) == ("completed", DONE)
            assert (paid, world.runs) == (["I-1"], {"slow": 1})


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = test_telemetry._EXPORTER
    exporter.clear()
    yield exporter
    exporter.clear()


async def test_the_invoke_agent_span_says_cancelled(spans: InMemorySpanExporter) -> None:
    world = World()
    with FakeOpenAIServer() as srv:
        _script("openai", srv, "text")
        async with _provider("openai", srv, world.store) as provider:
            runtime = Runtime(_program(provider, world))
            await _consume_and_stop(runtime, "break", _stops_here("text", world), world, "text")
    [span] = [s for s in spans.get_finished_spans() if s.name == "invoke_agent support"]
    assert (span.attributes or {}).get("touba.status") == "cancelled"


class _SlowSaves(SqliteCheckpointStore):
    """Checkpoints whose ``save`` takes 0.2 s: a second cancel lands during the stop's."""

    async def save(self, checkpoint_id: str, checkpoint: dict[str, Any]) -> None:
        await asyncio.sleep(0.2)
        await super().save(checkpoint_id, checkpoint)


@pytest.mark.parametrize("point", ["decided", "capability"])
async def test_a_consumer_cancelled_twice_still_gets_its_checkpoint_saved(
    point: str, tmp_path: Path
) -> None:
    world = World()
    checkpoints = _SlowSaves(str(tmp_path / "cp.db"))
    try:
        with FakeOpenAIServer() as srv:
            _script("openai", srv, point)
            async with _provider("openai", srv, world.store) as provider:
                runtime = Runtime(_program(provider, world), checkpoints)
                here = _stops_here(point, world)
                stream = runtime.stream("support", input="A?", run_id="run-1")
                reached = asyncio.Event()

                async def consumer() -> None:
                    async with stream:
                        async for event in stream:
                            if here(event):
                                if point == "capability":
                                    await asyncio.wait_for(world.slow_started.wait(), 5)
                                reached.set()
                                await asyncio.sleep(30)

                task = asyncio.create_task(consumer())
                await asyncio.wait_for(reached.wait(), 5)
                task.cancel()
                await asyncio.sleep(0.05)
                task.cancel()  # again, while the stop is being written
                with pytest.raises(asyncio.CancelledError):
                    await task
                stopped = stream.result  # settled before the consumer's task ended
                assert stopped.status == "cancelled"
                assert stopped.trace.entries[-1].kind == "decision_cancelled"
                saved = await checkpoints.list(run_id="run-1")
                assert [(c.checkpoint_id, c.status) for c in saved] == [
                    (stopped.checkpoint_id, "cancelled")
                ]
                _text("openai", srv, DONE)
                result = await runtime.resume(stopped.checkpoint_id or "")
                assert (result.status, result.output) == ("completed", DONE)
                assert world.runs == ({"slow": 1} if point == "capability" else {"lookup": 1})
    finally:
        await checkpoints.close()


class _SlowReplaces(SqliteCheckpointStore):
    """Checkpoints whose ``replace`` takes 0.2 s while ``slow`` says so: a removal (the
    journal's at the end, ``checkpoint is None``) or a claim (a running journal)."""

    slow: str | None = None  # "removals", "claims" or None

    async def replace(self, checkpoint_id: str, checkpoint: Any, *, revision: int) -> bool:
        if self.slow == ("removals" if checkpoint is None else "claims"):
            await asyncio.sleep(0.2)
        return bool(await super().replace(checkpoint_id, checkpoint, revision=revision))


async def test_a_stop_after_the_last_decision_leaves_the_invocations_own_result(
    tmp_path: Path,
) -> None:
    world = World()
    checkpoints = _SlowReplaces(str(tmp_path / "cp.db"))
    checkpoints.slow = "removals"
    try:
        with FakeOpenAIServer() as srv:
            _script("openai", srv, "decided")
            _text("openai", srv, DONE)
            async with _provider("openai", srv, world.store) as provider:
                runtime = Runtime(_program(provider, world), checkpoints)
                async with runtime.stream("support", input="A?", run_id="run-1") as stream:
                    async for event in stream:
                        if isinstance(event, DecisionCompleted) and event.final:
                            break  # the journal is being removed: the invocation completed
                assert stream.stopped
                result = stream.result
                assert (result.status, result.output) == ("completed", DONE)
                assert result.trace.entries[-1].kind == "invocation_completed"
                assert await checkpoints.list(run_id="run-1") == []  # its removal finished
                assert world.runs == {"lookup": 1}
    finally:
        await checkpoints.close()


async def test_a_flow_stopped_in_a_call_step_resumes_from_that_step() -> None:
    world = World()
    with FakeOpenAIServer() as srv:
        async with _provider("openai", srv, world.store) as provider:
            program = _program(provider, world)
            program.agent(
                "steps",
                provider=provider,
                capabilities=("lookup", "slow"),
                kind="flow",
                steps=(
                    Step.call("lookup", {"q": "A"}),
                    Step.call("slow", {"q": "B"}, on_error="continue"),
                    Step.model("reply"),
                ),
            )
            runtime = Runtime(program)
            async with runtime.stream("steps", input="A and B") as stream:
                async for event in stream:
                    if isinstance(event, ToolCallStarted) and event.name == "slow":
                        await asyncio.wait_for(world.slow_started.wait(), 5)
                        break
            stopped = stream.result
            assert stopped.status == "cancelled"
            assert stopped.checkpoint_id is not None
            assert stopped.trace.entries[-1]["interrupted"] == 1
            _text("openai", srv, DONE)
            result = await runtime.resume(stopped.checkpoint_id)
            assert (result.status, result.output) == ("completed", DONE), result.error
            assert world.runs == {"lookup": 1, "slow": 1}
            [slow] = [e for e in result.trace.of_kind("flow_step_finished") if e.get("index") == 1]
            assert slow["status"] == "error"


async def test_a_resume_stopped_while_it_claims_its_checkpoint_gives_it_back(
    tmp_path: Path,
) -> None:
    world = World()
    checkpoints = _SlowReplaces(str(tmp_path / "cp.db"))
    try:
        with FakeOpenAIServer() as srv:
            _script("openai", srv, "decided")
            async with _provider("openai", srv, world.store) as provider:
                runtime = Runtime(_program(provider, world), checkpoints)
                first = await _consume_and_stop(
                    runtime, "exit", _stops_here("decided", world), world, "decided"
                )
                assert first.checkpoint_id is not None
                checkpoints.slow = "claims"
                resumed = runtime.stream_resume(first.checkpoint_id)
                async with resumed:
                    await asyncio.sleep(0.05)  # left while the claim is being written
                again = resumed.result
                assert again.status == "cancelled"
                assert again.checkpoint_id not in (None, first.checkpoint_id)
                saved = await checkpoints.list(run_id="run-1")
                assert [(c.checkpoint_id, c.status) for c in saved] == [
                    (again.checkpoint_id, "cancelled")
                ]
                checkpoints.slow = None
                _text("openai", srv, DONE)
                result = await runtime.resume(again.checkpoint_id or "")
                assert (result.status, result.output) == ("completed", DONE), result.error
                assert world.runs == {"lookup": 1}
                assert len(srv.requests) == 2  # the first decision was never asked again
    finally:
        await checkpoints.close()
