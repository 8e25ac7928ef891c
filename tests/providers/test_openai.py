"""The OpenAI provider (Responses API), driven through the official SDK against the fake."""

from __future__ import annotations

import inspect
import json
import math
import sys
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai.resources.responses.input_tokens import AsyncInputTokens

from tests._providers import openai_sdk
from tests.providers._requests import LOOKUP, decision_request
from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    ProviderContextCountUnavailable,
    ProviderContextGuardUnsupported,
    ProviderContextWindowExceeded,
)
from touba.history import (
    CapabilityCall,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    MemoryHistoryStore,
    ResultMessage,
)
from touba.history._window import ExchangeSize
from touba.providers import (
    CapabilitySpec,
    ContextConfig,
    DecisionProvider,
    DecisionRequest,
    Observation,
    TraceCall,
    Turn,
)
from touba.providers._base import Plan
from touba.providers._framing import structured_instructions, structured_schema
from touba.providers._openai_wire import COUNT_FIELDS, input_items, strict_schema
from touba.providers.openai import create_openai_decision_provider
from touba.testing.fakes import (
    FakeOpenAIServer,
    openai_function_call,
    openai_reasoning,
    openai_refusal,
    openai_text,
    validate_openai_responses_request,
)

MODEL = "gpt-test"
ENCRYPTED = ["reasoning.encrypted_content"]
REFUND = CapabilitySpec(
    "refund", "Refund an order", {"type": "object", "properties": {"amount": {"type": "number"}}}
)
TOOLS = [
    {
        "type": "function",
        "name": c.name,
        "description": c.description,
        "parameters": dict(c.parameters),
        "strict": False,
    }
    for c in (LOOKUP, REFUND)
]
USER = {"role": "user", "content": "Where is order A1?"}


def request(**fields: Any) -> DecisionRequest:
    return decision_request(LOOKUP, REFUND, **fields)


def observe(decision: Any, *results: Any, status: str = "ok") -> tuple[Observation, ...]:
    return tuple(
        Observation(c.call_id, c.name, c.arguments, status, result)  # type: ignore[arg-type]
        for c, result in zip(decision.calls, results, strict=True)
    )


def bodies(openai_server: FakeOpenAIServer, endpoint: str = "responses") -> list[dict[str, Any]]:
    return [r.body for r in openai_server.requests_to(endpoint)]


def assert_no_rejection(openai_server: FakeOpenAIServer) -> None:
    assert [(r.endpoint, r.status) for r in openai_server.requests if r.status != 200] == []


def output_of(result: ResultMessage | Observation) -> str:
    payload: dict[str, Any] = {"status": result.status}
    if result.status == "ok":
        payload["result"] = result.result
    else:
        payload["error"] = result.error or result.status
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def events_sink() -> tuple[list[Any], HistoryConfig]:
    events: list[Any] = []
    return events, HistoryConfig(on_event=events.append)


# round trips -------------------------------------------------------------------


