"""The checks of the store conformance suite, importable without pytest.

Each check is an async function over a fresh store (``check_capacity`` takes
a factory, since it builds stores with small limits). It raises
:class:`AssertionError` naming the rule of SPEC section 6 that the store broke,
or :class:`CheckSkipped` when the store lacks the optional capability the
check is about (``read``, ``delete``, ``recover``, ``list``, ``transact_log``,
configurable limits). :func:`check_store` runs them all, each on a fresh store.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn, Protocol, TypeAlias, cast, runtime_checkable

from touba.errors import ConfigurationError, DecisionHistoryBusy, DecisionHistoryLimitExceeded
from touba.history._frozen import FrozenDict, FrozenList
from touba.history._identity import ConversationIdentity
from touba.history._model import message_bytes
from touba.history._record import RECORD_KIND, join_record, new_head
from touba.history._store import (
    HistoryStore,
    LogSnapshot,
    LogStore,
    LogWrite,
    Record,
    StoreUsage,
)

__all__ = [
    "CHECK_NAMES",
    "CheckSkipped",
    "ConformanceReport",
    "LimitedStoreFactory",
    "StoreFactory",
    "StoreSource",
    "check_atomicity",
    "check_cancellation_keeps_state",
    "check_capacity",
    "check_delete",
    "check_exception_keeps_state",
    "check_exclusion",
    "check_list",
    "check_log_interface",
    "check_private_snapshots",
    "check_read",
    "check_recover",
    "check_round_trip",
    "check_store",
    "open_store",
    "run_check",
]

StoreSource: TypeAlias = (
    HistoryStore | Awaitable[HistoryStore] | AbstractAsyncContextManager[HistoryStore]
)
"""What a factory returns: a store, an awaitable of one, or an async context manager."""

StoreFactory: TypeAlias = Callable[[], StoreSource]


class LimitedStoreFactory(Protocol):
    """Builds a fresh store with the given capacity (SPEC section 6 bounds)."""

    def __call__(self, *, max_sessions: int, max_store_bytes: int) -> StoreSource: ...


AT_ONCE: Final = 2.0
"""Seconds within which a refusal "at once" or an unrelated key must answer."""
STEP_TIMEOUT: Final = 10.0
"""Seconds within which any single store call is expected to finish."""
CHECK_TIMEOUT: Final = 60.0
"""Seconds after which a whole check is declared stuck (a deadlocked store)."""
CONCURRENT_INCREMENTS: Final = 16


class CheckSkipped(Exception):
    """The store lacks the optional capability a check is about."""


@dataclass(frozen=True, slots=True)
class ConformanceReport:
    """What :func:`check_store` ran: names of passed checks, skipped ones with why."""

    passed: tuple[str, ...]
    skipped: Mapping[str, str] = field(default_factory=dict)


# -- optional capabilities of built-in stores ------------------------------------------


@runtime_checkable
class _Readable(Protocol):
    async def read(self, key: str) -> Record | None: ...


@runtime_checkable
class _Deletable(Protocol):
    async def delete(self, key: str) -> bool: ...


@runtime_checkable
class _Recoverable(Protocol):
    async def recover(self, key: str, *, worker_stopped: bool) -> bool: ...


@runtime_checkable
class _Listable(Protocol):
    async def list(self, namespace: str | None = None) -> Sequence[Any]: ...


@runtime_checkable
class _Measurable(Protocol):
    async def usage(self) -> StoreUsage: ...


def _require(store: HistoryStore, capability: type, method: str) -> None:
    if not isinstance(store, capability):
        raise CheckSkipped(
            f"{type(store).__name__} has no {method} method (optional for adapters; every "
            "built-in store has it)"
        )


# -- opening stores ---------------------------------------------------------------------


@asynccontextmanager
async def open_store(source: StoreSource) -> AsyncIterator[HistoryStore]:
    """Open what a factory returned, and close it afterwards.

    An async context manager is entered (built-in stores close on exit);
    otherwise the store's ``close()`` is called, if it has one.
    """
    value: Any = await source if inspect.isawaitable(source) else source
    if isinstance(value, AbstractAsyncContextManager):
        async with value as store:
            _check_is_store(store)
            yield store
        return
    _check_is_store(value)
    try:
        yield value
    finally:
        close = getattr(value, "close", None)
        if callable(close):
            closing = close()
            if inspect.isawaitable(closing):
                await closing


def _check_is_store(value: object) -> None:
    if not callable(getattr(value, "transact", None)):
        _fail(f"the factory gave {value!r}, which has no transact(key, operation) method")


# -- small helpers ----------------------------------------------------------------------


def _fail(message: str) -> NoReturn:
    raise AssertionError(message)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class _Probe(Exception):
    """Raised by probe operations; a store must let it through untouched."""


def _key(label: str) -> str:
    return f"touba-conformance:{label}:{uuid.uuid4().hex}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _difference(
    expected: Any, actual: Any, path: str = "record", *, readonly: bool = False
) -> str | None:
    """Where ``actual`` first differs from ``expected``, types included (1 is not True).

    ``readonly``: a read-only dict or list (:mod:`touba.history._frozen`, which a
    log snapshot's head may share with its store's cache) counts as one."""
    if readonly and isinstance(actual, FrozenDict | FrozenList):
        actual = dict(actual) if isinstance(actual, dict) else list(actual)
    if type(expected) is not type(actual):
        return (
            f"{path} should be the {type(expected).__name__} {_short(expected)}, got the "
            f"{type(actual).__name__} {_short(actual)}"
        )
    if isinstance(expected, dict):
        for k in expected:
            if k not in actual:
                return f"{path} lost its key {k!r}"
        for k in actual:
            if k not in expected:
                return f"{path} gained a key {k!r} that was never saved"
        for k, v in expected.items():
            found = _difference(v, actual[k], f"{path}[{k!r}]", readonly=readonly)
            if found:
                return found
        return None
    if isinstance(expected, list):
        if len(expected) != len(actual):
            return f"{path} should have {len(expected)} items, got {len(actual)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            found = _difference(e, a, f"{path}[{i}]", readonly=readonly)
            if found:
                return found
        return None
    if expected != actual:
        return f"{path} should be {_short(expected)}, got {_short(actual)}"
    return None


def _expect_same(expected: Any, actual: Any, context: str, *, readonly: bool = False) -> None:
    found = _difference(expected, actual, readonly=readonly)
    if found:
        _fail(f"{context}: {found}")


def _containers(value: Any) -> list[object]:
    """Every dict and list inside ``value`` (to prove two snapshots share none)."""
    found: list[object] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            found.append(item)
            stack.extend(item)
    return found


def _expect_detached(first: Any, second: Any, what: str) -> None:
    shared = {id(c) for c in _containers(first)} & {id(c) for c in _containers(second)}
    _expect(
        not shared,
        f"{what} share {len(shared)} dict/list object(s): every snapshot must be a private "
        "deep copy, or one caller's changes leak into another's",
    )


async def _within(awaitable: Awaitable[Any], seconds: float, what: str) -> Any:
    try:
        async with asyncio.timeout(seconds):
            return await awaitable
    except TimeoutError:
        _fail(f"{what} did not finish within {seconds:g} s")


async def _save(store: HistoryStore, key: str, record: Record | None) -> None:
    async def operation(snapshot: Record | None) -> tuple[Record | None, None]:
        return copy.deepcopy(record), None

    await _within(store.transact(key, operation), STEP_TIMEOUT, f"transact({key!r}) saving")


async def _current(store: HistoryStore, key: str) -> Record | None:
    """The stored record, seen through ``transact`` (saved back unchanged)."""

    async def operation(snapshot: Record | None) -> tuple[Record | None, Record | None]:
        return snapshot, copy.deepcopy(snapshot)

    result: Record | None = await _within(
        store.transact(key, operation), STEP_TIMEOUT, f"transact({key!r}) reading"
    )
    return result


async def _expect_stored(store: HistoryStore, key: str, expected: Record | None, when: str) -> None:
    current = await _current(store, key)
    if expected is None:
        _expect(current is None, f"{when}, {key!r} should hold no record, got {_short(current)}")
    else:
        _expect(current is not None, f"{when}, the record of {key!r} is gone")
        _expect_same(expected, current, when)


def _identity(namespace: str) -> ConversationIdentity:
    return ConversationIdentity(
        namespace=namespace,
        provider="conformance",
        model="conformance-model",
        decision_interface="native",
        run_id=uuid.uuid4().hex,
        invocation_id=uuid.uuid4().hex,
        agent_ref="conformance-agent",
    )


def _messages(count: int, text: str = "") -> list[Record]:
    return [
        {
            "kind": "decision",
            "text": f"step {i} {text}",
            "calls": [{"call_id": f"c{i}", "name": "lookup", "arguments": {"id": i}}],
        }
        for i in range(count)
    ]


def _touba_record(namespace: str, exchanges: list[list[Record]]) -> tuple[str, Record]:
    """A record shaped like touba's own, under its conversation key."""
    identity = _identity(namespace)
    return identity.key, join_record(new_head(identity), exchanges)


