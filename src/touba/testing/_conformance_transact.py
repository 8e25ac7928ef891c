"""The checks of the contract every store keeps: ``transact`` (SPEC section 6).

JSON records round-trip exactly; each operation sees a private snapshot; an
operation that raises, or is cancelled, leaves the previous state; two
operations on one key exclude each other (``DecisionHistoryBusy`` at once,
or waiting, for an adapter that says so), while other keys answer; and
concurrent operations never lose an update. None of these is optional.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
from typing import Any

from touba.errors import DecisionHistoryBusy
from touba.history._store import HistoryStore, Record
from touba.testing._conformance_base import (
    AT_ONCE,
    CONCURRENT_INCREMENTS,
    STEP_TIMEOUT,
    Probe,
    expect,
    expect_detached,
    expect_same,
    expect_stored,
    fail_check,
    fresh_key,
    holding,
    messages,
    sample_records,
    save_record,
    touba_record,
    within,
)

__all__ = [
    "check_atomicity",
    "check_cancellation_keeps_state",
    "check_exception_keeps_state",
    "check_exclusion",
    "check_private_snapshots",
    "check_round_trip",
]


async def check_round_trip(store: HistoryStore) -> None:
    """Any JSON dict comes back equal; ``result`` is returned; ``None`` deletes."""
    key = fresh_key("round-trip")
    seen: list[Record | None] = []

    async def absent(snapshot: Record | None) -> tuple[None, str]:
        seen.append(snapshot)
        return None, "untouched"

    result = await within(store.transact(key, absent), STEP_TIMEOUT, "transact on a new key")
    expect(seen == [None], f"the snapshot of a key never saved must be None, got {seen!r}")
    expect(result == "untouched", f"transact must return the operation's result, got {result!r}")
    await expect_stored(store, key, None, "after an operation returned None for a new key")

    for index, record in enumerate(sample_records()):
        token = object()

        async def save(
            snapshot: Record | None, record: Record = record, token: object = token
        ) -> tuple[Record, object]:
            return copy.deepcopy(record), token

        for where in (fresh_key(f"round-trip-{index}"), key):  # a new key, then one rewritten
            got = await within(store.transact(where, save), STEP_TIMEOUT, "transact saving")
            expect(
                got is token,
                f"transact must return the very object the operation returned, got {got!r}",
            )
            await expect_stored(store, where, record, f"sample record #{index} did not round-trip")

    async def delete(snapshot: Record | None) -> tuple[None, str]:
        expect(snapshot is not None, "the record saved just before is missing")
        return None, "deleted"

    result = await store.transact(key, delete)
    expect(result == "deleted", f"transact must return the operation's result, got {result!r}")
    await expect_stored(store, key, None, "after an operation returned None (deletion)")


async def check_private_snapshots(store: HistoryStore) -> None:
    """Snapshots are private deep copies, and saved records are copied too."""
    key, record = touba_record(fresh_key("private"), [messages(2), messages(1)])
    record["nested"] = {"list": [1, 2], "map": {"a": "b"}}
    await save_record(store, key, record)

    async def vandal(snapshot: Record | None) -> tuple[Record | None, None]:
        expect(snapshot is not None, "the record saved just before is missing")
        assert snapshot is not None
        snapshot["nested"]["list"].append(3)
        snapshot["nested"]["map"].clear()
        snapshot["exchanges"][0][0]["text"] = "rewritten in place"
        snapshot["exchanges"].append([{"kind": "decision"}])
        snapshot["intruder"] = True
        raise Probe("mutated the snapshot, then failed")

    with contextlib.suppress(Probe):
        await store.transact(key, vandal)
    await expect_stored(
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
    await expect_stored(
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
    expect(first is not None and second is not None, "the record disappeared")
    expect(first is not second, "two successive transacts got the same snapshot object")
    expect_detached(first, second, "two successive snapshots")
    expect_detached(first, kept, "a snapshot and objects the operation returned earlier")


async def check_exception_keeps_state(store: HistoryStore) -> None:
    """When the operation raises: same exception, old state kept, key free at once."""
    key = fresh_key("exception")
    record: Record = {"counter": 1, "items": [{"a": 1}]}
    await save_record(store, key, record)

    async def fail(snapshot: Record | None) -> tuple[Record | None, None]:
        assert snapshot is not None
        snapshot["counter"] = 2
        snapshot["items"].append({"b": 2})
        await asyncio.sleep(0)
        raise probe

    for attempt in range(2):
        probe = Probe(f"operation failure #{attempt}")
        try:
            await within(store.transact(key, fail), STEP_TIMEOUT, "the failing transact")
        except Probe as e:
            expect(e is probe, "transact must re-raise the operation's own exception object")
        except AssertionError:
            raise
        except Exception as e:
            fail_check(
                f"transact must let the operation's exception through unchanged, it raised "
                f"{type(e).__name__}: {e}"
            )
        else:
            fail_check("transact swallowed the exception its operation raised")

        async def after(snapshot: Record | None) -> tuple[Record | None, Record | None]:
            return snapshot, copy.deepcopy(snapshot)

        try:
            current = await within(
                store.transact(key, after), AT_ONCE, "transact right after a failed operation"
            )
        except DecisionHistoryBusy:
            fail_check("after an operation raised, its key must be free at once, got busy")
        expect_same(record, current, "an operation raised, yet the stored record changed")

    new_key = fresh_key("exception-new")

    async def create_then_fail(snapshot: Record | None) -> tuple[Record | None, None]:
        raise Probe("failed before saving anything")

    with contextlib.suppress(Probe):
        await store.transact(new_key, create_then_fail)
    await expect_stored(store, new_key, None, "an operation on a new key raised")


async def check_cancellation_keeps_state(store: HistoryStore) -> None:
    """A cancelled transact (a timeout, a shutdown) keeps the old state and frees the key."""
    key = fresh_key("cancel")
    record: Record = {"before": "cancellation"}
    await save_record(store, key, record)
    started = asyncio.Event()

    async def endless(snapshot: Record | None) -> tuple[Record | None, None]:
        assert snapshot is not None
        snapshot["before"] = "changed"
        started.set()
        await asyncio.Event().wait()
        return snapshot, None

    task = asyncio.create_task(store.transact(key, endless))
    await within(started.wait(), STEP_TIMEOUT, "the operation to start")
    task.cancel()
    try:
        await within(task, STEP_TIMEOUT, "the cancelled transact")
    except asyncio.CancelledError:
        pass
    except AssertionError:
        raise
    except Exception as e:
        fail_check(f"a cancelled transact must end with CancelledError, got {e!r}")
    else:
        fail_check("a cancelled transact must end with CancelledError, it returned")
    try:
        await expect_stored(store, key, record, "a transact was cancelled mid-operation")
    except DecisionHistoryBusy:
        fail_check(
            "a cancelled transact left its key busy: cancellation is not a crash, the "
            "reservation must be released"
        )


async def check_exclusion(store: HistoryStore, *, expect_busy_error: bool = True) -> None:
    """Two operations on one key never overlap; other keys are not blocked.

    With ``expect_busy_error`` (built-in stores), the second transact must
    raise :class:`DecisionHistoryBusy` at once; otherwise it may also wait,
    as long as it runs after the first one saved.
    """
    key, other = fresh_key("exclusion"), fresh_key("exclusion-other")
    await save_record(store, key, {"n": 0})
    overlaps: list[Record | None] = []
    after_first: list[Record | None] = []
    waiting: asyncio.Task[Any] | None = None

    async with holding(store, key, save={"n": 1}) as held:

        async def second(snapshot: Record | None) -> tuple[Record | None, str]:
            (overlaps if held.running else after_first).append(copy.deepcopy(snapshot))
            return snapshot, "second"

        if expect_busy_error:
            try:
                async with asyncio.timeout(AT_ONCE):
                    await store.transact(key, second)
            except DecisionHistoryBusy as e:
                expect(
                    e.session_key == key,
                    f"DecisionHistoryBusy.session_key should be {key!r}, got {e.session_key!r}",
                )
            except TimeoutError:
                fail_check(
                    f"a second transact on a held key waited over {AT_ONCE:g} s; built-in "
                    "stores must refuse it at once with DecisionHistoryBusy"
                )
            else:
                fail_check(
                    "a second transact on a key held by another operation completed; it must "
                    "raise DecisionHistoryBusy (a bare get/set does not satisfy the contract)"
                )
        else:
            waiting = asyncio.create_task(store.transact(key, second))
            await asyncio.sleep(0.1)

        expect(not overlaps, "two operations on the same key ran at the same time")

        async def unrelated(snapshot: Record | None) -> tuple[Record, str]:
            return {"unrelated": True}, "done"

        try:
            async with asyncio.timeout(AT_ONCE):
                await store.transact(other, unrelated)
        except DecisionHistoryBusy:
            fail_check("a transact on another key was refused as busy: exclusion must be per key")
        except TimeoutError:
            fail_check(
                f"a transact on another key waited over {AT_ONCE:g} s behind a held key: "
                "exclusion must be per key"
            )

    if waiting is not None:
        with contextlib.suppress(DecisionHistoryBusy):
            await within(waiting, STEP_TIMEOUT, "the waiting transact")
        expect(not overlaps, "two operations on the same key ran at the same time")
        for snapshot in after_first:
            expect_same({"n": 1}, snapshot, "a waiting operation must see the first one's save")
    await expect_stored(store, key, {"n": 1}, "after the first operation finished")


async def check_atomicity(store: HistoryStore) -> None:
    """Concurrent increments (retried when busy) lose no update and never overlap."""
    key = fresh_key("atomicity")
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
        fail_check("an increment was refused as busy 2000 times in a row")

    async with asyncio.TaskGroup() as group:
        for _ in range(CONCURRENT_INCREMENTS):
            group.create_task(worker())
    expect(peak == 1, f"{peak} operations on the same key ran at the same time")
    await expect_stored(
        store,
        key,
        {"n": CONCURRENT_INCREMENTS},
        f"after {CONCURRENT_INCREMENTS} concurrent increments (a lost update means transact "
        "is not atomic)",
    )
    expect(
        sorted(results) == list(range(1, CONCURRENT_INCREMENTS + 1)),
        f"each increment should have seen a distinct value, got {sorted(results)}",
    )
