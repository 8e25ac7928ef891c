"""The SaverBackend contract, run on every store (see conftest.BACKENDS)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import pytest

from touba.errors import DecisionHistoryRecordInvalid
from touba.integrations.langgraph._backend import (
    ChannelBlob,
    CheckpointPage,
    HeldLog,
    ListQuery,
    LogAppend,
    LogKey,
    LogState,
    PutCheckpoint,
    SaverBackend,
    Span,
    TypedBlob,
    WriteRecord,
    merge_spans,
    span_length,
)

T = "thread-a"


def blob(text: str) -> TypedBlob:
    return ("json", text.encode())


def items(*texts: str) -> tuple[TypedBlob, ...]:
    return tuple(blob(t) for t in texts)


def put_request(
    checkpoint_id: str,
    *,
    thread_id: str = T,
    ns: str = "",
    parent_id: str | None = None,
    logs: Sequence[LogAppend] = (),
    versions: Mapping[str, str] | None = None,
    blobs: Sequence[ChannelBlob] = (),
    metadata: Mapping[str, object] | None = None,
    run_id: str | None = None,
) -> PutCheckpoint:
    meta = dict(metadata or {"step": 0})
    if run_id is not None:
        meta["run_id"] = run_id
    return PutCheckpoint(
        thread_id=thread_id,
        checkpoint_ns=ns,
        checkpoint_id=checkpoint_id,
        parent_id=parent_id,
        checkpoint=blob(f"checkpoint {checkpoint_id}"),
        metadata=blob(json.dumps(meta)),
        metadata_json=json.dumps(meta),
        run_id=run_id,
        versions=dict(versions or {}),
        blobs=tuple(blobs),
        logs=tuple(logs),
    )


def messages(base: tuple[Span, ...], *texts: str) -> LogAppend:
    return LogAppend("messages", base, items(*texts))


def values(page: CheckpointPage, key: LogKey, spans: Sequence[Span]) -> list[str]:
    """The decoded items ``spans`` name, from the page's entries (KeyError when one lacks)."""
    entries = page.logs[key].entries
    return [entries[p][1].decode() for s in spans for p in range(s.start, s.end)]


def ids(page: CheckpointPage) -> list[str]:
    return [row.record.checkpoint_id for row in page.rows]


KEY = LogKey(T, "", "messages")


async def latest(
    backend: SaverBackend,
    *,
    thread_id: str = T,
    ns: str = "",
    checkpoint_id: str | None = None,
    held: Mapping[str, HeldLog] | None = None,
) -> CheckpointPage:
    """``backend.get`` with the test's defaults: the latest checkpoint of thread-a."""
    return await backend.get(thread_id, ns, checkpoint_id, held or {})


# --- spans ---------------------------------------------------------------------------


def test_merge_spans_joins_adjacent_keeps_order_and_drops_empty() -> None:
    assert merge_spans([Span(0, 3), Span(3, 5), Span(5, 5), Span(9, 10)]) == (
        Span(0, 5),
        Span(9, 10),
    )
    assert merge_spans([Span(9, 10), Span(0, 2)]) == (Span(9, 10), Span(0, 2))
    assert span_length((Span(0, 5), Span(9, 10))) == 6


# --- put and get ---------------------------------------------------------------------


async def test_put_appends_at_the_end_and_get_returns_the_checkpoint(
    backend: SaverBackend,
) -> None:
    result = await backend.put(
        put_request(
            "0001",
            logs=[messages((), "a", "b", "c")],
            versions={"count": "1"},
            blobs=[ChannelBlob("count", "1", blob("3"))],
            metadata={"source": "input", "step": -1},
            run_id="run-1",
        )
    )
    assert result.spans == {"messages": (Span(0, 3),)}
    assert result.logs["messages"].length == 3

    page = await latest(backend)
    assert ids(page) == ["0001"]
    row = page.rows[0]
    record = row.record
    assert (record.thread_id, record.checkpoint_ns, record.parent_id) == (T, "", None)
    assert record.checkpoint == blob("checkpoint 0001")
    assert json.loads(record.metadata_json) == {"source": "input", "step": -1, "run_id": "run-1"}
    assert record.run_id == "run-1"
    assert dict(record.versions) == {"count": "1"}
    assert dict(record.logs) == {"messages": (Span(0, 3),)}
    assert dict(row.blobs) == {"count": blob("3")}
    assert row.writes == ()
    assert page.logs[KEY].state == result.logs["messages"]
    assert values(page, KEY, record.logs["messages"]) == ["a", "b", "c"]


