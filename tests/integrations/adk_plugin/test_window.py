"""ToubaContextPlugin's window on built LlmRequests: whole exchanges, confirmations, bounds."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from google.genai import types
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.integrations.adk_plugin._build import (
    callback_context,
    calls,
    confirmation_answer,
    confirmation_call,
    model,
    request,
    results,
    user,
)
from touba.errors import (
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
)
from touba.integrations.adk import ToubaContextPlugin
from touba.integrations.adk._plugin import trim_contents


def _is_input(content: types.Content) -> bool:
    return content.role == "user" and not any(p.function_response for p in content.parts or [])


def _weight(content: types.Content) -> int:
    return len(content.model_dump_json(exclude_none=True, by_alias=True).encode())


def assert_whole(window: Sequence[types.Content]) -> None:
    """Every call answered by the contents right after it, every response with its call."""
    open_calls: list[str] = []
    for content in window:
        parts = content.parts or []
        responses = [p.function_response for p in parts if p.function_response]
        made = [p.function_call for p in parts if p.function_call]
        if responses:
            for response in responses:
                assert response.name in open_calls, f"response {response.name} without its call"
                open_calls.remove(response.name)
        else:
            assert not open_calls, f"calls {open_calls} never answered in the window"
        open_calls.extend(c.name or "" for c in made if c.name != "adk_request_confirmation")
    assert not open_calls, f"calls {open_calls} never answered in the window"


def conversation(turns: Sequence[Sequence[int]], pad: int = 0) -> list[types.Content]:
    """One turn per item: a user input, then exchanges of that many parallel calls, a reply."""
    out: list[types.Content] = []
    for t, exchanges in enumerate(turns):
        out.append(user(f"question {t}"))
        for e, width in enumerate(exchanges):
            names = [f"tool_{t}_{e}_{k}" for k in range(width)]
            out.append(calls(*names))
            out.append(results(*names, pad=pad))
        out.append(model(f"answer {t}"))
    return out


def test_a_window_keeps_whole_turns_and_the_newest_input() -> None:
    contents = [*conversation([[1], [2, 1]]), user("now this")]
    window = trim_contents(contents, max_messages=6, max_bytes=None)
    # The newest input (not counted) and the last whole turn that fits in 6 messages.
    assert window == contents[4:]
    assert all(a is b for a, b in zip(window, contents[4:], strict=True))  # the same objects
    assert_whole(window)


def test_parallel_calls_travel_together() -> None:
    contents = [user("q"), calls("a", "b", "c"), results("a", "b"), results("c")]
    window = trim_contents(contents, max_messages=3, max_bytes=None)
    assert window == contents
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        trim_contents(contents, max_messages=2, max_bytes=None)
    assert caught.value.limit == "max_messages"


def test_responses_pair_by_id_when_ids_are_kept() -> None:
    contents = [
        user("q"),
        calls("lookup", "lookup", ids=["c1", "c2"]),
        results("lookup", "lookup", ids=["c2", "c1"]),
        user("next"),
    ]
    assert trim_contents(contents, max_messages=None, max_bytes=None) == contents
    wrong = [*contents[:2], results("lookup", "lookup", ids=["c2", "c9"]), contents[3]]
    # c9 answers nothing and c1 is never answered: the exchange is not sent.
    assert trim_contents(wrong, max_messages=None, max_bytes=None) == [contents[0], contents[3]]


def test_incomplete_exchanges_are_never_sent() -> None:
    orphan = results("gone")
    unanswered = calls("never")
    contents = [user("q"), orphan, model("a"), user("q2"), unanswered, user("q3")]
    window = trim_contents(contents, max_messages=None, max_bytes=None)
    assert orphan not in window
    assert unanswered not in window
    assert window == [contents[0], contents[2], contents[3], contents[5]]


def test_the_current_turn_keeps_its_last_exchange_and_drops_older_ones_first() -> None:
    contents = [user("old"), model("a"), user("q"), *conversation([[1, 1, 1]])[1:-1]]
    window = trim_contents(contents, max_messages=4, max_bytes=None)
    assert window == [contents[2], *contents[-4:]]
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        trim_contents(contents, max_messages=1, max_bytes=None)
    assert caught.value.limit == "max_messages"


def test_a_last_exchange_over_max_bytes_is_refused_never_sent_empty() -> None:
    contents = [user("q"), calls("big"), results("big", pad=5000)]
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        trim_contents(contents, max_messages=None, max_bytes=1000)
    assert caught.value.limit == "max_bytes"
    assert trim_contents(contents, max_messages=None, max_bytes=10_000) == contents


def test_nothing_whole_to_send_is_refused_typed() -> None:
    with pytest.raises(DecisionHistoryRecordInvalid):
        trim_contents([calls("x"), results("y")], max_messages=None, max_bytes=None)
    assert trim_contents([], max_messages=1, max_bytes=1) == []


def test_a_pending_confirmation_stays_with_its_call() -> None:
    contents = [
        user("old"),
        model("hi"),
        user("send 5"),
        calls("transfer", ids=["adk-1"]),
        results("transfer", ids=["adk-1"]),  # ADK's placeholder: "requires confirmation"
        confirmation_call("adk-2", "transfer", "adk-1"),
        user("meanwhile"),
        model("ok"),
        user("and now"),
    ]
    everything = trim_contents(contents, max_messages=None, max_bytes=None)
    assert everything == contents  # pending: not an unanswered call, sent with its exchange
    # The turn holding the pending confirmation goes whole or not at all.
    for bound in range(1, len(contents) + 1):
        window = trim_contents(contents, max_messages=bound, max_bytes=None)
        assert (contents[3] in window) == (contents[5] in window) == (contents[4] in window)
        assert window[-1] is contents[-1]


def test_an_answered_confirmation_joins_its_call_even_with_stripped_ids() -> None:
    contents = [
        user("send 5"),
        calls("transfer"),  # id stripped, as ADK does for Gemini
        results("transfer"),
        confirmation_call("adk-2", "transfer", "adk-1"),
        confirmation_answer("adk-2"),
    ]
    assert trim_contents(contents, max_messages=None, max_bytes=None) == contents
    with pytest.raises(DecisionHistoryLimitExceeded):
        trim_contents(contents, max_messages=3, max_bytes=None)  # 4 travel together


def test_a_confirmation_request_without_its_call_is_an_ordinary_call() -> None:
    request_alone = confirmation_call("adk-2", "transfer", "adk-1")
    contents = [user("q"), model("a"), request_alone, user("n")]
    window = trim_contents(contents, max_messages=None, max_bytes=None)
    assert request_alone not in window  # never answered: not sent
    answered = [*contents[:3], confirmation_answer("adk-2"), user("n")]
    assert trim_contents(answered, max_messages=None, max_bytes=None) == answered


def test_a_confirmation_answer_without_its_request_is_not_sent() -> None:
    contents = [user("q"), calls("t"), results("t"), confirmation_answer("adk-9"), user("n")]
    window = trim_contents(contents, max_messages=None, max_bytes=None)
    assert contents[3] not in window
    assert_whole(window)


def test_bad_bounds_are_refused_when_built() -> None:
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(ConfigurationError, match="max_messages"):
            ToubaContextPlugin(max_messages=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="max_bytes"):
            ToubaContextPlugin(max_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="together"):
        ToubaContextPlugin(max_tokens=100)
    with pytest.raises(ConfigurationError):
        ToubaContextPlugin(on_event="log")  # type: ignore[arg-type]


async def test_the_plugin_replaces_the_contents_and_keeps_the_static_prefix() -> None:
    prefix = types.Content(
        role="user",
        parts=[types.Part(inline_data=types.Blob(mime_type="image/png", data=b"\x89PNG"))],
    )
    history = conversation([[1], [1], [1]])
    contents = [prefix, *history, user("now")]
    llm_request = request(contents)
    llm_request._static_instruction_prefix_end_index = 1
    plugin = ToubaContextPlugin(max_messages=4, max_bytes=None)
    answer = await plugin.before_model_callback(
        callback_context=await callback_context(), llm_request=llm_request
    )
    assert answer is None
    assert llm_request.contents == [prefix, *history[-4:], contents[-1]]
    assert len(contents) == 1 + len(history) + 1  # the caller's list is not edited


_TURNS = st.lists(st.lists(st.integers(1, 3), max_size=3), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(
    turns=_TURNS,
    pending=st.booleans(),
    max_messages=st.integers(1, 30) | st.none(),
    max_bytes=st.integers(50, 4000) | st.none(),
)
def test_any_window_is_whole_bounded_and_ends_on_the_newest_input(
    turns: list[list[int]], pending: bool, max_messages: int | None, max_bytes: int | None
) -> None:
    contents = conversation(turns, pad=20)
    if pending:  # the current turn is a tool loop still going
        contents.pop()
    else:
        contents.append(user("the newest input"))
    newest = max(i for i, c in enumerate(contents) if _is_input(c))
    try:
        window = trim_contents(contents, max_messages=max_messages, max_bytes=max_bytes)
    except DecisionHistoryLimitExceeded:
        # Only when the newest input's last exchange alone is over a bound.
        last = contents[-2:]
        assert pending
        assert turns[-1]
        sizes = [_weight(c) for c in last]
        assert (max_messages is not None and max_messages < 2) or (
            max_bytes is not None and sum(sizes) > max_bytes
        )
        return
    positions = [next(i for i, c in enumerate(contents) if c is w) for w in window]
    assert positions == sorted(positions)  # a subsequence, in order
    assert any(w is contents[newest] for w in window)
    assert_whole(window)
    assert _is_input(window[0])  # it opens on a user input
    counted = [c for c in window if c is not contents[newest]]
    if max_messages is not None:
        assert len(counted) <= max_messages
    if max_bytes is not None:
        weights = [
            len(c.model_dump_json(exclude_none=True, by_alias=True).encode()) for c in counted
        ]
        assert sum(weights) <= max_bytes
    # Besides the newest input, what is sent is a suffix: what is left out is older.
    rest = [i for i in positions if i != newest]
    if rest:
        assert rest == [i for i in range(rest[0], len(contents)) if i != newest]


def _key(name: str | None, ident: str | None) -> tuple[str, str]:
    return ("id", ident) if ident else ("name", name or "")


def assert_paired(window: Sequence[types.Content]) -> None:
    """Each response sent answers an earlier call sent; each call sent is answered."""
    open_calls: list[tuple[str, str]] = []
    for content in window:
        for part in content.parts or []:
            call, response = part.function_call, part.function_response
            if call is not None:
                open_calls.append(_key(call.name, call.id))
            if response is not None:
                key = _key(response.name, response.id)
                assert key in open_calls, f"{key} sent without its call"
                open_calls.remove(key)
    pending = [k for k in open_calls if k[1] != "adk_request_confirmation" and "conf" not in k[1]]
    assert not pending, f"calls {pending} sent without their responses"


_NAMES = st.sampled_from(["a", "b"])
_IDS = st.sampled_from([None, "c1", "c2", "c3"])
_CONTENT = st.one_of(
    st.builds(lambda: user("hello")),
    st.builds(lambda: model("reply")),
    st.builds(lambda n, i, m, j: calls(n, m, ids=[i, j]), _NAMES, _IDS, _NAMES, _IDS),
    st.builds(lambda n, i: calls(n, ids=[i]), _NAMES, _IDS),
    st.builds(lambda n, i: results(n, ids=[i]), _NAMES, _IDS),
    st.builds(lambda n, i, m, j: results(n, m, ids=[i, j]), _NAMES, _IDS, _NAMES, _IDS),
    st.builds(lambda i: confirmation_call("conf1", "a", i or "c1"), _IDS),
    st.builds(lambda: confirmation_answer("conf1")),
)


@settings(max_examples=300, deadline=None)
@given(
    contents=st.lists(_CONTENT, max_size=14),
    max_messages=st.integers(1, 12) | st.none(),
)
def test_any_sequence_of_contents_never_sends_half_an_exchange(
    contents: list[types.Content], max_messages: int | None
) -> None:
    inputs = [i for i, c in enumerate(contents) if _is_input(c)]
    try:
        window = trim_contents(contents, max_messages=max_messages, max_bytes=None)
    except DecisionHistoryLimitExceeded:
        assert max_messages is not None  # the only bound given
        return
    except DecisionHistoryRecordInvalid:
        assert not inputs  # only when there is no input to send at all
        return
    positions = [next(i for i, c in enumerate(contents) if c is w) for w in window]
    assert positions == sorted(positions)
    assert len(set(positions)) == len(positions)
    if inputs:
        assert any(w is contents[inputs[-1]] for w in window)
    assert_paired(window)
