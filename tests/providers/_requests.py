"""The decision request most provider tests send, and the capability it offers."""

from __future__ import annotations

from typing import Any

from touba.providers import CapabilitySpec, DecisionRequest

LOOKUP = CapabilitySpec(
    "lookup_order",
    "Find an order",
    {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)


def decision_request(*capabilities: CapabilitySpec, **fields: Any) -> DecisionRequest:
    """A support agent asked where order A1 is, offered ``capabilities`` (default: LOOKUP)."""
    base: dict[str, Any] = {
        "run_id": "r1",
        "invocation_id": "i1",
        "agent_ref": "support",
        "instructions": "Help with orders.",
        "input": "Where is order A1?",
        "capabilities": capabilities or (LOOKUP,),
    }
    base.update(fields)
    return DecisionRequest(**base)
