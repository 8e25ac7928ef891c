"""The OpenAI-compatible provider (Chat Completions), driven through the openai SDK
against the fake server, whose validator refuses what the real API refuses."""

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.providers._requests import LOOKUP, decision_request
from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    ConfigurationError,
)
from touba.history import HistoryConfig, MemoryHistoryStore, SummaryRequest
from touba.providers import (
    CapabilitySpec,
    ContextConfig,
    DecisionRequest,
    Observation,
    TraceCall,
    Turn,
)
from touba.providers._framing import (
    enforced_structured_schema,
    structured_instructions,
    structured_schema,
)
from touba.providers.compatible import create_openai_compatible_decision_provider
from touba.testing.fakes import (
    FakeOpenAIServer,
    chat_tool_call,
    validate_chat_completions_request,
)

MODEL = "qwen3:8b"
REFUND = CapabilitySpec(
    "refund",
    "Refund an order",
    {"type": "object", "properties": {"order_id": {"type": "string"}}},
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": c.name,
            "description": c.description,
            "parameters": dict(c.parameters),
        },
    }
    for c in (LOOKUP, REFUND)
]


class KeyRecordingServer(FakeOpenAIServer):
    """The fake, also keeping the Authorization header it removes from its records."""

    def __init__(self) -> None:
        super().__init__()
        self.authorization: list[str | None] = []

    def _handle(self, method, raw_path, headers, raw):
        self.authorization.append(headers.get("authorization"))
        return super()._handle(method, raw_path, headers, raw)


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as srv:
        yield srv


def provider_for(server, **kwargs):
    kwargs.setdefault("history", HistoryConfig(store=MemoryHistoryStore(), namespace="t"))
    return create_openai_compatible_decision_provider(
        model=MODEL, base_url=server.base_url + "/v1", **kwargs
    )


def request(**fields: Any) -> DecisionRequest:
    return decision_request(LOOKUP, REFUND, **fields)


def bodies(server) -> list[dict[str, Any]]:
    """Every generation body sent; each was accepted by the fake's validator."""
    sent = server.requests_to("chat_completions")
    assert [r.status for r in sent] == [200] * len(sent)
    for r in sent:
        assert validate_chat_completions_request(r.body) == []
    return [r.body for r in sent]


def observe(call, status="ok", result=None, error=None, arguments=None) -> Observation:
    return Observation(
        call.call_id,
        call.name,
        call.arguments if arguments is None else arguments,
        status,
        result,
        error,
    )


def completion(message: dict[str, Any], finish_reason: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
    }


# native -------------------------------------------------------------------------


