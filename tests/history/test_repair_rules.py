"""The repair rules over generated damaged records (pure functions, no store).

Records are generated as stored rows: well-formed exchanges (decisions with calls
and their results, data messages, final answers), then damaged at random (rows
deleted, duplicated, moved to another exchange, swapped, garbled, call ids and
names changed, the head's stats and pending calls altered). Whatever the damage,
``plan_repair`` gives a record that checks clean, passes the window check over
every exchange and the head check, keeps every readable decision's first
call ids, and a second repair changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from touba.history import (
    ConversationIdentity,
    RawConversation,
    RawRow,
    check_record,
    plan_repair,
    raw_of_record,
)
from touba.history._integrity import check_window
from touba.history._model import canonical_json, message_from_dict
from touba.history._record import check_head, new_head

WHO = ConversationIdentity("n", "p", "m", "native", "r", "i", "a")
NAMES = ("lookup", "refund")


@st.composite
def healthy(draw: st.DrawFn) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """A well-formed record: its head and exchanges (the last may await its results)."""
    exchanges: list[list[dict[str, Any]]] = []
    number = 0
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["calls", "calls", "data", "final"]))
        if kind == "data":
            observation = {"kind": "result", "call_id": "x", "name": "lookup", "arguments": {}}
            exchanges.append([{"kind": "data", "observations": [{**observation, "status": "ok"}]}])
        elif kind == "final":
            exchanges.append([{"kind": "decision", "final": True, "output": "done"}])
        else:
            calls = []
            for _ in range(draw(st.integers(1, 3))):
                number += 1
                calls.append(
                    {"call_id": f"c{number}", "name": draw(st.sampled_from(NAMES)), "arguments": {}}
                )
            results = [
                {
                    **{k: c[k] for k in ("call_id", "name", "arguments")},
                    "kind": "result",
                    "status": "ok",
                    "result": 1,
                }
                for c in calls
            ]
            exchanges.append([{"kind": "decision", "calls": calls}, *results])
    head = new_head(WHO)
    pending: list[dict[str, str]] = []
    awaiting: bool = draw(st.booleans())
    if exchanges and awaiting and exchanges[-1][0].get("calls"):
        last = exchanges[-1]
        exchanges[-1] = [last[0]]  # awaiting its results
        pending = [{"call_id": c["call_id"], "name": c["name"]} for c in last[0]["calls"]]
    head["pending"] = pending
    head["stats"] = {
        "exchanges": len(exchanges),
        "messages": sum(len(ex) for ex in exchanges),
        "bytes": sum(len(canonical_json(m).encode()) for ex in exchanges for m in ex),
    }
    return head, exchanges


def _readable(body: str) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


@st.composite
def damaged(draw: st.DrawFn) -> RawConversation:
    head, exchanges = draw(healthy())
    rows = [RawRow(e, None, canonical_json(m)) for e, ex in enumerate(exchanges) for m in ex]
    for _ in range(draw(st.integers(0, 4))):
        if not rows:
            break
        index = draw(st.integers(0, len(rows) - 1))
        row = rows[index]
        action = draw(
            st.sampled_from(
                ["delete", "duplicate", "move", "swap", "garble", "rename", "reid", "frame"]
            )
        )
        if action == "delete":
            del rows[index]
        elif action == "duplicate":
            rows.insert(index, row)
        elif action == "move" and row.exchange is not None:
            rows[index] = RawRow(
                max(0, row.exchange + draw(st.sampled_from([-1, 1, 3]))), None, row.body
            )
        elif action == "swap" and index + 1 < len(rows):
            rows[index], rows[index + 1] = rows[index + 1], row
        elif action == "garble":
            rows[index] = RawRow(row.exchange, None, row.body[: len(row.body) // 2])
        elif action == "frame":
            rows[index] = RawRow(None, None, row.body)
        elif _readable(row.body):  # not one garbled already
            message = json.loads(row.body)
            target = message["calls"][0] if message.get("calls") else message
            if action == "rename":
                target["name"] = "forged"
            else:
                target["call_id"] = draw(st.sampled_from(["c1", "c2", "zz"]))
            rows[index] = RawRow(row.exchange, None, canonical_json(message))
    if draw(st.booleans()):
        head["stats"] = {**head["stats"], "messages": head["stats"]["messages"] + 1}
    if draw(st.booleans()):
        head["pending"] = draw(st.sampled_from([[], [{"call_id": "c1", "name": "lookup"}]]))
    rows.sort(key=lambda r: -1 if r.exchange is None else r.exchange)  # as stores order them
    head_text = canonical_json(head)
    size = len(head_text.encode()) + sum(len(r.body.encode()) for r in rows)
    exchange_count = len({r.exchange for r in rows if r.exchange is not None})
    return RawConversation("k", head_text, True, tuple(rows), exchange_count, len(rows), size)


def passes(record: dict[str, Any]) -> None:
    head = {k: v for k, v in record.items() if k != "exchanges"}
    check_head(head, WHO, exchange_count=len(record["exchanges"]))
    exchanges = [[message_from_dict(m) for m in ex] for ex in record["exchanges"]]
    check_window("k", 0, exchanges[:-1] if head["pending"] else exchanges)


@settings(max_examples=300, deadline=None)
@given(damaged())
def test_a_repaired_record_always_passes_the_checks(raw: RawConversation) -> None:
    plan = plan_repair(raw)
    assert plan.unrepairable is None
    if not plan.problems:
        assert not plan.changes
        return
    assert plan.record is not None
    passes(plan.record)
    again = raw_of_record("k", plan.record)
    assert check_record(again) == []
    assert not plan_repair(again).changes
    assert plan.event().count == len(plan.problems)


@settings(max_examples=100, deadline=None)
@given(healthy())
def test_a_healthy_record_checks_clean(value: tuple[dict[str, Any], list[Any]]) -> None:
    head, exchanges = value
    raw = raw_of_record("k", {**head, "exchanges": exchanges})
    assert check_record(raw) == []
    assert not plan_repair(raw).changes
