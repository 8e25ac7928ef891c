"""Helpers of the chat-session tests: one scripted model over three backends, a program.

A :class:`Model` scripts decisions the same way whatever it runs on: the
:class:`~touba.testing.ScriptedProvider`, or the official OpenAI and
Anthropic SDKs against the fake provider servers (whose validators refuse
what the real APIs refuse). ``bodies()`` gives what each generation was
sent, serialised, so tests assert what the model would have seen.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anthropic
import openai

from touba.memory import KeyEventsConfig, MemoryConfig
from touba.providers import DecisionRequest
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.providers.openai import create_openai_decision_provider
from touba.runtime import Program, Runtime, Step
from touba.runtime._program import AgentKind
from touba.testing import ScriptedProvider
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeOpenAIServer,
    anthropic_text,
    anthropic_tool_use,
    openai_function_call,
    openai_text,
)

BACKENDS = ("scripted", "openai", "anthropic")
TYPES = ("refund", "account issue")
INSTRUCTIONS = "You help customers with their orders."

Call = tuple[str, dict[str, Any]]


class Model:
    """A scripted model on one backend."""

    name: str
    provider: Any

    def calls(self, *calls: Call) -> None:
        """Script one decision making these calls."""
        raise NotImplementedError

    def call(self, name: str, **arguments: Any) -> None:
        self.calls((name, arguments))

    def say(self, text: str) -> None:
        """Script a final text answer."""
        raise NotImplementedError

    def output(self, value: Any) -> None:
        """Script a final structured output (an extraction's ops)."""
        raise NotImplementedError

    def fail(self) -> None:
        """Script a provider failure (no decision)."""
        raise NotImplementedError

    def bodies(self) -> list[str]:
        """Every generation request as sent, serialised (``ensure_ascii=False``)."""
        raise NotImplementedError

    def accepted(self) -> bool:
        """True when the fake server's validators accepted every request."""
        return True


class Scripted(Model):
    name = "scripted"

    def __init__(self) -> None:
        self.provider = ScriptedProvider()

    @property
    def requests(self) -> list[DecisionRequest]:
        requests: list[DecisionRequest] = self.provider.requests
        return requests

    def calls(self, *calls: Call) -> None:
        self.provider.add(ScriptedProvider.calls(*calls))

    def say(self, text: str) -> None:
        self.provider.add(ScriptedProvider.final(text))

    def output(self, value: Any) -> None:
        self.provider.add(ScriptedProvider.final(value))

    def fail(self) -> None:
        def broken(request: DecisionRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
            raise RuntimeError("model down")

        self.provider.add(broken)

    def bodies(self) -> list[str]:
        return [json.dumps(m, ensure_ascii=False) for m in self.provider.sent]


class OpenAI(Model):
    name = "openai"

    def __init__(self, server: FakeOpenAIServer, client: openai.AsyncOpenAI) -> None:
        self.server = server
        self.provider = create_openai_decision_provider(model="gpt-test", client=client)

    def calls(self, *calls: Call) -> None:
        self.server.script_response(*(openai_function_call(n, a) for n, a in calls))

    def say(self, text: str) -> None:
        self.server.script_response(openai_text(text))

    def output(self, value: Any) -> None:
        self.server.script_response(openai_text(json.dumps({"output": value})))

    def fail(self) -> None:
        self.server.script_error(500)

    def bodies(self) -> list[str]:
        return [
            json.dumps(r.body, ensure_ascii=False) for r in self.server.requests_to("responses")
        ]

    def accepted(self) -> bool:
        return all(r.status == 200 for r in self.server.requests if r.endpoint == "responses")


class Anthropic(Model):
    name = "anthropic"

    def __init__(self, server: FakeAnthropicServer, client: anthropic.AsyncAnthropic) -> None:
        self.server = server
        self.provider = create_anthropic_decision_provider(model="claude-test", client=client)

    def calls(self, *calls: Call) -> None:
        self.server.script_response(*(anthropic_tool_use(n, a) for n, a in calls))

    def say(self, text: str) -> None:
        self.server.script_response(anthropic_text(text))

    def output(self, value: Any) -> None:
        self.server.script_response(anthropic_text(json.dumps(value)))

    def fail(self) -> None:
        self.server.script_error(500)

    def bodies(self) -> list[str]:
        return [json.dumps(r.body, ensure_ascii=False) for r in self.server.requests_to("messages")]

    def accepted(self) -> bool:
        return all(r.status == 200 for r in self.server.requests if r.endpoint == "messages")


@asynccontextmanager
async def open_model(backend: str) -> AsyncIterator[Model]:
    """A model on ``backend`` ("scripted", "openai" or "anthropic"), closed afterwards."""
    async with AsyncExitStack() as stack:
        if backend == "scripted":
            yield Scripted()
        elif backend == "openai":
            server = stack.enter_context(FakeOpenAIServer())
            client = openai.AsyncOpenAI(
                base_url=server.base_url + "/v1", api_key="sk-test", max_retries=0
            )
            stack.push_async_callback(client.close)
            yield OpenAI(server, client)
        else:
            fake = stack.enter_context(FakeAnthropicServer())
            sdk = anthropic.AsyncAnthropic(base_url=fake.base_url, api_key="sk-ant", max_retries=0)
            stack.push_async_callback(sdk.close)
            yield Anthropic(fake, sdk)


def memory(
    short_term_turns: int = 30,
    full_context_turns: int = 1,
    *,
    enabled: bool = True,
    types: tuple[str, ...] = TYPES,
) -> MemoryConfig:
    return MemoryConfig(
        short_term_turns=short_term_turns,
        full_context_turns=full_context_turns,
        key_events=KeyEventsConfig(enabled=enabled, types=types),
    )


def build_runtime(
    model: Model | Any,
    *,
    kind: AgentKind = "loop",
    config: MemoryConfig | None = None,
    approval: bool = False,
    **runtime_options: Any,
) -> Runtime:
    """Agent "support" of ``kind`` with ``lookup_order`` (and ``refund``, needing approval).

    A flow has one model step, ``reply``.
    """
    program = Program()

    @program.capability(permissions=("orders:read",))
    async def lookup_order(order_id: str) -> dict[str, str]:
        """Find an order."""
        return {"order_id": order_id, "status": "shipped"}

    @program.capability(permissions=("orders:write",), requires_approval=approval)
    async def refund(order_id: str) -> str:
        """Refund an order."""
        return f"refunded {order_id}"

    provider = model.provider if isinstance(model, Model) else model
    program.agent(
        "support",
        provider=provider,
        instructions=INSTRUCTIONS,
        capabilities=("lookup_order", "refund"),
        grants=("orders:read", "orders:write"),
        kind=kind,
        memory=config if config is not None else memory(),
        steps=(Step.model("reply"),) if kind == "flow" else None,
    )
    return Runtime(program, **runtime_options)


@asynccontextmanager
async def open_store(
    kind: str, directory: Any, pg: tuple[str, str] | None = None
) -> AsyncIterator[Any]:
    """A memory store on the real clock: SQLite in ``directory``, or PostgreSQL tables."""
    if kind == "sqlite":
        from touba.memory import SqliteMemoryStore

        async with SqliteMemoryStore(directory / "memory.db") as sqlite_store:
            yield sqlite_store
        return
    from touba.memory.postgres import PostgresMemoryStore

    assert pg is not None
    dsn, prefix = pg
    async with PostgresMemoryStore(dsn, prefix=prefix) as pg_store:
        yield pg_store
