"""What only the Redis backend of ToubaSaver has: scripts run by concurrent clients, key
prefixes, connections cut mid-put, a client killed mid-put, values damaged in Redis.

The contract every store keeps is test_backend.py's; here the real server is driven by
several clients at once, through a relay that loses commands or replies, and by a child
process killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests._services import redis_url
from tests._tcp_cut import tcp_cut
from tests.history.test_redis_cluster import (
    _cli,
    _free_ports,
    cluster,  # noqa: F401 (a fixture: 3 masters)
)
from tests.integrations.langgraph._crash_worker import (
    check_and_put_after,
    check_reopened,
    kill_while_putting,
)
from tests.integrations.langgraph.test_saver import Thread, message
from tests.peers import langgraph_savers
from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._lua import load
from touba.integrations.langgraph import ToubaSaver
from touba.integrations.langgraph._backend import (
    CheckpointPage,
    ListQuery,
    LogAppend,
    LogKey,
    PutCheckpoint,
    Span,
    TypedBlob,
    WriteRecord,
    span_length,
)
from touba.integrations.langgraph._redis import RedisSaverBackend

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = sorted(
    p.stem
    for p in (ROOT / "src/touba/integrations/langgraph/lua").glob("*.lua")
    if p.stem[0] != "_"
)


@pytest.fixture
def url() -> str:
    return redis_url()


@pytest.fixture
def prefix(url: str) -> Iterator[str]:
    prefix = f"touba-test-lg-redis:{uuid.uuid4().hex[:12]}:"
    yield prefix
    _delete_keys(url, prefix)


def _delete_keys(url: str, prefix: str) -> None:
    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)


def _keys(url: str, prefix: str) -> list[str]:
    with redis.Redis.from_url(url) as client:
        return sorted(k.decode() for k in client.scan_iter(match=prefix + "*", count=1000))


@pytest.fixture
async def backend(url: str, prefix: str) -> AsyncIterator[RedisSaverBackend]:
    b = RedisSaverBackend(url, prefix=prefix)
    yield b
    await b.close()


def blob(text: str) -> TypedBlob:
    return ("json", text.encode())


def request(
    checkpoint_id: str,
    *,
    thread_id: str = "t",
    parent_id: str | None = None,
    base: tuple[Span, ...] = (),
    texts: tuple[str, ...] = (),
    run_id: str | None = None,
) -> PutCheckpoint:
    meta = {"step": 1, **({"run_id": run_id} if run_id else {})}
    return PutCheckpoint(
        thread_id=thread_id,
        checkpoint_ns="",
        checkpoint_id=checkpoint_id,
        parent_id=parent_id,
        checkpoint=blob(checkpoint_id),
        metadata=blob(json.dumps(meta)),
        metadata_json=json.dumps(meta),
        run_id=run_id,
        versions={},
        blobs=(),
        logs=(LogAppend("messages", base, tuple(blob(t) for t in texts)),),
    )


def texts_of(page: CheckpointPage, index: int = 0) -> list[str]:
    """Row ``index``'s messages; KeyError when the page lacks an entry its spans name."""
    record = page.rows[index].record
    entries = page.logs[LogKey(record.thread_id, record.checkpoint_ns, "messages")].entries
    return [entries[p][1].decode() for s in record.logs["messages"] for p in range(s.start, s.end)]


def assert_whole(page: CheckpointPage) -> None:
    """Every row's spans are present in full among the page's entries."""
    for i, row in enumerate(page.rows):
        assert len(texts_of(page, i)) == span_length(row.record.logs["messages"])


# --- the scripts ---------------------------------------------------------------------


async def test_the_server_answers_the_digest_touba_computes_for_each_script(url: str) -> None:
    assert SCRIPTS == [
        "delete",
        "export",
        "import",
        "prune",
        "put",
        "read",
        "retire",
        "runs",
        "writes",
    ]
    client = Redis.from_url(url)
    try:
        for name in SCRIPTS:
            script = load(name, "touba.integrations.langgraph")
            assert "--@include" not in script.text
            assert await client.script_load(script.source) == script.sha, name
    finally:
        await client.aclose()


def test_the_prefix_is_checked_at_construction(url: str) -> None:
    for bad in ("", "a{b", "a}b", 3):
        with pytest.raises(ConfigurationError, match="prefix"):
            RedisSaverBackend(url, prefix=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="url must be a str"):
        RedisSaverBackend(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="Redis url"):
        RedisSaverBackend("nothing://here")


