"""``InvocationContext``: what a host adds to one top-level invocation (SPEC sections 8, 9).

A chat session (:class:`touba.ChatSession`) runs each turn as one invocation
of an agent, and adds to that invocation alone:

- ``prior_turns``: the earlier chat turns, sent as
  ``DecisionRequest.prior_turns`` on every decision;
- ``instructions``: text appended to the agent's instructions (the system
  prompt), e.g. the quoted block of the user's key events;
- ``tools``: extra capabilities offered with the agent's catalog. Each call of
  one goes through the runtime's usual checks (in the catalog, arguments
  valid against ``spec.parameters``), then its ``handler`` runs; what it
  returns is the ``ok`` result, what it raises an ``error`` observation
  (type name and message, as for any capability);
- ``session_id`` and ``user_id``: trusted ids of the chat session and of
  the user, from the host (never from the model). They give the keys of the
  ``session`` and ``user`` scopes of business resources
  (:mod:`touba.runtime._resources`), are kept in checkpoints and passed on to
  delegated sub-invocations. A resume must give the same ids, or no context.

Tools need no permission and have no ``max_calls`` budget; the agent's
``max_decisions`` still bounds them. Delegated sub-invocations get none of
the rest of the context: they have their own history and catalog. A
checkpoint does not keep turns, instructions or tools (tool handlers are
code): pass the same context to :meth:`~touba.Runtime.resume`, as
``ChatSession.resume`` does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from touba.errors import ConfigurationError
from touba.history._model import JSON, CapabilityCall
from touba.providers._types import CapabilitySpec, Turn
from touba.providers._validate import check_catalog
from touba.runtime._capability import CapabilityDefinition
from touba.runtime._program import _check_name
from touba.runtime._schema import ParameterSchema

__all__ = ["InvocationContext", "InvocationTool", "ToolCall", "ToolHandler", "check_context"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One accepted call of an invocation tool, with the invocation that made it.

    ``decision`` is the number of the decision that made the call (1 for the
    first), so ``(invocation_id, decision, call.call_id)`` names the call
    uniquely, e.g. as an idempotency key.
    """

    run_id: str
    invocation_id: str
    agent_ref: str
    decision: int
    call: CapabilityCall


ToolHandler = Callable[[ToolCall], Awaitable[JSON]]


@dataclass(frozen=True, slots=True)
class InvocationTool:
    """A capability offered to one invocation only: its spec and its handler."""

    spec: CapabilitySpec
    handler: ToolHandler

    def definition(self) -> CapabilityDefinition:
        """The definition the runtime's checks see: no permission, no budget, no approval."""
        return CapabilityDefinition(
            name=self.spec.name,
            description=self.spec.description,
            parameters=ParameterSchema.from_json_schema(self.spec.parameters),
            permissions=(),
            max_calls=None,
            requires_approval=False,
            is_async=True,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class InvocationContext:
    """Earlier chat turns, extra instructions and tools, and trusted ids for one invocation."""

    prior_turns: tuple[Turn, ...] = ()
    instructions: str = ""
    tools: tuple[InvocationTool, ...] = ()
    session_id: str | None = None
    user_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prior_turns", tuple(self.prior_turns))
        object.__setattr__(self, "tools", tuple(self.tools))
        if not all(isinstance(t, Turn) for t in self.prior_turns):
            raise ConfigurationError("InvocationContext.prior_turns must hold touba Turns")
        if not isinstance(self.instructions, str):
            raise ConfigurationError("InvocationContext.instructions must be a str")
        for name in ("session_id", "user_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigurationError(
                    f"InvocationContext.{name} must be a non-empty str or None"
                )
        for tool in self.tools:
            if not isinstance(tool, InvocationTool) or not callable(tool.handler):
                raise ConfigurationError(
                    "InvocationContext.tools must hold InvocationTool(spec, handler) items"
                )
            _check_name(tool.spec.name, "tool")
        check_catalog([t.spec for t in self.tools])

    @property
    def tool_names(self) -> tuple[str, ...]:
        """The names of the tools this context adds, in order."""
        return tuple(t.spec.name for t in self.tools)


def check_context(
    context: object, capabilities: Mapping[str, CapabilityDefinition]
) -> InvocationContext | None:
    """``context`` if it can extend an agent of a program with these capabilities."""
    if context is None:
        return None
    if not isinstance(context, InvocationContext):
        raise ConfigurationError("context must be a touba.runtime.InvocationContext or None")
    clash = [name for name in context.tool_names if name in capabilities]
    if clash:
        raise ConfigurationError(
            f"invocation tools {clash} have the names of program capabilities; rename them"
        )
    return context
