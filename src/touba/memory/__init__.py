"""Chat memory across turns and key events across sessions (SPEC sections 8 and 9).

``PostgresMemoryStore`` is imported on first use, so psycopg stays optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from touba.memory._config import KeyEventsConfig, MemoryConfig
from touba.memory._extraction import ExtractionQueue, parse_ops
from touba.memory._key_events import KeyEventService, owner_for, render_key_events_block
from touba.memory._model import (
    CreateEventOp,
    EffectiveMemoryConfig,
    ExtractionJob,
    FieldChange,
    KeyEvent,
    KeyEventUpdate,
    MemoryConfigChange,
    SavedMemoryConfig,
    SessionMeta,
    StoredTurn,
    UpdateEventOp,
)
from touba.memory._session import ChatSession, ChatStream, ChatTurn
from touba.memory._store import MemoryStore, resolve_memory_settings
from touba.memory._window import select_prior_turns
from touba.memory._worker import ExtractionWorker
from touba.memory.sqlite import SqliteMemoryStore

if TYPE_CHECKING:
    from touba.memory.postgres import PostgresMemoryStore

__all__ = [
    "ChatSession",
    "ChatStream",
    "ChatTurn",
    "CreateEventOp",
    "EffectiveMemoryConfig",
    "ExtractionJob",
    "ExtractionQueue",
    "ExtractionWorker",
    "FieldChange",
    "KeyEvent",
    "KeyEventService",
    "KeyEventUpdate",
    "KeyEventsConfig",
    "MemoryConfig",
    "MemoryConfigChange",
    "MemoryStore",
    "PostgresMemoryStore",
    "SavedMemoryConfig",
    "SessionMeta",
    "SqliteMemoryStore",
    "StoredTurn",
    "UpdateEventOp",
    "owner_for",
    "parse_ops",
    "render_key_events_block",
    "resolve_memory_settings",
    "select_prior_turns",
]


def __getattr__(name: str) -> Any:
    if name == "PostgresMemoryStore":
        from touba.memory.postgres import PostgresMemoryStore

        return PostgresMemoryStore
    raise AttributeError(f"module 'touba.memory' has no attribute {name!r}")
