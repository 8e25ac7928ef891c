"""Property: the cut of SDK items never returns an orphan, whatever the stored list."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from touba.integrations._responses_items import exchanges, select_items
from touba.testing.fakes.openai import validate_openai_responses_request

IDS = st.sampled_from(["a", "b", "c", "d"])
ITEMS = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, st.text(max_size=3)),
    st.just(
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok", "annotations": []}],
        }
    ),
    st.just({"type": "reasoning", "summary": []}),
    st.builds(
        lambda i: {"type": "function_call", "call_id": i, "name": "f", "arguments": "{}"}, IDS
    ),
    st.builds(lambda i: {"type": "function_call_output", "call_id": i, "output": "r"}, IDS),
    st.just({"type": "web_search_call", "id": "ws", "status": "completed"}),
)


def pairs_intact(items: list[Any]) -> bool:
    calls = [i["call_id"] for i in items if i.get("type") == "function_call"]
    outs = [i["call_id"] for i in items if i.get("type") == "function_call_output"]
    return sorted(calls) == sorted(outs)


def reasoning_followed(items: list[Any], stored: list[Any]) -> bool:
    """Each reasoning item is followed by the same item as in the stored list."""
    where = {id(item): n for n, item in enumerate(stored)}
    for n, item in enumerate(items):
        if item.get("type") == "reasoning":
            after = where[id(item)] + 1
            if n + 1 >= len(items) or after >= len(stored) or items[n + 1] is not stored[after]:
                return False
    return True


@settings(max_examples=400, deadline=None)
@given(st.lists(ITEMS, max_size=25), st.one_of(st.none(), st.integers(0, 12)))
def test_selected_items_are_whole_complete_exchanges(drawn: list[Any], limit: int | None) -> None:
    items: list[Any] = []  # distinct objects, to follow each one; no two reasonings in a row,
    for item in drawn:  # which no response emits and the API refuses whatever the cut
        if not (item.get("type") == "reasoning" and items and items[-1].get("type") == "reasoning"):
            items.append(copy.deepcopy(item))
    units = exchanges(items)
    assert [i for u in units for i in range(u.start, u.stop)] == list(range(len(items)))
    chosen = select_items(items, limit=limit)
    if limit is not None:
        assert len(chosen) <= limit
    assert pairs_intact(chosen)
    assert reasoning_followed(chosen, items)
    ids = {id(i) for i in chosen}
    for unit in units:  # whole exchanges only, and only complete ones
        inside = [id(items[n]) in ids for n in range(unit.start, unit.stop)]
        assert all(inside) or not any(inside)
        assert unit.complete or not any(inside)
    # what the fake OpenAI server (the Responses API's rules) refuses: orphans, lone reasoning
    body = {"model": "m", "input": [*chosen, {"role": "user", "content": "next"}]}
    assert validate_openai_responses_request(body) == []
