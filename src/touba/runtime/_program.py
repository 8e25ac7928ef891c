"""``Program``: the capabilities, resources and agents a runtime runs (SPEC section 7).

Everything is checked when it is defined: a bad parameter type, an unknown
capability, a duplicate name, a bad budget, a flow step or reference that
cannot work (see :mod:`touba.runtime._flow`) raises :class:`ConfigurationError`
at once. Delegations may name an agent defined later; the program is checked
as a whole (every delegated agent exists, no delegation cycle) when a
:class:`~touba.Runtime` is built from it, and is sealed from then on.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Literal, TypeVar, overload

from pydantic import Field

from touba.errors import ConfigurationError
from touba.history._model import JSON
from touba.providers._types import CapabilitySpec
from touba.providers._validate import schema_validator
from touba.runtime._capability import CapabilityDefinition
from touba.runtime._flow import CallStep, Flow, Step, compile_flow
from touba.runtime._memory_config import MemoryConfig
from touba.runtime._resources import SCOPES, ResourceDefinition, ResourceScope
from touba.runtime._schema import ParameterSchema, parameters_from_fields, parameters_schema

__all__ = ["AgentDefinition", "AgentKind", "Program"]

AgentKind = Literal["loop", "agent", "flow"]
F = TypeVar("F", bound=Callable[..., Any])
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_KINDS = ("loop", "agent", "flow")


@dataclass(frozen=True, slots=True)
class AgentDefinition:
    """One agent: its provider, instructions, catalog, grants and budget.

    ``flow`` holds the checked steps of a ``kind="flow"`` agent (None otherwise).
    """

    name: str
    provider: Any
    instructions: str
    capabilities: tuple[str, ...]
    grants: frozenset[str]
    kind: AgentKind
    output_schema: Mapping[str, JSON] | None
    max_decisions: int
    memory: MemoryConfig | None
    specs: tuple[CapabilitySpec, ...] = field(default=(), repr=False)
    flow: Flow | None = None


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"{what} name must be 1 to 64 letters, digits, '_' or '-' (providers' tool-name "
            f"rule), got {name!r}"
        )
    return name


def _strings(value: object, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence | frozenset | set):
        raise ConfigurationError(f"{what} must be a tuple of strings, e.g. ('orders:read',)")
    items = tuple(value)
    if not all(isinstance(v, str) and v for v in items):
        raise ConfigurationError(f"{what} must hold non-empty strings, got {items!r}")
    return items


def _max_calls(value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(f"max_calls must be None (no limit) or an int >= 1, got {value!r}")
    return value


def _is_async(function: Callable[..., Any]) -> bool:
    call = getattr(function, "__call__", None)  # noqa: B004 - async callable objects
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


def _delegate_parameters(agent: str) -> ParameterSchema:
    task = Annotated[str, Field(description=f"The task for {agent}.")]
    return parameters_from_fields({"input": (task, inspect.Parameter.empty)}, f"agent {agent!r}")


class Program:
    """Capabilities, resources and agents, defined once and run by a :class:`~touba.Runtime`."""

    def __init__(self) -> None:
        self._capabilities: dict[str, CapabilityDefinition] = {}
        self._agents: dict[str, AgentDefinition] = {}
        self._resources: dict[str, ResourceDefinition] = {}
        self._sealed = False

    @property
    def capabilities(self) -> Mapping[str, CapabilityDefinition]:
        """The capabilities by name (a read-only view)."""
        return MappingProxyType(self._capabilities)

    @property
    def agents(self) -> Mapping[str, AgentDefinition]:
        """The agents by name (a read-only view)."""
        return MappingProxyType(self._agents)

    @property
    def resources(self) -> Mapping[str, ResourceDefinition]:
        """The business resources by name (a read-only view)."""
        return MappingProxyType(self._resources)

    def resource(
        self,
        name: str,
        *,
        scopes: Sequence[ResourceScope],
        read: Sequence[str],
        write: Sequence[str],
        description: str | None = None,
        max_value_bytes: int = 65536,
    ) -> ResourceDefinition:
        """Define a business resource (see :mod:`touba.runtime._resources`).

        ``scopes``: where its data is shared, among ``"run"``, ``"session"``,
        ``"user"`` and ``"agent"``. ``read`` and ``write``: the permissions a
        capability must declare, and its agent be granted, to read or write it.
        """
        _check_name(name, "resource")
        self._open(f"resource {name!r}")
        if name in self._resources:
            raise ConfigurationError(f"resource {name!r} is defined twice")
        where = f"resource {name!r}"
        chosen = _strings(scopes, f"{where}: scopes")
        wrong = [s for s in chosen if s not in SCOPES]
        if not chosen or wrong or len(set(chosen)) != len(chosen):
            raise ConfigurationError(
                f"{where}: scopes must name each of its scopes once, among {SCOPES}; got {chosen!r}"
            )
        readers = _strings(read, f"{where}: read")
        writers = _strings(write, f"{where}: write")
        if not readers or not writers:
            raise ConfigurationError(
                f"{where}: read and write must each name at least one permission, e.g. "
                "read=('notes:read',), write=('notes:write',); a resource grants nothing itself"
            )
        if description is not None and not isinstance(description, str):
            raise ConfigurationError(f"{where}: description must be a str or None")
        if (
            isinstance(max_value_bytes, bool)
            or not isinstance(max_value_bytes, int)
            or max_value_bytes < 1
        ):
            raise ConfigurationError(f"{where}: max_value_bytes must be an int >= 1")
        definition = ResourceDefinition(
            name=name,
            scopes=tuple(s for scope in chosen for s in SCOPES if s == scope),
            read=readers,
            write=writers,
            description=description or "",
            max_value_bytes=max_value_bytes,
        )
        self._resources[name] = definition
        return definition

    def _open(self, what: str) -> None:
        if self._sealed:
            raise ConfigurationError(
                f"cannot define {what}: this Program is already used by a Runtime. Define every "
                "capability and agent before creating the Runtime"
            )

    def _add(self, capability: CapabilityDefinition) -> None:
        self._open(f"capability {capability.name!r}")
        if capability.name in self._capabilities:
            raise ConfigurationError(f"capability {capability.name!r} is defined twice")
        self._capabilities[capability.name] = capability

    @overload
    def capability(self, function: F, /) -> F: ...

    @overload
    def capability(
        self,
        function: None = None,
        /,
        *,
        permissions: Sequence[str] = (),
        max_calls: int | None = None,
        requires_approval: bool = False,
        description: str | None = None,
        name: str | None = None,
    ) -> Callable[[F], F]: ...

    def capability(
        self,
        function: F | None = None,
        /,
        *,
        permissions: Sequence[str] = (),
        max_calls: int | None = None,
        requires_approval: bool = False,
        description: str | None = None,
        name: str | None = None,
    ) -> F | Callable[[F], F]:
        """Define a capability from a sync or async function (a decorator).

        Sync functions run in a worker thread. The parameters' JSON Schema
        comes from the type hints (see :mod:`touba.runtime._schema`); the
        description from ``description`` or the docstring. The function is
        returned unchanged.
        """
        granted = _strings(permissions, "permissions")
        limit = _max_calls(max_calls)
        if not isinstance(requires_approval, bool):
            raise ConfigurationError("requires_approval must be a bool")
        if description is not None and not isinstance(description, str):
            raise ConfigurationError("description must be a str or None")

        def define(fn: F) -> F:
            if not callable(fn):
                raise ConfigurationError(f"a capability must be a function, got {fn!r}")
            capability_name = _check_name(name or getattr(fn, "__name__", None), "capability")
            where = f"capability {capability_name!r}"
            parameters = parameters_schema(fn, where)
            is_async = _is_async(fn)
            if parameters.resources is not None and not is_async:
                raise ConfigurationError(
                    f"{where}: a capability taking Resources must be async (its resource "
                    "operations are awaited)"
                )
            self._add(
                CapabilityDefinition(
                    name=capability_name,
                    description=(description or inspect.getdoc(fn) or "").strip(),
                    parameters=parameters,
                    permissions=granted,
                    max_calls=limit,
                    requires_approval=requires_approval,
                    function=fn,
                    is_async=is_async,
                )
            )
            return fn

        return define if function is None else define(function)

    def delegate(
        self,
        agent: str,
        *,
        description: str | None = None,
        permissions: Sequence[str] = (),
        max_calls: int | None = None,
        requires_approval: bool = False,
    ) -> CapabilityDefinition:
        """Define a capability named ``agent`` that runs that agent as a sub-invocation.

        It takes one string parameter, ``input``. The sub-invocation has the
        same run_id, a new invocation_id, its own history and the delegated
        agent's own grants; its final output is the call's result. ``agent``
        may be defined later, but before the Runtime is built.
        """
        _check_name(agent, "agent")
        if description is not None and not isinstance(description, str):
            raise ConfigurationError("description must be a str or None")
        if not isinstance(requires_approval, bool):
            raise ConfigurationError("requires_approval must be a bool")
        capability = CapabilityDefinition(
            name=agent,
            description=description
            or f"Delegate a task to the agent {agent!r}; it returns that agent's final output.",
            parameters=_delegate_parameters(agent),
            permissions=_strings(permissions, "permissions"),
            max_calls=_max_calls(max_calls),
            requires_approval=requires_approval,
            delegate=agent,
        )
        self._add(capability)
        return capability

    def agent(
        self,
        name: str,
        *,
        provider: Any,
        instructions: str = "",
        capabilities: Sequence[str] = (),
        grants: Sequence[str] = (),
        kind: AgentKind = "loop",
        output_schema: Mapping[str, JSON] | None = None,
        max_decisions: int = 16,
        memory: MemoryConfig | None = None,
        steps: Sequence[Step] | None = None,
        output: str | None = None,
    ) -> AgentDefinition:
        """Define an agent; every capability it names must already be defined.

        ``kind="flow"`` needs ``steps`` (see :mod:`touba.runtime._flow`) and may
        name its output with ``output`` (a reference; default: the last step's
        output). Its ``capabilities`` default to those its steps call.
        """
        _check_name(name, "agent")
        self._open(f"agent {name!r}")
        if name in self._agents:
            raise ConfigurationError(f"agent {name!r} is defined twice")
        if kind != "flow" and (steps is not None or output is not None):
            raise ConfigurationError(
                f"agent {name!r}: steps= and output= are for kind='flow' agents"
            )
        if not callable(getattr(provider, "decide", None)):
            raise ConfigurationError(
                f"agent {name!r}: provider must be a decision provider (an object with "
                "`async decide(request)`), e.g. touba.create_openai_decision_provider(...)"
            )
        if not isinstance(instructions, str):
            raise ConfigurationError(f"agent {name!r}: instructions must be a str")
        catalog = _strings(capabilities, f"agent {name!r}: capabilities")
        flow = None
        if kind == "flow":
            if steps is None:
                raise ConfigurationError(
                    f"agent {name!r}: kind='flow' needs steps=(Step.call(...), "
                    "Step.model(...), ...)"
                )
            flow = compile_flow(name, steps, output, self._capabilities)
            called = tuple(
                dict.fromkeys(s.capability for s in flow.steps if isinstance(s, CallStep))
            )
            catalog = catalog or called
            missing = [c for c in called if c not in catalog]
            if missing:
                raise ConfigurationError(
                    f"flow {name!r}: its steps call {missing}, which are not in its "
                    "capabilities; add them (or leave capabilities out)"
                )
        if len(set(catalog)) != len(catalog):
            raise ConfigurationError(f"agent {name!r}: capabilities lists a name twice")
        unknown = [c for c in catalog if c not in self._capabilities]
        if unknown:
            raise ConfigurationError(
                f"agent {name!r}: unknown capabilities {unknown}; define them with "
                "@program.capability or program.delegate before the agent"
            )
        if kind not in _KINDS:
            raise ConfigurationError(f"agent {name!r}: kind must be one of {_KINDS}, got {kind!r}")
        if output_schema is not None:
            if not isinstance(output_schema, Mapping):
                raise ConfigurationError(f"agent {name!r}: output_schema must be a dict or None")
            schema_validator(output_schema, f"agent {name!r} output_schema")
        if (
            isinstance(max_decisions, bool)
            or not isinstance(max_decisions, int)
            or max_decisions < 1
        ):
            raise ConfigurationError(
                f"agent {name!r}: max_decisions must be an int >= 1, got {max_decisions!r}"
            )
        if memory is not None and not isinstance(memory, MemoryConfig):
            raise ConfigurationError(f"agent {name!r}: memory must be a touba.MemoryConfig")
        definition = AgentDefinition(
            name=name,
            provider=provider,
            instructions=instructions,
            capabilities=catalog,
            grants=frozenset(_strings(grants, f"agent {name!r}: grants")),
            kind=kind,
            output_schema=dict(output_schema) if output_schema is not None else None,
            max_decisions=max_decisions,
            memory=memory,
            specs=tuple(self._capabilities[c].spec for c in catalog),
            flow=flow,
        )
        self._agents[name] = definition
        return definition

    def seal(self) -> None:
        """Check the whole program (delegations resolved, no cycle) and freeze it."""
        for agent in self._agents.values():
            for capability in agent.capabilities:
                target = self._capabilities[capability].delegate
                if target is not None and target not in self._agents:
                    raise ConfigurationError(
                        f"agent {agent.name!r} delegates to {target!r}, which is not defined; "
                        f"define it with program.agent({target!r}, ...)"
                    )
        checked: set[str] = set()
        for name in self._agents:
            self._check_cycle(name, (), checked)
        self._sealed = True

    def _check_cycle(self, agent: str, path: tuple[str, ...], checked: set[str]) -> None:
        if agent in checked:
            return
        if agent in path:
            cycle = " -> ".join((*path[path.index(agent) :], agent))
            raise ConfigurationError(
                f"delegation cycle {cycle}: a sub-invocation could start itself without end; "
                "remove one of these delegations"
            )
        for capability in self._agents[agent].capabilities:
            target = self._capabilities[capability].delegate
            if target is not None:
                self._check_cycle(target, (*path, agent), checked)
        checked.add(agent)
