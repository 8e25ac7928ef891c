"""A fake Anthropic server: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Drive it with ``anthropic.AsyncAnthropic(base_url=srv.base_url, ...)``.
Thinking signatures and redacted thinking data it issues are HMAC-signed; the
validators reject them when they come back altered. ``preserved_thinking=True``
imitates models whose signatures also bind the block's prefix (everything sent
before it): a block replayed after that prefix changed is refused.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from touba.testing.fakes._anthropic_rules import (
    REDACTED_KIND,
    THINKING_KIND,
    check_messages,
    thinking_prefix,
    validate_anthropic_count_tokens_request,
    validate_anthropic_messages_request,
)
from touba.testing.fakes._server import (
    SIGN,
    FakeProviderServer,
    JSONObject,
    Rejection,
    Reply,
    Scripted,
    StreamKnobs,
    estimate_tokens,
)
from touba.testing.fakes._sse import message_events

__all__ = [
    "FakeAnthropicServer",
    "anthropic_redacted_thinking",
    "anthropic_text",
    "anthropic_thinking",
    "anthropic_tool_use",
    "validate_anthropic_count_tokens_request",
    "validate_anthropic_messages_request",
]

_ROUTES = {"/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"}
_ERRORS = {
    400: ("invalid_request_error", "Invalid request."),
    401: ("authentication_error", "invalid x-api-key"),
    403: (
        "permission_error",
        "Your API key does not have permission to use the specified resource.",
    ),
    404: ("not_found_error", "The requested resource could not be found."),
    413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
    429: ("rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit."),
    500: ("api_error", "Internal server error"),
    529: ("overloaded_error", "Overloaded"),
}


def anthropic_text(text: str) -> JSONObject:
    """A ``text`` content block."""
    return {"type": "text", "text": text}


def anthropic_tool_use(
    name: str, input: Mapping[str, Any] | str, *, id: str | None = None
) -> JSONObject:
    """A ``tool_use`` block; ``id`` (``toolu_...``) is issued when omitted.

    ``input`` as a str is sent verbatim as the streamed ``input_json_delta``
    pieces (a cut or invalid JSON), and as that string when not streamed.
    """
    block: JSONObject = {
        "type": "tool_use",
        "name": name,
        "input": input if isinstance(input, str) else dict(input),
    }
    if id is not None:
        block["id"] = id
    return block


def anthropic_thinking(thinking: str) -> JSONObject:
    """A ``thinking`` block; the server issues its ``signature`` (signed over the text)."""
    return {"type": "thinking", "thinking": thinking, "signature": SIGN}


def anthropic_redacted_thinking() -> JSONObject:
    """A ``redacted_thinking`` block; the server issues its signed ``data``."""
    return {"type": "redacted_thinking", "data": SIGN}


@dataclass(frozen=True)
class _MessageScript:
    blocks: tuple[JSONObject, ...]
    stop_reason: str | None


class FakeAnthropicServer(FakeProviderServer):
    """Scriptable fake of api.anthropic.com Messages and token counting.

    Endpoints: ``"messages"`` (default for ``script_error``) and
    ``"count_tokens"`` (``script_count``). ``preserved_thinking=True`` binds
    each thinking signature to its prefix, as newer models do.
    """

    provider: ClassVar[str] = "anthropic"
    endpoints: ClassVar[tuple[str, ...]] = ("messages", "count_tokens")
    generation_endpoint: ClassVar[str] = "messages"
    count_endpoint: ClassVar[str] = "count_tokens"

    def __init__(self, *, preserved_thinking: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.preserved_thinking = preserved_thinking

    def script_response(
        self,
        *blocks: JSONObject,
        stop_reason: str | None = None,
        delay: float = 0.0,
        stream: StreamKnobs | None = None,
    ) -> None:
        """Queue the next Messages answer with these content blocks.

        ``stop_reason`` defaults to ``"tool_use"`` when a block is a tool use,
        else ``"end_turn"``; use ``"max_tokens"`` for truncation and
        ``"refusal"`` for a refusal. No blocks: empty content. A request with
        ``stream: true`` gets the same answer as server-sent events, under
        ``stream`` (else the server's ``stream_knobs``).
        """
        script = _MessageScript(tuple(copy.deepcopy(list(blocks))), stop_reason)
        self._enqueue("messages", Scripted("generation", script, knobs=stream), delay)

    # provider hooks ------------------------------------------------------

    def route(self, method: str, path: str) -> str | None:
        return _ROUTES.get(path.rstrip("/")) if method == "POST" else None

    def check(
        self, endpoint: str, path: str, headers: Mapping[str, str], body: JSONObject
    ) -> list[Rejection]:
        if "anthropic-version" not in headers:
            return [Rejection(400, "anthropic-version: header is required")]
        return check_messages(
            body,
            self.ledger,
            count=endpoint == "count_tokens",
            bind_prefix=self.preserved_thinking,
        )

    def render_count(self, value: int | None, body: JSONObject) -> JSONObject:
        return {} if value is None else {"input_tokens": value}

    def render_generation(self, endpoint: str, path: str, payload: Any, body: JSONObject) -> Reply:
        assert isinstance(payload, _MessageScript)
        content: list[JSONObject] = []
        for block in payload.blocks:
            content.append(self._issue(block, body, content))
        has_tool_use = any(block.get("type") == "tool_use" for block in content)
        stop_reason = payload.stop_reason or ("tool_use" if has_tool_use else "end_turn")
        message: JSONObject = {
            "id": self.new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": estimate_tokens(body),
                "output_tokens": estimate_tokens({"content": content}),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        if stop_reason == "refusal":
            message["stop_details"] = {"type": "refusal", "category": None, "explanation": None}
        return Reply(200, message, {"request-id": self.new_id("req_")})

    def error_body(self, rejection: Rejection) -> JSONObject:
        default = "api_error" if rejection.status >= 500 else "invalid_request_error"
        kind = _ERRORS.get(rejection.status, (default, ""))[0]
        return {
            "type": "error",
            "error": {"type": kind, "message": rejection.message},
            "request_id": self.new_id("req_"),
        }

    def default_error_message(self, status: int) -> str:
        fallback = _ERRORS[500 if status >= 500 else 400]
        return _ERRORS.get(status, fallback)[1]

    def error_headers(self) -> dict[str, str]:
        return {"request-id": self.new_id("req_")}

    def stream_events(
        self, endpoint: str, answer: object, body: JSONObject
    ) -> list[tuple[str | None, object]]:
        assert isinstance(answer, dict)
        return message_events(answer)

    def stream_failure(self, endpoint: str, failure: str | None) -> tuple[str | None, object]:
        """An ``error`` event; ``failure`` is its error type (default ``overloaded_error``)."""
        kind = failure or "overloaded_error"
        message = next((m for k, m in _ERRORS.values() if k == kind), "Internal server error")
        return "error", {"type": "error", "error": {"type": kind, "message": message}}

    # rendering -----------------------------------------------------------

    def _issue(self, raw: JSONObject, body: JSONObject, before: list[JSONObject]) -> JSONObject:
        block = copy.deepcopy(raw)
        kind = block.get("type")
        prefix = None
        if self.preserved_thinking and kind in ("thinking", "redacted_thinking"):
            messages = body.get("messages")
            prefix = thinking_prefix(body, messages if isinstance(messages, list) else [], before)
        if kind == "tool_use":
            block.setdefault("id", self.new_id("toolu_"))
        elif kind == "thinking" and block.get("signature") == SIGN:
            block["signature"] = self._token(THINKING_KIND, str(block.get("thinking", "")), prefix)
        elif kind == "redacted_thinking" and block.get("data") == SIGN:
            block["data"] = self._token(REDACTED_KIND, "", prefix)
        return block

    def _token(self, kind: str, payload: str, prefix: str | None) -> str:
        token = self.ledger.sign(kind, payload)
        if prefix is not None:
            token += self.ledger.sign(kind, payload + "\x00" + prefix)
        return base64.b64encode(token).decode()
