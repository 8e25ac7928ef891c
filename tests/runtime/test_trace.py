"""Traces: ordered entries, history and guard events, JSON lines, no secrets."""

from __future__ import annotations

import json
from datetime import datetime

import openai
import pytest

from touba.history import HistoryConfig
from touba.providers import ContextConfig
from touba.providers.openai import create_openai_decision_provider
from touba.runtime import Program, Runtime, Trace
from touba.testing import ScriptedProvider
from touba.testing.fakes import (
    FakeOpenAIServer,
    openai_function_call,
    openai_text,
    validate_openai_responses_request,
)

from ._helpers import final, kinds, step

API_KEY = "sk-test-SECRET-KEY-123"


async def test_a_run_is_traced_in_order() -> None:
    program = Program()

    @program.capability(permissions=("orders:read",))
    async def lookup(order_id: str) -> str:
        return "shipped"

    @program.capability(permissions=("orders:write",))
    async def cancel(order_id: str) -> str:
        return "cancelled"

    model = ScriptedProvider(
        step(("c1", "lookup", {"order_id": "A1"}), ("c2", "cancel", {"order_id": "A1"})),
        final("A1 shipped"),
    )
    program.agent(
        "support",
        provider=model,
        instructions="INSTRUCTIONS-NOT-TRACED",
        capabilities=("lookup", "cancel"),
        grants=("orders:read",),
    )
    result = await Runtime(program).invoke("support", input="Where is A1?")
    assert kinds(result) == [
        "invocation_started",
        "history_event",
        "decision",
        "denial",  # checks run in call order: c2 refused and answered at once...
        "observation",
        "call",  # ... c1 accepted, started once the batch is recorded as started...
        "observation",  # ... then c1's result
        "history_event",
        "decision",
        "invocation_completed",
    ]
    started, window, decision, denial, denied, call, observed, _, last, completed = result.trace
    assert started["input"] == "Where is A1?"
    assert window["event"] == "history_window"
    assert decision["number"] == 1
    assert decision["calls"] == [
        {"call_id": "c1", "name": "lookup", "arguments": {"order_id": "A1"}},
        {"call_id": "c2", "name": "cancel", "arguments": {"order_id": "A1"}},
    ]
    assert decision["final"] is False
    assert (denial["call_id"], denial["reason"]) == ("c2", "permission_denied")
    assert (denied["call_id"], denied["status"]) == ("c2", "denied")
    assert (call["call_id"], call["arguments"]) == ("c1", {"order_id": "A1"})
    assert (observed["status"], observed["result"]) == ("ok", "shipped")
    assert "error" not in observed.data
    assert last["final"] is True
    assert last["output"] == "A1 shipped"
    assert completed["output"] == "A1 shipped"
    for entry in result.trace:
        assert (entry.run_id, entry.invocation_id, entry.agent_ref) == (
            result.run_id,
            result.invocation_id,
            "support",
        )
    assert "INSTRUCTIONS-NOT-TRACED" not in result.trace.to_jsonl()


async def test_to_jsonl_is_one_object_per_line_with_aware_timestamps() -> None:
    program = Program()
    program.agent("a", provider=ScriptedProvider(final({"answer": "é"})))
    result = await Runtime(program).invoke("a", input={"q": 1})
    text = result.trace.to_jsonl()
    lines = text.splitlines()
    assert text.endswith("\n")
    assert len(lines) == len(result.trace)
    previous = None
    for line in lines:
        entry = json.loads(line)
        at = datetime.fromisoformat(entry["at"])
        assert at.tzinfo is not None
        assert at.utcoffset() is not None
        assert previous is None or at >= previous
        previous = at
        assert {"kind", "run_id", "invocation_id", "agent_ref"} <= set(entry)
    assert "é" in text
    restored = Trace.from_dicts([json.loads(line) for line in lines])
    assert restored.to_jsonl() == text


async def test_history_events_are_traced_without_content() -> None:
    program = Program()

    @program.capability
    async def fetch(n: int) -> str:
        return "PAYLOAD-" + "x" * 200

    model = ScriptedProvider(
        *[step((f"c{i}", "fetch", {"n": i})) for i in range(3)],
        final("ok"),
        history=HistoryConfig(max_messages=3),
    )
    program.agent("a", provider=model, capabilities=("fetch",))
    result = await Runtime(program).invoke("a")
    events = result.trace.of_kind("history_event")
    assert {e["event"] for e in events} == {"history_window", "history_trimmed"}
    trimmed = next(e for e in events if e["event"] == "history_trimmed")
    assert trimmed["removed_exchanges"] >= 1
    for event in events:
        assert "PAYLOAD" not in json.dumps(event.to_dict())


