"""Per-turn context (schema 3): what a turn's invocation was given, kept with the turn as
a JSON object and returned by every method that returns stored turns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from tests.memory.conftest import MakeStore
from touba.errors import ConfigurationError
from touba.memory import StoredTurn

CONTEXT = {
    "settings": {"short_term_turns": 1, "source": "saved", "saved_at": "2026-01-05T09:00:00Z"},
    "given_turns": [2],
    "full_trace_turns": [2],
    "key_events": [{"id": "ke_1", "title": "Refund", "status": "open"}],
    "system_prompt_bytes": 812,
    "ratio": 0.5,
    "preview": False,
    "note": None,
}


async def test_the_context_is_kept_with_the_turn_and_read_back_everywhere(
    make_store: MakeStore,
) -> None:
    store = make_store()
    await store.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
    old = await store.append_turn("s-1", user="hi", replies=["hello"])
    given = dict(CONTEXT)
    new = await store.append_turn("s-1", user="again", replies=["yes"], context=given)
    given["preview"] = True  # the caller's dict is not the stored one
    assert old.context is None
    assert new.context == CONTEXT
    assert [t.context for t in await store.recent_turns("s-1", 5)] == [None, CONTEXT]
    assert [t.context for t in await store.list_turns("s-1")] == [None, CONTEXT]
    [reopened] = await make_store().recent_turns("s-1", 1)
    assert reopened == StoredTurn("s-1", 1, "again", ("yes",), (), None, new.created_at, CONTEXT)
    empty = await store.append_turn("s-1", user="q", replies=[], context={})
    assert empty.context == {}
    assert (await store.recent_turns("s-1", 1))[0].context == {}


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ([1, 2], "JSON object"),
        ("sizes", "JSON object"),
        (7, "JSON object"),
        ({"ratio": float("nan")}, r"context\[key 0\] is nan"),
        ({1: "a"}, "context"),
        ({"ids": {1, 2}}, "context"),
    ],
)
async def test_a_context_that_is_not_a_json_object_is_refused_and_writes_nothing(
    make_store: MakeStore, context: Any, message: str
) -> None:
    store = make_store()
    await store.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
    await store.append_turn("s-1", user="hi", replies=["hello"], context={"a": 1})
    with pytest.raises(ConfigurationError, match=message):
        await store.append_turn("s-1", user="bad", replies=["x"], context=context)
    turns = await store.recent_turns("s-1", 5)
    assert [(t.user, t.context) for t in turns] == [("hi", {"a": 1})]
    session = await store.get_session("s-1")
    assert session is not None
    assert session.turns == 1
    after = await store.append_turn("s-1", user="next", replies=[])
    assert after.index == 1


async def test_any_mapping_is_a_json_object(make_store: MakeStore) -> None:
    class Frozen(Mapping[str, int]):
        def __getitem__(self, key: str) -> int:
            return {"turns": 2}[key]

        def __iter__(self) -> Any:
            return iter(["turns"])

        def __len__(self) -> int:
            return 1

    store = make_store()
    await store.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
    turn = await store.append_turn("s-1", user="hi", replies=[], context=Frozen())
    assert turn.context == {"turns": 2}