def sample_records() -> list[Record]:
    """JSON dicts every store must give back exactly, whatever their shape."""
    deep: Any = "bottom"
    for depth in range(40):
        deep = {"level": depth, "next": deep} if depth % 2 else [deep]
    m = _messages(3, "é🙂")
    return [
        {},
        {"a": 1},
        {
            "nested": {"list": [1, [2, [3, {}]], []], "empty_dict": {}, "empty_list": []},
            "none": None,
            "bools": [True, False],
        },
        {
            "unicode": 'é 日本語 🙂 \u2028 \u0000 \t\n "quoted" \\ \'; DROP TABLE x; --',
            "ключ": "значение",
            "": "the empty key",
            "🙂": ["🙂", "\U0010ffff"],
        },
        {
            "integers": [0, -1, 2**53 + 1, 2**63 - 1, -(2**63)],
            "floats": [1.5, -0.25, 0.1, 1e300, 1.5e-07, 1.0],
            "types_kept": [1, 1.0, True, "1", None, 0, False, ""],
        },
        {"deep": deep},
        {"big": "x" * 50_000, "after": "still here"},
        # touba's own shape (built-in stores may keep its messages as rows) ...
        {**_touba_record("ns", [m[:2], m[2:]])[1], "extra": {"kept": True}},
        _touba_record("ns", [])[1],
        _touba_record("ns", [m[:1]])[1],
        # ... and near misses that must still come back exactly as saved.
        {"kind": RECORD_KIND, "version": 1, "exchanges": [[]]},
        {"kind": RECORD_KIND, "exchanges": "not a list"},
        {"kind": RECORD_KIND, "exchanges": [[{"a": 1}, 2]]},
        {"exchanges": [[{"kind": "decision"}]]},
        {"kind": "something-else", "version": 99},
    ]


