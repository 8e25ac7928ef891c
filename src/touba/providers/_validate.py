"""Checking a parsed decision against the catalog and the JSON Schemas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from touba.errors import ConfigurationError
from touba.history._model import DecisionMessage, canonical_json
from touba.providers._framing import violation
from touba.providers._types import CapabilitySpec

__all__ = ["check_catalog", "check_decision", "schema_validator"]


@lru_cache(maxsize=512)
def _validator(schema_json: str) -> Draft202012Validator:
    import json

    schema = json.loads(schema_json)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def schema_validator(schema: Mapping[str, Any], what: str) -> Draft202012Validator:
    try:
        return _validator(canonical_json(dict(schema)))
    except SchemaError as e:
        raise ConfigurationError(f"{what} is not a valid JSON Schema: {e.message}") from e


def check_catalog(capabilities: Sequence[CapabilitySpec]) -> None:
    """Refuse a catalog a provider could not offer (duplicate or bad schemas)."""
    seen: set[str] = set()
    for capability in capabilities:
        if capability.name in seen:
            raise ConfigurationError(f"capability {capability.name!r} is offered twice")
        seen.add(capability.name)
        if not isinstance(capability.parameters, Mapping) or (
            capability.parameters.get("type") != "object"
        ):
            raise ConfigurationError(
                f"capability {capability.name!r}: parameters must be a JSON Schema object "
                '({"type": "object", ...})'
            )
        schema_validator(capability.parameters, f"capability {capability.name!r} parameters")


def _where(error: Any) -> str:
    """Where a value failed and which rule, never the value itself."""
    path = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{path} fails {error.validator!r}"


def check_decision(
    decision: DecisionMessage,
    capabilities: Sequence[CapabilitySpec],
    output_schema: Mapping[str, Any] | None,
) -> None:
    """Raise a schema violation unless every call and the output are valid."""
    if not decision.final and not decision.calls:
        raise violation("the model returned neither calls nor a final output", "empty_output")
    by_name = {c.name: c for c in capabilities}
    ids: set[str] = set()
    for call in decision.calls:
        if call.call_id in ids:
            raise violation(f"call id {call.call_id!r} appears twice", "duplicate_call_id")
        ids.add(call.call_id)
        spec = by_name.get(call.name)
        if spec is None:
            raise violation(
                f"the model called {call.name!r}, which is not in the agent's catalog",
                "unknown_capability",
            )
        errors = sorted(
            schema_validator(spec.parameters, call.name).iter_errors(dict(call.arguments)),
            key=str,
        )
        if errors:
            raise violation(
                f"arguments of {call.name!r} do not match its schema: {_where(errors[0])}",
                "arguments_schema_mismatch",
            )
    if decision.final and output_schema is not None:
        errors = sorted(
            schema_validator(output_schema, "output_schema").iter_errors(decision.output), key=str
        )
        if errors:
            raise violation(
                f"the final output does not match output_schema: {_where(errors[0])}",
                "output_schema_mismatch",
            )