async def test_native_call_observation_final_round_trip(server) -> None:
    store = MemoryHistoryStore()
    provider = provider_for(
        server,
        history=HistoryConfig(store=store, namespace="t"),
        max_output_tokens=300,
        temperature=0.2,
    )
    assert (provider.provider, provider.model, provider.decision_interface) == (
        "openai_compatible",
        MODEL,
        "native",
    )
    server.script_chat_completion(
        "Let me look.", tool_calls=[chat_tool_call("lookup_order", {"order_id": "A1"}, id="c_1")]
    )
    first = await provider.decide(request())
    (call,) = first.calls
    assert (call.call_id, call.name, dict(call.arguments)) == (
        "c_1",
        "lookup_order",
        {"order_id": "A1"},
    )
    assert first.output is None
    assert first.text == "Let me look."
    assert first.usage.input_tokens is not None

    server.script_chat_completion("Order A1 has shipped.")
    final = await provider.decide(
        request(observations=(observe(call, result={"state": "shipped"}),))
    )
    assert final.calls == ()
    assert final.output == "Order A1 has shipped."

    one, two = bodies(server)
    system = {"role": "system", "content": "Help with orders."}
    user = {"role": "user", "content": "Where is order A1?"}
    assert one == {
        "model": MODEL,
        "messages": [system, user],
        "tools": TOOLS,
        "max_tokens": 300,
        "temperature": 0.2,
    }
    assert two == {
        "model": MODEL,
        "messages": [
            system,
            user,
            {
                "role": "assistant",
                "content": "Let me look.",
                "annotations": [],
                "tool_calls": [
                    {
                        "id": "c_1",
                        "type": "function",
                        "function": {"name": "lookup_order", "arguments": '{"order_id": "A1"}'},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "c_1",
                "content": '{"status":"ok","result":{"state":"shipped"}}',
            },
        ],
        "tools": TOOLS,
        "max_tokens": 300,
        "temperature": 0.2,
    }
    (row,) = await store.list()
    assert row.messages == 3  # decision, result, final decision


async def test_parallel_calls_with_error_and_denied_results_stay_paired(server) -> None:
    provider = provider_for(server)
    server.script_chat_completion(
        tool_calls=[
            chat_tool_call("lookup_order", {"order_id": "A1"}, id="c_1"),
            chat_tool_call("refund", {"order_id": "A1"}, id="c_2"),
            chat_tool_call("lookup_order", {"order_id": "B2"}, id="c_3"),
        ]
    )
    first = await provider.decide(request())
    assert [c.call_id for c in first.calls] == ["c_1", "c_2", "c_3"]
    a, b, c = first.calls
    server.script_chat_completion("done")
    observations = (
        observe(c, "error", error="timeout"),
        observe(b, "denied", error="refunds need approval"),
        observe(a, result={"state": "shipped"}),
    )
    await provider.decide(request(observations=observations))
    messages = bodies(server)[1]["messages"]
    assert [m.get("tool_call_id") for m in messages[3:]] == ["c_1", "c_2", "c_3"]
    assert [json.loads(m["content"]) for m in messages[3:]] == [
        {"status": "ok", "result": {"state": "shipped"}},
        {"status": "denied", "error": "refunds need approval"},
        {"status": "error", "error": "timeout"},
    ]


async def test_inline_replays_the_servers_message_untouched(server) -> None:
    """Reasoning fields and the model's exact argument text go back as returned; only
    the null content goes back as "" (chat templates read it, validation refuses null)."""
    store = MemoryHistoryStore()
    provider = provider_for(server, history=HistoryConfig(store=store, namespace="t"))
    returned = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "The user wants order A1.",
        "tool_calls": [
            {
                "id": "call_x9",
                "type": "function",
                "function": {"name": "lookup_order", "arguments": '{ "order_id" :"A1" }'},
            }
        ],
    }
    server.script_raw(200, completion(returned, "tool_calls"), endpoint="chat_completions")
    first = await provider.decide(request())
    server.script_chat_completion("Shipped.")
    await provider.decide(request(observations=(observe(first.calls[0], result=1),)))
    replayed = bodies(server)[1]["messages"][2]
    assert replayed == {**{k: v for k, v in returned.items() if v is not None}, "content": ""}
    (row,) = await store.list()
    record = await store.read(row.key)
    assert record is not None
    decision = record["exchanges"][0][0]
    assert decision["provider"] == "openai_compatible"
    assert decision["opaque"]["reasoning_content"] == "The user wants order A1."


async def test_opaque_refs_sends_projected_arguments_and_no_opaque_data(server) -> None:
    store = MemoryHistoryStore()
    provider = provider_for(
        server, history=HistoryConfig(store=store, namespace="t", continuity="opaque_refs")
    )
    returned = {
        "role": "assistant",
        "reasoning_content": "private thoughts",
        "tool_calls": [
            {
                "id": "c_1",
                "type": "function",
                "function": {
                    "name": "refund",
                    "arguments": '{"order_id": "A1", "card": "4111"}',
                },
            }
        ],
    }
    server.script_raw(200, completion(returned, "tool_calls"), endpoint="chat_completions")
    first = await provider.decide(request())
    projected = {"order_id": "A1", "card": "[redacted]"}
    server.script_chat_completion("Refunded.")
    await provider.decide(
        request(observations=(observe(first.calls[0], result="ok", arguments=projected),))
    )
    assistant = bodies(server)[1]["messages"][2]
    assert assistant == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c_1",
                "type": "function",
                "function": {
                    "name": "refund",
                    "arguments": json.dumps(projected, separators=(",", ":")),
                },
            }
        ],
    }
    (row,) = await store.list()
    record = json.dumps(await store.read(row.key))
    assert "4111" not in record
    assert "private thoughts" not in record


async def test_missing_call_id_is_issued_once_and_kept_for_the_result(server) -> None:
    returned = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup_order", "arguments": ""}}],
    }
    provider = provider_for(server)
    server.script_raw(200, completion(returned), endpoint="chat_completions")
    no_args = CapabilitySpec("lookup_order", "Find an order", {"type": "object"})
    first = await provider.decide(request(capabilities=(no_args,)))
    (call,) = first.calls
    assert call.call_id.startswith("call_")
    assert dict(call.arguments) == {}
    assert first.text is None
    server.script_chat_completion("ok")
    await provider.decide(request(capabilities=(no_args,), observations=(observe(call, result=1),)))
    messages = bodies(server)[1]["messages"]
    assert messages[2]["tool_calls"][0]["id"] == call.call_id
    assert messages[3]["tool_call_id"] == call.call_id


async def test_native_output_schema_is_asked_in_the_system_message_and_parsed(server) -> None:
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}, "required": ["eta"]}
    provider = provider_for(server)
    server.script_chat_completion('```json\n{"eta": 3}\n```')
    decision = await provider.decide(request(output_schema=schema))
    assert decision.output == {"eta": 3}
    (body,) = bodies(server)
    assert "response_format" not in body  # it would forbid tool calls on local servers
    system = body["messages"][0]["content"]
    assert system.startswith("Help with orders.\n\n")
    assert json.dumps(schema, separators=(",", ":")) in system


