"""pydantic-ai conversations as a log of turns: the same windows as the whole list,
only the tail read, only the new messages written, version 1 records carried over."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from tests.integrations.conftest import Factory
from touba.errors import DecisionHistoryLimitExceeded, DecisionHistoryRecordInvalid
from touba.history import HistoryStore, MemoryHistoryStore
from touba.history._model import canonical_json
from touba.history._store import LogSnapshot, LogStore, StoreUsage
from touba.integrations._cut import UNBOUNDED
from touba.integrations.pydantic_ai import KIND, ToubaConversations, _window

# One run's messages, by kind: a user prompt (with a system prompt now and then), a
# response calling tools (answered, retried, or never answered), a text answer.
STEPS = st.lists(
    st.sampled_from(["user", "system", "call", "calls", "retry", "abandon", "text"]),
    min_size=1,
    max_size=6,
)
RUNS = st.lists(STEPS, min_size=1, max_size=8)
BOUNDS = st.sampled_from(
    [
        {},
        {"max_messages": 3},
        {"max_messages": 8},
        {"max_bytes": 600},
        {"max_messages": 5, "max_bytes": 900},
    ]
)


def _run(steps: Sequence[str], counter: list[int]) -> list[ModelMessage]:
    """The messages of one run (a response that calls is followed by its returns,
    except an abandoned one: an incomplete exchange)."""
    messages: list[ModelMessage] = []
    for step in steps:
        counter[0] += 1
        n = counter[0]
        if step in ("user", "system"):
            parts: list[Any] = [UserPromptPart(f"question {n} " + "q" * (n % 5) * 20)]
            if step == "system":
                parts.insert(0, SystemPromptPart(f"be brief {n}"))
            messages.append(ModelRequest(parts=parts))
        elif step == "text":
            messages.append(ModelResponse(parts=[TextPart(f"answer {n} " + "é" * (n % 4))]))
        elif step == "abandon":
            messages.append(ModelResponse(parts=[ToolCallPart("lookup", {"n": n}, f"a{n}")]))
        else:
            ids = [f"c{n}"] + ([f"d{n}"] if step == "calls" else [])
            messages.append(ModelResponse(parts=[ToolCallPart("lookup", {"n": n}, i) for i in ids]))
            answers: list[Any] = [ToolReturnPart("lookup", f"order {n}", i) for i in ids]
            if step == "retry":
                answers = [ToolReturnPart("lookup", "bad order", ids[0], outcome="retried")]
            messages.append(ModelRequest(parts=answers))
    return messages


def _dumped(messages: Sequence[ModelMessage]) -> list[Any]:
    dumped: list[Any] = ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")
    return dumped


def _expected(messages: list[ModelMessage], bounds: dict[str, int]) -> list[Any] | str:
    """The window of the whole list (the version 1 path), or the bound it exceeds."""
    try:
        window = _window(
            messages,
            max_messages=bounds.get("max_messages", UNBOUNDED),
            max_bytes=bounds.get("max_bytes", UNBOUNDED),
            keep_pending_tail=True,
        )
    except DecisionHistoryLimitExceeded as e:
        return str(e.limit)
    return _dumped(window)


async def _loaded(conversations: ToubaConversations, name: str) -> list[Any] | str:
    try:
        async with conversations.open(name) as conversation:
            return _dumped(conversation.messages)
    except DecisionHistoryLimitExceeded as e:
        return str(e.limit)


async def _differential(store: HistoryStore, runs: list[list[str]], bounds: dict[str, int]) -> None:
    conversations = ToubaConversations(store, namespace="diff", **bounds)
    whole = ToubaConversations(_TransactOnly(MemoryHistoryStore()), namespace="diff", **bounds)
    name = uuid.uuid4().hex  # the store outlives one example
    counter = [0]
    every: list[ModelMessage] = []
    for steps in runs:
        new = _run(steps, counter)
        expected = _expected(every, bounds)
        assert await _loaded(conversations, name) == expected
        assert await _loaded(whole, name) == expected
        for target in (conversations, whole):
            try:
                async with target.open(name) as conversation:
                    conversation.extend(new)
            except DecisionHistoryLimitExceeded:
                async with ToubaConversations(target.store, namespace="diff").open(name) as c:
                    c.extend(new)  # unbounded: the run's messages are stored all the same
        every += new
    assert _dumped(await conversations.messages(name)) == _dumped(every)
    assert _dumped(await whole.messages(name)) == _dumped(every)
    assert await _loaded(conversations, name) == _expected(every, bounds)


class _TransactOnly:
    """A custom store: ``HistoryStore.transact`` only (no ``transact_log``)."""

    def __init__(self, inner: MemoryHistoryStore) -> None:
        self._inner = inner

    async def transact(self, key: str, operation: Any) -> Any:
        return await self._inner.transact(key, operation)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs=RUNS, bounds=BOUNDS)
async def test_the_log_loads_the_window_of_the_whole_list_in_ram(
    runs: list[list[str]], bounds: dict[str, int]
) -> None:
    assert not isinstance(_TransactOnly(MemoryHistoryStore()), LogStore)
    await _differential(MemoryHistoryStore(), runs, bounds)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(runs=RUNS, bounds=BOUNDS)
async def test_the_log_loads_the_window_of_the_whole_list_on_each_store(
    store: Any, runs: list[list[str]], bounds: dict[str, int]
) -> None:
    await _differential(store, runs, bounds)


class _Reads:
    """A built-in store whose snapshots note which exchanges an operation reads, and
    whose writes note what they append (the store itself does the work)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.read: list[tuple[int, int]] = []
        self.sized: list[int] = []
        self.appended: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def transact(self, key: str, operation: Any) -> Any:
        return await self.inner.transact(key, operation)

    async def transact_log(self, key: str, operation: Any) -> Any:
        notes = self

        class Seen:
            def __init__(self, snapshot: LogSnapshot) -> None:
                self._snapshot = snapshot
                self.head = snapshot.head
                self.exchange_count = snapshot.exchange_count

            async def sizes(self, start: int) -> Any:
                notes.sized.append(start)
                return await self._snapshot.sizes(start)

            async def exchanges(self, start: int, stop: int) -> Any:
                notes.read.append((start, stop))
                return await self._snapshot.exchanges(start, stop)

        async def seen(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
            write, result = await operation(None if snapshot is None else Seen(snapshot), usage)
            if write is not None:
                notes.appended.append(len(write.append))
            return write, result

        return await self.inner.transact_log(key, seen)


async def test_a_run_reads_the_tail_and_appends_only_its_messages(store: Any) -> None:
    spy = _Reads(store)
    assert isinstance(spy, LogStore)
    conversations = ToubaConversations(spy, namespace="tail", max_messages=6)
    counter = [0]
    for _ in range(40):  # 40 turns of a prompt, two tool exchanges and an answer
        async with conversations.open("long") as conversation:
            conversation.extend(_run(["user", "call", "calls", "text"], counter))
    spy.read.clear()
    spy.sized.clear()
    spy.appended.clear()
    async with conversations.open("long") as conversation:
        assert len(conversation.messages) == 6  # the last turn: an earlier one does not fit
        conversation.extend(_run(["user", "text"], counter))
    assert spy.read == [(39, 40)]  # the last turn only
    assert spy.sized == [40 - 1 - 6]  # the sizes of the six turns before it, at most
    assert spy.appended == [2]  # the two new messages, nothing rewritten
    spy.read.clear()
    wider = ToubaConversations(spy, namespace="tail", max_messages=14)
    async with wider.open("long") as conversation:  # two whole turns, then the last one
        assert len(conversation.messages) == 6 + 6 + 2
    assert spy.read == [(40, 41), (38, 40)]
    everything = await conversations.messages("long")
    assert len(everything) == 40 * 6 + 2


async def test_a_version_1_record_is_read_whole_then_kept_as_a_log(store: Any) -> None:
    conversations = ToubaConversations(store, namespace="old", max_messages=4)
    key = conversations.key("legacy")
    counter = [0]
    old = _run(["system", "call", "text", "user", "abandon", "user", "calls", "text"], counter)
    record = {
        "kind": KIND,
        "version": 1,
        "namespace": "old",
        "conversation_id": "legacy",
        "items": _dumped(old),
        "bytes": 1,
        "created_at": "2026-01-01T00:00:00+00:00",
        "updated_at": "2026-01-01T00:00:00+00:00",
    }

    async def put(_: Any) -> tuple[Any, None]:
        return record, None

    await store.transact(key, put)
    expected = _expected(old, {"max_messages": 4})
    assert await _loaded(conversations, "legacy") == expected
    new = _run(["user", "text"], counter)
    async with conversations.open("legacy") as conversation:
        conversation.extend(new)
    stored = await store.read(key)
    assert stored["version"] == 2
    assert stored["created_at"] == record["created_at"]
    assert [m for turn in stored["exchanges"] for m in turn] == _dumped([*old, *new])
    assert len(stored["exchanges"]) == 4  # one stored exchange per turn
    assert await _loaded(conversations, "legacy") == _expected([*old, *new], {"max_messages": 4})


async def test_a_refused_save_keeps_the_log_as_it_was(store: Any) -> None:
    conversations = ToubaConversations(store, namespace="full", max_retained_bytes=2_000)
    counter = [0]
    async with conversations.open("c") as conversation:
        conversation.extend(_run(["user", "text"], counter))
    before = await conversations.messages("c")
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        async with conversations.open("c") as conversation:
            conversation.extend(_run(["user", "call", "call", "call", "call", "text"] * 3, counter))
    assert caught.value.limit == "max_retained_bytes"
    assert _dumped(await conversations.messages("c")) == _dumped(before)
    async with conversations.open("c") as conversation:  # and it is free again
        assert _dumped(conversation.messages) == _dumped(before)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("incomplete", [[1, "x", 0]]),
        ("system", "none"),
        ("messages", -1),
        ("version", 3),
        ("exchanges", [[{"kind": "request", "parts": [{"part_kind": "x", "content": "SECRET"}]}]]),
    ],
)
async def test_a_corrupt_head_is_refused_and_left_alone(
    store_factory: Factory, field: str, value: Any
) -> None:
    async with store_factory() as store:
        conversations = ToubaConversations(store, namespace="bad")
        async with conversations.open("c") as conversation:
            conversation.extend(_run(["user", "text"], [0]))
        key = conversations.key("c")
        record = await store.read(key)
        record[field] = value

        async def put(_: Any) -> tuple[Any, None]:
            return record, None

        await store.transact(key, put)
        with pytest.raises(DecisionHistoryRecordInvalid) as caught:
            async with conversations.open("c"):
                pass
        assert "SECRET" not in str(caught.value)  # no stored content in the error
        assert caught.value.__cause__ is None
        with pytest.raises(DecisionHistoryRecordInvalid):
            await conversations.messages("c")
        assert await store.read(key) == record


