"""A fake Gemini Developer API: ``models/{model}:generateContent`` and ``:countTokens``.

Drive it with ``genai.Client(api_key=..., http_options=types.HttpOptions(
base_url=srv.base_url))``; paths under ``/v1/``, ``/v1beta/`` and ``/v1alpha/``
are served (google-genai 3.x defaults to ``v1``). Thought signatures it issues
are HMAC-signed over the part they ride on.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from touba.testing.fakes._gemini_rules import (
    PART_KIND,
    check_count_tokens,
    check_generate_content,
    part_fingerprint,
    validate_gemini_count_tokens_request,
    validate_gemini_generate_content_request,
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
from touba.testing.fakes._sse import gemini_events, joined_gemini_parts

__all__ = [
    "FakeGeminiServer",
    "gemini_function_call",
    "gemini_text",
    "gemini_thought",
    "validate_gemini_count_tokens_request",
    "validate_gemini_generate_content_request",
]

_PATH = re.compile(r"^/(?:v1|v1beta|v1alpha)/models/(?P<model>[^/:]+):(?P<method>[A-Za-z]+)$")
_METHODS = {
    "generateContent": "generate_content",
    "streamGenerateContent": "generate_content",
    "countTokens": "count_tokens",
}
_ERRORS = {
    400: ("INVALID_ARGUMENT", "Request contains an invalid argument."),
    401: ("UNAUTHENTICATED", "API key not valid. Please pass a valid API key."),
    403: ("PERMISSION_DENIED", "The caller does not have permission"),
    404: ("NOT_FOUND", "models/unknown is not found for API version v1beta."),
    429: ("RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota)."),
    500: (
        "INTERNAL",
        "An internal error has occurred. Please retry or report in "
        "https://developers.generativeai.google/guide/troubleshooting",
    ),
    503: ("UNAVAILABLE", "The model is overloaded. Please try again later."),
    504: ("DEADLINE_EXCEEDED", "Deadline expired before operation could complete."),
}


def gemini_text(text: str, *, signed: bool = False) -> JSONObject:
    """A text part; ``signed`` has the server issue a ``thoughtSignature`` on it."""
    part: JSONObject = {"text": text}
    if signed:
        part["thoughtSignature"] = SIGN
    return part


def gemini_thought(text: str, *, signed: bool = True) -> JSONObject:
    """A thought summary part (``thought: true``), signed by default."""
    part: JSONObject = {"text": text, "thought": True}
    if signed:
        part["thoughtSignature"] = SIGN
    return part


def gemini_function_call(
    name: str,
    args: Mapping[str, Any] | None = None,
    *,
    id: str | None = None,
    signed: bool = True,
) -> JSONObject:
    """A ``functionCall`` part, signed by default (Gemini signs the first call of a step)."""
    call: JSONObject = {"name": name, "args": dict(args or {})}
    if id is not None:
        call["id"] = id
    part: JSONObject = {"functionCall": call}
    if signed:
        part["thoughtSignature"] = SIGN
    return part


@dataclass(frozen=True)
class _ContentScript:
    parts: tuple[JSONObject, ...]
    finish_reason: str
    block_reason: str | None


class FakeGeminiServer(FakeProviderServer):
    """Scriptable fake of generativelanguage.googleapis.com (generateContent, countTokens).

    Endpoints: ``"generate_content"`` (default for ``script_error``) and
    ``"count_tokens"`` (``script_count``).
    """

    provider: ClassVar[str] = "gemini"
    endpoints: ClassVar[tuple[str, ...]] = ("generate_content", "count_tokens")
    generation_endpoint: ClassVar[str] = "generate_content"
    count_endpoint: ClassVar[str] = "count_tokens"

    def script_response(
        self,
        *parts: JSONObject,
        finish_reason: str = "STOP",
        block_reason: str | None = None,
        delay: float = 0.0,
        stream: StreamKnobs | None = None,
    ) -> None:
        """Queue the next generateContent answer with these parts.

        ``finish_reason="MAX_TOKENS"`` for truncation, ``"SAFETY"`` (no parts)
        for a refused answer; ``block_reason="SAFETY"`` blocks the prompt (no
        candidates). No parts: a candidate without parts. A
        ``streamGenerateContent`` request gets the same answer as ``alt=sse``
        chunks, under ``stream`` (else the server's ``stream_knobs``).
        """
        script = _ContentScript(tuple(copy.deepcopy(list(parts))), finish_reason, block_reason)
        self._enqueue("generate_content", Scripted("generation", script, knobs=stream), delay)

    # provider hooks ------------------------------------------------------

    def route(self, method: str, path: str) -> str | None:
        match = _PATH.match(path)
        if method != "POST" or match is None:
            return None
        return _METHODS.get(match["method"])

    def check(
        self, endpoint: str, path: str, headers: Mapping[str, str], body: JSONObject
    ) -> list[Rejection]:
        if endpoint == "count_tokens":
            return check_count_tokens(body, self.ledger)
        return check_generate_content(body, self.ledger)

    def render_count(self, value: int | None, body: JSONObject) -> JSONObject:
        if value is None:
            return {}
        return {
            "totalTokens": value,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": value}],
        }

    def render_generation(self, endpoint: str, path: str, payload: Any, body: JSONObject) -> Reply:
        assert isinstance(payload, _ContentScript)
        match = _PATH.match(path)
        model = match["model"] if match else "unknown"
        prompt_tokens = estimate_tokens(body)
        usage: JSONObject = {"promptTokenCount": prompt_tokens, "totalTokenCount": prompt_tokens}
        answer: JSONObject = {"modelVersion": model, "responseId": self.new_id("")[:22]}
        if payload.block_reason is not None:
            answer["promptFeedback"] = {"blockReason": payload.block_reason}
            return Reply(200, {**answer, "usageMetadata": usage})
        scripted = list(payload.parts)
        if match is not None and match["method"] == "streamGenerateContent":
            # signed as a streaming client will assemble them (see joined_gemini_parts)
            scripted = joined_gemini_parts(scripted)
        parts = self._issue(tuple(scripted))
        candidate: JSONObject = {"finishReason": payload.finish_reason, "index": 0}
        if parts or payload.finish_reason != "SAFETY":
            candidate["content"] = {"role": "model", **({"parts": parts} if parts else {})}
        output_tokens = estimate_tokens({"parts": parts}) if parts else 0
        thought_tokens = sum(estimate_tokens(p) for p in parts if p.get("thought"))
        usage.update(
            candidatesTokenCount=output_tokens - thought_tokens,
            totalTokenCount=prompt_tokens + output_tokens,
        )
        if thought_tokens:
            usage["thoughtsTokenCount"] = thought_tokens
        return Reply(200, {"candidates": [candidate], "usageMetadata": usage, **answer})

    def error_body(self, rejection: Rejection) -> JSONObject:
        fallback = _ERRORS[500 if rejection.status >= 500 else 400]
        status = _ERRORS.get(rejection.status, fallback)[0]
        return {"error": {"code": rejection.status, "message": rejection.message, "status": status}}

    def default_error_message(self, status: int) -> str:
        fallback = _ERRORS[500 if status >= 500 else 400]
        return _ERRORS.get(status, fallback)[1]

    def wants_stream(self, endpoint: str, path: str, body: JSONObject) -> bool:
        """``:streamGenerateContent`` (the fake answers it as ``alt=sse``)."""
        match = _PATH.match(path)
        return match is not None and match["method"] == "streamGenerateContent"

    def stream_events(
        self, endpoint: str, answer: object, body: JSONObject
    ) -> list[tuple[str | None, object]]:
        assert isinstance(answer, dict)
        return gemini_events(answer)

    def stream_failure(self, endpoint: str, failure: str | None) -> tuple[str | None, object]:
        """An ``{"error": ...}`` chunk (503 UNAVAILABLE)."""
        return None, self.error_body(Rejection(503, _ERRORS[503][1]))

    def sse_frame(self, name: str | None, data: object) -> bytes:
        """``data: <json>`` and a blank line, CRLF-terminated as the API writes them."""
        return f"data: {json.dumps(data)}\r\n\r\n".encode()

    # rendering -----------------------------------------------------------

    def _issue(self, raw_parts: tuple[JSONObject, ...]) -> list[JSONObject]:
        parts = [copy.deepcopy(part) for part in raw_parts]
        for part in parts:
            fingerprint = part_fingerprint(part)
            if part.get("thoughtSignature") == SIGN:
                token = self.ledger.sign(PART_KIND, fingerprint)
                part["thoughtSignature"] = base64.b64encode(token).decode()
                if self.ledger.recall("signed_part", fingerprint) is None:
                    self.ledger.remember("signed_part", fingerprint, "signed")
            elif "functionCall" in part and "thoughtSignature" not in part:
                self.ledger.remember("signed_part", fingerprint, "unsigned")
        return parts