@dataclass(slots=True)
class _Held:
    task: asyncio.Task[Any]
    release: asyncio.Event
    running: bool = True


@asynccontextmanager
async def _holding(
    store: HistoryStore, key: str, *, save: Record | None = None, expect_ok: bool = True
) -> AsyncIterator[_Held]:
    """Run a transact on ``key`` whose operation waits until the block exits.

    The operation saves ``save`` (or keeps the snapshot). With ``expect_ok``,
    a failure of that held transact fails the check.
    """
    started = asyncio.Event()
    release = asyncio.Event()
    held: _Held

    async def hold(snapshot: Record | None) -> tuple[Record | None, None]:
        started.set()
        try:
            await release.wait()
            return (snapshot if save is None else copy.deepcopy(save)), None
        finally:
            held.running = False

    held = _Held(asyncio.create_task(store.transact(key, hold)), release)
    body_failed = False
    try:
        waiter = asyncio.ensure_future(started.wait())
        done, _ = await asyncio.wait(
            {held.task, waiter}, timeout=STEP_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
        )
        if waiter not in done:
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            if held.task.done():
                _fail(
                    f"transact({key!r}) finished without running its operation: "
                    f"{held.task.exception()!r}"
                )
            _fail(f"transact({key!r}) did not call its operation within {STEP_TIMEOUT:g} s")
        yield held
    except BaseException:
        body_failed = True
        raise
    finally:
        release.set()
        await asyncio.wait({held.task}, timeout=STEP_TIMEOUT)
        if not held.task.done():
            held.task.cancel()
            with contextlib.suppress(BaseException):
                await held.task
            if not body_failed:
                _fail(f"transact({key!r}) did not finish after its operation returned")
        error = None if held.task.cancelled() else held.task.exception()
        if expect_ok and error is not None and not body_failed:
            _fail(f"the transact holding {key!r} failed: {error!r}")


# -- the checks -------------------------------------------------------------------------


async def check_round_trip(store: HistoryStore) -> None:
    """Any JSON dict comes back equal; ``result`` is returned; ``None`` deletes."""
    key = _key("round-trip")
    seen: list[Record | None] = []

    async def absent(snapshot: Record | None) -> tuple[None, str]:
        seen.append(snapshot)
        return None, "untouched"

    result = await _within(store.transact(key, absent), STEP_TIMEOUT, "transact on a new key")
    _expect(seen == [None], f"the snapshot of a key never saved must be None, got {seen!r}")
    _expect(result == "untouched", f"transact must return the operation's result, got {result!r}")
    await _expect_stored(store, key, None, "after an operation returned None for a new key")

    for index, record in enumerate(sample_records()):
        token = object()

        async def save(
            snapshot: Record | None, record: Record = record, token: object = token
        ) -> tuple[Record, object]:
            return copy.deepcopy(record), token

        for where in (_key(f"round-trip-{index}"), key):  # a new key, then one rewritten
            got = await _within(store.transact(where, save), STEP_TIMEOUT, "transact saving")
            _expect(
                got is token,
                f"transact must return the very object the operation returned, got {got!r}",
            )
            await _expect_stored(store, where, record, f"sample record #{index} did not round-trip")

    async def delete(snapshot: Record | None) -> tuple[None, str]:
        _expect(snapshot is not None, "the record saved just before is missing")
        return None, "deleted"

    result = await store.transact(key, delete)
    _expect(result == "deleted", f"transact must return the operation's result, got {result!r}")
    await _expect_stored(store, key, None, "after an operation returned None (deletion)")


async def check_private_snapshots(store: HistoryStore) -> None:
    """Snapshots are private deep copies, and saved records are copied too."""
    key, record = _touba_record(_key("private"), [_messages(2), _messages(1)])
    record["nested"] = {"list": [1, 2], "map": {"a": "b"}}
    await _save(store, key, record)

    async def vandal(snapshot: Record | None) -> tuple[Record | None, None]:
        _expect(snapshot is not None, "the record saved just before is missing")
        assert snapshot is not None
        snapshot["nested"]["list"].append(3)
        snapshot["nested"]["map"].clear()
        snapshot["exchanges"][0][0]["text"] = "rewritten in place"
        snapshot["exchanges"].append([{"kind": "decision"}])
        snapshot["intruder"] = True
        raise _Probe("mutated the snapshot, then failed")

    with contextlib.suppress(_Probe):
        await store.transact(key, vandal)
    await _expect_stored(
        store,
        key,
        record,
        "mutating the snapshot inside an operation that raised changed the store",
    )

    kept: list[Record] = []

    async def keep(snapshot: Record | None) -> tuple[Record | None, None]:
        assert snapshot is not None
        returned = copy.deepcopy(record)
        kept.extend([snapshot, returned])
        return returned, None

    await store.transact(key, keep)
    for obj in kept:
        obj["nested"]["list"].append("late")
        obj["exchanges"][0].append({"kind": "late"})
        obj["late"] = True
    await _expect_stored(
        store,
        key,
        record,
        "mutating the snapshot or the returned record after transact returned changed the "
        "store (it must copy what it saves and what it hands out)",
    )

    snapshots: list[Record | None] = []

    async def look(snapshot: Record | None) -> tuple[Record | None, None]:
        snapshots.append(snapshot)
        return snapshot, None

    await store.transact(key, look)
    await store.transact(key, look)
    first, second = snapshots
    _expect(first is not None and second is not None, "the record disappeared")
    _expect(first is not second, "two successive transacts got the same snapshot object")
    _expect_detached(first, second, "two successive snapshots")
    _expect_detached(first, kept, "a snapshot and objects the operation returned earlier")


