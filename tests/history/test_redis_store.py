"""``RedisHistoryStore`` against the real Redis server of ``TOUBA_REDIS_URL`` (SPEC section 6).

Each test works under its own prefix (``touba-test:<uuid>:``) and deletes its keys
afterwards; a second raw client inspects what the store really wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from tests._services import redis_url
from tests._tcp_cut import tcp_cut
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
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
)
from touba.history._reservations import HINT_MEMORY
from touba.history._store import LogSnapshot, LogWrite, StoreUsage
from touba.history._window import ExchangeSize
from touba.history.redis import RedisHistoryStore

pytestmark = pytest.mark.redis

Record = dict[str, Any]
KIND = "touba.decision_history"


# -- fixtures and helpers -----------------------------------------------------------------


@pytest.fixture
def url() -> str:
    return redis_url()


@pytest.fixture
async def raw(url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(url)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(raw: Redis) -> AsyncIterator[str]:
    prefix = f"touba-test:{uuid.uuid4().hex}:"
    yield prefix
    keys = [k async for k in raw.scan_iter(match=prefix + "*", count=1000)]
    if keys:
        await raw.delete(*keys)


@pytest.fixture
async def store(url: str, prefix: str) -> AsyncIterator[RedisHistoryStore]:
    async with RedisHistoryStore(url, prefix=prefix, worker_id="test-worker") as s:
        yield s


def record(*exchanges: list[Record], **extra: Any) -> Record:
    """A touba-shaped record (kept as head + rows by the store)."""
    return {
        "kind": KIND,
        "version": 1,
        "identity": {"namespace": "ns", "run_id": "r"},
        "exchanges": [list(ex) for ex in exchanges],
        **extra,
    }


def put(value: Record | None) -> Callable[[Record | None], Awaitable[tuple[Record | None, Any]]]:
    async def operation(snapshot: Record | None) -> tuple[Record | None, Any]:
        return value, snapshot

    return operation


async def save(store: RedisHistoryStore, key: str, value: Record | None) -> Record | None:
    """Save ``value`` under ``key``; return the snapshot the operation was given."""
    previous: Record | None = await store.transact(key, put(value))
    return previous


async def keys_of(raw: Redis, prefix: str, suffix: str = "") -> list[str]:
    found = [k.decode() async for k in raw.scan_iter(match=f"{prefix}*{suffix}", count=1000)]
    return sorted(found)


async def store_bytes(raw: Redis, prefix: str) -> int:
    """The store's byte counter (absent once the store is empty)."""
    names = await keys_of(raw, prefix, ":bytes")
    return int(await raw.get(names[0]) or 0) if names else 0


async def one_key(raw: Redis, prefix: str, suffix: str) -> str:
    found = await keys_of(raw, prefix, suffix)
    assert len(found) == 1, found
    return found[0]


# -- round trip ---------------------------------------------------------------------------

ODD_VALUES: list[Record] = [
    record([{"role": "model", "text": "é🙂"}], [{"a": 1}, {"b": [None, True, 1.5]}]),
    record(),
    {"kind": KIND, "exchanges": "not rows", "x": 1},
    {"kind": KIND, "exchanges": [[]]},
    {"arbitrary": {"nested": [1, 2.25, -3, None, False, {"deep": "x"}]}, "big": 2**62},
    {"text": 'nul\u0000byte, tab\t, quote", braces {} and unicode 中文'},
    {},
]


@pytest.mark.parametrize("value", ODD_VALUES)
async def test_any_json_dict_round_trips(store: RedisHistoryStore, value: Record) -> None:
    assert await save(store, "k", value) is None
    assert await store.read("k") == value
    assert await save(store, "k", {"next": 1}) == value


async def test_snapshots_and_reads_are_private_copies(store: RedisHistoryStore) -> None:
    value = record([{"a": [1]}])
    await save(store, "k", value)

    async def mutate(snapshot: Record | None) -> tuple[Record | None, None]:
        assert snapshot is not None
        snapshot["exchanges"][0][0]["a"].append(2)
        raise RuntimeError("changed my mind")

    with pytest.raises(RuntimeError):
        await store.transact("k", mutate)
    first = await store.read("k")
    assert first == value
    assert first is not None
    first["exchanges"].clear()
    assert await store.read("k") == value


async def test_none_deletes_and_list_reports_sizes(store: RedisHistoryStore, raw: Redis) -> None:
    value = record([{"a": 1}, {"b": 2}], [{"c": 3}])
    await save(store, "k", value)
    [row] = await store.list()
    assert (row.key, row.messages, row.active, row.reservation) == ("k", 3, False, None)
    assert row.identity == {"namespace": "ns", "run_id": "r"}
    head = {k: v for k, v in value.items() if k != "exchanges"}
    assert row.bytes == len(json.dumps(head, separators=(",", ":"))) + 3 * len('{"a":1}')
    assert row.expires_at is not None
    assert row.updated_at < row.expires_at
    assert await store.list(namespace="ns") == [row]
    assert await store.list(namespace="other") == []

    await save(store, "k", None)
    assert await store.read("k") is None
    assert await store.list() == []
    assert await store_bytes(raw, store.prefix) == 0


async def test_is_empty_until_something_is_stored_and_reads_only(
    store: RedisHistoryStore, raw: Redis
) -> None:
    assert await store.is_empty()
    assert await keys_of(raw, store.prefix) == []  # the check wrote nothing
    await save(store, "k", record([{"a": 1}]))
    assert not await store.is_empty()


# -- append-only log ----------------------------------------------------------------------


