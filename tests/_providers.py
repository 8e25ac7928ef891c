"""The fake provider servers and an official SDK client on each, as fixtures and helpers.

Registered for the whole suite by ``tests/conftest.py``: a test asks for
``openai_server`` and ``openai_client`` (or the ``anthropic_`` and ``gemini_``
pairs) and gets a fresh fake with a client that never retries, closed after the
test. ``api_key`` is the key those clients send; a module overrides the fixture
where the key matters (a test that checks it never leaks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from touba.history import HistoryConfig
from touba.providers import DecisionProvider
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.providers.compatible import create_openai_compatible_decision_provider
from touba.providers.gemini import create_gemini_decision_provider
from touba.providers.openai import create_openai_decision_provider
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    FakeProviderServer,
)

Fake = TypeVar("Fake", bound=FakeProviderServer)


def openai_sdk(
    srv: FakeOpenAIServer, api_key: str = "sk-test", **options: Any
) -> openai.AsyncOpenAI:
    """An OpenAI client on ``srv`` that does not retry (``options`` may say otherwise)."""
    options.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key=api_key, **options)


def anthropic_sdk(srv: FakeAnthropicServer, api_key: str = "sk-test") -> anthropic.AsyncAnthropic:
    """An Anthropic client on ``srv`` that does not retry."""
    return anthropic.AsyncAnthropic(base_url=srv.base_url, api_key=api_key, max_retries=0)


def gemini_sdk(base_url: str, *, api_key: str = "sk-test", **http: Any) -> genai.Client:
    """A Gemini client on ``base_url`` that tries once; ``http`` adds HTTP options."""
    retry = types.HttpRetryOptions(attempts=1)
    options = types.HttpOptions(base_url=base_url, retry_options=retry, **http)
    return genai.Client(api_key=api_key, http_options=options)


async def close_gemini(client: genai.Client) -> None:
    """Close both of a Gemini client's transports."""
    await client.aio.aclose()
    client.close()


def _serving(fake: type[Fake]) -> Iterator[Fake]:
    with fake() as srv:
        yield srv


@pytest.fixture
def api_key() -> str:
    return "sk-test"


@pytest.fixture
def openai_server() -> Iterator[FakeOpenAIServer]:
    yield from _serving(FakeOpenAIServer)


@pytest.fixture
async def openai_client(
    openai_server: FakeOpenAIServer, api_key: str
) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_sdk(openai_server, api_key) as sdk:
        yield sdk


@pytest.fixture
def anthropic_server() -> Iterator[FakeAnthropicServer]:
    yield from _serving(FakeAnthropicServer)


@pytest.fixture
async def anthropic_client(
    anthropic_server: FakeAnthropicServer, api_key: str
) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic_sdk(anthropic_server, api_key) as sdk:
        yield sdk


@pytest.fixture
def gemini_server() -> Iterator[FakeGeminiServer]:
    yield from _serving(FakeGeminiServer)


@pytest.fixture
async def gemini_client(
    gemini_server: FakeGeminiServer, api_key: str
) -> AsyncIterator[genai.Client]:
    sdk = gemini_sdk(gemini_server.base_url, api_key=api_key)
    yield sdk
    await close_gemini(sdk)


# -- one vendor by name: its fake and a provider on it -------------------------------------

VENDORS = ("openai", "compatible", "anthropic", "gemini")


def fake_server(vendor: str, **options: Any) -> FakeProviderServer:
    """A new fake of ``vendor`` (one of ``VENDORS``); the compatible one is OpenAI's."""
    if vendor in ("openai", "compatible"):
        return FakeOpenAIServer(**options)
    if vendor == "anthropic":
        return FakeAnthropicServer(**options)
    return FakeGeminiServer(**options)


@asynccontextmanager
async def vendor_provider(
    vendor: str, srv: FakeProviderServer, history: HistoryConfig | bool | None, **options: Any
) -> AsyncIterator[DecisionProvider]:
    """``vendor``'s decision provider on ``srv`` through its official SDK (the compatible
    one through its own client), closed after the block."""
    if vendor == "openai":
        async with openai_sdk(srv) as sdk:  # type: ignore[arg-type]
            yield create_openai_decision_provider(
                model="gpt-test", client=sdk, history=history, **options
            )
    elif vendor == "compatible":
        provider = create_openai_compatible_decision_provider(
            model="local", base_url=srv.base_url + "/v1", history=history, **options
        )
        yield provider
        await provider.aclose()
    elif vendor == "anthropic":
        async with anthropic_sdk(srv) as claude:  # type: ignore[arg-type]
            yield create_anthropic_decision_provider(
                model="claude-test", client=claude, history=history, **options
            )
    else:
        client = gemini_sdk(srv.base_url)
        yield create_gemini_decision_provider(
            model="gemini-test", client=client, history=history, **options
        )
        await close_gemini(client)