async def test_a_closed_backend_refuses_calls(url: str, prefix: str) -> None:
    b = RedisSaverBackend(url, prefix=prefix)
    await b.close()
    with pytest.raises(ConfigurationError, match="closed"):
        await b.get("t", "", None, {})


# --- appends only, and what key names show -------------------------------------------


async def test_a_put_writes_only_its_new_entries_and_key_names_hide_the_thread(
    backend: RedisSaverBackend, url: str, prefix: str
) -> None:
    thread = "user-secret-42"
    first = await backend.put(request("0001", thread_id=thread, texts=("a", "b")))
    keys = _keys(url, prefix)
    assert keys
    assert all(thread not in k for k in keys)
    digest = hashlib.sha256(thread.encode()).hexdigest()
    [log_key] = [k for k in keys if k.startswith(f"{prefix}{{{digest}}}:") and ":L:" in k]
    # an entry already written is never written again: a marker put in its place stays
    with redis.Redis.from_url(url) as client:
        client.hset(log_key, "0", b"4:jsonMARK")
    second = await backend.put(
        request(
            "0002", thread_id=thread, parent_id="0001", base=first.spans["messages"], texts=("c",)
        )
    )
    page = await backend.get(thread, "", None, {})
    assert texts_of(page) == ["MARK", "b", "c"]
    assert second.spans["messages"] == (Span(0, 3),)


async def test_prefixes_isolate_savers_on_one_server(url: str, prefix: str) -> None:
    other_prefix = prefix + "other:"
    one = RedisSaverBackend(url, prefix=prefix)
    two = RedisSaverBackend(url, prefix=other_prefix)
    try:
        await one.put(request("0001", texts=("one",), run_id="r"))
        await two.put(request("0002", texts=("two",), run_id="r"))
        await one.put_writes("t", "", "0001", [WriteRecord("task", 0, "x", blob("w1"))])
        assert texts_of(await one.get("t", "", None, {})) == ["one"]
        assert texts_of(await two.get("t", "", None, {})) == ["two"]
        assert [r.record.checkpoint_id for r in (await two.list(ListQuery(), {})).rows] == ["0002"]
        assert (await two.get("t", "", None, {})).rows[0].writes == ()

        await one.delete_for_runs(["r"])
        assert (await one.list(ListQuery(), {})).rows == ()
        assert texts_of(await two.get("t", "", None, {})) == ["two"]
        await one.put(request("0003", texts=("again",)))
        await one.delete_thread("t")
        await one.prune(["t"], "delete")
        assert texts_of(await two.get("t", "", None, {})) == ["two"]
        assert all(k.startswith(other_prefix) for k in _keys(url, other_prefix))
    finally:
        await one.close()
        await two.close()
        _delete_keys(url, other_prefix)


async def test_the_store_wide_indexes_follow_threads_and_runs(
    backend: RedisSaverBackend, url: str, prefix: str
) -> None:
    """A thread is indexed by its first put (even after pending writes alone made it), a
    run by its first put on each thread, again after a delete removed them; a delete
    leaves no index entry behind."""

    async def listed() -> list[str]:
        return [r.record.checkpoint_id for r in (await backend.list(ListQuery(), {})).rows]

    await backend.put_writes("a", "", "0001", [WriteRecord("task", 0, "x", blob("w"))])
    await backend.put(request("0001", thread_id="a", run_id="r1"))
    await backend.put(request("0002", thread_id="b", run_id="r1"))
    assert await listed() == ["0002", "0001"]
    await backend.delete_for_runs(["r1"])
    assert await listed() == []
    await backend.put(request("0003", thread_id="a", run_id="r1"))  # r1 anew on thread a
    await backend.put(request("0004", thread_id="a", run_id="r2"))
    await backend.delete_for_runs(["r1"])
    assert await listed() == ["0004"]
    await backend.delete_thread("a")
    await backend.put(request("0005", thread_id="a"))  # a anew
    assert await listed() == ["0005"]
    await backend.prune(["a", "b"], "delete")
    assert await listed() == []
    with redis.Redis.from_url(url) as client:
        assert [k for k in _keys(url, prefix) if client.type(k) != b"none"] == []


# --- concurrent clients --------------------------------------------------------------


