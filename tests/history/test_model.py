"""The neutral message model: stored form, round trip and byte measure (SPEC section 3)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.history._strategies import json_values
from touba.errors import DecisionHistoryMismatch, DecisionHistoryRecordInvalid
from touba.history import (
    CapabilityCall,
    DataMessage,
    DecisionMessage,
    Message,
    Observation,
    ResultMessage,
    SummaryMessage,
    message_bytes,
)
from touba.history._model import message_from_dict, message_to_dict, messages_bytes

PROPERTY = settings(max_examples=100, deadline=None)

text = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)
values = json_values(text=text, integers=st.integers(min_value=-(2**63), max_value=2**63))
arguments = st.dictionaries(text, values, max_size=4)
calls = st.builds(CapabilityCall, call_id=text, name=text, arguments=arguments)
statuses = st.sampled_from(["ok", "error", "denied"])
results = st.builds(
    ResultMessage,
    call_id=text,
    name=text,
    arguments=arguments,
    status=statuses,
    result=values,
    error=st.none() | text,
)
summaries = st.builds(
    SummaryMessage, text=text, covered_exchanges=st.integers(0, 10_000), fingerprint=text
)
data_messages = st.builds(DataMessage, observations=st.lists(results, max_size=3).map(tuple))


@st.composite
def decisions(draw: st.DrawFn) -> DecisionMessage:
    """Decisions in normal form: output only when final, provider only with opaque."""
    final = draw(st.booleans())
    opaque = draw(st.none() | values)
    return DecisionMessage(
        text=draw(st.none() | text),
        calls=tuple(draw(st.lists(calls, max_size=3))),
        output=draw(values) if final else None,
        final=final,
        provider=draw(st.none() | text) if opaque is not None else None,
        opaque=opaque,
    )


messages = st.one_of(decisions(), results, summaries, data_messages)


def measure(data: Any) -> int:
    return len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode())


@PROPERTY
@given(messages)
def test_message_round_trips_through_its_stored_dict(message: Message) -> None:
    data = message_to_dict(message)
    assert data["kind"] == message.kind
    # The stored form is plain JSON: it survives a trip through a JSON store.
    stored = json.loads(json.dumps(data, ensure_ascii=False))
    assert message_from_dict(stored) == message
    assert message_to_dict(message_from_dict(stored)) == data


@PROPERTY
@given(messages)
def test_byte_measure_is_compact_utf8_json(message: Message) -> None:
    data = message_to_dict(message)
    assert message_bytes(message) == measure(data)
    assert message_bytes(data) == measure(data)


@settings(max_examples=40, deadline=None)
@given(st.lists(messages, max_size=3))
def test_messages_bytes_is_the_sum(batch: list[Message]) -> None:
    assert messages_bytes(batch) == sum(measure(message_to_dict(m)) for m in batch)


def test_measure_counts_utf8_bytes_not_characters() -> None:
    message = SummaryMessage("é🙂", 1, "f")
    data = message_to_dict(message)
    characters = len(json.dumps(data, ensure_ascii=False, separators=(",", ":")))
    assert message_bytes(message) == characters + 1 + 3  # é is 2 bytes, 🙂 is 4


def test_decision_stored_form_omits_what_is_unset() -> None:
    assert message_to_dict(DecisionMessage()) == {"kind": "decision"}
    assert message_to_dict(DecisionMessage(text="hi", output={"x": 1})) == {
        "kind": "decision",
        "text": "hi",
    }
    assert message_to_dict(DecisionMessage(final=True, output=None)) == {
        "kind": "decision",
        "final": True,
        "output": None,
    }


def test_opaque_rides_along_untouched_with_its_provider() -> None:
    opaque = [{"type": "reasoning", "encrypted_content": "gAAA=="}, {"signature": "s1"}]
    message = DecisionMessage(
        calls=(CapabilityCall("c1", "f", {}),), provider="openai", opaque=opaque
    )
    data = message_to_dict(message)
    assert data["opaque"] == opaque
    assert data["provider"] == "openai"
    assert message_from_dict(data) == message


def test_result_from_observation_can_take_projected_arguments() -> None:
    observation = Observation("c1", "lookup", {"raw": "secret"}, "ok", result={"n": 1})
    assert ResultMessage.from_observation(observation).arguments == {"raw": "secret"}
    projected = ResultMessage.from_observation(observation, arguments={"ref": "r1"})
    assert projected.arguments == {"ref": "r1"}
    assert projected.result == {"n": 1}
    assert (projected.call_id, projected.name, projected.status) == ("c1", "lookup", "ok")


CORRUPT: list[Any] = [
    None,
    [],
    "decision",
    {},
    {"kind": "nope"},
    {"kind": 1},
    {"kind": "decision", "calls": "c1"},
    {"kind": "decision", "calls": {"call_id": "c1"}},
    {"kind": "decision", "calls": ["c1"]},
    {"kind": "decision", "calls": [None]},
    {"kind": "decision", "calls": [["c1", "f", {}]]},
    {"kind": "decision", "calls": [{"name": "f", "arguments": {}}]},
    {"kind": "decision", "calls": [{"call_id": 1, "name": "f", "arguments": {}}]},
    {"kind": "decision", "calls": [{"call_id": "c1", "name": None, "arguments": {}}]},
    {"kind": "decision", "calls": [{"call_id": "c1", "name": "f", "arguments": [1]}]},
    {"kind": "decision", "text": 3},
    {"kind": "result", "name": "f", "arguments": {}, "status": "ok"},
    {"kind": "result", "call_id": "c1", "arguments": {}, "status": "ok"},
    {"kind": "result", "call_id": "c1", "name": "f", "arguments": "x", "status": "ok"},
    {"kind": "result", "call_id": "c1", "name": "f", "arguments": {}},
    {"kind": "result", "call_id": "c1", "name": "f", "arguments": {}, "status": "done"},
    {"kind": "data"},
    {"kind": "data", "observations": {}},
    {
        "kind": "data",
        "observations": [
            {"kind": "summary", "text": "t", "covered_exchanges": 1, "fingerprint": "f"}
        ],
    },
    {"kind": "data", "observations": ["x"]},
    {"kind": "summary", "text": "t", "fingerprint": "f"},
    {"kind": "summary", "text": "t", "covered_exchanges": "1", "fingerprint": "f"},
    {"kind": "summary", "text": None, "covered_exchanges": 1, "fingerprint": "f"},
    {"kind": "summary", "text": "t", "covered_exchanges": 1},
]


@pytest.mark.parametrize("data", CORRUPT)
def test_corrupt_stored_message_is_a_typed_error(data: Any) -> None:
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        message_from_dict(data)
    assert isinstance(caught.value, DecisionHistoryMismatch)
    assert caught.value.code == "DecisionHistoryRecordInvalid"


@PROPERTY
@given(st.dictionaries(text, values, max_size=5) | values)
def test_any_json_is_either_a_message_or_a_typed_error(data: Any) -> None:
    try:
        message = message_from_dict(data)
    except DecisionHistoryRecordInvalid:
        return
    # What parses re-serialises to a valid stored form.
    assert message_from_dict(message_to_dict(message)) == message