async def check_exception_keeps_state(store: HistoryStore) -> None:
    """When the operation raises: same exception, old state kept, key free at once."""
    key = _key("exception")
    record: Record = {"counter": 1, "items": [{"a": 1}]}
    await _save(store, key, record)

    async def fail(snapshot: Record | None) -> tuple[Record | None, None]:
        assert snapshot is not None
        snapshot["counter"] = 2
        snapshot["items"].append({"b": 2})
        await asyncio.sleep(0)
        raise probe

    for attempt in range(2):
        probe = _Probe(f"operation failure #{attempt}")
        try:
            await _within(store.transact(key, fail), STEP_TIMEOUT, "the failing transact")
        except _Probe as e:
            _expect(e is probe, "transact must re-raise the operation's own exception object")
        except AssertionError:
            raise
        except Exception as e:
            _fail(
                f"transact must let the operation's exception through unchanged, it raised "
                f"{type(e).__name__}: {e}"
            )
        else:
            _fail("transact swallowed the exception its operation raised")

        async def after(snapshot: Record | None) -> tuple[Record | None, Record | None]:
            return snapshot, copy.deepcopy(snapshot)

        try:
            current = await _within(
                store.transact(key, after), AT_ONCE, "transact right after a failed operation"
            )
        except DecisionHistoryBusy:
            _fail("after an operation raised, its key must be free at once, got busy")
        _expect_same(record, current, "an operation raised, yet the stored record changed")

    new_key = _key("exception-new")

    async def create_then_fail(snapshot: Record | None) -> tuple[Record | None, None]:
        raise _Probe("failed before saving anything")

    with contextlib.suppress(_Probe):
        await store.transact(new_key, create_then_fail)
    await _expect_stored(store, new_key, None, "an operation on a new key raised")


async def check_cancellation_keeps_state(store: HistoryStore) -> None:
    """A cancelled transact (a timeout, a shutdown) keeps the old state and frees the key."""
    key = _key("cancel")
    record: Record = {"before": "cancellation"}
    await _save(store, key, record)
    started = asyncio.Event()

    async def endless(snapshot: Record | None) -> tuple[Record | None, None]:
        assert snapshot is not None
        snapshot["before"] = "changed"
        started.set()
        await asyncio.Event().wait()
        return snapshot, None

    task = asyncio.create_task(store.transact(key, endless))
    await _within(started.wait(), STEP_TIMEOUT, "the operation to start")
    task.cancel()
    try:
        await _within(task, STEP_TIMEOUT, "the cancelled transact")
    except asyncio.CancelledError:
        pass
    except AssertionError:
        raise
    except Exception as e:
        _fail(f"a cancelled transact must end with CancelledError, got {e!r}")
    else:
        _fail("a cancelled transact must end with CancelledError, it returned")
    try:
        await _expect_stored(store, key, record, "a transact was cancelled mid-operation")
    except DecisionHistoryBusy:
        _fail(
            "a cancelled transact left its key busy: cancellation is not a crash, the "
            "reservation must be released"
        )


async def check_exclusion(store: HistoryStore, *, expect_busy_error: bool = True) -> None:
    """Two operations on one key never overlap; other keys are not blocked.

    With ``expect_busy_error`` (built-in stores), the second transact must
    raise :class:`DecisionHistoryBusy` at once; otherwise it may also wait,
    as long as it runs after the first one saved.
    """
    key, other = _key("exclusion"), _key("exclusion-other")
    await _save(store, key, {"n": 0})
    overlaps: list[Record | None] = []
    after_first: list[Record | None] = []
    waiting: asyncio.Task[Any] | None = None

    async with _holding(store, key, save={"n": 1}) as held:

        async def second(snapshot: Record | None) -> tuple[Record | None, str]:
            (overlaps if held.running else after_first).append(copy.deepcopy(snapshot))
            return snapshot, "second"

        if expect_busy_error:
            try:
                async with asyncio.timeout(AT_ONCE):
                    await store.transact(key, second)
            except DecisionHistoryBusy as e:
                _expect(
                    e.session_key == key,
                    f"DecisionHistoryBusy.session_key should be {key!r}, got {e.session_key!r}",
                )
            except TimeoutError:
                _fail(
                    f"a second transact on a held key waited over {AT_ONCE:g} s; built-in "
                    "stores must refuse it at once with DecisionHistoryBusy"
                )
            else:
                _fail(
                    "a second transact on a key held by another operation completed; it must "
                    "raise DecisionHistoryBusy (a bare get/set does not satisfy the contract)"
                )
        else:
            waiting = asyncio.create_task(store.transact(key, second))
            await asyncio.sleep(0.1)

        _expect(not overlaps, "two operations on the same key ran at the same time")

        async def unrelated(snapshot: Record | None) -> tuple[Record, str]:
            return {"unrelated": True}, "done"

        try:
            async with asyncio.timeout(AT_ONCE):
                await store.transact(other, unrelated)
        except DecisionHistoryBusy:
            _fail("a transact on another key was refused as busy: exclusion must be per key")
        except TimeoutError:
            _fail(
                f"a transact on another key waited over {AT_ONCE:g} s behind a held key: "
                "exclusion must be per key"
            )

    if waiting is not None:
        with contextlib.suppress(DecisionHistoryBusy):
            await _within(waiting, STEP_TIMEOUT, "the waiting transact")
        _expect(not overlaps, "two operations on the same key ran at the same time")
        for snapshot in after_first:
            _expect_same({"n": 1}, snapshot, "a waiting operation must see the first one's save")
    await _expect_stored(store, key, {"n": 1}, "after the first operation finished")