async def test_plain_text_answers_a_string_output_schema(server) -> None:
    provider = provider_for(server)
    server.script_chat_completion("Shipped on Monday.")
    decision = await provider.decide(request(output_schema={"type": "string"}))
    assert decision.output == "Shipped on Monday."


async def test_prior_turns_send_traces_as_valid_native_pairs(server) -> None:
    provider = provider_for(server)
    trace = (
        (
            TraceCall("t_1", "lookup_order", {"order_id": "Z9"}, "ok", {"state": "lost"}),
            TraceCall("t_2", "refund", {"order_id": "Z9"}, "denied", error="no"),
        ),
        (TraceCall("t_3", "refund", {"order_id": "Z9"}, "ok", "done"),),
    )
    turns = (
        Turn("hello", replies=("Hi!",)),
        Turn("Where is Z9?", replies=("It was lost; refunded.",), trace=trace),
    )
    server.script_chat_completion("ok")
    await provider.decide(request(prior_turns=turns))
    messages = bodies(server)[0]["messages"]
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert messages[4]["tool_calls"] == [
        {
            "id": "t_1",
            "type": "function",
            "function": {"name": "lookup_order", "arguments": '{"order_id":"Z9"}'},
        },
        {
            "id": "t_2",
            "type": "function",
            "function": {"name": "refund", "arguments": '{"order_id":"Z9"}'},
        },
    ]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["t_1", "t_2", "t_3"]
    assert messages[9] == {"role": "assistant", "content": "It was lost; refunded."}
    assert messages[10] == {"role": "user", "content": "Where is order A1?"}


async def test_history_false_sends_observations_as_data_with_no_call_ids(server) -> None:
    provider = provider_for(server, history=False)
    server.script_chat_completion("ok")
    observation = Observation("call_secret_id", "lookup_order", {"order_id": "A1"}, "ok", {"s": 1})
    await provider.decide(DecisionRequest(input="Where is A1?", observations=(observation,)))
    (body,) = bodies(server)
    assert "call_secret_id" not in json.dumps(body)
    assert "tools" not in body  # no capabilities offered
    (user,) = body["messages"]  # input and data merged: strict templates alternate
    assert user["content"].startswith("Where is A1?\n\n[touba: results of capability calls")
    assert '"s":1' in user["content"]


async def test_history_false_without_instructions_sends_no_system_message(server) -> None:
    provider = provider_for(server, history=False)
    server.script_chat_completion("hi")
    await provider.decide(DecisionRequest(input="hello"))
    assert bodies(server)[0]["messages"] == [{"role": "user", "content": "hello"}]


async def test_summary_goes_as_user_data(server) -> None:
    summaries: list[SummaryRequest] = []

    async def summarize(req: SummaryRequest) -> str:
        summaries.append(req)
        return "Earlier: looked up A1."

    provider = provider_for(
        server,
        history=HistoryConfig(max_messages=4, summarize=summarize, max_summary_bytes=512),
    )
    observations: tuple[Observation, ...] = ()
    for i in range(3):
        server.script_chat_completion(
            tool_calls=[chat_tool_call("lookup_order", {"order_id": f"A{i}"}, id=f"c_{i}")]
        )
        decision = await provider.decide(request(observations=observations))
        observations = (observe(decision.calls[0], result=i),)
    assert summaries
    last = bodies(server)[-1]["messages"]
    assert last[0]["role"] == "system"
    assert last[1]["role"] == "user"
    assert "untrusted summary" in last[1]["content"]
    assert last[1]["content"].startswith("Where is order A1?\n\n")


# every message has a string content ---------------------------------------------


def contents_are_strings(body: dict[str, Any]) -> None:
    """Chat templates read message.content: it is never missing nor null."""
    for i, message in enumerate(body["messages"]):
        assert isinstance(message.get("content"), str), f"message {i} has no string content"


