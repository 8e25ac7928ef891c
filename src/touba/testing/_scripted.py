"""``ScriptedProvider``: a provider-neutral scripted model for tests and the demo."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, ClassVar, TypeAlias

from touba.errors import AgentDecisionProviderUnavailable
from touba.history._config import HistoryConfig
from touba.providers._base import DecisionProvider
from touba.providers._stream import DeltaSink
from touba.providers._types import Decision, DecisionInterface, DecisionRequest
from touba.providers.function import FunctionWire

__all__ = ["ScriptStep", "ScriptedProvider"]

ScriptStep: TypeAlias = (
    Mapping[str, Any] | Callable[[DecisionRequest, list[dict[str, Any]]], Mapping[str, Any]]
)
"""A decision dict (``ScriptedProvider.call(...)``/``final(...)``), or a function
of the request and the messages sent that returns one."""


_deciding: ContextVar[DecisionRequest] = ContextVar("touba_scripted_request")


class _ScriptedWire(FunctionWire):
    provider: ClassVar[str] = "scripted"


class ScriptedProvider(DecisionProvider):
    """Replays scripted decisions through the real history, guard-free.

    Every :class:`DecisionRequest` received is kept in ``requests`` and the
    chat messages each generation was given in ``sent``, so tests can assert
    exactly what a model would have seen.
    """

    def __init__(
        self,
        *steps: ScriptStep,
        model: str = "scripted",
        decision_interface: DecisionInterface = "native",
        history: HistoryConfig | bool | None = None,
    ) -> None:
        self.requests: list[DecisionRequest] = []
        self.sent: list[list[dict[str, Any]]] = []
        self._script: deque[ScriptStep] = deque(steps)
        wire = _ScriptedWire(generate=self._next, name=model, interface=decision_interface)
        super().__init__(wire, history=history)

    @staticmethod
    def call(name: str, call_id: str | None = None, /, **arguments: Any) -> dict[str, Any]:
        """A step calling one capability."""
        call: dict[str, Any] = {"name": name, "arguments": arguments}
        if call_id is not None:
            call["call_id"] = call_id
        return {"action": "call", "calls": [call]}

    @staticmethod
    def calls(*calls: tuple[str, Mapping[str, Any]]) -> dict[str, Any]:
        """A step calling several capabilities at once (parallel calls)."""
        return {
            "action": "call",
            "calls": [{"name": name, "arguments": dict(args)} for name, args in calls],
        }

    @staticmethod
    def final(output: Any) -> dict[str, Any]:
        """A step ending the invocation with ``output``."""
        return {"action": "final", "output": output}

    def add(self, *steps: ScriptStep) -> None:
        """Append ``steps`` to the script, after those not yet played."""
        self._script.extend(steps)

    @property
    def remaining(self) -> int:
        """How many scripted steps have not been played yet."""
        return len(self._script)

    async def decide(self, request: DecisionRequest, *, sink: DeltaSink | None = None) -> Decision:
        """DecisionProvider.decide, keeping the request (with ``sink``: the decision's
        calls and text reported whole, as a provider that does not stream)."""
        self.requests.append(request)
        token = _deciding.set(request)  # a step function sees its own request, even when
        try:  # decisions of several invocations run concurrently
            return await super().decide(request, sink=sink)
        finally:
            _deciding.reset(token)

    async def _next(
        self, messages: list[dict[str, Any]], schema: dict[str, Any]
    ) -> Mapping[str, Any]:
        self.sent.append(messages)
        if not self._script:
            raise AgentDecisionProviderUnavailable(
                "the ScriptedProvider has no step left: add one with provider.add(...)"
            )
        step = self._script.popleft()
        return step(_deciding.get(), messages) if callable(step) else step
