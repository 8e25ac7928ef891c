"""Exchanges of OpenAI Responses input items (the OpenAI Agents SDK's session items).

Pure functions over the items as JSON dicts, so they need no SDK to run or
test. An item is one of:

- a **call**: ``function_call``, ``custom_tool_call``, ``computer_call``,
  ``local_shell_call``, ``shell_call``, ``apply_patch_call``,
  ``tool_search_call`` (answered by the output of the matching type with the
  same ``call_id``), or ``mcp_approval_request`` (answered by the
  ``mcp_approval_response`` whose ``approval_request_id`` is its ``id``);
- an **output**: one of those answers;
- a **program** (programmatic tool calling): ``program`` and the model's own
  ``program_output`` with the same ``call_id``; its child calls are ordinary
  calls;
- **reasoning**: a ``reasoning`` item;
- an **input message**: a message whose role is ``user``, ``system`` or
  ``developer``;
- a **model item**: anything else (assistant messages, hosted tool calls such
  as ``web_search_call`` that carry their own result, unknown types).

An **exchange** is the shortest run of consecutive items that keeps together
what the Responses API requires together, built item by item:

1. an output answering a call still open in the current exchange joins it;
2. an input message, or an output answering no open call, starts a new
   exchange;
3. a call, a reasoning item or a model item joins the current exchange while
   it has open calls, ends with a reasoning item, or follows a reasoning item
   with no input message or output since (one response's items after its
   reasoning stay with it: the API refuses them without it); otherwise it
   starts a new exchange.

A program's ``program_output`` is emitted by the model, not by the host: an
open program keeps its exchange together (rule 3) and a matching
``program_output`` joins it, but it does not make the exchange incomplete,
since the model continues the program on the next request.

An exchange is **complete** when no call in it is open, no reasoning item in
it is followed by an output or ends it, and no item in it is an output
without its call. The last
exchange may still be open (a call awaiting its result or an approval); any
earlier exchange that is not complete stays incomplete for good (its calls
were abandoned when a new input arrived). Incomplete exchanges are never
returned by :func:`select_items`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from touba.history import ExchangeSize, message_bytes
from touba.integrations._cut import UNBOUNDED, Unit, fit_suffix

__all__ = ["CALL_OUTPUT_TYPES", "exchanges", "select_items"]

Item = Mapping[str, Any]

CALL_OUTPUT_TYPES: Final[Mapping[str, str]] = {
    "function_call": "function_call_output",
    "custom_tool_call": "custom_tool_call_output",
    "computer_call": "computer_call_output",
    "local_shell_call": "local_shell_call_output",
    "shell_call": "shell_call_output",
    "apply_patch_call": "apply_patch_call_output",
    "tool_search_call": "tool_search_output",
}
_OUTPUT_TYPES: Final = frozenset(CALL_OUTPUT_TYPES.values())
_INPUT_ROLES: Final = frozenset({"user", "system", "developer"})

Key = tuple[str, object]


def _kind(item: Item) -> tuple[str, Key | None]:
    """``("call" | "output" | "program" | "program_output", key)``, or
    ``("reasoning" | "input" | "model", None)``."""
    kind = item.get("type")
    if kind == "program":
        return "program", ("program_output", item.get("call_id"))
    if kind == "program_output":
        return "program_output", ("program_output", item.get("call_id"))
    if kind in CALL_OUTPUT_TYPES:
        return "call", (CALL_OUTPUT_TYPES[str(kind)], item.get("call_id"))
    if kind in _OUTPUT_TYPES:
        return "output", (str(kind), item.get("call_id"))
    if kind == "mcp_approval_request":
        return "call", ("mcp_approval_response", item.get("id"))
    if kind == "mcp_approval_response":
        return "output", ("mcp_approval_response", item.get("approval_request_id"))
    if kind == "reasoning":
        return "reasoning", None
    if (kind is None or kind == "message") and item.get("role") in _INPUT_ROLES:
        return "input", None
    return "model", None


class Bounds(NamedTuple):
    """Where one exchange starts and stops in a list of items, and whether it is complete."""

    start: int
    stop: int
    complete: bool


@dataclass(slots=True)
class _Open:
    """The exchange being built: its calls still awaiting an output and its programs
    still running, by key, with how many of each are pending in all."""

    start: int
    open: dict[Key, int] = field(default_factory=dict)
    programs: dict[Key, int] = field(default_factory=dict)
    pending_calls: int = 0
    pending_programs: int = 0
    after_reasoning: bool = False
    ends_with_reasoning: bool = False
    orphan: bool = False

    def bounds(self, stop: int) -> Bounds:
        complete = not self.pending_calls and not self.ends_with_reasoning and not self.orphan
        return Bounds(self.start, stop, complete)


def exchanges(items: Sequence[Item]) -> list[Unit]:
    """Split ``items`` into exchanges, oldest first (see the module docstring), each
    weighed (SPEC section 3's measure)."""
    units = []
    for start, stop, complete in exchange_bounds(items):
        weight = sum(message_bytes(i) for i in items[start:stop])
        units.append(Unit(start, stop, complete, ExchangeSize(stop - start, weight)))
    return units


def exchange_bounds(items: Sequence[Item]) -> list[Bounds]:
    """:func:`exchanges` without the weights (nothing encoded)."""
    units: list[Bounds] = []
    current: _Open | None = None
    for index, item in enumerate(items):
        kind, key = _kind(item)
        if current is None:
            new = True
        elif kind == "output":
            new = current.open.get(key, 0) <= 0  # type: ignore[arg-type]
        elif kind == "input":
            new = True
        else:
            held = current.pending_calls or current.pending_programs or current.ends_with_reasoning
            new = not (held or current.after_reasoning)
        if new:
            if current is not None:
                units.append(current.bounds(index))
            current = _Open(index)
        assert current is not None
        if kind == "output":
            if current.open.get(key, 0) > 0:  # type: ignore[arg-type]
                current.open[key] -= 1  # type: ignore[index]
                current.pending_calls -= 1
            else:
                current.orphan = True
            if current.ends_with_reasoning:  # a reasoning item needs a model item after it
                current.orphan = True
            current.after_reasoning = False
        elif kind == "input":
            current.after_reasoning = False
        elif kind == "call":
            current.open[key] = current.open.get(key, 0) + 1  # type: ignore[index,arg-type]
            current.pending_calls += 1
        elif kind == "program":
            current.programs[key] = current.programs.get(key, 0) + 1  # type: ignore[index,arg-type]
            current.pending_programs += 1
        elif kind == "program_output" and current.programs.get(key, 0) > 0:  # type: ignore[arg-type]
            current.programs[key] -= 1  # type: ignore[index]
            current.pending_programs -= 1
        current.ends_with_reasoning = kind == "reasoning"
        if kind == "reasoning":
            current.after_reasoning = True
    if current is not None:
        units.append(current.bounds(len(items)))
    return units


def select_items(
    items: Sequence[Item],
    *,
    limit: int | None = None,
    max_messages: int = UNBOUNDED,
    max_bytes: int = UNBOUNDED,
) -> list[Item]:
    """The items to hand back as history: whole complete exchanges, oldest first.

    The longest suffix of complete exchanges (incomplete ones are left out,
    never sent) that holds at most ``max_messages`` items and ``max_bytes``
    bytes (compact UTF-8 JSON per item, as touba measures): the last complete
    exchange must fit those bounds on its own, else
    :class:`~touba.errors.DecisionHistoryLimitExceeded`. ``limit`` (the SDK's
    "latest N items") then keeps at most that many items, by whole
    exchanges, so it may return fewer, or none when the last exchange alone
    is longer.
    """
    complete = [unit for unit in exchanges(items) if unit.complete]
    sizes = [unit.size for unit in complete]
    start = fit_suffix(sizes, max_messages=max_messages, max_bytes=max_bytes, required=True)
    if limit is not None:
        if limit <= 0:
            return []
        limited = fit_suffix(sizes[start:], max_messages=limit, max_bytes=UNBOUNDED, required=False)
        start += limited
    return [item for unit in complete[start:] for item in items[unit.start : unit.stop]]