async def test_a_step_appends_only_what_it_adds_and_a_warm_read_returns_only_that(
    backend: SaverBackend,
) -> None:
    first = await backend.put(put_request("0001", logs=[messages((), "a", "b")]))
    second = await backend.put(
        put_request("0002", parent_id="0001", logs=[messages(first.spans["messages"], "c")])
    )
    assert second.spans["messages"] == (Span(0, 3),)
    state = second.logs["messages"]
    assert state.token == first.logs["messages"].token
    assert state.length == 3

    held = {"messages": HeldLog(first.logs["messages"].token, 2)}
    page = await latest(backend, held=held)
    assert ids(page) == ["0002"]
    assert dict(page.logs[KEY].entries) == {2: blob("c")}

    cold = await latest(backend)
    assert values(cold, KEY, cold.rows[0].record.logs["messages"]) == ["a", "b", "c"]


async def test_a_held_log_under_another_token_gets_every_entry(backend: SaverBackend) -> None:
    await backend.put(put_request("0001", logs=[messages((), "a", "b")]))
    page = await latest(backend, held={"messages": HeldLog("not-the-token", 2)})
    assert sorted(page.logs[KEY].entries) == [0, 1]


async def test_an_unchanged_logged_channel_appends_nothing(backend: SaverBackend) -> None:
    first = await backend.put(put_request("0001", logs=[messages((), "a")]))
    second = await backend.put(
        put_request("0002", parent_id="0001", logs=[messages(first.spans["messages"])])
    )
    assert second.spans["messages"] == (Span(0, 1),)
    assert second.logs["messages"].length == 1


async def test_an_empty_logged_value_has_no_spans(backend: SaverBackend) -> None:
    result = await backend.put(put_request("0001", logs=[messages(())]))
    assert result.spans == {"messages": ()}
    page = await latest(backend)
    assert dict(page.rows[0].record.logs) == {"messages": ()}


async def test_a_fork_shares_the_prefix_and_appends_at_the_real_end(
    backend: SaverBackend,
) -> None:
    one = await backend.put(put_request("0001", logs=[messages((), "a", "b")]))
    await backend.put(
        put_request("0002", parent_id="0001", logs=[messages(one.spans["messages"], "c", "d")])
    )
    fork = await backend.put(
        put_request("0003", parent_id="0001", logs=[messages(one.spans["messages"], "x")])
    )
    assert fork.spans["messages"] == (Span(0, 2), Span(4, 5))
    assert fork.logs["messages"].length == 5

    for checkpoint_id, expected in [("0002", ["a", "b", "c", "d"]), ("0003", ["a", "b", "x"])]:
        page = await latest(backend, checkpoint_id=checkpoint_id)
        assert values(page, KEY, page.rows[0].record.logs["messages"]) == expected
    # a prefix of the parent's value (a message removed from the end) is a base too
    cut = await backend.put(
        put_request("0004", parent_id="0002", logs=[messages((Span(0, 1),), "y")])
    )
    assert cut.spans["messages"] == (Span(0, 1), Span(5, 6))


async def test_a_base_past_the_log_is_refused_and_nothing_is_written(
    backend: SaverBackend,
) -> None:
    await backend.put(
        put_request("0001", logs=[messages((), "a"), LogAppend("todo", (), items("t"))])
    )
    bad = put_request(
        "0002",
        parent_id="0001",
        logs=[messages((Span(0, 1),), "b"), LogAppend("todo", (Span(0, 2),), items("u"))],
        versions={"count": "2"},
        blobs=[ChannelBlob("count", "2", blob("2"))],
    )
    with pytest.raises(DecisionHistoryRecordInvalid):
        await backend.put(bad)
    page = await latest(backend)
    assert ids(page) == ["0001"]
    state = page.logs[KEY].state
    assert state is not None
    assert state.length == 1
    todo = page.logs[LogKey(T, "", "todo")].state
    assert todo is not None
    assert todo.length == 1
    # the next good put lands at position 1 of each log: nothing of the refused one remains
    good = await backend.put(
        put_request("0002", parent_id="0001", logs=[messages((Span(0, 1),), "c")])
    )
    assert good.spans["messages"] == (Span(0, 2),)


