"""Flows (``kind="flow"``, seed 004's FlowAgent): declared steps run in a fixed order.

```
program.agent(
    "triage", provider=..., kind="flow", grants=("orders:read", "mail:send"),
    steps=(
        Step.call("lookup_order", {"order_id": "$input.order_id"}, name="order"),
        Step.model("reply", instructions="Write the customer's reply.",
                   output_schema={"type": "object", "properties": {"message": {"type": "string"}},
                                  "required": ["message"], "additionalProperties": False}),
        Step.call("send_mail", {"text": "$steps.reply.output.message"}),
    ),
    output="$steps.reply.output",   # default: the last step's output
)
```

- **Capability steps** (:meth:`Step.call`) make one call, which goes through
  exactly the runtime's path for a model's call: catalog, permissions,
  budgets, arguments, approvals (checkpoint and resume), delegation, trace.
  A flow's catalog is its ``capabilities=``; when omitted, the capabilities
  its steps call. Its ``grants`` are checked as any agent's.
- **Model steps** (:meth:`Step.model`) ask the provider for a final output:
  the agent's instructions then the step's, the flow's input, no capability
  offered, the step's ``output_schema``. Every earlier step's result is sent
  as data (untrusted user-role JSON, one entry per step: a capability step's
  call with its status and result or error; a model step's output as an
  entry named after the step, with no arguments), opening a new exchange of
  the invocation's conversation (``DecisionRequest.data``). So a model step needs no
  reference: it sees everything the flow did so far, even when the provider's
  history has trimmed or lost earlier exchanges. The model may not call
  capabilities: a call it proposes anyway is refused with a ``denied``
  observation (trace ``denial``, reason ``calls_not_allowed``) and the model
  is asked again, within the agent's ``max_decisions`` (which bounds the
  decisions of all model steps together). Built-in providers refuse such a
  call themselves (``AgentDecisionProviderSchemaViolation``,
  ``unknown_capability``), which fails the flow.
- **History.** Model steps' decisions belong to the invocation's
  conversation, under its identity (run_id, invocation_id, agent_ref), like
  any decision; capability steps are not model decisions and appear there
  only as the data of the next model step.
- **References** in a capability step's arguments (at any depth) and in
  ``output``: ``"$input"`` / ``"$input.a.b"`` (the flow's input) and
  ``"$steps.NAME.output"`` / ``"$steps.NAME.output.a.0"`` (an earlier step's
  output; a digit segment indexes a list). ``"$$..."`` is the literal string
  ``"$..."``. They are checked when the agent is defined: syntax, an earlier
  step of that name, a path allowed by the step's ``output_schema`` when it
  has one; argument names against the capability's parameters, literal
  values against their schemas. At run time a path that finds nothing fails
  the step.
- **Failures.** A capability step whose call is denied (a check, a refused
  approval) or ends in an ``error`` stops the flow with
  :class:`~touba.errors.FlowStepFailed`, unless the step has
  ``on_error="continue"``: its output is then None and later model steps see
  the error. A model step fails with the provider's typed error.
- **Output.** The flow's output is the last step's output, or the
  ``output`` reference; the agent's ``output_schema`` (if any) checks it.
  A reference finding nothing or a mismatch fails the flow with
  ``FlowStepFailed`` (``step="output"``).
- **Trace.** ``flow_step_started`` (``step``, ``index``, ``type`` ``"call"``
  or ``"model"``; ``calls`` with the call for a capability step) and
  ``flow_step_finished`` (``step``, ``index``, ``status``, ``output``, and
  ``error`` when not ``ok``) frame each step's usual entries (``decision``,
  ``call``, ``observation``, ``approval_*``, ``denial``...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from touba.errors import ConfigurationError
from touba.history._model import JSON, Observation, canonical_json
from touba.providers._validate import schema_validator
from touba.runtime._capability import CapabilityDefinition

__all__ = [
    "CallStep",
    "Flow",
    "ModelStep",
    "OnError",
    "Reference",
    "Step",
    "Unresolved",
    "compile_flow",
    "step_outputs",
]

OnError = Literal["fail", "continue"]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Step:
    """A step of a flow: build one with :meth:`Step.call` or :meth:`Step.model`."""

    __slots__ = ()
    name: str

    @staticmethod
    def call(
        capability: str,
        arguments: Mapping[str, JSON] | None = None,
        *,
        name: str | None = None,
        on_error: OnError = "fail",
    ) -> CallStep:
        """A call of ``capability`` with ``arguments`` (JSON, with ``$`` references).

        ``name`` (default: the capability's name) is what later steps refer to.
        """
        return CallStep(
            name=capability if name is None else name,
            capability=capability,
            arguments=dict(arguments or {}),
            on_error=on_error,
        )

    @staticmethod
    def model(
        name: str, *, instructions: str = "", output_schema: Mapping[str, JSON] | None = None
    ) -> ModelStep:
        """A model decision producing the step's output (checked by ``output_schema``)."""
        return ModelStep(
            name=name,
            instructions=instructions,
            output_schema=dict(output_schema) if output_schema is not None else None,
        )


@dataclass(frozen=True, slots=True)
class CallStep(Step):
    """A capability step; see :meth:`Step.call`."""

    name: str
    capability: str
    arguments: Mapping[str, JSON] = field(default_factory=dict)
    on_error: OnError = "fail"


@dataclass(frozen=True, slots=True)
class ModelStep(Step):
    """A model step; see :meth:`Step.model`."""

    name: str
    instructions: str = ""
    output_schema: Mapping[str, JSON] | None = None


@dataclass(frozen=True, slots=True)
class Reference:
    """``$input...`` (``step`` None) or ``$steps.<step>.output...``, and the path below."""

    text: str
    step: str | None
    path: tuple[str, ...]


class Unresolved(Exception):
    """A reference found nothing in the data it points at."""

    def __init__(self, reference: Reference) -> None:
        super().__init__(f"{reference.text!r} finds nothing")
        self.reference = reference


@dataclass(frozen=True, slots=True)
class Flow:
    """A checked flow: its steps, compiled arguments, and its output reference."""

    steps: tuple[CallStep | ModelStep, ...]
    arguments: tuple[Any, ...]  # per step: the compiled arguments (None for model steps)
    output: Reference | None

    def resolve_arguments(
        self, index: int, flow_input: JSON, outputs: Mapping[str, JSON]
    ) -> dict[str, JSON]:
        """Step ``index``'s arguments with their references filled (may raise Unresolved)."""
        value = _fill(self.arguments[index], flow_input, outputs)
        assert isinstance(value, dict)
        return value

    def result(self, flow_input: JSON, outputs: Mapping[str, JSON]) -> JSON:
        """The flow's output: its ``output`` reference, or the last step's output."""
        if self.output is None:
            return outputs[self.steps[-1].name]
        return _lookup(self.output, flow_input, outputs)


def step_outputs(steps: Sequence[Step], results: Sequence[Observation]) -> dict[str, JSON]:
    """Each finished step's output by name: its result when ``ok``, else None."""
    return {
        step.name: (result.result if result.status == "ok" else None)
        for step, result in zip(steps, results, strict=False)
    }


# -- references --------------------------------------------------------------------------


def _lookup(reference: Reference, flow_input: JSON, outputs: Mapping[str, JSON]) -> JSON:
    value = flow_input if reference.step is None else outputs[reference.step]
    for segment in reference.path:
        if isinstance(value, dict) and segment in value:
            value = value[segment]
        elif isinstance(value, list) and segment.isdigit() and int(segment) < len(value):
            value = value[int(segment)]
        else:
            raise Unresolved(reference)
    return value


def _fill(template: Any, flow_input: JSON, outputs: Mapping[str, JSON]) -> JSON:
    if isinstance(template, Reference):
        return _lookup(template, flow_input, outputs)
    if isinstance(template, dict):
        return {k: _fill(v, flow_input, outputs) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, flow_input, outputs) for v in template]
    return template