async def _ignore(delta: object) -> None:
    """A sink: the decision streams."""


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("continuity", ["inline", "opaque_refs"])
async def test_every_message_shape_is_sent_with_a_string_content(
    server, continuity, streamed
) -> None:
    """Prior turns with traces, data, a summary, tool calls without text (the server
    answered null content, or none at all), results, replies and the final answer."""

    async def summarize(req: SummaryRequest) -> str:
        return "Earlier: looked orders up."

    provider = provider_for(
        server,
        history=HistoryConfig(
            max_messages=4, summarize=summarize, max_summary_bytes=512, continuity=continuity
        ),
    )
    trace = ((TraceCall("t_1", "lookup_order", {"order_id": "Z9"}, "ok", {"state": "lost"}),),)
    turns = (Turn("Where is Z9?", replies=("It was lost.",), trace=trace),)
    sink = _ignore if streamed else None
    lost = Observation("c_lost", "lookup_order", {"order_id": "A0"}, "ok", {"state": "late"})
    observations: tuple[Observation, ...] = (lost,)  # no pending call: sent as data
    for i in range(4):
        call = chat_tool_call("lookup_order", {"order_id": f"A{i}"}, id=f"c_{i}")
        if i % 2:
            server.script_raw(
                200,
                completion({"role": "assistant", "tool_calls": [call]}, "tool_calls"),
                endpoint="chat_completions",
            )  # no content field at all
        else:
            server.script_chat_completion(None, tool_calls=[call])  # "content": null
        decision = await provider.decide(
            request(prior_turns=turns, observations=observations), sink=sink
        )
        observations = (observe(decision.calls[0], result=i),)
    server.script_chat_completion("All shipped.")
    final = await provider.decide(request(prior_turns=turns, observations=observations))
    assert final.output == "All shipped."

    sent = bodies(server)
    for body in sent:
        contents_are_strings(body)
    last = sent[-1]["messages"]
    with_calls = [m for m in last if m["role"] == "assistant" and m.get("tool_calls")]
    assert len(with_calls) >= 2  # the prior turn's trace and the window's decisions
    assert [m["content"] for m in with_calls] == [""] * len(with_calls)
    assert "untrusted summary" in json.dumps(last)
    assert "c_lost" not in json.dumps(sent[0])  # data: no invented call id
    assert "[touba: results of capability calls" in json.dumps(sent[0])


async def test_structured_messages_have_string_contents(server) -> None:
    provider = provider_for(
        server, decision_interface="structured", structured_format="json_object_schema"
    )
    trace = ((TraceCall("t_1", "lookup_order", {"order_id": "Z9"}, "ok", 1),),)
    turns = (Turn("Where is Z9?", ("Lost.",), trace),)
    server.script_chat_completion(
        '{"action": "call", "calls": [{"name": "lookup_order", "arguments": {"order_id": "A1"}}]}'
    )
    first = await provider.decide(request(prior_turns=turns))
    server.script_chat_completion('{"action": "final", "output": "Shipped."}')
    await provider.decide(request(prior_turns=turns, observations=(observe(first.calls[0]),)))
    for body in bodies(server):
        contents_are_strings(body)


# structured ---------------------------------------------------------------------


async def test_structured_round_trip_uses_json_schema_and_data_results(server) -> None:
    provider = provider_for(server, decision_interface="structured", max_output_tokens=200)
    written = (
        '{"action": "call",\n "calls": [{"name": "lookup_order", "arguments": {"order_id": "A1"}}]}'
    )
    server.script_chat_completion(written)
    first = await provider.decide(request())
    (call,) = first.calls
    assert (call.name, dict(call.arguments)) == ("lookup_order", {"order_id": "A1"})
    server.script_chat_completion('{"action": "final", "output": "Shipped."}')
    final = await provider.decide(
        request(observations=(observe(call, result={"state": "shipped"}),))
    )
    assert final.output == "Shipped."

    one, two = bodies(server)
    system = "Help with orders.\n\n" + structured_instructions((LOOKUP, REFUND), None)
    assert one == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Where is order A1?"},
        ],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "touba_decision",
                "schema": structured_schema((LOOKUP, REFUND), None),
            },
        },
        "max_tokens": 200,
    }
    assert "tools" not in two
    assistant, results = two["messages"][2:]
    assert assistant == {"role": "assistant", "content": written, "annotations": []}
    assert results["role"] == "user"
    assert results["content"].startswith("[touba: results of your calls.")
    assert call.call_id in results["content"]


async def test_structured_json_object_mode_and_fenced_answers(server) -> None:
    provider = provider_for(
        server, decision_interface="structured", structured_format="json_object"
    )
    server.script_chat_completion('```json\n{"action": "final", "output": {"eta": 2}}\n```')
    decision = await provider.decide(request())
    assert decision.output == {"eta": 2}
    (body,) = bodies(server)
    assert body["response_format"] == {"type": "json_object"}
    assert "JSON decision" in body["messages"][0]["content"]