async def test_blobs_by_version_empty_marker_and_missing_blob(backend: SaverBackend) -> None:
    await backend.put(
        put_request(
            "0001",
            versions={"a": "1", "b": "1"},
            blobs=[ChannelBlob("a", "1", blob("A1")), ChannelBlob("b", "1", None)],
        )
    )
    # only "a" changes; "b" keeps version 1; "c" names a version never written
    await backend.put(
        put_request(
            "0002",
            parent_id="0001",
            versions={"a": "2", "b": "1", "c": "7"},
            blobs=[ChannelBlob("a", "2", blob("A2"))],
        )
    )
    row = (await latest(backend)).rows[0]
    assert dict(row.record.versions) == {"a": "2", "b": "1", "c": "7"}
    assert dict(row.blobs) == {"a": blob("A2"), "b": None}
    old = (await latest(backend, checkpoint_id="0001")).rows[0]
    assert dict(old.blobs) == {"a": blob("A1"), "b": None}


async def test_a_version_once_written_keeps_its_value(backend: SaverBackend) -> None:
    await backend.put(
        put_request("0001", versions={"a": "1"}, blobs=[ChannelBlob("a", "1", blob("first"))])
    )
    await backend.put(
        put_request("0002", versions={"a": "1"}, blobs=[ChannelBlob("a", "1", blob("second"))])
    )
    row = (await latest(backend)).rows[0]
    assert dict(row.blobs) == {"a": blob("first")}


async def test_putting_the_same_checkpoint_id_replaces_the_record(
    backend: SaverBackend,
) -> None:
    await backend.put(put_request("0001", metadata={"step": 1}))
    await backend.put(put_request("0001", metadata={"step": 2}))
    page = await backend.list(ListQuery(thread_id=T), {})
    assert ids(page) == ["0001"]
    assert json.loads(page.rows[0].record.metadata_json) == {"step": 2}


async def test_get_by_id_namespace_and_thread_are_isolated(backend: SaverBackend) -> None:
    await backend.put(put_request("0001", logs=[messages((), "root")]))
    await backend.put(put_request("0002", ns="child:1", logs=[messages((), "child")]))
    await backend.put(put_request("0003", thread_id="thread-b", logs=[messages((), "other")]))

    root = await latest(backend)
    assert ids(root) == ["0001"]
    assert values(root, KEY, (Span(0, 1),)) == ["root"]
    child = await latest(backend, ns="child:1")
    assert ids(child) == ["0002"]
    assert values(child, LogKey(T, "child:1", "messages"), (Span(0, 1),)) == ["child"]
    assert ids(await latest(backend, checkpoint_id="0002")) == []
    assert ids(await latest(backend, thread_id="thread-b", checkpoint_id="0001")) == []
    assert ids(await latest(backend, thread_id="nobody")) == []


# --- pending writes ------------------------------------------------------------------


async def test_writes_insert_or_ignore_special_ones_replace_and_come_sorted(
    backend: SaverBackend,
) -> None:
    await backend.put(put_request("0001"))
    await backend.put_writes(
        T,
        "",
        "0001",
        [
            WriteRecord("task-b", 0, "x", blob("b0"), "~1"),
            WriteRecord("task-b", 1, "y", blob("b1"), "~1"),
            WriteRecord("task-a", 0, "x", blob("a0"), "~2"),
            WriteRecord("task-a", -1, "__error__", blob("first error"), "~2"),
        ],
    )
    await backend.put_writes(
        T,
        "",
        "0001",
        [
            WriteRecord("task-b", 0, "x", blob("b0 again"), "~1"),
            WriteRecord("task-a", -1, "__error__", blob("second error"), "~2"),
            WriteRecord("task-c", 0, "z", blob("c0"), ""),
        ],
    )
    writes = (await latest(backend)).rows[0].writes
    assert [(w.task_path, w.task_id, w.idx, w.channel, w.value) for w in writes] == [
        ("", "task-c", 0, "z", blob("c0")),
        ("~1", "task-b", 0, "x", blob("b0")),
        ("~1", "task-b", 1, "y", blob("b1")),
        ("~2", "task-a", -1, "__error__", blob("second error")),
        ("~2", "task-a", 0, "x", blob("a0")),
    ]