async def check_atomicity(store: HistoryStore) -> None:
    """Concurrent increments (retried when busy) lose no update and never overlap."""
    key = _key("atomicity")
    running = 0
    peak = 0
    results: list[int] = []

    async def increment(snapshot: Record | None) -> tuple[Record, int]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            value = 0 if snapshot is None else snapshot["n"]
            await asyncio.sleep(0)  # let a store without exclusion interleave
            return {"n": value + 1}, value + 1
        finally:
            running -= 1

    async def worker() -> None:
        for attempt in range(2000):
            try:
                results.append(await store.transact(key, increment))
                return
            except DecisionHistoryBusy:
                await asyncio.sleep(random.uniform(0, 0.002) * min(attempt + 1, 10))
        _fail("an increment was refused as busy 2000 times in a row")

    async with asyncio.TaskGroup() as group:
        for _ in range(CONCURRENT_INCREMENTS):
            group.create_task(worker())
    _expect(peak == 1, f"{peak} operations on the same key ran at the same time")
    await _expect_stored(
        store,
        key,
        {"n": CONCURRENT_INCREMENTS},
        f"after {CONCURRENT_INCREMENTS} concurrent increments (a lost update means transact "
        "is not atomic)",
    )
    _expect(
        sorted(results) == list(range(1, CONCURRENT_INCREMENTS + 1)),
        f"each increment should have seen a distinct value, got {sorted(results)}",
    )


async def check_read(store: HistoryStore) -> None:
    """``read`` gives a detached copy or None, renews nothing, and refuses active keys."""
    _require(store, _Readable, "read(key)")
    assert isinstance(store, _Readable)
    absent = await _within(store.read(_key("read-absent")), STEP_TIMEOUT, "read")
    _expect(absent is None, f"read of a key never saved must return None, got {absent!r}")

    key, record = _touba_record(_key("read"), [_messages(2)])
    await _save(store, key, record)
    before = None
    if isinstance(store, _Listable):
        before = await _row(cast(_Listable, store), key)
    await asyncio.sleep(0.01)  # so that a renewed TTL would show in expires_at
    first = await store.read(key)
    _expect_same(record, first, "read did not return the saved record")
    assert first is not None
    first["exchanges"][0][0]["text"] = "changed by the reader"
    first["stats"]["messages"] = -1
    second = await store.read(key)
    _expect_same(record, second, "mutating what read returned changed the store")
    _expect_detached(first, second, "two results of read")
    if before is not None:
        after = await _row(cast(_Listable, store), key)
        _expect(
            (after.updated_at, after.expires_at) == (before.updated_at, before.expires_at),
            "read renewed the conversation's TTL (updated_at/expires_at changed); it must not",
        )

    async with _holding(store, key):
        try:
            async with asyncio.timeout(AT_ONCE):
                await store.read(key)
        except DecisionHistoryBusy:
            pass
        except TimeoutError:
            _fail("read of an active conversation waited; it must raise DecisionHistoryBusy")
        else:
            _fail("read of an active conversation must raise DecisionHistoryBusy")
    _expect_same(record, await store.read(key), "read after the operation finished")


async def check_delete(store: HistoryStore) -> None:
    """``delete`` removes inactive conversations only, and says whether it did."""
    _require(store, _Deletable, "delete(key)")
    assert isinstance(store, _Deletable)
    key = _key("delete")
    gone = await _within(store.delete(key), STEP_TIMEOUT, "delete")
    _expect(gone is False, f"delete of a key never saved must return False, got {gone!r}")

    record: Record = {"to": "delete"}
    await _save(store, key, record)
    async with _holding(store, key):
        try:
            async with asyncio.timeout(AT_ONCE):
                await store.delete(key)
        except DecisionHistoryBusy:
            pass
        except TimeoutError:
            _fail("delete of an active conversation waited; it must raise DecisionHistoryBusy")
        else:
            _fail("delete of an active conversation must raise DecisionHistoryBusy")
    await _expect_stored(store, key, record, "a refused delete of an active conversation")

    _expect(await store.delete(key) is True, "delete of a stored conversation must return True")
    await _expect_stored(store, key, None, "after delete")
    if isinstance(store, _Readable):
        _expect(await store.read(key) is None, "read after delete must return None")
    _expect(await store.delete(key) is False, "a second delete must return False")


