"""The function provider: a host generator returning only a typed object."""

import json
import math
from typing import Any

import pytest

from tests.providers._requests import decision_request as request
from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    DecisionHistoryMismatch,
)
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.providers import (
    CapabilitySpec,
    DecisionRequest,
    Observation,
    create_function_decision_provider,
)


class Scripted:
    """A generator that replays decisions and records what it was sent."""

    def __init__(self, *decisions):
        self.decisions = list(decisions)
        self.seen = []

    async def __call__(self, messages, schema):
        self.seen.append((messages, schema))
        return self.decisions.pop(0)


async def test_call_then_final_keeps_the_exchange_in_history() -> None:
    model = Scripted(
        {"action": "call", "calls": [{"name": "lookup_order", "arguments": {"order_id": "A1"}}]},
        {"action": "final", "output": "Shipped."},
    )
    store = MemoryHistoryStore()
    provider = create_function_decision_provider(
        generate=model, history=HistoryConfig(store=store, namespace="t")
    )
    first = await provider.decide(request())
    assert [c.name for c in first.calls] == ["lookup_order"]
    assert first.output is None
    call = first.calls[0]
    observation = Observation(call.call_id, call.name, call.arguments, "ok", {"status": "shipped"})
    final = await provider.decide(request(observations=(observation,)))
    assert final.output == "Shipped."
    messages, schema = model.seen[1]
    assert schema["properties"]["action"]["enum"] == ["call", "final"]
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert json.loads(messages[2]["content"])["calls"][0]["arguments"] == {"order_id": "A1"}
    assert "untrusted" not in messages[0]["content"]
    assert '"shipped"' in messages[3]["content"]
    (row,) = await store.list()
    assert row.messages == 3  # decision, result, final decision


async def test_history_false_sends_observations_as_plain_data_without_ids() -> None:
    model = Scripted({"action": "final", "output": "ok"})
    provider = create_function_decision_provider(generate=model, history=False)
    observation = Observation("call_xyz", "lookup_order", {"order_id": "A1"}, "ok", {"s": 1})
    await provider.decide(DecisionRequest(input="hi", observations=(observation,)))
    messages, _ = model.seen[0]
    assert "call_xyz" not in json.dumps(messages)
    assert '"s":1' in messages[-1]["content"]


async def test_history_needs_identity() -> None:
    provider = create_function_decision_provider(generate=Scripted())
    with pytest.raises(ConfigurationError, match="run_id"):
        await provider.decide(DecisionRequest(input="hi"))


async def test_observation_for_no_pending_call_is_a_mismatch() -> None:
    model = Scripted({"action": "final", "output": "done"})
    provider = create_function_decision_provider(generate=model)
    await provider.decide(request())
    stray = Observation("c9", "lookup_order", {"order_id": "A"}, "ok", 1)
    with pytest.raises(DecisionHistoryMismatch):
        await provider.decide(request(observations=(stray,)))


@pytest.mark.parametrize(
    ("decision", "code"),
    [
        ({"action": "call", "calls": [{"name": "refund", "arguments": {}}]}, "unknown_capability"),
        (
            {"action": "call", "calls": [{"name": "lookup_order", "arguments": {"id": 1}}]},
            "arguments_schema_mismatch",
        ),
        ({"action": "maybe"}, "bad_action"),
        ({"action": "call", "calls": []}, "missing_calls"),
        ({"action": "final"}, "missing_output"),
        (["not", "an", "object"], "decision_not_object"),
    ],
)
async def test_invalid_decisions_are_schema_violations(decision, code) -> None:
    provider = create_function_decision_provider(generate=Scripted(decision))
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request())
    assert caught.value.provider_error_code == code


async def test_output_schema_is_enforced() -> None:
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}, "required": ["eta"]}
    provider = create_function_decision_provider(
        generate=Scripted({"action": "final", "output": {"eta": "soon"}})
    )
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request(output_schema=schema))
    assert caught.value.provider_error_code == "output_schema_mismatch"
    assert "soon" not in str(caught.value)  # diagnostics never echo content


async def test_generator_failure_is_unavailable_and_stores_nothing() -> None:
    async def broken(messages, schema):
        raise TimeoutError

    store = MemoryHistoryStore()
    provider = create_function_decision_provider(
        generate=broken, history=HistoryConfig(store=store, namespace="t")
    )
    with pytest.raises(AgentDecisionProviderUnavailable):
        await provider.decide(request())
    assert await store.list() == []


async def test_opaque_refs_replays_projected_arguments_never_raw_ones() -> None:
    model = Scripted(
        {"action": "call", "calls": [{"name": "lookup_order", "arguments": {"order_id": "RAW"}}]},
        {"action": "final", "output": "ok"},
    )
    store = MemoryHistoryStore()
    provider = create_function_decision_provider(
        generate=model, history=HistoryConfig(store=store, namespace="t", continuity="opaque_refs")
    )
    (call,) = (await provider.decide(request())).calls
    projected = Observation(call.call_id, call.name, {"order_id": "ref:1"}, "ok", {"s": 1})
    await provider.decide(request(observations=(projected,)))
    messages, _ = model.seen[1]
    assert json.loads(messages[2]["content"])["calls"][0]["arguments"] == {"order_id": "ref:1"}
    assert "RAW" not in json.dumps(messages)
    (row,) = await store.list()
    assert "RAW" not in json.dumps(await store.read(row.key))


async def test_without_history_non_json_values_are_refused_too() -> None:
    """``history=False`` checks what ``DecisionHistory.step`` checks: observations before
    the model is called, the decision after."""
    calls: list[Any] = []

    async def generate(messages: Any, schema: Any) -> dict[str, Any]:
        calls.append(messages)
        return {"action": "call", "calls": [{"name": "measure", "arguments": {"x": math.inf}}]}

    provider = create_function_decision_provider(generate=generate, history=False)
    spec = CapabilitySpec("measure", "Measure", {"type": "object"})
    bad = Observation("c1", "measure", {}, "ok", {"reading": math.nan})
    base: dict[str, Any] = {
        "run_id": "r",
        "invocation_id": "i",
        "agent_ref": "a",
        "instructions": "x",
    }
    with pytest.raises(ConfigurationError, match=r"observations\[0\]\.result\[key 0\]"):
        await provider.decide(
            DecisionRequest(**base, input="go", capabilities=(spec,), observations=(bad,))
        )
    assert calls == []
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(DecisionRequest(**base, input="go", capabilities=(spec,)))
    assert caught.value.provider_error_code == "invalid_json"