async def test_structured_json_object_schema_sends_the_decision_schema(server) -> None:
    """llama-cpp-python's JSON mode: {"type": "json_object", "schema": ...}, held by grammar."""
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}, "required": ["eta"]}
    provider = provider_for(
        server, decision_interface="structured", structured_format="json_object_schema"
    )
    server.script_chat_completion('{"action": "final", "output": {"eta": 2}}')
    decision = await provider.decide(request(output_schema=schema))
    assert decision.output == {"eta": 2}
    (body,) = bodies(server)
    sent = body["response_format"]
    assert sent == {
        "type": "json_object",
        "schema": enforced_structured_schema((LOOKUP, REFUND), schema),
    }
    assert "JSON decision" in body["messages"][0]["content"]
    # A grammar holds the model to exactly one of the two shapes: a call with at least
    # one call, each with its capability's own parameters, or a final with its output.
    call, final = sent["schema"]["anyOf"]
    assert call["required"] == ["action", "calls"]
    assert call["additionalProperties"] is False
    assert call["properties"]["calls"]["minItems"] == 1
    shapes = call["properties"]["calls"]["items"]["anyOf"]
    assert [s["properties"]["name"]["enum"] for s in shapes] == [["lookup_order"], ["refund"]]
    assert [s["properties"]["arguments"] for s in shapes] == [
        dict(LOOKUP.parameters),
        dict(REFUND.parameters),
    ]
    assert final["required"] == ["action", "output"]
    assert final["properties"]["output"] == schema


async def test_structured_prior_turn_traces_are_data(server) -> None:
    provider = provider_for(server, decision_interface="structured")
    trace = ((TraceCall("t_1", "lookup_order", {"order_id": "Z9"}, "ok", 1),),)
    server.script_chat_completion('{"action": "final", "output": "ok"}')
    await provider.decide(request(prior_turns=(Turn("Where is Z9?", ("Lost.",), trace),)))
    messages = bodies(server)[0]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "[touba: tools used in that turn." in messages[1]["content"]
    assert "t_1" not in json.dumps(messages)


# schema violations --------------------------------------------------------------

NATIVE_VIOLATIONS = [
    pytest.param(
        {"role": "assistant", "content": "Your order"}, "length", "truncated_output", id="length"
    ),
    pytest.param({"role": "assistant", "content": ""}, "content_filter", "blocked", id="filter"),
    pytest.param(
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        "stop",
        "refusal",
        id="refusal",
    ),
    pytest.param(
        {
            "role": "assistant",
            "tool_calls": [chat_tool_call("lookup_order", '{"order_id": "SECRET-A1"', id="c1")],
        },
        "tool_calls",
        "invalid_json",
        id="invalid-arguments",
    ),
    pytest.param(
        {"role": "assistant", "tool_calls": [chat_tool_call("lookup_order", "[1]", id="c1")]},
        "tool_calls",
        "bad_call",
        id="arguments-not-object",
    ),
    pytest.param(
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {}}]},
        "tool_calls",
        "bad_call",
        id="no-name",
    ),
    pytest.param(
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "custom", "custom": {"name": "x", "input": ""}}],
        },
        "tool_calls",
        "bad_call",
        id="custom-tool-call",
    ),
    pytest.param(
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "custom", "function": {"name": "x", "arguments": "{}"}}
            ],
        },
        "tool_calls",
        "unexpected_tool_call",
        id="non-function-type",
    ),
    pytest.param({"role": "assistant", "content": "  "}, "stop", "empty_output", id="empty"),
    pytest.param(
        {"role": "assistant", "content": None, "reasoning_content": "SECRET plan"},
        "stop",
        "empty_output",
        id="reasoning-only",
    ),
    pytest.param(
        {"role": "assistant", "tool_calls": [chat_tool_call("delete_all", {}, id="c1")]},
        "tool_calls",
        "unknown_capability",
        id="unknown-capability",
    ),
    pytest.param(
        {"role": "assistant", "tool_calls": [chat_tool_call("lookup_order", {"id": 7}, id="c1")]},
        "tool_calls",
        "arguments_schema_mismatch",
        id="arguments-mismatch",
    ),
    pytest.param(
        {
            "role": "assistant",
            "tool_calls": [
                chat_tool_call("lookup_order", {"order_id": "A"}, id="dup"),
                chat_tool_call("refund", {"order_id": "A"}, id="dup"),
            ],
        },
        "tool_calls",
        "duplicate_call_id",
        id="duplicate-ids",
    ),
]


@pytest.mark.parametrize(("message", "finish", "code"), NATIVE_VIOLATIONS)
async def test_native_schema_violations_store_nothing(server, message, finish, code) -> None:
    store = MemoryHistoryStore()
    provider = provider_for(server, history=HistoryConfig(store=store, namespace="t"))
    server.script_raw(200, completion(message, finish), endpoint="chat_completions")
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request())
    assert caught.value.provider_error_code == code
    assert "SECRET" not in str(caught.value)  # diagnostics never echo model content
    assert await store.list() == []


async def test_invalid_json_arguments_explain_what_to_try(server) -> None:
    provider = provider_for(server)
    call = chat_tool_call("lookup_order", '{"order_id": A1}', id="c1")
    server.script_chat_completion(tool_calls=[call])
    with pytest.raises(AgentDecisionProviderSchemaViolation, match="lookup_order") as caught:
        await provider.decide(request())
    assert "tool call 1 of 1" in str(caught.value)
    assert "decision_interface='structured'" in str(caught.value)