class _Checker:
    """Compiles and checks one flow definition; ``where`` names it in errors."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seen: dict[str, CallStep | ModelStep] = {}

    def error(self, what: str) -> ConfigurationError:
        return ConfigurationError(f"{self.where}: {what}")

    def reference(self, text: str, at: str) -> Reference:
        parts = text[1:].split(".")
        if any(not p for p in parts):
            raise self.error(f"{at}: reference {text!r} has an empty segment")
        if parts[0] == "input":
            return Reference(text, None, tuple(parts[1:]))
        if parts[0] != "steps" or len(parts) < 3 or parts[2] != "output":
            raise self.error(
                f"{at}: {text!r} is not a reference; use '$input', '$input.<path>', "
                "'$steps.<step>.output' or '$steps.<step>.output.<path>' (write '$$' for "
                "a literal '$')"
            )
        name, path = parts[1], tuple(parts[3:])
        step = self.seen.get(name)
        if step is None:
            raise self.error(
                f"{at}: reference {text!r} names step {name!r}, which is not an earlier step "
                f"of this flow (earlier steps: {list(self.seen) or 'none'})"
            )
        if isinstance(step, ModelStep) and step.output_schema is not None:
            self.path(step.output_schema, path, text, at)
        return Reference(text, name, path)

    def path(self, schema: Mapping[str, Any], path: tuple[str, ...], text: str, at: str) -> None:
        """Follow ``path`` in ``schema`` as far as it tells; refuse what it excludes."""
        node: Any = schema
        for index, segment in enumerate(path):
            if not isinstance(node, Mapping) or "$ref" in node:
                return
            kind = node.get("type")
            properties = node.get("properties")
            if kind == "object" or isinstance(properties, Mapping):
                if isinstance(properties, Mapping) and segment in properties:
                    node = properties[segment]
                    continue
                if node.get("additionalProperties") is False:
                    raise self.error(
                        f"{at}: reference {text!r}: the output_schema of its step has no "
                        f"property {segment!r} at {'.'.join(path[:index]) or 'the top'}"
                    )
                return
            if kind == "array":
                if not segment.isdigit():
                    raise self.error(
                        f"{at}: reference {text!r}: {segment!r} indexes a list; use a number"
                    )
                node = node.get("items")
                continue
            if kind in ("string", "number", "integer", "boolean", "null"):
                raise self.error(
                    f"{at}: reference {text!r}: the output_schema of its step makes "
                    f"{'.'.join(path[:index]) or 'the output'} a {kind}, which has no "
                    f"{segment!r}"
                )
            return

    def template(self, value: Any, at: str) -> Any:
        """``value`` with its reference strings compiled and ``$$`` unescaped."""
        if isinstance(value, str):
            if value.startswith("$$"):
                return value[1:]
            if value.startswith("$"):
                return self.reference(value, at)
            return value
        if isinstance(value, Mapping):
            if not all(isinstance(k, str) for k in value):
                raise self.error(f"{at}: object keys must be strings")
            return {k: self.template(v, f"{at}.{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.template(v, f"{at}.{i}") for i, v in enumerate(value)]
        try:
            canonical_json(value)
        except (TypeError, ValueError) as e:
            raise self.error(f"{at}: {value!r} is not JSON data") from e
        return value

    def call_step(
        self, step: CallStep, capabilities: Mapping[str, CapabilityDefinition]
    ) -> dict[str, Any]:
        at = f"step {step.name!r}"
        capability = capabilities.get(step.capability)
        if capability is None:
            raise self.error(
                f"{at} calls unknown capability {step.capability!r}; define it with "
                "@program.capability or program.delegate before the agent"
            )
        if step.on_error not in ("fail", "continue"):
            raise self.error(f"{at}: on_error must be 'fail' or 'continue'")
        if not isinstance(step.arguments, Mapping):
            raise self.error(f"{at}: arguments must be a dict")
        compiled = self.template(step.arguments, f"{at} argument")
        assert isinstance(compiled, dict)
        schema = capability.parameters.schema
        properties = schema.get("properties")
        known = set(properties) if isinstance(properties, dict) else set()
        required = schema.get("required")
        unknown = sorted(set(compiled) - known)
        if unknown and schema.get("additionalProperties") is False:
            raise self.error(
                f"{at}: {step.capability!r} has no parameters {unknown}; its parameters are "
                f"{sorted(known)}"
            )
        missing = [p for p in (required if isinstance(required, list) else []) if p not in compiled]
        if missing:
            raise self.error(f"{at}: {step.capability!r} needs the arguments {missing}")
        literal = {k: v for k, v in compiled.items() if not _has_reference(v)}
        partial = {**schema, "required": []}
        errors = sorted(schema_validator(partial, step.capability).iter_errors(literal), key=str)
        if errors:
            path = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
            raise self.error(
                f"{at}: the arguments of {step.capability!r} do not match its parameters "
                f"at {path} ({errors[0].validator})"
            )
        return compiled

    def model_step(self, step: ModelStep) -> None:
        at = f"step {step.name!r}"
        if not isinstance(step.instructions, str):
            raise self.error(f"{at}: instructions must be a str")
        if step.output_schema is not None:
            if not isinstance(step.output_schema, Mapping):
                raise self.error(f"{at}: output_schema must be a dict or None")
            schema_validator(step.output_schema, f"{self.where} {at} output_schema")


def _has_reference(value: Any) -> bool:
    if isinstance(value, Reference):
        return True
    if isinstance(value, dict):
        return any(_has_reference(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_reference(v) for v in value)
    return False


def compile_flow(
    agent: str,
    steps: object,
    output: object,
    capabilities: Mapping[str, CapabilityDefinition],
) -> Flow:
    """Check ``steps`` and ``output`` of flow ``agent``; raise ConfigurationError."""
    checker = _Checker(f"flow {agent!r}")
    if isinstance(steps, str | Mapping) or not isinstance(steps, Sequence) or not steps:
        raise checker.error("steps must be a non-empty tuple of Step.call(...)/Step.model(...)")
    compiled: list[Any] = []
    for step in steps:
        if not isinstance(step, CallStep | ModelStep):
            raise checker.error(f"steps must be made by Step.call or Step.model, got {step!r}")
        if not isinstance(step.name, str) or not _NAME.match(step.name):
            raise checker.error(
                f"step name must be 1 to 64 letters, digits, '_' or '-', got {step.name!r}"
            )
        if step.name in checker.seen:
            raise checker.error(
                f"two steps are named {step.name!r}; give one another name (name=...)"
            )
        if isinstance(step, CallStep):
            compiled.append(checker.call_step(step, capabilities))
        else:
            checker.model_step(step)
            compiled.append(None)
        checker.seen[step.name] = step
    reference = None
    if output is not None:
        if not isinstance(output, str) or not output.startswith("$") or output.startswith("$$"):
            raise checker.error(
                "output must be a reference such as '$steps.<step>.output', or None for the "
                "last step's output"
            )
        reference = checker.reference(output, "output")
    return Flow(steps=tuple(steps), arguments=tuple(compiled), output=reference)
