"""ModelSummarizer: bounded, counted, honest about failures."""

import asyncio

import pytest

from touba.errors import ConfigurationError, DecisionHistorySummaryInvalid
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryEvent,
    Observation,
    SummaryRequest,
)
from touba.providers import create_function_decision_provider
from touba.providers.summarizer import ModelSummarizer
from touba.testing import ScriptedProvider

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
    identity = ConversationIdentity("touba.private", "p", "m", "native", "r", "i", "a")
    observations: list[Observation] = []
    windows = []
    for n in range(5):

        async def generate(window, n=n):
            windows.append(window)
            return DecisionMessage(calls=(CapabilityCall(f"c{n}", "f", {"n": n}),))

        decision = await history.step(identity, observations, generate)
        observations = [
            Observation(c.call_id, c.name, c.arguments, "ok", n) for c in decision.calls
        ]
    assert windows[-1].summary is not None
    assert windows[-1].summary.text.startswith("summary")
    summaries = [e for e in events if e.kind == "decision_history_summary"]
    assert summaries
    assert all("summary " not in str(e.to_dict()) for e in summaries)
    assert summarizer.usage.calls == len(summaries)
