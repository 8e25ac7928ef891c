"""touba.data.copy_stores and verify_copy over every pair of SQLite, PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from itertools import product
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.history._stores import Stores as Built
from tests.history._stores import holding
from touba.data import (
    CopyIssue,
    Stores,
    conversation_digest,
    copy_stores,
    copy_worker_id,
    verify_copy,
)
from touba.errors import ConfigurationError, DecisionHistoryStoreUnavailable
from touba.history import ConversationIdentity, MemoryHistoryStore
from touba.history._record import join_record, new_head
from touba.history._store import AdminStore

ROOT = str(Path(__file__).resolve().parents[2])
DURABLE = ["sqlite", "postgres", "redis"]
MARKS = {"postgres": [pytest.mark.postgres], "redis": [pytest.mark.redis], "sqlite": []}
PAIRS = [
    pytest.param(src, dst, marks=MARKS[src] + MARKS[dst], id=f"{src}-{dst}")
    for src, dst in product(DURABLE, DURABLE)
]


def record(n: int, exchanges: int = 3, namespace: str = "ns") -> dict[str, Any]:
    """A touba record of ``exchanges`` exchanges (a call, its result, an answer)."""
    who = ConversationIdentity(namespace, "openai", "m", "native", f"r-{n}", "i", "agent")
    messages = [
        [
            {"role": "assistant", "kind": "call", "call_id": f"c{n}-{i}", "name": "lookup"},
            {"role": "tool", "kind": "result", "call_id": f"c{n}-{i}", "text": f"é {n} {i}"},
        ]
        for i in range(exchanges)
    ]
    return join_record(new_head(who), messages)


async def fill(store: Any, count: int, **options: Any) -> dict[str, dict[str, Any]]:
    """``count`` conversations ``k000`` ..., returned as saved."""
    saved = {f"k{n:03d}": record(n, **options) for n in range(count)}
    for key, value in saved.items():
        await put(store, key, value)
    return saved


async def put(store: Any, key: str, value: dict[str, Any]) -> None:
    async def operation(snapshot: Any) -> tuple[dict[str, Any], None]:
        return value, None

    await store.transact(key, operation)


async def contents(store: AdminStore) -> dict[str, dict[str, Any] | None]:
    return {row.key: await store.read(row.key) for row in await store.list()}


@pytest.fixture
async def built(tmp_path: Path) -> AsyncIterator[dict[str, Built]]:
    """One builder per kind, made on first use, cleaned up after the test."""
    made: dict[str, Built] = {}

    class Lazy(dict[str, Built]):
        def __missing__(self, kind: str) -> Built:
            builder = Built(kind, tmp_path)
            builder.prepare()
            made[kind] = self[kind] = builder
            return builder

    yield Lazy()
    for builder in made.values():
        await builder.cleanup()


@pytest.mark.parametrize(("src", "dst"), PAIRS)
async def test_every_pair_copies_equal_and_verifies_clean(
    built: dict[str, Built], src: str, dst: str
) -> None:
    source, target = built[src]("source"), built[dst]("target", max_sessions=50)
    saved = await fill(source, 6)
    await put(source, "other-app", {"any": ["json", 1, None, {"é": True}]})  # opaque record
    seen: list[tuple[str, int, int]] = []

    report = await copy_stores(
        Stores(histories=[source]),
        Stores(histories=[target]),
        progress=lambda kind, done, total: seen.append((kind, done, total)),
    )

    assert report.copied == {"conversation": 7}
    assert report.already == {"conversation": 0}
    assert report.complete
    assert report.issues == ()
    assert report.bytes > 0
    assert seen[-1] == ("conversation", 7, 7)
    assert await contents(target) == {**saved, "other-app": await source.read("other-app")}
    assert not any(row.active for row in await target.list())
    verified = await verify_copy(Stores(histories=[source]), Stores(histories=[target]))
    assert verified.clean
    assert verified.matched == 7
    assert verified.counts == {"conversation": (7, 7)}


KINDS = [pytest.param(kind, marks=MARKS.get(kind, []), id=kind) for kind in DURABLE]


@pytest.mark.parametrize("dst", KINDS)
async def test_a_rerun_doubles_nothing(built: dict[str, Built], dst: str) -> None:
    source, target = built["sqlite"]("source"), built[dst]("target")
    await fill(source, 5)
    pair = Stores(histories=[source]), Stores(histories=[target])
    first = await copy_stores(*pair)
    before = await target.list(purge=False)
    again = await copy_stores(*pair)
    assert first.copied == {"conversation": 5}
    assert again.copied == {"conversation": 0}
    assert again.already == {"conversation": 5}
    assert again.bytes == 0
    assert again.complete
    # Untouched: not rewritten, not even its expiry renewed.
    assert await target.list(purge=False) == before
    assert (await verify_copy(*pair)).clean


class FailingTarget:
    """A real store whose ``transact`` fails (the store unreachable) for some calls."""

    def __init__(self, store: Any, failing: range) -> None:
        self.store = store
        self.failing = failing
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def transact(self, key: str, operation: Any) -> Any:
        self.calls += 1
        if self.calls - 1 in self.failing:
            raise DecisionHistoryStoreUnavailable("injected: the target went away")
        return await self.store.transact(key, operation)


class Crash(Exception):
    pass


class CrashingTarget(FailingTarget):
    """Raises a non-touba exception once four writes have been saved (those in flight
    then are cancelled by the copy, as a Ctrl-C would)."""

    async def transact(self, key: str, operation: Any) -> Any:
        if self.calls >= 4:
            raise Crash("the copy's process is stopping")
        result = await self.store.transact(key, operation)
        self.calls += 1
        return result


async def test_failures_midway_are_reported_and_a_rerun_finishes(
    built: dict[str, Built],
) -> None:
    source, target = built["sqlite"]("source"), built["sqlite"]("target")
    saved = await fill(source, 12)
    failing = FailingTarget(target, range(3, 7))
    report = await copy_stores(Stores(histories=[source]), Stores(histories=[failing]))
    refused = report.of("refused")
    assert len(refused) == 4
    assert not report.complete
    assert {issue.code for issue in refused} == {"DecisionHistoryStoreUnavailable"}
    assert report.copied == {"conversation": 8}
    assert set(await contents(target)) == set(saved) - {issue.key for issue in refused}

    again = await copy_stores(Stores(histories=[source]), Stores(histories=[target]))
    assert again.copied == {"conversation": 4}
    assert again.already == {"conversation": 8}
    assert await contents(target) == saved
    assert (await verify_copy(Stores(histories=[source]), Stores(histories=[target]))).clean


async def test_an_exception_stops_the_copy_and_a_rerun_doubles_nothing(
    built: dict[str, Built],
) -> None:
    source, target = built["sqlite"]("source"), built["sqlite"]("target")
    saved = await fill(source, 20)
    with pytest.raises(Crash):
        await copy_stores(
            Stores(histories=[source]), Stores(histories=[CrashingTarget(target, range(0))])
        )
    partial = await contents(target)
    assert 0 < len(partial) < 20
    assert not any(row.active for row in await target.list())  # every reservation released
    verified = await verify_copy(Stores(histories=[source]), Stores(histories=[target]))
    assert {m.reason for m in verified.mismatches} == {"missing"}
    assert len(verified.mismatches) == 20 - len(partial)

    again = await copy_stores(Stores(histories=[source]), Stores(histories=[target]))
    assert again.already == {"conversation": len(partial)}
    assert again.copied == {"conversation": 20 - len(partial)}
    assert await contents(target) == saved
    assert (await verify_copy(Stores(histories=[source]), Stores(histories=[target]))).clean


async def child(built: Built, target: Built, mode: str, argument: str = "-") -> Any:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.data._copy_child",
        mode,
        argument,
        built.kind,
        target.kind,
        *built.location("source"),
        "--",
        *target.location("target"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )


async def killed(proc: Any, after: bytes) -> list[bytes]:
    """Read ``proc``'s lines until one starts with ``after``, then SIGKILL it."""
    lines: list[bytes] = []
    try:
        while not (lines and lines[-1].startswith(after)):
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            if not line:
                break
            lines.append(line)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        _, errors = await proc.communicate()
    assert proc.returncode == -signal.SIGKILL, errors.decode()
    return lines


