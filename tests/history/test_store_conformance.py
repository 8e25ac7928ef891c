"""The store contract suite, run on every store, and proof that it can fail.

``TestStoreConformance`` runs ``touba.testing.store_conformance`` on the
built-in stores (SQLite on real files, PostgreSQL and Redis on the real servers
of ``TOUBA_POSTGRES_DSN`` / ``TOUBA_REDIS_URL``) and on ``DictStore``, a custom
adapter written the way a user would write one.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import itertools
import json
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest

from tests._services import postgres_dsn, redis_url, unavailable
from touba.errors import DecisionHistoryBusy
from touba.history import MemoryHistoryStore
from touba.testing import store_conformance
from touba.testing.store_conformance import (
    CHECK_NAMES,
    ExpiringStoreFactory,
    LimitedStoreFactory,
    StoreConformance,
    StoreFactory,
    check_atomicity,
    check_exception_keeps_state,
    check_exclusion,
    check_private_snapshots,
    check_store,
    open_store,
    run_check,
)

T = TypeVar("T")
Record = dict[str, Any]
Operation = Callable[[Record | None], Awaitable[tuple[Record | None, T]]]


class DictStore:
    """A complete custom adapter: the plain ``transact`` contract, nothing more.

    Records are kept as JSON text, so every snapshot is a private copy and
    anything that is not JSON is refused before it is saved. One asyncio.Lock
    per key refuses a second operation on a held key at once, as the built-in
    stores do. Nothing is saved unless the operation returns. (One process and
    no bounds or expiry: a real adapter adds capacity, TTL and crash recovery.)
    """

    def __init__(self) -> None:
        self._records: dict[str, str] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def transact(self, key: str, operation: Operation[T]) -> T:
        lock = self._locks[key]
        if lock.locked():
            raise DecisionHistoryBusy(f"conversation {key} is in use; retry", session_key=key)
        async with lock:
            return await self._run(key, operation)

    async def _run(self, key: str, operation: Operation[T]) -> T:
        """The operation on a private copy of the record, saved (or deleted) once it returns."""
        stored = self._records.get(key)
        record, result = await operation(None if stored is None else json.loads(stored))
        if record is None:
            self._records.pop(key, None)
        else:
            self._records[key] = json.dumps(record)
        return result


# -- which stores ------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    factory: StoreFactory
    limited: LimitedStoreFactory | None = None
    cleanup: Callable[[], None] = lambda: None
    expiring: ExpiringStoreFactory | None = None

    def __post_init__(self) -> None:
        if self.expiring is None and self.limited is not None:
            # The built-ins' factories pass every keyword to the store.
            object.__setattr__(self, "expiring", self.limited)


def _store_module(name: str) -> ModuleType:
    """Import a store module, or skip while it does not exist yet."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            pytest.skip(f"{name} does not exist yet; its conformance tests run once it lands")
        unavailable(f"{name} cannot be imported, {e.name!r} is missing: {e}")
    except Exception as e:
        unavailable(f"{name} failed to import: {type(e).__name__}: {e}")


def _memory(tmp_path: Path) -> Backend:
    return Backend(MemoryHistoryStore, MemoryHistoryStore)


def _sealing(encrypted: bool) -> dict[str, Any]:
    """The ``encryption=`` of an encrypted store's factory (two keys, one current)."""
    if not encrypted:
        return {}
    from touba import Encryption

    return {"encryption": Encryption(keys={"a": b"a" * 32, "b": b"b" * 32}, current="b")}


def _sqlite(tmp_path: Path, encrypted: bool = False) -> Backend:
    store_class = _store_module("touba.history.sqlite").SqliteHistoryStore
    files = itertools.count()
    sealing = _sealing(encrypted)

    def make(**limits: Any) -> Any:  # a new file per store
        name = str(tmp_path / f"history-{next(files)}.sqlite")
        return store_class(filename=name, **sealing, **limits)

    return Backend(make, make)


def _postgres(tmp_path: Path, encrypted: bool = False) -> Backend:
    store_class = _store_module("touba.history.postgres").PostgresHistoryStore
    dsn = postgres_dsn()
    import psycopg
    from psycopg import sql

    schema = f"touba_conformance_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    tables = itertools.count()

    def make(**limits: Any) -> Any:  # a new table per store, in a schema of this test
        table = f"{schema}.h{next(tables)}"
        return store_class(dsn=dsn, table=table, **_sealing(encrypted), **limits)

    def drop_schema() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

    return Backend(make, make, drop_schema)


def _redis(tmp_path: Path, encrypted: bool = False) -> Backend:
    store_class = _store_module("touba.history.redis").RedisHistoryStore
    url = redis_url()
    import redis

    root = f"touba-conformance:{uuid.uuid4().hex}:"
    prefixes = itertools.count()

    def make(**limits: Any) -> Any:  # a new key prefix per store, under one of this test
        prefix = f"{root}{next(prefixes)}:"
        return store_class(url=url, prefix=prefix, **_sealing(encrypted), **limits)

    def delete_keys() -> None:
        with redis.Redis.from_url(url) as client:
            keys = list(client.scan_iter(match=root + "*", count=1000))
            if keys:
                client.delete(*keys)

    return Backend(make, make, delete_keys)


def _custom(tmp_path: Path) -> Backend:
    return Backend(DictStore)


