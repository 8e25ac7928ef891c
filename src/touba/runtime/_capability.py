"""``CapabilityDefinition``: one capability as the runtime guards it (SPEC section 7).

It has a module of its own because both :mod:`touba.runtime._program` (which
defines capabilities) and :mod:`touba.runtime._flow` (which checks a flow's
steps against them) need it, and the program needs the flow: the definition
sits below both so that the imports point one way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from touba.providers._types import CapabilitySpec
from touba.runtime._schema import ParameterSchema

__all__ = ["CapabilityDefinition"]


@dataclass(frozen=True, slots=True)
class CapabilityDefinition:
    """One capability: what the model sees (:attr:`spec`) and how the runtime guards it.

    ``delegate`` names the agent a delegation starts (``function`` is then None).
    """

    name: str
    description: str
    parameters: ParameterSchema
    permissions: tuple[str, ...]
    max_calls: int | None
    requires_approval: bool
    function: Callable[..., Any] | None = None
    is_async: bool = False
    delegate: str | None = None

    @property
    def spec(self) -> CapabilitySpec:
        """What a provider is told of the capability: its name, description and parameters."""
        return CapabilitySpec(self.name, self.description, self.parameters.schema)
