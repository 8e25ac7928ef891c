"""A full store refuses a decision before the provider is paid, for every provider.

Each provider runs with its context guard against its fake server; the
server's request log shows that a refused decision sent nothing at all: no
count request, no generation. (tests/history/test_capacity.py covers every
store and limit with the OpenAI provider.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

from tests._providers import anthropic_sdk, close_gemini, gemini_sdk, openai_sdk
from tests.history._stores import LOOKUP
from tests.providers._requests import decision_request
from touba.errors import DecisionHistoryLimitExceeded
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.providers import ContextConfig, DecisionRequest, Observation
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.providers.gemini import create_gemini_decision_provider
from touba.providers.openai import create_openai_decision_provider
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    FakeProviderServer,
    anthropic_text,
    anthropic_tool_use,
    gemini_function_call,
    gemini_text,
    openai_function_call,
    openai_text,
)

GUARD = ContextConfig(context_window_tokens=100_000)


@dataclass
class Setup:
    server: FakeProviderServer
    provider: Any
    script_call: Callable[[], None]
    script_text: Callable[[str], None]


Vendor = tuple[FakeProviderServer, Callable[..., Any], Callable[..., Any], Callable[[str], Any]]


async def _openai(stack: AsyncExitStack) -> Vendor:
    server = stack.enter_context(FakeOpenAIServer())
    client = await stack.enter_async_context(openai_sdk(server))
    create = partial(create_openai_decision_provider, model="gpt-test", client=client)
    return server, create, openai_function_call, openai_text


async def _anthropic(stack: AsyncExitStack) -> Vendor:
    server = stack.enter_context(FakeAnthropicServer())
    client = await stack.enter_async_context(anthropic_sdk(server))
    create = partial(create_anthropic_decision_provider, model="claude-test", client=client)
    return server, create, anthropic_tool_use, anthropic_text


async def _gemini(stack: AsyncExitStack) -> Vendor:
    server = stack.enter_context(FakeGeminiServer())
    client = gemini_sdk(server.base_url)
    stack.push_async_callback(close_gemini, client)
    create = partial(create_gemini_decision_provider, model="gemini-test", client=client)
    return server, create, gemini_function_call, gemini_text


@pytest.fixture(params=[_openai, _anthropic, _gemini], ids=["openai", "anthropic", "gemini"])
async def build(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[HistoryConfig], Any]]:
    async with AsyncExitStack() as stack:

        async def make(history: HistoryConfig) -> Setup:
            vendor: Callable[[AsyncExitStack], Awaitable[Vendor]] = request.param
            server: Any
            server, create, call, text = await vendor(stack)
            return Setup(
                server,
                create(history=history, context=GUARD, max_output_tokens=100),
                lambda: server.script_response(call("lookup_order", {"order_id": "A1"})),
                lambda said: server.script_response(text(said)),
            )

        yield make


def request(invocation: str, **fields: Any) -> DecisionRequest:
    return decision_request(LOOKUP, invocation_id=invocation, **fields)


async def test_a_full_store_refuses_before_any_request(build: Any) -> None:
    store = MemoryHistoryStore(max_sessions=2, max_store_bytes=6000)
    setup: Setup = await build(HistoryConfig(store=store, namespace="t"))
    server = setup.server
    setup.script_call()
    decision = await setup.provider.decide(request("i1"))
    setup.script_text("done")
    await setup.provider.decide(request("i2"))
    paid = [r.endpoint for r in server.requests]
    assert paid == [server.count_endpoint, server.generation_endpoint] * 2
    before = [(row, await store.read(row.key)) for row in await store.list()]

    (call,) = decision.calls
    big = (Observation(call.call_id, call.name, call.arguments, "ok", {"pad": "x" * 6000}),)
    refusals = {
        "max_store_bytes": request("i1", observations=big),
        "max_sessions": request("i3"),
    }
    setup.script_text("never generated")
    for limit, refused in refusals.items():
        with pytest.raises(DecisionHistoryLimitExceeded) as caught:
            await setup.provider.decide(refused)
        assert caught.value.limit == limit
    assert [r.endpoint for r in server.requests] == paid  # nothing was sent
    assert server.pending(server.generation_endpoint) == 1
    assert [(row, await store.read(row.key)) for row in await store.list()] == before