@pytest.mark.parametrize("dst", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_copy_killed_midway_reruns_to_an_equal_target(
    built: dict[str, Built], dst: str
) -> None:
    sources, targets = built["sqlite"], built[dst]
    source = sources("source", max_sessions=1000)
    saved = await fill(source, 150, exchanges=20)
    await source.close()  # the child has the file to itself while it runs
    lines = await killed(await child(sources, targets, "copy"), b"done 10")
    assert b"finished\n" not in lines

    source, target = sources("source"), targets("target", max_sessions=1000)
    pair = Stores(histories=[source]), Stores(histories=[target])
    before = await target.list(purge=False)
    assert 10 <= len(before) < 150
    stale = [row.key for row in before if row.active]  # the reservations the kill left
    report = await copy_stores(*pair)
    assert report.recovered == tuple(stale)
    assert report.complete
    assert report.already["conversation"] + report.copied["conversation"] == 150
    assert report.already["conversation"] >= 10
    assert await contents(target) == saved  # nothing doubled, nothing missing
    assert (await verify_copy(*pair)).clean


async def test_a_killed_copy_s_reservation_is_recovered_and_no_other(
    built: dict[str, Built],
) -> None:
    builder = built["sqlite"]
    source, target = builder("source"), builder("target")
    saved = await fill(source, 3)
    lines = await killed(await child(builder, builder, "hold", "k001"), b"held")
    assert lines[-1] == b"held\n"
    # Another worker's reservation: a crashed application, not ours to free.
    other = builder("target", worker_id="app-worker")
    task, leave = await holding(other, "k002", lambda snapshot: (snapshot, None))

    pair = Stores(histories=[source]), Stores(histories=[target])
    report = await copy_stores(*pair)
    assert report.recovered == ("k001",)
    assert report.copied == {"conversation": 2}
    assert report.issues == (CopyIssue(0, "k002", "busy", "DecisionHistoryBusy"),)
    leave.set()
    await task
    assert (await copy_stores(*pair)).copied == {"conversation": 1}
    assert await contents(target) == saved


@pytest.mark.parametrize(("src", "dst"), PAIRS)
async def test_active_conversations_are_listed_and_skipped_or_copied_inactive(
    built: dict[str, Built], src: str, dst: str
) -> None:
    source, target = built[src]("source"), built[dst]("target")
    saved = await fill(source, 3)
    task, leave = await holding(source, "k001", lambda snapshot: ({"newer": 1}, None))
    bare, leave_bare = await holding(source, "k-new", lambda snapshot: (record(9), None))
    pair = Stores(histories=[source]), Stores(histories=[target])
    try:
        skipped = await copy_stores(*pair)
        assert skipped.copied == {"conversation": 2}
        assert set(skipped.of("active")) == {
            CopyIssue(0, "k001", "active"),
            CopyIssue(0, "k-new", "active"),
        }
        assert skipped.complete  # active ones are skipped on purpose
        verified = await verify_copy(*pair)
        assert verified.clean
        assert set(verified.active) == {"k001"}

        copied = await copy_stores(*pair, include_active=True)
        assert copied.copied_active == ("k001",)
        assert copied.of("active") == (CopyIssue(0, "k-new", "active"),)  # nothing saved yet
        rows = {row.key: row for row in await target.list()}
        assert not rows["k001"].active  # the target holds no reservation
        assert await target.read("k001") == saved["k001"]  # the last saved state
        assert (await verify_copy(*pair)).clean
    finally:
        leave.set()
        leave_bare.set()
        await asyncio.gather(task, bare)
    # The holder has saved since: verify sees the copy is now behind.
    behind = await verify_copy(*pair)
    reasons = {m.key: m.reason for m in behind.mismatches}
    assert reasons == {"k001": "different", "k-new": "missing"}


@pytest.mark.parametrize(("src", "dst"), PAIRS)
async def test_a_conflicting_conversation_is_reported_and_untouched(
    built: dict[str, Built], src: str, dst: str
) -> None:
    source, target = built[src]("source"), built[dst]("target")
    await fill(source, 3)
    theirs = record(99, exchanges=1, namespace="theirs")
    await put(target, "k001", theirs)
    before = await target.list(purge=False)

    report = await copy_stores(Stores(histories=[source]), Stores(histories=[target]))
    assert report.of("conflict") == (CopyIssue(0, "k001", "conflict"),)
    assert report.copied == {"conversation": 2}
    assert not report.complete
    assert await target.read("k001") == theirs
    row = next(r for r in await target.list(purge=False) if r.key == "k001")
    assert row == next(r for r in before if r.key == "k001")  # not even its expiry renewed

    verified = await verify_copy(Stores(histories=[source]), Stores(histories=[target]))
    assert not verified.clean
    (mismatch,) = verified.mismatches
    assert (mismatch.key, mismatch.reason) == ("k001", "different")
    assert mismatch.target_digest == conversation_digest(theirs)
    assert mismatch.source_digest == conversation_digest(await source.read("k001"))


async def test_the_target_s_bounds_refuse_whole_conversations(built: dict[str, Built]) -> None:
    source = built["sqlite"]("source")
    target = built["sqlite"]("target", max_sessions=2)
    saved = await fill(source, 4)
    report = await copy_stores(Stores(histories=[source]), Stores(histories=[target]))
    assert report.copied == {"conversation": 2}
    refused = report.of("refused")
    assert [issue.code for issue in refused] == ["DecisionHistoryLimitExceeded"] * 2
    held = await contents(target)
    assert len(held) == 2
    assert all(held[key] == saved[key] for key in held)


async def test_expired_conversations_are_counted_not_copied(tmp_path: Path) -> None:
    now = [1000.0]
    source: Any = MemoryHistoryStore(ttl_seconds=10, clock=lambda: now[0])
    target: Any = MemoryHistoryStore()
    await fill(source, 2)
    now[0] += 5
    await put(source, "fresh", record(7))
    now[0] += 6
    report = await copy_stores(Stores(histories=[source]), Stores(histories=[target]))
    assert report.expired == 2
    assert report.copied == {"conversation": 1}
    assert [row.key for row in await target.list()] == ["fresh"]


async def test_stores_that_do_not_pair_are_refused() -> None:
    one: Any = MemoryHistoryStore()
    two: Any = MemoryHistoryStore()
    with pytest.raises(ConfigurationError, match="one target per source"):
        await copy_stores(Stores(histories=[one, two]), Stores(histories=[one]))
    from touba.memory import SqliteMemoryStore

    with pytest.raises(ConfigurationError, match="memory store on both sides or on neither"):
        await verify_copy(Stores(memory=SqliteMemoryStore.__new__(SqliteMemoryStore)), Stores())


@pytest.mark.parametrize("kind", [*KINDS, "memory"])
async def test_read_saved_reads_a_reserved_conversation(built: dict[str, Built], kind: str) -> None:
    store = built[kind]("main")
    saved = await fill(store, 1)
    assert await store.read_saved("k000") == saved["k000"]
    newer = record(5)
    task, leave = await holding(store, "k000", lambda snapshot: (newer, None))
    bare, leave_bare = await holding(store, "bare", lambda snapshot: (None, None))
    try:
        assert await store.read_saved("k000") == saved["k000"]
        assert await store.read_saved("bare") is None
        assert await store.read_saved("absent") is None
    finally:
        leave.set()
        leave_bare.set()
        await asyncio.gather(task, bare)
    assert await store.read_saved("k000") == newer


def test_copy_worker_id_names_this_process() -> None:
    import os

    assert copy_worker_id().startswith("touba-copy:")
    assert copy_worker_id().endswith(f":{os.getpid()}")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=6))
def test_the_digest_ignores_key_order_and_sees_any_change(value: dict[str, Any]) -> None:
    reordered = dict(reversed(list(value.items())))
    assert conversation_digest(reordered) == conversation_digest(value)
    changed = {**value, "\x00extra": 1}
    assert conversation_digest(changed) != conversation_digest(value)
