"""Every built-in store validates session keys the same way, before touching anything.

A key is a non-empty ``str`` of at most 512 UTF-8 bytes, without NUL and without
lone surrogates (``touba.history._common.check_key``, shared by all of them).
Anything else is a ``ConfigurationError`` from every method that takes a key,
and leaves nothing behind: no row, no reservation, no misleading Busy later.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.history._stores import Stores, state
from touba.errors import ConfigurationError
from touba.history._common import MAX_KEY_BYTES, check_key

BAD_KEYS: list[Any] = [
    123,
    None,
    b"key",
    ("a", "b"),
    "",
    "nul\x00byte",
    "lone \ud800 surrogate",
    "k" * (MAX_KEY_BYTES + 1),
    "é" * (MAX_KEY_BYTES // 2 + 1),  # 514 bytes in 257 characters
]
GOOD_KEYS = ["k" * MAX_KEY_BYTES, "é" * (MAX_KEY_BYTES // 2), "{tag}:x", "\x01\n", "123"]


async def _op(snapshot: Any) -> tuple[dict[str, Any], None]:
    return {"saved": True}, None


async def _log_op(snapshot: Any, usage: Any) -> tuple[None, None]:
    raise AssertionError("a bad key must be refused before any operation runs")


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_check_key_refuses(key: Any) -> None:
    with pytest.raises(ConfigurationError, match="session key"):
        check_key(key)


@pytest.mark.parametrize("key", GOOD_KEYS, ids=lambda k: repr(k)[:20])
def test_check_key_accepts(key: str) -> None:
    assert check_key(key) == key


async def test_every_store_refuses_bad_keys_and_writes_nothing(stores: Stores) -> None:
    store = stores()
    for key in BAD_KEYS:
        calls = (
            store.transact(key, _op),
            store.transact_log(key, _log_op),
            store.read(key),
            store.delete(key),
            store.recover(key, worker_stopped=True),
        )
        for call in calls:
            with pytest.raises(ConfigurationError, match="session key"):
                await call
    assert await state(store) == []
    assert (await store.usage()).sessions == 0


async def test_every_store_keeps_good_keys_apart(stores: Stores) -> None:
    store = stores()
    for index, key in enumerate(GOOD_KEYS):
        await store.transact(key, lambda _s, i=index: _saved(i))
    for index, key in enumerate(GOOD_KEYS):
        assert await store.read(key) == {"i": index}
    assert sorted(row.key for row in await store.list()) == sorted(GOOD_KEYS)


async def _saved(index: int) -> tuple[dict[str, Any], None]:
    return {"i": index}, None