async def test_system_prompts_of_turns_left_out_open_the_window() -> None:
    conversations = ToubaConversations(MemoryHistoryStore(), namespace="sys", max_messages=2)
    counter = [0]
    for steps in (["system", "text"], ["user", "text"], ["user", "call"]):
        async with conversations.open("c") as conversation:
            conversation.extend(_run(steps, counter))
    async with conversations.open("c") as conversation:
        window = conversation.messages
    assert isinstance(window[0], ModelRequest)
    assert [type(p).__name__ for p in window[0].parts] == ["SystemPromptPart", "UserPromptPart"]
    assert window[0].parts[0].content == "be brief 1"  # type: ignore[union-attr]
    assert len(window) == 3  # the last prompt (pinned), then the call and its return


async def test_a_window_bounded_by_bytes_alone_reads_sizes_back_only_as_far_as_it_reaches(
    store: Any,
) -> None:
    spy = _Reads(store)
    counter = [0]
    every: list[ModelMessage] = []
    unbounded = ToubaConversations(spy, namespace="bytes")
    for _ in range(100):  # 100 turns of a prompt and an answer
        run = _run(["user", "text"], counter)
        async with unbounded.open("c") as conversation:
            conversation.extend(run)
        every += run
    turn_bytes = len(canonical_json(_dumped(every[-2:])[0])) + len(
        canonical_json(_dumped(every[-1:])[0])
    )
    for turns, sized in ((5, [100 - 1 - 16]), (40, [83, 35]), (90, [83, 35, 0])):
        spy.sized.clear()
        bounded = ToubaConversations(spy, namespace="bytes", max_bytes=turns * turn_bytes + 40)
        assert await _loaded(bounded, "c") == _expected(
            every, {"max_bytes": turns * turn_bytes + 40}
        )
        assert spy.sized == sized  # 16 turns back, then 4 times as many, while they all fit


async def test_extend_refuses_what_is_not_a_model_message_and_adds_nothing() -> None:
    conversations = ToubaConversations(MemoryHistoryStore(), namespace="bad")
    first = _run(["user", "text"], [0])
    async with conversations.open("c") as conversation:
        conversation.extend(first)
        bad: list[Any] = [*_run(["user"], [5]), {"kind": "request", "parts": []}]
        with pytest.raises(TypeError, match="message 1 is a dict"):
            conversation.extend(bad)
    assert _dumped(await conversations.messages("c")) == _dumped(first)