async def test_concurrent_forks_from_many_clients_each_get_their_own_positions(
    url: str, prefix: str
) -> None:
    clients = [RedisSaverBackend(url, prefix=prefix) for _ in range(6)]
    try:
        root = await clients[0].put(request("0000", texts=("root0", "root1")))
        base = root.spans["messages"]

        async def fork(c: int, n: int) -> tuple[str, tuple[Span, ...]]:
            checkpoint_id = f"1{c}{n:03d}"
            texts = tuple(f"{c}.{n}.{i}" for i in range(3))
            result = await clients[c].put(
                request(checkpoint_id, parent_id="0000", base=base, texts=texts)
            )
            return checkpoint_id, result.spans["messages"]

        done = await asyncio.gather(*(fork(c, n) for c in range(6) for n in range(8)))
        # each fork's own items (past the shared root; the first one's span joins it)
        positions = [p for _, spans in done for s in spans for p in range(s.start, s.end) if p > 1]
        assert sorted(positions) == list(range(2, 2 + 6 * 8 * 3))  # no position twice
        for checkpoint_id, spans in done:
            page = await clients[1].get("t", "", checkpoint_id, {})
            who, n = int(checkpoint_id[1]), int(checkpoint_id[2:])
            assert page.rows[0].record.logs["messages"] == spans
            assert texts_of(page) == ["root0", "root1", *(f"{who}.{n}.{i}" for i in range(3))]
            assert page.logs[LogKey("t", "", "messages")].state.length == 2 + 6 * 8 * 3  # type: ignore[union-attr]
    finally:
        for client in clients:
            await client.close()


async def test_a_reader_never_sees_half_a_put_or_half_a_copy(url: str, prefix: str) -> None:
    writer, reader, copier = (RedisSaverBackend(url, prefix=prefix) for _ in range(3))
    stop = asyncio.Event()
    seen: list[int] = []
    copies = 0
    try:

        async def write() -> None:
            spans: tuple[Span, ...] = ()
            parent = None
            for n in range(40):
                checkpoint_id = f"{n:04d}"
                texts = tuple(f"{n}.{i}" for i in range(25))
                result = await writer.put(
                    request(checkpoint_id, parent_id=parent, base=spans, texts=texts)
                )
                spans, parent = result.spans["messages"], checkpoint_id
            stop.set()

        async def read() -> None:
            while not stop.is_set():
                page = await reader.get("t", "", None, {})
                if page.rows:
                    n = int(page.rows[0].record.checkpoint_id)
                    assert texts_of(page) == [f"{m}.{i}" for m in range(n + 1) for i in range(25)]
                    seen.append(n)
                await asyncio.sleep(0)

        async def copy() -> None:
            nonlocal copies
            while not stop.is_set():
                target = f"copy-{copies}"
                await copier.copy_thread("t", target)
                page = await reader.list(ListQuery(thread_id=target), {})
                assert_whole(page)
                if page.rows:  # the copy is one state of the source: ids 0 .. newest
                    newest = int(page.rows[0].record.checkpoint_id)
                    assert [int(r.record.checkpoint_id) for r in page.rows] == list(
                        range(newest, -1, -1)
                    )
                copies += 1
                await asyncio.sleep(0)

        await asyncio.gather(write(), read(), copy())
        assert seen
        assert copies
        assert_whole(await reader.list(ListQuery(), {}))
    finally:
        for b in (writer, reader, copier):
            await b.close()


async def test_puts_racing_deletes_and_prunes_never_leave_a_row_half_there(
    url: str, prefix: str
) -> None:
    """A put whose base was deleted with its thread is refused (its log is shorter now),
    so no row ever names entries that are gone; whatever interleaving ran, every row
    read afterwards is whole."""
    writer, other = RedisSaverBackend(url, prefix=prefix), RedisSaverBackend(url, prefix=prefix)
    try:

        async def write(thread: str) -> None:
            spans: tuple[Span, ...] = ()
            parent = None
            for n in range(30):
                try:
                    result = await writer.put(
                        request(
                            f"{n:04d}",
                            thread_id=thread,
                            parent_id=parent,
                            base=spans,
                            texts=(f"{n}a", f"{n}b"),
                            run_id=f"run-{n % 3}",
                        )
                    )
                except DecisionHistoryRecordInvalid:
                    spans, parent = (), None  # start over, as a new thread would
                    continue
                spans, parent = result.spans["messages"], f"{n:04d}"

        async def disturb() -> None:
            for n in range(30):
                if n % 3 == 0:
                    await other.delete_thread("a")
                elif n % 3 == 1:
                    await other.prune(["b"], "keep_latest")
                else:
                    await other.delete_for_runs(["run-1"])
                await asyncio.sleep(0)

        await asyncio.gather(write("a"), write("b"), disturb())
        for thread in ("a", "b"):
            assert_whole(await other.list(ListQuery(thread_id=thread), {}))
            assert_whole(await other.get(thread, "", None, {}))
    finally:
        await writer.close()
        await other.close()


