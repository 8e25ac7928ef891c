"""The Anthropic provider, driven through the official SDK against FakeAnthropicServer."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import pytest

from tests._providers import anthropic_sdk
from tests.providers._requests import LOOKUP
from tests.providers._requests import decision_request as request
from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    ProviderContextCountUnavailable,
    ProviderContextGuardUnsupported,
    ProviderContextWindowExceeded,
)
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.providers import (
    ContextConfig,
    DecisionRequest,
    Observation,
    TraceCall,
    Turn,
)
from touba.providers._framing import structured_schema
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.testing.fakes import (
    FakeAnthropicServer,
    anthropic_redacted_thinking,
    anthropic_text,
    anthropic_thinking,
    anthropic_tool_use,
)
from touba.testing.fakes._anthropic_rules import check_messages

MODEL = "claude-test"
SECRET = "sk-ant-secret"  # the key no record or event may hold
ENABLED = {"type": "enabled", "budget_tokens": 1024}
ADAPTIVE = {"type": "adaptive"}
LOOKUP_TOOL = {
    "name": "lookup_order",
    "description": "Find an order",
    "input_schema": dict(LOOKUP.parameters),
}
COUNT_EXCLUDED = {"max_tokens", "metadata", "stop_sequences", "temperature"}


@pytest.fixture
def preserved() -> Iterator[FakeAnthropicServer]:
    """A server whose thinking signatures bind their prefix (newer models)."""
    with FakeAnthropicServer(preserved_thinking=True) as srv:
        yield srv


@pytest.fixture
def api_key() -> str:
    return SECRET


@pytest.fixture
async def pclient(preserved: FakeAnthropicServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    sdk = anthropic_sdk(preserved, SECRET)
    yield sdk
    await sdk.close()


def answer(decision: Any, result: Any = "shipped", **kwargs: Any) -> tuple[Observation, ...]:
    return tuple(
        Observation(c.call_id, c.name, c.arguments, kwargs.get("status", "ok"), result)
        for c in decision.calls
    )


def bodies(srv: FakeAnthropicServer, endpoint: str = "messages") -> list[dict[str, Any]]:
    return [r.body for r in srv.requests_to(endpoint)]


def assert_accepted(srv: FakeAnthropicServer) -> None:
    """The fake's validator rejected nothing (every request answered 200)."""
    assert [r.status for r in srv.requests] == [200] * len(srv.requests)


def kinds(message: dict[str, Any]) -> list[str]:
    return [b["type"] for b in message["content"]]


class Events(list[Any]):
    def __call__(self, event: Any) -> None:
        self.append(event)

    def of(self, kind: str) -> list[Any]:
        return [e for e in self if e.kind == kind]


def make(anthropic_client: Any, store: Any = None, **kwargs: Any) -> Any:
    config = kwargs.pop("config", {})
    history = kwargs.pop(
        "history", HistoryConfig(store=store or MemoryHistoryStore(), namespace="t", **config)
    )
    return create_anthropic_decision_provider(
        model=MODEL, client=anthropic_client, history=history, **kwargs
    )


# native round trip ---------------------------------------------------------


async def test_native_call_then_final_sends_exact_bodies(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    store = MemoryHistoryStore()
    provider = make(anthropic_client, store)
    assert (provider.provider, provider.model, provider.decision_interface) == (
        "anthropic",
        MODEL,
        "native",
    )
    anthropic_server.script_response(
        anthropic_text("Let me check."),
        anthropic_tool_use("lookup_order", {"order_id": "A1"}, id="toolu_1"),
    )
    first = await provider.decide(request())
    assert [(c.call_id, c.name, dict(c.arguments)) for c in first.calls] == [
        ("toolu_1", "lookup_order", {"order_id": "A1"})
    ]
    assert (first.text, first.output) == ("Let me check.", None)
    assert first.usage.input_tokens is not None

    anthropic_server.script_response(anthropic_text("Shipped."))
    final = await provider.decide(request(observations=answer(first, {"status": "shipped"})))
    assert (final.output, final.calls) == ("Shipped.", ())

    user = {"role": "user", "content": [{"type": "text", "text": "Where is order A1?"}]}
    one, two = bodies(anthropic_server)
    assert one == {
        "model": MODEL,
        "max_tokens": 1024,
        "system": "Help with orders.",
        "tools": [LOOKUP_TOOL],
        "messages": [user],
    }
    assert two == {
        **one,
        "messages": [
            user,
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {
                        "type": "tool_use",
                        "name": "lookup_order",
                        "input": {"order_id": "A1"},
                        "id": "toolu_1",
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": '{"status":"ok","result":{"status":"shipped"}}',
                    }
                ],
            },
        ],
    }
    (row,) = await store.list()
    assert row.messages == 3
    assert_accepted(anthropic_server)


