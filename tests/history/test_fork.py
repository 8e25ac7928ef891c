"""``DecisionHistory.fork`` on every built-in store (RAM, SQLite, PostgreSQL, Redis).

Hypothesis builds conversations through ``DecisionHistory.step`` with tool loops
(several calls per decision, data messages, a last decision whose calls may still
await results), then forks each at every exchange, in range or not: a fork holds
the first k exchanges exactly, passes the pre-send window check and continues; the
original reads the same before and after, byte for byte; a refused fork writes
nothing.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.history._stores import Stores, holding
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
)
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    MemoryHistoryStore,
    Observation,
    SummaryRequest,
)
from touba.history._integrity import check_window
from touba.history._model import canonical_json, message_bytes, message_from_dict

NS = "n"

# One conversation: its decisions, each (calls made, the results' text); a decision
# of 0 calls is a final answer; ``data``: the decision opens with a data message
# (only after a decision whose calls were all answered, or a final one).
DECISIONS = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.text(max_size=8),
        st.booleans(),
    ),
    min_size=1,
    max_size=7,
)


def identity(run: str, invocation: str = "i") -> ConversationIdentity:
    return ConversationIdentity(NS, "openai", "m", "native", run, invocation, "agent")


async def converse(
    history: DecisionHistory,
    who: ConversationIdentity,
    decisions: list[tuple[int, str, bool]],
    *,
    answer_last: bool,
) -> None:
    """Run ``decisions`` as one conversation; the last one's calls are answered (by a
    final decision) only with ``answer_last``."""
    pending: list[CapabilityCall] = []
    script = list(decisions) + ([(0, "", False)] if answer_last else [])
    for number, (made, text, data) in enumerate(script):
        calls = tuple(
            CapabilityCall(f"c{number}-{i}", f"tool_{i % 2}", {"q": text}) for i in range(made)
        )
        decision = DecisionMessage(
            text=text or None, calls=calls, output=None if calls else text, final=not calls
        )
        observations = [
            Observation(c.call_id, c.name, dict(c.arguments), "ok", result=[text, i])
            for i, c in enumerate(pending)
        ]
        extra = (
            [Observation(f"d{number}", "earlier", {}, "ok", result=text)]
            if data and not pending
            else []
        )

        async def generate(window: HistoryWindow, decision: DecisionMessage = decision) -> Any:
            return decision

        await history.step(who, observations, generate, data=extra)
        pending = list(calls)


async def original_state(store: Any, key: str) -> tuple[str, Any]:
    """What the store shows of one conversation: its record as canonical JSON, and its
    listed row (sizes, times, reservation)."""
    record = await store.read(key, purge=False)
    [row] = [r for r in await store.list(purge=False) if r.key == key]
    return canonical_json(record), row


def roomy(stores: Stores) -> Any:
    """One store of the test's kind for all of a test's examples, with room for them."""
    store = getattr(stores, "roomy", None)
    if store is None:
        store = stores("roomy", max_sessions=100_000)
        stores.roomy = store  # type: ignore[attr-defined]
    return store


def paired(key: str, exchanges: list[list[dict[str, Any]]]) -> None:
    """The check each decision runs before a provider request: it must accept them."""
    check_window(key, 0, [tuple(message_from_dict(m) for m in ex) for ex in exchanges])


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(decisions=DECISIONS, answer_last=st.booleans())
async def test_a_fork_at_every_exchange_keeps_whole_exchanges_and_the_original(
    stores: Stores, decisions: list[tuple[int, str, bool]], answer_last: bool
) -> None:
    store = roomy(stores)
    history = DecisionHistory(HistoryConfig(store=store, namespace=NS))
    run = uuid.uuid4().hex
    who = identity(run)
    await converse(history, who, decisions, answer_last=answer_last)
    before = await original_state(store, who.key)
    record = await store.read(who.key)
    exchanges = record["exchanges"]
    complete = len(exchanges) - (1 if record["pending"] else 0)
    keys = {r.key for r in await store.list(purge=False)}
    for k in range(-1, len(exchanges) + 2):
        copy = identity(run, f"fork-{k}")
        if not 1 <= k <= complete:
            with pytest.raises(ConfigurationError, match="out of range"):
                await history.fork(who.key, copy, at_exchange=k)
            assert {r.key for r in await store.list(purge=False)} == keys  # nothing written
            continue
        assert await history.fork(who.key, copy, at_exchange=k) == copy.key
        keys.add(copy.key)
        forked = await store.read(copy.key)
        assert forked["exchanges"] == exchanges[:k]
        paired(copy.key, forked["exchanges"])
        assert forked["identity"] == copy.as_dict()
        assert forked["pending"] == []
        kept = [m for ex in exchanges[:k] for m in ex]
        assert forked["stats"] == {
            "exchanges": k,
            "messages": len(kept),
            "bytes": sum(message_bytes(m) for m in kept),
        }
        assert await original_state(store, who.key) == before
    # a fork continues: its next decision sees the kept exchanges, and only them
    last = identity(run, f"fork-{complete}")
    seen: list[HistoryWindow] = []

    async def final(window: HistoryWindow) -> DecisionMessage:
        seen.append(window)
        return DecisionMessage(output="again", final=True)

    await history.step(last, [], final)
    assert [list(ex) for ex in seen[0].exchanges] == [
        [message_from_dict(m) for m in ex] for ex in exchanges[:complete]
    ]
    assert await original_state(store, who.key) == before


async def test_a_fork_is_refused_between_a_call_and_its_result(stores: Stores) -> None:
    store = stores()
    history = DecisionHistory(HistoryConfig(store=store, namespace=NS))
    who = identity("r")
    await converse(history, who, [(2, "a", False), (3, "b", False)], answer_last=False)
    with pytest.raises(ConfigurationError, match="awaits the results of its calls"):
        await history.fork(who.key, identity("r", "copy"), at_exchange=2)
    await history.fork(who.key, identity("r", "copy"), at_exchange=1)
    with pytest.raises(ConfigurationError, match="already exists"):
        await history.fork(who.key, identity("r", "copy"), at_exchange=1)
    for wrong in (True, 1.0, "1", None):
        with pytest.raises(ConfigurationError, match="must be an int"):
            await history.fork(who.key, identity("r", "other"), at_exchange=wrong)  # type: ignore[arg-type]


async def test_misuse_is_refused(stores: Stores) -> None:
    store = stores()
    history = DecisionHistory(HistoryConfig(store=store, namespace=NS))
    who = identity("r")
    await converse(history, who, [(1, "a", False)], answer_last=True)
    with pytest.raises(ConfigurationError, match="no conversation"):
        await history.fork(identity("absent").key, identity("r", "c"), at_exchange=1)
    with pytest.raises(ConfigurationError, match="names the original"):
        await history.fork(who.key, who, at_exchange=1)
    other = ConversationIdentity("elsewhere", "openai", "m", "native", "r", "c", "agent")
    with pytest.raises(ConfigurationError, match="namespace"):
        await history.fork(who.key, other, at_exchange=1)
    foreign = DecisionHistory(HistoryConfig(store=store, namespace="elsewhere"))
    with pytest.raises(ConfigurationError, match="another namespace"):
        await foreign.fork(who.key, other, at_exchange=1)


async def test_a_reserved_original_is_refused_busy(stores: Stores) -> None:
    store = stores()
    history = DecisionHistory(HistoryConfig(store=store, namespace=NS))
    who = identity("r")
    await converse(history, who, [(2, "a", False)], answer_last=True)
    task, leave = await holding(store, who.key, lambda record: (record, None))
    try:
        with pytest.raises(DecisionHistoryBusy):
            await history.fork(who.key, identity("r", "c"), at_exchange=1)
    finally:
        leave.set()
        await task
    assert await store.read(identity("r", "c").key) is None
    await history.fork(who.key, identity("r", "c"), at_exchange=1)  # once released


async def test_the_copy_keeps_the_stores_bounds(stores: Stores) -> None:
    full = stores("full", max_sessions=1)
    history = DecisionHistory(HistoryConfig(store=full, namespace=NS))
    who = identity("r")
    await converse(history, who, [(2, "a", False)], answer_last=True)
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await history.fork(who.key, identity("r", "c"), at_exchange=2)
    assert caught.value.limit == "max_sessions"

    small = stores("small")
    history = DecisionHistory(HistoryConfig(store=small, namespace=NS))
    await converse(history, who, [(2, "a" * 50, False)], answer_last=True)
    retained = (await small.read(who.key))["stats"]["bytes"]
    one = (await small.usage()).bytes  # what one such conversation takes in the store
    tight = DecisionHistory(
        HistoryConfig(store=small, namespace=NS, max_retained_bytes=retained - 1)
    )
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await tight.fork(who.key, identity("r", "c"), at_exchange=2)
    assert caught.value.limit == "max_retained_bytes"
    await tight.fork(who.key, identity("r", "c"), at_exchange=1)  # fits

    room = stores("room", max_store_bytes=one + 100)
    history = DecisionHistory(HistoryConfig(store=room, namespace=NS))
    await converse(history, who, [(2, "a" * 50, False)], answer_last=True)
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await history.fork(who.key, identity("r", "c"), at_exchange=2)
    assert caught.value.limit == "max_store_bytes"
    assert await room.read(identity("r", "c").key) is None


async def test_a_damaged_original_is_not_copied() -> None:
    store = MemoryHistoryStore()
    history = DecisionHistory(HistoryConfig(store=store, namespace=NS))
    who = identity("r")
    await converse(history, who, [(2, "a", False)], answer_last=True)
    record = await store.read(who.key)
    assert record is not None
    del record["exchanges"][0][1]  # a call's result lost

    async def damage(_: Any) -> tuple[Any, None]:
        return record, None

    await store.transact(who.key, damage)
    with pytest.raises(DecisionHistoryRecordInvalid, match=r"have no result|answers"):
        await history.fork(who.key, identity("r", "c"), at_exchange=1)
    assert await store.read(identity("r", "c").key) is None

    async def foreign(_: Any) -> tuple[Any, None]:
        return {"kind": "something.else", "exchanges": []}, None

    await store.transact(who.key, foreign)
    with pytest.raises(DecisionHistoryRecordInvalid, match="not a touba decision history"):
        await history.fork(who.key, identity("r", "c"), at_exchange=1)


async def test_a_summary_is_kept_only_when_it_covers_kept_exchanges(stores: Stores) -> None:
    store = stores()

    async def summarize(request: SummaryRequest) -> str:
        return f"summary of {len(request.turns)}"

    config = HistoryConfig(
        store=store, namespace=NS, max_messages=4, summarize=summarize, max_summary_bytes=64
    )
    history = DecisionHistory(config)
    who = identity("r")
    await converse(history, who, [(1, "a", False)] * 6, answer_last=True)
    record = await store.read(who.key)
    summary = record["summary"]
    assert summary is not None
    through = summary["through"]
    assert 0 < through < len(record["exchanges"])
    kept = identity("r", "kept")
    await history.fork(who.key, kept, at_exchange=through)
    assert (await store.read(kept.key))["summary"] == summary
    dropped = identity("r", "dropped")
    await history.fork(who.key, dropped, at_exchange=through - 1)
    assert (await store.read(dropped.key))["summary"] is None


class _TransactOnly:
    """A custom adapter offering only ``transact`` (a dict in RAM)."""

    def __init__(self) -> None:
        self.records: dict[str, Any] = {}
        self.saves = 0

    async def transact(self, key: str, operation: Any) -> Any:
        found = self.records.get(key)
        record, result = await operation(None if found is None else copy.deepcopy(found))
        self.saves += 1
        if record is None:
            self.records.pop(key, None)
        else:
            self.records[key] = copy.deepcopy(record)
        return result


async def test_a_custom_adapter_forks_through_transact() -> None:
    store = _TransactOnly()
    history = DecisionHistory(HistoryConfig(store=store, namespace=NS))
    who = identity("r")
    await converse(history, who, [(3, "a", False), (1, "b", True)], answer_last=True)
    before = canonical_json(store.records[who.key])
    copied = await history.fork(who.key, identity("r", "c"), at_exchange=2)
    assert store.records[copied]["exchanges"] == store.records[who.key]["exchanges"][:2]
    paired(copied, store.records[copied]["exchanges"])
    assert canonical_json(store.records[who.key]) == before  # saved back unchanged