async def test_concurrent_writes_of_one_task_keep_one_value_each_whole(
    url: str, prefix: str
) -> None:
    """Eight clients write the same (task, idx) keys at once, each its own values: a
    regular write keeps the first that landed, for every key of the batch alike (a batch
    is one script), and the checkpoint's writes are always one client's batch."""
    clients = [RedisSaverBackend(url, prefix=prefix) for _ in range(8)]
    try:
        await clients[0].put(request("0001"))

        async def write(c: int) -> None:
            batch = [WriteRecord("task", i, f"ch{i}", blob(f"{c}")) for i in range(5)]
            await clients[c].put_writes("t", "", "0001", batch)

        await asyncio.gather(*(write(c) for c in range(8)))
        writes = (await clients[0].get("t", "", None, {})).rows[0].writes
        assert [w.idx for w in writes] == [0, 1, 2, 3, 4]
        assert len({w.value for w in writes}) == 1  # one client's whole batch
    finally:
        for client in clients:
            await client.close()


async def test_the_latest_checkpoint_stays_whole_while_prunes_run(url: str, prefix: str) -> None:
    writer, pruner, reader = (RedisSaverBackend(url, prefix=prefix) for _ in range(3))
    stop = asyncio.Event()
    reads = 0
    try:

        async def write() -> None:
            spans: tuple[Span, ...] = ()
            parent = None
            for n in range(40):
                result = await writer.put(
                    request(f"{n:04d}", parent_id=parent, base=spans, texts=(f"{n}",))
                )
                spans, parent = result.spans["messages"], f"{n:04d}"
            stop.set()

        async def prune() -> None:
            while not stop.is_set():
                await pruner.prune(["t"], "keep_latest")
                await asyncio.sleep(0)

        async def read() -> None:
            nonlocal reads
            while not stop.is_set():
                page = await reader.get("t", "", None, {})
                if page.rows:
                    n = int(page.rows[0].record.checkpoint_id)
                    assert texts_of(page) == [f"{m}" for m in range(n + 1)]
                    reads += 1
                await asyncio.sleep(0)

        await asyncio.gather(write(), prune(), read())
        assert reads
        await pruner.prune(["t"], "keep_latest")
        page = await reader.list(ListQuery(thread_id="t"), {})
        assert [r.record.checkpoint_id for r in page.rows] == ["0039"]
        assert texts_of(page) == [f"{m}" for m in range(40)]
    finally:
        for b in (writer, pruner, reader):
            await b.close()


# --- connections cut mid-put ---------------------------------------------------------


def _relayed(url: str, port: int, query: str = "") -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"127.0.0.1:{port}", query=query).geturl()


@pytest.mark.parametrize("lost", ["command", "reply"])
async def test_a_put_whose_connection_is_cut_goes_through_once(
    url: str, prefix: str, lost: str
) -> None:
    """The command lost before the server saw it, or its reply lost after the script ran:
    the client sends it again on a new connection and the put lands exactly once (a
    second run of the same put finds its token and appends nothing)."""
    parts = urlsplit(url)
    async with tcp_cut(parts.hostname or "127.0.0.1", parts.port or 6379) as relay:
        backend = RedisSaverBackend(_relayed(url, relay.port), prefix=prefix)
        try:
            first = await backend.put(request("0001", texts=("a", "b")))
            relay.arm(lost)
            second = await backend.put(
                request("0002", parent_id="0001", base=first.spans["messages"], texts=("c", "d"))
            )
            assert relay.cuts == 1
            assert second.spans["messages"] == (Span(0, 4),)
            assert second.logs["messages"].length == 4
            page = await backend.get("t", "", None, {})
            assert texts_of(page) == ["a", "b", "c", "d"]
            assert page.logs[LogKey("t", "", "messages")].state.length == 4  # type: ignore[union-attr]
        finally:
            await backend.close()


