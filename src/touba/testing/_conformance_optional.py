"""The checks of what a store may offer beyond ``transact`` (SPEC section 6).

``read``, ``delete``, ``recover``, ``list``, capacity limits, expiry and the
``transact_log`` interface of the built-in stores: each check is skipped
(:class:`~touba.testing._conformance_base.CheckSkipped`) when the store lacks
the capability, and holds it to the contract when it has it. ``check_capacity``
and ``check_expiry`` take a factory, since they build stores with small limits
or a short time to live.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections.abc import Awaitable
from typing import Any, cast

from touba.errors import ConfigurationError, DecisionHistoryBusy, DecisionHistoryLimitExceeded
from touba.history._model import message_bytes
from touba.history._record import join_record, new_head
from touba.history._store import HistoryStore, LogSnapshot, LogStore, LogWrite, Record, StoreUsage
from touba.testing._conformance_base import (
    AT_ONCE,
    STEP_TIMEOUT,
    CheckSkipped,
    Deletable,
    ExpiringStoreFactory,
    LimitedStoreFactory,
    Listable,
    Measurable,
    Probe,
    Readable,
    Recoverable,
    expect,
    expect_detached,
    expect_same,
    expect_stored,
    fail_check,
    fresh_key,
    holding,
    identity_for,
    messages,
    open_store,
    require,
    save_record,
    touba_record,
    within,
)

__all__ = [
    "check_capacity",
    "check_delete",
    "check_expiry",
    "check_list",
    "check_log_interface",
    "check_read",
    "check_recover",
]


async def _refused_at_once(call: Awaitable[object], what: str) -> None:
    """``call``, on a key a transact holds, raises ``DecisionHistoryBusy`` within ``AT_ONCE``."""
    try:
        async with asyncio.timeout(AT_ONCE):
            await call
    except DecisionHistoryBusy:
        pass
    except TimeoutError:
        fail_check(f"{what} of an active conversation waited; it must raise DecisionHistoryBusy")
    else:
        fail_check(f"{what} of an active conversation must raise DecisionHistoryBusy")


async def check_read(store: HistoryStore) -> None:
    """``read`` gives a detached copy or None, renews nothing, and refuses active keys."""
    require(store, Readable, "read(key)")
    assert isinstance(store, Readable)
    absent = await within(store.read(fresh_key("read-absent")), STEP_TIMEOUT, "read")
    expect(absent is None, f"read of a key never saved must return None, got {absent!r}")

    key, record = touba_record(fresh_key("read"), [messages(2)])
    await save_record(store, key, record)
    before = None
    if isinstance(store, Listable):
        before = await _row(cast(Listable, store), key)
    await asyncio.sleep(0.01)  # so that a renewed TTL would show in expires_at
    first = await store.read(key)
    expect_same(record, first, "read did not return the saved record")
    assert first is not None
    first["exchanges"][0][0]["text"] = "changed by the reader"
    first["stats"]["messages"] = -1
    second = await store.read(key)
    expect_same(record, second, "mutating what read returned changed the store")
    expect_detached(first, second, "two results of read")
    if before is not None:
        after = await _row(cast(Listable, store), key)
        expect(
            (after.updated_at, after.expires_at) == (before.updated_at, before.expires_at),
            "read renewed the conversation's TTL (updated_at/expires_at changed); it must not",
        )

    async with holding(store, key):
        await _refused_at_once(store.read(key), "read")
    expect_same(record, await store.read(key), "read after the operation finished")


async def check_delete(store: HistoryStore) -> None:
    """``delete`` removes inactive conversations only, and says whether it did."""
    require(store, Deletable, "delete(key)")
    assert isinstance(store, Deletable)
    key = fresh_key("delete")
    gone = await within(store.delete(key), STEP_TIMEOUT, "delete")
    expect(gone is False, f"delete of a key never saved must return False, got {gone!r}")

    record: Record = {"to": "delete"}
    await save_record(store, key, record)
    async with holding(store, key):
        await _refused_at_once(store.delete(key), "delete")
    await expect_stored(store, key, record, "a refused delete of an active conversation")

    expect(await store.delete(key) is True, "delete of a stored conversation must return True")
    await expect_stored(store, key, None, "after delete")
    if isinstance(store, Readable):
        expect(await store.read(key) is None, "read after delete must return None")
    expect(await store.delete(key) is False, "a second delete must return False")


async def check_recover(store: HistoryStore) -> None:
    """``recover`` needs ``worker_stopped=True`` and frees only a reservation."""
    require(store, Recoverable, "recover(key, worker_stopped=...)")
    assert isinstance(store, Recoverable)
    key = fresh_key("recover")
    record: Record = {"state": "old"}
    await save_record(store, key, record)

    try:
        await within(store.recover(key, worker_stopped=False), STEP_TIMEOUT, "recover")
    except ConfigurationError:
        pass
    else:
        fail_check("recover(key, worker_stopped=False) must raise ConfigurationError")
    await expect_stored(store, key, record, "after a refused recover")

    freed = await store.recover(key, worker_stopped=True)
    expect(freed is False, f"recover of a key with no reservation must return False: {freed!r}")
    await expect_stored(store, key, record, "recover of a key with no reservation")
    absent = fresh_key("recover-absent")
    expect(
        await store.recover(absent, worker_stopped=True) is False,
        "recover of a key never saved must return False",
    )
    await expect_stored(store, absent, None, "recover of a key never saved")

    # A worker that "crashed" while holding the key: recovery frees the key, a new
    # worker proceeds, and the stale worker's late save is refused.
    async with holding(store, key, save={"state": "stale"}, expect_ok=False) as held:
        freed = await store.recover(key, worker_stopped=True)
        expect(freed is True, f"recover of a held key must return True, got {freed!r}")
        await expect_stored(store, key, record, "recover must touch nothing but the reservation")
        await save_record(store, key, {"state": "new"})
    error = None if held.task.cancelled() else held.task.exception()
    expect(
        isinstance(error, DecisionHistoryBusy),
        "the late save of a worker whose reservation was recovered must be refused with "
        f"DecisionHistoryBusy, got {error!r}",
    )
    await expect_stored(store, key, {"state": "new"}, "after a stale worker tried to save")


async def _row(store: Listable, key: str, namespace: str | None = None) -> Any:
    rows = await within(store.list(namespace=namespace), STEP_TIMEOUT, "list")
    matching = [r for r in rows if getattr(r, "key", None) == key]
    expect(len(matching) == 1, f"list() should show {key!r} once, found {len(matching)}")
    return matching[0]


async def check_list(store: HistoryStore) -> None:
    """``list`` shows sizes, identity and activity, and filters by namespace."""
    require(store, Listable, "list(namespace=None)")
    assert isinstance(store, Listable)
    ns_a, ns_b = fresh_key("ns-a"), fresh_key("ns-b")
    key_a, record_a = touba_record(ns_a, [messages(2), messages(1)])
    key_b, record_b = touba_record(ns_b, [messages(1)])
    key_plain = fresh_key("list-plain")
    for key, record in ((key_a, record_a), (key_b, record_b), (key_plain, {"plain": True})):
        await save_record(store, key, record)

    row = await _row(store, key_a)
    for name in ("identity", "messages", "bytes", "updated_at", "expires_at", "active"):
        expect(hasattr(row, name), f"list() rows must have {name!r}, got {row!r}")
    expect(
        row.identity == record_a["identity"],
        f"list() identity should be {record_a['identity']!r}, got {row.identity!r}",
    )
    expect(row.messages == 3, f"list() should count 3 messages, got {row.messages!r}")
    expect(isinstance(row.bytes, int) and row.bytes > 0, f"list() bytes: {row.bytes!r}")
    expect(isinstance(row.updated_at, str) and bool(row.updated_at), "list() updated_at")
    expect(row.expires_at is None or isinstance(row.expires_at, str), "list() expires_at")
    expect(row.active is False, f"an idle conversation must list active=False: {row!r}")
    await _row(store, key_b)
    await _row(store, key_plain)

    in_a = await store.list(namespace=ns_a)
    expect(
        [r.key for r in in_a] == [key_a],
        f"list(namespace={ns_a!r}) should show only {key_a!r}, got {[r.key for r in in_a]}",
    )
    async with holding(store, key_a):
        row = await _row(store, key_a, ns_a)
        expect(row.active is True, "a conversation held by an operation must list active=True")
    row = await _row(store, key_a, ns_a)
    expect(row.active is False, "after its operation finished, list() must show active=False")


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
            await save_record(store, key, record)
        except DecisionHistoryLimitExceeded as e:
            expect(e.limit == limit, f"the refusal should name limit={limit!r}, got {e.limit!r}")
        else:
            fail_check(f"a write over {limit} must raise DecisionHistoryLimitExceeded")

    async def absent_from_full(store: HistoryStore, key: str) -> None:
        try:
            await expect_stored(store, key, None, "a refused new conversation must not be stored")
        except DecisionHistoryLimitExceeded as e:
            # Built-in stores refuse even to reserve a new key when full: it has no record.
            expect(e.limit == "max_sessions", f"reserving a new key raised limit={e.limit!r}")

    async with open_store(limited_factory(max_sessions=2, max_store_bytes=1024 * 1024)) as store:
        k1, k2, k3 = fresh_key("cap-1"), fresh_key("cap-2"), fresh_key("cap-3")
        await save_record(store, k1, {"one": 1})
        await save_record(store, k2, {"two": 2})
        await _expect_usage(store, sessions=2, max_sessions=2)
        await refused(store, k3, {"three": 3}, "max_sessions")
        await expect_stored(store, k1, {"one": 1}, "a full store must evict nothing")
        await expect_stored(store, k2, {"two": 2}, "a full store must evict nothing")
        await absent_from_full(store, k3)
        await _expect_usage(store, sessions=2, max_sessions=2)
        await save_record(store, k1, {"one": "updated"})  # not a new session: allowed
        await save_record(store, k2, None)
        await save_record(store, k3, {"three": 3})  # room again after a deletion
        await expect_stored(store, k3, {"three": 3}, "after a deletion made room")

    async with open_store(limited_factory(max_sessions=100, max_store_bytes=8192)) as store:
        small: Record = {"pad": "a" * 2000}
        await save_record(store, k1, small)
        key, big = touba_record(fresh_key("cap-ns"), [messages(3, "b" * 2400)])
        await refused(store, key, big, "max_store_bytes")
        await expect_stored(store, k1, small, "a full store must evict nothing")
        await expect_stored(store, key, None, "a refused new conversation must not be stored")
        await refused(store, k1, {"pad": "a" * 9000}, "max_store_bytes")
        await expect_stored(store, k1, small, "a refused update must keep the old record")
        await _expect_usage(store, sessions=1, max_sessions=100, bytes=len(_json(small)))


EXPIRY_TTL = 1.0
"""The ``ttl_seconds`` of :func:`check_expiry`'s store (it waits a little longer)."""