async def test_writes_belong_to_their_checkpoint(backend: SaverBackend) -> None:
    await backend.put(put_request("0001"))
    await backend.put_writes(T, "", "0001", [WriteRecord("t", 0, "x", blob("v"))])
    await backend.put(put_request("0002", parent_id="0001"))
    await backend.put(put_request("0003", ns="child:1"))
    assert (await latest(backend)).rows[0].writes == ()
    assert len((await latest(backend, checkpoint_id="0001")).rows[0].writes) == 1
    assert (await latest(backend, ns="child:1")).rows[0].writes == ()


# --- list ----------------------------------------------------------------------------


async def _four(backend: SaverBackend) -> None:
    spans: tuple[Span, ...] = ()
    parent: str | None = None
    for i in range(4):
        checkpoint_id = f"000{i + 1}"
        meta = {"source": "input" if i % 2 == 0 else "loop", "step": i, "flag": i == 1}
        result = await backend.put(
            put_request(
                checkpoint_id,
                parent_id=parent,
                logs=[messages(spans, f"m{i}")],
                metadata=meta,
            )
        )
        spans, parent = result.spans["messages"], checkpoint_id


async def test_list_newest_first_with_every_entry_once(backend: SaverBackend) -> None:
    await _four(backend)
    page = await backend.list(ListQuery(thread_id=T), {})
    assert ids(page) == ["0004", "0003", "0002", "0001"]
    assert dict(page.logs[KEY].entries) == {i: blob(f"m{i}") for i in range(4)}
    for row in page.rows:
        assert values(page, KEY, row.record.logs["messages"]) == [
            f"m{i}" for i in range(span_length(row.record.logs["messages"]))
        ]
    token = page.logs[KEY].state.token  # type: ignore[union-attr]
    warm = await backend.list(ListQuery(thread_id=T), {KEY: HeldLog(token, 3)})
    assert dict(warm.logs[KEY].entries) == {3: blob("m3")}


async def test_list_before_limit_id_and_metadata_filters(backend: SaverBackend) -> None:
    await _four(backend)

    async def listed(
        *,
        before: str | None = None,
        limit: int | None = None,
        checkpoint_id: str | None = None,
        metadata: Mapping[str, object] | None = None,
    ) -> list[str]:
        query = ListQuery(
            thread_id=T,
            before=before,
            limit=limit,
            checkpoint_id=checkpoint_id,
            metadata=metadata or {},
        )
        return ids(await backend.list(query, {}))

    assert await listed(before="0003") == ["0002", "0001"]
    assert await listed(limit=2) == ["0004", "0003"]
    assert await listed(before="0004", limit=1) == ["0003"]
    assert await listed(checkpoint_id="0002") == ["0002"]
    assert await listed(metadata={"source": "input"}) == ["0003", "0001"]
    assert await listed(metadata={"source": "loop", "step": 3}) == ["0004"]
    assert await listed(metadata={"source": "loop", "step": 99}) == []
    assert await listed(metadata={"missing": None}) == []
    assert await listed(metadata={"flag": True}) == ["0002"]
    assert await listed(metadata={"step": True}) == []  # 1 and true differ, as in JSON
    assert await listed(metadata={"source": "input"}, limit=1) == ["0003"]
    assert await listed(limit=0) == []


async def test_list_gives_each_row_the_blobs_of_its_own_versions(backend: SaverBackend) -> None:
    for i in range(3):
        await backend.put(
            put_request(
                f"000{i + 1}",
                parent_id=f"000{i}" if i else None,
                versions={"count": str(i), "fixed": "1"},
                blobs=[ChannelBlob("count", str(i), blob(f"count {i}"))]
                + ([ChannelBlob("fixed", "1", blob("F"))] if i == 0 else []),
            )
        )
    page = await backend.list(ListQuery(thread_id=T), {})
    assert [dict(row.blobs) for row in page.rows] == [
        {"count": blob(f"count {i}"), "fixed": blob("F")} for i in (2, 1, 0)
    ]
    other = await backend.list(ListQuery(), {})
    assert [dict(row.blobs)["count"] for row in other.rows] == [
        blob(f"count {i}") for i in (2, 1, 0)
    ]


