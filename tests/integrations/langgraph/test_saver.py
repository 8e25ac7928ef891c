"""ToubaSaver's own behaviour, on every store: log deltas, forks, the decoded cache against
other writers, damaged logs, refused values, store isolation."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint, empty_checkpoint

from tests.integrations.langgraph.conftest import OPENERS
from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStorageUnsafe,
)
from touba.integrations.langgraph import ToubaSaver
from touba.integrations.langgraph._backend import PutCheckpoint, PutResult, SaverBackend


class Spy:
    """The real backend, recording each put request it forwards (an observer, not a fake)."""

    def __init__(self, inner: SaverBackend) -> None:
        self.inner = inner
        self.puts: list[PutCheckpoint] = []

    async def put(self, request: PutCheckpoint) -> PutResult:
        self.puts.append(request)
        return await self.inner.put(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def spied(backend: SaverBackend) -> tuple[ToubaSaver, Spy]:
    spy = Spy(backend)
    return ToubaSaver(cast(SaverBackend, spy)), spy


def message(i: int, size: int = 200) -> AnyMessage:
    kind = HumanMessage if i % 2 == 0 else AIMessage
    return kind(f"{i:05d} " + "x" * size, id=f"m{i}")


class Thread:
    """Puts checkpoints the way LangGraph's loop does: each one's parent is the last."""

    def __init__(self, saver: ToubaSaver, thread_id: str = "t", ns: str = "") -> None:
        self.saver = saver
        self.config: RunnableConfig = {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": ns}
        }
        self.version = 0

    async def put(
        self, messages: list[AnyMessage], *, parent: RunnableConfig | None = None, **other: Any
    ) -> RunnableConfig:
        self.version += 1
        checkpoint: Checkpoint = empty_checkpoint()
        version = self.saver.get_next_version(
            None if self.version == 1 else f"{self.version - 1}", None
        )
        channels = {"messages": messages, **other}
        checkpoint["channel_values"] = dict(channels)
        checkpoint["channel_versions"] = dict.fromkeys(channels, version)
        base = parent if parent is not None else self.config
        self.config = await self.saver.aput(
            base,
            checkpoint,
            {"source": "loop", "step": self.version},
            dict(checkpoint["channel_versions"]),
        )
        return self.config


async def read(saver: ToubaSaver, config: RunnableConfig) -> list[AnyMessage]:
    found = await saver.aget_tuple(config)
    assert found is not None
    return cast(list[AnyMessage], found.checkpoint["channel_values"]["messages"])


def contents(messages: list[AnyMessage]) -> list[str]:
    return [str(m.content)[:5] for m in messages]


@pytest.fixture
async def saver(backend: SaverBackend) -> AsyncIterator[ToubaSaver]:
    async with ToubaSaver(backend) as s:
        yield s


async def test_each_step_writes_only_the_messages_it_added(backend: SaverBackend) -> None:
    saver, spy = spied(backend)
    thread = Thread(saver)
    history: list[AnyMessage] = []
    for step in range(60):
        history = [*history, message(2 * step), message(2 * step + 1)]
        await thread.put(history, counter=step)
    sizes = []
    for step, request in enumerate(spy.puts):
        (append,) = request.logs
        assert append.channel == "messages"
        assert len(append.items) == 2
        assert sum(s.end - s.start for s in append.base) == 2 * step
        sizes.append(
            sum(len(b) for _, b in append.items)
            + len(request.checkpoint[1])
            + len(request.metadata[1])
            + sum(len(b.blob[1]) for b in request.blobs if b.blob is not None)
        )
    # what a step sends does not grow with the conversation
    assert max(sizes[-10:]) <= 1.2 * min(sizes[:10])
    assert [m.id for m in await read(saver, thread.config)] == [m.id for m in history]
    cold = ToubaSaver(backend)
    assert [m.content for m in await read(cold, thread.config)] == [m.content for m in history]


async def test_a_fork_shares_its_prefix(backend: SaverBackend) -> None:
    saver, spy = spied(backend)
    thread = Thread(saver)
    start = [message(i) for i in range(5)]
    first = await thread.put(start)
    await thread.put([*start, message(5), message(6)])
    fork = await thread.put([*start, message(70)], parent=first)
    append = spy.puts[-1].logs[0]
    assert len(append.items) == 1
    assert sum(s.end - s.start for s in append.base) == 5
    assert contents(await read(saver, fork)) == [
        "00000",
        "00001",
        "00002",
        "00003",
        "00004",
        "00070",
    ]
    cold = ToubaSaver(backend)
    assert contents(await read(cold, fork))[-1] == "00070"
    history = [t async for t in cold.alist({"configurable": {"thread_id": "t"}})]
    assert [len(t.checkpoint["channel_values"]["messages"]) for t in history] == [6, 7, 5]


async def test_a_removed_or_replaced_message_keeps_the_shared_prefix(backend: SaverBackend) -> None:
    saver, spy = spied(backend)
    thread = Thread(saver)
    start = [message(i) for i in range(6)]
    await thread.put(start)
    edited = AIMessage("edited", id="m3")
    await thread.put([*start[:3], edited, *start[4:]])
    append = spy.puts[-1].logs[0]
    assert sum(s.end - s.start for s in append.base) == 3
    assert len(append.items) == 3
    await thread.put([*start[:1], *start[2:3]])  # m1 removed
    values = await read(ToubaSaver(backend), thread.config)
    assert [m.id for m in values] == ["m0", "m2"]


async def test_a_logged_channel_that_is_not_a_list_is_stored_whole(saver: ToubaSaver) -> None:
    thread = Thread(saver)
    await thread.put(cast(list[AnyMessage], {"not": "a list"}))
    found = await saver.aget_tuple(thread.config)
    assert found is not None
    assert found.checkpoint["channel_values"]["messages"] == {"not": "a list"}
    await thread.put([message(0)])
    assert contents(await read(saver, thread.config)) == ["00000"]


async def test_another_writer_is_seen_through_the_cache(backend: SaverBackend) -> None:
    a, b = ToubaSaver(backend), ToubaSaver(backend)
    thread_a = Thread(a)
    history = [message(i) for i in range(4)]
    await thread_a.put(history)
    assert contents(await read(b, thread_a.config)) == contents(history)  # b's cache is warm
    history = [*history, message(4)]
    await thread_a.put(history)
    assert contents(await read(b, {"configurable": {"thread_id": "t"}})) == contents(history)

    # a deletes and starts over with other messages at the same positions: b must not
    # serve its cached ones
    await a.adelete_thread("t")
    thread_a = Thread(a)
    await thread_a.put([message(100), message(101)])
    assert contents(await read(b, {"configurable": {"thread_id": "t"}})) == ["00100", "00101"]

    # b continues from its cached head after a pruned elsewhere
    thread_b = Thread(b)
    thread_b.config = (await b.aget_tuple({"configurable": {"thread_id": "t"}})).config  # type: ignore[union-attr]
    await thread_a.put([message(100), message(101), message(102)], parent=thread_a.config)
    await a.aprune(["t"])
    await thread_b.put([message(100), message(101), message(103)], parent=thread_b.config)
    assert contents(await read(a, thread_b.config)) == ["00100", "00101", "00103"]


async def test_a_writer_continuing_after_the_thread_was_deleted_elsewhere(
    backend: SaverBackend,
) -> None:
    a, b = ToubaSaver(backend), ToubaSaver(backend)
    thread = Thread(a)
    history = [message(i) for i in range(3)]
    await thread.put(history)
    await b.adelete_thread("t")
    await thread.put([*history, message(3)])  # its parent's positions are gone: stored afresh
    assert contents(await read(b, thread.config)) == ["00000", "00001", "00002", "00003"]


async def test_a_value_the_serializer_refuses_names_the_channel_and_writes_nothing(
    saver: ToubaSaver,
) -> None:
    thread = Thread(saver)
    await thread.put([message(0)])
    with pytest.raises(ConfigurationError, match="'tool_state'"):
        await thread.put([message(0), message(1)], tool_state=object())
    with pytest.raises(ConfigurationError, match="item 1 of channel 'messages'"):
        await thread.put(cast(list[AnyMessage], [message(0), object()]))
    history = [t async for t in saver.alist({"configurable": {"thread_id": "t"}})]
    assert len(history) == 1
    with pytest.raises(ConfigurationError, match="pending write 0"):
        await saver.aput_writes(thread.config, [("x", object())], "task")


def damage(name: str, backend: SaverBackend, position: int) -> None:
    """Remove one log entry behind the store's back (a damaged file, a lost key)."""
    if name == "memory":
        from touba.integrations.langgraph._memory import MemorySaverBackend

        assert isinstance(backend, MemorySaverBackend)
        del backend._threads["t"][""].logs["messages"].entries[position]
    elif name == "sqlite":
        from touba.integrations.langgraph._sqlite import SqliteSaverBackend

        assert isinstance(backend, SqliteSaverBackend)
        with sqlite3.connect(backend._path) as conn:
            conn.execute("DELETE FROM lg_entries WHERE position = ?", (position,))
    else:
        pytest.skip(f"no way to damage a {name} store written for this test yet")


