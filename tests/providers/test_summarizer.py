"""ModelSummarizer: bounded, counted, honest about failures, plain text where it can."""

import asyncio
from collections.abc import Callable

import anthropic
import openai
import pytest
from google import genai
from google.genai import types as genai_types

from touba.errors import ConfigurationError, DecisionHistorySummaryInvalid
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryEvent,
    HistoryWindow,
    Observation,
    SummaryRequest,
)
from touba.providers import (
    create_anthropic_decision_provider,
    create_function_decision_provider,
    create_gemini_decision_provider,
    create_openai_decision_provider,
)
from touba.providers.summarizer import ModelSummarizer
from touba.testing import ScriptedProvider
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    anthropic_text,
    gemini_text,
    openai_refusal,
    openai_text,
)

REQUEST = SummaryRequest(
    previous_summary="Earlier: greeted.",
    turns=(({"kind": "decision", "calls": [{"call_id": "c", "name": "f", "arguments": {}}]},),),
    max_bytes=64,
)


async def test_summary_call_sees_previous_summary_and_turns_as_untrusted_data() -> None:
    model = ScriptedProvider(ScriptedProvider.final("Looked up order A1: shipped."), history=False)
    summarizer = ModelSummarizer(model, max_calls=2)
    assert await summarizer(REQUEST) == "Looked up order A1: shipped."
    (request,) = model.requests
    assert request.capabilities == ()
    assert "untrusted" in str(request.input)
    assert "Earlier: greeted." in str(request.input)
    assert "64 bytes" in request.instructions
    assert summarizer.usage.calls == 1


async def test_budget_is_enforced_and_counted() -> None:
    model = ScriptedProvider(ScriptedProvider.final("one"), history=False)
    summarizer = ModelSummarizer(model, max_calls=1)
    await summarizer(REQUEST)
    with pytest.raises(DecisionHistorySummaryInvalid, match="budget"):
        await summarizer(REQUEST)
    assert summarizer.usage.calls == 1


async def test_long_output_is_cut_at_the_bound_on_a_character_boundary() -> None:
    model = ScriptedProvider(ScriptedProvider.final("é" * 100), history=False)
    summarizer = ModelSummarizer(model, max_calls=1)
    text = await summarizer(REQUEST)
    assert len(text.encode()) <= 64
    assert text == "é" * 32
    assert summarizer.usage.truncated == 1


async def test_model_failure_refuses_the_decision() -> None:
    model = ScriptedProvider(history=False)  # no step left: the model is "unavailable"
    summarizer = ModelSummarizer(model, max_calls=3)
    with pytest.raises(DecisionHistorySummaryInvalid):
        await summarizer(REQUEST)
    assert summarizer.usage.failures == 1


async def test_timeout_refuses_the_decision() -> None:
    async def slow(messages, schema):
        await asyncio.sleep(5)
        return {"action": "final", "output": "late"}

    model = create_function_decision_provider(generate=slow, history=False)
    summarizer = ModelSummarizer(model, max_calls=3, timeout_seconds=0.05)
    with pytest.raises(DecisionHistorySummaryInvalid, match="TimeoutError"):
        await summarizer(REQUEST)
    assert summarizer.usage.failures == 1


def test_the_summary_provider_must_keep_no_history() -> None:
    with pytest.raises(ConfigurationError, match="history=False"):
        ModelSummarizer(ScriptedProvider(), max_calls=1)
    with pytest.raises(ConfigurationError):
        ModelSummarizer(ScriptedProvider(history=False), max_calls=0)


async def one_call_decisions(history: DecisionHistory, count: int) -> list[HistoryWindow]:
    """``count`` decisions of one call each, every result answered; the windows they saw."""
    identity = ConversationIdentity("touba.private", "p", "m", "native", "r", "i", "a")
    observations: list[Observation] = []
    windows: list[HistoryWindow] = []
    for n in range(count):

        async def generate(window: HistoryWindow, n: int = n) -> DecisionMessage:
            windows.append(window)
            return DecisionMessage(calls=(CapabilityCall(f"c{n}", "f", {"n": n}),))

        decision = await history.step(identity, observations, generate)
        observations = [
            Observation(c.call_id, c.name, c.arguments, "ok", n) for c in decision.calls
        ]
    return windows


async def test_wired_into_a_history() -> None:
    """The summary lands in the window as data and is observable without its text."""
    model = ScriptedProvider(
        *[ScriptedProvider.final(f"summary {n}") for n in range(10)], history=False
    )
    summarizer = ModelSummarizer(model, max_calls=10)
    events: list[HistoryEvent] = []
    history = DecisionHistory(
        HistoryConfig(
            max_messages=6, summarize=summarizer, max_summary_bytes=200, on_event=events.append
        )
    )
    windows = await one_call_decisions(history, 5)
    assert windows[-1].summary is not None
    assert windows[-1].summary.text.startswith("summary")
    summaries = [e for e in events if e.kind == "decision_history_summary"]
    assert summaries
    assert all("summary " not in str(e.to_dict()) for e in summaries)
    assert summarizer.usage.calls == len(summaries)