async def test_native_call_then_final_sends_exact_bodies(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(model=MODEL, client=openai_client)
    assert (provider.provider, provider.model, provider.decision_interface) == (
        "openai",
        MODEL,
        "native",
    )
    openai_server.script_response(
        openai_function_call("lookup_order", {"order_id": "A1"}, call_id="c1")
    )
    first = await provider.decide(request())
    assert [(c.call_id, c.name, dict(c.arguments)) for c in first.calls] == [
        ("c1", "lookup_order", {"order_id": "A1"})
    ]
    assert first.output is None
    assert first.usage.input_tokens is not None

    openai_server.script_response(openai_text("Shipped."))
    observation = Observation("c1", "lookup_order", {"order_id": "A1"}, "ok", {"state": "shipped"})
    final = await provider.decide(request(observations=(observation,)))
    assert (final.output, final.text, final.calls) == ("Shipped.", "Shipped.", ())

    sent_first, sent_second = bodies(openai_server)
    assert sent_first == {
        "model": MODEL,
        "instructions": "Help with orders.",
        "input": [USER],
        "tools": TOOLS,
        "store": False,
        "include": ENCRYPTED,
    }
    call_item = sent_second["input"][1]
    assert call_item["type"] == "function_call"
    assert call_item["id"].startswith("fc_")  # inline: the item keeps its id
    assert sent_second == {
        **sent_first,
        "input": [
            USER,
            call_item,
            {"type": "function_call_output", "call_id": "c1", "output": output_of(observation)},
        ],
    }
    assert json.loads(call_item["arguments"]) == {"order_id": "A1"}
    assert_no_rejection(openai_server)


async def test_parallel_calls_pair_every_output_after_the_calls(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(model=MODEL, client=openai_client)
    openai_server.script_response(
        openai_reasoning("two lookups"),
        openai_function_call("lookup_order", {"order_id": "A1"}, call_id="c1"),
        openai_function_call("refund", {"amount": 5}, call_id="c2"),
    )
    decision = await provider.decide(request())
    assert [c.call_id for c in decision.calls] == ["c1", "c2"]
    openai_server.script_response(openai_text("Done."))
    ok, denied = observe(decision, {"state": "late"}, None)
    denied = Observation(denied.call_id, denied.name, denied.arguments, "denied")
    await provider.decide(request(observations=(denied, ok)))  # any order
    items = bodies(openai_server)[1]["input"]
    assert [(i.get("type"), i.get("call_id")) for i in items[1:]] == [
        ("reasoning", None),
        ("function_call", "c1"),
        ("function_call", "c2"),
        ("function_call_output", "c1"),
        ("function_call_output", "c2"),
    ]
    assert json.loads(items[4]["output"]) == {"status": "ok", "result": {"state": "late"}}
    assert json.loads(items[5]["output"]) == {"status": "denied", "error": "denied"}
    assert_no_rejection(openai_server)


async def test_error_observation_is_sent_as_a_failed_output(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(model=MODEL, client=openai_client)
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    decision = await provider.decide(request())
    call = decision.calls[0]
    failed = Observation(call.call_id, call.name, call.arguments, "error", error="timeout")
    openai_server.script_response(openai_text("Sorry."))
    await provider.decide(request(observations=(failed,)))
    output = bodies(openai_server)[1]["input"][-1]
    assert output == {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"status":"error","error":"timeout"}',
    }
    assert_no_rejection(openai_server)


async def test_reasoning_items_round_trip_untouched_over_three_decisions(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    store = MemoryHistoryStore()
    provider = create_openai_decision_provider(
        model=MODEL,
        client=openai_client,
        history=HistoryConfig(store=store, namespace="t"),
        reasoning={"effort": "low", "summary": "auto"},
    )
    openai_server.script_response(
        openai_reasoning("first"), openai_function_call("lookup_order", {"order_id": "A1"})
    )
    one = await provider.decide(request())
    openai_server.script_response(
        openai_reasoning("second"), openai_function_call("refund", {"amount": 1})
    )
    two = await provider.decide(request(observations=observe(one, {"state": "lost"})))
    openai_server.script_response(openai_reasoning("third"), openai_text("Refunded."))
    three = await provider.decide(request(observations=observe(two, {"refunded": True})))
    assert three.output == "Refunded."

    (row,) = await store.list()
    record = await store.read(row.key)
    assert record is not None
    stored = [m for ex in record["exchanges"] for m in ex if m["kind"] == "decision"]
    opaque = [m["opaque"] for m in stored]
    assert all(m["provider"] == "openai" for m in stored)
    assert [i["type"] for i in opaque[2]] == ["reasoning", "message"]
    # the third request replays the first two decisions' items exactly, in order
    items = bodies(openai_server)[2]["input"]
    assert items == [
        USER,
        *opaque[0],
        {
            "type": "function_call_output",
            "call_id": one.calls[0].call_id,
            "output": '{"status":"ok","result":{"state":"lost"}}',
        },
        *opaque[1],
        {
            "type": "function_call_output",
            "call_id": two.calls[0].call_id,
            "output": '{"status":"ok","result":{"refunded":true}}',
        },
    ]
    reasoning = [i for i in items if i.get("type") == "reasoning"]
    assert len(reasoning) == 2
    assert all(i["encrypted_content"].startswith("gAAAAA") for i in reasoning)
    assert bodies(openai_server)[2]["reasoning"] == {"effort": "low", "summary": "auto"}
    assert (
        validate_openai_responses_request(bodies(openai_server)[2], ledger=openai_server.ledger)
        == []
    )
    assert_no_rejection(openai_server)


async def test_opaque_refs_sends_projected_arguments_without_ids_or_reasoning(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(
        model=MODEL, client=openai_client, history=HistoryConfig(continuity="opaque_refs")
    )
    openai_server.script_response(
        openai_reasoning("raw"),
        openai_function_call("lookup_order", {"order_id": "A1", "note": "raw secret"}),
    )
    decision = await provider.decide(request())
    call = decision.calls[0]
    projected = Observation(call.call_id, call.name, {"order_id": "A1"}, "ok", {"state": "ok"})
    openai_server.script_response(openai_text("ok"))
    await provider.decide(request(observations=(projected,)))
    items = bodies(openai_server)[1]["input"]
    assert items == [
        USER,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": "lookup_order",
            "arguments": '{"order_id":"A1"}',
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": output_of(projected)},
    ]
    assert "raw secret" not in json.dumps(bodies(openai_server)[1])
    assert_no_rejection(openai_server)


async def test_history_false_sends_observations_as_data_without_ids(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(model=MODEL, client=openai_client, history=False)
    observation = Observation("call_xyz", "lookup_order", {"order_id": "A1"}, "ok", {"s": 1})
    openai_server.script_response(openai_text("ok"))
    await provider.decide(DecisionRequest(input="hi", observations=(observation,)))
    (body,) = bodies(openai_server)
    assert "call_xyz" not in json.dumps(body)
    assert [i["role"] for i in body["input"]] == ["user", "user"]
    assert "not instructions" in body["input"][1]["content"]
    assert '"s":1' in body["input"][1]["content"]
    assert "tools" not in body
    assert "instructions" not in body
    assert_no_rejection(openai_server)


async def test_lost_history_sends_observations_as_data_not_orphan_outputs(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    events, config = events_sink()
    provider = create_openai_decision_provider(model=MODEL, client=openai_client, history=config)
    observation = Observation("c_gone", "lookup_order", {"order_id": "A1"}, "ok", 1)
    openai_server.script_response(openai_text("ok"))
    await provider.decide(request(observations=(observation,), resuming=True))
    body = bodies(openai_server)[0]
    assert all(i.get("type") != "function_call_output" for i in body["input"])
    assert "resumed_without_messages" in [e.kind for e in events]
    assert_no_rejection(openai_server)


# structured interface ------------------------------------------------------------


async def test_structured_round_trip_keeps_reasoning_and_sends_results_as_data(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(
        model=MODEL, client=openai_client, decision_interface="structured", max_output_tokens=300
    )
    call = {"action": "call", "calls": [{"name": "lookup_order", "arguments": {"order_id": "A1"}}]}
    openai_server.script_response(openai_reasoning("plan"), openai_text(json.dumps(call)))
    decision = await provider.decide(request())
    assert [c.name for c in decision.calls] == ["lookup_order"]
    openai_server.script_response(openai_text('{"action": "final", "output": "Shipped."}'))
    final = await provider.decide(request(observations=observe(decision, "shipped")))
    assert final.output == "Shipped."

    first, second = bodies(openai_server)
    caps = (LOOKUP, REFUND)
    assert first == {
        "model": MODEL,
        "instructions": "Help with orders.\n\n" + structured_instructions(caps, None),
        "input": [USER],
        "max_output_tokens": 300,
        "text": {
            "format": {
                "type": "json_schema",
                "name": "touba_decision",
                "schema": structured_schema(caps, None),
                "strict": False,
            }
        },
        "store": False,
        "include": ENCRYPTED,
    }
    items = second["input"]
    assert [(i.get("type"), i.get("role")) for i in items] == [
        (None, "user"),
        ("reasoning", None),
        ("message", "assistant"),
        (None, "user"),
    ]
    assert json.loads(items[2]["content"][0]["text"]) == call
    assert "not instructions" in items[3]["content"]
    assert '"shipped"' in items[3]["content"]
    assert_no_rejection(openai_server)


async def test_native_output_schema_asks_for_a_wrapped_final_answer(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}, "required": ["eta"]}
    provider = create_openai_decision_provider(model=MODEL, client=openai_client)
    openai_server.script_response(openai_text('{"output": {"eta": 3}}'))
    decision = await provider.decide(request(output_schema=schema))
    assert decision.output == {"eta": 3}
    fmt = bodies(openai_server)[0]["text"]["format"]
    assert fmt["name"] == "touba_output"
    assert fmt["schema"]["properties"]["output"] == schema
    assert bodies(openai_server)[0]["tools"] == TOOLS


# prior chat turns ------------------------------------------------------------------


TURN = Turn(
    user="Refund A0",
    replies=("Refunded 5.",),
    trace=(
        (
            TraceCall("t1", "lookup_order", {"order_id": "A0"}, "ok", {"paid": 5}),
            TraceCall("t2", "refund", {"amount": 9}, "denied"),
        ),
        (TraceCall("t3", "refund", {"amount": 5}, "ok", {"done": True}),),
    ),
)


async def test_prior_turns_with_trace_are_complete_call_output_pairs(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(model=MODEL, client=openai_client)
    openai_server.script_response(openai_text("ok"))
    await provider.decide(request(prior_turns=(Turn("hi", ("hello",)), TURN)))
    items = bodies(openai_server)[0]["input"]
    assert items == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Refund A0"},
        {
            "type": "function_call",
            "call_id": "t1",
            "name": "lookup_order",
            "arguments": '{"order_id":"A0"}',
        },
        {"type": "function_call", "call_id": "t2", "name": "refund", "arguments": '{"amount":9}'},
        {
            "type": "function_call_output",
            "call_id": "t1",
            "output": '{"status":"ok","result":{"paid":5}}',
        },
        {
            "type": "function_call_output",
            "call_id": "t2",
            "output": '{"status":"denied","error":"denied"}',
        },
        {"type": "function_call", "call_id": "t3", "name": "refund", "arguments": '{"amount":5}'},
        {
            "type": "function_call_output",
            "call_id": "t3",
            "output": '{"status":"ok","result":{"done":true}}',
        },
        {"role": "assistant", "content": "Refunded 5."},
        USER,
    ]
    assert_no_rejection(openai_server)


async def test_prior_turn_traces_are_data_in_structured_mode(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(
        model=MODEL, client=openai_client, decision_interface="structured"
    )
    openai_server.script_response(openai_text('{"action": "final", "output": "ok"}'))
    await provider.decide(request(prior_turns=(TURN,)))
    items = bodies(openai_server)[0]["input"]
    assert [i["role"] for i in items] == ["user", "user", "assistant", "user"]
    assert all("type" not in i for i in items)
    assert "not instructions" in items[1]["content"]
    assert '"paid":5' in items[1]["content"]


# schema violations -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "incomplete", "interface", "code"),
    [
        ([openai_refusal("I will not say SECRET")], None, "native", "refusal"),
        ([openai_text('{"act')], "max_output_tokens", "structured", "truncated_output"),
        ([openai_text("SECRET")], "content_filter", "native", "blocked"),
        ([openai_text("SECRET")], "max_messages", "native", "incomplete_output"),
        ([], None, "native", "empty_output"),
        ([openai_reasoning("SECRET")], None, "native", "empty_output"),
        ([], None, "structured", "empty_output"),
        ([openai_text("SECRET not json")], None, "structured", "invalid_json"),
        ([openai_text('{"action": "maybe"}')], None, "structured", "bad_action"),
        (
            [openai_function_call("lookup_order", "{SECRET")],
            None,
            "native",
            "invalid_json",
        ),
        ([openai_function_call("lookup_order", "[1]")], None, "native", "bad_call"),
        (
            [openai_function_call("wire_money", {"to": "SECRET"})],
            None,
            "native",
            "unknown_capability",
        ),
        (
            [openai_function_call("lookup_order", {"order_id": 7})],
            None,
            "native",
            "arguments_schema_mismatch",
        ),
        (
            [openai_function_call("lookup_order", {"order_id": "A1"})],
            None,
            "structured",
            "unexpected_output_item",
        ),
        (
            [{"type": "web_search_call", "status": "completed", "action": {"query": "SECRET"}}],
            None,
            "native",
            "unexpected_output_item",
        ),
    ],
)
async def test_responses_without_a_valid_decision_are_schema_violations(
    openai_server: FakeOpenAIServer,
    openai_client: openai.AsyncOpenAI,
    items: list[dict[str, Any]],
    incomplete: str | None,
    interface: Any,
    code: str,
) -> None:
    store = MemoryHistoryStore()
    provider = create_openai_decision_provider(
        model=MODEL,
        client=openai_client,
        decision_interface=interface,
        history=HistoryConfig(store=store, namespace="t"),
    )
    openai_server.script_response(*items, incomplete_reason=incomplete)
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request())
    assert caught.value.provider_error_code == code
    assert "SECRET" not in str(caught.value)
    assert len(bodies(openai_server)) == 1  # never retried
    assert await store.list() == []  # nothing stored


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ('{"eta": 3}', "missing_output"),
        ("not json", "invalid_json"),
        ('{"output": {"eta": "SECRET"}}', "output_schema_mismatch"),
    ],
)
async def test_native_final_output_violations(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI, text: str, code: str
) -> None:
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}}
    provider = create_openai_decision_provider(model=MODEL, client=openai_client, history=False)
    openai_server.script_response(openai_text(text))
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request(output_schema=schema))
    assert caught.value.provider_error_code == code
    assert "SECRET" not in str(caught.value)


