"""The Gemini provider, driven through google-genai against FakeGeminiServer.

Every request goes through the fake's validator (function call/response
pairing, thought signatures verified against what the fake issued); the
``server`` fixture fails a test whose requests drew a 400.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from google import genai
from google.genai import types

from tests._providers import close_gemini, gemini_sdk
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
from touba.history import (
    DecisionMessage,
    HistoryConfig,
    HistoryEvent,
    HistoryWindow,
    MemoryHistoryStore,
    ResultMessage,
)
from touba.history._window import ExchangeSize
from touba.providers import (
    CapabilitySpec,
    ContextConfig,
    DecisionRequest,
    Observation,
    TraceCall,
    Turn,
)
from touba.providers._base import Plan
from touba.providers._framing import results_text, structured_schema
from touba.providers._gemini_wire import NO_INPUT, SKIP_SIGNATURE, render_body
from touba.providers.gemini import create_gemini_decision_provider
from touba.testing.fakes import (
    FakeGeminiServer,
    estimate_tokens,
    gemini_function_call,
    gemini_text,
    gemini_thought,
)
from touba.testing.fakes._gemini_rules import PART_KIND, decode_signature, part_fingerprint

MODEL = "gemini-test"


def _path(path: str) -> str:
    """``path`` without its API version, which is the SDK's own choice.

    google-genai 3 sends ``/v1/...`` by default and 2.x (the releases ADK pins) ``/v1beta/...``;
    touba sets neither, so the tests accept the version the installed SDK picked.
    """
    version, _, rest = path.removeprefix("/").partition("/")
    assert version in {"v1", "v1beta"}, path
    return rest


REFUND = CapabilitySpec(
    "refund", "Refund an order", {"type": "object", "properties": {"order_id": {"type": "string"}}}
)
DECLARATIONS = [
    {
        "functionDeclarations": [
            {
                "name": "lookup_order",
                "description": "Find an order",
                "parametersJsonSchema": dict(LOOKUP.parameters),
            }
        ]
    }
]
USER = {"role": "user", "parts": [{"text": "Where is order A1?"}]}
SYSTEM = {"parts": [{"text": "Help with orders."}]}


def _no_rejection(srv: FakeGeminiServer) -> None:
    rejected = [(r.endpoint, r.status) for r in srv.requests if r.status == 400]
    assert rejected == [], "the fake's validator rejected a request"


@pytest.fixture
def server() -> Iterator[FakeGeminiServer]:
    with FakeGeminiServer() as srv:
        yield srv
        _no_rejection(srv)


@pytest.fixture
def documented() -> Iterator[FakeGeminiServer]:
    with FakeGeminiServer() as srv:
        yield srv
        _no_rejection(srv)


@pytest.fixture
async def client(server: FakeGeminiServer) -> AsyncIterator[genai.Client]:
    sdk = gemini_sdk(server.base_url)
    yield sdk
    await close_gemini(sdk)


@pytest.fixture
async def documented_client(documented: FakeGeminiServer) -> AsyncIterator[genai.Client]:
    sdk = gemini_sdk(documented.base_url)
    yield sdk
    await close_gemini(sdk)


def observe(call, result: Any = None, *, status: Any = "ok", error: str | None = None, **args):
    return Observation(call.call_id, call.name, args or dict(call.arguments), status, result, error)


def bodies(srv: FakeGeminiServer, endpoint: str = "generate_content") -> list[dict[str, Any]]:
    return [r.body for r in srv.requests_to(endpoint)]


def gemini(client: genai.Client, **kwargs: Any):
    return create_gemini_decision_provider(model=MODEL, client=client, **kwargs)


# native round trips ----------------------------------------------------------------


async def test_call_observation_final_round_trip_sends_exact_bodies(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    store = MemoryHistoryStore()
    provider = gemini(
        client, history=HistoryConfig(store=store, namespace="t"), max_output_tokens=256
    )
    assert (provider.provider, provider.model, provider.decision_interface) == (
        "gemini",
        MODEL,
        "native",
    )
    server.script_response(gemini_function_call("lookup_order", {"order_id": "A1"}))
    first = await provider.decide(request())
    (call,) = first.calls
    assert (call.name, call.arguments, first.output) == ("lookup_order", {"order_id": "A1"}, None)
    assert first.usage.input_tokens is not None

    server.script_response(gemini_text("Shipped yesterday."))
    final = await provider.decide(request(observations=(observe(call, {"status": "shipped"}),)))
    assert (final.output, final.text, final.calls) == (
        "Shipped yesterday.",
        "Shipped yesterday.",
        (),
    )

    sent_first, sent_second = bodies(server)
    config = {"maxOutputTokens": 256}
    assert sent_first == {
        "contents": [USER],
        "systemInstruction": SYSTEM,
        "tools": DECLARATIONS,
        "generationConfig": config,
    }
    model_turn = sent_second["contents"][1]
    assert model_turn["role"] == "model"
    (part,) = model_turn["parts"]
    assert part["functionCall"] == {"name": "lookup_order", "args": {"order_id": "A1"}}
    assert isinstance(part["thoughtSignature"], str)  # as the fake issued it
    assert sent_second == {
        "contents": [
            USER,
            model_turn,
            {
                "role": "user",
                "parts": [
                    {
                        "functionResponse": {
                            "name": "lookup_order",
                            "response": {"status": "ok", "result": {"status": "shipped"}},
                        }
                    }
                ],
            },
        ],
        "systemInstruction": SYSTEM,
        "tools": DECLARATIONS,
        "generationConfig": config,
    }
    (row,) = await store.list()
    assert row.messages == 3
    assert all(_path(r.path) == f"models/{MODEL}:generateContent" for r in server.requests)


async def test_thought_signatures_round_trip_across_three_decisions(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(client)
    server.script_response(
        gemini_thought("look the order up"),
        gemini_function_call("lookup_order", {"order_id": "A1"}),
    )
    one = await provider.decide(request())
    server.script_response(
        gemini_thought("now the second order"),
        gemini_function_call("lookup_order", {"order_id": "B2"}),
    )
    two = await provider.decide(request(observations=(observe(one.calls[0], "in transit"),)))
    server.script_response(gemini_thought("both known"), gemini_text("Both ship.", signed=True))
    three = await provider.decide(request(observations=(observe(two.calls[0], "delivered"),)))
    assert three.output == "Both ship."
    assert three.text == "Both ship."  # thought text never leaks into the decision

    second, third = bodies(server)[1:]
    # The first model turn is replayed byte for byte in both later requests.
    assert third["contents"][1] == second["contents"][1]
    model_turns = [c for c in third["contents"] if c["role"] == "model"]
    assert len(model_turns) == 2
    for turn in model_turns:
        thought, call = turn["parts"]
        assert thought["thought"] is True
        for part in (thought, call):  # each signature still covers its own part
            token = decode_signature(part["thoughtSignature"])
            assert token is not None
            assert server.ledger.verify(PART_KIND, token, part_fingerprint(part))
    assert [c["role"] for c in third["contents"]] == ["user", "model", "user", "model", "user"]


async def test_parallel_calls_get_one_response_turn_in_call_order(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(client, decision_interface="native")
    server.script_response(
        gemini_function_call("lookup_order", {"order_id": "A1"}),
        gemini_function_call("refund", {"order_id": "B2"}, signed=False),
    )
    decision = await provider.decide(request(capabilities=(LOOKUP, REFUND)))
    lookup, refund = decision.calls
    assert lookup.call_id != refund.call_id
    server.script_response(gemini_text("Done."))
    observations = (
        observe(refund, status="denied", error="refunds need approval"),
        observe(lookup, "shipped"),
    )
    await provider.decide(request(capabilities=(LOOKUP, REFUND), observations=observations))
    contents = bodies(server)[1]["contents"]
    assert [p["functionCall"]["name"] for p in contents[1]["parts"]] == ["lookup_order", "refund"]
    assert contents[2] == {
        "role": "user",
        "parts": [
            {
                "functionResponse": {
                    "name": "lookup_order",
                    "response": {"status": "ok", "result": "shipped"},
                }
            },
            {
                "functionResponse": {
                    "name": "refund",
                    "response": {"status": "denied", "error": "refunds need approval"},
                }
            },
        ],
    }


async def test_calls_without_ids_get_stable_local_ids_never_sent(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(client)
    server.script_response(
        gemini_function_call("lookup_order", {"order_id": "A1"}),
        gemini_function_call("lookup_order", {"order_id": "B2"}, signed=False),
    )
    decision = await provider.decide(request())
    ids = [c.call_id for c in decision.calls]
    assert len(set(ids)) == 2
    assert all(i.startswith("touba_gc_") for i in ids)
    server.script_response(gemini_text("ok"))
    await provider.decide(request(observations=tuple(observe(c, 1) for c in decision.calls)))
    sent = json.dumps(bodies(server)[1])
    assert '"id"' not in sent
    assert not any(i in sent for i in ids)


async def test_model_call_ids_are_kept_and_echoed(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(client)
    server.script_response(gemini_function_call("lookup_order", {"order_id": "A1"}, id="fc_7"))
    decision = await provider.decide(request())
    assert decision.calls[0].call_id == "fc_7"
    server.script_response(gemini_text("ok"))
    await provider.decide(request(observations=(observe(decision.calls[0], "x"),)))
    contents = bodies(server)[1]["contents"]
    assert contents[1]["parts"][0]["functionCall"]["id"] == "fc_7"
    assert contents[2]["parts"][0]["functionResponse"]["id"] == "fc_7"


async def test_error_observation_is_sent_as_the_function_response(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(client)
    server.script_response(gemini_function_call("lookup_order", {"order_id": "A1"}))
    decision = await provider.decide(request())
    server.script_response(gemini_text("Sorry."))
    failed = observe(decision.calls[0], status="error", error="timeout")
    await provider.decide(request(observations=(failed,)))
    response = bodies(server)[1]["contents"][2]["parts"][0]["functionResponse"]
    assert response["response"] == {"status": "error", "error": "timeout"}


async def test_native_output_schema_reads_the_final_text_as_json(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}, "required": ["eta"]}
    provider = gemini(client)
    server.script_response(gemini_text('```json\n{"eta": 2}\n```'))
    decision = await provider.decide(request(output_schema=schema))
    assert decision.output == {"eta": 2}
    system = bodies(server)[0]["systemInstruction"]["parts"][0]["text"]
    assert system.startswith("Help with orders.\n\n")
    assert json.dumps(schema, separators=(",", ":")) in system


# prior turns, opaque_refs, history=False ----------------------------------------------


async def test_prior_turns_with_trace_become_call_response_pairs(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    trace = (
        (
            TraceCall("call_abc", "lookup_order", {"order_id": "Z9"}, "ok", {"state": "lost"}),
            TraceCall("touba_gc_0123456789abcdef_1", "refund", {"order_id": "Z9"}, "denied"),
        ),
    )
    turns = (Turn("hello", ("Hi! How can I help?",)), Turn("where is Z9?", ("It is lost.",), trace))
    provider = gemini(client)
    server.script_response(gemini_text("A1 ships today."))
    await provider.decide(request(capabilities=(LOOKUP, REFUND), prior_turns=turns))
    contents = bodies(server)[0]["contents"]
    assert contents == [
        {"role": "user", "parts": [{"text": "hello"}]},
        {"role": "model", "parts": [{"text": "Hi! How can I help?"}]},
        {"role": "user", "parts": [{"text": "where is Z9?"}]},
        {
            "role": "model",
            "parts": [
                {
                    "functionCall": {
                        "name": "lookup_order",
                        "args": {"order_id": "Z9"},
                        "id": "call_abc",
                    }
                },
                {"functionCall": {"name": "refund", "args": {"order_id": "Z9"}}},
            ],
        },
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "name": "lookup_order",
                        "response": {"status": "ok", "result": {"state": "lost"}},
                        "id": "call_abc",
                    }
                },
                {
                    "functionResponse": {
                        "name": "refund",
                        "response": {"status": "denied", "error": "denied"},
                    }
                },
            ],
        },
        {"role": "model", "parts": [{"text": "It is lost."}]},
        USER,
    ]


async def test_structured_prior_trace_is_data(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    trace = ((TraceCall("c1", "lookup_order", {"order_id": "Z9"}, "ok", "lost"),),)
    provider = gemini(client, decision_interface="structured")
    server.script_response(gemini_text('{"action":"final","output":"ok"}'))
    await provider.decide(request(prior_turns=(Turn("where is Z9?", ("lost",), trace),)))
    contents = bodies(server)[0]["contents"]
    assert "functionCall" not in json.dumps(contents)
    assert [c["role"] for c in contents] == ["user", "model", "user"]
    assert contents[0]["parts"][1]["text"].startswith("[touba: tools used in that turn.")


async def test_opaque_refs_sends_projected_arguments_with_the_documented_marker(
    documented: FakeGeminiServer, documented_client: genai.Client
) -> None:
    provider = gemini(documented_client, history=HistoryConfig(continuity="opaque_refs"))
    documented.script_response(
        gemini_thought("search"), gemini_function_call("lookup_order", {"order_id": "A1-SECRET"})
    )
    decision = await provider.decide(request())
    documented.script_response(gemini_text("Found."))
    projected = observe(decision.calls[0], "found", order_id="A1")
    await provider.decide(request(observations=(projected,)))
    model_turn = bodies(documented)[1]["contents"][1]
    assert model_turn == {
        "role": "model",
        "parts": [
            {
                "functionCall": {"name": "lookup_order", "args": {"order_id": "A1"}},
                "thoughtSignature": SKIP_SIGNATURE,
            }
        ],
    }
    assert "SECRET" not in json.dumps(bodies(documented)[1])


async def test_history_false_sends_observations_as_data_without_ids(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(client, history=False)
    server.script_response(gemini_text("ok"))
    stray = Observation("call_xyz", "lookup_order", {"order_id": "A1"}, "ok", {"s": 1})
    await provider.decide(DecisionRequest(input="hi", observations=(stray,)))
    (body,) = bodies(server)
    sent = json.dumps(body)
    assert "call_xyz" not in sent
    assert "functionCall" not in sent
    assert "thoughtSignature" not in sent
    (content,) = body["contents"]
    assert content["parts"][0] == {"text": "hi"}
    assert content["parts"][1]["text"].startswith("[touba: results of capability calls")


async def test_missing_input_starts_with_a_user_turn(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(client, history=False)
    server.script_response(gemini_text("ok"))
    await provider.decide(DecisionRequest(instructions="Say ok."))
    assert bodies(server)[0]["contents"] == [{"role": "user", "parts": [{"text": NO_INPUT}]}]


def test_another_providers_decision_is_rendered_from_neutral_fields() -> None:
    foreign = DecisionMessage(
        calls=(_call("call_o1", {"order_id": "A1"}),),
        provider="openai",
        opaque={"items": [{"type": "reasoning", "encrypted_content": "gAAAA"}]},
    )
    result = ResultMessage("call_o1", "lookup_order", {"order_id": "A1"}, "ok", "shipped")
    window = HistoryWindow("k", None, ((foreign, result),), (ExchangeSize(2, 10),))
    plan = Plan(request(), "native", (), window)
    body = render_body(plan, max_output_tokens=None, generation={}, fields={})
    assert "gAAAA" not in json.dumps(body)
    assert body["contents"][1]["parts"] == [
        {
            "functionCall": {"name": "lookup_order", "args": {"order_id": "A1"}, "id": "call_o1"},
            "thoughtSignature": SKIP_SIGNATURE,  # current turn: Gemini 3 requires one
        }
    ]
    assert body["contents"][2]["parts"][0]["functionResponse"]["id"] == "call_o1"


def _call(call_id: str, args: dict[str, Any]):
    from touba.history import CapabilityCall

    return CapabilityCall(call_id, "lookup_order", args)


# structured interface ----------------------------------------------------------------


async def test_structured_round_trip(server: FakeGeminiServer, client: genai.Client) -> None:
    provider = gemini(client, decision_interface="structured", max_output_tokens=512)
    call_json = '{"action":"call","calls":[{"name":"lookup_order","arguments":{"order_id":"A1"}}]}'
    server.script_response(gemini_thought("plan"), gemini_text(call_json))
    decision = await provider.decide(request())
    (call,) = decision.calls
    server.script_response(gemini_text('{"action":"final","output":"Shipped."}'))
    final = await provider.decide(request(observations=(observe(call, "shipped"),)))
    assert final.output == "Shipped."

    first, second = bodies(server)
    assert "tools" not in first
    assert first["generationConfig"] == {
        "maxOutputTokens": 512,
        "responseMimeType": "application/json",
        "responseJsonSchema": structured_schema((LOOKUP,), None),
    }
    assert "Answer only with a JSON decision" in first["systemInstruction"]["parts"][0]["text"]
    assert second["contents"][1]["parts"][1] == {"text": call_json}  # replayed as written
    assert second["contents"][1]["parts"][0]["thought"] is True
    result = ResultMessage(call.call_id, "lookup_order", {"order_id": "A1"}, "ok", "shipped")
    assert second["contents"][2] == {"role": "user", "parts": [{"text": results_text([result])}]}


# schema violations and HTTP failures --------------------------------------------------


@pytest.mark.parametrize(
    ("interface", "script", "code"),
    [
        (
            "native",
            {"parts": [gemini_text("Shi")], "finish_reason": "MAX_TOKENS"},
            "truncated_output",
        ),
        ("native", {"parts": [], "finish_reason": "SAFETY"}, "blocked"),
        ("native", {"parts": [], "block_reason": "SAFETY"}, "blocked"),
        ("native", {"parts": [gemini_text("x")], "finish_reason": "RECITATION"}, "recitation"),
        (
            "native",
            {"parts": [], "finish_reason": "MALFORMED_FUNCTION_CALL"},
            "malformed_function_call",
        ),
        ("native", {"parts": []}, "empty_output"),
        ("native", {"parts": [gemini_thought("hmm")]}, "empty_output"),
        ("native", {"parts": [gemini_function_call("refund", {})]}, "unknown_capability"),
        (
            "native",
            {"parts": [gemini_function_call("lookup_order", {"order_id": 5})]},
            "arguments_schema_mismatch",
        ),
        ("structured", {"parts": [gemini_text("not json")]}, "invalid_json"),
        ("structured", {"parts": [gemini_text('{"action":"maybe"}')]}, "bad_action"),
        (
            "structured",
            {"parts": [gemini_function_call("lookup_order", {"order_id": "A1"})]},
            "unexpected_function_call",
        ),
    ],
)
async def test_schema_violations_store_nothing(
    server: FakeGeminiServer, client: genai.Client, interface, script, code
) -> None:
    store = MemoryHistoryStore()
    provider = gemini(
        client, decision_interface=interface, history=HistoryConfig(store=store, namespace="t")
    )
    script = dict(script)
    server.script_response(*script.pop("parts"), **script)
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await provider.decide(request())
    assert caught.value.provider_error_code == code
    assert "A1" not in str(caught.value)
    assert await store.list() == []


@pytest.mark.parametrize(
    ("text", "code"), [("Shipped", "invalid_json"), ('{"eta": "soon"}', "output_schema_mismatch")]
)
async def test_native_output_violations(
    server: FakeGeminiServer, client: genai.Client, text: str, code: str
) -> None:
    schema = {"type": "object", "properties": {"eta": {"type": "integer"}}, "required": ["eta"]}
    server.script_response(gemini_text(text))
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await gemini(client).decide(request(output_schema=schema))
    assert caught.value.provider_error_code == code
    assert "soon" not in str(caught.value)


async def test_no_candidates_is_empty_output(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    server.script_raw(200, {"candidates": [], "usageMetadata": {"promptTokenCount": 3}})
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await gemini(client).decide(request())
    assert caught.value.provider_error_code == "empty_output"


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_http_errors_are_unavailable(
    server: FakeGeminiServer, client: genai.Client, status: int
) -> None:
    store = MemoryHistoryStore()
    server.script_error(status)
    provider = gemini(client, history=HistoryConfig(store=store, namespace="t"))
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    assert caught.value.status_code == status
    assert isinstance(caught.value.__cause__, genai.errors.APIError)
    assert len(server.requests) == 1  # no SDK retry
    assert await store.list() == []


async def test_connection_failure_is_unavailable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sdk = gemini_sdk(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(AgentDecisionProviderUnavailable) as caught:
            await gemini(sdk).decide(request())
        assert caught.value.status_code is None
        assert caught.value.__cause__ is not None
    finally:
        await sdk.aio.aclose()
        sdk.close()


# context guard -----------------------------------------------------------------------


def tokens_per_content(per: int = 100):
    def count(body: dict[str, Any]) -> int:
        return per * len(body["generateContentRequest"]["contents"])

    return count


def tight(window: int) -> ContextConfig:
    return ContextConfig(window, input_token_multiplier=1, safety_margin_tokens=0)


async def test_guard_counts_the_full_generation_body(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    events: list[HistoryEvent] = []
    provider = gemini(
        client,
        history=HistoryConfig(on_event=events.append),
        context=ContextConfig(100_000),
        max_output_tokens=300,
        temperature=0.2,
        thinking_config={"include_thoughts": True, "thinking_budget": 256},
        safety_settings=[{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        labels={"team_name": "support"},
    )
    server.script_response(gemini_function_call("lookup_order", {"order_id": "A1"}))
    decision = await provider.decide(request())
    server.script_response(gemini_text("ok"))
    await provider.decide(request(observations=(observe(decision.calls[0], "x"),)))

    counts = server.requests_to("count_tokens")
    generations = bodies(server)
    assert len(counts) == 2
    for counted, sent in zip(counts, generations, strict=True):
        assert _path(counted.path) == f"models/{MODEL}:countTokens"
        expected = {k: v for k, v in sent.items() if k != "labels"}  # no prompt tokens
        assert counted.body == {"generateContentRequest": {"model": f"models/{MODEL}", **expected}}
    request_sent = generations[0]
    assert request_sent["systemInstruction"] == SYSTEM
    assert request_sent["tools"] == DECLARATIONS
    assert request_sent["generationConfig"] == {
        "temperature": 0.2,
        "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 256},
        "maxOutputTokens": 300,
    }
    assert request_sent["labels"] == {"team_name": "support"}

    counted_events = [e for e in events if e.kind == "provider_context_count"]
    assert len(counted_events) == 2
    first = counted_events[0]
    count = estimate_tokens(counts[0].body)
    assert (first.provider, first.count, first.window, first.fits) == (
        "gemini",
        count,
        100_000,
        True,
    )
    assert first.reserve == math.ceil(count * 1.2) + 512 + 300
    assert set(first.to_dict()) == {
        "kind",
        "session_key",
        "message_count",
        "bytes",
        "provider",
        "count",
        "reserve",
        "window",
        "fits",
        "prior_turns",
    }
    assert first.prior_turns == 0  # no chat turn before this invocation


async def test_guard_counts_structured_schema_too(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(
        client,
        decision_interface="structured",
        context=ContextConfig(100_000),
        max_output_tokens=64,
    )
    server.script_response(gemini_text('{"action":"final","output":"ok"}'))
    await provider.decide(request())
    (counted,) = server.requests_to("count_tokens")
    config = counted.body["generateContentRequest"]["generationConfig"]
    assert config["responseJsonSchema"] == structured_schema((LOOKUP,), None)


async def _three_exchanges(server: FakeGeminiServer, provider, **kwargs: Any):
    observations: tuple[Observation, ...] = ()
    for order in ("A1", "B2", "C3"):
        server.script_response(gemini_function_call("lookup_order", {"order_id": order}))
        decision = await provider.decide(request(observations=observations, **kwargs))
        observations = (observe(decision.calls[0], order.lower()),)
    return observations


async def test_guard_drops_prior_turns_then_oldest_exchange_before_generating(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    events: list[HistoryEvent] = []
    prior = (Turn("hello", ("hi",)),)
    provider = gemini(
        client,
        history=HistoryConfig(on_event=events.append),
        context=tight(600),  # 5 contents at most fit, once they cost 100 each (500 + 100)
        max_output_tokens=100,
    )
    server.count_tokens = lambda body: 1
    observations = await _three_exchanges(server, provider, prior_turns=prior)
    server.count_tokens = tokens_per_content()
    events.clear()
    server.script_response(gemini_text("All known."))
    before = len(server.requests_to("count_tokens"))
    await provider.decide(request(observations=observations, prior_turns=prior))

    contents = bodies(server)[-1]["contents"]
    assert len(contents) == 5
    assert contents[0] == USER  # prior turn and first exchange gone, input kept
    assert contents[1]["parts"][0]["functionCall"]["args"] == {"order_id": "B2"}
    asked = len(server.requests_to("count_tokens")) - before
    n = 3  # exchanges in the window before the guard
    assert asked <= 2 + math.ceil(math.log2(n))
    fits = [e.fits for e in events if e.kind == "provider_context_count"]
    assert fits[0] is False
    assert True in fits  # the search confirms its cut next to a count that does not fit


async def test_guard_refuses_when_the_minimum_does_not_fit(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    provider = gemini(client, context=tight(350), max_output_tokens=100)
    server.count_tokens = lambda body: 1
    observations = await _three_exchanges(server, provider)
    server.count_tokens = tokens_per_content()  # input, last call, its response: 300 + 100
    generated = len(bodies(server))
    with pytest.raises(ProviderContextWindowExceeded):
        await provider.decide(request(observations=observations))
    assert len(bodies(server)) == generated


@pytest.mark.parametrize(
    "script",
    [
        lambda srv: srv.script_error(500, endpoint="count_tokens"),
        lambda srv: srv.script_error(429, endpoint="count_tokens"),
        lambda srv: srv.script_count(None),  # totalTokens omitted
        lambda srv: srv.script_raw(200, {"totalTokens": "many"}, endpoint="count_tokens"),
    ],
)
async def test_count_unavailable_generates_nothing(
    server: FakeGeminiServer, client: genai.Client, script
) -> None:
    store = MemoryHistoryStore()
    provider = gemini(
        client,
        history=HistoryConfig(store=store, namespace="t"),
        context=ContextConfig(100_000),
        max_output_tokens=100,
    )
    script(server)
    with pytest.raises(ProviderContextCountUnavailable):
        await provider.decide(request())
    assert server.requests_to("generate_content") == []
    assert await store.list() == []


async def test_summary_is_sent_as_user_data_and_counted(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    async def summarize(summary_request):
        return f"{len(summary_request.turns)} lookups done"

    events: list[HistoryEvent] = []
    provider = gemini(
        client,
        history=HistoryConfig(max_messages=4, summarize=summarize, on_event=events.append),
        context=ContextConfig(100_000),
        max_output_tokens=100,
    )
    observations = await _three_exchanges(server, provider)
    server.script_response(gemini_text("done"))
    await provider.decide(request(observations=observations))
    sent = bodies(server)[-1]
    counted = server.requests_to("count_tokens")[-1].body["generateContentRequest"]
    assert counted["contents"] == sent["contents"]
    assert sent["contents"][0]["role"] == "user"
    summary_part = sent["contents"][0]["parts"][1]["text"]
    assert summary_part.startswith("[touba: untrusted summary of earlier exchanges")
    assert "lookups done" in summary_part
    assert "lookups done" not in sent["systemInstruction"]["parts"][0]["text"]
    assert any(e.kind == "decision_history_summary" for e in events)


async def test_guard_refuses_implicit_server_state(server: FakeGeminiServer) -> None:
    vertex = genai.Client(vertexai=True, api_key="k")
    extra = gemini_sdk(server.base_url, extra_body={"cachedContent": "cachedContents/x"})
    plain = gemini_sdk(server.base_url)
    guarded = {"context": ContextConfig(100_000), "max_output_tokens": 100}
    with pytest.raises(ProviderContextGuardUnsupported, match="Vertex"):
        gemini(vertex, **guarded)
    with pytest.raises(ProviderContextGuardUnsupported, match="cached_content"):
        gemini(plain, cached_content="cachedContents/abc", **guarded)
    with pytest.raises(ProviderContextGuardUnsupported, match="cached_content"):
        gemini(
            plain, config=types.GenerateContentConfig(cached_content="cachedContents/a"), **guarded
        )
    with pytest.raises(ProviderContextGuardUnsupported, match="extra_body"):
        gemini(extra, **guarded)
    with pytest.raises(ConfigurationError, match="max_output_tokens"):
        gemini(plain, context=ContextConfig(100_000))
    assert server.requests == []
    for sdk in (vertex, extra, plain):
        await sdk.aio.aclose()
        sdk.close()


async def test_cached_content_without_guard_is_sent(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    server.script_response(gemini_text("ok"))
    await gemini(client, cached_content="cachedContents/abc").decide(request())
    assert bodies(server)[0]["cachedContent"] == "cachedContents/abc"


# configuration -----------------------------------------------------------------------


async def test_sdk_config_is_sent_in_rest_form(
    server: FakeGeminiServer, client: genai.Client
) -> None:
    config = types.GenerateContentConfig(
        temperature=0.3,
        thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=128),
        safety_settings=[
            types.SafetySetting(
                category=types.HarmCategory.HARM_CATEGORY_HARASSMENT,
                threshold=types.HarmBlockThreshold.BLOCK_NONE,
            )
        ],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    server.script_response(gemini_text("ok"))
    await gemini(client, config=config).decide(request())
    body = bodies(server)[0]
    assert body["generationConfig"] == {
        "temperature": 0.3,
        "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 128},
    }
    assert body["safetySettings"] == [
        {"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}
    ]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"topp": 0.5}, "unknown Gemini option"),
        ({"response_mime_type": "text/plain"}, "set by touba"),
        ({"system_instruction": "x"}, "set by touba"),
        ({"candidate_count": 2}, "candidate_count"),
        ({"automatic_function_calling": types.AutomaticFunctionCallingConfig()}, "automatic"),
        (
            {"temperature": 0.1, "config": types.GenerateContentConfig(temperature=0.2)},
            "given twice",
        ),
        ({"config": "fast"}, "GenerateContentConfig"),
    ],
)
async def test_bad_options_are_refused_at_construction(
    client: genai.Client, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        gemini(client, **options)


async def test_construction_checks(client: genai.Client, monkeypatch) -> None:
    with pytest.raises(ConfigurationError, match="model"):
        create_gemini_decision_provider(model="", client=client)
    with pytest.raises(ConfigurationError, match="client must be"):
        create_gemini_decision_provider(model=MODEL, client=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="decision_interface"):
        gemini(client, decision_interface="json")
    bad = CapabilitySpec("look up", "x", {"type": "object"})
    unnamed = gemini(client, history=False)
    with pytest.raises(ConfigurationError, match="Gemini function name"):
        await unnamed.decide(DecisionRequest(input="x", capabilities=(bad,)))
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigurationError, match="GEMINI_API_KEY"):
        create_gemini_decision_provider(model=MODEL)
    monkeypatch.setenv("GEMINI_API_KEY", "env-key")
    assert create_gemini_decision_provider(model=MODEL).provider == "gemini"


def test_missing_sdk_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "google.genai", None)
    with pytest.raises(ImportError, match=r'pip install "touba\[gemini\]"'):
        create_gemini_decision_provider(model=MODEL)


@pytest.mark.parametrize("extra_body", [None, {"generationConfig": {"temperature": 0.25}}])
def test_the_sdk_edits_a_copy_of_the_body_never_the_rendered_one(
    server: FakeGeminiServer, extra_body: dict[str, Any] | None
) -> None:
    # The SDK's request builder drops top-level "_" keys and merges the client's
    # extra_body into nested objects of the dict it is given: touba hands it a copy.
    sdk = gemini_sdk(server.base_url, extra_body=extra_body)  # None: the default
    wire = gemini(sdk)._wire
    body = {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "generationConfig": {"maxOutputTokens": 5},
        "_query": {"x": "1"},
    }
    before = json.loads(json.dumps(body))
    sent = wire._sendable(body)
    request = sdk.aio._api_client._build_request("post", f"models/{MODEL}:generateContent", sent)
    assert body == before
    assert isinstance(request.data, dict)
    assert "_query" not in request.data
    config = request.data["generationConfig"]
    assert config == (
        {"maxOutputTokens": 5, "temperature": 0.25} if extra_body else before["generationConfig"]
    )
    sdk.close()
