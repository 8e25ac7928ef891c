"""touba.Encryption: seal and open, bound to a place; every alteration refused, never read."""

from __future__ import annotations

import base64
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from touba import Encryption
from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid

KEY = bytes(range(32))
PLACE = Encryption.context("history", "ns", "key-1", 3)


def test_a_sealed_value_opens_only_in_its_place() -> None:
    enc = Encryption(keys={"k1": KEY}, current="k1")
    token = enc.seal(b"the user's words", context=PLACE)
    assert token.startswith("tbe1.k1.")
    assert b"the user's words" not in token.encode()
    assert enc.open(token, context=PLACE) == b"the user's words"
    for elsewhere in (
        Encryption.context("history", "ns", "key-2", 3),
        Encryption.context("history", "ns", "key-1", 4),
        Encryption.context("memory", "ns", "key-1", 3),
    ):
        with pytest.raises(DecisionHistoryRecordInvalid, match="moved from another place"):
            enc.open(token, context=elsewhere)


def test_two_seals_of_one_text_differ() -> None:
    enc = Encryption(keys={"k1": KEY}, current="k1")
    assert enc.seal(b"same", context=PLACE) != enc.seal(b"same", context=PLACE)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda t: "plain text of a row", id="plaintext"),
        pytest.param(lambda t: '{"role": "user"}', id="plaintext-json"),
        pytest.param(lambda t: t[:-6], id="truncated"),
        pytest.param(lambda t: t[:20], id="cut-short"),
        pytest.param(lambda t: "tbe1.k1.!!not-base64!!", id="not-base64"),
        pytest.param(lambda t: t.replace("tbe1.k1.", "tbe1.k9."), id="unknown-key"),
        pytest.param(lambda t: t.replace("tbe1.k1.", "tbe1.k 1."), id="damaged-key-id"),
        pytest.param(lambda t: None, id="null"),
        pytest.param(lambda t: t.replace("tbe1.k1.", "tbe1.k1A"), id="separator-lost"),
    ],
)
def test_anything_but_an_intact_token_is_refused(damage: object) -> None:
    enc = Encryption(keys={"k1": KEY}, current="k1")
    token = enc.seal(b"secret words", context=PLACE)
    bad = damage(token)  # type: ignore[operator]
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        enc.open(bad, context=PLACE)
    assert "secret" not in str(caught.value)
    assert KEY.hex() not in str(caught.value)
    assert token.rpartition(".")[2][:8] not in str(caught.value)  # nor the ciphertext


@given(position=st.integers(min_value=0, max_value=200), bit=st.integers(0, 7))
def test_any_flipped_bit_is_refused(position: int, bit: int) -> None:
    enc = Encryption(keys={"k1": KEY}, current="k1")
    token = enc.seal(b"twenty-four bytes of txt", context=PLACE)
    prefix, body = token.rsplit(".", 1)
    raw = bytearray(base64.urlsafe_b64decode(body))
    raw[position % len(raw)] ^= 1 << bit
    flipped = f"{prefix}.{base64.urlsafe_b64encode(bytes(raw)).decode()}"
    with pytest.raises(DecisionHistoryRecordInvalid):
        enc.open(flipped, context=PLACE)


def test_rotation_reads_old_rows_and_seals_with_the_current_key() -> None:
    old = Encryption(keys={"k1": KEY}, current="k1")
    token = old.seal(b"kept", context=PLACE)
    new_key = os.urandom(32)
    rotated = Encryption(keys={"k1": KEY, "k2": new_key}, current="k2")
    assert rotated.open(token, context=PLACE) == b"kept"
    assert rotated.needs_reseal(token)
    resealed = rotated.seal(rotated.open(token, context=PLACE), context=PLACE)
    assert Encryption.key_id_of(resealed) == "k2"
    assert not rotated.needs_reseal(resealed)
    dropped = Encryption(keys={"k2": new_key}, current="k2")
    assert dropped.open(resealed, context=PLACE) == b"kept"
    with pytest.raises(DecisionHistoryRecordInvalid, match="no key 'k1'"):
        dropped.open(token, context=PLACE)


def test_a_key_provider_is_asked_by_key_id() -> None:
    asked: list[str] = []

    def lookup(key_id: str) -> bytes | None:
        asked.append(key_id)
        return KEY if key_id == "kms-1" else None

    enc = Encryption(keys=lookup, current="kms-1")
    token = enc.seal_text("été", context=PLACE)
    assert enc.open_text(token, context=PLACE) == "été"
    assert asked == ["kms-1"]  # looked up once, then kept
    with pytest.raises(DecisionHistoryRecordInvalid):
        enc.open(token.replace("kms-1", "kms-2"), context=PLACE)


@pytest.mark.parametrize(
    ("keys", "current", "match"),
    [
        ({"k1": b"short"}, "k1", "16, 24 or 32 bytes"),
        ({"k1": "a str key" * 4}, "k1", "16, 24 or 32 bytes"),
        ({"k 1": KEY}, "k 1", "key id"),
        ({"k1": KEY}, "k2", "no key 'k2'"),
        ({"k1": KEY}, "", "key id"),
    ],
)
def test_bad_keys_are_configuration_errors(keys: object, current: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Encryption(keys=keys, current=current)  # type: ignore[arg-type]


def test_repr_shows_no_key() -> None:
    enc = Encryption(keys={"k1": KEY}, current="k1")
    assert repr(enc) == "Encryption(current='k1')"