async def test_list_by_namespace_and_across_threads(backend: SaverBackend) -> None:
    await backend.put(put_request("0001"))
    await backend.put(put_request("0002", ns="child:1"))
    await backend.put(put_request("0003", thread_id="thread-b"))
    assert ids(await backend.list(ListQuery(thread_id=T), {})) == ["0002", "0001"]
    assert ids(await backend.list(ListQuery(thread_id=T, checkpoint_ns=""), {})) == ["0001"]
    assert ids(await backend.list(ListQuery(thread_id=T, checkpoint_ns="child:1"), {})) == ["0002"]
    assert ids(await backend.list(ListQuery(), {})) == ["0003", "0002", "0001"]
    assert ids(await backend.list(ListQuery(thread_id="nobody"), {})) == []


# --- delete, copy, prune -------------------------------------------------------------


async def test_delete_thread_removes_every_namespace_and_a_new_log_starts_over(
    backend: SaverBackend,
) -> None:
    first = await backend.put(put_request("0001", logs=[messages((), "a", "b")]))
    await backend.put(put_request("0002", ns="child:1", logs=[messages((), "c")]))
    await backend.put_writes(T, "", "0001", [WriteRecord("t", 0, "x", blob("v"))])
    await backend.put(put_request("0003", thread_id="thread-b", logs=[messages((), "keep")]))

    await backend.delete_thread(T)
    await backend.delete_thread("nobody")
    assert ids(await backend.list(ListQuery(thread_id=T), {})) == []
    other = await latest(backend, thread_id="thread-b")
    assert values(other, LogKey("thread-b", "", "messages"), (Span(0, 1),)) == ["keep"]

    again = await backend.put(put_request("0004", logs=[messages((), "new")]))
    assert again.spans["messages"] == (Span(0, 1),)
    assert again.logs["messages"].token != first.logs["messages"].token
    page = await latest(backend, held={"messages": HeldLog(first.logs["messages"].token, 2)})
    assert values(page, KEY, (Span(0, 1),)) == ["new"]
    assert page.rows[0].writes == ()


async def test_delete_for_runs_removes_their_checkpoints_and_writes_only(
    backend: SaverBackend,
) -> None:
    one = await backend.put(put_request("0001", logs=[messages((), "a")], run_id="run-1"))
    await backend.put_writes(T, "", "0001", [WriteRecord("t", 0, "x", blob("v"))])
    await backend.put(
        put_request(
            "0002", parent_id="0001", logs=[messages(one.spans["messages"], "b")], run_id="run-2"
        )
    )
    await backend.put(put_request("0003", ns="child:1", run_id="run-1"))
    await backend.put(put_request("0004", thread_id="thread-b", run_id="run-1"))

    await backend.delete_for_runs(["run-1", "run-unknown"])
    await backend.delete_for_runs([])
    assert ids(await backend.list(ListQuery(), {})) == ["0002"]
    page = await latest(backend)
    assert values(page, KEY, page.rows[0].record.logs["messages"]) == ["a", "b"]
    assert page.logs[KEY].state == LogState(one.logs["messages"].token, 2)
    # the writes went with their checkpoint: a checkpoint put again under that id has none
    await backend.put(put_request("0001", run_id="run-3"))
    assert (await latest(backend, checkpoint_id="0001")).rows[0].writes == ()


async def test_copy_thread_copies_everything_and_leaves_the_source(
    backend: SaverBackend,
) -> None:
    one = await backend.put(
        put_request(
            "0001",
            logs=[messages((), "a", "b")],
            versions={"k": "1"},
            blobs=[ChannelBlob("k", "1", blob("K"))],
            metadata={"step": 0, "source": "input"},
        )
    )
    await backend.put(
        put_request(
            "0002",
            parent_id="0001",
            logs=[messages(one.spans["messages"], "c")],
            versions={"k": "1"},
        )
    )
    await backend.put_writes(T, "", "0002", [WriteRecord("t", 0, "x", blob("w"), "~p")])
    await backend.put(put_request("0003", ns="child:1", logs=[messages((), "sub")]))
    before = await backend.list(ListQuery(thread_id=T), {})

    await backend.copy_thread(T, "thread-copy")
    await backend.copy_thread("nobody", "thread-none")

    after = await backend.list(ListQuery(thread_id=T), {})
    assert after.rows == before.rows
    copied = await backend.list(ListQuery(thread_id="thread-copy"), {})
    assert ids(copied) == ids(before)
    for src, dst in zip(before.rows, copied.rows, strict=True):
        assert dst.record.thread_id == "thread-copy"
        assert (dst.record.parent_id, dst.record.checkpoint, dst.record.metadata_json) == (
            src.record.parent_id,
            src.record.checkpoint,
            src.record.metadata_json,
        )
        assert dict(dst.blobs) == dict(src.blobs)
        assert dst.writes == src.writes
        for channel, spans in src.record.logs.items():
            ns = src.record.checkpoint_ns
            assert values(copied, LogKey("thread-copy", ns, channel), dst.record.logs[channel]) == (
                values(before, LogKey(T, ns, channel), spans)
            )
    assert ids(await backend.list(ListQuery(thread_id="thread-none"), {})) == []


