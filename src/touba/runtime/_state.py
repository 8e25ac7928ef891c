"""An invocation's state and its checkpoint, as plain JSON-ready data.

A checkpoint (``CHECKPOINT_VERSION`` 1) is a JSON object:

- ``version``, ``checkpoint_id``, ``created_at`` (ISO 8601, UTC);
- identity: ``run_id``, ``invocation_id``, ``agent_ref``, and ``input``;
  ``session_id`` and ``user_id``: the trusted ids the invocation was given
  (:class:`~touba.runtime.InvocationContext`), which scope its resources
  (absent when None);
- budgets used: ``decisions`` (decisions made so far) and ``calls_used``
  (capability name -> calls run or started, pending approvals excluded);
- ``observations``: the observations answering the last decision, not yet
  sent to the model (a checkpoint taken between two decisions);
- the decision in progress: ``calls`` (all its calls, in order; empty
  between decisions), ``done`` (the observations already obtained for some
  of them: calls that ran, failed or were denied), and ``pending``: one entry
  per unanswered call: ``{"kind": "approval", "call": ...}`` awaits a
  reviewer; ``{"kind": "approved", ...}`` was approved and has not started;
  ``{"kind": "started", ...}`` was recorded as started before it ran, and has
  no outcome yet (after a crash its outcome is unknown: it is never run
  again); ``{"kind": "delegate", "call": ..., "child": {...}}`` is a
  delegated sub-invocation in progress (running, awaiting approval or failed
  retryably), ``child`` being that sub-invocation's own checkpoint, nested
  (same shape, no ``trace``);
- ``flow_results`` (``kind="flow"`` only): one observation per step already
  finished, in order (a model step's as ``{"name": <step>, "status": "ok",
  "result": <output>}`` with ``call_id`` ``"flow:<step>"``); the paused
  decision is then the call of the next capability step;
- ``trace``: the trace so far (top level only), as dicts;
- top level only, written by the runtime (:mod:`touba.runtime._journal`):
  ``status`` (``"awaiting_approval"``, ``"running"``: a worker runs it now, or
  ran it and crashed; ``"failed"``: it stopped on a retryable error),
  ``revision`` (bumped by every write: the store's compare-and-swap),
  ``holder`` (the worker running it: ``worker_id``, ``pid``, ``host``,
  ``since``), ``successor`` (the id its next stop will be saved under) and
  ``error`` (the retryable error's ``code`` and message, when failed).

Nesting the children inside their parent keeps one store entry per
top-level invocation, so a resume consumes the whole tree atomically and no
child checkpoint can be resumed (or lost) on its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from touba.errors import ConfigurationError
from touba.history._model import JSON, CapabilityCall, Observation

__all__ = [
    "CHECKPOINT_VERSION",
    "InvocationState",
    "Paused",
    "Pending",
    "PendingApproval",
    "PendingApproved",
    "PendingChild",
    "PendingStarted",
    "call_from_dict",
    "call_to_dict",
    "observation_to_dict",
]

CHECKPOINT_VERSION = 1


def call_to_dict(call: CapabilityCall) -> dict[str, JSON]:
    return {"call_id": call.call_id, "name": call.name, "arguments": dict(call.arguments)}


def call_from_dict(value: Mapping[str, Any]) -> CapabilityCall:
    return CapabilityCall(value["call_id"], value["name"], dict(value["arguments"]))


def observation_to_dict(observation: Observation) -> dict[str, JSON]:
    out: dict[str, JSON] = {
        "call_id": observation.call_id,
        "name": observation.name,
        "arguments": dict(observation.arguments),
        "status": observation.status,
    }
    if observation.status == "ok":
        out["result"] = observation.result
    else:
        out["error"] = observation.error
    return out


def observation_from_dict(value: Mapping[str, Any]) -> Observation:
    return Observation(
        call_id=value["call_id"],
        name=value["name"],
        arguments=dict(value["arguments"]),
        status=value["status"],
        result=value.get("result"),
        error=value.get("error"),
    )


def _optional_str(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"expected a str or null, got {type(value).__name__}")
    return value


@dataclass(slots=True)
class InvocationState:
    """Identity, input and budgets used of one invocation (and a flow's finished steps)."""

    run_id: str
    invocation_id: str
    agent_ref: str
    input: JSON
    decisions: int = 0
    calls_used: dict[str, int] = field(default_factory=dict)
    observations: list[Observation] = field(default_factory=list)
    session_id: str | None = None
    user_id: str | None = None
    flow_results: list[Observation] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _PendingCall:
    """A call of a paused decision, in the state its subclass names."""

    call: CapabilityCall


@dataclass(frozen=True, slots=True)
class PendingApproval(_PendingCall):
    """Awaiting its reviewer."""


@dataclass(frozen=True, slots=True)
class PendingApproved(_PendingCall):
    """Approved, not started yet."""


@dataclass(frozen=True, slots=True)
class PendingStarted(_PendingCall):
    """Started before the pause: its outcome is unknown."""


@dataclass(frozen=True, slots=True)
class PendingChild:
    call: CapabilityCall
    child: Paused


Pending = PendingApproval | PendingApproved | PendingStarted | PendingChild
_SIMPLE: dict[str, type[PendingApproval | PendingApproved | PendingStarted]] = {
    "approval": PendingApproval,
    "approved": PendingApproved,
    "started": PendingStarted,
}
_KINDS = {cls: kind for kind, cls in _SIMPLE.items()}


@dataclass(frozen=True, slots=True)
class Paused:
    """An invocation stopped in the middle of a decision, awaiting approvals."""

    checkpoint_id: str
    created_at: str
    state: InvocationState
    calls: tuple[CapabilityCall, ...]
    done: Mapping[str, Observation]
    pending: tuple[Pending, ...]

    def awaiting(self) -> Iterator[CapabilityCall]:
        """The calls awaiting a reviewer, this invocation's and its children's."""
        for item in self.pending:
            if isinstance(item, PendingApproval):
                yield item.call
            elif isinstance(item, PendingChild):
                yield from item.child.awaiting()

    def invocations(self) -> Iterator[InvocationState]:
        """Every invocation of the tree, this one first."""
        yield self.state
        for item in self.pending:
            if isinstance(item, PendingChild):
                yield from item.child.invocations()

    def ran_calls(self) -> bool:
        """Whether any call of the tree ran or started (an effect may have happened)."""
        return any(state.calls_used for state in self.invocations())

    def agents(self) -> Iterator[str]:
        """Every agent_ref in the tree."""
        yield self.state.agent_ref
        for item in self.pending:
            if isinstance(item, PendingChild):
                yield from item.child.agents()

    def to_dict(self) -> dict[str, JSON]:
        pending: list[JSON] = []
        for item in self.pending:
            if not isinstance(item, PendingChild):
                pending.append({"kind": _KINDS[type(item)], "call": call_to_dict(item.call)})
            else:
                pending.append(
                    {
                        "kind": "delegate",
                        "call": call_to_dict(item.call),
                        "child": item.child.to_dict(),
                    }
                )
        state = self.state
        extra: dict[str, JSON] = {}
        if state.session_id is not None:
            extra["session_id"] = state.session_id
        if state.user_id is not None:
            extra["user_id"] = state.user_id
        if state.flow_results:
            extra["flow_results"] = [observation_to_dict(o) for o in state.flow_results]
        if state.observations:
            extra["observations"] = [observation_to_dict(o) for o in state.observations]
        return {
            "version": CHECKPOINT_VERSION,
            "checkpoint_id": self.checkpoint_id,
            "created_at": self.created_at,
            "run_id": state.run_id,
            "invocation_id": state.invocation_id,
            "agent_ref": state.agent_ref,
            "input": state.input,
            "decisions": state.decisions,
            "calls_used": dict(state.calls_used),
            "calls": [call_to_dict(c) for c in self.calls],
            "done": [observation_to_dict(o) for o in self.done.values()],
            "pending": pending,
            **extra,
        }

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Paused:
        version = value.get("version") if isinstance(value, Mapping) else None
        if version != CHECKPOINT_VERSION:
            raise ConfigurationError(
                f"this checkpoint has version {version!r}; this touba reads version "
                f"{CHECKPOINT_VERSION}. Resume it with the touba version that wrote it"
            )
        try:
            pending: list[Pending] = []
            for item in value["pending"]:
                call = call_from_dict(item["call"])
                if item["kind"] == "delegate":
                    pending.append(PendingChild(call, cls.from_dict(item["child"])))
                else:
                    pending.append(_SIMPLE[item["kind"]](call))
            done = [observation_from_dict(o) for o in value["done"]]
            return cls(
                checkpoint_id=value["checkpoint_id"],
                created_at=value["created_at"],
                state=InvocationState(
                    run_id=value["run_id"],
                    invocation_id=value["invocation_id"],
                    agent_ref=value["agent_ref"],
                    input=value["input"],
                    decisions=int(value["decisions"]),
                    calls_used={str(k): int(v) for k, v in value["calls_used"].items()},
                    session_id=_optional_str(value.get("session_id")),
                    user_id=_optional_str(value.get("user_id")),
                    flow_results=[
                        observation_from_dict(o) for o in value.get("flow_results") or []
                    ],
                    observations=[
                        observation_from_dict(o) for o in value.get("observations") or []
                    ],
                ),
                calls=tuple(call_from_dict(c) for c in value["calls"]),
                done={o.call_id: o for o in done},
                pending=tuple(pending),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigurationError(
                f"this checkpoint is malformed ({type(e).__name__}: {e}); it cannot be resumed"
            ) from e
