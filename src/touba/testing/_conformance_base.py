"""What every check of the store conformance suite shares, importable without pytest.

A check runs over a fresh store that a factory returned (:data:`StoreSource`,
opened and closed by :func:`open_store`). It raises :class:`AssertionError`
naming the rule of SPEC section 6 that the store broke (:func:`expect`,
:func:`expect_same`, :func:`expect_stored`), or :class:`CheckSkipped` when the
store lacks the optional capability the check is about (:func:`require` with
:class:`Readable`, :class:`Deletable`, :class:`Recoverable`, :class:`Listable`,
:class:`Measurable`). Every store call is bounded (:func:`within`,
:data:`STEP_TIMEOUT`), so a stuck store fails a check instead of hanging it;
keys are fresh per check (:func:`fresh_key`), so checks never see each
other's records.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn, Protocol, TypeAlias, runtime_checkable

from touba.history._frozen import FrozenDict, FrozenList
from touba.history._identity import ConversationIdentity
from touba.history._record import RECORD_KIND, join_record, new_head
from touba.history._store import HistoryStore, Record, StoreUsage

__all__ = [
    "AT_ONCE",
    "CHECK_TIMEOUT",
    "CONCURRENT_INCREMENTS",
    "CheckSkipped",
    "ConformanceReport",
    "Deletable",
    "Held",
    "ExpiringStoreFactory",
    "LimitedStoreFactory",
    "Listable",
    "Measurable",
    "Probe",
    "Readable",
    "Recoverable",
    "STEP_TIMEOUT",
    "StoreFactory",
    "StoreSource",
    "expect",
    "expect_detached",
    "expect_same",
    "expect_stored",
    "fail_check",
    "fresh_key",
    "holding",
    "identity_for",
    "messages",
    "open_store",
    "require",
    "sample_records",
    "save_record",
    "touba_record",
    "within",
]

StoreSource: TypeAlias = (
    HistoryStore | Awaitable[HistoryStore] | AbstractAsyncContextManager[HistoryStore]
)
"""What a factory returns: a store, an awaitable of one, or an async context manager."""

StoreFactory: TypeAlias = Callable[[], StoreSource]


class LimitedStoreFactory(Protocol):
    """Builds a fresh store with the given capacity (SPEC section 6 bounds)."""

    def __call__(self, *, max_sessions: int, max_store_bytes: int) -> StoreSource: ...


class ExpiringStoreFactory(Protocol):
    """Builds a fresh store whose conversations expire after ``ttl_seconds``."""

    def __call__(self, *, ttl_seconds: float) -> StoreSource: ...


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
class Readable(Protocol):
    """A store with ``read(key)``."""

    async def read(self, key: str) -> Record | None:
        """A detached copy of the stored record, or None."""


@runtime_checkable
class Deletable(Protocol):
    """A store with ``delete(key)``."""

    async def delete(self, key: str) -> bool:
        """Delete the record; whether there was one."""


@runtime_checkable
class Recoverable(Protocol):
    """A store with ``recover(key, worker_stopped=...)``."""

    async def recover(self, key: str, *, worker_stopped: bool) -> bool:
        """Clear a dead worker's reservation; whether there was one."""


@runtime_checkable
class Listable(Protocol):
    """A store with ``list(namespace=None)``."""

    async def list(self, namespace: str | None = None) -> Sequence[Any]:
        """The stored conversations, of ``namespace`` or all."""


@runtime_checkable
class Measurable(Protocol):
    """A store with ``usage()``."""

    async def usage(self) -> StoreUsage:
        """Places held and bytes retained, with the limits."""


def require(store: HistoryStore, capability: type, method: str) -> None:
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
        fail_check(f"the factory gave {value!r}, which has no transact(key, operation) method")


# -- small helpers ----------------------------------------------------------------------


def fail_check(message: str) -> NoReturn:
    raise AssertionError(message)


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Probe(Exception):
    """Raised by probe operations; a store must let it through untouched."""


def fresh_key(label: str) -> str:
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


def expect_same(expected: Any, actual: Any, context: str, *, readonly: bool = False) -> None:
    found = _difference(expected, actual, readonly=readonly)
    if found:
        fail_check(f"{context}: {found}")


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


def expect_detached(first: Any, second: Any, what: str) -> None:
    shared = {id(c) for c in _containers(first)} & {id(c) for c in _containers(second)}
    expect(
        not shared,
        f"{what} share {len(shared)} dict/list object(s): every snapshot must be a private "
        "deep copy, or one caller's changes leak into another's",
    )


