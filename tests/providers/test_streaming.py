"""Streaming decisions: every provider streams through its SDK, against the fakes.

The same scripted answers, streamed and not, leave byte-identical stored
history and equal traces (reasoning items and signatures, several calls in
one decision, a structured final output). A stream that breaks is
``AgentDecisionProviderUnavailable``, one that ends early or carries cut
tool-call JSON a schema violation, and nothing of it is stored; events of
unknown types are ignored; a cancelled decision closes the vendor's response.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any

import pytest

from tests._providers import anthropic_sdk, fake_server, vendor_provider
from touba.errors import AgentDecisionProviderSchemaViolation, AgentDecisionProviderUnavailable
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.providers import CapabilitySpec, DecisionProvider, DecisionRequest
from touba.providers._stream import DecisionDelta, StreamedCall, StreamedDecision, StreamedText
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.runtime import Program, Runtime
from touba.runtime import _invocation as invocation_module
from touba.runtime import _runtime as runtime_module
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeProviderServer,
    StreamKnobs,
    anthropic_redacted_thinking,
    anthropic_text,
    anthropic_thinking,
    anthropic_tool_use,
    chat_tool_call,
    gemini_function_call,
    gemini_text,
    gemini_thought,
    openai_function_call,
    openai_reasoning,
    openai_text,
)

VENDORS = ("openai", "compatible", "anthropic", "gemini")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
ANSWER = {"answer": "A and B have shipped"}
LOOKUP = CapabilitySpec(
    "lookup",
    "Look an order up",
    {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
)
REPLY = "Let me look both orders up, one after the other."
SECRET = "SECRET-EVENT-CONTENT"
REASONING = {
    "openai": ['"encrypted_content"', "Two orders to check."],
    "compatible": ['"reasoning_content"', "Two orders to check."],
    "anthropic": ['"signature"', '"redacted_thinking"', "Two orders to check."],
    "gemini": ['"thoughtSignature"', "Two orders to check."],
}


# one vendor: its fake, a provider on it, its scripted answers ---------------------------


def _provider(
    vendor: str, srv: FakeProviderServer, history: HistoryConfig | bool, **options: Any
) -> AbstractAsyncContextManager[DecisionProvider]:
    """``vendor_provider``, Anthropic's with adaptive thinking unless told otherwise."""
    if vendor == "anthropic":
        options.setdefault("thinking", {"type": "adaptive"})
    return vendor_provider(vendor, srv, history, **options)


def _script_calls(vendor: str, srv: Any, **knobs: Any) -> None:
    """Reasoning (with its signature), visible text, then two calls in one decision."""
    if vendor == "openai":
        srv.script_response(
            openai_reasoning("Two orders to check."),
            openai_text(REPLY),
            openai_function_call("lookup", {"q": "A"}),
            openai_function_call("lookup", {"q": "B"}),
            **knobs,
        )
    elif vendor == "compatible":
        srv.script_chat_completion(
            REPLY,
            tool_calls=[chat_tool_call("lookup", {"q": "A"}), chat_tool_call("lookup", {"q": "B"})],
            extra={"reasoning_content": "Two orders to check."},
            **knobs,
        )
    elif vendor == "anthropic":
        srv.script_response(
            anthropic_thinking("Two orders to check."),
            anthropic_redacted_thinking(),
            anthropic_text(REPLY),
            anthropic_tool_use("lookup", {"q": "A"}),
            anthropic_tool_use("lookup", {"q": "B"}),
            **knobs,
        )
    else:
        srv.script_response(
            gemini_thought("Two orders to check."),
            gemini_text(REPLY),
            gemini_function_call("lookup", {"q": "A"}),
            gemini_function_call("lookup", {"q": "B"}, signed=False),
            **knobs,
        )


