"""LangChain message lists and LangGraph agents with touba's window.

```python
from langchain.agents import create_agent
from touba.integrations.langgraph import ToubaWindowMiddleware

agent = create_agent(model, tools, middleware=[ToubaWindowMiddleware(max_messages=40)])
```

(``create_agent`` is the agent LangGraph 1 recommends; ``touba_pre_model_hook`` serves
its deprecated ``create_react_agent``.)

Behaviour decisions:

- **Exchanges.** An ``AIMessage`` with ``tool_calls`` and the
  ``ToolMessage``\\ s answering them (by ``tool_call_id``) are one exchange;
  a ``HumanMessage`` opens a turn. A call never answered, or a
  ``ToolMessage`` whose call is gone, makes its exchange incomplete.
- **The window** (:func:`trim_messages`) is the one of
  :mod:`touba.integrations._turns`: the last user turn's ``HumanMessage``
  always, not counted in the bounds; the current turn's exchanges, newest
  first, the last one always (``DecisionHistoryLimitExceeded`` when it alone
  exceeds a bound); then whole earlier turns. Leading ``SystemMessage``\\ s are
  instructions: always kept, first, and not counted.
- **The middleware and the hook trim what the model sees, not the graph's
  state.** :class:`ToubaWindowMiddleware` hands the model call a request whose
  ``messages`` are the window (``request.override(messages=...)``), and
  :func:`touba_pre_model_hook` returns ``{"llm_input_messages": ...}``, so the
  checkpointed ``messages`` keep every exchange (touba's rule: trimming deletes
  nothing).
- **Measure.** A message weighs the UTF-8 bytes of the compact JSON of its
  LangChain serialisation (``message.model_dump(mode="json")``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from touba.history import ExchangeSize, message_bytes
from touba.integrations._cut import Unit, check_bound
from touba.integrations._turns import TurnUnit, turn_window

try:
    from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest
    from langchain.agents.middleware.types import ModelCallResult, ModelResponse
    from langchain_core.messages import (
        AIMessage,
        AnyMessage,
        BaseMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
except ImportError as e:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        "touba.integrations.langgraph needs langchain, langchain-core and langgraph: "
        'pip install "touba[langgraph]"'
    ) from e

__all__ = ["ToubaWindowMiddleware", "touba_pre_model_hook", "touba_trimmer", "trim_messages"]


@dataclass(slots=True)
class _Open:
    start: int
    is_input: bool
    open: Counter[str] = field(default_factory=Counter)
    orphan: bool = False


def _units(messages: Sequence[BaseMessage], sizes: Sequence[int], offset: int) -> list[TurnUnit]:
    units: list[TurnUnit] = []
    current: _Open | None = None

    def close(stop: int) -> None:
        if current is not None:
            start = current.start
            size = ExchangeSize(stop - start, sum(sizes[start - offset : stop - offset]))
            complete = not (+current.open) and not current.orphan
            units.append(TurnUnit(Unit(start, stop, complete, size), current.is_input))

    for index, message in enumerate(messages, start=offset):
        if isinstance(message, ToolMessage):
            call = message.tool_call_id
            if current is not None and current.open[call] > 0:
                current.open[call] -= 1
                continue
            close(index)
            current = _Open(index, is_input=False, orphan=True)
        elif isinstance(message, AIMessage):
            if current is None or not +current.open:
                close(index)
                current = _Open(index, is_input=False)
            current.open.update(str(c["id"]) for c in message.tool_calls if c.get("id"))
        else:  # a HumanMessage (or any other input) opens a turn
            close(index)
            current = _Open(index, is_input=isinstance(message, HumanMessage))
    close(offset + len(messages))
    return units


def trim_messages(
    messages: Sequence[BaseMessage],
    *,
    max_messages: int | None = None,
    max_bytes: int | None = None,
) -> list[BaseMessage]:
    """The messages to send: leading system messages, then touba's window, oldest first.

    Raises ``DecisionHistoryLimitExceeded`` (``limit`` names the bound) when
    the last exchange alone exceeds a bound, ``ConfigurationError`` on a bad
    bound.
    """
    messages_bound = check_bound("max_messages", max_messages)
    bytes_bound = check_bound("max_bytes", max_bytes)
    lead = 0
    while lead < len(messages) and isinstance(messages[lead], SystemMessage):
        lead += 1
    rest = messages[lead:]
    sizes = [message_bytes(m.model_dump(mode="json")) for m in rest]
    chosen = turn_window(
        _units(rest, sizes, lead), max_messages=messages_bound, max_bytes=bytes_bound
    )
    return [*messages[:lead], *(messages[i] for u in chosen for i in range(u.start, u.stop))]


def touba_trimmer(
    *, max_messages: int | None = None, max_bytes: int | None = None
) -> Callable[[Sequence[BaseMessage]], list[BaseMessage]]:
    """:func:`trim_messages` with its bounds fixed, checked now (a LangChain-style trimmer)."""
    check_bound("max_messages", max_messages)
    check_bound("max_bytes", max_bytes)

    def trim(messages: Sequence[BaseMessage]) -> list[BaseMessage]:
        return trim_messages(messages, max_messages=max_messages, max_bytes=max_bytes)

    return trim


def touba_pre_model_hook(
    *, max_messages: int | None = None, max_bytes: int | None = None
) -> Callable[[Mapping[str, Any]], dict[str, list[BaseMessage]]]:
    """A ``create_react_agent(..., pre_model_hook=...)`` node: the window as ``llm_input_messages``.

    The graph's ``messages`` state is left whole; only what the model is sent
    is trimmed.
    """
    trim = touba_trimmer(max_messages=max_messages, max_bytes=max_bytes)

    def hook(state: Mapping[str, Any]) -> dict[str, list[BaseMessage]]:
        return {"llm_input_messages": trim(state["messages"])}

    return hook


class ToubaWindowMiddleware(AgentMiddleware[AgentState[Any], Any, Any]):
    """A ``create_agent(..., middleware=[...])`` middleware: each model call gets the window.

    Before every model call of the agent, the request's ``messages`` (the system
    prompt travels apart, in ``request.system_message``) are cut to touba's
    window (:func:`trim_messages`); the agent's ``messages`` state is left whole.
    Bounds are checked here (``ConfigurationError``); a last exchange that alone
    exceeds one raises ``DecisionHistoryLimitExceeded`` from the model call.
    """

    def __init__(self, *, max_messages: int | None = None, max_bytes: int | None = None) -> None:
        super().__init__()
        self._trim = touba_trimmer(max_messages=max_messages, max_bytes=max_bytes)

    def _windowed(self, request: ModelRequest[Any]) -> ModelRequest[Any]:
        # The window is a sub-list of request.messages: the same AnyMessage objects.
        window = cast("list[AnyMessage]", self._trim(request.messages))
        return request.override(messages=window)

    def wrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], ModelResponse[Any]],
    ) -> ModelCallResult[Any]:
        """Call the model with the window of ``request.messages``."""
        return handler(self._windowed(request))

    async def awrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]],
    ) -> ModelCallResult[Any]:
        """Call the model with the window of ``request.messages`` (async agents)."""
        return await handler(self._windowed(request))
