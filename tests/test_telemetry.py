"""OpenTelemetry spans (issue 12, section 4), recorded by the SDK's in-memory exporter.

The span tree of one invocation that trims its window with the context guard
(OpenAI provider against the fake server, through the official SDK), runs a
delegate, pauses for an approval and is resumed. No content on any span
unless the host opts in; and touba works with no OpenTelemetry installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from touba.providers import ContextConfig, create_openai_decision_provider
from touba.runtime import InvocationResult, Program, Runtime
from touba.testing import ScriptedProvider
from touba.testing.fakes import FakeOpenAIServer, openai_function_call, openai_text

ROOT = Path(__file__).resolve().parents[1]
SECRET_ORDER = "ORDER-SECRET-77"
_EXPORTER = InMemorySpanExporter()


def _install() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)


_install()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def outputs_cost(body: dict[str, Any]) -> int:
    return 100 + 1000 * sum(1 for i in body["input"] if i.get("type") == "function_call_output")


def build(client: openai.AsyncOpenAI) -> tuple[Program, list[str]]:
    ran: list[str] = []
    provider = create_openai_decision_provider(
        model="gpt-otel",
        client=client,
        # fits one function_call_output at most: 100 + 1000 * outputs + 100 <= 1300
        context=ContextConfig(1300, input_token_multiplier=1, safety_margin_tokens=0),
        max_output_tokens=100,
    )
    program = Program()

    @program.capability
    async def lookup_order(order_id: str) -> str:
        ran.append(f"lookup {order_id}")
        return f"{order_id} shipped"

    @program.capability(requires_approval=True)
    async def refund(order_id: str) -> str:
        ran.append(f"refund {order_id}")
        return "refunded"

    program.delegate("checker")
    program.agent("support", provider=provider, capabilities=("lookup_order", "refund", "checker"))
    program.agent("checker", provider=ScriptedProvider(ScriptedProvider.final("looks fine")))
    return program, ran


async def run_scenario() -> tuple[InvocationResult, InvocationResult]:
    with FakeOpenAIServer(count_tokens=outputs_cost) as srv:
        srv.script_response(
            openai_function_call("lookup_order", {"order_id": SECRET_ORDER}, call_id="call_l1")
        )
        srv.script_response(openai_function_call("checker", {"input": "check"}, call_id="call_d1"))
        srv.script_response(
            openai_function_call("refund", {"order_id": SECRET_ORDER}, call_id="call_r1")
        )
        srv.script_response(openai_text("Refunded."))
        base_url = srv.base_url + "/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-otel", max_retries=0) as c:
            program, ran = build(c)
            runtime = Runtime(program)
            paused = await runtime.invoke("support", input="refund my order", run_id="run-otel")
            assert paused.status == "awaiting_approval", paused.error
            done = await runtime.resume(paused.checkpoint_id or "", {"call_r1": True})
            assert done.status == "completed", done.error
            assert ran == [f"lookup {SECRET_ORDER}", f"refund {SECRET_ORDER}"]
            return paused, done


def children(all_spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    return [
        s for s in all_spans if s.parent is not None and s.parent.span_id == parent.context.span_id
    ]


def named(all_spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in all_spans if s.name == name]


async def test_the_span_tree_of_an_invocation_with_a_trim_a_delegate_and_an_approval(
    spans: InMemorySpanExporter,
) -> None:
    paused, done = await run_scenario()
    finished = list(spans.get_finished_spans())

    first, resumed = named(finished, "invoke_agent support")
    assert first.parent is None
    assert resumed.parent is None
    assert first.attributes is not None
    assert resumed.attributes is not None
    assert first.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert first.attributes["gen_ai.agent.name"] == "support"
    assert first.attributes["gen_ai.conversation.id"] == "run-otel"
    assert first.attributes["touba.invocation_id"] == paused.invocation_id
    assert first.attributes["touba.status"] == "awaiting_approval"
    assert [e.name for e in first.events] == ["touba.approval_requested"]
    assert resumed.attributes["touba.status"] == "completed"
    assert resumed.attributes["touba.resumed"] is True

    chats = [s for s in children(finished, first) if s.name == "chat gpt-otel"]
    assert len(chats) == 3
    for chat in chats:
        assert chat.kind == trace.SpanKind.CLIENT
        assert chat.attributes is not None
        assert chat.attributes["gen_ai.provider.name"] == "openai"
        assert chat.attributes["gen_ai.request.model"] == "gpt-otel"
        assert isinstance(chat.attributes["gen_ai.usage.input_tokens"], int)
        assert isinstance(chat.attributes["gen_ai.usage.output_tokens"], int)
        transaction = children(finished, chat)
        assert [s.name for s in transaction] == ["touba.history.transaction"]
        counts = named(children(finished, transaction[0]), "count_tokens gpt-otel")
        assert len(counts) == chat.attributes["touba.guard.counts"]
    keys = {chat.attributes["touba.session_key"] for chat in chats if chat.attributes}
    assert len(keys) == 1  # one conversation: this invocation's
    assert all(isinstance(k, str) and len(k) > 32 for k in keys)
    third = chats[2].attributes
    assert third is not None
    assert third["touba.trimmed.exchanges"] == 1  # the guard dropped the lookup
    assert third["touba.guard.fits"] is True
    assert third["touba.window.messages"] == 2

    tools = {s.name: s for s in children(finished, first)}
    lookup, checker = tools["execute_tool lookup_order"], tools["execute_tool checker"]
    assert lookup.attributes is not None
    assert lookup.attributes["gen_ai.tool.call.id"] == "call_l1"
    assert lookup.attributes["touba.call.status"] == "ok"
    [child] = children(finished, checker)
    assert child.name == "invoke_agent checker"
    assert child.attributes is not None
    assert child.attributes["touba.status"] == "completed"
    assert child.attributes["touba.invocation_id"] != paused.invocation_id
    assert [s.name for s in children(finished, child)] == ["chat scripted"]

    [refund] = named(children(finished, resumed), "execute_tool refund")
    assert refund.attributes is not None
    assert refund.attributes["touba.call.status"] == "ok"
    assert done.invocation_id == paused.invocation_id

    everything = json.dumps([dict(s.attributes or {}) for s in finished])
    events = json.dumps([dict(e.attributes or {}) for s in finished for e in s.events])
    for secret in (SECRET_ORDER, "shipped", "refund my order", "sk-otel", "Refunded."):
        assert secret not in everything + events


async def test_arguments_and_results_only_when_the_host_opts_in(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    await run_scenario()
    [lookup] = named(list(spans.get_finished_spans()), "execute_tool lookup_order")
    assert lookup.attributes is not None
    assert json.loads(str(lookup.attributes["gen_ai.tool.call.arguments"])) == {
        "order_id": SECRET_ORDER
    }
    assert (
        json.loads(str(lookup.attributes["gen_ai.tool.call.result"])) == f"{SECRET_ORDER} shipped"
    )


async def test_a_refusal_marks_its_spans_with_the_touba_error_code(
    spans: InMemorySpanExporter,
) -> None:
    from touba.history import HistoryConfig, MemoryHistoryStore

    history = HistoryConfig(store=MemoryHistoryStore(max_sessions=1), namespace="otel")
    model = ScriptedProvider(ScriptedProvider.final("one"), history=history)
    program = Program()
    program.agent("a", provider=model)
    runtime = Runtime(program)
    assert (await runtime.invoke("a")).status == "completed"
    refused = await runtime.invoke("a")
    assert refused.status == "failed"
    chat = named(list(spans.get_finished_spans()), "chat scripted")[-1]
    assert chat.attributes is not None
    assert chat.attributes["error.type"] == "DecisionHistoryLimitExceeded"
    assert chat.attributes["touba.limit"] == "max_sessions"
    assert chat.status.status_code == trace.StatusCode.ERROR


def test_touba_runs_without_opentelemetry_installed() -> None:
    script = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import asyncio, touba\n"
        "from touba.runtime import Program, Runtime\n"
        "from touba.testing import ScriptedProvider\n"
        "p = Program(); p.agent('a', provider=ScriptedProvider(ScriptedProvider.final('ok')))\n"
        "r = asyncio.run(Runtime(p).invoke('a'))\n"
        "assert r.status == 'completed', r.error\n"
        "assert 'opentelemetry.trace' not in sys.modules\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_spans_start_only_once_a_tracer_provider_is_set() -> None:
    """No provider: no span is started (the API's no-op would record nothing);
    a provider set afterwards, in the same process, gets every span."""
    script = (
        "import asyncio\n"
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import "
        "InMemorySpanExporter\n"
        "from touba import _telemetry\n"
        "from touba.runtime import Program, Runtime\n"
        "from touba.testing import ScriptedProvider\n"
        "def run():\n"
        "    p = Program(); p.agent('a', provider=ScriptedProvider(ScriptedProvider.final('ok')))\n"
        "    r = asyncio.run(Runtime(p).invoke('a'))\n"
        "    assert r.status == 'completed', r.error\n"
        "with _telemetry.span('probe') as before:\n"
        "    assert before is None, before\n"
        "run()\n"
        "exporter = InMemorySpanExporter()\n"
        "provider = TracerProvider()\n"
        "provider.add_span_processor(SimpleSpanProcessor(exporter))\n"
        "trace.set_tracer_provider(provider)\n"
        "with _telemetry.span('probe') as after:\n"
        "    assert after is not None and after.is_recording()\n"
        "run()\n"
        "print(sorted({s.name.split()[0] for s in exporter.get_finished_spans()}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("OTEL_PYTHON_TRACER_PROVIDER", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['chat', 'invoke_agent', 'probe', 'touba.history.transaction']"


async def test_lifecycle_is_logged_at_info_without_content(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from touba.history import HistoryConfig, MemoryHistoryStore

    caplog.set_level("INFO", logger="touba")
    history = HistoryConfig(store=MemoryHistoryStore(max_sessions=1), namespace="logs")

    def down(request: Any, messages: Any) -> dict[str, Any]:
        raise RuntimeError("503")

    model = ScriptedProvider(
        ScriptedProvider.call("lookup_order", order_id=SECRET_ORDER), down, history=history
    )
    program = Program()

    @program.capability
    async def lookup_order(order_id: str) -> str:
        return f"{order_id} shipped"

    program.agent("a", provider=model, capabilities=("lookup_order",))
    runtime = Runtime(program)
    failed = await runtime.invoke("a", input="where is my order")
    assert failed.checkpoint_id is not None
    refused = await runtime.invoke("a")  # a second conversation: the store is full
    assert refused.status == "failed"
    messages = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert any(
        name == "touba.runtime" and level == "INFO" and failed.checkpoint_id in text
        for name, level, text in messages
    )
    assert any(
        name == "touba.history" and "refused: DecisionHistoryLimitExceeded (max_sessions)" in text
        for name, _, text in messages
    )
    logged = "\n".join(text for _, _, text in messages)
    for secret in (SECRET_ORDER, "shipped", "where is my order"):
        assert secret not in logged


async def test_a_recovered_reservation_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    from touba.errors import DecisionHistoryBusy
    from touba.history.sqlite import SqliteHistoryStore

    caplog.set_level("INFO", logger="touba.history")
    held, release = asyncio.Event(), asyncio.Event()

    async def stuck(record: Any) -> tuple[Any, None]:
        held.set()
        await release.wait()
        return {"any": "record"}, None

    async with SqliteHistoryStore(tmp_path / "h.sqlite") as store:
        task = asyncio.create_task(store.transact("key-1", stuck))
        await held.wait()
        assert await store.recover("key-1", worker_stopped=True)
        release.set()
        with pytest.raises(DecisionHistoryBusy):
            await task  # the late save of the "crashed" worker is refused
    assert any(
        r.name == "touba.history" and "recovered the reservation of conversation key-1" in r.message
        for r in caplog.records
    )


async def test_a_streamed_decision_records_its_time_to_first_token_and_a_cancel(
    spans: InMemorySpanExporter,
) -> None:
    from touba.providers import DecisionRequest
    from touba.testing.fakes import StreamKnobs

    async def sink(delta: object) -> None:
        pass

    with FakeOpenAIServer() as srv:
        srv.script_response(openai_text("streamed reply"), stream=StreamKnobs(event_delay=0.01))
        srv.script_response(openai_text("plain reply"))
        srv.script_response(openai_text("a long reply " * 20), stream=StreamKnobs(event_delay=0.05))
        async with openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="k") as client:
            provider = create_openai_decision_provider(
                model="gpt-otel", client=client, history=False
            )
            await provider.decide(DecisionRequest(input="x"), sink=sink)
            await provider.decide(DecisionRequest(input="x"))
            task = asyncio.create_task(provider.decide(DecisionRequest(input="x"), sink=sink))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    streamed, plain, cancelled = named(list(spans.get_finished_spans()), "chat gpt-otel")
    assert streamed.attributes is not None
    assert plain.attributes is not None
    assert cancelled.attributes is not None
    ttft = streamed.attributes["gen_ai.server.time_to_first_token"]
    assert isinstance(ttft, float)
    assert 0.02 < ttft < 5  # the fake spaced its first events by 10 ms each
    assert "gen_ai.server.time_to_first_token" not in plain.attributes
    assert cancelled.attributes["touba.cancelled"] is True
    assert "touba.cancelled" not in streamed.attributes