async def test_approvals_and_sub_invocations_are_traced() -> None:
    program = Program()

    @program.capability(requires_approval=True)
    async def pay(invoice: str) -> str:
        return "paid"

    program.delegate("billing")
    parent = ScriptedProvider(step(("d1", "billing", {"input": "pay"})), final("done"))
    child = ScriptedProvider(
        step(("p1", "pay", {"invoice": "I-1"}), ("p2", "pay", {"invoice": "I-2"})),
        final("one paid"),
    )
    program.agent("main", provider=parent, capabilities=("billing",))
    program.agent("billing", provider=child, capabilities=("pay",))
    runtime = Runtime(program)
    paused = await runtime.invoke("main")
    [waiting_child, waiting_parent] = paused.trace.of_kind("awaiting_approval")
    assert waiting_child.agent_ref == "billing"
    assert waiting_parent.agent_ref == "main"
    assert waiting_parent["checkpoint_id"] == paused.checkpoint_id
    assert [c["call_id"] for c in waiting_parent["pending"]] == ["p1", "p2"]
    requested = paused.trace.of_kind("approval_requested")
    assert [(e["call_id"], e["arguments"]) for e in requested] == [
        ("p1", {"invoice": "I-1"}),
        ("p2", {"invoice": "I-2"}),
    ]
    result = await runtime.resume(paused.checkpoint_id or "", approvals={"p1": True, "p2": False})
    assert [e["call_id"] for e in result.trace.of_kind("approval_granted")] == ["p1"]
    assert [e["call_id"] for e in result.trace.of_kind("approval_refused")] == ["p2"]
    child_id = child.requests[0].invocation_id
    finished = result.trace.of_kind("sub_invocation_finished")
    assert [(e["child_invocation_id"], e["status"]) for e in finished] == [
        (child_id, "awaiting_approval"),
        (child_id, "completed"),
    ]
    assert {e.invocation_id for e in result.trace.of_kind("invocation_resumed")} == {
        paused.invocation_id,
        child_id,
    }


# -- end to end through the OpenAI fake ---------------------------------------------------


@pytest.fixture
def api_key() -> str:
    return API_KEY  # the client's key, which no trace may hold


async def test_openai_end_to_end_with_approval_guard_events_and_no_key(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    program = Program()
    paid: list[str] = []

    @program.capability
    async def lookup_invoice(invoice: str) -> dict[str, str]:
        return {"invoice": invoice, "amount": "12.00"}

    @program.capability(requires_approval=True)
    async def pay(invoice: str) -> str:
        paid.append(invoice)
        return "paid"

    provider = create_openai_decision_provider(
        model="gpt-test",
        client=openai_client,
        context=ContextConfig(context_window_tokens=32768),
        max_output_tokens=1000,
    )
    program.agent("billing", provider=provider, capabilities=("lookup_invoice", "pay"))
    runtime = Runtime(program)

    openai_server.script_count(120)
    openai_server.script_response(
        openai_function_call("lookup_invoice", {"invoice": "I-1"}, call_id="call_a"),
        openai_function_call("pay", {"invoice": "I-1"}, call_id="call_b"),
    )
    paused = await runtime.invoke("billing", input="Pay I-1")
    assert paused.status == "awaiting_approval", paused.error
    assert [c.call_id for c in paused.pending] == ["call_b"]

    openai_server.script_count(180)
    openai_server.script_response(openai_text("I-1 is paid."))
    result = await runtime.resume(paused.checkpoint_id or "", approvals={"call_b": True})
    assert result.status == "completed", result.error
    assert result.output == "I-1 is paid."
    assert paid == ["I-1"]

    [_, second] = openai_server.requests_to("responses")
    assert validate_openai_responses_request(second.body) == []
    outputs = [i for i in second.body["input"] if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == ["call_a", "call_b"]
    counts = [
        e for e in result.trace.of_kind("history_event") if e["event"] == "provider_context_count"
    ]
    assert [(e["count"], e["fits"]) for e in counts] == [(120, True), (180, True)]
    assert API_KEY not in result.trace.to_jsonl()
    assert "Authorization" not in result.trace.to_jsonl()


async def test_openai_provider_error_code_is_traced(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    program = Program()
    program.agent(
        "a",
        provider=create_openai_decision_provider(model="gpt-test", client=openai_client),
        output_schema={"type": "object", "properties": {"n": {"type": "integer"}}},
    )
    openai_server.script_response(openai_text("not json"))
    result = await Runtime(program).invoke("a")
    assert result.status == "failed"
    [error] = result.trace.of_kind("provider_error")
    assert error["error_code"] == "AgentDecisionProviderSchemaViolation"
    assert error["provider_error_code"]
    assert (
        result.trace.of_kind("invocation_failed")[0]["provider_error_code"]
        == (error["provider_error_code"])
    )
