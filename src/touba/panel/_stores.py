"""What the panel needs of the stores it is given, as protocols (the built-in ones fit)."""

from __future__ import annotations

from typing import Protocol

from touba.history._store import AdminStore
from touba.memory import (
    ExtractionJob,
    KeyEvent,
    MemoryStore,
    SessionMeta,
    StoredTurn,
)
from touba.memory._model import JobStatus, KeyEventStatus, OwnerSummary, SessionMode
from touba.memory._store import MemoryConfigStore

__all__ = ["HistoryView", "MemoryAdmin"]


class MemoryAdmin(MemoryStore, MemoryConfigStore, Protocol):
    """A memory store with saved settings and the operator's paged reads
    (``SqliteMemoryStore`` and ``PostgresMemoryStore``)."""

    async def count_sessions(
        self, *, owner: str | None = None, mode: SessionMode | None = None
    ) -> int: ...

    async def count_owners(self, *, mode: SessionMode | None = None) -> int: ...

    async def list_owners(
        self, *, limit: int = 50, offset: int = 0, mode: SessionMode | None = None
    ) -> list[OwnerSummary]: ...

    async def list_sessions(
        self,
        *,
        owner: str | None = None,
        limit: int = 100,
        offset: int = 0,
        mode: SessionMode | None = None,
    ) -> list[SessionMeta]: ...

    async def list_turns(
        self, session_id: str, *, limit: int = 50, offset: int = 0, newest_first: bool = False
    ) -> tuple[StoredTurn, ...]: ...

    async def query_events(
        self,
        owner: str,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
        limit: int = 20,
        offset: int = 0,
    ) -> list[KeyEvent]: ...

    async def count_events(
        self,
        owner: str,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
    ) -> int: ...

    async def query_all_events(
        self,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
        limit: int = 20,
        offset: int = 0,
    ) -> list[KeyEvent]: ...

    async def count_all_events(
        self,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
    ) -> int: ...

    async def list_jobs(
        self, *, status: JobStatus | None = None, limit: int = 100, offset: int = 0
    ) -> list[ExtractionJob]: ...

    async def count_jobs(self) -> dict[str, int]: ...


HistoryView = AdminStore
"""A built-in decision-history store, as the panel administers it."""
