"""Encryption at rest of the memory store: a chat turn's store work, sealed versus plain.

One chat turn touches its memory store twice: it appends the turn and reads the
recent ones (the prompt's short-term memory). This measures that pair on a
SQLite memory store with and without ``encryption=`` (AES-GCM, one token per
column), interleaved so that both sides see the same machine load, and prints
the ratio sealed / plain of the median. A session grows to ``--turns`` turns, and
each read fetches the last ``--recent`` (``short_term_turns``, 30 by default)
turns of about ``--bytes`` bytes of text each.

    .venv/bin/python bench/memory_encryption.py [--turns 200] [--recent 30] [--bytes 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from touba import Encryption
from touba.memory import SqliteMemoryStore


async def one_round(store: SqliteMemoryStore, n: int, size: int, recent: int) -> float:
    started = time.perf_counter()
    await store.append_turn("s", user=f"{n} " + "q" * size, replies=["a" * size])
    turns = await store.recent_turns("s", recent)
    elapsed = time.perf_counter() - started
    assert turns[-1].user.startswith(f"{n} ")
    return elapsed


def private_directory() -> Path:
    directory = Path(tempfile.mkdtemp())
    directory.chmod(0o700)
    return directory


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--recent", type=int, default=30)
    parser.add_argument("--bytes", type=int, default=2000)
    args = parser.parse_args()
    directory = private_directory()
    sealed = Encryption(keys={"k": os.urandom(32)}, current="k")
    stores = {
        "plain": SqliteMemoryStore(directory / "plain.db"),
        "sealed": SqliteMemoryStore(directory / "sealed.db", encryption=sealed),
    }
    timings: dict[str, list[float]] = {name: [] for name in stores}
    try:
        for store in stores.values():
            await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
        for n in range(args.turns):
            for name, store in stores.items():
                timings[name].append(await one_round(store, n, args.bytes, args.recent))
    finally:
        for store in stores.values():
            await store.close()
    plain, sealed_median = (statistics.median(timings[k]) for k in ("plain", "sealed"))
    print(
        f"memory store, append + recent_turns({args.recent}) of ~{args.bytes} B turns, "
        f"{args.turns} rounds: plain {plain * 1000:.2f} ms, sealed {sealed_median * 1000:.2f} ms, "
        f"ratio sealed/plain {sealed_median / plain:.2f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
