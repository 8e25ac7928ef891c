"""``DecisionHistory.step`` over ``MemoryHistoryStore`` (SPEC sections 1, 3, 5, 6).

``generate`` is a test double of the provider: a plain async function that
records the window it was given and returns a ``DecisionMessage``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryMismatch,
    DecisionHistoryRecordInvalid,
    DecisionHistorySummaryInvalid,
)
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DataMessage,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryEvent,
    HistoryWindow,
    MemoryHistoryStore,
    Observation,
    ResultMessage,
    SummaryMessage,
    SummaryRequest,
)
from touba.history._model import message_to_dict
from touba.history._store import LogOperation, LogSnapshot, LogWrite, Operation, StoreUsage
from touba.history._window import ExchangeSize

NS = "tenant-a"
Record = dict[str, Any]

EVENT_FIELDS = {
    "history_window": set(),
    "history_trimmed": {"removed_exchanges", "removed_messages", "removed_bytes"},
    "decision_history_summary": {"covered_exchanges", "fingerprint", "summary_bytes"},
    "decision_history_summary_failed": set(),
    "resumed_without_messages": set(),
}
COMMON_FIELDS = {"kind", "session_key", "message_count", "bytes"}


# -- doubles and helpers ------------------------------------------------------------------


def ident(**fields: str) -> ConversationIdentity:
    base = {
        "namespace": NS,
        "provider": "openai",
        "model": "gpt-4.1-mini",
        "decision_interface": "native",
        "run_id": "run-1",
        "invocation_id": "inv-1",
        "agent_ref": "agents/support",
    }
    base.update(fields)
    return ConversationIdentity(**base)


@dataclass
class Provider:
    """A scripted provider: returns its decisions in order, records each window."""

    decisions: list[DecisionMessage]
    windows: list[HistoryWindow] = field(default_factory=list)

    async def __call__(self, window: HistoryWindow) -> DecisionMessage:
        self.windows.append(window)
        return self.decisions.pop(0)


def calls(prefix: str, *names: str) -> tuple[CapabilityCall, ...]:
    return tuple(
        CapabilityCall(f"{prefix}-{i}", name, {"query": f"{prefix} raw {i}"})
        for i, name in enumerate(names)
    )


def decide(*made: CapabilityCall, text: str | None = None) -> DecisionMessage:
    return DecisionMessage(text=text, calls=made, provider="openai", opaque={"sig": "s"})


def answer(made: Sequence[CapabilityCall], result: Any = "done") -> list[Observation]:
    return [Observation(c.call_id, c.name, dict(c.arguments), "ok", result=result) for c in made]


def measure(data: Any) -> int:
    return len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


def dicts(window: HistoryWindow) -> list[list[Record]]:
    return [[message_to_dict(m) for m in exchange] for exchange in window.exchanges]


def weight(exchanges: Sequence[Sequence[Record]]) -> tuple[int, int]:
    return (
        sum(len(ex) for ex in exchanges),
        sum(measure(m) for ex in exchanges for m in ex),
    )


def window_weight(window: HistoryWindow) -> tuple[int, int]:
    messages = window.messages
    return len(messages), sum(measure(message_to_dict(m)) for m in messages)


def sha(previous: str | None, exchanges: Sequence[Sequence[Record]]) -> str:
    digest = hashlib.sha256()
    if previous:
        digest.update(previous.encode("ascii"))
    digest.update(json.dumps(exchanges, ensure_ascii=False, separators=(",", ":")).encode())
    return "sha256:" + digest.hexdigest()


def projected(exchange: Sequence[Record]) -> tuple[Record, ...]:
    return tuple({k: v for k, v in m.items() if k not in ("opaque", "provider")} for m in exchange)


def assert_paired(exchanges: Sequence[Sequence[Record]]) -> None:
    """Each exchange is a decision followed by exactly the results of its calls."""
    for exchange in exchanges:
        head, *rest = exchange
        if head["kind"] == "data":
            assert rest == []
            continue
        assert head["kind"] == "decision"
        wanted = [(c["call_id"], c["name"]) for c in head.get("calls", [])]
        assert [m["kind"] for m in rest] == ["result"] * len(rest)
        assert [(m["call_id"], m["name"]) for m in rest] == wanted


def assert_no_content(events: Sequence[HistoryEvent], *secrets: str) -> None:
    for event in events:
        data = event.to_dict()
        assert set(data) == COMMON_FIELDS | EVENT_FIELDS[event.kind]
        for value in data.values():
            for secret in secrets:
                assert secret not in str(value)


class Env:
    def __init__(self, **config: Any) -> None:
        self.store = MemoryHistoryStore()
        self.events: list[HistoryEvent] = []
        self.history = DecisionHistory(
            HistoryConfig(store=self.store, namespace=NS, on_event=self.events.append, **config)
        )
        self.identity = ident()
        self.key = self.identity.key

    async def step(
        self, observations: Sequence[Observation], decision: DecisionMessage
    ) -> HistoryWindow:
        provider = Provider([decision])
        self.events.clear()
        await self.history.step(self.identity, observations, provider)
        return provider.windows[0]

    async def read(self) -> Record | None:
        return await self.store.read(self.key)

    def of_kind(self, kind: str) -> list[HistoryEvent]:
        return [e for e in self.events if e.kind == kind]


async def put(store: MemoryHistoryStore, key: str, record: Record) -> None:
    async def operation(snapshot: Record | None) -> tuple[Record | None, None]:
        return record, None

    await store.transact(key, operation)


async def never(window: HistoryWindow) -> DecisionMessage:
    raise AssertionError("generate must not be called")


# -- the window: complete exchanges, oldest first out --------------------------------------


async def test_first_decision_sees_an_empty_window_and_is_stored() -> None:
    env = Env()
    first = decide(*calls("a", "lookup"), text="let me look")
    window = await env.step([], first)
    assert window.exchanges == ()
    assert window.summary is None
    assert [e.to_dict() for e in env.events] == [
        {"kind": "history_window", "session_key": env.key, "message_count": 0, "bytes": 0}
    ]
    record = await env.read()
    assert record is not None
    assert record["exchanges"] == [[message_to_dict(first)]]
    assert record["pending"] == [{"call_id": "a-0", "name": "lookup"}]
    assert record["identity"] == env.identity.as_dict()
    assert record["version"] == 1


async def test_results_join_the_decision_they_answer() -> None:
    env = Env()
    first = decide(*calls("a", "lookup", "fetch"))
    await env.step([], first)
    window = await env.step(answer(first.calls, {"rows": [1, 2]}), decide(text="done"))
    assert len(window.exchanges) == 1
    decision, *results = window.exchanges[0]
    assert decision == first
    assert all(isinstance(r, ResultMessage) for r in results)
    assert [(r.call_id, r.result) for r in results if isinstance(r, ResultMessage)] == [
        ("a-0", {"rows": [1, 2]}),
        ("a-1", {"rows": [1, 2]}),
    ]
    assert window.sizes == (ExchangeSize(3, weight(dicts(window))[1]),)


async def test_parallel_calls_stay_together_and_never_split() -> None:
    # 4 + 2 messages do not fit 5: the older exchange leaves whole, not 1 of its results.
    env = Env(max_messages=5)
    first = decide(*calls("a", "f", "g", "h"))
    await env.step([], first)
    second = decide(*calls("b", "f"))
    window = await env.step(answer(first.calls), second)
    assert [len(ex) for ex in window.exchanges] == [4]
    window = await env.step(answer(second.calls), decide())
    assert [len(ex) for ex in window.exchanges] == [2]
    assert window.exchanges[0][0] == second
    assert_paired(dicts(window))
    trimmed = env.of_kind("history_trimmed")
    assert [(e.removed_exchanges, e.removed_messages) for e in trimmed] == [(1, 4)]


async def test_oldest_exchanges_leave_first_and_stay_retained() -> None:
    env = Env(max_messages=4)
    made: tuple[CapabilityCall, ...] = ()
    for i in range(10):
        decision = decide(*calls(f"d{i}", "lookup"))
        window = await env.step(answer(made, f"result {i}"), decision)
        made = decision.calls
    # Two exchanges of two messages fit 4: the last two complete ones.
    assert [ex[0]["calls"][0]["call_id"] for ex in dicts(window)] == ["d7-0", "d8-0"]
    record = await env.read()
    assert record is not None
    assert len(record["exchanges"]) == 10
    assert [ex[0]["calls"][0]["call_id"] for ex in record["exchanges"]] == [
        f"d{i}-0" for i in range(10)
    ]
    assert record["stats"]["exchanges"] == 10
    assert record["stats"]["messages"] == 19
    assert record["stats"]["bytes"] == weight(record["exchanges"])[1]


async def test_trimming_depends_on_bytes_too() -> None:
    # Each exchange here weighs 547 bytes: two fit 1200, three do not.
    env = Env(max_bytes=1_200)
    made: tuple[CapabilityCall, ...] = ()
    for i in range(4):
        decision = decide(*calls(f"d{i}", "lookup"))
        window = await env.step(answer(made, "x" * 300), decision)
        made = decision.calls
    assert window.sizes == (ExchangeSize(2, 547), ExchangeSize(2, 547))
    assert window_weight(window) == (4, 1_094)
    assert env.of_kind("history_trimmed")[0].removed_exchanges == 1


async def test_text_only_and_final_decisions_need_no_observations() -> None:
    env = Env()
    await env.step([], decide(text="thinking"))
    await env.step([], DecisionMessage(final=True, output={"answer": 42}))
    window = await env.step([], decide(text="next turn"))
    assert [len(ex) for ex in window.exchanges] == [1, 1]
    assert window.exchanges[-1][0] == DecisionMessage(final=True, output={"answer": 42})


async def test_async_event_callback_is_awaited_and_a_failing_one_is_ignored() -> None:
    seen: list[str] = []

    async def on_event(event: HistoryEvent) -> None:
        await asyncio.sleep(0)
        seen.append(event.kind)

    store = MemoryHistoryStore()
    history = DecisionHistory(HistoryConfig(store=store, namespace=NS, on_event=on_event))
    await history.step(ident(), [], Provider([decide()]))
    assert seen == ["history_window"]

    def broken(event: HistoryEvent) -> None:
        raise RuntimeError("host bug")

    history = DecisionHistory(HistoryConfig(store=store, namespace=NS, on_event=broken))
    await history.step(ident(run_id="run-2"), [], Provider([decide()]))
    assert await store.read(ident(run_id="run-2").key) is not None


async def test_identity_namespace_must_match_the_history() -> None:
    env = Env()
    with pytest.raises(ConfigurationError):
        await env.history.step(ident(namespace="other"), [], never)


async def test_without_a_store_a_private_memory_store_is_used() -> None:
    history = DecisionHistory(HistoryConfig())
    identity = ident(namespace=history.namespace)
    first = decide(*calls("a", "f"))
    await history.step(identity, [], Provider([first]))
    provider = Provider([decide()])
    await history.step(identity, answer(first.calls), provider)
    assert len(provider.windows[0].exchanges) == 1


# -- random conversations: the invariants of every step ------------------------------------

SECRET = "SECRET"


@dataclass(frozen=True)
class Turn:
    calls: int
    result_sizes: tuple[int, ...]
    text: bool
    final: bool


# Mostly bounds that hold a full exchange (4 calls + decision), sometimes not.
message_bounds = st.sampled_from([1, 2, 3, 5, 5, 6, 6, 7, 8, 9, 10, 12, 14])
turns = st.builds(
    Turn,
    calls=st.integers(min_value=0, max_value=4),
    result_sizes=st.tuples(*[st.sampled_from([0, 0, 5, 5, 40, 40, 120, 120, 400, 1_500])] * 4),
    text=st.booleans(),
    final=st.booleans(),
)


def turn_decision(index: int, turn: Turn) -> DecisionMessage:
    made = tuple(
        CapabilityCall(f"c{index}-{j}", f"cap{j}", {"q": f"{SECRET}-arg-{index}"})
        for j in range(turn.calls)
    )
    return DecisionMessage(
        text=f"{SECRET}-text-{index}" if turn.text else None,
        calls=made,
        final=turn.final and not made,
        output={"v": SECRET} if turn.final and not made else None,
        provider="openai",
        opaque={"signature": f"{SECRET}-sig"},
    )


def turn_observations(made: Sequence[CapabilityCall], turn: Turn) -> list[Observation]:
    return [
        Observation(
            c.call_id,
            c.name,
            {"q": f"{SECRET}-projected"},
            "ok",
            result=SECRET + "x" * turn.result_sizes[j],
        )
        for j, c in enumerate(made)
    ]


def expected_limit(
    before: Record | None, observations: Sequence[Observation], config: HistoryConfig
) -> str | None:
    """SPEC section 3, independently: the last exchange must fit on its own."""
    last = list(before["exchanges"][-1]) if before else []
    last += [message_to_dict(ResultMessage.from_observation(o)) for o in observations]
    if not last:
        return None
    messages, size = weight([last])
    if messages > config.max_messages:
        return "max_messages"
    if size > config.max_bytes:
        return "max_bytes"
    return None


def check_events(
    env: Env, window: HistoryWindow, start: int, exchanges: list[list[Record]]
) -> None:
    count, size = window_weight(window)
    kinds = [e.kind for e in env.events]
    assert kinds.count("history_window") == 1
    assert kinds[-1] == "history_window"
    for event in env.events:
        assert event.session_key == env.key
        assert (event.message_count, event.bytes) == (count, size)
    trimmed = env.of_kind("history_trimmed")
    if start == 0:
        assert trimmed == []
    else:
        (event,) = trimmed
        removed = weight(exchanges[:start])
        assert event.removed_exchanges == start
        assert (event.removed_messages, event.removed_bytes) == removed
    assert_no_content(env.events, SECRET)


async def run_conversation(bounds: tuple[int, int], script: list[Turn]) -> None:
    env = Env(max_messages=bounds[0], max_bytes=bounds[1])
    config = env.history.config
    made: tuple[CapabilityCall, ...] = ()
    for index, turn in enumerate(script):
        observations = turn_observations(made, turn)
        decision = turn_decision(index, turn)
        before = await env.read()
        limit = expected_limit(before, observations, config)
        provider = Provider([decision])
        env.events.clear()
        if limit is not None:
            with pytest.raises(DecisionHistoryLimitExceeded) as caught:
                await env.history.step(env.identity, observations, provider)
            assert caught.value.limit == limit
            assert provider.windows == []
            assert await env.read() == before  # atomic: nothing written
            hypothesis.event(f"refused {limit}")
            # The key is free again: retry the same calls with the smallest results.
            observations = turn_observations(made, Turn(0, (0, 0, 0, 0), False, False))
            if expected_limit(before, observations, config) is not None:
                return
            hypothesis.event("went on after a refusal")
        await env.history.step(env.identity, observations, provider)
        (window,) = provider.windows
        after = await env.read()
        assert after is not None
        exchanges: list[list[Record]] = after["exchanges"]
        count = len(exchanges) - 1  # the exchanges before the new decision
        # Retained history only grows: earlier exchanges are untouched, the decision appended.
        if before is not None:
            assert exchanges[: count - 1] == before["exchanges"][:-1]
            last = before["exchanges"][-1]
            assert exchanges[count - 1][: len(last)] == last
        assert exchanges[-1] == [message_to_dict(decision)]
        # The window is a suffix of complete exchanges ending with the current one.
        sent = dicts(window)
        start = count - len(sent)
        assert sent == exchanges[start:count]
        if count:
            assert len(sent) >= 1
        assert_paired(sent)
        assert window.summary is None
        # Within both bounds, and maximal: one more exchange would break one.
        messages, size = weight(sent)
        assert messages <= config.max_messages
        assert size <= config.max_bytes
        assert window_weight(window) == (messages, size)
        assert window.size == ExchangeSize(messages, size)
        if start > 0:
            more = weight(exchanges[start - 1 : count])
            assert more[0] > config.max_messages or more[1] > config.max_bytes
        check_events(env, window, start, exchanges)
        hypothesis.event("trimmed" if start else "untrimmed")
        assert after["stats"] == {
            "exchanges": count + 1,
            "messages": weight(exchanges)[0],
            "bytes": weight(exchanges)[1],
        }
        made = decision.calls if not decision.final else ()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.tuples(message_bounds, st.integers(min_value=300, max_value=8_000)),
    st.lists(turns, min_size=3, max_size=14),
)
def test_every_step_keeps_the_window_rules(bounds: tuple[int, int], script: list[Turn]) -> None:
    asyncio.run(run_conversation(bounds, script))


# -- limits: refused atomically -------------------------------------------------------------


async def refused_step(
    env: Env, names: tuple[str, ...], result_size: int, limit: str
) -> tuple[CapabilityCall, ...]:
    """A decision with `calls(*names)`, then results of `result_size` bytes refused on `limit`:
    the stored record is left exactly as it was. Returns the calls still to answer."""
    first = decide(*calls(*names))
    await env.step([], first)
    before = await env.read()
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await env.history.step(env.identity, answer(first.calls, "x" * result_size), never)
    assert caught.value.limit == limit
    assert await env.read() == before
    return first.calls


async def test_last_exchange_over_max_bytes_is_refused_and_nothing_changes() -> None:
    env = Env(max_bytes=1_000)
    made = await refused_step(env, ("a", "lookup"), 2_000, "max_bytes")
    # The key is free and the conversation usable with a result that fits.
    window = await env.step(answer(made, "small"), decide())
    assert len(window.exchanges) == 1


async def test_last_exchange_over_max_messages_is_refused_first() -> None:
    # Over both bounds: max_messages is named.
    await refused_step(
        Env(max_messages=3, max_bytes=300), ("a", "f", "g", "h"), 1_000, "max_messages"
    )


async def test_max_retained_bytes_refuses_before_generating() -> None:
    await refused_step(Env(max_retained_bytes=600), ("a", "lookup"), 1_000, "max_retained_bytes")


async def test_max_retained_bytes_refuses_a_decision_too_large_to_keep() -> None:
    env = Env(max_retained_bytes=600)
    provider = Provider([decide(text="x" * 1_000)])
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await env.history.step(env.identity, [], provider)
    assert caught.value.limit == "max_retained_bytes"
    assert len(provider.windows) == 1
    assert await env.read() is None


# -- mismatches and unreadable records: never overwritten -----------------------------------


async def pending_env() -> tuple[Env, tuple[CapabilityCall, ...], Record]:
    env = Env()
    first = decide(*calls("a", "lookup", "fetch"))
    await env.step([], first)
    before = await env.read()
    assert before is not None
    return env, first.calls, before


def _missing(made: Sequence[CapabilityCall]) -> list[Observation]:
    return answer(made[:1])


def _extra(made: Sequence[CapabilityCall]) -> list[Observation]:
    return [*answer(made), Observation("a-9", "lookup", {}, "ok")]


def _renamed(made: Sequence[CapabilityCall]) -> list[Observation]:
    return [*answer(made[:1]), Observation(made[1].call_id, "delete_all", {}, "ok")]


def _duplicated(made: Sequence[CapabilityCall]) -> list[Observation]:
    return [*answer(made), *answer(made[:1])]


def _replaced(made: Sequence[CapabilityCall]) -> list[Observation]:
    return [*answer(made[:1]), Observation("a-9", made[1].name, {}, "ok")]


def _none(made: Sequence[CapabilityCall]) -> list[Observation]:
    return []


@pytest.mark.parametrize(
    "observations", [_missing, _extra, _renamed, _duplicated, _replaced, _none]
)
async def test_observations_disagreeing_with_pending_calls_are_a_mismatch(
    observations: Callable[[Sequence[CapabilityCall]], list[Observation]],
) -> None:
    env, made, before = await pending_env()
    with pytest.raises(DecisionHistoryMismatch) as caught:
        await env.history.step(env.identity, observations(made), never)
    assert type(caught.value) is DecisionHistoryMismatch
    assert await env.read() == before


async def test_observations_in_another_order_are_accepted_in_call_order() -> None:
    env, made, _ = await pending_env()
    window = await env.step(list(reversed(answer(made))), decide())
    assert [getattr(m, "call_id", None) for m in window.exchanges[0][1:]] == ["a-0", "a-1"]


async def test_observations_with_nothing_pending_are_a_mismatch() -> None:
    env = Env()
    await env.step([], decide(text="no calls"))
    before = await env.read()
    with pytest.raises(DecisionHistoryMismatch):
        await env.history.step(env.identity, [Observation("x", "f", {}, "ok")], never)
    assert await env.read() == before


@pytest.mark.parametrize(
    "field_name",
    ["provider", "model", "decision_interface", "run_id", "invocation_id", "agent_ref"],
)
async def test_record_of_another_conversation_under_the_key_is_a_mismatch(
    field_name: str,
) -> None:
    env = Env()
    await env.step([], decide(*calls("a", "f")))
    record = await env.read()
    assert record is not None
    other = ident(**{field_name: "someone-else"})
    await put(env.store, other.key, record)  # A's record under B's key
    with pytest.raises(DecisionHistoryMismatch, match=field_name):
        await env.history.step(other, [], never)
    assert await env.store.read(other.key) == record


@pytest.mark.parametrize(
    "record",
    [
        {"kind": "touba.decision_history", "version": 2, "identity": {}, "future": True},
        {
            "kind": "touba.decision_history",
            "version": 99,
            "identity": {},
            "pending": [],
            "stats": {"exchanges": 1, "messages": 1, "bytes": 1},
            "exchanges": [[{"kind": "decision"}]],
        },
        {"kind": "touba.decision_history", "identity": {}},
        {"hello": "not touba"},
        {"kind": "other.app", "version": 1},
        {"kind": "touba.decision_history", "version": 1, "identity": "x", "pending": []},
        {"kind": "touba.decision_history", "version": 1, "exchanges": "nope"},
    ],
)
async def test_unreadable_record_is_a_typed_error_and_never_overwritten(record: Record) -> None:
    env = Env()
    await put(env.store, env.key, record)
    for observations in ([], [Observation("x", "f", {}, "ok")]):
        with pytest.raises(DecisionHistoryRecordInvalid):
            await env.history.step(env.identity, observations, never)
        assert await env.read() == record


def _exchanges_not_a_list(record: Record) -> None:
    record["exchanges"] = "nope"


def _empty_exchange(record: Record) -> None:
    record["exchanges"].append([])


def _non_message_in_exchange(record: Record) -> None:
    record["exchanges"][0].append("x")


def _exchanges_lost(record: Record) -> None:
    del record["exchanges"]


def _stats_disagree(record: Record) -> None:
    record["stats"]["exchanges"] = 3


def _pending_corrupt(record: Record) -> None:
    record["pending"] = ["a-0"]


def _pending_without_name(record: Record) -> None:
    record["pending"] = [{"call_id": "a-0"}]


@pytest.mark.parametrize(
    "corrupt",
    [
        _exchanges_not_a_list,
        _empty_exchange,
        _non_message_in_exchange,
        _exchanges_lost,
        _stats_disagree,
        _pending_corrupt,
        _pending_without_name,
    ],
)
async def test_corrupt_record_of_this_conversation_is_never_overwritten(
    corrupt: Callable[[Record], None],
) -> None:
    # Right kind, version and identity, but the body cannot be read: refuse, keep it.
    env = Env()
    first = decide(*calls("a", "f"))
    await env.step([], first)
    record = await env.read()
    assert record is not None
    corrupt(record)
    await put(env.store, env.key, record)
    for observations in ([], answer(first.calls)):
        with pytest.raises(DecisionHistoryRecordInvalid):
            await env.history.step(env.identity, observations, never)
        assert await env.read() == record


async def test_corrupt_stored_message_is_a_typed_error() -> None:
    env = Env()
    first = decide(*calls("a", "f"))
    await env.step([], first)
    record = await env.read()
    assert record is not None
    record["exchanges"][0][0]["calls"][0]["name"] = 7
    await put(env.store, env.key, record)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await env.history.step(env.identity, answer(first.calls), never)
    assert await env.read() == record


# -- concurrency and failures ---------------------------------------------------------------


async def test_concurrent_step_on_one_conversation_is_busy_at_once() -> None:
    env = Env()
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(window: HistoryWindow) -> DecisionMessage:
        entered.set()
        await release.wait()
        return decide(text="first")

    first = asyncio.create_task(env.history.step(env.identity, [], slow))
    await entered.wait()
    with pytest.raises(DecisionHistoryBusy) as caught:
        await asyncio.wait_for(env.history.step(env.identity, [], never), timeout=1)
    assert caught.value.session_key == env.key
    # Another conversation is not blocked.
    other = ident(invocation_id="inv-2")
    await env.history.step(other, [], Provider([decide()]))
    release.set()
    assert (await first).text == "first"
    record = await env.read()
    assert record is not None
    assert record["exchanges"] == [[message_to_dict(decide(text="first"))]]


async def test_generate_failing_keeps_the_old_state_and_frees_the_key() -> None:
    env = Env()
    first = decide(*calls("a", "f"))
    await env.step([], first)
    before = await env.read()

    async def failing(window: HistoryWindow) -> DecisionMessage:
        raise RuntimeError("provider down")

    with pytest.raises(RuntimeError, match="provider down"):
        await env.history.step(env.identity, answer(first.calls), failing)
    assert await env.read() == before
    window = await env.step(answer(first.calls), decide())
    assert len(window.exchanges[0]) == 2


async def test_cancelled_step_keeps_the_old_state_and_frees_the_key() -> None:
    env = Env()
    entered = asyncio.Event()

    async def hanging(window: HistoryWindow) -> DecisionMessage:
        entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    task = asyncio.create_task(env.history.step(env.identity, [], hanging))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await env.read() is None
    await env.step([], decide())


# -- summaries --------------------------------------------------------------------------------


class Summarizer:
    def __init__(self, *replies: Any) -> None:
        self.replies = list(replies)
        self.requests: list[SummaryRequest] = []

    async def __call__(self, request: SummaryRequest) -> Any:
        self.requests.append(request)
        return self.replies.pop(0) if self.replies else f"summary {len(self.requests)}"


async def run_turns(env: Env, count: int, result: Any = "done") -> list[HistoryWindow]:
    """``count`` decisions of one call each, every one answered by the next."""
    windows = []
    made: tuple[CapabilityCall, ...] = ()
    for i in range(count):
        decision = decide(*calls(f"d{i}", "lookup"))
        windows.append(await env.step(answer(made, result), decision))
        made = decision.calls
    return windows


async def test_summaries_are_incremental_chained_and_never_hold_text_in_events() -> None:
    summarize = Summarizer("first summary", "second summary")
    # Two messages per exchange; one message kept for the summary: two exchanges fit.
    env = Env(max_messages=5, max_bytes=100_000, max_summary_bytes=200, summarize=summarize)
    windows = await run_turns(env, 3)
    assert summarize.requests == []
    assert all(w.summary is None for w in windows)

    window = await env.step(answer(calls("d2", "lookup")), decide(*calls("d3", "lookup")))
    record = await env.read()
    assert record is not None
    stored = record["exchanges"]
    (request,) = summarize.requests
    assert request.previous_summary is None
    assert request.turns == (projected(stored[0]),)
    assert request.max_bytes == 200
    assert all("opaque" not in m for turn in request.turns for m in turn)
    first_fp = sha(None, stored[:1])
    assert window.summary == SummaryMessage("first summary", 1, first_fp)
    assert window.messages[0] == window.summary
    assert dicts(window) == stored[1:3]
    assert window_weight(window)[0] == 5
    (event,) = env.of_kind("decision_history_summary")
    assert event.covered_exchanges == 1
    assert event.fingerprint == first_fp
    assert event.summary_bytes == len(b"first summary")
    assert (event.message_count, event.bytes) == window_weight(window)
    assert_no_content(env.events, "first summary", "raw", "done", "sig")

    window = await env.step(answer(calls("d3", "lookup")), decide())
    record = await env.read()
    assert record is not None
    stored = record["exchanges"]
    assert len(summarize.requests) == 2
    request = summarize.requests[1]
    assert request.previous_summary == "first summary"
    assert request.turns == (projected(stored[1]),)  # only what left since the last one
    second_fp = sha(first_fp, stored[1:2])
    assert window.summary == SummaryMessage("second summary", 2, second_fp)
    assert dicts(window) == stored[2:4]
    (event,) = env.of_kind("decision_history_summary")
    assert (event.covered_exchanges, event.fingerprint) == (2, second_fp)
    assert_no_content(env.events, "second summary", "raw", "done", "sig")
    # Originals stay retained.
    assert len(stored) == 5
    assert record["summary"]["text"] == "second summary"


async def test_the_summary_is_reused_until_more_exchanges_leave() -> None:
    summarize = Summarizer()
    env = Env(max_messages=5, max_bytes=100_000, max_summary_bytes=100, summarize=summarize)
    await run_turns(env, 4)
    assert len(summarize.requests) == 1
    await env.step(answer(calls("d3", "lookup")), decide(text="t"))
    assert len(summarize.requests) == 2
    await env.step([], decide(text="u"))
    assert len(summarize.requests) == 3
    # Exchanges 3 (2 messages), 4 and 5 (1 each) + the summary fill 5: nothing new left.
    window = await env.step([], decide(text="v"))
    assert len(summarize.requests) == 3
    assert env.of_kind("decision_history_summary") == []
    assert window.summary == SummaryMessage(
        "summary 3", 3, (await env.read() or {})["summary"]["fingerprint"]
    )
    assert [len(ex) for ex in window.exchanges] == [2, 1, 1]
    assert window_weight(window)[0] == 5


async def test_first_summary_fingerprint_is_sha256_of_the_covered_exchanges() -> None:
    env = Env(max_messages=3, max_bytes=100_000, max_summary_bytes=100, summarize=Summarizer())
    await run_turns(env, 3)
    record = await env.read()
    assert record is not None
    covered = record["exchanges"][:1]
    canonical = json.dumps(covered, ensure_ascii=False, separators=(",", ":")).encode()
    assert record["summary"]["fingerprint"] == "sha256:" + hashlib.sha256(canonical).hexdigest()


@pytest.mark.parametrize("reply", ["", "   \n", None, 42, b"bytes", "é" * 101])
async def test_invalid_summary_is_refused_and_nothing_is_written(reply: Any) -> None:
    summarize = Summarizer(reply)
    env = Env(max_messages=3, max_bytes=100_000, max_summary_bytes=200, summarize=summarize)
    await run_turns(env, 2)
    assert summarize.requests == []
    before = await env.read()
    env.events.clear()
    with pytest.raises(DecisionHistorySummaryInvalid):
        await env.history.step(env.identity, answer(calls("d1", "lookup")), never)
    assert len(summarize.requests) == 1
    assert await env.read() == before
    assert env.events == []


class FailingSummarizer(Summarizer):
    """Replies in order; an exception in the replies is raised instead."""

    async def __call__(self, request: SummaryRequest) -> Any:
        reply = await super().__call__(request)
        if isinstance(reply, Exception):
            raise reply
        return reply


async def test_on_summary_failure_trim_sends_the_plain_window_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = FailingSummarizer(RuntimeError("model down"))
    env = Env(
        max_messages=5,
        max_bytes=100_000,
        max_summary_bytes=200,
        summarize=failing,
        on_summary_failure="trim",
    )
    plain = Env(max_messages=5, max_bytes=100_000)  # the same script, no summariser at all
    await run_turns(env, 3)
    await run_turns(plain, 3)

    window = await env.step(answer(calls("d2", "lookup")), decide(*calls("d3", "lookup")))
    expected = await plain.step(answer(calls("d2", "lookup")), decide(*calls("d3", "lookup")))

    assert len(failing.requests) == 1
    assert window.summary is None
    assert dicts(window) == dicts(expected)  # no room reserved for a summary either
    assert (await env.read() or {})["summary"] is None
    (failed,) = env.of_kind("decision_history_summary_failed")
    assert (failed.message_count, failed.bytes) == window_weight(window)
    assert [e.kind for e in env.events] == [
        "decision_history_summary_failed",
        "history_trimmed",
        "history_window",
    ]
    assert_no_content(env.events, "model down", "raw", "done", "sig")
    assert "summarize failed (RuntimeError)" in caplog.text


@pytest.mark.parametrize(
    "failure",
    [DecisionHistorySummaryInvalid("budget spent"), "", None, "é" * 101],
    ids=["raises", "empty", "none", "too_long"],
)
async def test_after_a_failure_trim_keeps_the_summary_state_and_tries_again(
    failure: Any,
) -> None:
    summarize = FailingSummarizer("first summary", failure, "third summary")
    env = Env(
        max_messages=5,
        max_bytes=100_000,
        max_summary_bytes=200,
        summarize=summarize,
        on_summary_failure="trim",
    )
    plain = Env(max_messages=5, max_bytes=100_000)
    await run_turns(env, 4)  # the 4th decision summarises exchange 0
    await run_turns(plain, 4)
    first = (await env.read() or {})["summary"]
    assert (first["text"], first["through"]) == ("first summary", 1)

    window = await env.step(answer(calls("d3", "lookup")), decide(*calls("d4", "lookup")))
    expected = await plain.step(answer(calls("d3", "lookup")), decide(*calls("d4", "lookup")))
    assert window.summary is None
    assert dicts(window) == dicts(expected)  # what a history without a summariser sends
    assert (await env.read() or {})["summary"] == first  # unchanged
    assert env.events[0].kind == "decision_history_summary_failed"

    window = await env.step(answer(calls("d4", "lookup")), decide())
    (request,) = summarize.requests[2:]
    assert request.previous_summary == "first summary"  # tried again from where it was
    assert window.summary is not None
    assert window.summary.text == "third summary"
    assert env.of_kind("decision_history_summary_failed") == []


async def test_on_summary_failure_refuse_is_the_default() -> None:
    assert HistoryConfig().on_summary_failure == "refuse"
    env = Env(
        max_messages=3,
        max_bytes=100_000,
        max_summary_bytes=200,
        summarize=FailingSummarizer(RuntimeError("model down")),
    )
    await run_turns(env, 2)
    before = await env.read()
    with pytest.raises(DecisionHistorySummaryInvalid, match="raised RuntimeError") as refused:
        await env.history.step(env.identity, answer(calls("d1", "lookup")), never)
    assert isinstance(refused.value.__cause__, RuntimeError)  # the callback's own error
    assert str(refused.value.__cause__) == "model down"
    assert "model down" not in str(refused.value)
    assert await env.read() == before


def test_on_summary_failure_must_be_refuse_or_trim() -> None:
    bad: Any = "ignore"
    with pytest.raises(ConfigurationError, match="on_summary_failure"):
        HistoryConfig(on_summary_failure=bad)


async def test_summary_at_exactly_max_summary_bytes_is_accepted() -> None:
    env = Env(
        max_messages=3, max_bytes=100_000, max_summary_bytes=200, summarize=Summarizer("é" * 100)
    )
    windows = await run_turns(env, 3)
    assert windows[-1].summary is not None
    assert windows[-1].summary.text == "é" * 100


async def test_without_summarize_no_summary_is_ever_made() -> None:
    env = Env(max_messages=3)
    windows = await run_turns(env, 8)
    assert all(w.summary is None for w in windows)
    assert env.of_kind("decision_history_summary") == []
    record = await env.read()
    assert record is not None
    assert record["summary"] is None


async def test_a_summary_never_takes_the_place_of_the_current_exchange() -> None:
    summarize = Summarizer()
    env = Env(max_messages=5, max_bytes=100_000, max_summary_bytes=100, summarize=summarize)
    first = decide(*calls("a", "f"))
    await env.step([], first)
    wide = decide(*calls("b", "f", "g", "h", "i"))
    await env.step(answer(first.calls), wide)
    # The current exchange holds 5 messages: it alone fills max_messages.
    window = await env.step(answer(wide.calls), decide())
    assert dicts(window)[-1][0]["calls"][0]["call_id"] == "b-0"
    assert len(window.exchanges) == 1
    assert window_weight(window)[0] <= 5
    record = await env.read()
    assert record is not None
    # What left (exchange 0) is summarised; the current exchange never is. With no
    # room left next to the minimum window, the summary is not sent this time.
    (request,) = summarize.requests
    assert request.turns == (projected(record["exchanges"][0]),)
    assert record["summary"]["through"] == 1
    assert window.summary is None


async def test_summary_window_still_fits_when_escaping_inflates_the_summary() -> None:
    quoted = '"' * 100  # 100 bytes of text, 200 bytes of JSON
    env = Env(max_messages=20, max_bytes=900, max_summary_bytes=100, summarize=Summarizer(quoted))
    windows = await run_turns(env, 8, "x" * 50)
    for window in windows:
        assert window_weight(window)[0] <= 20
        assert window_weight(window)[1] <= 900
    assert any(w.summary is not None and w.summary.text == quoted for w in windows)


@dataclass(frozen=True)
class SummaryScript:
    max_messages: int
    max_bytes: int
    max_summary_bytes: int
    patterns: tuple[str, ...]


summary_scripts = st.builds(
    SummaryScript,
    max_messages=message_bounds,
    max_bytes=st.integers(min_value=700, max_value=5_000),
    max_summary_bytes=st.integers(min_value=1, max_value=300),
    patterns=st.lists(st.sampled_from(["s", '"', "\x00", "é", "🙂"]), min_size=1, max_size=4).map(
        tuple
    ),
)


def fitting(pattern: str, max_bytes: int) -> str:
    text = "S"
    while len((text + pattern).encode()) <= max_bytes:
        text += pattern
    return text


async def run_summarised(script: SummaryScript, plan: list[Turn]) -> None:
    requests: list[SummaryRequest] = []
    replies: list[str] = []

    async def summarize(request: SummaryRequest) -> str:
        requests.append(request)
        pattern = script.patterns[len(requests) % len(script.patterns)]
        replies.append(fitting(pattern, script.max_summary_bytes))
        return replies[-1]

    env = Env(
        max_messages=script.max_messages,
        max_bytes=script.max_bytes,
        max_summary_bytes=script.max_summary_bytes,
        summarize=summarize,
    )
    config = env.history.config
    made: tuple[CapabilityCall, ...] = ()
    for index, turn in enumerate(plan):
        observations = turn_observations(made, turn)
        decision = turn_decision(index, turn)
        before = await env.read()
        provider = Provider([decision])
        env.events.clear()
        if expected_limit(before, observations, config) is not None:
            with pytest.raises(DecisionHistoryLimitExceeded):
                await env.history.step(env.identity, observations, provider)
            assert await env.read() == before
            return
        await env.history.step(env.identity, observations, provider)
        (window,) = provider.windows
        after = await env.read()
        assert after is not None
        exchanges = after["exchanges"]
        count = len(exchanges) - 1
        sent = dicts(window)
        start = count - len(sent)
        assert sent == exchanges[start:count]
        if count:
            assert sent
        assert_paired(sent)
        messages, size = window_weight(window)
        assert messages <= config.max_messages
        assert size <= config.max_bytes
        if window.summary is not None:
            assert window.messages[0] == window.summary
        state = after["summary"]
        through = state["through"] if state else 0
        # The summary covers only exchanges out of the window, never the current one.
        assert through <= start
        assert through <= max(count - 1, 0)
        if window.summary is not None:
            assert window.summary.covered_exchanges == through
            assert window.summary.fingerprint == state["fingerprint"]
        elif state is not None:
            assert len(sent) == 1  # dropped only when the minimum leaves no room
        hypothesis.event("summary sent" if window.summary else "no summary sent")
        # Incremental: the requests so far cover exchanges 0 .. through, in order, once.
        covered = [turn for request in requests for turn in request.turns]
        assert covered == [projected(ex) for ex in exchanges[:through]]
        assert all(request.turns for request in requests)
        previous: str | None = None
        fingerprint: str | None = None
        position = 0
        for request, reply in zip(requests, replies, strict=True):
            assert request.previous_summary == previous
            assert request.max_bytes == script.max_summary_bytes
            batch = exchanges[position : position + len(request.turns)]
            fingerprint = sha(fingerprint, batch)
            position += len(request.turns)
            previous = reply
        if state is not None:
            assert state["fingerprint"] == fingerprint
            assert state["text"] == previous
        for event in env.events:
            assert (event.message_count, event.bytes) == (messages, size)
        for event in env.of_kind("decision_history_summary"):
            assert event.covered_exchanges == through
            assert event.summary_bytes == len(replies[-1].encode())
        assert_no_content(env.events, SECRET, *(r for r in replies if len(r) > 1))
        made = decision.calls if not decision.final else ()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(summary_scripts, st.lists(turns, min_size=3, max_size=14))
def test_summarised_windows_keep_every_rule(script: SummaryScript, plan: list[Turn]) -> None:
    hypothesis.assume(script.max_summary_bytes < script.max_bytes)
    asyncio.run(run_summarised(script, plan))


# -- continuity: opaque_refs ---------------------------------------------------------------


async def test_opaque_refs_keeps_projections_only() -> None:
    summarize = Summarizer()
    env = Env(
        continuity="opaque_refs",
        max_messages=3,
        max_bytes=100_000,
        max_summary_bytes=100,
        summarize=summarize,
    )
    made: tuple[CapabilityCall, ...] = ()
    windows = []
    for i in range(4):
        raw = (CapabilityCall(f"c{i}", "lookup", {"card": f"RAW-{i}"}),)
        decision = DecisionMessage(
            text="t", calls=raw, provider="openai", opaque={"encrypted": "OPAQUE"}
        )
        observations = [
            Observation(c.call_id, c.name, {"card": "ref:1"}, "ok", result="r") for c in made
        ]
        provider = Provider([decision])
        returned = await env.history.step(env.identity, observations, provider)
        assert returned == decision  # the provider's decision itself is returned untouched
        windows.append(provider.windows[0])
        made = decision.calls
    record = await env.read()
    assert record is not None
    text = json.dumps(record)
    assert "RAW" not in text
    assert "OPAQUE" not in text
    assert record["exchanges"][0][0] == {
        "kind": "decision",
        "text": "t",
        "calls": [{"call_id": "c0", "name": "lookup", "arguments": {}}],
    }
    assert record["exchanges"][0][1]["arguments"] == {"card": "ref:1"}
    for window in windows:
        sent = json.dumps([message_to_dict(m) for m in window.messages])
        assert "RAW" not in sent
        assert "OPAQUE" not in sent
    assert summarize.requests
    assert "RAW" not in repr(summarize.requests)


async def test_inline_keeps_the_decision_untouched_but_results_use_observations() -> None:
    env = Env()
    first = DecisionMessage(
        calls=(CapabilityCall("c0", "lookup", {"card": "RAW"}),),
        provider="openai",
        opaque=[{"type": "reasoning", "encrypted_content": "OPAQUE"}],
    )
    await env.step([], first)
    observations = [Observation("c0", "lookup", {"card": "ref:1"}, "ok", result="r")]
    window = await env.step(observations, decide())
    decision, result = window.exchanges[0]
    assert decision == first
    assert isinstance(result, ResultMessage)
    assert result.arguments == {"card": "ref:1"}


# -- resume without messages ----------------------------------------------------------------


async def test_resume_with_lost_history_sends_observations_as_data() -> None:
    env = Env()
    observations = [
        Observation("c1", "lookup", {"q": "a"}, "ok", result={"n": 1}),
        Observation("c2", "charge", {"q": "b"}, "denied", error="needs approval"),
    ]
    window = await env.step(observations, decide())
    (exchange,) = window.exchanges
    (message,) = exchange
    assert isinstance(message, DataMessage)
    assert message.observations == tuple(ResultMessage.from_observation(o) for o in observations)
    assert not any(isinstance(m, ResultMessage) for m in window.messages)
    kinds = [e.kind for e in env.events]
    assert kinds == ["resumed_without_messages", "history_window"]
    (event,) = env.of_kind("resumed_without_messages")
    assert (event.message_count, event.bytes) == window_weight(window)
    assert_no_content(env.events, "lookup", "needs approval")
    record = await env.read()
    assert record is not None
    assert [[m["kind"] for m in ex] for ex in record["exchanges"]] == [["data"], ["decision"]]
    # The conversation goes on normally afterwards.
    window = await env.step([], decide())
    assert len(window.exchanges) == 2
    assert env.of_kind("resumed_without_messages") == []


# -- data: results the runtime obtained itself (a flow's steps) -----------------------------


def final(output: Any) -> DecisionMessage:
    return DecisionMessage(output=output, final=True)


async def test_data_opens_a_new_exchange_after_a_final_decision() -> None:
    env = Env()
    await env.step([], final({"category": "refund"}))
    data = [Observation("s1", "lookup", {"q": "a"}, "ok", result={"n": 1})]
    provider = Provider([final("done")])
    await env.history.step(env.identity, [], provider, data=data)
    (window,) = provider.windows
    assert [[type(m).__name__ for m in ex] for ex in window.exchanges] == [
        ["DecisionMessage"],
        ["DataMessage"],
    ]
    (message,) = window.exchanges[-1]
    assert isinstance(message, DataMessage)
    assert message.observations == (ResultMessage.from_observation(data[0]),)
    assert env.of_kind("resumed_without_messages") == []
    record = await env.read()
    assert record is not None
    kinds = [[m["kind"] for m in ex] for ex in record["exchanges"]]
    assert kinds == [["decision"], ["data"], ["decision"]]
    assert record["stats"]["exchanges"] == 3
    assert_paired(record["exchanges"])


async def test_data_on_a_new_conversation_is_its_first_exchange() -> None:
    env = Env()
    data = [Observation("s1", "lookup", {}, "ok", result=1)]
    provider = Provider([final("done")])
    await env.history.step(env.identity, [], provider, data=data)
    assert env.of_kind("resumed_without_messages") == []
    record = await env.read()
    assert record is not None
    assert [[m["kind"] for m in ex] for ex in record["exchanges"]] == [["data"], ["decision"]]


async def test_data_while_calls_are_pending_is_a_mismatch() -> None:
    env = Env()
    made = calls("a", "lookup")
    await env.step([], decide(*made))
    before = await env.read()
    data = [Observation("s1", "lookup", {}, "ok", result=1)]
    with pytest.raises(DecisionHistoryMismatch):
        await env.history.step(env.identity, [], never, data=data)
    with pytest.raises(DecisionHistoryMismatch):
        await env.history.step(env.identity, answer(made), never, data=data)
    assert await env.read() == before


# -- cost: only a bounded tail is read ------------------------------------------------------


class CountingSnapshot:
    def __init__(self, inner: LogSnapshot, reads: list[tuple[int, int]]) -> None:
        self._inner = inner
        self._reads = reads

    @property
    def head(self) -> Record:
        return self._inner.head

    @property
    def exchange_count(self) -> int:
        return self._inner.exchange_count

    async def sizes(self, start: int) -> list[ExchangeSize]:
        self._reads.append((start, self.exchange_count))
        return await self._inner.sizes(start)

    async def exchanges(self, start: int, stop: int) -> list[list[Record]]:
        self._reads.append((start, self.exchange_count))
        return await self._inner.exchanges(start, stop)


class CountingStore:
    """A LogStore adapter around the memory store that records every read's start."""

    def __init__(self) -> None:
        self.inner = MemoryHistoryStore()
        self.reads: list[tuple[int, int]] = []

    async def transact(self, key: str, operation: Operation[Any]) -> Any:
        return await self.inner.transact(key, operation)

    async def transact_log(self, key: str, operation: LogOperation[Any]) -> Any:
        async def counted(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite | None, Any]:
            wrapped = None if snapshot is None else CountingSnapshot(snapshot, self.reads)
            return await operation(wrapped, usage)

        return await self.inner.transact_log(key, counted)


@pytest.mark.parametrize("with_summary", [False, True])
async def test_a_decision_reads_only_a_bounded_tail(with_summary: bool) -> None:
    store = CountingStore()
    extra: dict[str, Any] = {"summarize": Summarizer(), "max_summary_bytes": 64}
    history = DecisionHistory(
        HistoryConfig(store=store, namespace=NS, max_messages=8, **(extra if with_summary else {}))
    )
    identity = ident()
    made: tuple[CapabilityCall, ...] = ()
    for i in range(500):
        decision = decide(*calls(f"d{i}", "lookup"))
        provider = Provider([decision])
        await history.step(identity, answer(made), provider)
        assert sum(len(ex) for ex in provider.windows[0].exchanges) <= 8
        made = decision.calls
    assert store.reads
    assert max(count for _, count in store.reads) == 499
    for start, count in store.reads:
        assert start >= count - 9, (start, count)
    record = await store.inner.read(identity.key)
    assert record is not None
    assert len(record["exchanges"]) == 500
