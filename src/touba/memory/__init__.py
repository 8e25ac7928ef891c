"""Chat memory across turns and key events across sessions (SPEC sections 8 and 9)."""

from touba.memory._config import KeyEventsConfig, MemoryConfig

__all__ = ["KeyEventsConfig", "MemoryConfig"]