async def test_transact_log_appends_only_and_reads_only_the_tail(
    store: RedisHistoryStore, raw: Redis, prefix: str
) -> None:
    m = [{"i": i, "pad": "x" * i} for i in range(5)]
    size = [len(json.dumps(x, separators=(",", ":"))) for x in m]
    head1 = {"kind": KIND, "version": 1, "identity": {"namespace": "ns"}, "n": 1}

    async def first(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[LogWrite, str]:
        assert snapshot is None
        return LogWrite(head1, [(0, m[0]), (0, m[1]), (1, m[2])]), "one"

    assert await store.transact_log("k", first) == "one"
    messages = await one_key(raw, prefix, ":messages")
    before = await raw.lrange(messages, 0, -1)
    assert len(before) == 3

    head2 = {**head1, "n": 2}

    async def second(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, None]:
        assert snapshot is not None
        assert snapshot.head == head1
        assert snapshot.exchange_count == 2
        assert await snapshot.sizes(0) == [
            ExchangeSize(2, size[0] + size[1]),
            ExchangeSize(1, size[2]),
        ]
        assert await snapshot.sizes(1) == [ExchangeSize(1, size[2])]
        assert await snapshot.sizes(2) == []
        assert await snapshot.exchanges(1, 2) == [[m[2]]]
        assert await snapshot.exchanges(0, 2) == [[m[0], m[1]], [m[2]]]
        return LogWrite(head2, [(1, m[3]), (2, m[4])]), None

    await store.transact_log("k", second)
    after = await raw.lrange(messages, 0, -1)
    assert len(after) == len(before) + 2
    assert after[:3] == before  # older rows untouched, byte for byte
    assert await store.read("k") == {**head2, "exchanges": [[m[0], m[1]], [m[2], m[3]], [m[4]]]}

    async def rewrite_old(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, None]:
        return LogWrite(head2, [(0, {"late": True})]), None

    with pytest.raises(ValueError, match="exchange 0"):
        await store.transact_log("k", rewrite_old)
    assert await raw.lrange(messages, 0, -1) == after
    [row] = await store.list()
    assert (row.messages, row.active) == (5, False)


async def test_transact_log_shows_a_record_kept_whole_as_a_head_without_rows(
    store: RedisHistoryStore,
) -> None:
    """As on SQLite and PostgreSQL: the caller decides (a version 1 integration
    record is read whole, a foreign one refused); nothing is changed meanwhile."""
    await save(store, "k", {"not": "touba"})
    seen: list[tuple[Any, int]] = []

    async def look(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite | None, None]:
        assert snapshot is not None
        seen.append((snapshot.head, snapshot.exchange_count))
        return None, None

    await store.transact_log("k", look)
    await store.transact_log_optimistic("k", look)  # (its peek gives way to the reservation)
    assert seen == [({"not": "touba"}, 0)] * 2
    assert await store.read("k") == {"not": "touba"}


async def test_engine_steps_store_the_same_as_memory(store: RedisHistoryStore) -> None:
    """DecisionHistory over Redis keeps exactly what it keeps over RAM."""

    async def run(history_store: Any) -> Record:
        history = DecisionHistory(
            HistoryConfig(store=history_store, namespace="ns", max_messages=4)
        )
        identity = ConversationIdentity(
            "ns", "openai", "m", "native", run_id="r", invocation_id="i", agent_ref="a"
        )
        observations: list[Observation] = []
        windows: list[int] = []
        for step in range(5):

            async def model(window: HistoryWindow, step: int = step) -> DecisionMessage:
                windows.append(len(window.exchanges))
                call = CapabilityCall(f"c{step}", "lookup", {"id": step, "text": "é" * step})
                return DecisionMessage(text=f"step {step}", calls=(call,))

            decision = await history.step(identity, observations, model)
            observations = [
                Observation(c.call_id, c.name, c.arguments, "ok", {"n": step})
                for c in decision.calls
            ]
        stored = await history_store.read(identity.key)
        assert stored is not None
        return {"windows": windows, "exchanges": stored["exchanges"], "stats": stored["stats"]}

    async with MemoryHistoryStore() as memory:
        expected = await run(memory)
    assert await run(store) == expected


# -- exclusion and crash recovery ---------------------------------------------------------


async def test_second_client_is_refused_at_once(
    store: RedisHistoryStore, url: str, prefix: str
) -> None:
    await save(store, "k", {"v": 1})
    holding, done = asyncio.Event(), asyncio.Event()

    async def hold(snapshot: Record | None) -> tuple[Record, str]:
        holding.set()
        await done.wait()
        return {"v": 2}, "saved"

    task = asyncio.create_task(store.transact("k", hold))
    await holding.wait()
    async with RedisHistoryStore(url, prefix=prefix) as other:
        started = time.monotonic()
        with pytest.raises(DecisionHistoryBusy, match="test-worker") as caught:
            await other.transact("k", put({"v": 3}))
        assert caught.value.session_key == "k"
        with pytest.raises(DecisionHistoryBusy):
            await other.read("k")
        with pytest.raises(DecisionHistoryBusy):
            await other.delete("k")
        assert time.monotonic() - started < 1
        done.set()
        assert await task == "saved"
        assert await other.read("k") == {"v": 2}
        assert await other.delete("k") is True
        assert await other.delete("k") is False


CHILD = """
import asyncio, sys
from touba.history.redis import RedisHistoryStore

async def main(url, prefix, key):
    store = RedisHistoryStore(url, prefix=prefix, worker_id="doomed")
    async def operation(snapshot):
        assert snapshot == {"v": 1}, snapshot
        print("reserved", flush=True)
        await asyncio.sleep(60)
        return {"v": "never"}, None
    await store.transact(key, operation)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_crash_keeps_the_key_busy_until_recover(
    store: RedisHistoryStore, url: str, prefix: str
) -> None:
    key = "crash:{k}"
    await save(store, key, {"v": 1})
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, url, prefix, key, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), timeout=10)
        assert line == b"reserved\n"
    finally:
        child.send_signal(signal.SIGKILL)
        await child.communicate()
    assert child.returncode == -signal.SIGKILL

    with pytest.raises(DecisionHistoryBusy, match="doomed"):
        await store.transact(key, put({"v": 2}))
    with pytest.raises(DecisionHistoryBusy):
        await store.read(key)
    with pytest.raises(DecisionHistoryBusy):
        await store.delete(key)
    [row] = await store.list()
    assert row.key == key
    assert row.active is True
    assert row.reservation is not None
    assert row.reservation["pid"] == child.pid
    assert row.reservation["host"] == socket.gethostname()
    assert row.reservation["worker_id"] == "doomed"

    with pytest.raises(ConfigurationError):
        await store.recover(key, worker_stopped=False)
    assert await store.recover(key, worker_stopped=True) is True
    assert await store.recover(key, worker_stopped=True) is False
    assert await store.read(key) == {"v": 1}
    assert await save(store, key, {"v": 3}) == {"v": 1}


async def test_a_new_key_held_by_a_crashed_worker_is_listed_and_recoverable(
    store: RedisHistoryStore, url: str, prefix: str
) -> None:
    async with RedisHistoryStore(url, prefix=prefix, worker_id="w2") as crashed:
        holding = asyncio.Event()

        async def hang(snapshot: Record | None) -> tuple[Record, None]:
            holding.set()
            await asyncio.sleep(60)
            raise AssertionError("unreachable")

        task = asyncio.create_task(crashed.transact("fresh", hang))
        await holding.wait()
        [row] = await store.list()
        assert (row.key, row.active, row.messages, row.identity) == ("fresh", True, 0, None)
        assert row.reservation is not None
        assert row.reservation["worker_id"] == "w2"
        # A worker that dies without its finally blocks: simulate by recovering first.
        assert await store.recover("fresh", worker_stopped=True) is True
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await store.list() == []
    assert await store.read("fresh") is None


async def test_an_operation_that_raises_keeps_state_and_frees_the_key(
    store: RedisHistoryStore, raw: Redis, prefix: str
) -> None:
    value = record([{"a": 1}], [{"b": 2}])
    await save(store, "k", value)
    messages = await one_key(raw, prefix, ":messages")
    rows = await raw.lrange(messages, 0, -1)

    async def boom(*_: Any) -> Any:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await store.transact("k", boom)
    with pytest.raises(KeyError, match="boom"):
        await store.transact_log("k", boom)
    with pytest.raises(DecisionHistoryRecordInvalid):  # not JSON: refused, nothing saved
        await store.transact("k", put({"x": object()}))
    assert await store.read("k") == value
    assert await raw.lrange(messages, 0, -1) == rows
    [row] = await store.list()
    assert row.active is False
    assert await save(store, "k", {"v": 2}) == value


async def test_a_late_commit_after_recover_is_refused(store: RedisHistoryStore) -> None:
    await save(store, "k", {"v": 1})
    holding, done = asyncio.Event(), asyncio.Event()

    async def slow(snapshot: Record | None) -> tuple[Record, None]:
        holding.set()
        await done.wait()
        return {"v": "late"}, None

    task = asyncio.create_task(store.transact("k", slow))
    await holding.wait()
    assert await store.recover("k", worker_stopped=True) is True
    await save(store, "k", {"v": 2})
    done.set()
    with pytest.raises(DecisionHistoryBusy, match="recovered"):
        await task
    assert await store.read("k") == {"v": 2}


# -- expiry -------------------------------------------------------------------------------


async def test_expired_entries_are_purged_on_access_and_read_does_not_renew(
    url: str, prefix: str, raw: Redis
) -> None:
    async with RedisHistoryStore(url, prefix=prefix, ttl_seconds=1.0) as store:
        await save(store, "k", record([{"a": 1}]))
        await asyncio.sleep(0.5)
        assert await store.read("k") is not None
        await asyncio.sleep(0.6)  # 1.1 s after the save: expired, the read did not renew it
        assert await store.read("k") is None
        assert await keys_of(raw, prefix, ":head") == []
        assert await keys_of(raw, prefix, ":messages") == []
        assert await store_bytes(raw, prefix) == 0

    async with RedisHistoryStore(url, prefix=prefix, ttl_seconds=0.2) as store:
        await save(store, "a", {"v": 1})
        await save(store, "b", {"v": 2})
        await asyncio.sleep(0.3)
        assert len(await keys_of(raw, prefix, ":head")) == 2  # lazy: still there
        assert await store.purge_expired() == 2
        assert await keys_of(raw, prefix, ":head") == []
        assert await store.list() == []


async def test_a_reserved_key_is_never_purged(url: str, prefix: str) -> None:
    async with RedisHistoryStore(url, prefix=prefix, ttl_seconds=0.3) as store:
        await save(store, "k", {"v": 1})
        holding, done = asyncio.Event(), asyncio.Event()

        async def slow(snapshot: Record | None) -> tuple[Record, None]:
            holding.set()
            await done.wait()
            return {"v": 2}, None

        task = asyncio.create_task(store.transact("k", slow))
        await holding.wait()
        await asyncio.sleep(0.4)
        assert await store.purge_expired() == 0
        [row] = await store.list()
        assert row.active is True
        done.set()
        await task
        assert await store.read("k") == {"v": 2}


async def test_backstop_expiry_is_lifted_while_reserved(
    store: RedisHistoryStore, raw: Redis, prefix: str
) -> None:
    await save(store, "k", record([{"a": 1}]))
    head = await one_key(raw, prefix, ":head")
    sessions = await one_key(raw, prefix, ":sessions")
    assert await raw.pttl(head) > 86_400_000  # logical expiry plus a grace
    assert await raw.pttl(sessions) > 86_400_000  # the store's keys follow the last record
    holding, done = asyncio.Event(), asyncio.Event()

    async def hold(snapshot: Record | None) -> tuple[Record | None, None]:
        holding.set()
        await done.wait()
        return snapshot, None

    task = asyncio.create_task(store.transact("k", hold))
    await holding.wait()
    assert await raw.pttl(head) == -1  # a reserved conversation never expires under its worker
    assert await raw.pttl(sessions) == -1
    done.set()
    await task
    assert await raw.pttl(head) > 0
    assert await raw.pttl(sessions) > 0
    await store.delete("k")
    assert await keys_of(raw, prefix) == []  # an empty store leaves no key behind


# -- capacity -----------------------------------------------------------------------------


async def test_full_store_refuses_atomically(url: str, prefix: str, raw: Redis) -> None:
    async with RedisHistoryStore(url, prefix=prefix, max_sessions=2) as store:
        await save(store, "a", {"v": 1})
        await save(store, "b", {"v": 1})
        with pytest.raises(DecisionHistoryLimitExceeded) as caught:
            await save(store, "c", {"v": 1})
        assert caught.value.limit == "max_sessions"
        assert await store.read("c") is None
        assert [r.key for r in await store.list()] == ["a", "b"]
        await save(store, "a", {"v": 2})  # updating a stored conversation is fine
        await store.delete("b")
        await save(store, "c", {"v": 1})  # "c" was not left reserved

    big = {"pad": "x" * 600}
    async with RedisHistoryStore(url, prefix=prefix + "bytes:", max_store_bytes=1000) as store:
        value = record([{"a": 1}], [{"b": 2}])
        await save(store, "k", value)
        messages = await one_key(raw, prefix + "bytes:", ":messages")
        rows = await raw.lrange(messages, 0, -1)
        [before] = await store.list()
        with pytest.raises(DecisionHistoryLimitExceeded) as caught:
            await save(store, "k", record([big], [big]))
        assert caught.value.limit == "max_store_bytes"

        async def append(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, None]:
            assert snapshot is not None
            return LogWrite(snapshot.head, [(1, big), (2, big)]), None

        with pytest.raises(DecisionHistoryLimitExceeded):
            await store.transact_log("k", append)
        assert await store.read("k") == value
        assert await raw.lrange(messages, 0, -1) == rows
        assert await store.list() == [before]


async def test_two_creators_of_the_last_slot_one_wins(url: str, prefix: str) -> None:
    async with (
        RedisHistoryStore(url, prefix=prefix, max_sessions=2) as one,
        RedisHistoryStore(url, prefix=prefix, max_sessions=2) as two,
    ):
        await save(one, "existing", {"v": 0})
        claimed = 0
        release = asyncio.Event()

        async def create(snapshot: Record | None) -> tuple[Record, str]:
            nonlocal claimed
            assert snapshot is None
            claimed += 1
            await release.wait()  # hold the reservation while the other one tries
            return {"v": 1}, "created"

        tasks = [
            asyncio.create_task(one.transact("x", create)),
            asyncio.create_task(two.transact("y", create)),
        ]
        await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        refused = [r for r in results if isinstance(r, DecisionHistoryLimitExceeded)]
        assert len(refused) == 1
        assert refused[0].limit == "max_sessions"
        assert results.count("created") == 1
        assert claimed == 1  # the loser was refused when reserving, before its operation
        rows = await one.list()
        assert len(rows) == 2
        assert not any(r.active for r in rows)


# -- keys, configuration, driver ----------------------------------------------------------

# Valid keys only: NUL, "" and lone surrogates are refused by every store alike
# (tests/history/test_keys.py).
ODD_KEYS = ["{", "}", "a:b", "{tag}:x", "é🙂中", "*?[x]", "\x01\n\t", "k" * 500]


async def test_keys_with_odd_characters_are_safe(
    store: RedisHistoryStore, raw: Redis, prefix: str
) -> None:
    for i, key in enumerate(ODD_KEYS):
        await save(store, key, {"i": i})
    for i, key in enumerate(ODD_KEYS):
        assert await store.read(key) == {"i": i}
    assert sorted(r.key for r in await store.list()) == sorted(ODD_KEYS)
    names = await keys_of(raw, prefix)
    tags = {name[len(prefix) :].split("}")[0] for name in names}
    assert len(tags) == 1  # one hash tag: one cluster slot for the whole store
    for name in names:
        assert name.startswith(prefix)
        assert name[len(prefix) :].isascii()
        assert name[len(prefix) :].count("{") == 1
    assert await store.delete("{") is True
    assert await store.read("}") == {"i": 1}


async def test_a_given_client_is_left_open_and_may_decode(url: str, prefix: str) -> None:
    client = Redis.from_url(url, decode_responses=True)
    try:
        async with RedisHistoryStore(client=client, prefix=prefix) as store:
            value = record([{"t": "é"}])
            await save(store, "k", value)
            assert await store.read("k") == value
            [row] = await store.list()
            assert row.key == "k"
        assert await client.ping() is True
        with pytest.raises(ConfigurationError, match="closed"):
            await store.read("k")
    finally:
        await client.aclose()


async def test_configuration_is_checked_at_construction(url: str) -> None:
    client = Redis.from_url(url)
    try:
        with pytest.raises(ConfigurationError, match="exactly one"):
            RedisHistoryStore(url, client=client)
        with pytest.raises(ConfigurationError, match="exactly one"):
            RedisHistoryStore()
        with pytest.raises(ConfigurationError, match="prefix"):
            RedisHistoryStore(client=client, prefix="a{b}")
        with pytest.raises(ConfigurationError, match="max_sessions"):
            RedisHistoryStore(client=client, max_sessions=0)
        with pytest.raises(ConfigurationError, match="ttl_seconds"):
            RedisHistoryStore(client=client, ttl_seconds=0)
        with pytest.raises(ConfigurationError, match="url"):
            RedisHistoryStore("http://127.0.0.1:6379")
        with pytest.raises(ConfigurationError, match=r"redis\.asyncio\.Redis"):
            RedisHistoryStore(client=object())  # type: ignore[arg-type]
    finally:
        await client.aclose()


async def test_driver_errors_become_store_errors() -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
    try:
        async with RedisHistoryStore(client=client) as store:
            with pytest.raises(DecisionHistoryStoreUnavailable, match="Redis failed") as caught:
                await store.read("k")
            assert isinstance(caught.value.__cause__, RedisConnectionError)
            assert caught.value.code == "DecisionHistoryStoreUnavailable"
    finally:
        await client.aclose()


def test_missing_redis_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.delitem(sys.modules, "touba.history.redis")
    with pytest.raises(ImportError, match=r'pip install "touba\[redis\]"'):
        importlib.import_module("touba.history.redis")


@pytest.mark.parametrize(
    ("field", "tampered"),
    [
        ("head", "[1, 2, 3]"),
        ("head", '"text"'),
        ("head", '{"kind": "touba.decision_history", "x": NaN}'),
    ],
    ids=["array", "string", "nan"],
)
async def test_a_tampered_head_is_a_typed_record_error(
    store: RedisHistoryStore, raw: Redis, prefix: str, field: str, tampered: str
) -> None:
    identity = ConversationIdentity("ns", "openai", "m", "native", "r", "i", "a")
    history = DecisionHistory(HistoryConfig(store=store, namespace="ns"))

    async def generate(window: HistoryWindow) -> DecisionMessage:
        return DecisionMessage(calls=(CapabilityCall("c1", "lookup", {}),))

    await history.step(identity, [], generate)
    await raw.hset(await one_key(raw, prefix, ":head"), field, tampered)
    observation = Observation("c1", "lookup", {}, "ok", "done")
    with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
        await history.step(identity, [observation], generate)
    with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
        await store.transact(identity.key, put(None))
    with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
        await store.read(identity.key)
    [row] = await store.list()
    assert row.active is False  # refused without leaving the key held


async def test_a_tampered_message_row_is_a_typed_record_error(
    store: RedisHistoryStore, raw: Redis, prefix: str
) -> None:
    await save(store, "k", record([{"a": 1}], [{"b": 2}]))
    messages = await one_key(raw, prefix, ":messages")
    for bad in ('{"not": "a row"}', "[0, 1]", '[0, 1, "not a message"]', "[99999999, 1, {}]"):
        await raw.lset(messages, 0, bad)
        with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
            await store.read("k")
        with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
            await store.transact("k", put(None))
    [row] = await store.list()
    assert row.active is False


def count_round_trips(store: RedisHistoryStore) -> list[int]:
    """``[n]``: the round trips ``store`` makes from now on (the real calls run);
    set ``n`` back to 0 to count afresh."""
    trips = [0]
    run, lrange = store._run, store._lrange

    async def counted_run(*args: Any, **options: Any) -> Any:
        trips[0] += 1
        return await run(*args, **options)

    async def counted_lrange(*args: Any) -> Any:
        trips[0] += 1
        return await lrange(*args)

    store._run = counted_run  # type: ignore[method-assign]
    store._lrange = counted_lrange  # type: ignore[method-assign,assignment]
    return trips


async def test_a_decision_is_two_round_trips_and_reads_the_right_tail(
    store: RedisHistoryStore,
) -> None:
    who = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")
    history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=6))
    trips = count_round_trips(store)
    seen: list[list[str | None]] = []
    observations: list[Observation] = []
    for step in range(10):

        async def generate(window: HistoryWindow, step: int = step) -> DecisionMessage:
            seen.append([m.text for m in window.messages if isinstance(m, DecisionMessage)])
            call = CapabilityCall(f"c{step}", "f", {})
            return DecisionMessage(text=f"d{step}", calls=(call,))

        trips[0] = 0
        await history.step(who, observations, generate)
        observations = [Observation(f"c{step}", "f", {}, "ok", {"r": step})]
        if step >= 2:  # once the store has seen how much of the tail is read
            assert trips[0] == 2, step
    for step, texts in enumerate(seen):
        assert texts == [f"d{n}" for n in range(max(0, step - 3), step)]


# -- what a claim carries, and versions -----------------------------------------------------


def conversation(exchanges: int) -> Record:
    """A record of ``exchanges`` exchanges of two messages (the last one: one)."""
    rows: list[list[Record]] = [[{"n": n, "m": 0}, {"n": n, "m": 1}] for n in range(exchanges)]
    rows[-1].pop()
    return record(*rows)


@dataclass
class Claim:
    """One claim as it came back from Redis (the real script runs)."""

    token: str
    version: str = ""  # the stored record's version ("" for none)
    row_count: int = 0  # rows the conversation holds
    rows: int = 0  # rows the LRANGE pipelined with it brought
    entries: int = 0  # exchange entries the script returned


def claims_of(store: RedisHistoryStore) -> list[Claim]:
    """Every claim ``store`` makes from now on."""
    seen: list[Claim] = []
    conv = store._conv

    async def recorded(
        script: Any, keys: Any, args: Any, what: str, rows: Any = None, **options: Any
    ) -> Any:
        result = await conv(script, keys, args, what, rows, **options)
        if script is store._claim_script:
            reply, listed = result if rows is not None else (result, [])
            claim = Claim(token=args[1], rows=len(listed))
            if reply[0] == b"found":
                claim.version, claim.row_count = reply[6].decode(), int(reply[7])
                claim.entries = int(reply[9]) if len(reply) > 9 else 0
            seen.append(claim)
        return result

    store._conv = recorded  # type: ignore[method-assign]
    return seen


def decider(texts: list[list[str | None]]) -> Callable[[HistoryWindow], Awaitable[DecisionMessage]]:
    """A model that records the decision texts of each window and calls ``f``."""

    async def generate(window: HistoryWindow) -> DecisionMessage:
        texts.append([m.text for m in window.messages if isinstance(m, DecisionMessage)])
        step = len(texts) - 1
        return DecisionMessage(text=f"d{step}", calls=(CapabilityCall(f"c{step}", "f", {}),))

    return generate


async def decide(history: DecisionHistory, who: ConversationIdentity, texts: list[Any]) -> None:
    pending = f"c{len(texts) - 1}"
    observations = [Observation(pending, "f", {}, "ok", {"r": len(texts)})] if texts else []
    await history.step(who, observations, decider(texts))


async def decided(
    store: RedisHistoryStore, decisions: int
) -> tuple[DecisionHistory, list[list[str | None]]]:
    """WHO's history on ``store`` (windows of 6 messages) after ``decisions`` decisions, and
    what each was sent, to go on with ``decide``."""
    history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=6))
    texts: list[list[str | None]] = []
    for _ in range(decisions):
        await decide(history, WHO, texts)
    return history, texts


async def test_the_claim_carries_the_window_whatever_was_read_before(
    store: RedisHistoryStore,
) -> None:
    history, texts = await decided(store, 60)

    async def look_back(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
        assert snapshot is not None  # read far back, as a summary's exchanges are
        old = await snapshot.exchanges(0, snapshot.exchange_count - 1)
        return LogWrite(head=snapshot.head), len(old)

    assert await store.transact_log(WHO.key, look_back) == 59
    claims = claims_of(store)
    for _ in range(5):
        await decide(history, WHO, texts)
    # The rows of the window's exchanges and one more (the read-ahead: 5 stored
    # messages a window reads, its sixth the result the decision appends, in 4
    # exchanges of 2), plus the two a decision appends: not the 119 read before.
    assert all(c.rows <= 4 * 2 + 2 for c in claims), [c.rows for c in claims]
    assert all(c.entries <= 6 + 1 for c in claims)  # sizes of 6 exchanges, plus one
    for step, seen in enumerate(texts):  # every window was the right one
        assert seen == [f"d{n}" for n in range(max(0, step - 3), step)]


HEAD = {"kind": "touba.test", "version": 1}


async def read_all(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
    """Read every exchange (it reaches the last one: a window read, as a session's
    ``get_items()`` is) and save nothing new."""
    assert snapshot is not None
    everything = await snapshot.exchanges(0, snapshot.exchange_count)
    return LogWrite(head=snapshot.head), len(everything)


async def bulk(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
    """Open a conversation with one exchange of 300 messages."""
    assert snapshot is None
    return LogWrite(head=HEAD, append=[(0, {"n": n}) for n in range(300)]), None


@pytest.mark.parametrize("wide", ["read", "append"])
async def test_one_wide_read_or_bulk_append_widens_the_claims_for_a_while_only(
    store: RedisHistoryStore, wide: str
) -> None:
    """A claim carries what the last HINT_MEMORY operations of its own kind read (a
    whole conversation read by another kind of operation, a session's
    ``get_items()``, widens only that kind's claims), plus what saves appended
    lately: one append of many messages (to any conversation) widens the next
    claims for a while only."""
    history, texts = await decided(store, 60)
    if wide == "read":
        assert await store.transact_log(WHO.key, read_all) == 60
    else:
        await store.transact_log("bulk", bulk)
    claims = claims_of(store)
    for _ in range(HINT_MEMORY + 4):
        await decide(history, WHO, texts)
    rows = [c.rows for c in claims]
    if wide == "append":
        assert rows[0] >= 100, rows  # still wide right after (all the 120 rows there are)
    # (then) the rows of the window's exchanges and the two a decision appends
    assert all(n <= 4 * 2 + 2 for n in rows[HINT_MEMORY + 1 if wide == "append" else 0 :]), rows
    assert await store.transact_log(WHO.key, read_all) == 60 + HINT_MEMORY + 4
    claims.clear()
    await decide(history, WHO, texts)
    assert [c.rows <= 4 * 2 + 2 for c in claims] == [True]  # a decision's, as before it
    for step, seen in enumerate(texts):  # every window was the right one
        assert seen == [f"d{n}" for n in range(max(0, step - 3), step)]


async def test_a_conversation_growing_into_its_window_is_read_with_the_claim(
    store: RedisHistoryStore,
) -> None:
    who = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")
    history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=40))
    texts: list[list[str | None]] = []
    await decide(history, who, texts)
    await decide(history, who, texts)
    claims = claims_of(store)
    for _ in range(15):
        await decide(history, who, texts)
    # Each claim brought the whole conversation (it fits its window), and only it.
    assert [c.rows for c in claims] == [c.row_count for c in claims]
    assert [c.row_count for c in claims] == [3 + 2 * n for n in range(15)]
    for step, seen in enumerate(texts):
        assert seen == [f"d{n}" for n in range(step)]


async def test_reads_beyond_what_the_claim_brought_are_right(store: RedisHistoryStore) -> None:
    from touba.history._store import RecordSnapshot

    value = conversation(50)
    await save(store, "k", value)
    truth = RecordSnapshot.of(value)
    reservations = store._reservations
    reservations._sizes.note(10)
    reservations._bodies.note(4)
    assert (reservations.sizes_hint, reservations.bodies_hint) == (10, 4)
    store._backend._per_exchange.note(1750)  # 7 rows read ahead for 4 exchanges

    async def check(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
        assert snapshot is not None
        assert snapshot.exchange_count == 50
        for start in (0, 1, 39, 40, 41, 45, 49, 50):
            assert await snapshot.sizes(start) == await truth.sizes(start), start
        for start, stop in [(0, 50), (0, 3), (10, 44), (43, 47), (44, 50), (49, 50), (3, 99)]:
            assert await snapshot.exchanges(start, stop) == await truth.exchanges(start, stop)
        return None, None

    claims = claims_of(store)
    await store.transact_log("k", check)
    (claim,) = claims
    assert claim.entries == 10
    assert claim.rows == 7  # the 4 last exchanges (2 messages each, the last one 1)
    [row] = await store.list()
    assert row.active is False


async def test_a_version_changes_on_every_save_and_never_repeats(
    store: RedisHistoryStore,
) -> None:
    claims = claims_of(store)
    versions = []

    async def append(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
        assert snapshot is not None
        count = snapshot.exchange_count
        return LogWrite(head=snapshot.head, append=[(count, {"n": count})]), None

    async def nothing(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
        return None, None

    for _ in range(2):
        await save(store, "k", conversation(3))  # the same content each time
        for _ in range(3):
            await store.transact_log("k", append)
        await store.transact_log("k", nothing)  # released: no save, the same version
        await store.read("k")
        await store.transact_log("k", nothing)
        versions.append([c.version for c in claims])
        claims.clear()
        assert await store.delete("k")
    for run in versions:
        # transact's claim of the new key (no version), the appends' three claims
        # after three saves, then the fourth save's version, seen twice
        assert len(run) == 6
        assert run[0] == ""
        assert len(set(run[1:5])) == 4
        assert run[4] == run[5]
        assert all(len(v) == 32 for v in run[1:])
    first, second = versions
    assert not set(first[1:]) & set(second[1:])  # re-created: no version comes back


async def test_the_version_is_the_saving_reservation_token(store: RedisHistoryStore) -> None:
    claims = claims_of(store)
    await save(store, "k", conversation(2))
    await save(store, "k", conversation(4))
    await store.transact("k", put(conversation(4)))
    saver, *later = claims
    assert later[0].version == saver.token
    assert later[1].version == later[0].token


async def test_two_store_objects_on_one_server_never_see_stale_windows(
    url: str, prefix: str
) -> None:
    who = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")
    async with (
        RedisHistoryStore(url, prefix=prefix) as one,
        RedisHistoryStore(url, prefix=prefix) as two,
    ):
        small = DecisionHistory(HistoryConfig(store=one, namespace="n", max_messages=6))
        large = DecisionHistory(HistoryConfig(store=two, namespace="n", max_messages=14))
        texts: list[list[str | None]] = []
        order = [small, large, large, small, small, small, large] * 6
        for history in order:
            await decide(history, who, texts)
        for step, (history, seen) in enumerate(zip(order, texts, strict=True)):
            depth = 3 if history is small else 7  # exchanges of two messages in the window
            assert seen == [f"d{n}" for n in range(max(0, step - depth), step)], step


async def test_a_damaged_exchange_entry_is_a_typed_error_and_frees_the_key(
    store: RedisHistoryStore, raw: Redis, prefix: str
) -> None:
    history, texts = await decided(store, 4)
    await raw.lset(await one_key(raw, prefix, ":exchanges"), -2, "not:an entry")
    with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
        await decide(history, WHO, texts)
    [row] = await store.list()
    assert row.active is False


async def test_a_claim_loads_its_script_when_the_server_lacks_it(
    store: RedisHistoryStore,
) -> None:
    from touba.history._lua import load

    history, texts = await decided(store, 3)
    # A script the server has never seen (as after a restart or SCRIPT FLUSH): the
    # pipelined claim gets NOSCRIPT, loads it and runs again.
    fresh = f"{load('claim').text}\n-- {uuid.uuid4().hex}\n"
    store._claim_script = store._client.register_script(fresh)
    assert await store._client.script_exists(store._claim_script.sha) == [False]
    claims = claims_of(store)
    await decide(history, WHO, texts)
    assert await store._client.script_exists(store._claim_script.sha) == [True]
    assert claims[0].rows == claims[0].row_count == 5  # pipelined with the claim
    assert texts[-1] == ["d0", "d1", "d2"]


# -- the content-validated tail cache -------------------------------------------------------
# Redis cannot see another client's LSET or LREM of a row (the version stays), so
# every claim brings the window's rows and the cached parse of a message is used
# only while its stored text is byte-identical (touba.history._tail_cache, content
# mode).

WHO = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")


async def rows_of(raw: Redis, prefix: str) -> tuple[str, list[list[Any]]]:
    """The messages list of the one conversation, and its rows parsed."""
    name = await one_key(raw, prefix, ":messages")
    return name, [json.loads(row) for row in await raw.lrange(name, 0, -1)]


def as_row(exchange: int, message: Record) -> str:
    body = json.dumps(message, separators=(",", ":"))
    return f"[{exchange},{len(body.encode())},{body}]"


def counted_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every stored message the shared layer parses from a read (the real parse runs)."""
    from touba.history import _tail_cache

    parsed: list[str] = []
    original = _tail_cache._frozen_object_of

    def counting(body: str, key: str, label: str) -> Record:
        parsed.append(body)
        return original(body, key, label)

    monkeypatch.setattr(_tail_cache, "_frozen_object_of", counting)
    return parsed


async def test_an_in_place_edit_of_a_cached_row_is_refused_on_the_next_decision(
    store: RedisHistoryStore, raw: Redis, prefix: str
) -> None:
    history, texts = await decided(store, 5)
    assert store._reservations.cache.peek(WHO.key) is not None  # the window is cached
    name, rows = await rows_of(raw, prefix)
    at = len(rows) - 2  # the result of exchange 3, in the window and in the cache
    exchange, _size, message = rows[at]
    assert message["kind"] == "result"
    message["call_id"] = "c-forged"  # the version stays: only the text tells
    await raw.lset(name, at, as_row(exchange, message))
    with pytest.raises(DecisionHistoryRecordInvalid, match="is damaged"):
        await decide(history, WHO, texts)
    assert len(texts) == 5  # nothing was generated
    assert store._reservations.cache.peek(WHO.key) is None
    [row] = await store.list()
    assert (row.active, row.messages) == (False, len(rows))


async def test_rows_whose_text_is_unchanged_are_not_parsed_again(
    store: RedisHistoryStore, raw: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    history, texts = await decided(store, 5)
    parsed = counted_parses(monkeypatch)
    for _ in range(3):
        await decide(history, WHO, texts)
    assert parsed == []  # the window came with each claim; every text matched
    name, rows = await rows_of(raw, prefix)
    at = max(i for i, row in enumerate(rows) if row[2]["kind"] == "decision")
    exchange, _size, message = rows[at - 2]  # the decision before the pending one
    assert message["text"] == "d6"
    message["text"] = "edited"  # well formed, another text: parsed and shown
    await raw.lset(name, at - 2, as_row(exchange, message))
    await decide(history, WHO, texts)
    assert len(parsed) == 2  # the edited exchange's two messages, no other
    assert texts[-1] == ["d5", "edited", "d7"]
    parsed.clear()
    await decide(history, WHO, texts)
    assert parsed == []
    assert texts[-1] == ["edited", "d7", "d8"]


async def test_a_narrow_claim_keeps_what_a_wide_one_parsed_until_it_is_checked(
    store: RedisHistoryStore, raw: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's ``add_items`` claims only the last exchange and its ``get_items``
    the window: the window's messages, parsed once, are reused by the next wide
    claim whose texts match, never served unchecked (an edit behind touba's back
    in between is parsed, and shown). The claims are what this measures, so the
    optimistic path (which makes none while the tail is current; its own checks
    are in tests/integrations/test_optimistic_sessions.py) and the peeked read
    (tested below) are switched off."""
    from touba.integrations.openai_agents import ToubaSession

    monkeypatch.setattr(type(store._reservations.backend), "save_if", None)
    monkeypatch.setattr(type(store._reservations.backend), "peek", None)

    def item(n: int) -> Any:
        return {"role": "user", "content": f"q{n}"}

    session = ToubaSession("s", store=store, namespace="ns")
    await session.add_items([item(n) for n in range(30)])
    last = 30 + HINT_MEMORY  # the bulk append is forgotten, the kinds' read-ahead settles
    for n in range(30, last):
        await session.get_items(limit=10)
        await session.add_items([item(n)])
    claims = claims_of(store)
    parsed = counted_parses(monkeypatch)
    await session.add_items([item(last)])
    assert await session.get_items(limit=10) == [item(n) for n in range(last - 9, last + 1)]
    add, get = (c.rows for c in claims)
    assert add <= 3, add  # the last exchange
    assert 10 <= get <= 13, get  # the window
    assert parsed == []  # every text matched what was parsed before
    name, rows = await rows_of(raw, prefix)
    at = len(rows) - 8  # in the window, outside the add's claim
    rows[at][2]["content"] = "edited"  # behind touba's back
    await raw.lset(name, at, as_row(rows[at][0], rows[at][2]))
    await session.add_items([item(last + 1)])
    window = await session.get_items(limit=10)
    assert window[-9] == {"role": "user", "content": "edited"}
    assert len(parsed) == 1  # the edited message, no other


async def _wide_session(store: RedisHistoryStore, items: int = 40) -> Any:
    """A session whose reads have settled wider than OPTIMISTIC_READ exchanges."""
    from touba.integrations.openai_agents import ToubaSession

    session = ToubaSession("s", store=store, namespace="ns")
    await session.add_items([{"role": "user", "content": f"q{n}"} for n in range(items)])
    for _ in range(2):
        await session.get_items()
    return session


def _items(*numbers: int) -> list[Any]:
    return [{"role": "user", "content": f"q{n}"} for n in numbers]


async def test_a_wide_session_read_is_one_round_trip_that_renews_the_expiry(
    store: RedisHistoryStore, raw: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of more than OPTIMISTIC_READ exchanges is peeked: the claim's read and
    its rows in one MULTI, no reservation and no commit; the expiry renewed there,
    as a save would; the parsed messages reused while their texts match, an edit
    behind touba's back parsed and shown."""
    session = await _wide_session(store)
    head = await one_key(raw, prefix, ":head")
    await raw.hset(head, "expires_at", "1")  # as if it expired long ago...
    await raw.zadd(await one_key(raw, prefix, "expiry"), {head.split(":")[-2]: 2**50})
    trips = count_round_trips(store)  # ...but the expiry index keeps it live
    parsed = counted_parses(monkeypatch)
    assert await session.get_items() == _items(*range(40))
    assert trips == [1]
    assert parsed == []  # every text was the one parsed before
    (seconds, _micros) = await raw.time()
    expires = int(await raw.hget(head, "expires_at") or 0)
    assert expires >= seconds * 1000 + store._ttl_ms - 5000  # renewed by the read
    assert await raw.hget(head, "token") is None  # and never reserved
    name, rows = await rows_of(raw, prefix)
    rows[30][2]["content"] = "edited"  # behind touba's back
    await raw.lset(name, 30, as_row(rows[30][0], rows[30][2]))
    assert (await session.get_items())[30] == {"role": "user", "content": "edited"}
    assert len(parsed) == 1  # that message alone
    assert trips == [2]


async def test_a_peeked_read_refuses_while_held_and_leaves_writes_to_the_reserved_path(
    store: RedisHistoryStore, url: str, prefix: str
) -> None:
    from touba.integrations.openai_agents import ToubaSession

    session = await _wide_session(store)
    async with RedisHistoryStore(url, prefix=prefix) as other:
        holder = ToubaSession("s", store=other, namespace="ns")
        async with holder.exclusive():
            await holder.add_items(_items(40))
            with pytest.raises(DecisionHistoryBusy):
                await session.get_items()
    assert await session.get_items() == _items(*range(41))  # the holder's write, read

    claims = claims_of(store)

    async def read_then_append(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, int]:
        assert snapshot is not None
        count = snapshot.exchange_count
        seen = await snapshot.exchanges(count - 30, count)  # as wide as the reads were
        return LogWrite(head=snapshot.head, append=[(count, {"role": "user"})]), len(seen)

    for _ in range(HINT_MEMORY):  # this kind's read-ahead settles wide too
        assert await store.transact_log_optimistic(session.session_key, read_then_append) == 30
    assert len(claims) == HINT_MEMORY  # every write went through a reservation
    claims.clear()
    everything = await session.get_items()  # wider than any read of its kind before
    assert everything[41:] == [{"role": "user"}] * HINT_MEMORY
    assert len(claims) == 0  # beyond what was peeked: peeked again, wider, never reserved
    assert await session.get_items() == everything
    assert len(claims) == 0


async def test_a_peek_loads_its_script_when_the_server_lacks_it(
    store: RedisHistoryStore,
) -> None:
    """Inside the MULTI too: the peek gets NOSCRIPT, loads the script and runs again."""
    from touba.history._lua import load

    session = await _wide_session(store)
    fresh = f"{load('peek').text}\n-- {uuid.uuid4().hex}\n"
    store._peek_script = store._client.register_script(fresh)
    assert await store._client.script_exists(store._peek_script.sha) == [False]
    trips = count_round_trips(store)
    assert await session.get_items() == _items(*range(40))
    assert await store._client.script_exists(store._peek_script.sha) == [True]
    assert trips == [1]  # the peek (its load and second try inside the same call)


async def test_a_peek_sees_what_another_store_object_added_to_the_cached_exchange(
    store: RedisHistoryStore, url: str, prefix: str
) -> None:
    """The tail a store object holds is only a parse cache for its peeks: another
    store object's output completing the last exchange (the exchange count
    unchanged) is in the next peeked read."""
    from touba.integrations.openai_agents import ToubaSession

    session = await _wide_session(store, items=12)
    call: Any = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output: Any = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    async with RedisHistoryStore(url, prefix=prefix) as other:
        writer = ToubaSession("s", store=other, namespace="ns")
        await writer.add_items([call])
        assert await session.get_items() == _items(*range(12))  # the call is not answered
        await writer.add_items([output])
    trips = count_round_trips(store)
    assert await session.get_items() == [*_items(*range(12)), call, output]
    assert trips == [1]


async def test_peeked_reads_racing_appends_see_whole_states(
    store: RedisHistoryStore, url: str, prefix: str
) -> None:
    """Wide reads through one store object while another appends: each read is one
    state (the items in order, none missing), however the two interleave. (The
    MULTI around the peek and its LRANGE is what guarantees it; Redis mostly runs
    one client's pipelined commands back to back anyway, so this checks the
    outcome and does not prove the MULTI necessary.)"""
    from touba.integrations.openai_agents import ToubaSession

    session = await _wide_session(store)
    seen: list[int] = []
    async with RedisHistoryStore(url, prefix=prefix) as other:
        writer = ToubaSession("s", store=other, namespace="ns")

        async def append() -> None:
            n = 40
            for _ in range(2000):  # (bounded: a key left held fails the test, not hangs it)
                if n == 100:
                    return
                with contextlib.suppress(DecisionHistoryBusy):  # a reserved read holds it
                    await writer.add_items(_items(n))
                    n += 1
                await asyncio.sleep(0)

        async def read() -> None:
            for _ in range(2000):
                if len(seen) == 200:
                    return
                with contextlib.suppress(DecisionHistoryBusy):  # a reserved add holds it
                    items = await session.get_items()
                    assert items == _items(*range(len(items)))
                    seen.append(len(items))
                await asyncio.sleep(0)

        await asyncio.gather(append(), read())
    assert len(seen) == 200
    assert await session.get_items() == _items(*range(100))
    assert seen[0] >= 40
    assert seen == sorted(seen)


async def test_a_peeked_read_of_another_kind_of_record_is_refused_and_renews_nothing(
    store: RedisHistoryStore, raw: Redis, prefix: str
) -> None:
    session = await _wide_session(store)
    await store.transact(session.session_key, put({"not": "a session"}))
    head = await one_key(raw, prefix, ":head")
    before = await raw.hget(head, "expires_at")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await session.get_items()
    assert await raw.hget(head, "expires_at") == before
    assert await store.read(session.session_key) == {"not": "a session"}


@pytest.mark.parametrize("optimistic", [False, True])
async def test_a_session_pop_is_two_round_trips_or_one(
    store: RedisHistoryStore, monkeypatch: pytest.MonkeyPatch, optimistic: bool
) -> None:
    """Reserved, the claim brings the rows a pop drops and the commit checks them,
    no read between: two round trips. Optimistic (the store object's tail is
    current), one script compares those rows and drops them: one."""
    from touba.integrations.openai_agents import ToubaSession

    if not optimistic:
        monkeypatch.setattr(type(store._reservations.backend), "save_if", None)
    session = ToubaSession("s", store=store, namespace="ns")
    await session.add_items([{"role": "user", "content": f"q{n}"} for n in range(5)])
    await session.pop_item()  # the kinds' read-ahead settles
    trips = count_round_trips(store)
    assert await session.pop_item() == {"role": "user", "content": "q3"}
    assert trips == ([1] if optimistic else [2])
    assert await session.get_items() == [{"role": "user", "content": f"q{n}"} for n in range(3)]


async def test_two_store_objects_on_one_server_see_each_others_rewrites(
    url: str, prefix: str
) -> None:
    async with (
        RedisHistoryStore(url, prefix=prefix) as one,
        RedisHistoryStore(url, prefix=prefix) as two,
    ):
        history = DecisionHistory(HistoryConfig(store=one, namespace="n", max_messages=6))
        texts: list[list[str | None]] = []
        for _ in range(4):
            await decide(history, WHO, texts)

        async def rewrite(value: Record | None) -> tuple[Record | None, None]:
            assert value is not None  # the same exchanges, other decision texts
            for exchange in value["exchanges"]:
                for message in exchange:
                    if message["kind"] == "decision":
                        message["text"] = message["text"].upper()
            return value, None

        await two.transact(WHO.key, rewrite)
        await decide(history, WHO, texts)
        assert texts[-1] == ["D1", "D2", "D3"]
        other = DecisionHistory(HistoryConfig(store=two, namespace="n", max_messages=6))
        await decide(other, WHO, texts)  # two appends; one must see it
        await decide(history, WHO, texts)
        assert texts[-2:] == [["D2", "D3", "d4"], ["D3", "d4", "d5"]]


async def test_a_failed_save_drops_the_cached_tail(url: str, prefix: str) -> None:
    async with RedisHistoryStore(url, prefix=prefix, max_store_bytes=4000) as store:
        history, texts = await decided(store, 3)
        assert store._reservations.cache.peek(WHO.key) is not None
        before = await store.read(WHO.key)
        large = [Observation("c2", "f", {}, "ok", {"r": "x" * 5000})]
        with pytest.raises(DecisionHistoryLimitExceeded):
            await history.step(WHO, large, decider(texts))
        assert store._reservations.cache.peek(WHO.key) is None
        assert await store.read(WHO.key) == before
        await decide(history, WHO, texts)  # read again from Redis: still right
        assert texts[-1] == ["d0", "d1", "d2"]


@pytest.mark.parametrize("when", ["between decisions", "during the model call"])
@pytest.mark.parametrize("retries", ["the store's own client", "a client without retries"])
async def test_connections_cut_by_the_server(
    url: str, prefix: str, when: str, retries: str
) -> None:
    """A connection cut with a command in flight, at the first command of a decision or
    at the save after its model answered: the client the store makes from ``url`` sends
    the failed command again on a new connection (every write is a script a second run
    finds done), so the decision goes through once; a client of the caller's with no
    retries fails that decision with DecisionHistoryStoreUnavailable (retryable, chained
    to redis-py's error), which saves nothing and leaves the conversation free for the
    next one. The cut is a relay's (tests/_tcp_cut.py): redis-py heals an idle
    connection the server killed before it sends on it, so a killed idle client would
    prove nothing."""
    own = retries == "the store's own client"
    parts = urlsplit(url)
    identity = ConversationIdentity("ns", "openai", "m", "native", "r", "i", "a")
    texts: list[list[str | None]] = []

    async def decide(text: str, during: Callable[[], Awaitable[None]] | None = None) -> None:
        async def generate(window: HistoryWindow) -> DecisionMessage:
            texts.append(
                [m.text for ex in window.exchanges for m in ex if isinstance(m, DecisionMessage)]
            )
            if during is not None:
                await during()
            return DecisionMessage(text=text, final=True)

        await history.step(identity, [], generate)

    async with tcp_cut(parts.hostname or "127.0.0.1", parts.port or 6379) as relay:
        relayed = parts._replace(netloc=f"127.0.0.1:{relay.port}").geturl()

        async def cut() -> None:
            relay.arm()

        client = None if own else Redis.from_url(relayed, retry=Retry(NoBackoff(), 0))
        store = (
            RedisHistoryStore(relayed, prefix=prefix)
            if own
            else RedisHistoryStore(client=client, prefix=prefix)
        )
        try:
            async with store:
                history = DecisionHistory(
                    HistoryConfig(store=store, namespace="ns", max_messages=6)
                )
                for n in range(3):
                    await decide(f"d{n}")
                if when == "between decisions":
                    await cut()
                during = cut if when == "during the model call" else None
                if own:
                    await decide("kept", during)
                else:
                    with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
                        await decide("lost", during)
                    assert caught.value.retryable
                    assert isinstance(caught.value.__cause__, RedisConnectionError)
                assert relay.cuts == 1
                await decide("d3")  # not left reserved, and the client connects again
                await decide("d4")
        finally:
            if client is not None:
                await client.aclose()
    assert texts[-1] == ["d0", "d1", "d2", *(["kept"] if own else []), "d3"]