BACKENDS: dict[str, Callable[[Path], Backend]] = {
    "memory": _memory,
    "sqlite": _sqlite,
    "postgres": _postgres,
    "redis": _redis,
    "custom-dict-lock": _custom,
    "sqlite-encrypted": functools.partial(_sqlite, encrypted=True),
    "postgres-encrypted": functools.partial(_postgres, encrypted=True),
    "redis-encrypted": functools.partial(_redis, encrypted=True),
}


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("redis", marks=pytest.mark.redis),
        "custom-dict-lock",
        "sqlite-encrypted",
        pytest.param("postgres-encrypted", marks=pytest.mark.postgres),
        pytest.param("redis-encrypted", marks=pytest.mark.redis),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    built = BACKENDS[request.param](tmp_path)
    yield built
    built.cleanup()


class TestStoreConformance(StoreConformance):
    @pytest.fixture
    def store_factory(self, backend: Backend) -> StoreFactory:
        return backend.factory

    @pytest.fixture
    def limited_store_factory(self, backend: Backend) -> LimitedStoreFactory | None:
        return backend.limited

    @pytest.fixture
    def expiring_store_factory(self, backend: Backend) -> ExpiringStoreFactory | None:
        return backend.expiring


# -- the function API --------------------------------------------------------------------


async def test_check_store_passes_the_memory_store() -> None:
    report = await check_store(
        MemoryHistoryStore, limited_factory=MemoryHistoryStore, expiring_factory=MemoryHistoryStore
    )
    assert report.passed == CHECK_NAMES
    assert report.skipped == {}


async def test_check_store_skips_what_a_plain_adapter_does_not_offer() -> None:
    report = await check_store(DictStore)
    optional = {"read", "delete", "recover", "list", "capacity", "expiry", "log_interface"}
    assert set(report.skipped) == optional
    assert set(report.passed) == set(CHECK_NAMES) - optional
    assert "DictStore has no read(key) method" in report.skipped["read"]


async def test_factories_may_be_async_or_context_managers() -> None:
    closed: list[str] = []

    @asynccontextmanager
    async def managed() -> AsyncIterator[MemoryHistoryStore]:
        yield MemoryHistoryStore()
        closed.append("managed")

    async def built() -> DictStore:
        return DictStore()

    await run_check("exclusion", managed)
    await run_check("round_trip", built)
    assert closed == ["managed"]
    with pytest.raises(ValueError, match="unknown check 'nope'"):
        await run_check("nope", built)


class WaitingStore(DictStore):
    """Also valid: a second operation on a held key waits its turn instead of failing."""

    async def transact(self, key: str, operation: Operation[T]) -> T:
        async with self._locks[key]:
            return await self._run(key, operation)


async def test_an_adapter_may_wait_instead_of_refusing() -> None:
    report = await check_store(WaitingStore, expect_busy_error=False)
    assert {"exclusion", "atomicity"} <= set(report.passed)


def test_public_surface() -> None:
    names = store_conformance.__all__
    assert names == sorted(names)
    assert all(hasattr(store_conformance, name) for name in names)
    tests = {name for name in dir(StoreConformance) if name.startswith("test_")}
    assert tests == {f"test_{name}" for name in CHECK_NAMES}


def test_check_functions_import_without_pytest() -> None:
    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "from touba.testing.store_conformance import check_store, StoreConformance\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the suite fails adapters that break the contract -------------------------------------


class GetSetStore(DictStore):
    """BROKEN: a bare get/set pair, without exclusion."""

    async def transact(self, key: str, operation: Operation[T]) -> T:
        return await self._run(key, operation)


class GlobalLockStore(DictStore):
    """BROKEN: one lock for every key, so unrelated conversations refuse each other."""

    def __init__(self) -> None:
        super().__init__()
        shared = asyncio.Lock()
        self._locks = defaultdict(lambda: shared)


class LeakyStore(DictStore):
    """BROKEN: hands out and keeps the live objects instead of copies."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[str, Record] = {}

    async def transact(self, key: str, operation: Operation[T]) -> T:
        lock = self._locks[key]
        if lock.locked():
            raise DecisionHistoryBusy(f"conversation {key} is in use", session_key=key)
        async with lock:
            record, result = await operation(self._live.get(key))
            if record is None:
                self._live.pop(key, None)
            else:
                self._live[key] = record
            return result


class StuckStore(DictStore):
    """BROKEN: leaves the key locked when the operation raises."""

    async def transact(self, key: str, operation: Operation[T]) -> T:
        lock = self._locks[key]
        if lock.locked():
            raise DecisionHistoryBusy(f"conversation {key} is in use", session_key=key)
        await lock.acquire()
        stored = self._records.get(key)
        record, result = await operation(None if stored is None else json.loads(stored))
        self._records[key] = json.dumps(record)
        lock.release()
        return result


@pytest.mark.parametrize(
    ("store_class", "check", "message"),
    [
        (GetSetStore, check_exclusion, "it must raise DecisionHistoryBusy"),
        (
            GetSetStore,
            functools.partial(check_exclusion, expect_busy_error=False),
            "two operations on the same key ran at the same time",
        ),
        (GetSetStore, check_atomicity, "operations on the same key ran at the same time"),
        (GlobalLockStore, check_exclusion, "exclusion must be per key"),
        (LeakyStore, check_private_snapshots, "changed the store"),
        (StuckStore, check_exception_keeps_state, "its key must be free at once"),
    ],
)
async def test_the_suite_fails_a_broken_adapter(
    store_class: Callable[[], Any], check: Callable[[Any], Awaitable[None]], message: str
) -> None:
    async with open_store(store_class()) as store:
        with pytest.raises(AssertionError, match=message):
            await check(store)


async def test_check_store_lists_every_failed_check() -> None:
    with pytest.raises(AssertionError) as failure:
        await check_store(GetSetStore)
    text = str(failure.value)
    assert text.startswith(f"2 of {len(CHECK_NAMES)} store conformance checks failed")
    assert "- exclusion: AssertionError:" in text
    assert "- atomicity: AssertionError:" in text