async def test_a_connection_cut_past_the_retries_is_a_retryable_error_and_stores_nothing(
    url: str, prefix: str
) -> None:
    parts = urlsplit(url)
    async with tcp_cut(parts.hostname or "127.0.0.1", parts.port or 6379) as relay:
        backend = RedisSaverBackend(_relayed(url, relay.port), prefix=prefix)
        try:
            first = await backend.put(request("0001", texts=("a",)))
            relay.arm("command", times=3)  # the first send and both retries
            with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
                await backend.put(
                    request("0002", parent_id="0001", base=first.spans["messages"], texts=("b",))
                )
            assert caught.value.retryable
            assert isinstance(caught.value.__cause__, RedisConnectionError)
            assert relay.cuts == 3
            page = await backend.get("t", "", None, {})
            assert [r.record.checkpoint_id for r in page.rows] == ["0001"]
            assert page.logs[LogKey("t", "", "messages")].state.length == 1  # type: ignore[union-attr]
            again = await backend.put(
                request("0002", parent_id="0001", base=first.spans["messages"], texts=("b",))
            )
            assert again.spans["messages"] == (Span(0, 2),)
        finally:
            await backend.close()


async def test_a_server_that_stops_answering_is_a_retryable_timeout(url: str, prefix: str) -> None:
    parts = urlsplit(url)
    async with tcp_cut(parts.hostname or "127.0.0.1", parts.port or 6379) as relay:
        backend = RedisSaverBackend(_relayed(url, relay.port, "socket_timeout=0.2"), prefix=prefix)
        try:
            await backend.put(request("0001", texts=("a",)))
            relay.arm("swallow", times=1)
            with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
                await backend.get("t", "", None, {})
            assert caught.value.retryable
            assert isinstance(caught.value.__cause__, RedisTimeoutError)
            relay.arm("", 0)
            assert texts_of(await backend.get("t", "", None, {})) == ["a"]
        finally:
            await backend.close()


# --- a client killed mid-put ---------------------------------------------------------