# against the fake servers, through the official SDKs ---------------------------------------


async def test_native_providers_are_asked_for_plain_text(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(model="m", client=openai_client, history=False)
    openai_server.script_response(openai_text("Order A1 was looked up: shipped."))
    summarizer = ModelSummarizer(provider, max_calls=1)

    assert await summarizer(REQUEST) == "Order A1 was looked up: shipped."
    (body,) = [r.body for r in openai_server.requests_to("responses")]
    assert "text" not in body  # no JSON format asked for: the answer is the text
    assert "tools" not in body


async def test_anthropic_and_gemini_are_asked_for_plain_text_too() -> None:
    with FakeAnthropicServer() as srv:
        sdk = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="k", max_retries=0)
        provider = create_anthropic_decision_provider(model="claude", client=sdk, history=False)
        srv.script_response(anthropic_text("Looked up A1."))
        assert await ModelSummarizer(provider, max_calls=1)(REQUEST) == "Looked up A1."
        (body,) = [r.body for r in srv.requests_to("messages")]
        assert "tools" not in body
        assert "JSON" not in str(body.get("system", ""))
        await sdk.close()
    with FakeGeminiServer() as gsrv:
        client = genai.Client(
            api_key="k",
            http_options=genai_types.HttpOptions(
                base_url=gsrv.base_url, retry_options=genai_types.HttpRetryOptions(attempts=1)
            ),
        )
        provider = create_gemini_decision_provider(model="gemini", client=client, history=False)
        gsrv.script_response(gemini_text("Looked up A1."))
        assert await ModelSummarizer(provider, max_calls=1)(REQUEST) == "Looked up A1."
        (body,) = [r.body for r in gsrv.requests]
        assert "responseJsonSchema" not in body.get("generationConfig", {})
        await client.aio.aclose()
        client.close()


async def test_the_structured_interface_asks_for_strict_structured_output(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    provider = create_openai_decision_provider(
        model="m", client=openai_client, history=False, decision_interface="structured"
    )
    openai_server.script_response(openai_text('{"action":"final","output":"Looked up A1."}'))

    assert await ModelSummarizer(provider, max_calls=1)(REQUEST) == "Looked up A1."
    (body,) = [r.body for r in openai_server.requests_to("responses")]
    assert body["text"]["format"]["strict"] is True
    assert body["text"]["format"]["schema"] == {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["final"]},
            "output": {"type": "string"},
        },
        "required": ["action", "output"],
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    ("script", "cause"),
    [
        (
            lambda srv: srv.script_response(openai_refusal("I will not.")),
            "AgentDecisionProviderSchemaViolation, provider_error_code=refusal",
        ),
        (
            lambda srv: srv.script_response(openai_text("   ")),
            "AgentDecisionProviderSchemaViolation, provider_error_code=empty_output",
        ),
        (lambda srv: srv.script_error(503), "AgentDecisionProviderUnavailable"),
    ],
    ids=["refusal", "empty", "server_down"],
)
async def test_a_failure_names_its_cause_in_the_message(
    openai_server: FakeOpenAIServer,
    openai_client: openai.AsyncOpenAI,
    script: Callable[[FakeOpenAIServer], None],
    cause: str,
) -> None:
    provider = create_openai_decision_provider(model="m", client=openai_client, history=False)
    script(openai_server)
    summarizer = ModelSummarizer(provider, max_calls=1)
    with pytest.raises(DecisionHistorySummaryInvalid) as raised:
        await summarizer(REQUEST)
    assert cause in raised.value.message
    assert "I will not" not in raised.value.message  # codes only, never the model's text
    assert summarizer.usage.failures == 1


async def test_a_failing_model_summariser_degrades_to_plain_trimming_when_asked() -> None:
    """``on_summary_failure="trim"``: the spent budget does not refuse the decisions."""
    model = ScriptedProvider(ScriptedProvider.final("summary 0"), history=False)
    summarizer = ModelSummarizer(model, max_calls=1)
    events: list[HistoryEvent] = []
    history = DecisionHistory(
        HistoryConfig(
            max_messages=6,
            summarize=summarizer,
            max_summary_bytes=200,
            on_event=events.append,
            on_summary_failure="trim",
        )
    )
    windows = await one_call_decisions(history, 6)
    kinds = [e.kind for e in events if e.kind.startswith("decision_history_summary")]
    assert kinds == [
        "decision_history_summary",
        "decision_history_summary_failed",
        "decision_history_summary_failed",
    ]
    assert windows[-1].summary is None
    assert summarizer.usage.calls == 1