def _purges(store: HistoryStore) -> bool:
    """Whether ``list``, ``read`` and ``usage`` all take ``purge=`` (a read-only look)."""
    methods = [getattr(store, name, None) for name in ("list", "read", "usage")]
    return all(m is not None and "purge" in inspect.signature(m).parameters for m in methods)


async def check_expiry(expiring_factory: ExpiringStoreFactory | None) -> None:
    """An expired conversation reads as absent, and ``list``, ``read`` and ``usage``
    with ``purge=False`` (the read-only look of the CLI and the panel) leave it
    stored, listed with ``expired=True`` and counted, until a purge removes it."""
    if expiring_factory is None:
        raise CheckSkipped("no factory building the store with ttl_seconds was given")
    async with open_store(expiring_factory(ttl_seconds=EXPIRY_TTL)) as store:
        if not _purges(store):
            raise CheckSkipped(f"{type(store).__name__} has no list/read/usage(purge=...)")
        admin: Any = store
        key, record = touba_record(fresh_key("expiry"), [messages(2)])
        await save_record(store, key, record)
        row = await _row(admin, key)
        expect(row.expired is False, f"a live conversation must list expired=False: {row!r}")
        await asyncio.sleep(EXPIRY_TTL + 0.5)
        for look in ("first", "second"):  # the first look must not have purged it
            rows = await within(admin.list(purge=False), STEP_TIMEOUT, "list(purge=False)")
            found = [r for r in rows if r.key == key]
            expect(
                len(found) == 1 and found[0].expired is True,
                f"list(purge=False), {look} look: the expired {key!r} should be listed once "
                f"with expired=True, got {found!r}",
            )
            read = await within(admin.read(key, purge=False), STEP_TIMEOUT, "read(purge=False)")
            expect(read is None, f"read(purge=False) of an expired conversation: {read!r}")
            usage = await within(admin.usage(purge=False), STEP_TIMEOUT, "usage(purge=False)")
            expect(
                usage.sessions == 1,
                f"usage(purge=False) should count the expired conversation: {usage!r}",
            )
        rows = await within(admin.list(), STEP_TIMEOUT, "list()")
        expect(key not in [r.key for r in rows], "list() must purge an expired conversation first")
        again = await within(admin.list(purge=False), STEP_TIMEOUT, "list(purge=False)")
        expect(key not in [r.key for r in again], "after list(), the expired conversation is gone")


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


