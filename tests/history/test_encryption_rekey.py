"""Key rotation of the encrypted history stores: ``rekey`` interrupted and resumed.

On the real SQLite file, PostgreSQL and Redis servers: conversations sealed with
``k1`` are re-sealed with ``k2`` one batch at a time; after an interruption a new
store object (a restarted ``touba rekey``) finishes the work, and every
conversation stays readable with both keys given until then.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.history._stores import DURABLE, Stores
from tests.history.test_encryption_stores import K1, K2, converse, identity
from touba import Encryption
from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid

OLD = Encryption(keys={"k1": K1}, current="k1")
BOTH = Encryption(keys={"k1": K1, "k2": K2}, current="k2")
NEW = Encryption(keys={"k2": K2}, current="k2")


@pytest.fixture(params=DURABLE)
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    built = Stores(request.param, tmp_path)
    built.prepare()
    yield built
    await built.cleanup()


async def test_rotation_interrupted_then_resumed(durable: Stores) -> None:
    old = durable("main", encryption=OLD)
    people = [identity(n) for n in range(7)]
    for who in people:
        await converse(old, who, 2)
    before = {who.key: await old.read(who.key) for who in people}
    counts = await old.key_ids()
    assert set(counts) == {"k1"}
    assert counts["k1"] == 7 * 4

    first = durable("main", encryption=BOTH)
    assert await first.rekey(batch=3) == 3  # then the process stops
    counts = await first.key_ids()
    assert counts == {"k1": 4 * 4, "k2": 3 * 4}
    # Mid-rotation: every conversation opens with both keys given, and a conversation
    # can keep going (its new messages sealed with k2).
    for who in people:
        assert await first.read(who.key) == before[who.key]
    await converse(first, people[-1], 1)
    with pytest.raises(DecisionHistoryRecordInvalid):  # k1 alone cannot open the new rows
        await durable("main", encryption=OLD).read(people[-1].key)

    resumed = durable("main", encryption=BOTH)  # a new store object: nothing kept but the data
    done = []
    while n := await resumed.rekey(batch=2):
        done.append(n)
    assert sum(done) == 4
    assert set(await resumed.key_ids()) == {"k2"}
    assert await resumed.rekey() == 0

    only_new = durable("main", encryption=NEW)  # the old key may go now
    for who in people[:-1]:
        assert await only_new.read(who.key) == before[who.key]
    last = await only_new.read(people[-1].key)
    assert last is not None
    assert len(last["exchanges"]) == 3


async def test_rekey_skips_a_conversation_in_use_and_takes_it_later(durable: Stores) -> None:
    from tests.history._stores import holding

    old = durable("main", encryption=OLD)
    a, b = identity(1), identity(2)
    await converse(old, a, 1)
    await converse(old, b, 1)
    store = durable("main", encryption=BOTH)
    # A worker not yet given k2 holds a, and saves it (with k1) after the pass.
    task, leave = await holding(old, a.key, lambda record: ({**record, "note": 1}, None))
    assert await store.rekey() == 1  # b only: a is held, and its writer is not lost
    leave.set()
    await task
    assert (await store.read(a.key))["note"] == 1
    assert (await store.key_ids()).get("k1") == 2  # a's head and message, as they were
    assert await store.rekey() == 1
    assert set(await store.key_ids()) == {"k2"}


async def test_rekey_needs_encryption_and_a_positive_batch(durable: Stores) -> None:
    with pytest.raises(ConfigurationError, match="encryption"):
        await durable("main").rekey()
    with pytest.raises(ConfigurationError, match="batch"):
        await durable("main", encryption=BOTH).rekey(batch=0)
