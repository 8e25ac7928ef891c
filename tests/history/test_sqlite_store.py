"""``SqliteHistoryStore`` on real files (SPEC section 6): layout, safety, reservations."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._sqlite import raw
from tests.history._clock import Clock
from tests.history._stores import WHO, holding
from tests.history._strategies import json_values
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStorageUnsafe,
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
from touba.history._store import LogSnapshot, LogWrite, StoreUsage
from touba.history.sqlite import SqliteHistoryStore

SUFFIXES = ("", "-wal", "-shm", "-journal")
HEAD = {"kind": "touba.decision_history", "version": 1, "identity": {"namespace": "ns"}}
posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
root_only = pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0, reason="needs root to chown"
)


@pytest.fixture
def db_path(private_dir: Path) -> Path:
    return private_dir / "history.sqlite"


def modes(db_path: Path) -> dict[str, int]:
    """Permission bits of the database and of those of its companions that exist."""
    out = {}
    for suffix in SUFFIXES:
        path = Path(f"{db_path}{suffix}")
        if path.exists():
            out[suffix] = stat.S_IMODE(path.lstat().st_mode)
    return out


def make_loose_companions(db_path: Path) -> None:
    for suffix in SUFFIXES:
        path = Path(f"{db_path}{suffix}")
        path.touch()
        path.chmod(0o644)


def saving(record: dict[str, Any] | None, result: Any = None) -> Any:
    async def operation(snapshot: dict[str, Any] | None) -> tuple[Any, Any]:
        return record, result

    return operation


async def failing(*_: Any) -> Any:
    raise RuntimeError("boom")


# -- file safety -------------------------------------------------------------------------


@posix_only
async def test_database_and_companions_are_created_0600(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        await store.transact("k", saving({"a": 1}))
        found = modes(db_path)
        assert {"", "-wal", "-shm"} <= set(found)
        assert set(found.values()) == {0o600}
        with raw(db_path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # Reopened: the empty journal made before opening stays, 0600 too.
    async with SqliteHistoryStore(db_path) as store:
        assert modes(db_path) == dict.fromkeys(SUFFIXES, 0o600)
        assert await store.read("k") == {"a": 1}


@posix_only
async def test_existing_files_are_reset_to_0600(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        await store.transact("k", saving({"a": 1}))
    make_loose_companions(db_path)
    async with SqliteHistoryStore(db_path) as store:
        assert modes(db_path) == dict.fromkeys(SUFFIXES, 0o600)
        assert await store.read("k") == {"a": 1}


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_symbolic_links_are_refused(private_dir: Path, suffix: str) -> None:
    target = private_dir / "target"
    target.write_bytes(b"")
    db_path = private_dir / "history.sqlite"
    Path(f"{db_path}{suffix}").symlink_to(target)
    before = sorted(os.listdir(private_dir))
    with pytest.raises(DecisionHistoryStorageUnsafe, match="symbolic link"):
        SqliteHistoryStore(db_path)
    assert sorted(os.listdir(private_dir)) == before
    assert target.read_bytes() == b""


@posix_only
@pytest.mark.parametrize(("suffix", "kind"), [("", "dir"), ("-wal", "fifo"), ("-shm", "dir")])
def test_non_regular_files_are_refused(private_dir: Path, suffix: str, kind: str) -> None:
    db_path = private_dir / "history.sqlite"
    path = Path(f"{db_path}{suffix}")
    if kind == "dir":
        path.mkdir()
    else:
        os.mkfifo(path, 0o600)
    before = sorted(os.listdir(private_dir))
    with pytest.raises(DecisionHistoryStorageUnsafe, match="not a regular file"):
        SqliteHistoryStore(db_path)
    assert sorted(os.listdir(private_dir)) == before


@posix_only
@pytest.mark.parametrize("dir_mode", [0o777, 0o775, 0o770, 0o1777])
def test_parent_writable_by_group_or_others_is_refused(tmp_path: Path, dir_mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(dir_mode)
    with pytest.raises(DecisionHistoryStorageUnsafe, match="writable by group or others"):
        SqliteHistoryStore(shared / "history.sqlite")
    assert os.listdir(shared) == []


@posix_only
def test_writable_ancestor_without_sticky_bit_is_refused(tmp_path: Path) -> None:
    ancestor = tmp_path / "open"
    ancestor.mkdir()
    ancestor.chmod(0o777)
    private = ancestor / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(DecisionHistoryStorageUnsafe, match="ancestor directory"):
        SqliteHistoryStore(private / "history.sqlite")
    assert os.listdir(private) == []


@pytest.fixture
def under_sticky_root_dir(tmp_path: Path) -> Path:
    """A private directory below a world-writable sticky directory of root, like /tmp.

    tmp_path already lies under /tmp; as root the fixture also makes its own.
    """
    if os.geteuid() == 0:
        sticky = tmp_path / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)
        tmp_path = sticky
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    return private / "history.sqlite"


@posix_only
async def test_sticky_root_owned_ancestor_is_accepted(under_sticky_root_dir: Path) -> None:
    async with SqliteHistoryStore(under_sticky_root_dir) as store:
        await store.transact("k", saving({"a": 1}))


@root_only
def test_directories_of_other_users_are_refused(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    os.chown(sticky, 12345, -1)  # sticky, but not root's
    private = sticky / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(DecisionHistoryStorageUnsafe, match="ancestor directory"):
        SqliteHistoryStore(private / "history.sqlite")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, -1)
    with pytest.raises(DecisionHistoryStorageUnsafe, match="belongs to another user"):
        SqliteHistoryStore(theirs / "history.sqlite")
    assert os.listdir(private) == []
    assert os.listdir(theirs) == []


def test_missing_directory_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not exist"):
        SqliteHistoryStore(tmp_path / "missing" / "history.sqlite")
    assert not (tmp_path / "missing").exists()


def test_file_that_is_not_a_database_is_refused_untouched(db_path: Path) -> None:
    db_path.write_bytes(b"not a database, " * 100)
    db_path.chmod(0o600)
    with pytest.raises(DecisionHistoryRecordInvalid, match="not a database"):
        SqliteHistoryStore(db_path)
    assert db_path.read_bytes() == b"not a database, " * 100


@pytest.fixture
def future_db(db_path: Path) -> Path:
    """A file as a newer touba would leave it: history schema version 3."""
    with raw(db_path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO touba_meta VALUES ('history_schema_version', '3')")
        conn.execute("CREATE TABLE touba_history_sessions (anything)")
    db_path.chmod(0o600)
    return db_path


def test_future_schema_version_is_refused_without_modification(future_db: Path) -> None:
    content = future_db.read_bytes()
    with pytest.raises(DecisionHistoryRecordInvalid, match="schema version '3'"):
        SqliteHistoryStore(future_db)
    assert future_db.read_bytes() == content
    with raw(future_db) as conn:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [
            ("touba_meta",),
            ("sqlite_autoindex_touba_meta_1",),
            ("touba_history_sessions",),
        ]


# -- construction and lifecycle ------------------------------------------------------------


def test_exactly_one_of_filename_or_database(db_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="exactly one"):
        SqliteHistoryStore()
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        with pytest.raises(ConfigurationError, match="exactly one"):
            SqliteHistoryStore(db_path, database=conn)
        with pytest.raises(ConfigurationError, match="max_sessions"):
            SqliteHistoryStore(database=conn, max_sessions=0)
    finally:
        conn.close()
    assert not db_path.exists()


async def test_database_connection_is_used_and_left_open() -> None:
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        async with SqliteHistoryStore(database=conn) as store:
            await store.transact("k", saving({"a": [1, 2]}))
            assert await store.read("k") == {"a": [1, 2]}
        assert conn.execute("SELECT COUNT(*) FROM touba_history_sessions").fetchone() == (1,)
    finally:
        conn.close()


def test_database_connection_bound_to_its_thread_is_refused() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        with pytest.raises(ConfigurationError, match="check_same_thread=False"):
            SqliteHistoryStore(database=conn)
    finally:
        conn.close()


async def test_use_after_close_is_refused(db_path: Path) -> None:
    store = SqliteHistoryStore(db_path)
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(ConfigurationError, match="closed"):
        await store.read("k")
    with pytest.raises(ConfigurationError, match="closed"):
        await store.transact("k", saving({}))


async def test_close_waits_for_a_running_operation(db_path: Path) -> None:
    store = SqliteHistoryStore(db_path)
    started = asyncio.Event()

    async def slow(snapshot: Any) -> tuple[Any, str]:
        started.set()
        await asyncio.sleep(0.05)
        return {"done": True}, "ok"

    task = asyncio.create_task(store.transact("k", slow))
    await started.wait()
    await store.close()
    assert await task == "ok"
    async with SqliteHistoryStore(db_path) as again:
        assert await again.read("k") == {"done": True}


# -- records ------------------------------------------------------------------------------

RECORDS: list[dict[str, Any]] = [
    {},
    {"a": 1, "b": [True, False, None], "c": {"d": 1.5, "e": "é€😀\u0000"}},
    {"kind": "touba.decision_history", "exchanges": [[{"m": 1}], [{"m": 2}, {"m": 3}]], "x": 1},
    {"kind": "touba.decision_history", "exchanges": [[]], "note": "not splittable: kept whole"},
    {"kind": "other", "exchanges": [[{"m": 1}]]},
    {"exchanges": "not a list", "big": 10**30, "neg": -0.0, "list": [[[]]]},
]


@pytest.mark.parametrize("record", RECORDS)
async def test_any_json_dict_round_trips(db_path: Path, record: dict[str, Any]) -> None:
    async with SqliteHistoryStore(db_path) as store:
        assert await store.transact("k", saving(record, "saved")) == "saved"
        read = await store.read("k")
        assert read == record
        assert read is not record
        seen: list[Any] = []

        async def again(snapshot: dict[str, Any] | None) -> tuple[Any, None]:
            seen.append(snapshot)
            assert snapshot is not None
            snapshot["mutated"] = True  # a private copy: not saved unless returned
            return record, None

        await store.transact("k", again)
        assert seen == [{**record, "mutated": True}]
        assert await store.read("k") == record


plain_records = st.dictionaries(
    st.text(max_size=6), json_values(keys=st.text(max_size=6), items=3, leaves=12), max_size=4
)
touba_records = st.builds(
    lambda extra, exchanges: {**extra, "kind": "touba.decision_history", "exchanges": exchanges},
    plain_records,
    st.lists(st.lists(plain_records, max_size=3), max_size=4),  # an empty exchange: kept whole
)


@settings(max_examples=40, deadline=None)
@given(records=st.lists(plain_records | touba_records, min_size=1, max_size=3))
async def test_json_dicts_round_trip_property(records: list[dict[str, Any]]) -> None:
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        async with SqliteHistoryStore(database=conn) as store:
            for record in records:  # each save replaces the previous record whole
                await store.transact("k", saving(record))
                assert await store.read("k") == record
    finally:
        conn.close()


async def test_snapshot_and_read_are_detached_copies(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        await store.transact("k", saving({"a": [1]}))
        first = await store.read("k")
        assert first is not None
        first["a"].append(2)
        assert await store.read("k") == {"a": [1]}


async def test_returning_none_deletes_and_delete_reports(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        await store.transact("k", saving({"a": 1}))
        await store.transact("k", saving(None))
        assert await store.read("k") is None
        assert await store.delete("k") is False
        await store.transact("k", saving({"a": 1}))
        assert await store.delete("k") is True
        assert await store.read("k") is None
        assert await store.list() == []


async def test_transact_log_appends_rows_without_rewriting(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:

        async def first(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, str]:
            assert snapshot is None
            append = [(0, {"m": 0}), (0, {"m": 1}), (1, {"m": 2})]
            return LogWrite(head=dict(HEAD), append=append), "one"

        assert await store.transact_log("k", first) == "one"
        with raw(db_path) as conn:
            before = conn.execute("SELECT id, body FROM touba_history_messages").fetchall()

        async def second(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, str]:
            assert snapshot is not None
            assert snapshot.head == HEAD
            assert snapshot.exchange_count == 2
            sizes = await snapshot.sizes(0)
            assert [(s.messages, s.bytes) for s in sizes] == [(2, 14), (1, 7)]
            assert [s.messages for s in await snapshot.sizes(1)] == [1]
            assert await snapshot.exchanges(1, 2) == [[{"m": 2}]]
            head = {**snapshot.head, "n": 2}
            return LogWrite(head=head, append=[(1, {"m": 3}), (2, {"m": 4})]), "two"

        assert await store.transact_log("k", second) == "two"
        with raw(db_path) as conn:
            after = conn.execute("SELECT id, body FROM touba_history_messages").fetchall()
        assert after[: len(before)] == before
        assert len(after) == len(before) + 2
        assert await store.read("k") == {
            **HEAD,
            "n": 2,
            "exchanges": [[{"m": 0}, {"m": 1}], [{"m": 2}, {"m": 3}], [{"m": 4}]],
        }
        [row] = await store.list("ns")
        assert (row.messages, row.identity, row.active) == (5, {"namespace": "ns"}, False)

        async def rewrite(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, None]:
            return LogWrite(head=dict(HEAD), append=[(0, {"m": "rewrite"})]), None

        with pytest.raises(ValueError, match="append to exchange 0 refused"):
            await store.transact_log("k", rewrite)
        assert (await store.read("k") or {})["n"] == 2


async def test_sizes_match_the_memory_store_through_the_history_engine(db_path: Path) -> None:
    identity = ConversationIdentity("ns", "fake", "m", "native", "run", "inv", "agent")
    call = CapabilityCall("c1", "lookup", {"id": 1})
    observation = Observation("c1", "lookup", {"id": 1}, "ok", result={"v": "x" * 40})
    windows: dict[str, list[int]] = {}

    async def run(store: Any, name: str) -> dict[str, Any]:
        history = DecisionHistory(HistoryConfig(store=store, namespace="ns", max_messages=3))

        async def decide(window: HistoryWindow) -> DecisionMessage:
            windows.setdefault(name, []).append(len(window.messages))
            return DecisionMessage(text="t", calls=(call,))

        await history.step(identity, (), decide)
        for _ in range(3):
            await history.step(identity, (observation,), decide)
        record = await store.read(identity.key)
        [row] = await store.list("ns")
        return {"record": record, "messages": row.messages, "bytes": row.bytes}

    memory = await run(MemoryHistoryStore(), "memory")
    async with SqliteHistoryStore(db_path) as store:
        sqlite = await run(store, "sqlite")
    for result in (memory, sqlite):
        for field in ("created_at", "updated_at"):
            result["record"].pop(field)
        for point in result["record"]["plot"]["points"]:
            point[1] = 0  # the wall-clock second of the decision: the runs may straddle one
    assert sqlite == memory
    assert windows["sqlite"] == windows["memory"] == [0, 2, 2, 2]  # trimmed


async def test_corrupt_rows_raise_and_are_kept(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        await store.transact("whole", saving({"a": 1}))
        await store.transact("split", saving({**HEAD, "exchanges": [[{"m": 1}]]}))
        with raw(db_path) as conn:
            conn.execute("UPDATE touba_history_sessions SET head = '{oops' WHERE key = 'whole'")
            conn.execute(
                "UPDATE touba_history_messages SET body = '[1]' WHERE conv = "
                "(SELECT id FROM touba_history_sessions WHERE key = 'split')"
            )
        for key in ("whole", "split"):
            with pytest.raises(DecisionHistoryRecordInvalid, match="not modified"):
                await store.read(key)
            with pytest.raises(DecisionHistoryRecordInvalid):
                await store.transact(key, saving({"overwritten": True}))

        async def tail(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, None]:
            assert snapshot is not None
            await snapshot.exchanges(0, 1)
            raise AssertionError("unreachable")

        with pytest.raises(DecisionHistoryRecordInvalid):
            await store.transact_log("split", tail)
        assert [row.active for row in await store.list()] == [False, False]
        with raw(db_path) as conn:
            assert conn.execute(
                "SELECT head FROM touba_history_sessions WHERE key = 'whole'"
            ).fetchone() == ("{oops",)
        assert await store.delete("whole") is True


# -- exclusion, failures, capacity ----------------------------------------------------------


async def test_exception_keeps_old_state_and_frees_the_key(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        await store.transact("k", saving({"v": 1}))
        with pytest.raises(RuntimeError, match="boom"):
            await store.transact("k", failing)
        with pytest.raises(RuntimeError, match="boom"):
            await store.transact_log("k", failing)
        with pytest.raises(RuntimeError, match="boom"):
            await store.transact("new", failing)
        assert await store.read("k") == {"v": 1}
        assert [row.key for row in await store.list()] == ["k"]  # no row left for "new"
        await store.transact("k", saving({"v": 2}))
        assert await store.read("k") == {"v": 2}


async def test_cancelled_operation_frees_the_key(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        await store.transact("k", saving({"v": 1}))
        started = asyncio.Event()

        async def forever(*_: Any) -> Any:
            started.set()
            await asyncio.sleep(3600)

        task = asyncio.create_task(store.transact("k", forever))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await store.read("k") == {"v": 1}


async def test_busy_between_two_stores_on_one_file(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as one, SqliteHistoryStore(db_path) as two:
        await one.transact("k", saving({"v": 1}))
        task, leave = await holding(one, "k", lambda snapshot: ({"v": 2}, None))
        for attempt in (
            two.transact("k", saving({"v": 3})),
            two.transact_log("k", failing),
            two.read("k"),
            two.delete("k"),
            one.read("k"),
        ):
            with pytest.raises(DecisionHistoryBusy) as caught:
                await attempt
            assert caught.value.session_key == "k"
        leave.set()
        await task
        assert await two.read("k") == {"v": 2}


async def test_save_after_recovery_meanwhile_is_refused(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as one, SqliteHistoryStore(db_path) as two:
        await one.transact("k", saving({"v": 1}))

        async def overtaken(snapshot: Any) -> tuple[Any, None]:
            assert await two.recover("k", worker_stopped=True) is True
            return {"v": 2}, None

        with pytest.raises(DecisionHistoryBusy, match="recovered"):
            await one.transact("k", overtaken)
        assert await two.read("k") == {"v": 1}


async def test_max_sessions_counts_reservations_of_new_keys(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path, max_sessions=1) as store:
        task, leave = await holding(store, "first", lambda snapshot: ({"first": True}, None))
        [held] = await store.list()
        assert (held.key, held.active, held.messages) == ("first", True, 0)
        ran: list[str] = []

        async def never(snapshot: Any) -> tuple[Any, None]:
            ran.append("late")
            return {"late": True}, None

        with pytest.raises(DecisionHistoryLimitExceeded) as caught:
            await store.transact("late", never)  # "first" holds the only place
        assert caught.value.limit == "max_sessions"
        assert ran == []
        leave.set()
        await task
        assert [row.key for row in await store.list()] == ["first"]
        assert await store.read("late") is None
        assert await store.read("first") == {"first": True}
        await store.transact("first", saving({"v": 2}))  # replacing is not a new session
        with pytest.raises(DecisionHistoryLimitExceeded):
            await store.transact("late", never)
        assert ran == []


async def test_max_store_bytes_refuses_atomically(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path, max_store_bytes=200) as store:
        await store.transact("k", saving({"v": "x" * 50}))
        with pytest.raises(DecisionHistoryLimitExceeded) as caught:
            await store.transact("k", saving({"v": "x" * 300}))
        assert caught.value.limit == "max_store_bytes"

        async def grow(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, None]:
            return LogWrite(head=dict(HEAD), append=[(0, {"m": "y" * 300})]), None

        with pytest.raises(DecisionHistoryLimitExceeded):
            await store.transact_log("other", grow)
        assert await store.read("k") == {"v": "x" * 50}
        assert [(row.key, row.bytes) for row in await store.list()] == [("k", 58)]
        await store.transact("k", saving({"v": "fits"}))


async def test_ttl_purges_on_access_and_read_does_not_renew(db_path: Path) -> None:
    clock = Clock()
    async with SqliteHistoryStore(db_path, ttl_seconds=10, clock=clock) as store:
        await store.transact("a", saving({"v": 1}))
        await store.transact("b", saving({"v": 2}))
        clock.now += 6
        assert await store.read("a") == {"v": 1}  # read at t+6 does not renew
        await store.transact("b", saving({"v": 3}))  # a save does: b expires at t+16
        [row] = [r for r in await store.list() if r.key == "a"]
        assert row.expires_at is not None
        assert row.expires_at.endswith("+00:00")
        clock.now += 5
        assert await store.read("a") is None
        assert [r.key for r in await store.list()] == ["b"]
        with raw(db_path) as conn:
            assert conn.execute("SELECT key FROM touba_history_sessions").fetchall() == [("b",)]

        task, leave = await holding(store, "b", lambda snapshot: (snapshot, None))
        clock.now += 100
        assert await store.purge_expired() == 0  # a reserved key is never purged
        leave.set()
        await task
        assert await store.read("b") == {"v": 3}  # saved again, with a fresh expiry
        clock.now += 11
        assert await store.purge_expired() == 1
        assert await store.list() == []


# -- across processes ------------------------------------------------------------------------

CHILD = """
import asyncio, sys
from touba.history.sqlite import SqliteHistoryStore