async def _two_lookups(server: FakeAnthropicServer, provider: Any) -> Any:
    """A decision of two lookup_order calls, toolu_a and toolu_b."""
    server.script_response(
        anthropic_tool_use("lookup_order", {"order_id": "A1"}, id="toolu_a"),
        anthropic_tool_use("lookup_order", {"order_id": "B2"}, id="toolu_b"),
    )
    return await provider.decide(request())


async def test_parallel_calls_answer_with_all_results_first(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    provider = make(anthropic_client)
    first = await _two_lookups(anthropic_server, provider)
    assert [c.call_id for c in first.calls] == ["toolu_a", "toolu_b"]
    anthropic_server.script_response(anthropic_text("Both shipped."))
    await provider.decide(request(observations=tuple(reversed(answer(first)))))
    last = bodies(anthropic_server)[-1]["messages"][-1]
    assert last["role"] == "user"
    assert [(b["type"], b["tool_use_id"]) for b in last["content"]] == [
        ("tool_result", "toolu_a"),
        ("tool_result", "toolu_b"),
    ]
    assert_accepted(anthropic_server)


async def test_error_and_denied_observations_are_error_results(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    provider = make(anthropic_client)
    first = await _two_lookups(anthropic_server, provider)
    a, b = first.calls
    observations = (
        Observation(a.call_id, a.name, a.arguments, "error", error="timeout"),
        Observation(b.call_id, b.name, b.arguments, "denied"),
    )
    anthropic_server.script_response(anthropic_text("Could not check."))
    await provider.decide(request(observations=observations))
    results = bodies(anthropic_server)[-1]["messages"][-1]["content"]
    assert results == [
        {
            "type": "tool_result",
            "tool_use_id": "toolu_a",
            "content": '{"status":"error","error":"timeout"}',
            "is_error": True,
        },
        {
            "type": "tool_result",
            "tool_use_id": "toolu_b",
            "content": '{"status":"denied","error":"denied"}',
            "is_error": True,
        },
    ]
    assert_accepted(anthropic_server)


async def test_output_schema_is_stated_and_the_final_answer_parsed(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}, "required": ["eta"]}
    provider = make(anthropic_client)
    anthropic_server.script_response(anthropic_text('```json\n{"eta": 3}\n```'))
    decision = await provider.decide(request(output_schema=schema))
    assert decision.output == {"eta": 3}
    assert '{"type":"object","properties":{"eta"' in bodies(anthropic_server)[0]["system"]


# structured interface ------------------------------------------------------


async def test_structured_forces_the_decision_tool_and_answers_it(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    provider = make(anthropic_client, decision_interface="structured")
    call = {"action": "call", "calls": [{"name": "lookup_order", "arguments": {"order_id": "A1"}}]}
    anthropic_server.script_response(anthropic_tool_use("touba_decision", call, id="toolu_d1"))
    first = await provider.decide(request())
    (made,) = first.calls
    assert (made.name, dict(made.arguments)) == ("lookup_order", {"order_id": "A1"})
    assert made.call_id.startswith("call_")

    anthropic_server.script_response(
        anthropic_tool_use("touba_decision", {"action": "final", "output": "Shipped."})
    )
    final = await provider.decide(request(observations=answer(first, "shipped")))
    assert final.output == "Shipped."

    one, two = bodies(anthropic_server)
    assert one["tool_choice"] == {
        "type": "tool",
        "name": "touba_decision",
        "disable_parallel_tool_use": True,
    }
    assert [t["name"] for t in one["tools"]] == ["touba_decision"]
    assert one["tools"][0]["input_schema"] == structured_schema((LOOKUP,), None)
    assert one["system"].startswith("Help with orders.\n\nAnswer only with a JSON decision")
    _, assistant, results = two["messages"]
    assert assistant["content"][0]["id"] == "toolu_d1"
    (result,) = results["content"]
    assert (result["type"], result["tool_use_id"]) == ("tool_result", "toolu_d1")
    assert made.call_id in result["content"]
    assert "untrusted" not in two["system"]
    assert_accepted(anthropic_server)


async def test_structured_options_touba_owns_are_refused(
    anthropic_client: anthropic.AsyncAnthropic,
) -> None:
    with pytest.raises(ConfigurationError, match="tool_choice"):
        make(anthropic_client, decision_interface="structured", tool_choice={"type": "auto"})


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}], ids=["absent", "disabled"])
async def test_structured_without_thinking_forces_the_decision_tool(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic, thinking: Any
) -> None:
    options = {} if thinking is None else {"thinking": thinking}
    provider = make(anthropic_client, decision_interface="structured", **options)
    anthropic_server.script_response(
        anthropic_tool_use("touba_decision", {"action": "final", "output": 1})
    )
    assert (await provider.decide(request())).output == 1
    (body,) = bodies(anthropic_server)
    assert body["tool_choice"]["type"] == "tool"
    assert_accepted(anthropic_server)


