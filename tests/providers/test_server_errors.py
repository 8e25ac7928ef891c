"""What a vendor or server said when it refused, on every provider, against the fakes.

An HTTP error answer becomes ``AgentDecisionProviderUnavailable`` (a count of the
guard: ``ProviderContextCountUnavailable``) whose ``server_message`` and text carry
the body's message, and whose ``retryable`` says whether the same request may work
later: not after a 4xx other than 408, 409 and 429. The message may quote the
request, so it never reaches ``error.message``, trace events, checkpoints or logs.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tests._providers import fake_server, vendor_provider
from touba.errors import AgentDecisionProviderUnavailable, ProviderContextCountUnavailable
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.providers import CapabilitySpec, ContextConfig, DecisionRequest
from touba.providers._refusal import body_message, retry_can_help
from touba.runtime import Program, Runtime
from touba.testing.fakes import (
    FakeOpenAIServer,
    FakeProviderServer,
    anthropic_tool_use,
    chat_tool_call,
    gemini_function_call,
    openai_function_call,
)

VENDORS = ("openai", "compatible", "anthropic", "gemini")
COUNTING = ("openai", "anthropic", "gemini")
SAID = "messages.1.content: SECRET-ECHO is not a valid value"
LOOKUP = CapabilitySpec(
    "lookup",
    "Look an order up",
    {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
)
REQUEST = DecisionRequest(
    run_id="r", invocation_id="i", agent_ref="a", input="Where is A?", capabilities=(LOOKUP,)
)


def _script_call(vendor: str, srv: Any) -> None:
    if vendor == "openai":
        srv.script_response(openai_function_call("lookup", {"q": "A"}))
    elif vendor == "compatible":
        srv.script_chat_completion(tool_calls=[chat_tool_call("lookup", {"q": "A"})])
    elif vendor == "anthropic":
        srv.script_response(anthropic_tool_use("lookup", {"q": "A"}), stop_reason="tool_use")
    else:
        srv.script_response(gemini_function_call("lookup", {"q": "A"}))


def _endpoint(vendor: str, srv: FakeProviderServer) -> str:
    return "chat_completions" if vendor == "compatible" else srv.generation_endpoint


def _check(error: Exception, status: int, retryable: bool) -> None:
    assert isinstance(error, AgentDecisionProviderUnavailable | ProviderContextCountUnavailable)
    assert error.status_code == status
    assert error.server_message == SAID
    assert f'(the server said: "{SAID}")' in str(error)
    assert "SECRET-ECHO" not in error.message  # touba's own words only
    assert error.retryable is retryable
    if not retryable:
        assert "retry later" not in str(error).lower()


STATUSES = [
    (400, False),
    (401, False),
    (403, False),
    (404, False),
    (413, False),
    (422, False),
    (408, True),
    (429, True),
    (500, True),
    (503, True),
]


@pytest.mark.parametrize(("status", "retryable"), STATUSES)
@pytest.mark.parametrize("vendor", VENDORS)
async def test_an_http_error_carries_the_servers_message(
    vendor: str, status: int, retryable: bool
) -> None:
    store = MemoryHistoryStore()
    with fake_server(vendor) as srv:
        srv.script_error(status, SAID, endpoint=_endpoint(vendor, srv))
        async with vendor_provider(
            vendor, srv, HistoryConfig(store=store, namespace="t")
        ) as provider:
            with pytest.raises(AgentDecisionProviderUnavailable) as caught:
                await provider.decide(REQUEST)
        assert len(srv.requests) == 1  # never retried by the SDK
    _check(caught.value, status, retryable)
    assert await store.list() == []  # nothing stored


@pytest.mark.parametrize(("status", "retryable"), [(400, False), (401, False), (500, True)])
@pytest.mark.parametrize("vendor", COUNTING)
async def test_a_refused_count_carries_the_servers_message(
    vendor: str, status: int, retryable: bool
) -> None:
    with fake_server(vendor) as srv:
        srv.script_error(status, SAID, endpoint=srv.count_endpoint)
        options = {"context": ContextConfig(100_000), "max_output_tokens": 100}
        async with vendor_provider(vendor, srv, False, **options) as provider:
            with pytest.raises(ProviderContextCountUnavailable) as caught:
                await provider.decide(REQUEST)
        assert srv.requests_to(srv.generation_endpoint) == []
    _check(caught.value, status, retryable)


async def test_an_error_without_a_message_has_none() -> None:
    with FakeOpenAIServer() as srv:
        srv.script_raw(500, {"error": {"type": "server_error"}}, endpoint="chat_completions")
        async with vendor_provider("compatible", srv, False) as provider:
            with pytest.raises(AgentDecisionProviderUnavailable) as caught:
                await provider.decide(REQUEST)
    assert caught.value.server_message is None
    assert caught.value.retryable
    assert str(caught.value) == caught.value.message


@pytest.mark.parametrize(("status", "retryable"), [(400, False), (503, True)])
@pytest.mark.parametrize("vendor", VENDORS)
async def test_the_servers_message_stays_out_of_traces_checkpoints_and_logs(
    vendor: str, status: int, retryable: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A call runs, then the next decision is refused: the invocation fails (with a
    checkpoint when the error is retryable), and only the caller sees the message."""
    caplog.set_level(logging.DEBUG)
    with fake_server(vendor) as srv:
        _script_call(vendor, srv)
        srv.script_error(status, SAID, endpoint=_endpoint(vendor, srv))
        async with vendor_provider(vendor, srv, None) as provider:
            program = Program()

            @program.capability()
            async def lookup(q: str) -> str:
                return f"{q} shipped"

            program.agent("support", provider=provider, capabilities=("lookup",))
            runtime = Runtime(program)
            result = await runtime.invoke("support", input="Where is A?")
    assert result.status == "failed"
    error = result.error
    assert isinstance(error, AgentDecisionProviderUnavailable)
    _check(error, status, retryable)
    events = json.dumps(result.trace.to_dicts(), default=str)
    assert "invocation_failed" in events
    assert "SECRET-ECHO" not in events
    if retryable:  # a call ran: the checkpoint keeps the error's code and touba's words
        assert result.checkpoint_id is not None
        checkpoint = await runtime.checkpoints.get(result.checkpoint_id)
        assert checkpoint is not None
        assert checkpoint["error"]["code"] == "AgentDecisionProviderUnavailable"
        assert "SECRET-ECHO" not in json.dumps(checkpoint)
    else:
        assert result.checkpoint_id is None
    assert caplog.records, "the runtime logs the failure"
    for record in caplog.records:
        assert "SECRET-ECHO" not in record.getMessage()


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"error": {"message": "m", "type": "t"}}, "m"),  # OpenAI, compatible servers
        ({"type": "error", "error": {"type": "t", "message": "m"}}, "m"),  # Anthropic
        ({"error": {"code": 400, "message": "m", "status": "INVALID_ARGUMENT"}}, "m"),  # Gemini
        ({"error": "m"}, "m"),  # Ollama's native errors
        ({"detail": "m"}, "m"),  # FastAPI's HTTPException
        (
            {"detail": [{"loc": ["body", "tools", 0], "msg": "m", "input": {"SECRET": 1}}]},
            "body.tools.0: m",
        ),
        ("  m  ", "m"),  # a text body
        ({"error": {"type": "t"}}, None),
        ({"detail": [{"input": 1}]}, None),
        (None, None),
        ([1, 2], None),
    ],
)
def test_the_message_of_each_error_body(body: object, said: str | None) -> None:
    assert body_message(body) == said


@pytest.mark.parametrize(
    ("status", "said", "kind", "retryable"),
    [
        (None, None, None, True),
        (408, "m", None, True),
        (409, "m", None, True),
        (429, "m", None, True),
        (400, "m", None, False),
        (404, None, None, False),
        (500, None, None, True),
        (500, "CUDA error: out of memory", None, True),
        (503, "Service Unavailable", "server_error", True),
        (529, "Overloaded", "overloaded_error", True),
        (500, "m", "invalid_request_error", False),
        (500, "1 validation error for CreateChatCompletionRequest", None, False),
        (500, "'NoneType' object has no attribute 'content'", None, False),
        (500, "jinja2.exceptions.TemplateError: nope", None, False),
        (500, "'messages' is undefined", None, False),
        (500, "'content'", None, False),
    ],
)
def test_whether_a_retry_can_help(
    status: int | None, said: str | None, kind: str | None, retryable: bool
) -> None:
    assert retry_can_help(status, said, kind) is retryable
