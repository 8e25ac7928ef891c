"""Loopback fake provider servers speaking each provider's real wire format.

Each server is a stdlib HTTP server on 127.0.0.1 (ephemeral port) meant to be
driven through the official SDK clients. Tests script its answers, read what
it was sent (``srv.requests``), and rely on its validators to refuse what the
real API refuses, with the real status and error body::

    with FakeOpenAIServer() as srv:
        srv.script_response(openai_function_call("search", {"q": "x"}))
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="test")

The validators are also plain functions (``validate_*_request``) returning
the list of problems for a request body.
"""

from touba.testing.fakes._ledger import IssueLedger
from touba.testing.fakes._server import (
    FakeProviderServer,
    RecordedRequest,
    Rejection,
    StreamKnobs,
    StreamRecord,
    estimate_tokens,
)
from touba.testing.fakes.anthropic import (
    FakeAnthropicServer,
    anthropic_redacted_thinking,
    anthropic_text,
    anthropic_thinking,
    anthropic_tool_use,
    validate_anthropic_count_tokens_request,
    validate_anthropic_messages_request,
)
from touba.testing.fakes.gemini import (
    FakeGeminiServer,
    gemini_function_call,
    gemini_text,
    gemini_thought,
    validate_gemini_count_tokens_request,
    validate_gemini_generate_content_request,
)
from touba.testing.fakes.openai import (
    FakeOpenAIServer,
    chat_tool_call,
    openai_function_call,
    openai_reasoning,
    openai_refusal,
    openai_text,
    validate_chat_completions_request,
    validate_openai_input_tokens_request,
    validate_openai_responses_request,
)

__all__ = [
    "FakeAnthropicServer",
    "FakeGeminiServer",
    "FakeOpenAIServer",
    "FakeProviderServer",
    "IssueLedger",
    "RecordedRequest",
    "Rejection",
    "StreamKnobs",
    "StreamRecord",
    "anthropic_redacted_thinking",
    "anthropic_text",
    "anthropic_thinking",
    "anthropic_tool_use",
    "chat_tool_call",
    "estimate_tokens",
    "gemini_function_call",
    "gemini_text",
    "gemini_thought",
    "openai_function_call",
    "openai_reasoning",
    "openai_refusal",
    "openai_text",
    "validate_anthropic_count_tokens_request",
    "validate_anthropic_messages_request",
    "validate_chat_completions_request",
    "validate_gemini_count_tokens_request",
    "validate_gemini_generate_content_request",
    "validate_openai_input_tokens_request",
    "validate_openai_responses_request",
]