async def test_a_missing_log_entry_is_an_error_not_a_shorter_list(
    backend: SaverBackend, backend_name: str
) -> None:
    thread = Thread(ToubaSaver(backend))
    await thread.put([message(i) for i in range(5)])
    damage(backend_name, backend, 2)
    with pytest.raises(DecisionHistoryRecordInvalid, match="position 2 of its 'messages' log"):
        await ToubaSaver(backend).aget_tuple(thread.config)
    with pytest.raises(DecisionHistoryRecordInvalid):
        [t async for t in ToubaSaver(backend).alist(None)]


async def test_stores_with_different_names_never_see_each_other(
    backend_name: str, private_dir: Path, store_tag: str
) -> None:
    async with (
        OPENERS[backend_name](private_dir, store_tag + "a") as one,
        OPENERS[backend_name](private_dir, store_tag + "b") as two,
    ):
        await Thread(ToubaSaver(one)).put([message(0)])
        assert await ToubaSaver(two).aget_tuple({"configurable": {"thread_id": "t"}}) is None
        assert [t async for t in ToubaSaver(two).alist(None)] == []


async def test_the_sqlite_file_is_private(private_dir: Path) -> None:
    path = private_dir / "graph.sqlite"
    async with ToubaSaver.sqlite(path) as saver:
        await Thread(saver).put([message(0)])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    link = private_dir / "link.sqlite"
    link.symlink_to(path)
    async with ToubaSaver.sqlite(link) as saver:
        with pytest.raises(DecisionHistoryStorageUnsafe):
            await saver.aget_tuple({"configurable": {"thread_id": "t"}})


async def test_a_foreign_sqlite_file_is_refused_untouched(private_dir: Path) -> None:
    path = private_dir / "other.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE mine (x)")
    os.chmod(path, 0o600)
    before = path.read_bytes()
    async with ToubaSaver.sqlite(path) as saver:
        with pytest.raises(DecisionHistoryRecordInvalid, match="not a ToubaSaver store"):
            await saver.aget_tuple({"configurable": {"thread_id": "t"}})
    assert path.read_bytes() == before


async def test_a_closed_saver_refuses_calls(saver: ToubaSaver) -> None:
    await saver.aclose()
    await saver.aclose()
    with pytest.raises(ConfigurationError, match="closed"):
        await saver.aget_tuple({"configurable": {"thread_id": "t"}})


async def test_an_unknown_prune_strategy_is_refused(saver: ToubaSaver) -> None:
    with pytest.raises(ConfigurationError, match="'oldest'"):
        await saver.aprune(["t"], strategy="oldest")


async def test_a_filter_value_json_cannot_hold_is_refused(saver: ToubaSaver) -> None:
    with pytest.raises(ConfigurationError, match="JSON"):
        [t async for t in saver.alist(None, filter={"x": object()})]