async def check_recover(store: HistoryStore) -> None:
    """``recover`` needs ``worker_stopped=True`` and frees only a reservation."""
    _require(store, _Recoverable, "recover(key, worker_stopped=...)")
    assert isinstance(store, _Recoverable)
    key = _key("recover")
    record: Record = {"state": "old"}
    await _save(store, key, record)

    try:
        await _within(store.recover(key, worker_stopped=False), STEP_TIMEOUT, "recover")
    except ConfigurationError:
        pass
    else:
        _fail("recover(key, worker_stopped=False) must raise ConfigurationError")
    await _expect_stored(store, key, record, "after a refused recover")

    freed = await store.recover(key, worker_stopped=True)
    _expect(freed is False, f"recover of a key with no reservation must return False: {freed!r}")
    await _expect_stored(store, key, record, "recover of a key with no reservation")
    absent = _key("recover-absent")
    _expect(
        await store.recover(absent, worker_stopped=True) is False,
        "recover of a key never saved must return False",
    )
    await _expect_stored(store, absent, None, "recover of a key never saved")

    # A worker that "crashed" while holding the key: recovery frees the key, a new
    # worker proceeds, and the stale worker's late save is refused.
    async with _holding(store, key, save={"state": "stale"}, expect_ok=False) as held:
        freed = await store.recover(key, worker_stopped=True)
        _expect(freed is True, f"recover of a held key must return True, got {freed!r}")
        await _expect_stored(store, key, record, "recover must touch nothing but the reservation")
        await _save(store, key, {"state": "new"})
    error = None if held.task.cancelled() else held.task.exception()
    _expect(
        isinstance(error, DecisionHistoryBusy),
        "the late save of a worker whose reservation was recovered must be refused with "
        f"DecisionHistoryBusy, got {error!r}",
    )
    await _expect_stored(store, key, {"state": "new"}, "after a stale worker tried to save")


async def _row(store: _Listable, key: str, namespace: str | None = None) -> Any:
    rows = await _within(store.list(namespace=namespace), STEP_TIMEOUT, "list")
    matching = [r for r in rows if getattr(r, "key", None) == key]
    _expect(len(matching) == 1, f"list() should show {key!r} once, found {len(matching)}")
    return matching[0]


async def check_list(store: HistoryStore) -> None:
    """``list`` shows sizes, identity and activity, and filters by namespace."""
    _require(store, _Listable, "list(namespace=None)")
    assert isinstance(store, _Listable)
    ns_a, ns_b = _key("ns-a"), _key("ns-b")
    key_a, record_a = _touba_record(ns_a, [_messages(2), _messages(1)])
    key_b, record_b = _touba_record(ns_b, [_messages(1)])
    key_plain = _key("list-plain")
    for key, record in ((key_a, record_a), (key_b, record_b), (key_plain, {"plain": True})):
        await _save(store, key, record)

    row = await _row(store, key_a)
    for name in ("identity", "messages", "bytes", "updated_at", "expires_at", "active"):
        _expect(hasattr(row, name), f"list() rows must have {name!r}, got {row!r}")
    _expect(
        row.identity == record_a["identity"],
        f"list() identity should be {record_a['identity']!r}, got {row.identity!r}",
    )
    _expect(row.messages == 3, f"list() should count 3 messages, got {row.messages!r}")
    _expect(isinstance(row.bytes, int) and row.bytes > 0, f"list() bytes: {row.bytes!r}")
    _expect(isinstance(row.updated_at, str) and bool(row.updated_at), "list() updated_at")
    _expect(row.expires_at is None or isinstance(row.expires_at, str), "list() expires_at")
    _expect(row.active is False, f"an idle conversation must list active=False: {row!r}")
    await _row(store, key_b)
    await _row(store, key_plain)

    in_a = await store.list(namespace=ns_a)
    _expect(
        [r.key for r in in_a] == [key_a],
        f"list(namespace={ns_a!r}) should show only {key_a!r}, got {[r.key for r in in_a]}",
    )
    async with _holding(store, key_a):
        row = await _row(store, key_a, ns_a)
        _expect(row.active is True, "a conversation held by an operation must list active=True")
    row = await _row(store, key_a, ns_a)
    _expect(row.active is False, "after its operation finished, list() must show active=False")