# transport failures --------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 429, 401, 400])
async def test_http_errors_are_unavailable_and_never_retried(
    openai_server: FakeOpenAIServer, status: int
) -> None:
    retrying = openai.AsyncOpenAI(base_url=openai_server.base_url + "/v1", api_key="sk-test")
    assert retrying.max_retries > 0  # the SDK default; touba still sends one request
    provider = create_openai_decision_provider(model=MODEL, client=retrying)
    openai_server.script_error(status)
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    await retrying.close()
    assert caught.value.status_code == status
    assert isinstance(caught.value.__cause__, openai.APIStatusError)
    assert "sk-test" not in str(caught.value)
    assert len(bodies(openai_server)) == 1


async def test_connection_failure_and_timeout_are_unavailable(
    openai_server: FakeOpenAIServer,
) -> None:
    with FakeOpenAIServer() as gone:
        url = gone.base_url
    closed = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
    provider = create_openai_decision_provider(model=MODEL, client=closed, history=False)
    with pytest.raises(AgentDecisionProviderUnavailable, match="connection") as caught:
        await provider.decide(request())
    assert caught.value.status_code is None
    await closed.close()

    slow = openai_sdk(openai_server, timeout=0.2)
    provider = create_openai_decision_provider(model=MODEL, client=slow, history=False)
    openai_server.script_response(openai_text("late"), delay=2)
    with pytest.raises(AgentDecisionProviderUnavailable, match="timeout"):
        await provider.decide(request())
    await slow.close()


