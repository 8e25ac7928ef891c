"""What the two OpenAI wire formats share: role-based item lists, and usage.

The Responses API's ``input`` items (:mod:`touba.providers._openai_wire`) and the
Chat Completions ``messages`` (:mod:`touba.providers.compatible`) put a plan in the
same order (prior turns, the invocation input, the summary, then the window's
exchanges) and frame the same things as user-role data (data messages, summaries,
the structured interface's results). They differ only in how a decision and a
call's result are written, which each wire passes in; the order and the framing
are here once. Their ``usage`` objects differ only in field names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from touba.history._model import (
    JSON,
    CapabilityCall,
    DataMessage,
    DecisionMessage,
    Message,
    ResultMessage,
    SummaryMessage,
)
from touba.providers._base import Plan
from touba.providers._framing import (
    data_text,
    input_text,
    observation_payload,
    results_text,
    summary_text,
)
from touba.providers._memo import ExchangeMemo, rendered_exchanges
from touba.providers._types import DecisionInterface, Turn, Usage

__all__ = [
    "DecisionItems",
    "Item",
    "ResultItem",
    "assistant",
    "exchange_items",
    "plan_items",
    "projected_calls",
    "usage",
    "user",
]

Item = dict[str, Any]
Projected = Mapping[str, Mapping[str, JSON]]
DecisionItems = Callable[[DecisionMessage, DecisionInterface, Projected], list[Item]]
"""A wire's items for one decision, given the runtime's projected arguments by call id."""
ResultItem = Callable[[str, JSON], Item]
"""A wire's item for one call's result: ``(call_id, payload)``."""


def user(text: str) -> Item:
    """A user-role message holding ``text``."""
    return {"role": "user", "content": text}


def assistant(text: str) -> Item:
    """An assistant-role message holding ``text``."""
    return {"role": "assistant", "content": text}


def projected_calls(decision: DecisionMessage, projected: Projected) -> tuple[CapabilityCall, ...]:
    """The decision's calls with the runtime's projected arguments wherever an
    observation gives them, never the model's raw ones."""
    return tuple(
        CapabilityCall(c.call_id, c.name, projected.get(c.call_id, c.arguments))
        for c in decision.calls
    )


def exchange_items(
    exchange: Sequence[Message],
    interface: DecisionInterface,
    decision_items: DecisionItems,
    result_item: ResultItem,
) -> list[Item]:
    """One exchange: its decisions, data and summaries in order, then its results
    (one user-role text under the structured interface, else one item each)."""
    results = [m for m in exchange if isinstance(m, ResultMessage)]
    projected = {r.call_id: r.arguments for r in results}
    items: list[Item] = []
    for message in exchange:
        if isinstance(message, DecisionMessage):
            items.extend(decision_items(message, interface, projected))
        elif isinstance(message, DataMessage):
            items.append(user(data_text(message)))
        elif isinstance(message, SummaryMessage):
            items.append(user(summary_text(message)))
    if results and interface == "structured":
        items.append(user(results_text(results)))
    else:
        items.extend(result_item(r.call_id, observation_payload(r)) for r in results)
    return items


def plan_items(
    plan: Plan,
    memo: ExchangeMemo[list[Item]] | None,
    turn_items: Callable[[Turn, DecisionInterface], list[Item]],
    render: Callable[[Sequence[Message], DecisionInterface], list[Item]],
) -> list[Item]:
    """Prior turns, the invocation input, the summary, then the exchanges (each taken
    from ``memo`` when it rendered that very exchange before, else by ``render``)."""
    items: list[Item] = []
    for turn in plan.prior_turns:
        items.extend(turn_items(turn, plan.interface))
    if plan.request.input is not None:
        items.append(user(input_text(plan.request.input)))
    if plan.summary is not None:
        items.append(user(summary_text(plan.summary)))
    for rendered in rendered_exchanges(plan.window, plan.interface, memo, render):
        items.extend(rendered)
    return items


def usage(data: Mapping[str, Any], inputs: str, outputs: str) -> Usage:
    """The body's ``usage``: the token counts under ``inputs`` and ``outputs``, and the
    ``cached_tokens`` of ``{inputs}_details`` and ``reasoning_tokens`` of
    ``{outputs}_details`` when ints; an empty :class:`Usage` without a ``usage``."""
    found = data.get("usage")
    if not isinstance(found, Mapping):
        return Usage()
    details: dict[str, JSON] = {}
    for group, key in (
        (f"{inputs}_details", "cached_tokens"),
        (f"{outputs}_details", "reasoning_tokens"),
    ):
        section = found.get(group)
        if isinstance(section, Mapping) and isinstance(section.get(key), int):
            details[key] = section[key]
    counted_in, counted_out = found.get(inputs), found.get(outputs)
    return Usage(
        input_tokens=counted_in if isinstance(counted_in, int) else None,
        output_tokens=counted_out if isinstance(counted_out, int) else None,
        details=details,
    )
