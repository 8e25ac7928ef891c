"""Provider deadlines (issue 29, item 2): every provider, its fake server behind a
loopback proxy (tests/_netproxy.py) that black-holes or slows the traffic.

Each provider is given a client of the host's with no timeout at all (the SDK's own
per-request timeout would otherwise be the SDK default of minutes), so only
``deadline_seconds`` bounds it. A request that gets no answer fails with the retryable
``AgentDecisionProviderUnavailable`` within the deadline + 1 s (a count of the context
guard with ``ProviderContextCountUnavailable``), stores nothing and leaves the
conversation free for the next decision, which succeeds once the network is back. A
stream that goes silent after some events fails the same way; a stream whose events
keep coming may last longer than the deadline in total; 50 ms of latency changes
nothing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from tests._netproxy import NetProxy, net_proxy
from tests._providers import close_gemini, fake_server
from tests.providers.test_streaming import LOOKUP, VENDORS, _script_calls
from touba.errors import (
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    DecisionHistorySummaryInvalid,
    ProviderContextCountUnavailable,
)
from touba.history import HistoryConfig, MemoryHistoryStore, SummaryRequest
from touba.providers import ContextConfig, DecisionProvider, DecisionRequest
from touba.providers._stream import DecisionDelta, StreamedCall
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.providers.compatible import create_openai_compatible_decision_provider
from touba.providers.gemini import create_gemini_decision_provider
from touba.providers.openai import create_openai_decision_provider
from touba.providers.summarizer import ModelSummarizer
from touba.testing.fakes import (
    FakeProviderServer,
    StreamKnobs,
    anthropic_text,
    gemini_text,
    openai_text,
)

DEADLINE = 1.0
SLACK = 1.0  # the bound: no answer fails within deadline + 1 s
REQUEST = DecisionRequest(
    run_id="r", invocation_id="i", agent_ref="a", input="A and B?", capabilities=(LOOKUP,)
)
GUARDED = ("openai", "anthropic", "gemini")  # the OpenAI-compatible provider has no guard


@pytest.fixture(params=VENDORS)
def vendor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def served(vendor: str) -> Iterator[tuple[FakeProviderServer, NetProxy]]:
    with fake_server(vendor) as srv:
        parts = urlsplit(srv.base_url)
        with net_proxy(parts.hostname or "127.0.0.1", parts.port or 80) as proxy:
            yield srv, proxy


@asynccontextmanager
async def provider_on(
    vendor: str, base_url: str, store: MemoryHistoryStore, **options: Any
) -> AsyncIterator[DecisionProvider]:
    """``vendor``'s provider on ``base_url`` with a host client that has no timeout and
    never retries, deadline ``DEADLINE``."""
    history = HistoryConfig(store=store, namespace="test")
    options.setdefault("deadline_seconds", DEADLINE)
    if vendor == "openai":
        sdk = openai.AsyncOpenAI(
            base_url=base_url + "/v1", api_key="sk-test", max_retries=0, timeout=None
        )
        async with sdk:
            yield create_openai_decision_provider(
                model="gpt-test", client=sdk, history=history, **options
            )
    elif vendor == "compatible":
        options.pop("max_output_tokens", None)
        provider = create_openai_compatible_decision_provider(
            model="local", base_url=base_url + "/v1", history=history, **options
        )
        yield provider
        await provider.aclose()
    elif vendor == "anthropic":
        claude = anthropic.AsyncAnthropic(
            base_url=base_url, api_key="sk-test", max_retries=0, timeout=None
        )
        async with claude:
            yield create_anthropic_decision_provider(
                model="claude-test", client=claude, history=history, **options
            )
    else:
        http = types.HttpOptions(
            base_url=base_url, retry_options=types.HttpRetryOptions(attempts=1)
        )
        client = genai.Client(api_key="sk-test", http_options=http)
        yield create_gemini_decision_provider(
            model="gemini-test", client=client, history=history, **options
        )
        await close_gemini(client)


async def nothing(delta: DecisionDelta) -> None:
    pass


def _make(vendor: str, base_url: str, deadline: Any) -> DecisionProvider:
    if vendor == "compatible":
        return create_openai_compatible_decision_provider(
            model="m", base_url=base_url, deadline_seconds=deadline
        )
    if vendor == "openai":
        client = openai.AsyncOpenAI(base_url=base_url, api_key="k")
        return create_openai_decision_provider(model="m", client=client, deadline_seconds=deadline)
    if vendor == "anthropic":
        claude = anthropic.AsyncAnthropic(base_url=base_url, api_key="k")
        return create_anthropic_decision_provider(
            model="m", client=claude, deadline_seconds=deadline
        )
    gemini = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=base_url))
    return create_gemini_decision_provider(model="m", client=gemini, deadline_seconds=deadline)


def test_the_deadline_is_checked_at_construction(vendor: str) -> None:
    with fake_server(vendor) as srv:
        for bad in (0, -2.5, float("inf"), True, "60"):
            with pytest.raises(ConfigurationError, match="deadline_seconds"):
                _make(vendor, srv.base_url, bad)
        assert _make(vendor, srv.base_url, 7).deadline_seconds == 7.0


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_a_black_hole_fails_the_decision_in_time_and_the_next_succeeds(
    vendor: str, served: tuple[FakeProviderServer, NetProxy], streamed: bool
) -> None:
    srv, proxy = served
    store = MemoryHistoryStore()
    sink = nothing if streamed else None
    async with provider_on(vendor, proxy.url(srv.base_url), store) as provider:
        _script_calls(vendor, srv)
        proxy.black_hole()
        started = time.monotonic()
        with pytest.raises(AgentDecisionProviderUnavailable) as caught:
            await provider.decide(REQUEST, sink=sink)
        elapsed = time.monotonic() - started
        assert caught.value.retryable
        assert elapsed < DEADLINE + SLACK, elapsed
        assert "deadline_seconds" in str(caught.value)
        assert [c.messages for c in await store.list()] in ([], [0])  # nothing stored
        proxy.restore()
        decision = await provider.decide(REQUEST, sink=sink)  # the scripted answer, unsent
        assert len(decision.calls) == 2
    assert [c.messages for c in await store.list()] == [1]  # the one decision that was answered


async def test_a_stream_gone_silent_midway_fails_in_time(
    vendor: str, served: tuple[FakeProviderServer, NetProxy]
) -> None:
    """The network goes silent once the stream's first call has arrived: the decision
    fails within the deadline after that event, and nothing of the stream is stored."""
    srv, proxy = served
    store = MemoryHistoryStore()
    silenced: list[float] = []

    async def sink(delta: DecisionDelta) -> None:
        if isinstance(delta, StreamedCall) and not silenced:
            proxy.black_hole()
            silenced.append(time.monotonic())

    _script_calls(vendor, srv, stream=StreamKnobs(event_delay=0.05))
    async with provider_on(vendor, proxy.url(srv.base_url), store) as provider:
        with pytest.raises(AgentDecisionProviderUnavailable) as caught:
            await provider.decide(REQUEST, sink=sink)
        assert silenced, "the stream never reached its first call"
        elapsed = time.monotonic() - silenced[0]
        assert elapsed < DEADLINE + SLACK, elapsed
        assert caught.value.retryable  # (the SDK's read timeout, capped at the deadline, or ours)
        assert [c.messages for c in await store.list()] in ([], [0])
        proxy.restore()
        _script_calls(vendor, srv)
        assert len((await provider.decide(REQUEST, sink=sink)).calls) == 2


def _script_text(vendor: str, srv: Any, text: str, **knobs: Any) -> None:
    """A final answer of plain text: the shortest stream each vendor sends."""
    if vendor == "openai":
        srv.script_response(openai_text(text), **knobs)
    elif vendor == "compatible":
        srv.script_chat_completion(text, **knobs)
    elif vendor == "anthropic":
        srv.script_response(anthropic_text(text), **knobs)
    else:
        srv.script_response(gemini_text(text), **knobs)


# How far apart the events of ``_script_text``'s stream are sent: about 2 s in all (its
# 15, 10, 13 and 7 events), each gap well inside the 0.8 s deadline (an Anthropic
# "ping" the SDK skips makes one gap twice as long).
GAPS = {"openai": 0.15, "compatible": 0.22, "anthropic": 0.17, "gemini": 0.33}
LONG_TEXT = "All done, the orders A and B have both shipped today."


async def test_a_stream_may_outlast_the_deadline_while_its_events_keep_coming(
    vendor: str, served: tuple[FakeProviderServer, NetProxy]
) -> None:
    """Each silence fits in the deadline, the whole stream does not, and the decision
    arrives: the deadline bounds silence, not length."""
    srv, proxy = served
    store = MemoryHistoryStore()
    deadline = 0.8
    _script_text(vendor, srv, LONG_TEXT, stream=StreamKnobs(event_delay=GAPS[vendor]))
    async with provider_on(
        vendor, proxy.url(srv.base_url), store, deadline_seconds=deadline
    ) as provider:
        started = time.monotonic()
        decision = await provider.decide(REQUEST, sink=nothing)
        assert time.monotonic() - started > deadline * 2  # longer than the deadline
        assert LONG_TEXT in (decision.text, decision.output)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_decisions_through_50_ms_of_latency_work(
    vendor: str, served: tuple[FakeProviderServer, NetProxy], streamed: bool
) -> None:
    srv, proxy = served
    proxy.delay(50)
    store = MemoryHistoryStore()
    async with provider_on(vendor, proxy.url(srv.base_url), store) as provider:
        _script_calls(vendor, srv)
        assert len((await provider.decide(REQUEST, sink=nothing if streamed else None)).calls) == 2


async def test_a_guard_count_under_a_black_hole_is_count_unavailable_in_time(
    vendor: str, served: tuple[FakeProviderServer, NetProxy]
) -> None:
    if vendor not in GUARDED:
        pytest.skip("the OpenAI-compatible provider has no context guard")
    srv, proxy = served
    store = MemoryHistoryStore()
    context = ContextConfig(context_window_tokens=100_000)
    async with provider_on(
        vendor, proxy.url(srv.base_url), store, context=context, max_output_tokens=1000
    ) as provider:
        proxy.black_hole()
        started = time.monotonic()
        with pytest.raises(ProviderContextCountUnavailable) as caught:
            await provider.decide(REQUEST)
        assert time.monotonic() - started < DEADLINE + SLACK
        assert caught.value.retryable
        assert srv.requests == []  # nothing reached the server: nothing was generated
        proxy.restore()
        _script_calls(vendor, srv)
        assert len((await provider.decide(REQUEST)).calls) == 2


async def test_a_summarizer_whose_provider_goes_silent_refuses_in_time() -> None:
    """The summariser's provider has its own deadline (shorter here than the summariser's
    timeout_seconds): a silent network refuses the decision that needed the summary
    with DecisionHistorySummaryInvalid, the provider's error chained. (One provider
    suffices: the deadline is DecisionProvider's, shared by all.)"""
    with fake_server("openai") as srv:
        parts = urlsplit(srv.base_url)
        with net_proxy(parts.hostname or "127.0.0.1", parts.port or 80) as proxy:
            await _summarize_through(srv, proxy)


async def _summarize_through(srv: FakeProviderServer, proxy: NetProxy) -> None:
    sdk = openai.AsyncOpenAI(
        base_url=proxy.url(srv.base_url) + "/v1", api_key="sk-test", max_retries=0, timeout=None
    )
    async with sdk:
        provider = create_openai_decision_provider(
            model="m", client=sdk, history=False, deadline_seconds=DEADLINE
        )
        summarizer = ModelSummarizer(provider, max_calls=3, timeout_seconds=30)
        request = SummaryRequest(previous_summary="Greeted.", turns=(), max_bytes=200)
        proxy.black_hole()
        started = time.monotonic()
        with pytest.raises(DecisionHistorySummaryInvalid) as caught:
            await summarizer(request)
        assert time.monotonic() - started < DEADLINE + SLACK
        assert isinstance(caught.value.__cause__, AgentDecisionProviderUnavailable)
        proxy.restore()
        _script_text("openai", srv, "Nothing happened yet.")
        assert await summarizer(request) == "Nothing happened yet."