async def check_capacity(limited_factory: LimitedStoreFactory | None) -> None:
    """A full store refuses atomically (``DecisionHistoryLimitExceeded``), evicting nothing.

    A store may refuse a new key when reserving it or when saving it. Where the
    store offers ``usage()`` (built-ins do), its figures are checked as well.
    """
    if limited_factory is None:
        raise CheckSkipped(
            "no factory building the store with max_sessions/max_store_bytes was given"
        )

    async def refused(store: HistoryStore, key: str, record: Record, limit: str) -> None:
        try:
            await _save(store, key, record)
        except DecisionHistoryLimitExceeded as e:
            _expect(e.limit == limit, f"the refusal should name limit={limit!r}, got {e.limit!r}")
        else:
            _fail(f"a write over {limit} must raise DecisionHistoryLimitExceeded")

    async def absent_from_full(store: HistoryStore, key: str) -> None:
        try:
            await _expect_stored(store, key, None, "a refused new conversation must not be stored")
        except DecisionHistoryLimitExceeded as e:
            # Built-in stores refuse even to reserve a new key when full: it has no record.
            _expect(e.limit == "max_sessions", f"reserving a new key raised limit={e.limit!r}")

    async with open_store(limited_factory(max_sessions=2, max_store_bytes=1024 * 1024)) as store:
        k1, k2, k3 = _key("cap-1"), _key("cap-2"), _key("cap-3")
        await _save(store, k1, {"one": 1})
        await _save(store, k2, {"two": 2})
        await _expect_usage(store, sessions=2, max_sessions=2)
        await refused(store, k3, {"three": 3}, "max_sessions")
        await _expect_stored(store, k1, {"one": 1}, "a full store must evict nothing")
        await _expect_stored(store, k2, {"two": 2}, "a full store must evict nothing")
        await absent_from_full(store, k3)
        await _expect_usage(store, sessions=2, max_sessions=2)
        await _save(store, k1, {"one": "updated"})  # not a new session: allowed
        await _save(store, k2, None)
        await _save(store, k3, {"three": 3})  # room again after a deletion
        await _expect_stored(store, k3, {"three": 3}, "after a deletion made room")

    async with open_store(limited_factory(max_sessions=100, max_store_bytes=8192)) as store:
        small: Record = {"pad": "a" * 2000}
        await _save(store, k1, small)
        key, big = _touba_record(_key("cap-ns"), [_messages(3, "b" * 2400)])
        await refused(store, key, big, "max_store_bytes")
        await _expect_stored(store, k1, small, "a full store must evict nothing")
        await _expect_stored(store, key, None, "a refused new conversation must not be stored")
        await refused(store, k1, {"pad": "a" * 9000}, "max_store_bytes")
        await _expect_stored(store, k1, small, "a refused update must keep the old record")
        await _expect_usage(store, sessions=1, max_sessions=100, bytes=len(_json(small)))


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


async def _expect_usage(store: HistoryStore, **expected: int) -> None:
    """``usage()``, where the store offers it (built-ins do), reports these figures."""
    if not isinstance(store, _Measurable):
        return
    usage = await _within(store.usage(), STEP_TIMEOUT, "usage()")
    got = {name: getattr(usage, name) for name in expected}
    _expect(got == expected, f"usage() should report {expected}, got {got}")


