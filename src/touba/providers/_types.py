"""The provider-neutral request and decision types (SPEC section 2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from touba.history._model import JSON, CapabilityCall, Observation

__all__ = [
    "CapabilityCall",
    "CapabilitySpec",
    "Decision",
    "DecisionInterface",
    "DecisionRequest",
    "Observation",
    "TraceCall",
    "Turn",
    "Usage",
]

DecisionInterface = Literal["native", "structured"]


@dataclass(frozen=True, slots=True)
class CapabilitySpec:
    """A capability offered to the model: ``parameters`` is a JSON Schema object."""

    name: str
    description: str
    parameters: Mapping[str, JSON]


@dataclass(frozen=True, slots=True)
class TraceCall:
    """One executed call of an earlier chat turn, with what it returned."""

    call_id: str
    name: str
    arguments: Mapping[str, JSON]
    status: Literal["ok", "error", "denied"]
    result: JSON = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    """An earlier chat turn sent before the new message (SPEC section 8).

    ``replies`` are the agent's texts. ``trace`` is empty for a text-only turn;
    otherwise it holds the turn's calls grouped by the decision that made
    them, and is rendered as native call/result pairs.
    """

    user: str
    replies: tuple[str, ...] = ()
    trace: tuple[tuple[TraceCall, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage the provider reported for one generation (None when unknown)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    details: Mapping[str, JSON] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    """A typed model decision: calls to make, or a final output."""

    calls: tuple[CapabilityCall, ...] = ()
    output: JSON = None
    text: str | None = None
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecisionRequest:
    """Everything a provider needs for one decision.

    ``instructions``, the capability catalog and ``input`` are sent on every
    decision and never trimmed; ``observations`` answer the calls of the
    previous decision; ``prior_turns`` are earlier chat turns.

    ``data`` holds results the runtime obtained on its own, not answers to
    the model's calls (a flow's earlier steps, ``kind="flow"``): they open a
    new exchange of the conversation, after the earlier ones, as untrusted
    user-role data, and are never paired with a call. Give them only when no
    call of the conversation awaits its observation.
    """

    run_id: str | None = None
    invocation_id: str | None = None
    agent_ref: str | None = None
    instructions: str = ""
    input: JSON = None
    capabilities: Sequence[CapabilitySpec] = ()
    output_schema: Mapping[str, JSON] | None = None
    observations: Sequence[Observation] = ()
    prior_turns: Sequence[Turn] = ()
    resuming: bool = False
    data: Sequence[Observation] = ()