async def test_copy_into_a_thread_with_a_log_shifts_the_copied_spans(
    backend: SaverBackend,
) -> None:
    await backend.put(put_request("0001", thread_id="dst", logs=[messages((), "d0", "d1")]))
    await backend.put(put_request("0002", logs=[messages((), "s0")]))
    await backend.copy_thread(T, "dst")
    page = await latest(backend, thread_id="dst")
    assert ids(page) == ["0002"]
    spans = page.rows[0].record.logs["messages"]
    assert spans == (Span(2, 3),)
    assert values(page, LogKey("dst", "", "messages"), spans) == ["s0"]
    old = await latest(backend, thread_id="dst", checkpoint_id="0001")
    assert values(old, LogKey("dst", "", "messages"), (Span(0, 2),)) == ["d0", "d1"]


async def test_prune_keep_latest_keeps_what_the_latest_names(backend: SaverBackend) -> None:
    one = await backend.put(
        put_request(
            "0001",
            logs=[messages((), "a", "b")],
            versions={"k": "1"},
            blobs=[ChannelBlob("k", "1", blob("K1"))],
        )
    )
    await backend.put(
        put_request(
            "0002",
            parent_id="0001",
            logs=[messages(one.spans["messages"], "c", "d")],
            versions={"k": "2"},
            blobs=[ChannelBlob("k", "2", blob("K2"))],
        )
    )
    # the latest is a fork from 0001: positions 2 and 3 are no one's once 0002 goes
    fork = await backend.put(
        put_request(
            "0003",
            parent_id="0001",
            logs=[messages(one.spans["messages"], "x")],
            versions={"k": "1"},
        )
    )
    await backend.put_writes(T, "", "0003", [WriteRecord("t", 0, "x", blob("w"))])
    await backend.put_writes(T, "", "0002", [WriteRecord("t", 0, "x", blob("gone"))])
    await backend.put(put_request("0004", ns="child:1", logs=[messages((), "s0")]))
    await backend.put(put_request("0005", ns="child:1", logs=[messages((), "s1")]))
    await backend.put(put_request("0006", thread_id="thread-b"))
    await backend.put(put_request("0007", thread_id="thread-b"))

    await backend.prune([T, "nobody"], "keep_latest")

    assert ids(await backend.list(ListQuery(thread_id=T), {})) == ["0005", "0003"]
    assert ids(await backend.list(ListQuery(thread_id="thread-b"), {})) == ["0007", "0006"]
    page = await latest(backend)
    row = page.rows[0]
    assert row.record.logs["messages"] == fork.spans["messages"] == (Span(0, 2), Span(4, 5))
    assert values(page, KEY, row.record.logs["messages"]) == ["a", "b", "x"]
    assert sorted(page.logs[KEY].entries) == [0, 1, 4]
    assert dict(row.blobs) == {"k": blob("K1")}
    assert [w.value for w in row.writes] == [blob("w")]
    state = page.logs[KEY].state
    assert state is not None
    assert state.token != fork.logs["messages"].token
    # a holder of the old token is sent everything again
    warm = await latest(backend, held={"messages": HeldLog(fork.logs["messages"].token, 5)})
    assert sorted(warm.logs[KEY].entries) == [0, 1, 4]
    child = await latest(backend, ns="child:1")
    assert values(child, LogKey(T, "child:1", "messages"), (Span(1, 2),)) == ["s1"]


async def test_prune_delete_removes_the_threads(backend: SaverBackend) -> None:
    await backend.put(put_request("0001", logs=[messages((), "a")]))
    await backend.put(put_request("0002", thread_id="thread-b"))
    await backend.prune([T], "delete")
    await backend.prune([], "delete")
    assert ids(await backend.list(ListQuery(), {})) == ["0002"]


async def test_close_is_idempotent(backend: SaverBackend) -> None:
    await backend.put(put_request("0001"))
    await backend.close()
    await backend.close()