def _script_final(vendor: str, srv: Any) -> None:
    """Reasoning, then the structured final output."""
    if vendor == "openai":
        srv.script_response(
            openai_reasoning("Both found."), openai_text(json.dumps({"output": ANSWER}))
        )
    elif vendor == "compatible":
        srv.script_chat_completion(json.dumps(ANSWER), extra={"reasoning_content": "Both found."})
    elif vendor == "anthropic":
        srv.script_response(anthropic_thinking("Both found."), anthropic_text(json.dumps(ANSWER)))
    else:
        srv.script_response(gemini_thought("Both found."), gemini_text(json.dumps(ANSWER)))


@contextmanager
def _fixed_ids(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    counter = itertools.count()

    def new_id() -> str:
        return f"id-{next(counter)}"

    with monkeypatch.context() as patch:
        patch.setattr(invocation_module, "new_id", new_id)
        patch.setattr(runtime_module, "new_id", new_id)
        yield


def _streaming(provider: DecisionProvider, deltas: list[DecisionDelta]) -> None:
    """Make the runtime's ``decide`` calls stream into ``deltas``."""
    plain = provider.decide

    async def sink(delta: DecisionDelta) -> None:
        deltas.append(delta)

    async def decide(request: DecisionRequest, *, sink_: Any = None) -> Any:
        return await plain(request, sink=sink)

    provider.decide = decide  # type: ignore[method-assign, assignment]


async def _run(
    vendor: str, *, streamed: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, list[Any], list[DecisionDelta], FakeProviderServer]:
    store = MemoryHistoryStore()
    deltas: list[DecisionDelta] = []
    with fake_server(vendor, seed=26, secret=b"k" * 32) as srv, _fixed_ids(monkeypatch):
        _script_calls(vendor, srv)
        _script_final(vendor, srv)
        async with _provider(vendor, srv, HistoryConfig(store=store, namespace="test")) as provider:
            if streamed:
                _streaming(provider, deltas)
            program = Program()

            @program.capability()
            async def lookup(q: str) -> str:
                return f"{q} shipped"

            program.agent(
                "support", provider=provider, capabilities=("lookup",), output_schema=SCHEMA
            )
            result = await Runtime(program).invoke("support", input="A and B?", run_id="run-1")
        assert result.status == "completed", result.error
        assert result.output == ANSWER
        [conversation] = await store.list()
        record = dict(await store.read(conversation.key) or {})
        del record["created_at"], record["updated_at"]  # wall-clock times, and the plot's:
        for point in record["plot"]["points"]:
            point[1] = "at"
        trace = [
            (e.kind, e.run_id, e.invocation_id, e.agent_ref, dict(e.data)) for e in result.trace
        ]
        return json.dumps(record, sort_keys=True), trace, deltas, srv


@pytest.mark.parametrize("vendor", VENDORS)
async def test_streamed_and_not_streamed_store_the_same_history_and_trace(
    vendor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_record, plain_trace, none, plain_srv = await _run(
        vendor, streamed=False, monkeypatch=monkeypatch
    )
    record, trace, deltas, srv = await _run(vendor, streamed=True, monkeypatch=monkeypatch)
    assert none == []
    assert plain_srv.streams == []
    assert [s.outcome for s in srv.streams] == ["completed", "completed"]
    assert record == plain_record  # byte-identical (wall-clock times aside)
    assert trace == plain_trace
    for marker in REASONING[vendor]:  # reasoning and its signatures are kept
        assert marker in record
    # Two calls started, then the decision; a second decision; no text (output_schema is
    # set: a structured final output is delivered whole, in the decision).
    kinds = [type(d).__name__ for d in deltas]
    assert kinds == ["StreamedCall", "StreamedCall", "StreamedDecision", "StreamedDecision"]
    assert [d.index for d in deltas if isinstance(d, StreamedCall)] == [0, 1]
    final = deltas[-1]
    assert isinstance(final, StreamedDecision)
    assert final.decision.output == ANSWER


@pytest.mark.parametrize("vendor", VENDORS)
async def test_a_plain_text_reply_streams_as_text_pieces(vendor: str) -> None:
    deltas: list[DecisionDelta] = []

    async def sink(delta: DecisionDelta) -> None:
        deltas.append(delta)

    with fake_server(vendor) as srv:
        _script_calls(vendor, srv)
        async with _provider(vendor, srv, False) as provider:
            decision = await provider.decide(
                DecisionRequest(input="A and B?", capabilities=(LOOKUP,)), sink=sink
            )
    texts = [d.text for d in deltas if isinstance(d, StreamedText)]
    assert len(texts) > 1  # pieces, as they were written
    assert "".join(texts) == decision.text == REPLY
    started = [d for d in deltas if isinstance(d, StreamedCall)]
    assert [s.name for s in started] == ["lookup", "lookup"]
    if vendor != "gemini":  # Gemini sends no call ids: touba names them once complete
        assert [s.call_id for s in started] == [c.call_id for c in decision.calls]
    assert deltas[-1] == StreamedDecision(decision)


@pytest.mark.parametrize("vendor", VENDORS)
async def test_the_structured_interface_streams_no_text(vendor: str) -> None:
    deltas: list[DecisionDelta] = []

    async def sink(delta: DecisionDelta) -> None:
        deltas.append(delta)

    decision_json = json.dumps({"action": "final", "output": "done"})
    with fake_server(vendor) as srv:
        if vendor == "openai":
            srv.script_response(openai_text(decision_json))  # type: ignore[attr-defined]
        elif vendor == "compatible":
            srv.script_chat_completion(decision_json)  # type: ignore[attr-defined]
        elif vendor == "anthropic":
            srv.script_response(  # type: ignore[attr-defined]
                anthropic_text("Deciding."),
                anthropic_tool_use("touba_decision", {"action": "final", "output": "done"}),
            )
        else:
            srv.script_response(gemini_text(decision_json))  # type: ignore[attr-defined]
        async with _provider(vendor, srv, False, decision_interface="structured") as provider:
            decision = await provider.decide(DecisionRequest(input="go"), sink=sink)
    assert decision.output == "done"
    assert not [d for d in deltas if isinstance(d, StreamedText)]
    assert deltas[-1] == StreamedDecision(decision)


# faults: nothing partial is stored ------------------------------------------------------


async def _decide_and_fail(
    vendor: str, script: Callable[[Any], None], error: type[Exception]
) -> Exception:
    """A decision streamed from ``script``; returns the error it raised, having checked
    that nothing was stored and that the conversation takes its next decision."""
    store = MemoryHistoryStore()
    request = DecisionRequest(
        run_id="r", invocation_id="i", agent_ref="a", input="A and B?", capabilities=(LOOKUP,)
    )

    async def sink(delta: DecisionDelta) -> None:
        pass

    with fake_server(vendor) as srv:
        script(srv)
        async with _provider(vendor, srv, HistoryConfig(store=store, namespace="test")) as provider:
            with pytest.raises(error) as raised:
                await provider.decide(request, sink=sink)
            assert [c.messages for c in await store.list()] in ([], [0])
            _script_calls(vendor, srv)  # the same conversation: not busy, nothing half-saved
            decision = await provider.decide(request, sink=sink)
            assert len(decision.calls) == 2
    return raised.value


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("after", [0, 1, 4])
async def test_a_connection_cut_midway_is_unavailable(vendor: str, after: int) -> None:
    def script(srv: Any) -> None:
        _script_calls(vendor, srv, stream=StreamKnobs(cut_after=after))

    await _decide_and_fail(vendor, script, AgentDecisionProviderUnavailable)


FAILURES = [
    ("openai", "error"),
    ("openai", "response.failed"),
    ("compatible", None),
    ("anthropic", "overloaded_error"),
    ("anthropic", "api_error"),
    ("gemini", None),
]


@pytest.mark.parametrize(("vendor", "failure"), FAILURES)
async def test_an_error_event_midway_is_unavailable(vendor: str, failure: str | None) -> None:
    def script(srv: Any) -> None:
        _script_calls(vendor, srv, stream=StreamKnobs(fail_after=3, failure=failure))

    error = await _decide_and_fail(vendor, script, AgentDecisionProviderUnavailable)
    # what the vendor said is in the error's text, apart from touba's own words
    assert isinstance(error, AgentDecisionProviderUnavailable)
    assert error.server_message, "the vendor's message is kept"
    assert error.server_message in str(error)
    assert error.server_message not in error.message
    assert error.retryable  # a server failure while streaming: the same request may work
    if failure is not None and vendor == "anthropic":
        assert failure in error.message


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("after", [0, 3])
async def test_a_stream_ending_early_is_a_schema_violation(vendor: str, after: int) -> None:
    def script(srv: Any) -> None:
        _script_calls(vendor, srv, stream=StreamKnobs(end_after=after))

    error = await _decide_and_fail(vendor, script, AgentDecisionProviderSchemaViolation)
    assert error.provider_error_code == "incomplete_stream"  # type: ignore[attr-defined]


CUT_JSON = '{"q": "A'


@pytest.mark.parametrize("vendor", ["openai", "compatible", "anthropic"])
@pytest.mark.parametrize("arguments", [CUT_JSON, '{"q": "A"} trailing'])
async def test_cut_or_invalid_tool_call_json_is_a_schema_violation(
    vendor: str, arguments: str
) -> None:
    def script(srv: Any) -> None:
        if vendor == "openai":
            srv.script_response(openai_function_call("lookup", arguments))
        elif vendor == "compatible":
            srv.script_chat_completion(tool_calls=[chat_tool_call("lookup", arguments)])
        else:
            srv.script_response(anthropic_tool_use("lookup", arguments))

    error = await _decide_and_fail(vendor, script, AgentDecisionProviderSchemaViolation)
    assert error.provider_error_code == "invalid_json"  # type: ignore[attr-defined]


UNKNOWN: dict[str, list[tuple[int, str | None, object]]] = {
    "openai": [(2, "response.future_event", {"type": "response.future_event", "x": SECRET})],
    "anthropic": [
        (2, "future_event", {"type": "future_event", "x": SECRET}),
        (
            4,
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "x_delta", "x": SECRET}},
        ),
    ],
    "compatible": [(2, None, {"object": "future.chunk", "x": SECRET, "choices": []})],
    "gemini": [(1, None, {"futureField": SECRET})],
}