@pytest.mark.parametrize("thinking", [ENABLED, ADAPTIVE], ids=["enabled", "adaptive"])
async def test_structured_with_thinking_never_forces_a_tool(
    anthropic_server: FakeAnthropicServer,
    anthropic_client: anthropic.AsyncAnthropic,
    thinking: dict[str, Any],
) -> None:
    """The API refuses a forced tool choice with thinking on: the decision tool is
    offered with ``auto``, and the results answer it, thinking blocks replayed."""
    provider = make(
        anthropic_client, decision_interface="structured", thinking=thinking, max_output_tokens=2048
    )
    call = {"action": "call", "calls": [{"name": "lookup_order", "arguments": {"order_id": "A1"}}]}
    anthropic_server.script_response(
        anthropic_thinking("which order?"),
        anthropic_tool_use("touba_decision", call, id="toolu_d1"),
    )
    first = await provider.decide(request())
    anthropic_server.script_response(
        anthropic_thinking("shipped"),
        anthropic_tool_use("touba_decision", {"action": "final", "output": "Shipped."}),
    )
    final = await provider.decide(request(observations=answer(first, "shipped")))
    assert final.output == "Shipped."

    one, two = bodies(anthropic_server)
    for body in (one, two):
        assert body["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
        assert [t["name"] for t in body["tools"]] == ["touba_decision"]
    assert "touba_decision tool" in one["system"]
    _, assistant, results = two["messages"]
    assert kinds(assistant) == ["thinking", "tool_use"]
    assert [b["tool_use_id"] for b in results["content"]] == ["toolu_d1"]
    assert_accepted(anthropic_server)


async def test_structured_with_thinking_and_no_decision_call_is_a_schema_violation(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    provider = make(anthropic_client, decision_interface="structured", thinking=ADAPTIVE)
    anthropic_server.script_response(
        anthropic_thinking("hm"), anthropic_text("I think it shipped.")
    )
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request())
    assert caught.value.provider_error_code == "missing_decision"


@pytest.mark.parametrize("interface", ["native", "structured"])
@pytest.mark.parametrize("thinking", [ENABLED, ADAPTIVE], ids=["enabled", "adaptive"])
@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "tool", "name": "lookup_order"}], ids=["any", "tool"]
)
async def test_a_forced_tool_choice_with_thinking_is_refused_before_anything_is_sent(
    anthropic_client: anthropic.AsyncAnthropic, interface: str, thinking: Any, choice: Any
) -> None:
    with pytest.raises(ConfigurationError, match="tool_choice"):
        make(anthropic_client, decision_interface=interface, thinking=thinking, tool_choice=choice)