async def check_log_interface(store: HistoryStore, *, expect_busy_error: bool = True) -> None:
    """Built-ins' ``transact_log``: appends, sizes and tails agree with ``transact``."""
    if not isinstance(store, LogStore):
        raise CheckSkipped(
            f"{type(store).__name__} has no transact_log (touba falls back to transact; "
            "built-in stores implement it)"
        )
    identity = _identity(_key("log"))
    key = identity.key
    head = new_head(identity)
    m = _messages(5, "log")

    async def create(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, str]:
        _expect(snapshot is None, "the log snapshot of a new key must be None")
        return LogWrite(head=copy.deepcopy(head), append=[(0, m[0]), (0, m[1]), (1, m[2])]), "r1"

    result = await _within(store.transact_log(key, create), STEP_TIMEOUT, "transact_log")
    _expect(result == "r1", f"transact_log must return the operation's result, got {result!r}")
    expected = join_record(head, [m[0:2], m[2:3]])
    await _expect_stored(store, key, expected, "after appending through transact_log")

    head2 = {**head, "pending": [{"call_id": "c2", "name": "lookup"}]}

    async def inspect_then_append(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, None]:
        _expect(snapshot is not None, "the log snapshot of a stored key is None")
        assert snapshot is not None
        # Its top-level dict is the operation's; nested values may be read-only.
        _expect(type(snapshot.head) is dict, "the log snapshot's head must be a plain dict")
        _expect_same(head, snapshot.head, "the log snapshot's head", readonly=True)
        _expect(snapshot.exchange_count == 2, f"exchange_count is {snapshot.exchange_count}")
        sizes = [(s.messages, s.bytes) for s in await snapshot.sizes(0)]
        want = [(2, message_bytes(m[0]) + message_bytes(m[1])), (1, message_bytes(m[2]))]
        _expect(sizes == want, f"sizes(0) should be {want}, got {sizes}")
        tail = [(s.messages, s.bytes) for s in await snapshot.sizes(1)]
        _expect(tail == want[1:], f"sizes(1) should be {want[1:]}, got {tail}")
        _expect_same([m[0:2], m[2:3]], await snapshot.exchanges(0, 2), "exchanges(0, 2)")
        last = await snapshot.exchanges(1, 2)
        _expect_same([m[2:3]], last, "exchanges(1, 2)")
        last[0][0]["text"] = "mutated copy"
        return LogWrite(head=copy.deepcopy(head2), append=[(1, m[3])]), None

    await store.transact_log(key, inspect_then_append)
    expected = join_record(head2, [m[0:2], m[2:4]])
    await _expect_stored(store, key, expected, "after appending to the last exchange")

    for bad in ([(0, m[4])], [(3, m[4])]):

        async def rewrite(
            snapshot: LogSnapshot | None, usage: StoreUsage | None, bad: Any = bad
        ) -> tuple[LogWrite, None]:
            return LogWrite(head=copy.deepcopy(head2), append=bad), None

        refused = False
        try:
            await store.transact_log(key, rewrite)
        except Exception:  # any refusal will do: what matters is the state kept
            refused = True
        _expect(refused, f"appending to exchange {bad[0][0]} of a 2-exchange log was accepted")
        await _expect_stored(store, key, expected, "a refused append must change nothing")

    async def nothing(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[None, str]:
        return None, "kept"

    _expect(await store.transact_log(key, nothing) == "kept", "transact_log result")
    probe = _Probe("log operation failed")

    async def fail(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[LogWrite, None]:
        assert snapshot is not None
        try:
            snapshot.head["stats"]["messages"] = -1
        except TypeError:  # read-only, shared with the store's cache: changed at the top
            snapshot.head["stats"] = {**snapshot.head["stats"], "messages": -1}
        (await snapshot.exchanges(0, 1))[0].clear()
        raise probe

    try:
        await store.transact_log(key, fail)
    except _Probe as e:
        _expect(e is probe, "transact_log must re-raise the operation's own exception")
    await _expect_stored(store, key, expected, "a failed log operation must change nothing")

    if expect_busy_error:
        async with _holding(store, key):
            try:
                async with asyncio.timeout(AT_ONCE):
                    await store.transact_log(key, nothing)
            except DecisionHistoryBusy:
                pass
            except TimeoutError:
                _fail("transact_log on a key held by transact waited; it must raise busy")
            else:
                _fail(
                    "transact_log ran while transact held the same key: both must share "
                    "one exclusion"
                )


# -- running ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Options:
    limited_factory: LimitedStoreFactory | None
    expect_busy_error: bool


_StoreCheck = Callable[[HistoryStore, _Options], Awaitable[None]]

_STORE_CHECKS: Final[dict[str, _StoreCheck]] = {
    "round_trip": lambda store, _: check_round_trip(store),
    "private_snapshots": lambda store, _: check_private_snapshots(store),
    "exception_keeps_state": lambda store, _: check_exception_keeps_state(store),
    "cancellation_keeps_state": lambda store, _: check_cancellation_keeps_state(store),
    "exclusion": lambda store, o: check_exclusion(store, expect_busy_error=o.expect_busy_error),
    "atomicity": lambda store, _: check_atomicity(store),
    "read": lambda store, _: check_read(store),
    "delete": lambda store, _: check_delete(store),
    "recover": lambda store, _: check_recover(store),
    "list": lambda store, _: check_list(store),
    "log_interface": lambda store, o: check_log_interface(
        store, expect_busy_error=o.expect_busy_error
    ),
}

CHECK_NAMES: Final[tuple[str, ...]] = (*_STORE_CHECKS, "capacity")
"""Every check, in the order :func:`check_store` runs them."""


async def run_check(
    name: str,
    factory: StoreFactory,
    *,
    limited_factory: LimitedStoreFactory | None = None,
    expect_busy_error: bool = True,
) -> None:
    """Run one check on a fresh store from ``factory``; see :data:`CHECK_NAMES`."""
    if name not in CHECK_NAMES:
        raise ValueError(f"unknown check {name!r}; choose one of {', '.join(CHECK_NAMES)}")
    try:
        async with asyncio.timeout(CHECK_TIMEOUT):
            if name == "capacity":
                await check_capacity(limited_factory)
                return
            async with open_store(factory()) as store:
                await _STORE_CHECKS[name](store, _Options(limited_factory, expect_busy_error))
    except TimeoutError as e:
        raise AssertionError(
            f"check {name!r} did not finish within {CHECK_TIMEOUT:g} s: the store is stuck "
            "(a lock never released?)"
        ) from e


async def check_store(
    factory: StoreFactory,
    *,
    limited_factory: LimitedStoreFactory | None = None,
    expect_busy_error: bool = True,
) -> ConformanceReport:
    """Run every check, each on a fresh store from ``factory``.

    ``factory`` returns a store, an awaitable of one, or an async context
    manager yielding one; it is called inside the running event loop.
    ``limited_factory(max_sessions=..., max_store_bytes=...)`` enables the
    capacity check. Set ``expect_busy_error=False`` for an adapter that makes
    a second operation on a key wait instead of raising ``DecisionHistoryBusy``.

    Raises one :class:`AssertionError` listing every failed check; returns
    the names of passed checks and why others were skipped.
    """
    passed: list[str] = []
    skipped: dict[str, str] = {}
    failures: list[tuple[str, Exception]] = []
    for name in CHECK_NAMES:
        try:
            await run_check(
                name,
                factory,
                limited_factory=limited_factory,
                expect_busy_error=expect_busy_error,
            )
        except CheckSkipped as e:
            skipped[name] = str(e)
        except Exception as e:
            failures.append((name, e))
        else:
            passed.append(name)
    if failures:
        lines = [f"- {name}: {type(e).__name__}: {e}" for name, e in failures]
        raise AssertionError(
            f"{len(failures)} of {len(CHECK_NAMES)} store conformance checks failed "
            "(SPEC section 6):\n" + "\n".join(lines)
        ) from failures[0][1]
    return ConformanceReport(tuple(passed), skipped)
