"""Which conversations are damaged, read for the panel's pages (see :mod:`touba.panel._repair`)."""

from __future__ import annotations

from typing import Any

from touba.history import RawConversation, RecordProblem, check_record

__all__ = ["damaged_counts", "problems_of", "raw_of"]


async def raw_of(store: Any, key: str) -> RawConversation | None:
    read_raw = getattr(store, "read_raw", None)
    if read_raw is None:  # a store of the application's own, without the primitive
        return None
    found: RawConversation | None = await read_raw(key)
    return found


async def problems_of(store: Any, key: str) -> list[RecordProblem]:
    """The problems of conversation ``key`` (empty when healthy, absent or unknown)."""
    raw = await raw_of(store, key)
    return [] if raw is None else check_record(raw)


async def damaged_counts(store: Any, keys: list[str]) -> dict[str, int]:
    """How many problems each damaged conversation of ``keys`` has (healthy ones left out)."""
    counts = {}
    for key in keys:
        problems = await problems_of(store, key)
        if problems:
            counts[key] = len(problems)
    return counts
