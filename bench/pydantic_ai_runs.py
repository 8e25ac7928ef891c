"""Per-run cost of pydantic-ai's ``ToubaConversations`` against retained history size.

``ToubaConversations.open`` keeps each conversation as an append-only log of
turns (:mod:`touba.integrations._turns_log`): a run reads the last turn, the
sizes of the earlier turns its window can reach and the messages the window
keeps, then appends what it adds. So a run should cost the same whatever the
conversation holds (until issue 11's tenth session each run loaded, validated
and rewrote the whole record: about 1 s at 10,000 messages).

For each store, conversations holding N = 10, 100, 1,000 and 10,000 messages
(1 KiB turns: a user prompt and a text response) are run in interleaved
rounds: ``open``, ``extend`` with one turn, leave the block (the save). The
window the model would be sent is bounded (``max_messages=16``, or with
``--max-bytes N`` by bytes alone, which the log reads back in widening steps),
so it is the same at every size. Printed: the median ms per run and the ratio to N = 10.
Benchmarks are not tests: nothing here asserts a time.

    .venv/bin/python bench/pydantic_ai_runs.py [--rounds 20] [--stores memory,sqlite,postgres,redis]
        [--max-bytes 16000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, UserPromptPart

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.history_cost import open_store
from touba.history._common import MiB
from touba.integrations.pydantic_ai import ToubaConversations

SIZES = (10, 100, 1_000, 10_000)
SEED_BATCH = 500


def turn(n: int) -> list[ModelMessage]:
    """A user prompt and a text response of about 512 bytes each."""
    return [
        ModelRequest(parts=[UserPromptPart(content=f"q{n} " + "x" * 500)]),
        ModelResponse(parts=[TextPart(content=f"a{n} " + "y" * 500)]),
    ]


async def run_store(
    kind: str, rounds: int, bound: dict[str, int], report: Callable[[str], None]
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        async with open_store(kind, Path(directory)) as store:
            conversations = ToubaConversations(
                store, namespace="bench", max_retained_bytes=1024 * MiB, **bound
            )
            for size in SIZES:  # seeded through the adapter itself, in a few runs
                for start in range(0, size // 2, SEED_BATCH):
                    async with conversations.open(f"c{size}") as conversation:
                        for n in range(start, min(size // 2, start + SEED_BATCH)):
                            conversation.extend(turn(n))
            timings: dict[int, list[float]] = {size: [] for size in SIZES}
            for r in range(rounds):
                shift = r % len(SIZES)
                for size in SIZES[shift:] + SIZES[:shift]:
                    started = time.perf_counter()
                    async with conversations.open(f"c{size}") as conversation:
                        conversation.extend(turn(1_000_000 + r))
                    timings[size].append(time.perf_counter() - started)
    report(
        f"\n{kind}: median ms per run (open, extend with one turn, save; window bound {bound}), "
        "ratio to N = 10"
    )
    base = statistics.median(timings[SIZES[0]])
    for size in SIZES:
        median = statistics.median(timings[size])
        report(f"{size:>8,}  {median * 1e3:9.2f}  {median / base:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--stores", default="memory,sqlite,postgres,redis")
    parser.add_argument("--max-bytes", type=int, default=None, help="bound the window by bytes")
    args = parser.parse_args()

    async def run() -> None:
        for kind in args.stores.split(","):
            bound = {"max_bytes": args.max_bytes} if args.max_bytes else {"max_messages": 16}
            await run_store(kind, args.rounds, bound, print)

    asyncio.run(run())


if __name__ == "__main__":
    main()
