"""OpenTelemetry spans, when ``opentelemetry-api`` is installed; nothing otherwise.

touba depends only on the API (``pip install "touba[otel]"``): the host
installs an SDK and exporter and sets the tracer provider, and every span
below goes there; without a provider no span is started (the API's no-op
tracer would record nothing: a decision does not pay for it), and without the
package nothing is imported or recorded. Spans follow the
OpenTelemetry GenAI semantic conventions where they apply:

- ``invoke_agent {agent}`` (INTERNAL) per invocation or resume, delegates
  included: ``gen_ai.operation.name="invoke_agent"``, ``gen_ai.agent.name``,
  ``gen_ai.conversation.id`` (the run id), ``touba.invocation_id``,
  ``touba.status``, ``touba.error_code``; span events ``touba.denial``
  (``touba.call_id``, ``gen_ai.tool.name``, ``touba.reason``) and
  ``touba.approval_requested``.
- ``chat {model}`` (CLIENT) per decision: ``gen_ai.operation.name="chat"``,
  ``gen_ai.provider.name``, ``gen_ai.request.model``,
  ``gen_ai.usage.input_tokens`` / ``output_tokens``, ``touba.session_key``,
  the window sent (``touba.window.messages``, ``touba.window.bytes``),
  ``touba.trimmed.exchanges`` / ``messages`` / ``bytes``, the guard
  (``touba.guard.counts``, ``touba.guard.count``, ``touba.guard.reserve``,
  ``touba.guard.window``, ``touba.guard.fits``), ``touba.summary.*``, and on a
  refusal ``error.type`` = the touba error code (with ``touba.limit``).
- ``count_tokens {model}`` (CLIENT) per count request of the context guard.
- ``execute_tool {name}`` (INTERNAL) per capability call:
  ``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ``touba.call.status``.
- ``touba.history.transaction`` per decision-history transaction (reserve,
  the decision, save), ``touba.history.summary`` per summary.

No message content, arguments or results are recorded unless the host sets
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`` (the GenAI
instrumentations' own switch): then a tool span also carries
``gen_ai.tool.call.arguments`` and ``gen_ai.tool.call.result`` as JSON. Keys,
headers and instructions are never recorded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

_trace: Any  # the opentelemetry.trace module, or None
try:
    from opentelemetry import trace as _api
except ImportError:  # the extra is optional: no spans at all
    _trace = None
else:
    _trace = _api

__all__ = [
    "PROVIDER_NAMES",
    "add_event",
    "capture_content",
    "current_event",
    "history_event",
    "set_attributes",
    "span",
]

Kind = Literal["internal", "client"]
PROVIDER_NAMES: Mapping[str, str] = {
    "openai": "openai",
    "anthropic": "anthropic",
    "gemini": "gcp.gemini",
}
"""touba provider names -> ``gen_ai.provider.name`` (others are passed as they are)."""

_decision: ContextVar[tuple[Any, list[int]] | None] = ContextVar(
    "touba_decision_span", default=None
)
Attribute = str | bool | int | float


def capture_content() -> bool:
    """Whether the host opted in to arguments and results on spans."""
    value = os.environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "")
    return value.strip().lower() == "true"


def _clean(attributes: Mapping[str, object]) -> dict[str, Attribute]:
    return {k: v for k, v in attributes.items() if isinstance(v, str | bool | int | float)}


@contextmanager
def span(
    name: str,
    attributes: Mapping[str, object] | None = None,
    *,
    kind: Kind = "internal",
    decision: bool = False,
) -> Iterator[Any]:
    """A span named ``name`` around the block, current inside it (None without the API).

    An exception leaving the block marks the span as an error with
    ``error.type`` = the touba error code or the exception's class name; the
    exception itself is not recorded (its message may hold content).
    ``decision=True`` makes it the span that history events annotate.
    Without a tracer provider there is no span either: the API's no-op tracer
    would only make the current span's context current again, so the block
    runs as it is (checked at every call: a provider set later is used).
    """
    if _trace is None or isinstance(_trace.get_tracer_provider(), _trace.ProxyTracerProvider):
        yield None
        return
    tracer = _trace.get_tracer("touba")
    span_kind = _trace.SpanKind.CLIENT if kind == "client" else _trace.SpanKind.INTERNAL
    with tracer.start_as_current_span(
        name,
        kind=span_kind,
        attributes=_clean(attributes or {}),
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        token = _decision.set((current, [0])) if decision else None
        try:
            yield current
        except BaseException as e:
            code = getattr(e, "code", None)
            current.set_attribute("error.type", code if isinstance(code, str) else type(e).__name__)
            limit = getattr(e, "limit", None)
            if isinstance(limit, str):
                current.set_attribute("touba.limit", limit)
            current.set_status(_trace.Status(_trace.StatusCode.ERROR))
            raise
        finally:
            if token is not None:
                _decision.reset(token)


def set_attributes(target: Any, attributes: Mapping[str, object]) -> None:
    """Set attributes on ``target`` (a span from :func:`span`, or None: nothing)."""
    if target is not None:
        target.set_attributes(_clean(attributes))


def add_event(target: Any, name: str, attributes: Mapping[str, object]) -> None:
    if target is not None:
        target.add_event(name, _clean(attributes))


def current_event(name: str, attributes: Mapping[str, object]) -> None:
    """Add an event to the current span (the invocation's, where the runtime calls it)."""
    if _trace is not None:
        _trace.get_current_span().add_event(name, _clean(attributes))


def history_event(event: Any) -> None:
    """Put a :class:`~touba.HistoryEvent`'s sizes and verdicts on the decision span."""
    current = _decision.get()
    if current is None:
        return
    target, counts = current
    kind = event.kind
    if kind == "history_window":
        set_attributes(
            target,
            {
                "touba.session_key": event.session_key,
                "touba.window.messages": event.message_count,
                "touba.window.bytes": event.bytes,
            },
        )
    elif kind == "history_trimmed":
        set_attributes(
            target,
            {
                "touba.trimmed.exchanges": event.removed_exchanges,
                "touba.trimmed.messages": event.removed_messages,
                "touba.trimmed.bytes": event.removed_bytes,
            },
        )
    elif kind == "provider_context_count":
        counts[0] += 1
        set_attributes(
            target,
            {
                "touba.guard.counts": counts[0],
                "touba.guard.count": event.count,
                "touba.guard.reserve": event.reserve,
                "touba.guard.window": event.window,
                "touba.guard.fits": event.fits,
            },
        )
    elif kind == "decision_history_summary":
        set_attributes(
            target,
            {
                "touba.summary.covered_exchanges": event.covered_exchanges,
                "touba.summary.bytes": event.summary_bytes,
            },
        )
    elif kind == "resumed_without_messages":
        set_attributes(target, {"touba.resumed_without_messages": True})
    elif kind == "history_store_pressure":
        add_event(
            target,
            "touba.history_store_pressure",
            {
                "touba.used_sessions": event.used_sessions,
                "touba.max_sessions": event.max_sessions,
                "touba.used_bytes": event.used_bytes,
                "touba.max_store_bytes": event.max_store_bytes,
            },
        )
