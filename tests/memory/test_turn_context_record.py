"""The per-turn context record (what a turn's invocation was given), as pure functions."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from touba.memory import KeyEventsConfig, MemoryConfig, StoredTurn, select_prior_turns
from touba.memory._model import KeyEvent, KeyEventStatus
from touba.memory._turn_context import (
    NOT_RECORDED,
    UNKNOWN_FORMAT,
    describe_context,
    describe_history,
    describe_windows,
    given_context,
    human_bytes,
    turn_context,
)
from touba.providers._types import TraceCall
from touba.runtime._trace import Trace

AT = datetime(2026, 12, 7, 8, 20, tzinfo=UTC)


def stored(index: int, calls: int = 0) -> StoredTurn:
    trace = (
        (tuple(TraceCall(f"c{index}-{i}", "lookup", {}, "ok", result=1) for i in range(calls)),)
        if calls
        else ()
    )
    return StoredTurn("s", index, f"user {index}", (f"reply {index}",), trace, None, AT)


def event(n: int, status: KeyEventStatus = "open") -> KeyEvent:
    return KeyEvent(
        f"ke_{n}",
        "user:u",
        "refund",
        f"title {n}",
        status,
        "secret details",
        AT,
        AT,
        "s",
    )


def given(**options: object) -> dict[str, object]:
    base: dict[str, object] = {
        "mode": "live",
        "config": MemoryConfig(short_term_turns=2, full_context_turns=1),
        "source": "program",
    }
    return given_context(**(base | options))  # type: ignore[arg-type]


# -- settings ------------------------------------------------------------------------------


def test_settings_and_their_source_are_recorded_saved_in_the_panel() -> None:
    config = MemoryConfig(
        short_term_turns=1,
        full_context_turns=0,
        key_events=KeyEventsConfig(enabled=True, types=("refund",)),
    )
    record = given(config=config, source="saved", saved_at=AT, saved_by="operator")
    assert record["version"] == 1
    assert record["settings"] == {
        "short_term_turns": 1,
        "full_context_turns": 0,
        "key_events": {"enabled": True, "types": ["refund"]},
        "source": "saved",
        "saved_at": "2026-12-07T08:20:00+00:00",
        "saved_by": "operator",
    }
    line = describe_context(record)
    assert "short-term memory 1 turn, saved in the panel 2026-12-07 08:20 UTC" in line
    assert json.loads(json.dumps(record)) == record  # plain JSON


@pytest.mark.parametrize(
    ("source", "saved_by", "words"),
    [
        ("program", None, "short-term memory 2 turns (1 with full trace), from the program"),
        ("defaults", None, "touba's defaults"),
        ("saved", "billing-api", "saved by billing-api 2026-12-07 10:20 UTC+02:00"),
    ],
)
def test_each_source_is_said(source: str, saved_by: str | None, words: str) -> None:
    at = AT.astimezone(timezone(timedelta(hours=2))) if saved_by else None
    assert words in describe_context(given(source=source, saved_at=at, saved_by=saved_by))


def test_bad_source_or_naive_time_is_refused() -> None:
    with pytest.raises(ValueError, match="source"):
        given(source="panel")
    with pytest.raises(ValueError, match="timezone-aware"):
        given(source="saved", saved_at=datetime(2026, 1, 1))


# -- earlier turns ---------------------------------------------------------------------------


def test_turns_given_are_the_window_the_session_sends_with_their_trace_layer() -> None:
    recent = [stored(i, calls=i % 2) for i in range(5)]
    config = MemoryConfig(short_term_turns=3, full_context_turns=2)
    record = given(config=config, recent=recent)
    assert record["turns"] == [
        {"number": 3, "full_trace": False, "calls": 0},
        {"number": 4, "full_trace": True, "calls": 1},
        {"number": 5, "full_trace": True, "calls": 0},
    ]
    sent = select_prior_turns(recent, 3, 2)  # the same window as the session sends
    assert [t.user for t in sent] == [f"user {n - 1}" for n in (3, 4, 5)]
    assert [bool(t.trace) for t in sent] == [False, True, False]
    line = describe_context(record)
    assert line.startswith(
        "given turns 3 (text only), 4 (full trace), 5 (full trace, no tool call)"
    )


def test_no_earlier_turn_and_zero_short_term_memory() -> None:
    record = given(config=MemoryConfig(short_term_turns=0, full_context_turns=0), recent=[])
    assert record["turns"] == []
    assert describe_context(record).startswith("given no earlier turn; short-term memory 0 turns")
    one = given(
        config=MemoryConfig(short_term_turns=1, full_context_turns=1), recent=[stored(1, calls=2)]
    )
    assert describe_context(one).startswith("given turn 2 (full trace); short-term memory 1 turn")


# -- key events and the system prompt ---------------------------------------------------------


def test_key_events_injected_are_listed_by_id_title_status_never_details() -> None:
    config = MemoryConfig(key_events=KeyEventsConfig(enabled=True, types=("refund",)))
    record = given(
        config=config,
        key_events=[event(1), event(2, "in_progress")],
        agent_instructions="Be brief.",
        injected="[block]é",
    )
    assert record["key_events"] == [
        {"id": "ke_1", "type": "refund", "title": "title 1", "status": "open"},
        {"id": "ke_2", "type": "refund", "title": "title 2", "status": "in_progress"},
    ]
    assert "secret details" not in json.dumps(record)
    assert record["system_prompt"] == {"bytes": 9 + 2 + 9, "agent_bytes": 9, "key_events_bytes": 9}
    assert describe_context(record).endswith("key events: ke_1 (open), ke_2 (in_progress)")
    details = describe_windows(record)
    assert details[0] == "system prompt 20 B (agent instructions 9 B, key events block 9 B)"
    assert "key event ke_2 [refund] title 2 (in_progress)" in details


def test_key_events_switch_off_and_none_open() -> None:
    assert describe_context(given()).endswith("key events: off")
    on = MemoryConfig(key_events=KeyEventsConfig(enabled=True, types=("refund",)))
    assert describe_context(given(config=on)).endswith("key events: none open")


def test_preview_is_blank_memory_whatever_was_read() -> None:
    config = MemoryConfig(key_events=KeyEventsConfig(enabled=True, types=("refund",)))
    record = given(
        mode="preview", config=config, recent=[stored(0)], key_events=[event(1)], injected="x"
    )
    assert record["mode"] == "preview"
    assert record["turns"] == []
    assert record["key_events"] == []
    assert record["key_events_active"] is False
    assert record["system_prompt"]["key_events_bytes"] == 0  # type: ignore[index]
    assert describe_context(record).startswith("preview: blank memory")


def test_a_turn_without_record_or_with_a_foreign_one_says_so() -> None:
    assert describe_context(None) == NOT_RECORDED
    assert describe_windows(None) == []
    assert describe_context({"given_turns": [2]}) == UNKNOWN_FORMAT
    assert describe_context({"version": True}) == UNKNOWN_FORMAT
    later = {**given(), "version": 2, "something_new": 1}  # a later version: known keys read
    assert describe_context(later).startswith("given no earlier turn; short-term memory 2")


# -- windows, from the trace -------------------------------------------------------------------


def history(trace: Trace, invocation: str, event: str, **fields: object) -> None:
    trace.add("history_event", "run", invocation, "support", event=event, **fields)


def test_windows_are_read_per_decision_with_trims_summaries_and_guard_counts() -> None:
    trace = Trace()
    key = "th1:abc:def"
    trace.add("invocation_started", "run", "inv", "support", input="hi")
    # decision 1: a plain window
    history(trace, "inv", "history_window", session_key=key, message_count=2, bytes=300)
    trace.add("decision", "run", "inv", "support", number=1, calls=[], input_tokens=120)
    # a delegate's decision between them is not this invocation's
    history(trace, "child", "history_window", session_key="th1:other", message_count=9, bytes=9)
    trace.add("decision", "run", "child", "helper", number=1, calls=[])
    # decision 2: summarised, trimmed, then the guard counted three times
    history(
        trace,
        "inv",
        "decision_history_summary",
        session_key=key,
        message_count=6,
        bytes=2048,
        covered_exchanges=4,
        summary_bytes=512,
    )
    history(
        trace,
        "inv",
        "history_trimmed",
        session_key=key,
        message_count=6,
        bytes=2048,
        removed_exchanges=4,
        removed_messages=8,
        removed_bytes=4096,
    )
    history(trace, "inv", "history_window", session_key=key, message_count=6, bytes=2048)
    for count, fits, messages in ((9000, False, 6), (7000, True, 4), (5000, True, 2)):
        history(
            trace,
            "inv",
            "provider_context_count",
            session_key=key,
            message_count=messages,
            bytes=100 * messages,
            provider="openai",
            count=count,
            reserve=int(count * 1.2) + 512,
            window=10000,
            fits=fits,
        )
    trace.add("decision", "run", "inv", "support", number=2, calls=[])
    # decision 3: the summariser failed, then the provider failed
    history(
        trace, "inv", "decision_history_summary_failed", session_key=key, message_count=1, bytes=1
    )
    history(trace, "inv", "history_window", session_key=key, message_count=1, bytes=10)
    trace.add("provider_error", "run", "inv", "support", error_code="provider_unavailable")

    record = turn_context(given(), trace, "inv", retained=True)
    assert record["conversation_key"] == key
    assert record["decision_history"] == "retained"
    first, second, third = record["windows"]
    assert first == {"decision": 1, "messages": 2, "bytes": 300, "input_tokens": 120}
    assert second == {
        "decision": 2,
        "messages": 6,
        "bytes": 2048,
        "summary": {"covered_exchanges": 4, "bytes": 512, "new": True},
        "trimmed": {"exchanges": 4, "messages": 8, "bytes": 4096},
        "guard": {
            "counts": 3,
            "tokens": 7000,
            "reserve": 8912,
            "window": 10000,
            "fits": True,
            "messages": 4,
            "bytes": 400,
        },
    }
    assert third == {
        "decision": None,
        "messages": 1,
        "bytes": 10,
        "summary_failed": True,
        "error": "provider_unavailable",
    }
    lines = describe_windows(record)
    assert (
        "decision 1: history window 2 messages, 300 B; provider reported 120 input tokens" in lines
    )
    assert (
        "decision 2: history window 6 messages, 2 KiB; trimmed 4 exchanges (8 messages, "
        "4 KiB); new summary of 4 exchanges (512 B); guard: 7000 tokens counted, reserve "
        "8912 of 10000 (fits; 3 counts)"
    ) in lines
    assert (
        "failed decision: history window 1 message, 10 B; summary failed, trimmed plainly; "
        "error provider_unavailable"
    ) in lines
    assert {k: record[k] for k in given()} == given()  # the given part, unchanged


def test_a_provider_without_history_gives_decisions_without_window() -> None:
    trace = Trace()
    trace.add("decision", "run", "inv", "support", number=1, calls=[])
    trace.add("provider_error", "run", "inv", "support", error_code="provider_unavailable")
    record = turn_context(given(), trace, "inv", retained=False)
    assert record["windows"] == [
        {"decision": 1},
        {"decision": None, "error": "provider_unavailable"},
    ]
    assert record["conversation_key"] is None
    lines = describe_windows(record)
    assert "decision 1: no history window (the provider keeps no decision history)" in lines
    assert describe_history(record) == ("no decision history (its provider keeps none)")
    assert describe_history({**record, "conversation_key": "th1:k"}) == (
        "decision history deleted when the turn was stored (retain_decision_history=False)"
    )
    assert describe_history(
        {**record, "conversation_key": "th1:k", "decision_history": "retained"}
    ) == ("decision history retained: conversation th1:k")
    assert describe_history(None) is None


def test_a_guard_that_never_fit_records_its_last_count() -> None:
    trace = Trace()
    history(trace, "inv", "history_window", session_key="k", message_count=3, bytes=30)
    history(
        trace, "inv", "provider_context_count", session_key="k", message_count=1, bytes=3,
        count=20000, reserve=24512, window=10000, fits=False,
    )  # fmt: skip
    trace.add("provider_error", "run", "inv", "support", error_code="context_window_exceeded")
    (window,) = turn_context(given(), trace, "inv", retained=True)["windows"]
    assert window["guard"]["fits"] is False
    assert window["guard"]["tokens"] == 20000
    assert "(does not fit; 1 count)" in describe_windows({"windows": [window]})[0]


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 32 * 1024 * 1024)] == [
        "0 B",
        "1023 B",
        "1 KiB",
        "1.5 KiB",
        "32 MiB",
    ]
