"""``HistoryConfig`` defaults and validation, ``HistoryEvent`` (SPEC section 3)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from touba import HistoryConfig, HistoryEvent
from touba.errors import ConfigurationError
from touba.history import MemoryHistoryStore, SummaryRequest


async def summarize(request: SummaryRequest) -> str:
    return "summary"


def test_defaults_are_the_spec_table() -> None:
    config = HistoryConfig()
    assert config.max_messages == 128
    assert config.max_bytes == 262144
    assert config.max_retained_bytes == 8 * 1024 * 1024
    assert config.store is None
    assert config.namespace is None
    assert config.on_event is None
    assert config.summarize is None
    assert config.max_summary_bytes == 4096
    assert config.continuity == "inline"


def test_every_field_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        HistoryConfig(10)  # type: ignore[call-arg]


def test_config_is_frozen() -> None:
    config = HistoryConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_messages = 1  # type: ignore[misc]


def test_valid_config_is_accepted() -> None:
    store = MemoryHistoryStore()
    config = HistoryConfig(
        max_messages=1,
        max_bytes=2,
        max_retained_bytes=3,
        store=store,
        namespace="support-production",
        on_event=lambda event: None,
        summarize=summarize,
        max_summary_bytes=1,
        continuity="opaque_refs",
    )
    assert config.store is store
    assert config.continuity == "opaque_refs"
    # A namespace without a store names the private store's conversations.
    assert HistoryConfig(namespace="ns").namespace == "ns"


BOUNDS = ["max_messages", "max_bytes", "max_retained_bytes", "max_summary_bytes"]


@pytest.mark.parametrize("name", BOUNDS)
@pytest.mark.parametrize("bad", [0, -1, -262144, True, False, 1.5, 10.0, "10", None])
def test_invalid_bound_is_a_configuration_error(name: str, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=name) as caught:
        HistoryConfig(**{name: bad})
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("bad", ["", "INLINE", "opaque-refs", "none", None, 1])
def test_unknown_continuity_is_a_configuration_error(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="continuity"):
        HistoryConfig(continuity=bad)


def test_store_without_namespace_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="namespace"):
        HistoryConfig(store=MemoryHistoryStore())


@pytest.mark.parametrize("bad", ["", 1, b"ns"])
def test_namespace_must_be_non_empty_text(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="namespace"):
        HistoryConfig(store=MemoryHistoryStore(), namespace=bad)


def test_store_must_offer_transact() -> None:
    with pytest.raises(ConfigurationError, match="transact"):
        HistoryConfig(store=object(), namespace="ns")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["on_event", "summarize"])
@pytest.mark.parametrize("bad", ["print", 1, {"a": 1}])
def test_non_callable_hook_is_a_configuration_error(name: str, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=name):
        HistoryConfig(**{name: bad})


def test_summary_must_be_smaller_than_the_window() -> None:
    with pytest.raises(ConfigurationError, match="max_summary_bytes"):
        HistoryConfig(max_bytes=4096, summarize=summarize)
    # Without a summariser the bound is unused, so it is not checked against max_bytes.
    assert HistoryConfig(max_bytes=4096).max_summary_bytes == 4096


def test_event_to_dict_omits_unused_fields() -> None:
    window = HistoryEvent(kind="history_window", session_key="k", message_count=3, bytes=120)
    assert window.to_dict() == {
        "kind": "history_window",
        "session_key": "k",
        "message_count": 3,
        "bytes": 120,
    }
    trimmed = HistoryEvent(
        kind="history_trimmed",
        session_key="k",
        message_count=0,
        bytes=0,
        removed_exchanges=0,
        removed_messages=2,
        removed_bytes=40,
    )
    # Zero is a value, not an unused field.
    assert trimmed.to_dict() == {
        "kind": "history_trimmed",
        "session_key": "k",
        "message_count": 0,
        "bytes": 0,
        "removed_exchanges": 0,
        "removed_messages": 2,
        "removed_bytes": 40,
    }
    count = HistoryEvent(
        kind="provider_context_count",
        session_key="k",
        message_count=1,
        bytes=2,
        provider="openai",
        count=10,
        reserve=20,
        window=30,
        fits=False,
    )
    assert count.to_dict()["fits"] is False
    assert set(count.to_dict()) == {
        "kind",
        "session_key",
        "message_count",
        "bytes",
        "provider",
        "count",
        "reserve",
        "window",
        "fits",
    }


def test_event_has_no_field_for_content() -> None:
    names = {f.name for f in dataclasses.fields(HistoryEvent)}
    assert names == {
        "kind",
        "session_key",
        "message_count",
        "bytes",
        "removed_exchanges",
        "removed_messages",
        "removed_bytes",
        "covered_exchanges",
        "fingerprint",
        "summary_bytes",
        "provider",
        "count",
        "reserve",
        "window",
        "fits",
        "used_sessions",
        "max_sessions",
        "used_bytes",
        "max_store_bytes",
        "prior_turns",
        "added_messages",  # history_repaired: how many observations a repair added
        "repaired_kinds",  # and the kinds of problem it fixed (orphan_call, ...)
    }
    assert not names & {"text", "messages", "arguments", "result", "results", "signature"}


def test_event_is_frozen() -> None:
    event = HistoryEvent(kind="history_window", session_key="k", message_count=0, bytes=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.bytes = 1  # type: ignore[misc]
