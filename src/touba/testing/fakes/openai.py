"""A fake OpenAI server: Responses API, its input-token count, and Chat Completions.

Routes ``POST /v1/responses``, ``POST /v1/responses/input_tokens`` and
``POST /v1/chat/completions`` (the OpenAI-compatible servers: Ollama, vLLM).
Drive it with ``openai.AsyncOpenAI(base_url=srv.base_url + "/v1", ...)``.
"""

from __future__ import annotations

import base64
import copy
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from touba.testing.fakes._openai_rules import (
    ENCRYPTED_PREFIX,
    REASONING_KIND,
    check_chat_completions,
    check_responses,
    validate_chat_completions_request,
    validate_openai_input_tokens_request,
    validate_openai_responses_request,
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
from touba.testing.fakes._sse import chat_events, response_events

__all__ = [
    "FakeOpenAIServer",
    "chat_tool_call",
    "openai_function_call",
    "openai_reasoning",
    "openai_refusal",
    "openai_text",
    "validate_chat_completions_request",
    "validate_openai_input_tokens_request",
    "validate_openai_responses_request",
]

_ROUTES = {
    "/v1/responses": "responses",
    "/v1/responses/input_tokens": "input_tokens",
    "/v1/chat/completions": "chat_completions",
}
_ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "unsupported_country_region_territory"),
    404: ("invalid_request_error", None),
    429: ("tokens", "rate_limit_exceeded"),
}
_ERROR_MESSAGES = {
    400: "Invalid request.",
    401: "Incorrect API key provided: test. You can find your API key at "
    "https://platform.openai.com/account/api-keys.",
    403: "Country, region, or territory not supported",
    404: "The model `unknown` does not exist or you do not have access to it.",
    429: "Rate limit reached for requests. Please try again in 1s.",
    500: "The server had an error while processing your request. Sorry about that!",
    503: "The engine is currently overloaded, please try again later",
}


def _arguments(arguments: Mapping[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(dict(arguments))


def openai_text(text: str, *, id: str | None = None) -> JSONObject:
    """An assistant ``message`` output item with one ``output_text`` part."""
    item: JSONObject = {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }
    if id is not None:
        item["id"] = id
    return item


def openai_refusal(refusal: str, *, id: str | None = None) -> JSONObject:
    """An assistant ``message`` output item carrying a ``refusal`` part."""
    item: JSONObject = {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "refusal", "refusal": refusal}],
    }
    if id is not None:
        item["id"] = id
    return item


def openai_function_call(
    name: str,
    arguments: Mapping[str, Any] | str,
    *,
    call_id: str | None = None,
    id: str | None = None,
) -> JSONObject:
    """A ``function_call`` output item; ``call_id``/``id`` are issued when omitted."""
    item: JSONObject = {
        "type": "function_call",
        "name": name,
        "arguments": _arguments(arguments),
        "status": "completed",
    }
    if call_id is not None:
        item["call_id"] = call_id
    if id is not None:
        item["id"] = id
    return item


def openai_reasoning(*summary: str, id: str | None = None, encrypted: bool = True) -> JSONObject:
    """A ``reasoning`` item with these summary texts.

    With ``encrypted`` the server issues a signed ``encrypted_content``, sent
    only when the request asks ``include=["reasoning.encrypted_content"]``.
    """
    item: JSONObject = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text} for text in summary],
    }
    if encrypted:
        item["encrypted_content"] = SIGN
    if id is not None:
        item["id"] = id
    return item


def chat_tool_call(
    name: str, arguments: Mapping[str, Any] | str, *, id: str | None = None
) -> JSONObject:
    """A Chat Completions ``tool_calls`` entry; ``id`` is issued when omitted."""
    call: JSONObject = {
        "type": "function",
        "function": {"name": name, "arguments": _arguments(arguments)},
    }
    if id is not None:
        call["id"] = id
    return call


@dataclass(frozen=True)
class _ResponseScript:
    items: tuple[JSONObject, ...]
    incomplete_reason: str | None