@pytest.mark.parametrize("vendor", VENDORS)
async def test_events_of_unknown_types_are_ignored_and_logged_without_content(
    vendor: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def sink(delta: DecisionDelta) -> None:
        pass

    caplog.set_level(logging.DEBUG, logger="touba.providers.stream")
    with fake_server(vendor) as srv:
        _script_calls(vendor, srv, stream=StreamKnobs(insert=tuple(UNKNOWN[vendor])))
        async with _provider(vendor, srv, False) as provider:
            decision = await provider.decide(
                DecisionRequest(input="A and B?", capabilities=(LOOKUP,)), sink=sink
            )
    assert [c.arguments for c in decision.calls] == [{"q": "A"}, {"q": "B"}]
    assert SECRET not in caplog.text
    if vendor in ("openai", "anthropic"):  # typed events: the unknown type is named
        assert "unknown type" in caplog.text


# a cancelled decision ---------------------------------------------------------------------


@pytest.mark.parametrize("vendor", VENDORS)
async def test_a_cancelled_decision_closes_the_response_and_stores_nothing(vendor: str) -> None:
    store = MemoryHistoryStore()
    request = DecisionRequest(
        run_id="r", invocation_id="i", agent_ref="a", input="A and B?", capabilities=(LOOKUP,)
    )
    first_text = asyncio.Event()

    async def sink(delta: DecisionDelta) -> None:
        if isinstance(delta, StreamedText):
            first_text.set()

    with fake_server(vendor) as srv:
        _script_calls(vendor, srv, stream=StreamKnobs(event_delay=0.05))
        async with _provider(vendor, srv, HistoryConfig(store=store, namespace="test")) as provider:
            task = asyncio.create_task(provider.decide(request, sink=sink))
            await asyncio.wait_for(first_text.wait(), 5)
            stopped = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            record = srv.wait_stream_end()
            assert record.outcome == "client_closed"
            assert record.closed_at is not None
            assert record.closed_at - stopped < 0.1
            assert [c.messages for c in await store.list()] in ([], [0])
            _script_calls(vendor, srv)  # the reservation was released at once
            decision = await provider.decide(request, sink=sink)
            assert len(decision.calls) == 2


# Anthropic: a max_tokens the SDK refuses without streaming is streamed ------------------


@pytest.mark.parametrize(
    ("model", "max_tokens", "seconds", "streamed"),
    [
        ("claude-test", 32_000, None, True),  # above 21,333: over 10 minutes by the SDK's rule
        ("claude-test", 64_000, None, True),
        ("claude-test", 21_000, None, False),
        ("claude-opus-4-0", 10_000, None, True),  # above the model's MODEL_NONSTREAMING_TOKENS
        ("claude-opus-4-0", 8_000, None, False),
        ("claude-test", 32_000, 30.0, False),  # a timeout of the host's: the SDK refuses nothing
    ],
)
async def test_anthropic_streams_what_the_sdk_refuses_without_streaming(
    model: str, max_tokens: int, seconds: float | None, streamed: bool
) -> None:
    with FakeAnthropicServer() as srv:
        _script_calls("anthropic", srv)
        async with anthropic_sdk(srv) as client:
            if seconds is not None:
                client = client.with_options(timeout=seconds)
            provider = create_anthropic_decision_provider(
                model=model, client=client, history=False, max_output_tokens=max_tokens
            )
            decision = await provider.decide(  # no sink: what invoke does
                DecisionRequest(input="A and B?", capabilities=(LOOKUP,))
            )
    assert [c.arguments for c in decision.calls] == [{"q": "A"}, {"q": "B"}]
    [sent] = srv.requests_to("messages")
    assert sent.body["max_tokens"] == max_tokens
    assert sent.body.get("stream", False) is streamed
    assert len(srv.streams) == int(streamed)


async def test_anthropic_with_a_long_max_tokens_works_through_invoke() -> None:
    store = MemoryHistoryStore()
    with FakeAnthropicServer() as srv:
        _script_calls("anthropic", srv)
        _script_final("anthropic", srv)
        async with anthropic_sdk(srv) as client:
            provider = create_anthropic_decision_provider(
                model="claude-test",
                client=client,
                history=HistoryConfig(store=store, namespace="test"),
                max_output_tokens=48_000,
                thinking={"type": "enabled", "budget_tokens": 32_000},
            )
            program = Program()

            @program.capability()
            async def lookup(q: str) -> str:
                return f"{q} shipped"

            program.agent(
                "support", provider=provider, capabilities=("lookup",), output_schema=SCHEMA
            )
            result = await Runtime(program).invoke("support", input="A and B?")
    assert result.status == "completed", result.error
    assert result.output == ANSWER
    assert [r.body["stream"] for r in srv.requests_to("messages")] == [True, True]
    [conversation] = await store.list()
    assert conversation.messages == 4  # both decisions and their results, stored


@pytest.mark.parametrize("vendor", VENDORS)
async def test_an_error_of_the_sink_reaches_the_caller_as_it_is(vendor: str) -> None:
    async def broken(delta: DecisionDelta) -> None:
        if isinstance(delta, StreamedCall):
            raise LookupError("the consumer broke")

    def script(srv: Any) -> None:
        _script_calls(vendor, srv)

    store = MemoryHistoryStore()
    request = DecisionRequest(
        run_id="r", invocation_id="i", agent_ref="a", input="A and B?", capabilities=(LOOKUP,)
    )
    with fake_server(vendor) as srv:
        script(srv)
        async with _provider(vendor, srv, HistoryConfig(store=store, namespace="t")) as provider:
            with pytest.raises(LookupError, match="the consumer broke"):
                await provider.decide(request, sink=broken)
            assert [c.messages for c in await store.list()] in ([], [0])
            script(srv)
            assert len((await provider.decide(request)).calls) == 2
