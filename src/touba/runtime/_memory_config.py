"""The chat memory settings an agent is defined with (SPEC section 8, seed 004).

:class:`MemoryConfig` and :class:`KeyEventsConfig` are plain, validated data.
They live in the runtime, below :mod:`touba.memory`, because
``Program.agent(memory=...)`` checks an agent's settings when it is defined
(a :class:`~touba.errors.ConfigurationError` at once, not at the first turn),
while the layer that applies them, chat memory, sits above the runtime.
:mod:`touba.memory` exports both under the same names; the runtime itself
only carries them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from touba.errors import ConfigurationError

__all__ = ["KeyEventsConfig", "MemoryConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyEventsConfig:
    """The key-event switch and the allowed event types.

    Tools and injection need both: ``enabled`` true **and** at least one type.
    An empty ``types`` is valid; the switch then has no effect (not a fault).
    Types are matched exactly, case and spaces included.
    """

    enabled: bool = False
    types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigurationError(
                f"KeyEventsConfig.enabled must be a bool, got {self.enabled!r}"
            )
        types: object = self.types
        if isinstance(types, str) or not all(isinstance(t, str) for t in self.types):
            raise ConfigurationError(
                "KeyEventsConfig.types must be a sequence of type names, e.g. ('refund',)"
            )
        object.__setattr__(self, "types", tuple(self.types))
        for name in self.types:
            if not name.strip():
                raise ConfigurationError("KeyEventsConfig.types holds an empty type name")
        duplicates = sorted({t for t in self.types if self.types.count(t) > 1})
        if duplicates:
            raise ConfigurationError(f"KeyEventsConfig.types repeats {duplicates}")

    @property
    def active(self) -> bool:
        """Whether key-event tools and injection apply (switch on and a type configured)."""
        return self.enabled and bool(self.types)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryConfig:
    """How much of earlier turns an agent sees, and its key events.

    ``short_term_turns``: the last N turns sent as text (0: the agent forgets
    the previous turn). ``full_context_turns`` (0..5): the last M of them also
    carry their complete tool trace; the two settings are independent.
    """

    short_term_turns: int = 30
    full_context_turns: int = 1
    key_events: KeyEventsConfig = field(default_factory=KeyEventsConfig)

    def __post_init__(self) -> None:
        turns = self.short_term_turns
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 0:
            raise ConfigurationError(
                f"MemoryConfig.short_term_turns must be an int >= 0 (0 disables), got {turns!r}"
            )
        full = self.full_context_turns
        if isinstance(full, bool) or not isinstance(full, int) or not 0 <= full <= 5:
            raise ConfigurationError(
                f"MemoryConfig.full_context_turns must be an int from 0 to 5, got {full!r}"
            )
        if not isinstance(self.key_events, KeyEventsConfig):
            raise ConfigurationError("MemoryConfig.key_events must be a touba.KeyEventsConfig")