async def test_a_failed_response_status_is_unavailable(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_raw(
        200, {"id": "resp_1", "object": "response", "status": "failed", "output": []}
    )
    provider = create_openai_decision_provider(model=MODEL, client=openai_client, history=False)
    with pytest.raises(AgentDecisionProviderUnavailable, match="failed"):
        await provider.decide(request())


@pytest.mark.parametrize(("code", "retryable"), [("server_error", True), ("invalid_prompt", False)])
async def test_a_failed_response_keeps_what_the_api_said(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI, code: str, retryable: bool
) -> None:
    error = {"code": code, "message": "The prompt was flagged: SECRET"}
    openai_server.script_raw(
        200,
        {"id": "resp_1", "object": "response", "status": "failed", "output": [], "error": error},
    )
    provider = create_openai_decision_provider(model=MODEL, client=openai_client, history=False)
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    assert caught.value.server_message == "The prompt was flagged: SECRET"
    assert "SECRET" in str(caught.value)
    assert "SECRET" not in caught.value.message
    assert caught.value.retryable is retryable


# context guard ---------------------------------------------------------------------


def outputs_cost(body: dict[str, Any]) -> int:
    """Deterministic counts: 100 + 1000 per function_call_output, +500 per prior turn."""
    items = body.get("input", [])
    outputs = sum(1 for i in items if i.get("type") == "function_call_output")
    turns = sum(1 for i in items if i.get("content") == "earlier")
    return 100 + 1000 * outputs + 500 * turns


@pytest.fixture
async def outputs_counted() -> AsyncIterator[tuple[FakeOpenAIServer, openai.AsyncOpenAI]]:
    """A fake server counting tokens with ``outputs_cost``, and an SDK client on it."""
    with FakeOpenAIServer(count_tokens=outputs_cost) as srv:
        async with openai_sdk(srv) as sdk:
            yield srv, sdk


GUARD = ContextConfig(context_window_tokens=2300, input_token_multiplier=1, safety_margin_tokens=0)


def guarded(sdk: openai.AsyncOpenAI) -> DecisionProvider:
    """A provider whose guard keeps requests within GUARD's 2,300 tokens, 100 to answer."""
    return create_openai_decision_provider(
        model=MODEL, client=sdk, context=GUARD, max_output_tokens=100
    )


async def run_calls(provider: Any, openai_server: FakeOpenAIServer, n: int, **kwargs: Any) -> Any:
    """n decisions each calling lookup_order (the first with a reasoning item)."""
    decision = None
    for i in range(n):
        items = [openai_function_call("lookup_order", {"order_id": f"A{i}"})]
        if i == 0:
            items.insert(0, openai_reasoning("think"))
        openai_server.script_response(*items)
        observations = observe(decision, {"i": i - 1}) if decision else ()
        decision = await provider.decide(request(observations=observations, **kwargs))
    return decision


async def test_guard_counts_the_full_body_through_the_count_endpoint(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    events, config = events_sink()
    provider = create_openai_decision_provider(
        model=MODEL,
        client=openai_client,
        history=config,
        context=ContextConfig(context_window_tokens=100_000),
        max_output_tokens=500,
        reasoning={"effort": "low"},
        temperature=0.2,
        metadata={"app": "t"},
        parallel_tool_calls=False,
        text={"verbosity": "low"},
    )
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    await provider.decide(request(output_schema={"type": "string"}))
    (count,) = openai_server.requests_to("input_tokens")
    (generation,) = bodies(openai_server)
    assert count.path == "/v1/responses/input_tokens"
    assert count.body == {k: v for k, v in generation.items() if k in COUNT_FIELDS}
    dropped = set(generation) - set(count.body)
    assert dropped == {"store", "include", "max_output_tokens", "metadata", "temperature"}
    for key in ("instructions", "tools", "text", "reasoning", "parallel_tool_calls", "input"):
        assert key in count.body
    assert count.body["text"]["verbosity"] == "low"
    assert count.body["text"]["format"]["name"] == "touba_output"
    (event,) = [e for e in events if e.kind == "provider_context_count"]
    expected = openai_server.count_tokens(count.body)
    assert (event.provider, event.count, event.window, event.fits) == (
        "openai",
        expected,
        100_000,
        True,
    )
    assert event.reserve == math.ceil(expected * 1.2) + 512 + 500
    dumped = json.dumps(event.to_dict())
    assert "Where is order" not in dumped
    assert "A1" not in dumped
    assert_no_rejection(openai_server)


def test_count_fields_are_the_sdk_count_parameters() -> None:
    params = set(inspect.signature(AsyncInputTokens.count).parameters)
    assert params - {"self", "extra_headers", "extra_query", "extra_body", "timeout"} == set(
        COUNT_FIELDS
    )


async def test_guard_trims_oldest_exchanges_like_one_at_a_time(
    outputs_counted: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    srv, sdk = outputs_counted
    events, config = events_sink()
    provider = create_openai_decision_provider(
        model=MODEL, client=sdk, history=config, context=GUARD, max_output_tokens=100
    )
    decision = await run_calls(provider, srv, 5)
    before = len(srv.requests_to("input_tokens"))
    srv.script_response(openai_text("done"))
    await provider.decide(request(observations=observe(decision, {"i": 4})))
    counted = [r.body for r in srv.requests_to("input_tokens")[before:]]
    # 5 exchanges in the window: at most 2 + ceil(log2(5)) counts
    assert len(counted) <= 2 + math.ceil(math.log2(5))
    last = bodies(srv)[-1]
    outputs = [i for i in last["input"] if i.get("type") == "function_call_output"]
    # one at a time: 100 + 1000 * 2 + 100 fits 2300, one exchange more would not
    assert len(outputs) == 2
    assert [json.loads(o["output"])["result"]["i"] for o in outputs] == [3, 4]
    assert last["input"][0] == USER  # the input is never trimmed
    assert {k: v for k, v in last.items() if k in COUNT_FIELDS} in counted
    assert any(e.kind == "history_trimmed" for e in events)
    assert_no_rejection(srv)


async def test_guard_trim_drops_a_reasoning_item_with_its_call(
    outputs_counted: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    srv, sdk = outputs_counted
    provider = guarded(sdk)
    await run_calls(provider, srv, 4)
    kept = bodies(srv)[-1]["input"]
    # exchange 0 (reasoning + its call) is sent while it fits, then leaves whole
    for sent in bodies(srv)[1:3]:
        assert [i.get("type") for i in sent["input"][1:3]] == ["reasoning", "function_call"]
    assert [i.get("type") for i in kept[1:]] == [
        "function_call",
        "function_call_output",
        "function_call",
        "function_call_output",
    ]
    assert all(i.get("type") != "reasoning" for i in kept)
    assert validate_openai_responses_request(bodies(srv)[-1], ledger=srv.ledger) == []
    assert_no_rejection(srv)


async def test_guard_drops_prior_turns_first(
    outputs_counted: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    srv, sdk = outputs_counted
    provider = guarded(sdk)
    turns = (Turn("earlier", ("yes",)), Turn("earlier", ("no",)))
    # 100 + 1000 + 2 * 500 + 100 = 2200: fits; a second exchange must push the turns out
    await run_calls(provider, srv, 3, prior_turns=turns)
    second, third = bodies(srv)[1:]
    assert [i.get("content") for i in second["input"][:1]] == ["earlier"]
    assert "earlier" not in json.dumps(third["input"])
    assert sum(1 for i in third["input"] if i.get("type") == "function_call_output") == 2
    assert_no_rejection(srv)


async def test_minimum_over_the_window_raises_without_generating() -> None:
    with FakeOpenAIServer(count_tokens=lambda body: 5000) as srv:
        sdk = openai_sdk(srv)
        provider = guarded(sdk)
        with pytest.raises(ProviderContextWindowExceeded):
            await provider.decide(request())
        assert bodies(srv) == []
        await sdk.close()


@pytest.mark.parametrize("failure", ["http_500", "missing_field", "timeout"])
async def test_count_unavailable_generates_nothing(
    openai_server: FakeOpenAIServer, failure: str
) -> None:
    sdk = openai_sdk(openai_server, timeout=0.3)
    store = MemoryHistoryStore()
    provider = create_openai_decision_provider(
        model=MODEL,
        client=sdk,
        context=ContextConfig(context_window_tokens=100_000),
        max_output_tokens=100,
        history=HistoryConfig(store=store, namespace="t"),
    )
    if failure == "http_500":
        openai_server.script_error(500, endpoint="input_tokens")
    elif failure == "missing_field":
        openai_server.script_count(None)
    else:
        openai_server.script_count(10, delay=2)
    openai_server.script_response(openai_text("never"))
    with pytest.raises(ProviderContextCountUnavailable) as caught:
        await provider.decide(request())
    assert "sk-test" not in str(caught.value)
    assert bodies(openai_server) == []
    assert openai_server.pending("responses") == 1
    assert await store.list() == []
    await sdk.close()


@pytest.mark.parametrize(
    "options",
    [
        {"previous_response_id": "resp_1"},
        {"conversation": "conv_1"},
        {"truncation": "auto"},
        {"prompt": {"id": "pmpt_1"}},
        {"context_management": [{"type": "compaction"}]},
    ],
)
def test_guard_refuses_implicit_server_state(
    openai_client: openai.AsyncOpenAI, options: Any
) -> None:
    with pytest.raises(ProviderContextGuardUnsupported):
        create_openai_decision_provider(
            model=MODEL,
            client=openai_client,
            context=ContextConfig(context_window_tokens=10_000),
            max_output_tokens=100,
            **options,
        )


def test_guard_refuses_azure_clients() -> None:
    azure = openai.AsyncAzureOpenAI(
        api_key="k", api_version="2025-04-01-preview", azure_endpoint="http://127.0.0.1:9"
    )
    create_openai_decision_provider(model=MODEL, client=azure)  # fine without the guard
    with pytest.raises(ProviderContextGuardUnsupported, match="Azure"):
        create_openai_decision_provider(
            model=MODEL,
            client=azure,
            context=ContextConfig(context_window_tokens=10_000),
            max_output_tokens=100,
        )


async def test_guard_supports_a_custom_base_url(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    assert str(openai_client.base_url).startswith("http://127.0.0.1:")
    provider = create_openai_decision_provider(
        model=MODEL,
        client=openai_client,
        context=ContextConfig(context_window_tokens=10_000),
        max_output_tokens=100,
    )
    openai_server.script_response(openai_text("ok"))
    assert (await provider.decide(request())).output == "ok"
    assert [r.endpoint for r in openai_server.requests] == ["input_tokens", "responses"]


async def test_summary_is_user_data_and_is_counted(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    seen: list[Any] = []

    async def summarize(req: Any) -> str:
        seen.append(req)
        return "Earlier: order A0 looked up."

    provider = create_openai_decision_provider(
        model=MODEL,
        client=openai_client,
        history=HistoryConfig(summarize=summarize, max_messages=4),
        context=ContextConfig(context_window_tokens=100_000),
        max_output_tokens=100,
    )
    await run_calls(provider, openai_server, 4)
    assert seen
    assert all("opaque" not in json.dumps(r.turns) for r in seen)
    last = bodies(openai_server)[-1]
    summary = last["input"][1]
    assert summary["role"] == "user"
    assert "untrusted summary" in summary["content"]
    assert "order A0 looked up" in summary["content"]
    assert "order A0 looked up" not in last["instructions"]
    assert last["input"][0] == USER  # input first, then the summary
    counted = openai_server.requests_to("input_tokens")[-1].body
    assert counted["input"] == last["input"]
    assert_no_rejection(openai_server)


# neutral rendering of decisions whose items cannot be replayed --------------------


def plan_with(decision: DecisionMessage, result: ResultMessage, interface: Any = "native") -> Plan:
    window = HistoryWindow(
        session_key="k",
        summary=None,
        exchanges=((decision, result),),
        sizes=(ExchangeSize(2, 100),),
    )
    return Plan(request(), interface, (), window)


@pytest.mark.parametrize(
    ("provider", "opaque"),
    [
        ("anthropic", [{"type": "thinking", "thinking": "x", "signature": "sig"}]),
        ("openai", [{"type": "reasoning", "id": "rs_1", "summary": []}]),  # no encrypted content
        ("openai", [{"type": "function_call", "call_id": "other", "name": "n", "arguments": "{}"}]),
        ("openai", "corrupt"),
    ],
)
def test_unreplayable_opaque_items_are_rendered_from_neutral_fields(
    provider: str, opaque: Any
) -> None:
    call = DecisionMessage(
        text="Checking.",
        calls=(CapabilityCall("c1", "lookup_order", {"order_id": "raw"}),),
        provider=provider,
        opaque=opaque,
    )
    result = ResultMessage("c1", "lookup_order", {"order_id": "A1"}, "ok", 1)
    items = input_items(plan_with(call, result))
    assert items == [
        USER,
        {"role": "assistant", "content": "Checking."},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "lookup_order",
            "arguments": '{"order_id":"A1"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": output_of(result)},
    ]
    body = {"model": MODEL, "input": items}
    assert validate_openai_responses_request(body) == []


# configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"tools": []}, "capabilities"),
        ({"input": "x"}, "input"),
        ({"stream": True}, "streams when decide.. is given a sink"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "text"}}}, "format"),
        ({"no_such_option": 1}, "unknown option"),
        ({"metadata": {"k": object()}}, "JSON"),
    ],
)
def test_options_touba_cannot_honour_are_refused(
    openai_client: openai.AsyncOpenAI, options: Any, match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        create_openai_decision_provider(model=MODEL, client=openai_client, **options)


async def test_passthrough_options_and_include_are_merged(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(
        model=MODEL,
        client=openai_client,
        include=["message.output_text.logprobs"],
        truncation="auto",  # fine without the guard
        store=False,
    )
    openai_server.script_response(openai_text("ok"))
    await provider.decide(request())
    body = bodies(openai_server)[0]
    assert body["include"] == ["message.output_text.logprobs", *ENCRYPTED]
    assert (body["truncation"], body["store"]) == ("auto", False)


def test_client_and_model_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    sync = openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(ConfigurationError, match="AsyncOpenAI"):
        create_openai_decision_provider(model=MODEL, client=sync)  # type: ignore[arg-type]
    sync.close()
    with pytest.raises(ConfigurationError, match="model"):
        create_openai_decision_provider(model="", client=None)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="OPENAI_API_KEY"):
        create_openai_decision_provider(model=MODEL)
    with pytest.raises(ConfigurationError, match="max_output_tokens"):
        create_openai_decision_provider(
            model=MODEL,
            client=openai.AsyncOpenAI(api_key="k", base_url="http://127.0.0.1:9/v1"),
            context=ContextConfig(context_window_tokens=10_000),
        )


def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ImportError, match=r'pip install "touba\[openai\]"'):
        create_openai_decision_provider(model=MODEL)


async def test_keys_never_reach_records_or_events(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    store = MemoryHistoryStore()
    events: list[Any] = []
    provider = create_openai_decision_provider(
        model=MODEL,
        client=openai_client,
        history=HistoryConfig(store=store, namespace="t", on_event=events.append),
        context=ContextConfig(context_window_tokens=100_000),
        max_output_tokens=100,
    )
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    await provider.decide(request())
    (row,) = await store.list()
    dumped = json.dumps(await store.read(row.key)) + json.dumps([e.to_dict() for e in events])
    assert "sk-test" not in dumped
    assert all("authorization" not in r.headers for r in openai_server.requests)


def test_structured_decision_without_items_replays_projected_json() -> None:
    stored = DecisionMessage(calls=(CapabilityCall("c1", "lookup_order", {}),))  # opaque_refs
    result = ResultMessage("c1", "lookup_order", {"order_id": "A1"}, "ok", 1)
    items = input_items(plan_with(stored, result, "structured"))
    assert [i["role"] for i in items] == ["user", "assistant", "user"]
    assert json.loads(items[1]["content"]) == {
        "action": "call",
        "calls": [{"name": "lookup_order", "arguments": {"order_id": "A1"}}],
    }
    assert '"call_id":"c1"' in items[2]["content"]


# strict structured output --------------------------------------------------------------


def test_strict_schema_closes_objects_and_refuses_what_strict_mode_would_change() -> None:
    closed = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}
        },
        "required": ["a"],
    }
    assert strict_schema(closed) == {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "string"}},
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    }
    optional = {"type": "object", "properties": {"a": {"type": "string"}}}
    open_object = {"type": "object", "properties": {}, "additionalProperties": True}
    keyword = {"type": "string", "minLength": 1}
    assert strict_schema(optional) is None  # optional -> nullable would change its meaning
    assert strict_schema(open_object) is None
    assert strict_schema(keyword) is None
    assert strict_schema({}) is None
    assert strict_schema({"type": "string", "format": "date"}) == {
        "type": "string",
        "format": "date",
    }


async def test_the_structured_interface_is_strict_only_when_its_schema_allows(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(
        model=MODEL, client=openai_client, history=False, decision_interface="structured"
    )
    openai_server.script_response(openai_text('{"action":"final","output":"done"}'))
    openai_server.script_response(openai_text('{"action":"final","output":{"n":1}}'))
    await provider.decide(request(capabilities=(), output_schema={"type": "string"}))
    await provider.decide(request(output_schema={"type": "object"}))  # capabilities: free args
    strict, loose = (b["text"]["format"] for b in bodies(openai_server))
    assert strict["strict"] is True
    assert loose["strict"] is False
    assert loose["schema"] == structured_schema((LOOKUP, REFUND), {"type": "object"})
