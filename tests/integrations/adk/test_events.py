"""The stored-event reader gives exactly what ADK's own ``Event.model_validate_json`` gives."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions, EventCompaction
from google.adk.tools.tool_confirmation import ToolConfirmation
from google.genai import types
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid
from touba.integrations.adk import _events
from touba.integrations.adk._events import decode, decode_all, encode

JSON_LEAF = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def shapes() -> list[Event]:
    """Events of the shapes a Runner stores: text, tools, confirmations, bytes, metadata."""
    call = types.FunctionCall(id="c1", name="refund", args={"amount": 3, "note": None, "x": [1]})
    return [
        Event(
            author="user",
            invocation_id="i",
            content=types.Content(role="user", parts=[types.Part(text="hi")]),
        ),
        Event(
            author="agent",
            invocation_id="i",
            content=types.Content(role="model", parts=[types.Part(function_call=call)]),
            long_running_tool_ids={"c1", "c0"},
            actions=EventActions(
                requested_tool_confirmations={"c1": ToolConfirmation(hint="ok?", payload={"a": 1})}
            ),
        ),
        Event(
            author="agent",
            invocation_id="i",
            content=types.Content(
                role="user",
                parts=[
                    types.Part(
                        function_response=types.FunctionResponse(
                            id="c1", name="refund", response={"ok": True}
                        )
                    )
                ],
            ),
            actions=EventActions(state_delta={"k": {"nested": [1, 2.5]}, "user:u": "v"}),
        ),
        Event(
            author="agent",
            invocation_id="i",
            content=types.Content(
                role="model",
                parts=[
                    types.Part(
                        inline_data=types.Blob(data=b"\x00\xffbytes", mime_type="image/png")
                    ),
                    types.Part(text="thinking", thought=True, thought_signature=b"\x01\x02"),
                ],
            ),
            usage_metadata=types.GenerateContentResponseUsageMetadata(
                prompt_token_count=10, candidates_token_count=5, total_token_count=15
            ),
            custom_metadata={"trace": {"id": 7}},
            branch="root.child",
            turn_complete=True,
        ),
        Event(
            author="agent",
            invocation_id="i",
            actions=EventActions(
                compaction=EventCompaction(
                    start_timestamp=1.0,
                    end_timestamp=2.0,
                    compacted_content=types.Content(role="model", parts=[types.Part(text="sum")]),
                ),
                artifact_delta={"f.txt": 2},
                skip_summarization=True,
                escalate=True,
            ),
            error_code="E",
            error_message="boom",
        ),
        # JSON the copy leaves to ADK's validator: a null, the convenience keys as state keys
        Event(author="agent", invocation_id="i", actions=EventActions(state_delta={"state": None})),
        Event(author="agent", invocation_id="i", output={"message": "x", "route": 1}),
    ]


def fields_set_tree(value: Any) -> Any:
    """Every model's class and fields_set, recursively: what ``==`` does not compare."""
    if isinstance(value, BaseModel):
        return (
            type(value),
            sorted(value.model_fields_set),
            {k: fields_set_tree(v) for k, v in value.__dict__.items()},
        )
    if isinstance(value, dict):
        return {k: fields_set_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [fields_set_tree(v) for v in value]
    return value


def assert_same_as_adk(data: str) -> None:
    ours = decode(data, "s")
    theirs = Event.model_validate_json(data)
    assert type(ours) is Event
    assert ours == theirs
    assert fields_set_tree(ours) == fields_set_tree(theirs)
    assert ours.model_dump_json(exclude_unset=True) == theirs.model_dump_json(exclude_unset=True)


def test_the_schema_copy_is_built_on_the_adk_this_extra_installs() -> None:
    # without it every read silently takes ADK's slower path: this pins the speed-up
    assert _events._validator() is not None


def test_building_the_copy_leaves_every_model_class_as_it_was() -> None:
    models: set[type[BaseModel]] = set()
    _events._strip(Event.__pydantic_core_schema__, models)
    assert len(models) > 10
    before = {cls: cls.__dict__.get("__pydantic_complete__") for cls in models}
    assert _events._build() is not None
    assert {cls: cls.__dict__.get("__pydantic_complete__") for cls in models} == before
    assert any(before.values())  # some were marked complete, so were unmarked and put back


# Ids by position, not the events' own (random) ids: the same in every process.
@pytest.mark.parametrize("event", shapes(), ids=[f"shape{n}" for n in range(len(shapes()))])
def test_each_shape_reads_back_as_adk_reads_it(event: Event) -> None:
    data = encode(event)
    assert_same_as_adk(data)
    assert decode(data, "s") == event


def test_the_copy_reads_plain_events_itself_and_hooked_ones_go_to_adk() -> None:
    plain, hooked = shapes()[0], shapes()[5]
    fast = _events._validator()
    assert fast is not None
    plain_data, hooked_data = encode(plain), encode(hooked)
    assert not any(word in plain_data for word in _events._HOOKED)
    assert "null" in hooked_data
    assert fast.validate_json(plain_data) == plain


def test_foreign_json_with_convenience_keys_reads_as_adk_reads_it() -> None:
    # not written by encode(): ADK's hook routes these keys; so must the reader
    data = json.dumps(
        {
            "id": "e1",
            "timestamp": 5.0,
            "author": "user",
            "message": "hello",
            "state": {"k": 1},
            "node_path": "a",
        }
    )
    assert_same_as_adk(data)
    assert decode(data, "s").content is not None


def test_a_part_with_an_explicit_null_reads_as_adk_reads_it() -> None:
    data = json.dumps(
        {
            "id": "e1",
            "timestamp": 5.0,
            "author": "user",
            "content": {"role": "user", "parts": [{"text": "x", "thought": None}]},
        }
    )
    assert_same_as_adk(data)


@settings(max_examples=60, deadline=None)
@given(
    delta=st.dictionaries(st.text(max_size=8), JSON, max_size=4),
    text=st.text(max_size=40),
    args=st.dictionaries(st.text(max_size=6), JSON, max_size=3),
    author=st.text(max_size=8),
)
def test_random_events_read_back_as_adk_reads_them(
    delta: dict[str, Any], text: str, args: dict[str, Any], author: str
) -> None:
    event = Event(
        author=author,
        invocation_id="i",
        content=types.Content(
            role="model",
            parts=[
                types.Part(text=text),
                types.Part(function_call=types.FunctionCall(name="f", args=args)),
            ],
        ),
        actions=EventActions(state_delta=delta),
    )
    try:
        data = encode(event)
    except ConfigurationError:
        return  # a value that does not round-trip is refused by both readers alike
    assert_same_as_adk(data)
    assert decode(data, "s") == event


def test_decode_all_keeps_order_and_names_the_session_of_a_damaged_event() -> None:
    events = shapes()
    datas = [encode(e) for e in events]
    assert decode_all(datas, "s") == events
    with pytest.raises(DecisionHistoryRecordInvalid, match="'s-7'"):
        decode_all([*datas, '{"author": 3}'], "s-7")
