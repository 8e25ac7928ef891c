"""A provider around a host-injected generator that returns a typed object.

``create_function_decision_provider(generate=...)`` wraps
``async generate(messages, schema) -> dict``: ``messages`` are plain chat
messages (``{"role": "system" | "user" | "assistant" | "tool", ...}``) and
``schema`` the JSON Schema of the decision. The generator returns the
decision object only, so history keeps that object and no metadata.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    ToubaError,
)
from touba.history._config import HistoryConfig
from touba.history._model import (
    DataMessage,
    DecisionMessage,
    Message,
    ResultMessage,
    SummaryMessage,
    canonical_json,
)
from touba.providers._base import DecisionProvider, Plan, Wire
from touba.providers._framing import (
    data_text,
    input_text,
    observation_payload,
    parse_structured,
    results_text,
    structured_decision_json,
    structured_instructions,
    structured_schema,
    summary_text,
    trace_text,
)
from touba.providers._stream import DeltaSink
from touba.providers._types import DecisionInterface, Turn, Usage

__all__ = ["FunctionWire", "create_function_decision_provider", "render_chat_messages"]

Generator = Callable[[list[dict[str, Any]], dict[str, Any]], Awaitable[Mapping[str, Any]]]


def _turn_messages(turn: Turn, interface: DecisionInterface) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "user", "content": turn.user}]
    if turn.trace and interface == "structured":
        out.append({"role": "user", "content": trace_text(turn.trace)})
    elif turn.trace:
        for group in turn.trace:
            out.append(
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": c.call_id, "name": c.name, "arguments": dict(c.arguments)}
                        for c in group
                    ],
                }
            )
            out.extend(
                {
                    "role": "tool",
                    "tool_call_id": c.call_id,
                    "content": canonical_json(observation_payload(c)),
                }
                for c in group
            )
    if turn.replies:
        out.append({"role": "assistant", "content": "\n\n".join(turn.replies)})
    return out


def _message(
    message: Message, interface: DecisionInterface, projected: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    if isinstance(message, SummaryMessage):
        return [{"role": "user", "content": summary_text(message)}]
    if isinstance(message, DataMessage):
        return [{"role": "user", "content": data_text(message)}]
    if isinstance(message, DecisionMessage):
        if interface == "structured":
            return [{"role": "assistant", "content": structured_decision_json(message, projected)}]
        out: dict[str, Any] = {"role": "assistant"}
        if message.text is not None or message.final:
            out["content"] = (
                message.text if message.text is not None else input_text(message.output)
            )
        if message.calls:
            out["tool_calls"] = [
                {"id": c.call_id, "name": c.name, "arguments": dict(c.arguments)}
                for c in message.calls
            ]
        return [out]
    raise AssertionError(f"unexpected message {message!r}")  # results are grouped by caller


def render_chat_messages(plan: Plan) -> list[dict[str, Any]]:
    """The plan as plain chat messages, for generators that take them."""
    request = plan.request
    system = request.instructions
    if plan.interface == "structured":
        system = (
            f"{system}\n\n{structured_instructions(request.capabilities, request.output_schema)}"
        )
    projected = {
        m.call_id: m.arguments
        for exchange in plan.exchanges
        for m in exchange
        if isinstance(m, ResultMessage)
    }
    messages: list[dict[str, Any]] = [{"role": "system", "content": system.strip()}]
    for turn in plan.prior_turns:
        messages.extend(_turn_messages(turn, plan.interface))
    if request.input is not None:
        messages.append({"role": "user", "content": input_text(request.input)})
    if plan.summary is not None:
        messages.extend(_message(plan.summary, plan.interface, projected))
    for exchange in plan.exchanges:
        results = [m for m in exchange if isinstance(m, ResultMessage)]
        for message in exchange:
            if not isinstance(message, ResultMessage):
                messages.extend(_message(message, plan.interface, projected))
        if results and plan.interface == "structured":
            messages.append({"role": "user", "content": results_text(results)})
        elif results:
            messages.extend(
                {
                    "role": "tool",
                    "tool_call_id": r.call_id,
                    "content": canonical_json(observation_payload(r)),
                }
                for r in results
            )
    return messages


class FunctionWire(Wire):
    provider: ClassVar[str] = "function"

    def __init__(self, *, generate: Generator, name: str, interface: DecisionInterface) -> None:
        super().__init__(model=name, interface=interface)
        self._generate = generate

    def render(self, plan: Plan) -> dict[str, Any]:
        """Wire.render: the plan as chat messages plus the structured decision's schema."""
        request = plan.request
        return {
            "messages": render_chat_messages(plan),
            "schema": structured_schema(request.capabilities, request.output_schema),
        }

    async def count(self, body: dict[str, Any]) -> int:
        """Wire.count: always ConfigurationError (a function provider has no count endpoint)."""
        raise ConfigurationError("a function provider has no count endpoint")

    async def generate(
        self, body: dict[str, Any], sink: DeltaSink | None = None
    ) -> tuple[DecisionMessage, Usage]:
        """Wire.generate: call the injected generator; its failures become touba's, chained.

        It does not stream: with a sink, the provider reports the decision whole.
        """
        try:
            value = await self._generate(body["messages"], body["schema"])
        except ToubaError:
            raise
        except Exception as e:
            raise AgentDecisionProviderUnavailable(
                f"the injected generator failed ({type(e).__name__}); nothing was stored"
            ) from e
        if not isinstance(value, Mapping):
            raise AgentDecisionProviderSchemaViolation(
                "the injected generator must return a dict decision",
                provider_error_code="decision_not_object",
            )
        return parse_structured(value), Usage()


def create_function_decision_provider(
    *,
    generate: Generator,
    name: str = "function",
    decision_interface: DecisionInterface = "structured",
    history: HistoryConfig | bool | None = None,
) -> DecisionProvider:
    """A provider whose model is ``async generate(messages, schema) -> dict``."""
    if not callable(generate):
        raise ConfigurationError("generate must be an async callable (messages, schema) -> dict")
    if not isinstance(name, str) or not name:
        raise ConfigurationError("name must be a non-empty str")
    wire = FunctionWire(generate=generate, name=name, interface=decision_interface)
    return DecisionProvider(wire, history=history)
