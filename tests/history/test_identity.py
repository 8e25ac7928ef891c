"""Conversation identity and ``conversation_key`` (SPEC section 1)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from touba.errors import ConfigurationError
from touba.history import ConversationIdentity, conversation_key

FIELDS = (
    "namespace",
    "provider",
    "model",
    "decision_interface",
    "run_id",
    "invocation_id",
    "agent_ref",
)
BASE = ("support-prod", "openai", "gpt-4.1-mini", "native", "run-1", "inv-1", "agent/support")

# Any text, with the characters a naive key would use as separators over-represented.
tricky = st.text(
    alphabet=st.one_of(
        st.sampled_from([":", "|", "/", "\\", '"', ",", "\x00", "\n", "é", "🙂", "\u202e", "["]),
        st.characters(codec="utf-8"),
    ),
    max_size=12,
)
seven = st.tuples(tricky, tricky, tricky, tricky, tricky, tricky, tricky)

PROPERTY = settings(max_examples=150, deadline=None)


def key_of(fields: tuple[str, ...]) -> str:
    return conversation_key(*fields)


@PROPERTY
@given(seven)
def test_key_is_deterministic(fields: tuple[str, ...]) -> None:
    key = key_of(fields)
    assert key == key_of(tuple("".join(list(f)) for f in fields))  # equal, not identical, strs
    assert key.isascii()
    assert key.startswith("th1:")
    if all(fields[4:]):
        assert ConversationIdentity(*fields).key == key


@PROPERTY
@given(seven, st.integers(min_value=0, max_value=6))
def test_any_lone_surrogate_is_refused(fields: tuple[str, ...], index: int) -> None:
    broken = list(fields)
    broken[index] += "\udc80"
    with pytest.raises(ConfigurationError, match=FIELDS[index]):
        key_of(tuple(broken))


@PROPERTY
@given(seven, st.integers(min_value=0, max_value=6), tricky)
def test_key_changes_with_each_field(fields: tuple[str, ...], index: int, other: str) -> None:
    if other == fields[index]:
        other += "x"
    changed = list(fields)
    changed[index] = other
    assert key_of(tuple(changed)) != key_of(fields)


@PROPERTY
@given(seven, st.integers(min_value=0, max_value=5), st.integers(min_value=1, max_value=4))
def test_moving_characters_between_fields_does_not_forge_a_key(
    fields: tuple[str, ...], index: int, moved: int
) -> None:
    # Move the last characters of one field to the front of the next one.
    left, right = fields[index], fields[index + 1]
    if not left:
        left = "a:b"
    cut = max(len(left) - moved, 0)
    forged = list(fields)
    forged[index], forged[index + 1] = left[:cut], left[cut:] + right
    original = list(fields)
    original[index] = left
    assert key_of(tuple(forged)) != key_of(tuple(original))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("a:b", "c"), ("a", "b:c")),
        (("a|b", "c"), ("a", "b|c")),
        (('a","b', "c"), ("a", 'b","c')),
        (("a\x00b", "c"), ("a", "b\x00c")),
        (("", "ab"), ("a", "b")),
    ],
)
def test_separator_examples_give_distinct_keys(a: tuple[str, str], b: tuple[str, str]) -> None:
    tail = BASE[2:]
    assert conversation_key(*a, *tail) != conversation_key(*b, *tail)


def test_key_does_not_leak_the_fields() -> None:
    key = conversation_key(*BASE)
    for field in BASE:
        assert field not in key


def test_same_namespace_shares_a_prefix_and_others_do_not() -> None:
    one = conversation_key(*BASE)
    two = conversation_key(BASE[0], *BASE[1:6], "agent/other")
    three = conversation_key("other-ns", *BASE[1:])
    assert one.rsplit(":", 1)[0] == two.rsplit(":", 1)[0]
    assert one.rsplit(":", 1)[0] != three.rsplit(":", 1)[0]


def test_identity_key_is_conversation_key() -> None:
    identity = ConversationIdentity(*BASE)
    assert identity.key == conversation_key(*BASE)
    assert identity.as_tuple() == BASE
    assert identity.as_dict() == dict(zip(FIELDS, BASE, strict=True))


@pytest.mark.parametrize("index", range(7))
@pytest.mark.parametrize("bad", [None, 1, b"run", ["x"]])
def test_non_str_field_is_a_configuration_error(index: int, bad: Any) -> None:
    fields: list[Any] = list(BASE)
    fields[index] = bad
    with pytest.raises(ConfigurationError, match=FIELDS[index]):
        conversation_key(*fields)
    with pytest.raises(ConfigurationError, match=FIELDS[index]):
        ConversationIdentity(*fields)


@pytest.mark.parametrize("index", range(7))
def test_unencodable_text_is_a_configuration_error(index: int) -> None:
    # A lone surrogate is a Python str but not Unicode text: no store can keep it.
    fields = list(BASE)
    fields[index] = "run\ud800"
    with pytest.raises(ConfigurationError, match=FIELDS[index]):
        conversation_key(*fields)
    with pytest.raises(ConfigurationError, match=FIELDS[index]):
        ConversationIdentity(*fields)


@pytest.mark.parametrize("name", ["run_id", "invocation_id", "agent_ref"])
def test_identity_requires_run_invocation_and_agent(name: str) -> None:
    fields = dict(zip(FIELDS, BASE, strict=True))
    fields[name] = ""
    with pytest.raises(ConfigurationError, match=name) as caught:
        ConversationIdentity(**fields)
    assert isinstance(caught.value, ValueError)
    assert caught.value.code == "ConfigurationError"


def test_two_invocations_of_one_agent_never_share_a_key() -> None:
    first = ConversationIdentity(*BASE[:5], "inv-1", BASE[6])
    second = ConversationIdentity(*BASE[:5], "inv-2", BASE[6])
    assert first.key != second.key


def test_identity_is_frozen() -> None:
    identity = ConversationIdentity(*BASE)
    with pytest.raises(AttributeError):
        identity.run_id = "other"  # type: ignore[misc]
