"""``LogWrite.bodies``: the engine's encoded messages are stored as given, checked.

The history engine encodes each message it appends once, to measure it, and
hands that text over (``LogWrite.bodies``) so that the store does not encode
it again. These tests hold every built-in store to what that promises: the
text kept is the one given, a count that does not match is refused with the
previous state intact, and text that is not storable UTF-8 is refused typed.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.history._stores import Stores, state
from touba.errors import DecisionHistoryRecordInvalid
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
)
from touba.history._model import canonical_json
from touba.history._store import LogWrite

HEAD = {"kind": "touba.test", "version": 1}
WHO = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")


def append(**kwargs: Any) -> Any:
    async def operation(snapshot: Any, usage: Any) -> tuple[LogWrite, None]:
        count = 0 if snapshot is None else snapshot.exchange_count
        return LogWrite(head=dict(HEAD), **{"append": [(count, {"n": count})], **kwargs}), None

    return operation


async def test_the_bodies_given_are_what_the_store_keeps(stores: Stores) -> None:
    store = stores()
    spaced = '{"n": 0}'  # not touba's compact form: the store keeps it, it does not re-encode
    await store.transact_log("k", append(bodies=[spaced]))
    assert await store.read("k") == {**HEAD, "exchanges": [[{"n": 0}]]}
    usage = await store.usage()
    assert usage.bytes == len(canonical_json(HEAD)) + len(spaced)


async def test_a_count_of_bodies_that_does_not_match_is_refused_untouched(stores: Stores) -> None:
    store = stores()
    await store.transact_log("k", append())
    before = await state(store)
    with pytest.raises(ValueError, match="2 text"):
        await store.transact_log("k", append(bodies=["{}", "{}"]))
    assert await state(store) == before
    await store.transact_log("k", append())  # the key was released


async def test_a_body_that_is_not_utf8_is_refused_typed_untouched(stores: Stores) -> None:
    store = stores()
    await store.transact_log("k", append())
    before = await state(store)
    with pytest.raises(DecisionHistoryRecordInvalid, match="lone surrogate"):
        await store.transact_log(
            "k", append(append=[(1, {"t": "\ud800"})], bodies=['{"t":"\ud800"}'])
        )
    assert await state(store) == before
    with pytest.raises(ValueError, match=r"bodies\[0\] is not storable"):
        await store.transact_log("k", append(append=[(1, {"t": "a"})], bodies=['{"t":"\ud800"}']))
    assert await state(store) == before


async def test_the_engine_hands_over_the_text_it_measured(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = stores()
    writes: list[LogWrite] = []
    original = store.transact_log

    async def spied(key: str, operation: Any) -> Any:
        async def spy(snapshot: Any, usage: Any) -> Any:
            write, result = await operation(snapshot, usage)
            writes.append(write)
            return write, result

        return await original(key, spy)

    monkeypatch.setattr(store, "transact_log", spied)
    history = DecisionHistory(HistoryConfig(store=store, namespace="n"))

    async def generate(window: HistoryWindow) -> DecisionMessage:
        return DecisionMessage(text="é", calls=(CapabilityCall("c1", "f", {"a": [1.5]}),))

    await history.step(WHO, [], generate)
    (write,) = writes
    assert write.bodies == [canonical_json(message) for _index, message in write.append]
    (stored,) = (await store.read(WHO.key))["exchanges"]
    assert [canonical_json(m) for m in stored] == list(write.bodies)


async def test_a_write_without_messages_keeps_the_stored_ones(stores: Stores) -> None:
    store = stores()
    await store.transact_log("k", append())
    await store.transact_log("k", append(append=[], bodies=[]))
    await store.transact_log("k", append(append=[]))
    assert await store.read("k") == {**HEAD, "exchanges": [[{"n": 0}]]}