async def test_raw_control_characters_in_json_strings_are_accepted_and_stored_escaped(
    server,
) -> None:
    """llama-cpp-python's JSON grammar lets a model write a raw newline or tab inside a
    string; a strict parse refused the decision and ended the tool loop."""
    store = MemoryHistoryStore()
    provider = provider_for(server, history=HistoryConfig(store=store, namespace="t"))
    raw_arguments = '{"order_id": "A1\n\tline two"}'  # a real newline and tab, unescaped
    assert "\n" in raw_arguments
    assert "\\n" not in raw_arguments
    server.script_chat_completion(
        tool_calls=[chat_tool_call("lookup_order", raw_arguments, id="c1")]
    )
    first = await provider.decide(request())
    assert dict(first.calls[0].arguments) == {"order_id": "A1\n\tline two"}
    server.script_chat_completion('{"eta":\n"two\ndays"}')
    final = await provider.decide(
        request(
            observations=(observe(first.calls[0], result="ok"),),
            output_schema={"type": "object"},
        )
    )
    assert final.output == {"eta": "two\ndays"}
    (row,) = await store.list()
    record = await store.read(row.key)
    assert record is not None
    # the decision is kept with the string as parsed, which a store writes escaped
    assert '"A1\\n\\tline two"' in json.dumps(record)

    structured = provider_for(server, decision_interface="structured")
    server.script_chat_completion('{"action": "final", "output": "a\tb"}')
    decision = await structured.decide(request(invocation_id="inv-structured"))
    assert decision.output == "a\tb"

    # an unterminated string is still refused, control characters or not
    server.script_chat_completion(
        tool_calls=[chat_tool_call("lookup_order", '{"order_id": "A1\n', id="c2")]
    )
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request(invocation_id="inv-broken"))
    assert caught.value.provider_error_code == "invalid_json"


async def test_a_number_beyond_a_doubles_range_is_refused_saying_so(server) -> None:
    """A server's JSON grammar bounds shapes, not magnitudes: a model may write 1e999."""
    store = MemoryHistoryStore()
    provider = provider_for(
        server,
        decision_interface="structured",
        history=HistoryConfig(store=store, namespace="t"),
    )
    server.script_chat_completion('{"action": "final", "output": {"n": [1, 1e999]}}')
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request())
    assert "a number beyond a 64-bit float's range" in str(caught.value)
    assert await store.list() == []


@pytest.mark.parametrize(
    ("text", "schema", "code"),
    [
        pytest.param("The ETA is 3 days.", {"type": "object"}, "invalid_json", id="prose"),
        pytest.param('{"eta": "soon"}', None, "output_schema_mismatch", id="mismatch"),
    ],
)
async def test_native_final_output_violations(server, text, schema, code) -> None:
    output_schema = schema or {
        "type": "object",
        "properties": {"eta": {"type": "integer"}},
        "required": ["eta"],
    }
    provider = provider_for(server)
    server.script_chat_completion(text)
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request(output_schema=output_schema))
    assert caught.value.provider_error_code == code
    assert "soon" not in str(caught.value)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        pytest.param({"role": "assistant", "content": "{not json"}, "invalid_json", id="json"),
        pytest.param(
            {"role": "assistant", "content": '{"action": "x"}'}, "bad_action", id="action"
        ),
        pytest.param(
            {"role": "assistant", "content": '{"action": "call", "calls": []}'},
            "missing_calls",
            id="no-calls",
        ),
        pytest.param({"role": "assistant", "content": None}, "empty_output", id="empty"),
        pytest.param(
            {"role": "assistant", "tool_calls": [chat_tool_call("lookup_order", {}, id="c1")]},
            "unexpected_tool_call",
            id="tool-call",
        ),
        pytest.param(
            {
                "role": "assistant",
                "content": '{"action": "call", "calls": [{"name": "wipe", "arguments": {}}]}',
            },
            "unknown_capability",
            id="unknown",
        ),
    ],
)
async def test_structured_schema_violations(server, message, code) -> None:
    provider = provider_for(server, decision_interface="structured")
    server.script_raw(200, completion(message), endpoint="chat_completions")
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request())
    assert caught.value.provider_error_code == code