async def main(path, key, mode):
    store = SqliteHistoryStore(path, worker_id="child-worker")

    async def save(snapshot):
        return {"saved": "first"}, None

    async def hold(snapshot):
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        return {"saved": "second"}, None

    if mode == "crash":
        await store.transact(key, save)
    await store.transact(key, hold)
    await store.close()

asyncio.run(main(*sys.argv[1:]))
"""


async def spawn(db_path: Path, mode: str) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(db_path),
        "k",
        mode,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
    assert line == b"ready\n"
    return process


async def test_busy_across_processes_is_immediate(db_path: Path) -> None:
    process = await spawn(db_path, "hold")
    try:
        async with SqliteHistoryStore(db_path) as store:
            started = time.monotonic()
            with pytest.raises(DecisionHistoryBusy):
                await store.transact("k", saving({"parent": True}))
            assert time.monotonic() - started < 1.0  # refused, not waited for
            await process.communicate(b"go\n")
            assert process.returncode == 0
            assert await store.read("k") == {"saved": "second"}
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@posix_only
@pytest.mark.parametrize("mode", ["crash", "crash-new-key"])
async def test_reservation_survives_a_killed_worker_until_recover(db_path: Path, mode: str) -> None:
    """A worker saves a record (or not, on a new key), then is killed inside the next one."""
    process = await spawn(db_path, mode)
    process.send_signal(signal.SIGKILL)
    await process.wait()
    assert process.returncode == -signal.SIGKILL
    async with SqliteHistoryStore(db_path) as store:
        with pytest.raises(DecisionHistoryBusy, match="recover"):
            await store.read("k")
        with pytest.raises(DecisionHistoryBusy):
            await store.transact("k", saving({"parent": True}))
        with pytest.raises(DecisionHistoryBusy):
            await store.delete("k")
        [row] = await store.list()
        assert row.active is True
        assert row.reservation is not None
        assert row.reservation["pid"] == process.pid
        assert row.reservation["host"] == socket.gethostname()
        assert row.reservation["worker_id"] == "child-worker"
        with pytest.raises(ConfigurationError, match="worker_stopped=True"):
            await store.recover("k", worker_stopped=False)
        assert await store.recover("k", worker_stopped=True) is True
        assert await store.recover("k", worker_stopped=True) is False
        if mode == "crash":
            assert await store.read("k") == {"saved": "first"}
            [row] = await store.list()
            assert (row.active, row.reservation) == (False, None)
        else:  # the bare reservation is gone with its row
            assert await store.read("k") is None
            assert await store.list() == []


# -- reading ahead -----------------------------------------------------------------------


async def test_two_stores_on_one_file_alternating_decisions_see_each_others_saves(
    db_path: Path,
) -> None:
    seen: list[list[str | None]] = []
    async with SqliteHistoryStore(db_path) as one, SqliteHistoryStore(db_path) as two:
        histories = [
            DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=6))
            for store in (one, two)
        ]
        observations: list[Observation] = []
        for step in range(12):

            async def generate(window: HistoryWindow, step: int = step) -> DecisionMessage:
                seen.append([m.text for m in window.messages if isinstance(m, DecisionMessage)])
                call = CapabilityCall(f"c{step}", "f", {})
                return DecisionMessage(text=f"d{step}", calls=(call,))

            await histories[step % 2].step(WHO, observations, generate)
            observations = [Observation(f"c{step}", "f", {}, "ok", {"r": step})]
    # Each window holds the decisions of both stores, up to the one just before.
    for step, texts in enumerate(seen):
        assert texts == [f"d{n}" for n in range(max(0, step - 3), step)]


async def test_a_decision_costs_two_hops_to_the_store_thread(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=6))
        hops = 0
        original = store._run

        async def counted(key: str, job: Any) -> Any:  # counts hops; runs the real job
            nonlocal hops
            hops += 1
            return await original(key, job)

        store._run = counted  # type: ignore[method-assign]
        observations: list[Observation] = []
        for step in range(8):

            async def generate(window: HistoryWindow, step: int = step) -> DecisionMessage:
                return DecisionMessage(calls=(CapabilityCall(f"c{step}", "f", {}),))

            hops = 0
            await history.step(WHO, observations, generate)
            observations = [Observation(f"c{step}", "f", {}, "ok", {"r": step})]
            if step >= 2:  # once the store has seen how much of the tail is read
                assert hops == 2, step