CHILD = """
import asyncio, json, sys
from touba.integrations.langgraph._backend import LogAppend, PutCheckpoint
from touba.integrations.langgraph._redis import RedisSaverBackend

async def main(url, prefix):
    backend = RedisSaverBackend(url, prefix=prefix)
    spans, parent = (), None
    for n in range(100000):
        cid = f"{n:06d}"
        items = tuple(("json", f"{n}.{i}".encode() + b" " * 2000) for i in range(40))
        result = await backend.put(PutCheckpoint(
            thread_id="t", checkpoint_ns="", checkpoint_id=cid, parent_id=parent,
            checkpoint=("json", b"{}"), metadata=("json", b"{}"), metadata_json="{}",
            run_id=None, versions={}, blobs=(), logs=(LogAppend("messages", spans, items),),
        ))
        spans, parent = result.spans["messages"], cid
        if n == 2:
            print("putting", flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("after", [0.05, 0.3])
async def test_a_client_killed_mid_put_leaves_every_put_whole_or_absent(
    backend: RedisSaverBackend, url: str, prefix: str, after: float
) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, url, prefix, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), timeout=30)
        assert line == b"putting\n"
        await asyncio.sleep(after)
    finally:
        child.send_signal(signal.SIGKILL)
        await child.communicate()
    assert child.returncode == -signal.SIGKILL

    page = await backend.list(ListQuery(thread_id="t"), {})
    ids = [int(r.record.checkpoint_id) for r in page.rows]
    newest = ids[0]
    assert ids == list(range(newest, -1, -1))
    for row, n in zip(page.rows, ids, strict=True):
        assert row.record.logs["messages"] == (Span(0, 40 * (n + 1)),)
    assert [t.split(" ")[0] for t in texts_of(page)] == [
        f"{m}.{i}" for m in range(newest + 1) for i in range(40)
    ]
    # nothing of a put that did not land: the log ends where the newest put's items end
    state = page.logs[LogKey("t", "", "messages")].state
    assert state is not None
    assert state.length == 40 * (newest + 1)
    # and the thread takes the next put
    spans = page.rows[0].record.logs["messages"]
    nxt = await backend.put(
        request("999999", parent_id=f"{newest:06d}", base=spans, texts=("after",))
    )
    assert nxt.spans["messages"] == (Span(0, 40 * (newest + 1) + 1),)


@pytest.mark.parametrize("after", [0.0, 0.2])
async def test_kill_9_during_toubasaver_aput_on_redis_leaves_each_checkpoint_whole_or_absent(
    url: str, prefix: str, after: float
) -> None:
    kill_while_putting(after, "redis", url, prefix)
    async with ToubaSaver.redis(url, prefix=prefix) as saver:
        config, newest = await check_and_put_after(saver)
    async with ToubaSaver.redis(url, prefix=prefix) as fresh:
        await check_reopened(fresh, config, newest)


# --- values damaged in Redis ---------------------------------------------------------


async def test_a_damaged_entry_or_spans_field_is_record_invalid(
    backend: RedisSaverBackend, url: str, prefix: str
) -> None:
    await backend.put(request("0001", texts=("a",)))
    await backend.put_writes("t", "", "0001", [WriteRecord("task", 0, "x", blob("w"))])
    keys = _keys(url, prefix)
    [log_key] = [k for k in keys if ":L:" in k]
    [cp_key] = [k for k in keys if ":c:0001" in k]
    [writes_key] = [k for k in keys if ":w:0001" in k]
    with redis.Redis.from_url(url) as client:
        client.hset(log_key, "0", b"999:json")
        with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
            await backend.get("t", "", None, {})
        client.hset(log_key, "0", b'4:json"a"')
        client.hset(cp_key, "l:messages", b"zero-one")
        with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
            await backend.get("t", "", None, {})
        client.hset(cp_key, "l:messages", b"0-1")
        client.hset(writes_key, "0:task", b"x")
        with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
            await backend.get("t", "", None, {})
        client.hdel(writes_key, "0:task")
        client.hdel(cp_key, "ct")
        with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
            await backend.get("t", "", None, {})


async def test_a_name_whose_digest_another_name_holds_is_refused_and_nothing_written(
    backend: RedisSaverBackend, url: str, prefix: str
) -> None:
    await backend.put(request("0001", texts=("a",)))
    keys_before = _keys(url, prefix)
    [ns_key] = [k for k in keys_before if k.endswith("}:ns")]
    digest = hashlib.sha1(b"child", usedforsecurity=False).hexdigest()[:16]
    with redis.Redis.from_url(url) as client:
        client.hset(ns_key, digest, "another namespace")  # as a digest collision would
        keys_before = _keys(url, prefix)
        with pytest.raises(DecisionHistoryRecordInvalid):
            await backend.put(replace(request("0002", texts=("b",)), checkpoint_ns="child"))
        with pytest.raises(DecisionHistoryRecordInvalid):
            await backend.put_writes("t", "child", "0002", [WriteRecord("k", 0, "x", blob("w"))])
    assert _keys(url, prefix) == keys_before
    assert texts_of(await backend.get("t", "", None, {})) == ["a"]


# --- through ToubaSaver --------------------------------------------------------------


async def test_a_log_entry_lost_in_redis_is_an_error_not_a_shorter_list(
    backend: RedisSaverBackend, url: str, prefix: str
) -> None:
    thread = Thread(ToubaSaver(backend))
    await thread.put([message(i) for i in range(5)])
    [log_key] = [k for k in _keys(url, prefix) if ":L:" in k]
    with redis.Redis.from_url(url) as client:
        assert client.hdel(log_key, "2") == 1  # an evicted or hand-deleted field
    with pytest.raises(DecisionHistoryRecordInvalid, match="position 2 of its 'messages' log"):
        await ToubaSaver(backend).aget_tuple(thread.config)
    with pytest.raises(DecisionHistoryRecordInvalid):
        [t async for t in ToubaSaver(backend).alist(None)]


async def test_langgraph_conformance_reaches_full_on_redis(url: str) -> None:
    """langgraph-checkpoint-conformance's validate(), as make peers runs it, in make test."""
    registered = checkpointer_test(name="ToubaSaver.redis")(langgraph_savers.redis)
    report = await validate(registered, progress=ProgressCallbacks.quiet())
    assert {cap: r.failures for cap, r in report.results.items() if r.failures} == {}
    assert all(r.detected and r.passed is True for r in report.results.values())
    assert report.conformance_level() == "FULL"
    assert sum(r.tests_passed for r in report.results.values()) == 81


async def test_metadata_filters_compare_json_values_in_the_script(
    backend: RedisSaverBackend,
) -> None:
    meta = {"step": 1, "score": 2.0, "big": 2**60, "nested": {"b": [1, 2.5], "a": None}}
    put = replace(request("0001"), metadata_json=json.dumps(meta))
    await backend.put(put)

    async def hits(**wanted: object) -> int:
        return len((await backend.list(ListQuery(thread_id="t", metadata=wanted), {})).rows)

    assert await hits(step=1.0, score=2, big=float(2**60)) == 1
    assert await hits(nested={"a": None, "b": [1.0, 2.5]}) == 1
    assert await hits(step=True) == 0
    assert await hits(big=2**60 + 1) == 0
    assert await hits(nested={"a": None}) == 0
    assert await hits(step="1") == 0


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own on a free loopback port (its URL), so that its
    script cache may be flushed without touching the shared server's."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    [port] = _free_ports(1)
    node = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while "PONG" not in _cli("-p", str(port), "ping"):
            assert time.monotonic() < deadline, "the private redis-server did not start"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        node.terminate()
        node.wait(timeout=10)


