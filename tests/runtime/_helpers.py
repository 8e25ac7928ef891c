"""Shared helpers of the runtime tests: scripted steps and a raw provider."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from touba.history import CapabilityCall
from touba.providers import Decision, DecisionRequest
from touba.runtime import InvocationResult


def step(*calls: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    """A ScriptedProvider step making ``(call_id, name, arguments)`` calls at once."""
    return {
        "action": "call",
        "calls": [{"call_id": i, "name": n, "arguments": a} for i, n, a in calls],
    }


def final(output: Any) -> dict[str, Any]:
    return {"action": "final", "output": output}


class RawProvider:
    """A host-written provider that validates nothing: the runtime's checks must.

    Each step is a Decision, or a function of the request returning one.
    """

    provider = "raw"
    model = "raw"
    decision_interface = "native"
    history = None

    def __init__(self, *steps: Decision | Callable[[DecisionRequest], Decision]) -> None:
        self.steps = list(steps)
        self.requests: list[DecisionRequest] = []

    async def decide(self, request: DecisionRequest) -> Decision:
        self.requests.append(request)
        item = self.steps.pop(0)
        return item(request) if callable(item) else item


def calls(*items: tuple[str, str, dict[str, Any]]) -> Decision:
    """A raw Decision making ``(call_id, name, arguments)`` calls."""
    return Decision(calls=tuple(CapabilityCall(i, n, a) for i, n, a in items))


def done(output: Any) -> Decision:
    return Decision(output=output)


def kinds(result: InvocationResult) -> list[str]:
    return [e.kind for e in result.trace]


def sent_json(messages: list[dict[str, Any]]) -> str:
    return json.dumps(messages, ensure_ascii=False)