# transport failures -------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "hint", "retryable"),
    [
        (500, "retry later", True),
        (503, "retry later", True),
        (429, "retry later", True),
        (401, "api_key", False),
        (404, "base_url", False),
        (400, "structured_format='json_object_schema'", False),
        (422, "tool calling", False),
        (413, "a retry will not help", False),
    ],
)
async def test_http_errors_say_what_the_server_said_and_store_nothing(
    server, status, hint, retryable
) -> None:
    store = MemoryHistoryStore()
    provider = provider_for(server, history=HistoryConfig(store=store, namespace="t"))
    said = "echo of the prompt: SECRET"
    server.script_error(status, said, endpoint="chat_completions")
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    error = caught.value
    assert error.status_code == status
    assert error.server_message == said
    assert hint in str(error)
    assert str(error).endswith(f'(the server said: "{said}")')
    assert "SECRET" not in error.message  # touba's own words, for traces and records
    assert error.retryable is retryable
    if not retryable:
        assert "retry later" not in str(error)
    assert isinstance(error.__cause__, Exception)
    assert len(server.requests_to("chat_completions")) == 1  # no SDK retry
    assert await store.list() == []


# What llama-cpp-python's server answers (its RouteErrorHandler wraps every failure of the
# route, request validation included, as HTTP 500 {"error": {"message": str(exc),
# "type": "internal_server_error", "param": null, "code": null}}), and what others do.
LLAMA_CPP_VALIDATION = (
    "[{'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), 'msg': "
    "\"Input should be 'text' or 'json_object'\", 'input': 'json_schema', 'ctx': "
    "{'expected': \"'text' or 'json_object'\"}}]"
)


def llama_cpp_error(message: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "internal_server_error", "param": None, "code": None}
    }


@pytest.mark.parametrize(
    ("status", "body", "said", "retryable"),
    [
        pytest.param(
            500,
            llama_cpp_error(LLAMA_CPP_VALIDATION),
            LLAMA_CPP_VALIDATION,
            False,
            id="llama-cpp-python-validation",
        ),
        pytest.param(
            500,
            llama_cpp_error("'dict object' has no attribute 'content'"),
            "'dict object' has no attribute 'content'",
            False,
            id="jinja-undefined",
        ),
        pytest.param(
            500, llama_cpp_error("'content'"), "'content'", False, id="missing-key-in-template"
        ),
        pytest.param(
            500,
            {
                "error": {
                    "code": 500,
                    "message": "Conversation roles must alternate "
                    "user/assistant/user/assistant/...",
                    "type": "server_error",
                }
            },
            "Conversation roles must alternate user/assistant/user/assistant/...",
            False,
            id="llama-server-template-exception",
        ),
        pytest.param(
            500,
            llama_cpp_error("llama_decode returned -3"),
            "llama_decode returned -3",
            True,
            id="a-server-failure",
        ),
        pytest.param(
            422,
            {
                "detail": [
                    {
                        "type": "missing",
                        "loc": ["body", "messages", 1, "content"],
                        "msg": "Field required",
                        "input": {"role": "SECRET"},
                    }
                ]
            },
            "body.messages.1.content: Field required",
            False,
            id="fastapi-detail-without-the-input",
        ),
        pytest.param(
            404,
            {"error": "model 'qwen3:8b' not found"},
            "model 'qwen3:8b' not found",
            False,
            id="ollama-string-error",
        ),
        pytest.param(502, "Bad Gateway", "Bad Gateway", True, id="plain-text"),
        pytest.param(503, None, None, True, id="no-body"),
    ],
)
async def test_local_server_refusals_are_explained_and_not_retryable(
    server, status, body, said, retryable
) -> None:
    provider = provider_for(server)
    server.script_raw(status, body, endpoint="chat_completions")
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    error = caught.value
    assert (error.status_code, error.server_message, error.retryable) == (status, said, retryable)
    if said is not None:
        assert said in str(error)
        assert said not in error.message
    assert "SECRET" not in str(error)
    if not retryable:
        assert "retry later" not in str(error)
        assert "overloaded" not in str(error)
    if not retryable and status == 500:  # what to change instead
        assert "a retry will not help" in error.message
        assert "structured_format" in error.message


async def test_the_server_message_is_bounded_and_without_control_characters(server) -> None:
    provider = provider_for(server)
    noisy = "line one\nline two\x1b[31m red\x00" + "x" * 2000
    server.script_raw(500, llama_cpp_error(noisy), endpoint="chat_completions")
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    said = caught.value.server_message
    assert said is not None
    assert len(said) <= 500
    assert said.startswith("line one line two[31m red")
    assert all(c.isprintable() for c in said)
    assert said in str(caught.value)


async def test_a_rejected_request_is_unavailable_with_its_status(server) -> None:
    provider = provider_for(server)
    server.script_error(400, endpoint="chat_completions")
    with pytest.raises(AgentDecisionProviderUnavailable, match="structured_format") as caught:
        await provider.decide(request())
    assert caught.value.status_code == 400


async def test_unreachable_server_is_unavailable() -> None:
    with FakeOpenAIServer() as srv:
        base_url = srv.base_url + "/v1"
    provider = create_openai_compatible_decision_provider(
        model=MODEL, base_url=base_url, history=False
    )
    with pytest.raises(AgentDecisionProviderUnavailable, match="could not reach") as caught:
        await provider.decide(DecisionRequest(input="hi"))
    assert caught.value.status_code is None