async def test_scripts_the_server_forgot_are_loaded_again(private_server: str) -> None:
    """After SCRIPT FLUSH (what a restart does to the cache) each kind of call works: a
    lone script, a script after index commands, a pipeline of reads."""
    backend = RedisSaverBackend(private_server, prefix="p:")
    flusher = Redis.from_url(private_server)
    try:
        first = await backend.put(request("0001", texts=("a",)))
        await flusher.script_flush()
        await backend.put(
            request("0002", parent_id="0001", base=first.spans["messages"], texts=("b",))
        )
        await flusher.script_flush()
        await backend.put(request("0003", thread_id="new", texts=("c",)))  # indexes, then put
        await flusher.script_flush()
        page = await backend.list(ListQuery(), {})
        assert [r.record.checkpoint_id for r in page.rows] == ["0003", "0002", "0001"]
        assert texts_of(page, 1) == ["a", "b"]
    finally:
        await backend.close()
        await flusher.aclose()


# --- Redis Cluster -------------------------------------------------------------------


async def test_the_backend_contract_and_conformance_on_a_cluster(
    cluster: list[int],  # noqa: F811 (the fixture imported above)
) -> None:
    """Every contract test of test_backend.py, then langgraph-checkpoint-conformance, on a
    three-master cluster (tests/history/test_redis_cluster.py starts it): a thread's keys
    share a slot, the store-wide indexes live in another, and each call lands on its node."""
    import tests.integrations.langgraph.test_backend as contract

    cases = [
        fn
        for name, fn in sorted(vars(contract).items())
        if name.startswith("test_")
        and inspect.iscoroutinefunction(fn)
        and list(inspect.signature(fn).parameters) == ["backend"]
    ]
    assert len(cases) >= 20
    client = RedisCluster(host="127.0.0.1", port=cluster[0])
    try:
        for n, case in enumerate(cases):
            b = RedisSaverBackend(client=client, prefix=f"contract-{n}:")
            await case(b)
            await b.close()
        slots = {
            await client.execute_command("CLUSTER KEYSLOT", key)
            async for key in client.scan_iter(match="contract-*")
        }
        assert len(slots) > 3  # the threads are spread over slots (and nodes)
        # scripts the nodes forgot (a restart, SCRIPT FLUSH) are loaded again
        for port in cluster:
            node = Redis(host="127.0.0.1", port=port)
            await node.script_flush()
            await node.aclose()
        again = RedisSaverBackend(client=client, prefix="flushed:")
        await again.put(request("0001", texts=("a",)))
        assert texts_of(await again.get("t", "", None, {})) == ["a"]

        async def factory() -> AsyncIterator[ToubaSaver]:
            async with ToubaSaver(
                RedisSaverBackend(client=client, prefix=f"peers-{uuid.uuid4().hex[:8]}:")
            ) as saver:
                yield saver

        report = await validate(
            checkpointer_test(name="ToubaSaver.redis-cluster")(factory),
            progress=ProgressCallbacks.quiet(),
        )
        assert {cap: r.failures for cap, r in report.results.items() if r.failures} == {}
        assert report.conformance_level() == "FULL"
        assert sum(r.tests_passed for r in report.results.values()) == 81
    finally:
        await client.aclose()


def test_a_given_client_must_be_async_and_keep_bytes(url: str) -> None:
    with pytest.raises(ConfigurationError, match="exactly one"):
        RedisSaverBackend()
    with pytest.raises(ConfigurationError, match="exactly one"):
        RedisSaverBackend(url, client=Redis.from_url(url))
    with pytest.raises(ConfigurationError, match="synchronous"):
        RedisSaverBackend(client=redis.Redis.from_url(url))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="decode"):
        RedisSaverBackend(client=Redis.from_url(url, decode_responses=True))


async def test_a_given_client_stays_open_after_close(url: str, prefix: str) -> None:
    client = Redis.from_url(url)
    try:
        b = RedisSaverBackend(client=client, prefix=prefix)
        await b.put(request("0001", texts=("a",)))
        await b.close()
        assert await client.ping()
    finally:
        await client.aclose()