async def within(awaitable: Awaitable[Any], seconds: float, what: str) -> Any:
    try:
        async with asyncio.timeout(seconds):
            return await awaitable
    except TimeoutError:
        fail_check(f"{what} did not finish within {seconds:g} s")


async def save_record(store: HistoryStore, key: str, record: Record | None) -> None:
    async def operation(snapshot: Record | None) -> tuple[Record | None, None]:
        return copy.deepcopy(record), None

    await within(store.transact(key, operation), STEP_TIMEOUT, f"transact({key!r}) saving")


async def _current(store: HistoryStore, key: str) -> Record | None:
    """The stored record, seen through ``transact`` (saved back unchanged)."""

    async def operation(snapshot: Record | None) -> tuple[Record | None, Record | None]:
        return snapshot, copy.deepcopy(snapshot)

    result: Record | None = await within(
        store.transact(key, operation), STEP_TIMEOUT, f"transact({key!r}) reading"
    )
    return result


async def expect_stored(store: HistoryStore, key: str, expected: Record | None, when: str) -> None:
    current = await _current(store, key)
    if expected is None:
        expect(current is None, f"{when}, {key!r} should hold no record, got {_short(current)}")
    else:
        expect(current is not None, f"{when}, the record of {key!r} is gone")
        expect_same(expected, current, when)


def identity_for(namespace: str) -> ConversationIdentity:
    return ConversationIdentity(
        namespace=namespace,
        provider="conformance",
        model="conformance-model",
        decision_interface="native",
        run_id=uuid.uuid4().hex,
        invocation_id=uuid.uuid4().hex,
        agent_ref="conformance-agent",
    )


def messages(count: int, text: str = "") -> list[Record]:
    return [
        {
            "kind": "decision",
            "text": f"step {i} {text}",
            "calls": [{"call_id": f"c{i}", "name": "lookup", "arguments": {"id": i}}],
        }
        for i in range(count)
    ]


def touba_record(namespace: str, exchanges: list[list[Record]]) -> tuple[str, Record]:
    """A record shaped like touba's own, under its conversation key."""
    identity = identity_for(namespace)
    return identity.key, join_record(new_head(identity), exchanges)


def sample_records() -> list[Record]:
    """JSON dicts every store must give back exactly, whatever their shape."""
    deep: Any = "bottom"
    for depth in range(40):
        deep = {"level": depth, "next": deep} if depth % 2 else [deep]
    m = messages(3, "é🙂")
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
        {**touba_record("ns", [m[:2], m[2:]])[1], "extra": {"kept": True}},
        touba_record("ns", [])[1],
        touba_record("ns", [m[:1]])[1],
        # ... and near misses that must still come back exactly as saved.
        {"kind": RECORD_KIND, "version": 1, "exchanges": [[]]},
        {"kind": RECORD_KIND, "exchanges": "not a list"},
        {"kind": RECORD_KIND, "exchanges": [[{"a": 1}, 2]]},
        {"exchanges": [[{"kind": "decision"}]]},
        {"kind": "something-else", "version": 99},
    ]


@dataclass(slots=True)
class Held:
    task: asyncio.Task[Any]
    release: asyncio.Event
    running: bool = True


@asynccontextmanager
async def holding(
    store: HistoryStore, key: str, *, save: Record | None = None, expect_ok: bool = True
) -> AsyncIterator[Held]:
    """Run a transact on ``key`` whose operation waits until the block exits.

    The operation saves ``save`` (or keeps the snapshot). With ``expect_ok``,
    a failure of that held transact fails the check.
    """
    started = asyncio.Event()
    release = asyncio.Event()
    held: Held

    async def hold(snapshot: Record | None) -> tuple[Record | None, None]:
        started.set()
        try:
            await release.wait()
            return (snapshot if save is None else copy.deepcopy(save)), None
        finally:
            held.running = False

    held = Held(asyncio.create_task(store.transact(key, hold)), release)
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
                fail_check(
                    f"transact({key!r}) finished without running its operation: "
                    f"{held.task.exception()!r}"
                )
            fail_check(f"transact({key!r}) did not call its operation within {STEP_TIMEOUT:g} s")
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
                fail_check(f"transact({key!r}) did not finish after its operation returned")
        error = None if held.task.cancelled() else held.task.exception()
        if expect_ok and error is not None and not body_failed:
            fail_check(f"the transact holding {key!r} failed: {error!r}")