async def _expect_usage(store: HistoryStore, **expected: int) -> None:
    """``usage()``, where the store offers it (built-ins do), reports these figures."""
    if not isinstance(store, Measurable):
        return
    usage = await within(store.usage(), STEP_TIMEOUT, "usage()")
    got = {name: getattr(usage, name) for name in expected}
    expect(got == expected, f"usage() should report {expected}, got {got}")


async def check_log_interface(store: HistoryStore, *, expect_busy_error: bool = True) -> None:
    """Built-ins' ``transact_log``: appends, sizes and tails agree with ``transact``."""
    if not isinstance(store, LogStore):
        raise CheckSkipped(
            f"{type(store).__name__} has no transact_log (touba falls back to transact; "
            "built-in stores implement it)"
        )
    identity = identity_for(fresh_key("log"))
    key = identity.key
    head = new_head(identity)
    m = messages(5, "log")

    async def create(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, str]:
        expect(snapshot is None, "the log snapshot of a new key must be None")
        return LogWrite(head=copy.deepcopy(head), append=[(0, m[0]), (0, m[1]), (1, m[2])]), "r1"

    result = await within(store.transact_log(key, create), STEP_TIMEOUT, "transact_log")
    expect(result == "r1", f"transact_log must return the operation's result, got {result!r}")
    expected = join_record(head, [m[0:2], m[2:3]])
    await expect_stored(store, key, expected, "after appending through transact_log")

    head2 = {**head, "pending": [{"call_id": "c2", "name": "lookup"}]}

    async def inspect_then_append(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, None]:
        expect(snapshot is not None, "the log snapshot of a stored key is None")
        assert snapshot is not None
        # Its top-level dict is the operation's; nested values may be read-only.
        expect(type(snapshot.head) is dict, "the log snapshot's head must be a plain dict")
        expect_same(head, snapshot.head, "the log snapshot's head", readonly=True)
        expect(snapshot.exchange_count == 2, f"exchange_count is {snapshot.exchange_count}")
        sizes = [(s.messages, s.bytes) for s in await snapshot.sizes(0)]
        want = [(2, message_bytes(m[0]) + message_bytes(m[1])), (1, message_bytes(m[2]))]
        expect(sizes == want, f"sizes(0) should be {want}, got {sizes}")
        tail = [(s.messages, s.bytes) for s in await snapshot.sizes(1)]
        expect(tail == want[1:], f"sizes(1) should be {want[1:]}, got {tail}")
        expect_same([m[0:2], m[2:3]], await snapshot.exchanges(0, 2), "exchanges(0, 2)")
        last = await snapshot.exchanges(1, 2)
        expect_same([m[2:3]], last, "exchanges(1, 2)")
        last[0][0]["text"] = "mutated copy"
        return LogWrite(head=copy.deepcopy(head2), append=[(1, m[3])]), None

    await store.transact_log(key, inspect_then_append)
    expected = join_record(head2, [m[0:2], m[2:4]])
    await expect_stored(store, key, expected, "after appending to the last exchange")

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
        expect(refused, f"appending to exchange {bad[0][0]} of a 2-exchange log was accepted")
        await expect_stored(store, key, expected, "a refused append must change nothing")

    async def nothing(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[None, str]:
        return None, "kept"

    expect(await store.transact_log(key, nothing) == "kept", "transact_log result")
    probe = Probe("log operation failed")

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
    except Probe as e:
        expect(e is probe, "transact_log must re-raise the operation's own exception")
    await expect_stored(store, key, expected, "a failed log operation must change nothing")

    if expect_busy_error:
        async with holding(store, key):
            try:
                async with asyncio.timeout(AT_ONCE):
                    await store.transact_log(key, nothing)
            except DecisionHistoryBusy:
                pass
            except TimeoutError:
                fail_check("transact_log on a key held by transact waited; it must raise busy")
            else:
                fail_check(
                    "transact_log ran while transact held the same key: both must share "
                    "one exclusion"
                )
