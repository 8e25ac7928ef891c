"""Retention on the checkpoint stores (RAM, SQLite, PostgreSQL) and the decision-history
stores: abandoned checkpoints older than the bound go, running and younger ones stay;
histories lose only what already expired."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.runtime._stores import KINDS, Place, place
from touba.data import Retention, Stores, apply_retention
from touba.errors import ConfigurationError
from touba.history import MemoryHistoryStore


@pytest.fixture(params=KINDS)
async def where(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Place]:
    async with place(request.param, tmp_path) as found:
        yield found


async def _times(store: Any) -> dict[str, datetime]:
    return {i.checkpoint_id: datetime.fromisoformat(i.updated_at) for i in await store.list()}


async def _saved_apart(store: Any, items: dict[str, dict[str, Any]]) -> None:
    for checkpoint_id, body in items.items():
        await store.save(checkpoint_id, body)
        await asyncio.sleep(0.01)  # distinct write times, whichever clock stamps them


async def test_abandoned_checkpoints_older_than_the_bound_go_and_no_other(where: Place) -> None:
    store = where.checkpoints()
    await _saved_apart(
        store,
        {
            "awaiting": {"agent_ref": "a"},  # no status: awaiting approval
            "failed": {"status": "failed", "revision": 2},
            "running": {"status": "running", "revision": 1},
            "young": {"status": "awaiting_approval"},
        },
    )
    times = await _times(store)
    assert times["running"] < times["young"]
    # the bound falls between the running one and the young one
    cutoff = times["running"] + (times["young"] - times["running"]) / 2
    now = cutoff + timedelta(days=3)
    stores, retention = Stores(checkpoints=store), Retention(checkpoints_days=3)
    dry = await apply_retention(stores, retention, now=now, dry_run=True)
    assert dry.counts == {"checkpoints": {"checkpoints": 2}}
    assert set(await _times(store)) == {"awaiting", "failed", "running", "young"}
    report = await apply_retention(stores, retention, now=now)
    assert report.counts == {"checkpoints": {"checkpoints": 2}}
    assert set(await _times(store)) == {"running", "young"}
    assert await store.get("young") == {"status": "awaiting_approval"}
    assert (await apply_retention(stores, retention, now=now)).counts == {
        "checkpoints": {"checkpoints": 0}
    }


async def test_a_checkpoint_written_again_is_young_again(where: Place) -> None:
    store = where.checkpoints()
    await _saved_apart(store, {"a": {"revision": 0}, "b": {"revision": 0}})
    times = await _times(store)
    await asyncio.sleep(0.01)
    assert await store.replace("a", {"revision": 1, "note": "approved later"}, revision=0)
    cutoff = times["b"] + timedelta(microseconds=1)  # after both first writes
    removed = await store.purge_before(cutoff)
    assert removed == 1
    assert set(await _times(store)) == {"a"}


async def test_checkpoints_are_removed_in_batches(where: Place) -> None:
    store = where.checkpoints()
    for i in range(7):
        await store.save(f"c{i}", {"status": "failed"})
    await store.save("r", {"status": "running"})
    later = max((await _times(store)).values()) + timedelta(seconds=1)
    assert await store.purge_before(later, dry_run=True) == 7
    assert await store.purge_before(later, batch_size=2) == 7
    assert set(await _times(store)) == {"r"}


async def test_purge_before_refuses_bad_arguments(where: Place) -> None:
    store = where.checkpoints()
    await store.save("c", {})
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        await store.purge_before(datetime(2999, 1, 1))
    with pytest.raises(ConfigurationError, match="batch_size"):
        await store.purge_before(datetime.now().astimezone(), batch_size=True)
    assert await store.get("c") == {}


async def _put(store: MemoryHistoryStore, key: str) -> None:
    async def operation(snapshot: Any) -> tuple[Any, None]:
        return {"v": key}, None

    await store.transact(key, operation)


async def test_histories_lose_only_what_already_expired() -> None:
    moment = [1_000.0]
    # the RAM store has no purge_expired (it purges on every access): not an AdminStore
    first: Any = MemoryHistoryStore(ttl_seconds=60, clock=lambda: moment[0])
    second: Any = MemoryHistoryStore(ttl_seconds=60, clock=lambda: moment[0])
    await _put(first, "old")
    moment[0] += 50
    await _put(first, "young")
    await _put(second, "young")
    moment[0] += 20  # "old" expired 10 s ago; "young" has 40 s left
    stores = Stores(histories=[first, second])
    dry = await apply_retention(stores, Retention(), dry_run=True)
    assert dry.counts == {"history:0": {"conversations": 1}, "history:1": {"conversations": 0}}
    assert len(await first.list(purge=False)) == 2
    report = await apply_retention(stores, Retention(turns_days=1, checkpoints_days=1))
    assert report.counts == {"history:0": {"conversations": 1}, "history:1": {"conversations": 0}}
    assert [c.key for c in await first.list(purge=False)] == ["young"]
    assert [c.key for c in await second.list(purge=False)] == ["young"]
    one = await apply_retention(Stores(histories=[first]), Retention())
    assert one.counts == {"history": {"conversations": 0}}


_BAD = st.one_of(
    st.integers(max_value=0),
    st.floats(max_value=0.0),
    st.just(float("nan")),
    st.just(float("inf")),
    st.booleans(),
    st.text(max_size=3),
    st.just(2_000_000),
)


@given(
    name=st.sampled_from(["turns_days", "events_closed_days", "checkpoints_days", "traces_days"]),
    value=_BAD,
)
def test_a_bound_that_is_not_a_positive_number_of_days_is_refused(name: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=name):
        Retention(**{name: value})  # type: ignore[arg-type]


@given(
    days=st.one_of(st.none(), st.integers(1, 100_000), st.floats(0.001, 100_000, allow_nan=False))
)
def test_a_positive_bound_is_kept_and_measured_in_days(days: float | None) -> None:
    retention = Retention(turns_days=days)
    assert retention.turns_days == days
    assert retention.configured is (days is not None)
    now = datetime(2026, 6, 1).astimezone()
    expected = None if days is None else now - timedelta(days=days)
    assert retention.cutoff("turns_days", now) == expected
    assert retention.cutoff("traces_days", now) is None


def test_retention_is_frozen_and_defaults_to_nothing() -> None:
    retention = Retention()
    assert not retention.configured
    with pytest.raises(AttributeError):
        retention.turns_days = 3  # type: ignore[misc]
    with pytest.raises(ConfigurationError, match="retention kind"):
        retention.cutoff("days", datetime.now().astimezone())


async def test_a_sqlite_history_store_loses_only_what_already_expired(
    private_dir: Path,
) -> None:
    from touba.history.sqlite import SqliteHistoryStore

    moment = [1_000.0]
    path = private_dir / "history.db"
    async with SqliteHistoryStore(path, ttl_seconds=60, clock=lambda: moment[0]) as store:
        await _put(store, "old")  # type: ignore[arg-type]
        moment[0] += 50
        await _put(store, "young")  # type: ignore[arg-type]
        moment[0] += 20
        stores = Stores(histories=[store])
        dry = await apply_retention(stores, Retention(), dry_run=True)
        assert dry.counts == {"history": {"conversations": 1}}
        assert len(await store.list(purge=False)) == 2
        done = await apply_retention(stores, Retention(traces_days=1))
        assert done.counts == {"history": {"conversations": 1}}
        assert [c.key for c in await store.list(purge=False)] == ["young"]
