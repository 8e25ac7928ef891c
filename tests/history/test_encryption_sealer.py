"""The history stores' sealing rules, as properties: what opens, and what does not.

``Sealer`` (``touba.history._sealed``) binds each sealed value to its store, its
conversation, its field and its position: any value opens at exactly the place it
was sealed for, with its bytes intact, and nowhere else.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from touba import Encryption
from touba.errors import DecisionHistoryRecordInvalid
from touba.history._sealed import Sealer

ENCRYPTION = Encryption(keys={"k1": b"1" * 32, "k2": b"2" * 32}, current="k1")
SEALER = Sealer(ENCRYPTION, "touba_history", "SQLite")
texts = st.text(max_size=200)
keys = st.text(min_size=1, max_size=20)
places = st.tuples(keys, st.integers(min_value=0, max_value=10_000))


@given(texts, places)
def test_a_message_opens_at_its_place_only(text: str, place: tuple[str, int]) -> None:
    key, seq = place
    token = SEALER.seal_body(key, seq, text)
    assert SEALER.open_body(key, seq, token) == text
    with pytest.raises(DecisionHistoryRecordInvalid):
        SEALER.open_body(key, seq + 1, token)
    with pytest.raises(DecisionHistoryRecordInvalid):
        SEALER.open_body(key + "x", seq, token)
    with pytest.raises(DecisionHistoryRecordInvalid):
        SEALER.open_head(key, token)  # another field
    other_store = Sealer(ENCRYPTION, "other_table", "SQLite")
    with pytest.raises(DecisionHistoryRecordInvalid):
        other_store.open_body(key, seq, token)


@given(texts, keys)
def test_a_head_opens_in_its_conversation_only(text: str, key: str) -> None:
    token = SEALER.seal_head(key, text)
    assert SEALER.open_head(key, token) == text
    assert SEALER.is_current(token)
    with pytest.raises(DecisionHistoryRecordInvalid):
        SEALER.open_head(key + "x", token)


@given(texts, keys, st.data())
def test_any_change_to_a_token_is_refused(text: str, key: str, data: st.DataObject) -> None:
    token = SEALER.seal_body(key, 0, text)
    at = data.draw(st.integers(min_value=0, max_value=len(token) - 1))
    changed = token[:at] + ("A" if token[at] != "A" else "B") + token[at + 1 :]
    cut = token[: data.draw(st.integers(min_value=0, max_value=len(token) - 1))]
    for damaged in (changed, cut):
        outcome = _opened(key, damaged)
        # base64 may spell the same bytes two ways: then nothing changed, and it opens
        assert outcome == text or isinstance(outcome, DecisionHistoryRecordInvalid)
        if isinstance(outcome, DecisionHistoryRecordInvalid):
            assert token.rpartition(".")[2] not in str(outcome)  # no ciphertext in errors


def _opened(key: str, token: str) -> str | DecisionHistoryRecordInvalid:
    try:
        return SEALER.open_body(key, 0, token)
    except DecisionHistoryRecordInvalid as e:
        return e


def test_a_rotated_sealer_opens_the_old_key_and_reports_it() -> None:
    token = SEALER.seal_body("k", 3, "hello")
    rotated = Sealer(
        Encryption(keys={"k1": b"1" * 32, "k2": b"2" * 32}, current="k2"), "touba_history", "SQLite"
    )
    assert not rotated.is_current(token)
    assert rotated.open_body("k", 3, token) == "hello"
    assert rotated.is_current(rotated.seal_body("k", 3, "hello"))
