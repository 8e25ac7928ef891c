"""The built-in offline program of ``touba chat`` and ``touba worker`` (``--program demo``).

Two agents over one capability, ``lookup_order``, both with key events on
(types ``refund`` and ``account issue``), driven by a deterministic model (a
function provider, no network):

- ``support`` (``kind="loop"``): looks orders up, and opens a ``refund`` key
  event itself, during the turn, when a message asks for a refund;
- ``assistant`` (``kind="agent"``): looks orders up only; its key events are
  extracted after the session ends (``touba worker``), one ``refund`` event
  per order the conversation asked a refund for, unless one is already open.

Both say how many earlier turns they were given and which key events the
system prompt carried, so memory is visible from the terminal.
"""

from __future__ import annotations

import json
import re
from typing import Any

from touba.memory import KeyEventsConfig, MemoryConfig
from touba.memory._worker import EXTRACTION_INSTRUCTIONS
from touba.providers import create_function_decision_provider
from touba.runtime import Program
from touba.runtime._program import AgentKind

__all__ = ["ORDERS", "build_program"]

ORDERS = {"A1": "shipped", "B2": "in transit", "C3": "delivered", "D4": "refund pending"}
TYPES = ("refund", "account issue")
_ORDER = re.compile(r"\b([A-D][1-4])\b")
_EVENTS = re.compile(r'"key_events":(\[.*\])')

Message = dict[str, Any]


def _orders(text: str) -> list[str]:
    return [o for o in _ORDER.findall(text) if o in ORDERS]


def _events(system: str) -> list[dict[str, Any]]:
    found = _EVENTS.search(system)
    return list(json.loads(found.group(1))) if found else []


def _extract(messages: list[Message]) -> dict[str, Any]:
    """The extraction answer: one refund event per order a refund was asked for."""
    data = json.loads(str(messages[-1]["content"]).split("\n", 1)[1])
    titles = {e["title"] for e in data["open_events"] if e["type"] == "refund"}
    ops: list[dict[str, Any]] = []
    for turn in data["transcript"]:
        if "refund" not in turn["user"].lower():
            continue
        for order in _orders(turn["user"]):
            title = f"Refund for order {order}"
            if title not in titles:
                titles.add(title)
                ops.append(
                    {"kind": "create", "type": "refund", "title": title, "details": turn["user"]}
                )
    return {"action": "final", "output": {"ops": ops}}


def _answer(messages: list[Message], *, writes_events: bool) -> dict[str, Any]:
    system = str(messages[0]["content"])
    last = messages[-1]
    if last["role"] == "tool":  # the calls were answered: report them
        results = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
        return {"action": "final", "output": "; ".join(_describe(r) for r in results[-2:])}
    user = str(last["content"])
    earlier = sum(1 for m in messages[1:-1] if m["role"] == "user")
    orders = _orders(user)
    calls: list[dict[str, Any]] = [
        {"name": "lookup_order", "arguments": {"order_id": o}} for o in orders[:1]
    ]
    if writes_events and orders and "refund" in user.lower():
        title = f"Refund for order {orders[0]}"
        calls.append(
            {
                "name": "create_key_event",
                "arguments": {"type": "refund", "title": title, "details": user},
            }
        )
    if calls:
        return {"action": "call", "calls": calls}
    events = _events(system)
    listed = ", ".join(f"{e['title']} ({e['status']})" for e in events) or "none"
    return {
        "action": "final",
        "output": f"I was given {earlier} earlier turn(s); open key events: {listed}. "
        "Ask me about an order (A1 to D4), or for a refund.",
    }


def _describe(payload: dict[str, Any]) -> str:
    result = payload.get("result")
    if payload.get("status") != "ok":
        return f"that did not work: {payload.get('error')}"
    if isinstance(result, dict) and "created" in result:
        return f"I opened the case {result['created']['title']!r}"
    if isinstance(result, dict) and "order_id" in result:
        return f"order {result['order_id']} is {result['status']}"
    return "done"


async def _model(messages: list[Message], schema: dict[str, Any]) -> dict[str, Any]:
    system = str(messages[0]["content"])
    if system.startswith(EXTRACTION_INSTRUCTIONS[:40]):
        return _extract(messages)
    return _answer(messages, writes_events="create_key_event" in json.dumps(schema))


def build_program() -> Program:
    """A fresh demo program (a Program is sealed by the first Runtime built on it)."""
    program = Program()

    @program.capability(permissions=("orders:read",))
    async def lookup_order(order_id: str) -> dict[str, str]:
        """Look up the status of an order (A1 to D4)."""
        return {"order_id": order_id, "status": ORDERS.get(order_id, "unknown")}

    memory = MemoryConfig(key_events=KeyEventsConfig(enabled=True, types=TYPES))
    agents: tuple[tuple[str, AgentKind], ...] = (("support", "loop"), ("assistant", "agent"))
    for name, kind in agents:
        program.agent(
            name,
            provider=create_function_decision_provider(
                generate=_model, name="touba-demo", decision_interface="native"
            ),
            instructions="You help customers with their orders.",
            capabilities=("lookup_order",),
            grants=("orders:read",),
            kind=kind,
            memory=memory,
        )
    return program
