"""What a vendor's or server's error answer said, and whether a retry can help.

Every provider turns an HTTP error answer into
:class:`~touba.errors.AgentDecisionProviderUnavailable` (or, for a count of
the context guard, :class:`~touba.errors.ProviderContextCountUnavailable`)
with two facts taken from the answer:

* **The server's message** (``server_message``): the body's ``message`` as
  each SDK hands the body (OpenAI's and most compatible servers'
  ``{"error": {"message": ...}}``, Anthropic's ``{"type": "error", "error":
  {...}}``, Gemini's ``{"error": {"message": ...}}``, Ollama's
  ``{"error": "..."}``, FastAPI's ``{"detail": ...}``, whose validation errors
  are given as ``field.path: reason`` without the values sent, or a plain
  text body). The error class bounds it; touba never logs it or writes it to
  trace events.
* **Whether a retry can help** (``retryable``): yes when no answer came, for
  HTTP 408, 409 and 429 (the SDKs' own retry rules) and for a 5xx server
  failure; no for any other 4xx, nor for a 5xx whose message is a request
  validation or chat template error. llama-cpp-python's server answers both
  of those as HTTP 500 (a pydantic-style list of ``loc``/``msg`` errors; the
  Jinja message, such as ``'dict object' has no attribute 'content'``, or a
  bare ``'content'`` for a missing key), and the same request fails the same
  way every time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["body_message", "retry_can_help"]

_RETRIED_4XX = frozenset({408, 409, 429})
"""Client-side statuses the vendors' SDKs retry: a timeout, a conflict, a rate limit."""

_REQUEST_PROBLEM = re.compile(
    r"validation error|input should be|field required|extra inputs are not permitted"
    r"|'loc':|\"loc\":|value error,|invalid_request|invalid request|unprocessable"
    r"|jinja|template|has no attribute|is undefined|undefinederror|raise_exception"
    r"|roles must alternate",
    re.IGNORECASE,
)
"""A 5xx message that names a problem of the request itself (validation, chat template)."""

_MISSING_KEY = re.compile(r"\A'[\w.-]{1,64}'\Z")
"""A server's ``str(KeyError)`` (``'content'``): the request lacks a field it reads."""

_NOT_RETRIED_KINDS = frozenset(
    {"invalid_request_error", "invalid_request", "invalid_prompt", "INVALID_ARGUMENT"}
)
"""Error types that mean the request itself is wrong, even under a 5xx status."""


def _validation_items(detail: list[object]) -> str | None:
    """FastAPI/pydantic validation errors as ``loc: msg`` (never the ``input`` sent)."""
    parts: list[str] = []
    for item in detail:
        if not isinstance(item, Mapping) or not isinstance(item.get("msg"), str):
            continue
        loc = item.get("loc")
        where = ".".join(str(p) for p in loc) if isinstance(loc, list | tuple) else ""
        parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "; ".join(parts) or None


def body_message(body: object, _depth: int = 0) -> str | None:
    """The human-readable message of an error body as an SDK decoded it (see the
    module notes), or None when it holds none. Not bounded: the error class is."""
    if isinstance(body, str):
        return body.strip() or None
    if not isinstance(body, Mapping) or _depth > 3:
        return None
    for key in ("message", "detail", "error"):
        value = body.get(key)
        if isinstance(value, list):
            found = _validation_items(value)
        elif isinstance(value, Mapping):
            found = body_message(value, _depth + 1)
        elif isinstance(value, str) and value.strip():
            found = value.strip()
        else:
            found = None
        if found is not None:
            return found
    return None


def retry_can_help(status: int | None, message: str | None, kind: object = None) -> bool:
    """Whether the same request may succeed later, given the HTTP ``status`` (None: no
    answer), the server's ``message`` and the error ``kind`` (type or status name) it gave."""
    if status is None:
        return True
    if 400 <= status < 500:
        return status in _RETRIED_4XX
    if status < 500:
        return True
    if isinstance(kind, str) and kind in _NOT_RETRIED_KINDS:
        return False
    text = (message or "").strip()
    return not (_REQUEST_PROBLEM.search(text) or _MISSING_KEY.match(text))
