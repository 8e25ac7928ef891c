"""Chat memory settings (SPEC section 8, seed 004): the panel's "Mémoire" tab.

:class:`MemoryConfig` and :class:`KeyEventsConfig` are defined in
:mod:`touba.runtime._memory_config`, below this package, because
``Program.agent(memory=...)`` checks them when an agent is defined; this
package exports them under the same names and stores them as JSON data.
"""

from __future__ import annotations

from touba.runtime._memory_config import KeyEventsConfig, MemoryConfig

__all__ = ["KeyEventsConfig", "MemoryConfig", "config_from_data", "config_to_data"]


def config_to_data(config: MemoryConfig) -> dict[str, object]:
    """The settings as JSON data (what ``save_memory_config`` stores)."""
    return {
        "short_term_turns": config.short_term_turns,
        "full_context_turns": config.full_context_turns,
        "key_events": {
            "enabled": config.key_events.enabled,
            "types": list(config.key_events.types),
        },
    }


def config_from_data(data: object) -> MemoryConfig:
    """Settings from :func:`config_to_data`'s shape; ``ValueError`` on anything else
    (``ConfigurationError`` is one), with the message ``MemoryConfig`` gives."""
    if not isinstance(data, dict):
        raise ValueError(f"saved memory settings must be a JSON object, got {data!r:.100}")
    events = data.get("key_events", {})
    if not isinstance(events, dict):
        raise ValueError("saved memory settings: key_events must be a JSON object")
    types = events.get("types", [])
    return MemoryConfig(
        short_term_turns=data.get("short_term_turns", 30),
        full_context_turns=data.get("full_context_turns", 1),
        key_events=KeyEventsConfig(
            enabled=events.get("enabled", False),
            types=tuple(types) if isinstance(types, list) else types,
        ),
    )
