"""The checks every call goes through, whatever history says (SPEC section 7).

Pure functions of the program, the agent, the call and the calls used so
far. In order: the capability is in the agent's catalog, its permissions
are granted to the agent, its arguments are valid (checked and converted by
the capability's parameter type, see :mod:`touba.runtime._schema`), and its
``max_calls`` budget is not used up. A refusal is a :class:`Denial`, sent
back to the model as a ``denied`` observation; its message names the rule
and the fields, never an argument's value. (Two more reasons come from
elsewhere: ``not_approved`` when a reviewer refuses, ``calls_not_allowed``
when a flow's model step proposes a call.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from touba.history._model import CapabilityCall
from touba.runtime._capability import CapabilityDefinition
from touba.runtime._program import AgentDefinition
from touba.runtime._schema import ArgumentError

__all__ = ["Accepted", "Denial", "DenialReason", "check_call"]

DenialReason = Literal[
    "unknown_capability",
    "permission_denied",
    "invalid_arguments",
    "budget_exhausted",
    "not_approved",
    "calls_not_allowed",
]


@dataclass(frozen=True, slots=True)
class Denial:
    reason: DenialReason
    message: str


@dataclass(frozen=True, slots=True)
class Accepted:
    capability: CapabilityDefinition
    kwargs: dict[str, Any]


def check_call(
    capabilities: Mapping[str, CapabilityDefinition],
    agent: AgentDefinition,
    call: CapabilityCall,
    used: Mapping[str, int],
) -> Accepted | Denial:
    """Accept ``call`` (with converted keyword arguments) or say why not."""
    capability = capabilities.get(call.name)
    if call.name not in agent.capabilities or capability is None:
        return Denial(
            "unknown_capability",
            f"capability {call.name!r} is not available to agent {agent.name!r}; call only "
            "the capabilities offered",
        )
    missing = [p for p in capability.permissions if p not in agent.grants]
    if missing:
        return Denial(
            "permission_denied",
            f"agent {agent.name!r} is not granted {', '.join(missing)}, which "
            f"{call.name!r} requires",
        )
    given: object = call.arguments  # a custom provider may send anything
    if not isinstance(given, Mapping):
        return Denial("invalid_arguments", f"arguments of {call.name!r} must be an object")
    try:
        kwargs = capability.parameters.validate(given)
    except ArgumentError as e:
        return Denial(
            "invalid_arguments",
            f"arguments of {call.name!r} do not match its parameters: {e}; call it again "
            "with arguments its schema allows",
        )
    limit = capability.max_calls
    if limit is not None and used.get(call.name, 0) >= limit:
        return Denial(
            "budget_exhausted",
            f"{call.name!r} may be called at most {limit} time(s) per invocation and that "
            "budget is used up",
        )
    return Accepted(capability, kwargs)