@dataclass(frozen=True)
class _ChatScript:
    content: str | None
    tool_calls: tuple[JSONObject, ...]
    refusal: str | None
    finish_reason: str | None
    extra: JSONObject


class FakeOpenAIServer(FakeProviderServer):
    """Scriptable fake of api.openai.com (Responses, input-token count, Chat Completions).

    Endpoints: ``"responses"`` (default for ``script_error``), ``"input_tokens"``
    (``script_count``) and ``"chat_completions"``.
    """

    provider: ClassVar[str] = "openai"
    endpoints: ClassVar[tuple[str, ...]] = ("responses", "input_tokens", "chat_completions")
    generation_endpoint: ClassVar[str] = "responses"
    count_endpoint: ClassVar[str] = "input_tokens"

    def script_response(
        self,
        *items: JSONObject,
        incomplete_reason: str | None = None,
        delay: float = 0.0,
        stream: StreamKnobs | None = None,
    ) -> None:
        """Queue the next Responses API answer with these output items.

        No items: an empty output. ``incomplete_reason`` (e.g.
        ``"max_output_tokens"``) answers ``status: "incomplete"`` with
        ``incomplete_details``. A request with ``stream: true`` gets the same
        answer as server-sent events, sent under ``stream`` (else the server's
        ``stream_knobs``).
        """
        script = _ResponseScript(tuple(copy.deepcopy(list(items))), incomplete_reason)
        self._enqueue("responses", Scripted("generation", script, knobs=stream), delay)

    def script_chat_completion(
        self,
        content: str | None = None,
        *,
        tool_calls: Sequence[JSONObject] = (),
        refusal: str | None = None,
        finish_reason: str | None = None,
        delay: float = 0.0,
        stream: StreamKnobs | None = None,
        extra: JSONObject | None = None,
    ) -> None:
        """Queue the next Chat Completions answer (``finish_reason`` defaults to
        ``"tool_calls"`` or ``"stop"``; use ``"length"`` for truncation).

        ``extra``: more fields of the assistant message (a server's
        ``reasoning_content``...). A streaming request gets the same answer as
        chunks, under ``stream`` (else the server's ``stream_knobs``).
        """
        script = _ChatScript(
            content,
            tuple(copy.deepcopy(list(tool_calls))),
            refusal,
            finish_reason,
            copy.deepcopy(dict(extra or {})),
        )
        self._enqueue("chat_completions", Scripted("generation", script, knobs=stream), delay)

    # provider hooks ------------------------------------------------------

    def route(self, method: str, path: str) -> str | None:
        return _ROUTES.get(path.rstrip("/")) if method == "POST" else None

    def check(
        self, endpoint: str, path: str, headers: Mapping[str, str], body: JSONObject
    ) -> list[Rejection]:
        if endpoint == "chat_completions":
            return check_chat_completions(body)
        return check_responses(body, self.ledger, count=endpoint == "input_tokens")

    def render_count(self, value: int | None, body: JSONObject) -> JSONObject:
        answer: JSONObject = {"object": "response.input_tokens"}
        if value is not None:
            answer["input_tokens"] = value
        return answer

    def render_generation(self, endpoint: str, path: str, payload: Any, body: JSONObject) -> Reply:
        if isinstance(payload, _ChatScript):
            return Reply(200, self._chat_completion(payload, body))
        assert isinstance(payload, _ResponseScript)
        return Reply(200, self._response(payload, body))

    def error_body(self, rejection: Rejection) -> JSONObject:
        kind, default_code = _ERROR_TYPES.get(rejection.status, ("server_error", None))
        return {
            "error": {
                "message": rejection.message,
                "type": kind,
                "param": rejection.param,
                "code": rejection.code if rejection.code is not None else default_code,
            }
        }

    def default_error_message(self, status: int) -> str:
        return _ERROR_MESSAGES.get(status, _ERROR_MESSAGES[500 if status >= 500 else 400])

    def error_headers(self) -> dict[str, str]:
        return {"x-request-id": self.new_id("req_")}

    def stream_events(
        self, endpoint: str, answer: object, body: JSONObject
    ) -> list[tuple[str | None, object]]:
        assert isinstance(answer, dict)
        if endpoint == "chat_completions":
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            return chat_events(answer, include_usage=usage)
        return response_events(answer)

    def stream_failure(self, endpoint: str, failure: str | None) -> tuple[str | None, object]:
        """Chat Completions: an ``{"error": ...}`` chunk; Responses: an ``error`` event, or
        ``response.failed`` (``failure="response.failed"``)."""
        error = {"message": _ERROR_MESSAGES[500], "type": "server_error", "code": "server_error"}
        if endpoint == "chat_completions":
            return None, {"error": {**error, "param": None}}
        if failure == "response.failed":
            response = {"object": "response", "status": "failed", "output": [], "error": error}
            return failure, {"type": failure, "response": response, "sequence_number": 0}
        fields = {"code": error["code"], "message": error["message"], "param": None}
        return "error", {"type": "error", **fields, "sequence_number": 0}

    def sse_trailer(self, endpoint: str) -> bytes:
        return b"data: [DONE]\n\n" if endpoint == "chat_completions" else b""

    # rendering -----------------------------------------------------------

    def _issue_output(self, script: _ResponseScript, body: JSONObject) -> list[JSONObject]:
        include = body.get("include") or []
        want_encrypted = "reasoning.encrypted_content" in include
        store = body.get("store", True) is not False
        output: list[JSONObject] = []
        reasoning_id: str | None = None
        follower_pending = False
        for raw in script.items:
            item = copy.deepcopy(raw)
            kind = item.get("type")
            if kind == "reasoning":
                item.setdefault("id", self.new_id("rs_"))
                encrypted = item.pop("encrypted_content", None)
                if want_encrypted and encrypted is not None:
                    item["encrypted_content"] = self._encrypt(item["id"], encrypted)
                reasoning_id, follower_pending = item["id"], True
            else:
                item.setdefault("id", self.new_id("fc_" if kind == "function_call" else "msg_"))
                if kind == "function_call":
                    item.setdefault("call_id", self.new_id("call_"))
                if reasoning_id is not None:
                    self.ledger.remember("requires_reasoning", item["id"], reasoning_id)
                    if follower_pending:
                        self.ledger.remember("follower", reasoning_id, item["id"])
                        follower_pending = False
            if store:
                self.ledger.remember("stored", item["id"])
            output.append(item)
        if script.incomplete_reason is not None:
            for item in output:
                if item.get("type") == "message":
                    item["status"] = "incomplete"
        return output

    def _encrypt(self, item_id: str, value: str) -> str:
        if value != SIGN:
            return value
        token = self.ledger.sign(REASONING_KIND, item_id)
        return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(token).decode()

    def _response(self, script: _ResponseScript, body: JSONObject) -> JSONObject:
        output = self._issue_output(script, body)
        input_tokens = estimate_tokens(body)
        output_tokens = estimate_tokens({"output": output})
        reasoning_tokens = sum(
            estimate_tokens(item) for item in output if item.get("type") == "reasoning"
        )
        incomplete = script.incomplete_reason
        now = int(time.time())
        return {
            "id": self.new_id("resp_"),
            "object": "response",
            "created_at": now,
            "completed_at": None if incomplete else now,
            "status": "incomplete" if incomplete else "completed",
            "background": False,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "model": body.get("model"),
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "truncation": body.get("truncation", "disabled"),
            "usage": {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": input_tokens + output_tokens,
            },
            "user": None,
        }

    def _chat_completion(self, script: _ChatScript, body: JSONObject) -> JSONObject:
        calls = [copy.deepcopy(call) for call in script.tool_calls]
        for call in calls:
            call.setdefault("id", self.new_id("call_"))
        message: JSONObject = {
            "role": "assistant",
            "content": script.content,
            "refusal": script.refusal,
            "annotations": [],
            **script.extra,
        }
        if calls:
            message["tool_calls"] = calls
        finish = script.finish_reason or ("tool_calls" if calls else "stop")
        prompt_tokens = estimate_tokens(body)
        completion_tokens = estimate_tokens(message)
        return {
            "id": self.new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "system_fingerprint": None,
        }