async def test_an_answer_that_is_not_a_completion_is_unavailable(server) -> None:
    provider = provider_for(server, history=False)
    server.script_raw(
        200, {"object": "chat.completion", "choices": []}, endpoint="chat_completions"
    )
    with pytest.raises(AgentDecisionProviderUnavailable, match="not a chat completion"):
        await provider.decide(DecisionRequest(input="hi"))


# keys and configuration ---------------------------------------------------------


async def test_openai_environment_is_never_sent_to_another_server(monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-platform-key")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-1")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-1")
    monkeypatch.setenv("OPENAI_CUSTOM_HEADERS", "Authorization: Bearer ambient\nX-Team: a")
    with KeyRecordingServer() as srv:
        for api_key in (None, "local-key"):
            provider = create_openai_compatible_decision_provider(
                model=MODEL, base_url=srv.base_url + "/v1", api_key=api_key, history=False
            )
            srv.script_chat_completion("ok")
            await provider.decide(DecisionRequest(input="hi"))
        assert srv.authorization == [None, "Bearer local-key"]
        for recorded in srv.requests:
            assert "openai-organization" not in recorded.headers
            assert "openai-project" not in recorded.headers
        assert "local-key" not in repr(provider._wire)


async def test_client_options_and_server_specific_fields(server) -> None:
    with KeyRecordingServer() as srv:
        provider = create_openai_compatible_decision_provider(
            model=MODEL,
            base_url=srv.base_url + "/v1",
            history=False,
            timeout=5,
            default_headers={"Authorization": "Bearer from-headers", "X-Route": "gpu"},
            max_completion_tokens=64,
            top_k=20,
            chat_template_kwargs={"enable_thinking": False},
            tool_choice="auto",
        )
        srv.script_chat_completion("ok")
        await provider.decide(DecisionRequest(input="hi"))
        (recorded,) = srv.requests
        assert srv.authorization == ["Bearer from-headers"]
        assert recorded.headers["x-route"] == "gpu"
        assert recorded.body == {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 64,
            "top_k": 20,
            "chat_template_kwargs": {"enable_thinking": False},
        }  # tool_choice only goes with tools


async def test_context_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match="no standard token count endpoint"):
        create_openai_compatible_decision_provider(
            model=MODEL,
            base_url="http://localhost:11434/v1",
            max_output_tokens=100,
            context=ContextConfig(context_window_tokens=8192),
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"client": object()}, "builds its own client"),
        ({"messages": []}, "builds the messages"),
        ({"stream": True}, "streams when decide.. is given a sink"),
        ({"n": 2}, "single choice"),
        ({"response_format": {"type": "text"}}, "structured_format"),
        ({"max_tokens": 10}, "max_output_tokens"),
        ({"max_output_tokens": 10, "max_completion_tokens": 10}, "either"),
        ({"functions": []}, "legacy"),
        ({"extra_body": {"top_k": 1}}, "top_k=20"),
        (
            {"structured_format": "yaml", "decision_interface": "structured"},
            "'json_schema', 'json_object' or 'json_object_schema', got 'yaml'",
        ),
        ({"structured_format": "json_object"}, "applies to"),
        ({"structured_format": "json_object_schema"}, "applies to"),
        ({"decision_interface": "structured", "tool_choice": "auto"}, "needs tools"),
        ({"decision_interface": "chatty"}, "decision_interface"),
        ({"timeout": 0}, "timeout"),
        ({"default_headers": {"X": 1}}, "default_headers"),
        ({"api_key": "k", "default_headers": {"authorization": "Bearer k"}}, "not both"),
        ({"api_key": ""}, "api_key"),
        ({"base_url": "localhost:11434"}, "base_url"),
        ({"model": ""}, "model"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"history": "yes"}, "history"),
    ],
)
def test_misconfiguration_is_refused_at_construction(kwargs, match) -> None:
    arguments: dict[str, Any] = {"model": MODEL, "base_url": "http://localhost:11434/v1"}
    arguments.update(kwargs)
    with pytest.raises(ConfigurationError, match=match):
        create_openai_compatible_decision_provider(**arguments)


def test_importing_the_module_does_not_import_the_sdk() -> None:
    code = "import sys, touba.providers.compatible; assert 'openai' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_sdk_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ImportError, match=r'pip install "touba\[openai\]"'):
        create_openai_compatible_decision_provider(model=MODEL, base_url="http://localhost/v1")


async def test_the_wire_refuses_to_count() -> None:
    from touba.errors import ProviderContextGuardUnsupported

    provider = create_openai_compatible_decision_provider(
        model=MODEL, base_url="http://localhost:8000/v1"
    )
    with pytest.raises(ProviderContextGuardUnsupported):
        await provider._wire.count({})