async def test_native_tool_choice_auto_or_none_with_thinking_is_sent(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    for choice in ({"type": "auto"}, {"type": "none"}):
        provider = make(anthropic_client, thinking=ADAPTIVE, tool_choice=choice)
        anthropic_server.script_response(anthropic_thinking("easy"), anthropic_text("Shipped."))
        assert (await provider.decide(request())).output == "Shipped."
        assert bodies(anthropic_server)[-1]["tool_choice"] == choice
    assert_accepted(anthropic_server)


# thinking blocks -----------------------------------------------------------


async def _tool_loop(
    srv: FakeAnthropicServer, provider: Any, steps: int, **request_kwargs: Any
) -> list[Any]:
    """``steps`` thinking tool-use decisions, each answering the previous one."""
    decisions: list[Any] = []
    for step in range(steps):
        blocks = [anthropic_thinking(f"plan {step}")]
        if step == 0:
            blocks.append(anthropic_redacted_thinking())
        blocks.append(anthropic_tool_use("lookup_order", {"order_id": f"A{step}"}))
        srv.script_response(*blocks)
        observations = answer(decisions[-1], f"r{step}") if decisions else ()
        decisions.append(
            await provider.decide(request(observations=observations, **request_kwargs))
        )
    return decisions


@pytest.mark.parametrize(
    ("preserved_thinking", "thinking"), [(False, ENABLED), (True, ADAPTIVE), (True, ENABLED)]
)
async def test_thinking_round_trip_replays_blocks_verbatim(
    preserved_thinking: bool, thinking: dict[str, Any]
) -> None:
    with FakeAnthropicServer(preserved_thinking=preserved_thinking) as srv:
        sdk = anthropic_sdk(srv, SECRET)
        provider = make(sdk, thinking=thinking, max_output_tokens=2048)
        decisions = await _tool_loop(srv, provider, 2)
        srv.script_response(anthropic_thinking("done"), anthropic_text("Shipped."))
        final = await provider.decide(request(observations=answer(decisions[-1], "r")))
        assert final.output == "Shipped."
        await sdk.close()

        two, three = bodies(srv)[1:]
        first_turn = two["messages"][1]
        assert kinds(first_turn) == ["thinking", "redacted_thinking", "tool_use"]
        assert first_turn["content"][0]["thinking"] == "plan 0"
        # The same blocks, signatures and redacted data, every time they are replayed.
        assert three["messages"][1] == first_turn
        assert kinds(three["messages"][3]) == ["thinking", "tool_use"]
        assert_accepted(srv)


async def test_after_a_trim_stale_thinking_is_removed_for_preserved_thinking_models(
    preserved: FakeAnthropicServer, pclient: anthropic.AsyncAnthropic
) -> None:
    events = Events()
    provider = make(pclient, thinking=ADAPTIVE, config={"max_messages": 4, "on_event": events})
    decisions = await _tool_loop(preserved, provider, 3)
    preserved.script_response(anthropic_thinking("done"), anthropic_text("Shipped."))
    await provider.decide(request(observations=answer(decisions[-1], "r")))
    assert events.of("history_trimmed")

    trimmed = bodies(preserved)[-1]
    assistants = [m for m in trimmed["messages"] if m["role"] == "assistant"]
    assert [kinds(m) for m in assistants] == [["tool_use"], ["tool_use"]]
    assert_accepted(preserved)
    # Replaying the stale blocks instead is what the API refuses.
    earlier = bodies(preserved)[-2]["messages"][3]  # decision 1, replayed before the trim
    assert kinds(earlier) == ["thinking", "tool_use"]
    restored = json.loads(json.dumps(trimmed))
    restored["messages"][1] = earlier
    problems = check_messages(restored, preserved.ledger, bind_prefix=True)
    assert any("bound to a different conversation" in p.message for p in problems)


async def test_after_a_trim_enabled_thinking_keeps_the_continuation_blocks(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    provider = make(
        anthropic_client, thinking=ENABLED, max_output_tokens=2048, config={"max_messages": 4}
    )
    decisions = await _tool_loop(anthropic_server, provider, 3)
    anthropic_server.script_response(anthropic_thinking("done"), anthropic_text("Shipped."))
    await provider.decide(request(observations=answer(decisions[-1], "r")))
    trimmed = bodies(anthropic_server)[-1]
    assistants = [m for m in trimmed["messages"] if m["role"] == "assistant"]
    # Earlier turn: stale, stripped. Turn the results answer: kept, as the API requires.
    assert [kinds(m) for m in assistants] == [["tool_use"], ["thinking", "tool_use"]]
    assert assistants[1]["content"][0]["thinking"] == "plan 2"
    assert_accepted(anthropic_server)


async def test_enabled_thinking_after_a_trim_on_a_prefix_binding_model_is_a_400(
    preserved: FakeAnthropicServer, pclient: anthropic.AsyncAnthropic
) -> None:
    store = MemoryHistoryStore()
    provider = make(
        pclient, store, thinking=ENABLED, max_output_tokens=2048, config={"max_messages": 4}
    )
    decisions = await _tool_loop(preserved, provider, 3)
    (before,) = await store.list()
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request(observations=answer(decisions[-1], "r")))
    assert caught.value.status_code == 400
    cause = caught.value.__cause__
    assert isinstance(cause, anthropic.BadRequestError)
    assert "bound to a different conversation" in str(cause.api_message)
    (after,) = await store.list()
    assert after.messages == before.messages  # nothing stored


async def test_a_summary_changes_the_prefix_so_thinking_is_dropped(
    preserved: FakeAnthropicServer, pclient: anthropic.AsyncAnthropic
) -> None:
    seen: list[Any] = []

    async def summarize(req: Any) -> str:
        seen.append(req)
        return "Looked up A0."

    provider = make(pclient, thinking=ADAPTIVE, config={"max_messages": 4, "summarize": summarize})
    decisions = await _tool_loop(preserved, provider, 3)
    preserved.script_response(anthropic_text("Shipped."))
    await provider.decide(request(observations=answer(decisions[-1], "r")))
    assert seen
    last = bodies(preserved)[-1]["messages"]
    texts = [b["text"] for b in last[0]["content"]]
    assert texts[0] == "Where is order A1?"
    assert texts[1].startswith("[touba: untrusted summary")
    assert all("thinking" not in kinds(m) for m in last if m["role"] == "assistant")
    assert_accepted(preserved)


# continuity and history modes ----------------------------------------------


async def test_opaque_refs_replays_projected_arguments_without_opaque_data(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    provider = make(anthropic_client, config={"continuity": "opaque_refs"}, thinking=ADAPTIVE)
    anthropic_server.script_response(
        anthropic_thinking("secret plan"),
        anthropic_tool_use("lookup_order", {"order_id": "A1-raw"}, id="toolu_1"),
    )
    first = await provider.decide(request())
    (call,) = first.calls
    projected = Observation(call.call_id, call.name, {"order_id": "A1"}, "ok", "shipped")
    anthropic_server.script_response(anthropic_text("Shipped."))
    await provider.decide(request(observations=(projected,)))
    body = bodies(anthropic_server)[-1]
    assert body["messages"][1]["content"] == [
        {"type": "tool_use", "id": "toolu_1", "name": "lookup_order", "input": {"order_id": "A1"}}
    ]
    assert "A1-raw" not in json.dumps(body)
    assert "secret plan" not in json.dumps(body)
    assert_accepted(anthropic_server)


async def test_opaque_refs_with_enabled_thinking_is_refused(
    anthropic_client: anthropic.AsyncAnthropic,
) -> None:
    with pytest.raises(ConfigurationError, match="opaque_refs"):
        make(anthropic_client, config={"continuity": "opaque_refs"}, thinking=ENABLED)


async def test_history_false_sends_observations_as_data_without_ids(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    provider = make(anthropic_client, history=False)
    anthropic_server.script_response(anthropic_text("Shipped."))
    observation = Observation("toolu_lost", "lookup_order", {"order_id": "A1"}, "ok", {"s": 1})
    await provider.decide(DecisionRequest(input="Where is A1?", observations=(observation,)))
    (body,) = bodies(anthropic_server)
    (message,) = body["messages"]
    assert [b["type"] for b in message["content"]] == ["text", "text"]
    assert "toolu_lost" not in json.dumps(body)
    assert '"s":1' in message["content"][1]["text"]
    assert_accepted(anthropic_server)


async def test_prior_turns_with_traces_are_valid_tool_pairs(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    trace = (
        TraceCall("call.1/x", "lookup_order", {"order_id": "Z9"}, "ok", "lost"),
        TraceCall("call_2", "lookup_order", {"order_id": "Z8"}, "error", error="gone"),
    )
    turns = (
        Turn("Where is Z9?", replies=("Z9 is lost.",), trace=(trace,)),
        Turn("And Z7?", trace=((TraceCall("c3", "lookup_order", {"order_id": "Z7"}, "ok", 1),),)),
    )
    provider = make(anthropic_client)
    anthropic_server.script_response(anthropic_text("A1 shipped."))
    await provider.decide(request(prior_turns=turns))
    messages = bodies(anthropic_server)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3 + ["user"]
    uses = messages[1]["content"]
    results = messages[2]["content"]
    assert [u["id"] for u in uses] == [r["tool_use_id"] for r in results]
    assert uses[0]["id"] != "call.1/x"
    assert uses[1]["id"] == "call_2"
    assert results[1]["is_error"] is True
    assert messages[3]["content"] == [{"type": "text", "text": "Z9 is lost."}]
    # The last turn has no reply: its results come first, then the new input.
    assert kinds(messages[-1]) == ["tool_result", "text"]
    assert messages[-1]["content"][1]["text"] == "Where is order A1?"
    assert_accepted(anthropic_server)


async def test_structured_prior_turns_send_traces_as_data(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    trace = (TraceCall("c1", "lookup_order", {"order_id": "Z9"}, "ok", "lost"),)
    provider = make(anthropic_client, decision_interface="structured")
    anthropic_server.script_response(
        anthropic_tool_use("touba_decision", {"action": "final", "output": "ok"})
    )
    await provider.decide(request(prior_turns=(Turn("Z9?", ("Lost.",), (trace,)),)))
    messages = bodies(anthropic_server)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"][1]["text"].startswith("[touba: tools used in that turn")
    assert_accepted(anthropic_server)


async def test_requests_the_api_cannot_take_are_refused_before_sending(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    with pytest.raises(ConfigurationError, match="user message"):
        await make(anthropic_client, history=False).decide(DecisionRequest(input=None))
    provider = make(anthropic_client)
    anthropic_server.script_response(anthropic_text("Done."))
    await provider.decide(request())
    with pytest.raises(ConfigurationError, match="prefill"):
        await provider.decide(request())  # after a final decision, nothing new to answer
    assert len(anthropic_server.requests) == 1


# schema violations and transport errors ------------------------------------


@pytest.mark.parametrize(
    ("interface", "blocks", "stop_reason", "code"),
    [
        ("native", [], "refusal", "refusal"),
        ("native", [anthropic_text("Ship")], "max_tokens", "truncated_output"),
        ("native", [], None, "empty_output"),
        ("native", [anthropic_tool_use("refund", {})], None, "unknown_capability"),
        (
            "native",
            [anthropic_tool_use("lookup_order", {"id": 1})],
            None,
            "arguments_schema_mismatch",
        ),
        ("native", [anthropic_text("not json")], None, "invalid_json"),
        ("native", [anthropic_text('{"eta": "soon"}')], None, "output_schema_mismatch"),
        ("structured", [], None, "empty_output"),
        ("structured", [anthropic_text("I think so")], None, "missing_decision"),
        ("structured", [anthropic_tool_use("touba_decision", {"action": "x"})], None, "bad_action"),
        (
            "structured",
            [anthropic_tool_use("touba_decision", {"action": "final", "output": {}})],
            None,
            "output_schema_mismatch",
        ),
    ],
)
async def test_schema_violations_store_nothing(
    anthropic_server: FakeAnthropicServer,
    anthropic_client: anthropic.AsyncAnthropic,
    interface: str,
    blocks: list[Any],
    stop_reason: str | None,
    code: str,
) -> None:
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}, "required": ["eta"]}
    store = MemoryHistoryStore()
    provider = make(anthropic_client, store, decision_interface=interface)
    anthropic_server.script_response(*blocks, stop_reason=stop_reason)
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request(output_schema=schema))
    assert caught.value.provider_error_code == code
    assert "soon" not in str(caught.value)
    assert "not json" not in str(caught.value)
    assert await store.list() == []


@pytest.mark.parametrize("status", [500, 429, 529])
async def test_http_errors_are_unavailable_without_retry(
    anthropic_server: FakeAnthropicServer, status: int
) -> None:
    sdk = anthropic.AsyncAnthropic(
        base_url=anthropic_server.base_url, api_key="k"
    )  # SDK default retries
    store = MemoryHistoryStore()
    provider = make(sdk, store)
    anthropic_server.script_error(status)
    anthropic_server.script_error(status)
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    assert caught.value.status_code == status
    assert len(anthropic_server.requests) == 1  # the provider never lets the SDK retry
    assert await store.list() == []
    await sdk.close()


async def test_unreachable_server_is_unavailable() -> None:
    with FakeAnthropicServer() as srv:
        url = srv.base_url
    sdk = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
    provider = make(sdk)
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    assert caught.value.status_code is None
    await sdk.close()


# context guard -------------------------------------------------------------


async def test_guard_counts_the_full_body_and_reports_the_reserve(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    events = Events()
    provider = make(
        anthropic_client,
        context=ContextConfig(context_window_tokens=200_000),
        thinking=ENABLED,
        max_output_tokens=2048,
        metadata={"user_id": "u1"},
        stop_sequences=["END"],
        output_config={"effort": "low"},
        temperature=0.5,
        config={"on_event": events},
    )
    anthropic_server.script_count(1000)
    anthropic_server.script_response(anthropic_thinking("hm"), anthropic_text("Shipped."))
    await provider.decide(request())
    (count,) = bodies(anthropic_server, "count_tokens")
    (generation,) = bodies(anthropic_server)
    assert generation["temperature"] == 0.5
    assert generation["metadata"] == {"user_id": "u1"}
    assert count == {k: v for k, v in generation.items() if k not in COUNT_EXCLUDED}
    (event,) = events.of("provider_context_count")
    assert (event.provider, event.count, event.window, event.fits) == (
        "anthropic",
        1000,
        200_000,
        True,
    )
    assert event.reserve == math.ceil(1000 * 1.2) + 512 + 2048
    assert "Where is order" not in json.dumps(dataclasses.asdict(event))
    assert_accepted(anthropic_server)


def _marker_count(body: dict[str, Any]) -> int:
    return 100 + 1000 * json.dumps(body).count("BIG")


async def test_guard_drops_prior_turns_then_oldest_exchanges_before_generating() -> None:
    with FakeAnthropicServer(count_tokens=_marker_count) as srv:
        sdk = anthropic_sdk(srv, SECRET)
        store = MemoryHistoryStore()
        plain = make(sdk, store)
        guarded = make(
            sdk,
            store,
            context=ContextConfig(1600, input_token_multiplier=1, safety_margin_tokens=0),
            max_output_tokens=100,
        )
        turns = (Turn("earlier BIG question", ("answer",)),)
        srv.script_response(anthropic_tool_use("lookup_order", {"order_id": "A1"}, id="toolu_0"))
        d0 = await plain.decide(request(prior_turns=turns))
        srv.script_response(anthropic_tool_use("lookup_order", {"order_id": "A2"}, id="toolu_1"))
        d1 = await plain.decide(request(prior_turns=turns, observations=answer(d0, "BIG")))
        srv.script_response(anthropic_text("Done."))
        await guarded.decide(request(prior_turns=turns, observations=answer(d1, "BIG")))
        await sdk.close()

        generation = bodies(srv)[-1]
        assert [m["role"] for m in generation["messages"]] == ["user", "assistant", "user"]
        assert generation["messages"][1]["content"][0]["id"] == "toolu_1"
        counts = bodies(srv, "count_tokens")
        assert 2 <= len(counts) <= 2 + math.ceil(math.log2(3))
        expected = {k: v for k, v in generation.items() if k not in COUNT_EXCLUDED}
        assert expected in counts
        assert_accepted(srv)


async def test_guard_refuses_a_minimum_that_does_not_fit(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    provider = make(
        anthropic_client,
        context=ContextConfig(1600, safety_margin_tokens=0),
        max_output_tokens=1500,
    )
    anthropic_server.script_count(500)
    with pytest.raises(ProviderContextWindowExceeded):
        await provider.decide(request())
    assert bodies(anthropic_server) == []


@pytest.mark.parametrize("failure", ["http", "missing"])
async def test_count_unavailable_generates_nothing(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic, failure: str
) -> None:
    store = MemoryHistoryStore()
    provider = make(anthropic_client, store, context=ContextConfig(100_000))
    if failure == "http":
        anthropic_server.script_error(500, endpoint="count_tokens")
    else:
        anthropic_server.script_count(None)
    with pytest.raises(ProviderContextCountUnavailable):
        await provider.decide(request())
    assert bodies(anthropic_server) == []
    assert await store.list() == []


async def test_guard_refuses_platform_clients_and_server_side_options(
    anthropic_client: anthropic.AsyncAnthropic,
) -> None:
    context = ContextConfig(100_000)
    platforms: list[Any] = [
        anthropic.AsyncAnthropicBedrock(
            aws_region="us-east-1", aws_access_key="a", aws_secret_key="b"
        ),
        anthropic.AnthropicBedrock(aws_region="us-east-1", aws_access_key="a", aws_secret_key="b"),
        anthropic.AsyncAnthropicVertex(region="us-east5", project_id="p", access_token="t"),
        anthropic.AnthropicVertex(region="us-east5", project_id="p", access_token="t"),
    ]
    for platform in platforms:
        with pytest.raises(ProviderContextGuardUnsupported, match=type(platform).__name__):
            make(platform, context=context)
    for option in ("container", "context_management", "mcp_servers"):
        with pytest.raises(ProviderContextGuardUnsupported, match=option):
            make(anthropic_client, context=context, **{option: {"any": "value"}})
    # Without the guard an async platform client is fine, a sync one is not.
    make(platforms[0])
    with pytest.raises(ConfigurationError, match="AsyncAnthropic"):
        make(platforms[1])
    for platform in platforms:
        close = platform.close()
        if close is not None:
            await close


# factory -------------------------------------------------------------------


async def test_factory_validates_options(anthropic_client: anthropic.AsyncAnthropic) -> None:
    for option in ("messages", "system", "tools", "max_tokens", "stream", "extra_body"):
        with pytest.raises(ConfigurationError, match=option):
            make(anthropic_client, **{option: None})
    with pytest.raises(ConfigurationError, match="format"):
        make(anthropic_client, output_config={"format": {"type": "json_schema", "schema": {}}})
    with pytest.raises(ConfigurationError, match="thinking"):
        make(anthropic_client, thinking={"type": "sometimes"})
    with pytest.raises(ConfigurationError, match="max_output_tokens"):
        make(anthropic_client, max_output_tokens=None)
    with pytest.raises(ConfigurationError, match="model"):
        create_anthropic_decision_provider(model="", client=anthropic_client)


async def test_default_client_reads_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-from-env")
    provider = create_anthropic_decision_provider(model=MODEL)
    assert provider.provider == "anthropic"


async def test_keys_never_reach_records_events_or_the_wire_log(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    store = MemoryHistoryStore()
    events = Events()
    provider = make(anthropic_client, store, config={"on_event": events})
    anthropic_server.script_response(anthropic_tool_use("lookup_order", {"order_id": "A1"}))
    await provider.decide(request())
    (row,) = await store.list()
    record = await store.read(row.key)
    assert SECRET not in json.dumps(record, default=str)
    assert SECRET not in repr(list(events))
    assert all("x-api-key" not in r.headers for r in anthropic_server.requests)
