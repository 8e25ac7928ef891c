"""What a provider reports while a decision streams: typed deltas to a sink.

``DecisionProvider.decide(request, sink=...)`` sends the generation as a
stream (each vendor's own streaming request, through its SDK) and awaits
``sink(delta)`` for every delta, in order, while it assembles the decision:

- :class:`StreamedText`: a piece of the model's visible reply (native
  interface without ``output_schema`` only: structured decisions and
  structured final outputs are JSON, delivered whole in the decision);
- :class:`StreamedCall`: the model started writing a call (its arguments are
  known only once the decision is complete and checked);
- :class:`StreamedDecision`: the decision, complete, checked and saved in the
  history; the last delta, sent just before ``decide`` returns it.

The sink is awaited: a slow consumer slows the producer down, nothing is
buffered without bound. The decision is the one the non-streaming request
would have produced (the same records, the same trace). A stream that breaks
midway is ``AgentDecisionProviderUnavailable`` and one that ends without a
complete decision ``AgentDecisionProviderSchemaViolation``; either way nothing
of it is stored. Cancelling ``decide`` closes the vendor's HTTP response.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from touba.errors import AgentDecisionProviderSchemaViolation
from touba.providers._types import Decision

__all__ = [
    "DecisionDelta",
    "DeltaSink",
    "StreamedCall",
    "StreamedDecision",
    "StreamedText",
    "ignore_event",
    "incomplete_stream",
]

log = logging.getLogger("touba.providers.stream")


@dataclass(frozen=True, slots=True)
class StreamedText:
    """A piece of the model's visible reply, as it is written."""

    text: str


@dataclass(frozen=True, slots=True)
class StreamedCall:
    """The model started writing a call to ``name``.

    ``call_id`` is None when the vendor names the call only once the decision
    is complete (Gemini without call ids, a server that sends none).
    ``index`` counts the decision's calls from 0.
    """

    index: int
    name: str
    call_id: str | None = None


@dataclass(frozen=True, slots=True)
class StreamedDecision:
    """The decision the stream produced, checked and saved; the last delta."""

    decision: Decision


DecisionDelta = StreamedText | StreamedCall | StreamedDecision
DeltaSink = Callable[[DecisionDelta], Awaitable[None]]
"""Where ``decide(request, sink=...)`` sends deltas: an async callable, awaited for each."""


def ignore_event(provider: str, kind: object) -> None:
    """An event of a type this version does not know (a newer API): ignored, at DEBUG.

    Only the type's name is logged (clipped), never the event's content.
    """
    if log.isEnabledFor(logging.DEBUG):
        name = kind[:64] if isinstance(kind, str) else type(kind).__name__
        log.debug("%s stream: ignored an event of unknown type %r", provider, name)


def incomplete_stream(provider: str, hint: str = "") -> AgentDecisionProviderSchemaViolation:
    """The stream ended (cleanly) before the vendor's final event; ``hint`` says
    what commonly causes it with this provider."""
    return AgentDecisionProviderSchemaViolation(
        f"the {provider} stream ended before the decision was complete; nothing was "
        f"stored{'; ' + hint if hint else ''}",
        provider_error_code="incomplete_stream",
    )