@asynccontextmanager
async def _put_right_after(
    url: str, prefix: str, script: str, put: PutCheckpoint
) -> AsyncIterator[tuple[RedisSaverBackend, RedisSaverBackend]]:
    """Two backends on one prefix, closed afterwards: whenever the first runs ``script``,
    the second's ``put`` lands right after it (another client's put between that script
    and whatever the first sends next)."""
    first, writer = RedisSaverBackend(url, prefix=prefix), RedisSaverBackend(url, prefix=prefix)
    evaluate = first._eval

    async def then_a_put(name: str, *args: object, **kwargs: object) -> object:
        reply = await evaluate(name, *args, **kwargs)  # type: ignore[arg-type]
        if name == script:
            await writer.put(put)
        return reply

    first._eval = then_a_put  # type: ignore[method-assign]
    try:
        yield first, writer
    finally:
        await first.close()
        await writer.close()


async def test_a_put_landing_right_after_a_delete_keeps_its_thread_indexed(
    url: str, prefix: str
) -> None:
    """Another client's put lands between the delete script and whatever the delete
    sends after it: the thread that put made again stays in the store-wide indexes (a
    list over every thread shows it, a delete of its run finds it), then and after its
    next put."""
    after = request("0002", texts=("again",), run_id="run-2")
    async with _put_right_after(url, prefix, "delete", after) as (deleter, writer):
        await writer.put(request("0001", texts=("first",), run_id="run-2"))
        await deleter.delete_thread("t")
        page = await writer.list(ListQuery(), {})
        assert [r.record.checkpoint_id for r in page.rows] == ["0002"]
        await writer.put(request("0003", parent_id="0002", run_id="run-2"))
        page = await writer.list(ListQuery(), {})
        assert [r.record.checkpoint_id for r in page.rows] == ["0003", "0002"]
        await writer.delete_for_runs(["run-2"])
        assert (await writer.list(ListQuery(thread_id="t"), {})).rows == ()


async def test_a_put_landing_right_after_a_run_delete_keeps_its_run_indexed(
    url: str, prefix: str
) -> None:
    """Another client's put of a run lands right after delete_for_runs's script on its
    thread: the run index still names the thread, so the next delete of the run finds
    that checkpoint."""
    after = request("0002", texts=("again",), run_id="run-2")
    async with _put_right_after(url, prefix, "runs", after) as (deleter, writer):
        await writer.put(request("0001", texts=("first",), run_id="run-2"))
        await deleter.delete_for_runs(["run-2"])
        page = await writer.list(ListQuery(thread_id="t"), {})
        assert [r.record.checkpoint_id for r in page.rows] == ["0002"]
        await writer.delete_for_runs(["run-2"])
        assert (await writer.list(ListQuery(thread_id="t"), {})).rows == ()


async def test_a_put_landing_right_after_a_prune_keeps_its_run_indexed(
    url: str, prefix: str
) -> None:
    """A prune empties a run on a thread; another client's put of that run lands right
    after the prune script: the run index still names the thread, so a delete of the
    run finds that checkpoint."""
    after = request("0003", texts=("again",), run_id="run-1")
    async with _put_right_after(url, prefix, "prune", after) as (pruner, writer):
        await writer.put(request("0001", texts=("first",), run_id="run-1"))
        await writer.put(request("0002", texts=("second",), run_id="run-2"))
        await pruner.prune(["t"], "keep_latest")
        page = await writer.list(ListQuery(thread_id="t"), {})
        assert [r.record.checkpoint_id for r in page.rows] == ["0003", "0002"]
        await writer.delete_for_runs(["run-1"])
        page = await writer.list(ListQuery(thread_id="t"), {})
        assert [r.record.checkpoint_id for r in page.rows] == ["0002"]
        # a run a prune empties for good leaves the thread's run set and the index
        await writer.put(request("0004", texts=("fourth",), run_id="run-4"))
        await writer.prune(["t"], "keep_latest")
        with redis.Redis.from_url(url) as client:
            assert not client.exists(writer._run_index("run-2"))
            assert client.smembers(writer._run_index("run-4")) == {
                hashlib.sha256(b"t").hexdigest().encode()
            }
            assert client.smembers(writer._base("t") + "runs") == {
                hashlib.sha1(b"run-4", usedforsecurity=False).hexdigest().encode()
            }
