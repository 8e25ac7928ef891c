"""Exports are streamed: the memory they take does not grow with what they hold.

tracemalloc's peak (Python allocations, every thread: the SQLite stores' own threads
included; SQLite's C heap is not traced) while exporting N and then 4N records of the
same size to a sink that keeps nothing. Linear growth would give a ratio near 4; a
page at a time keeps it near 1 (what still grows: the key list of one history store,
a few hundred bytes per conversation, against a conversation read whole).
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from tests.data._export_data import conversation, save
from touba.data import Stores, write_export
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore


class Sink:
    """A binary file that counts what it is given and keeps none of it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass


async def peak(stores: Stores, **selection: str) -> tuple[int, int]:
    """The peak traced while exporting ``selection``, and the bytes written."""
    sink = Sink()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        await write_export(stores, sink, **selection)  # type: ignore[arg-type]
        _, top = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return top, sink.size


async def test_exporting_4n_conversations_takes_no_more_memory_than_n(private_dir: Path) -> None:
    measured: dict[int, tuple[int, int]] = {}
    for count in (15, 60):
        async with SqliteHistoryStore(private_dir / f"h{count}.db") as store:
            for n in range(count):  # each about 100 kB of messages
                await save(store, f"app:{n}", conversation("r", f"i{n}", messages=50, size=1000))
            measured[count] = await peak(Stores(histories=(store,)), namespace="app")
    (small, small_bytes), (large, large_bytes) = measured[15], measured[60]
    print(
        f"conversations: N=15 {small_bytes} B peak {small} B; 4N=60 {large_bytes} B peak {large} B"
    )
    assert large_bytes > 3.9 * small_bytes
    assert large < 1.5 * small


async def test_exporting_a_session_of_4n_turns_takes_no_more_memory_than_n(
    private_dir: Path,
) -> None:
    measured: dict[int, tuple[int, int]] = {}
    for count in (300, 1200):
        async with SqliteMemoryStore(private_dir / f"m{count}.db") as memory:
            await memory.open_session("s", owner="u", agent_ref="a", mode="live")
            for _n in range(count):  # each about 4 kB
                await memory.append_turn("s", user="q" * 2000, replies=["r" * 2000])
            measured[count] = await peak(Stores(memory=memory), session="s")
    (small, small_bytes), (large, large_bytes) = measured[300], measured[1200]
    print(f"turns: N=300 {small_bytes} B peak {small} B; 4N=1200 {large_bytes} B peak {large} B")
    assert large_bytes > 3.9 * small_bytes
    assert large < 1.5 * small
