"""LangChain message lists and LangGraph agents with touba's window.

```python
from langgraph.prebuilt import create_react_agent
from touba.integrations.langgraph import touba_pre_model_hook

agent = create_react_agent(model, tools, pre_model_hook=touba_pre_model_hook(max_messages=40))
```

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
- **The hook trims what the model sees, not the graph's state.**
  :func:`touba_pre_model_hook` returns ``{"llm_input_messages": ...}``, so
  the checkpointed ``messages`` keep every exchange (touba's rule: trimming
  deletes nothing).
- **Measure.** A message weighs the UTF-8 bytes of the compact JSON of its
  LangChain serialisation (``message.model_dump(mode="json")``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from touba.history import ExchangeSize, message_bytes
from touba.integrations._cut import Unit, check_bound
from touba.integrations._turns import TurnUnit, turn_window

try:
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
except ImportError as e:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        "touba.integrations.langgraph needs langchain-core and langgraph: "
        'pip install "touba[langgraph]"'
    ) from e

__all__ = ["touba_pre_model_hook", "touba_trimmer", "trim_messages"]


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
