"""The settings form of an agent, to and from ``MemoryConfig`` (pure, no I/O).

Validation is ``MemoryConfig``'s own: each field is checked by building the
config class with that field alone, so the message shown next to a field is
exactly the one ``MemoryConfig`` (or ``KeyEventsConfig``) raises. A number
typed as text that is not an integer is handed over as the text, for the
same reason (``got 'abc'``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from touba.errors import ConfigurationError
from touba.memory import KeyEventsConfig, MemoryConfig

__all__ = ["DEFAULT_SHORT_TERM", "SettingsForm", "parse_settings"]

DEFAULT_SHORT_TERM = MemoryConfig().short_term_turns
_INTEGER = re.compile(r"[+-]?\d{1,9}")


def _number(text: str) -> int | str:
    stripped = text.strip()
    return int(stripped) if _INTEGER.fullmatch(stripped) else text


@dataclass(slots=True)
class SettingsForm:
    """What the form shows: the values as typed, and an error per field."""

    short_term_on: bool
    short_term_turns: str
    full_context_turns: str
    key_events_on: bool
    types: str
    errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, config: MemoryConfig) -> SettingsForm:
        turns = config.short_term_turns
        return cls(
            short_term_on=turns > 0,
            short_term_turns=str(turns if turns > 0 else DEFAULT_SHORT_TERM),
            full_context_turns=str(config.full_context_turns),
            key_events_on=config.key_events.enabled,
            types="\n".join(config.key_events.types),
        )


def _types(text: str) -> tuple[str, ...]:
    """One type per line, kept exactly (spaces count); only empty lines are skipped."""
    return tuple(line.rstrip("\r") for line in text.split("\n") if line.rstrip("\r") != "")


def parse_settings(form: Mapping[str, str]) -> tuple[MemoryConfig | None, SettingsForm]:
    """The config the form describes, or None and the form with its errors."""
    shown = SettingsForm(
        short_term_on=form.get("short_term_on") == "on",
        short_term_turns=form.get("short_term_turns", ""),
        full_context_turns=form.get("full_context_turns", ""),
        key_events_on=form.get("key_events_on") == "on",
        types=form.get("types", ""),
    )
    values: dict[str, object] = {}
    short: object = _number(shown.short_term_turns) if shown.short_term_on else 0
    full: object = _number(shown.full_context_turns)
    checks: tuple[tuple[str, object], ...] = (
        ("short_term_turns", short),
        ("full_context_turns", full),
    )
    for name, value in checks:
        try:
            MemoryConfig(**{name: value})  # type: ignore[arg-type]
            values[name] = value
        except ConfigurationError as e:
            shown.errors[name] = str(e)
    try:
        values["key_events"] = KeyEventsConfig(
            enabled=shown.key_events_on, types=_types(shown.types)
        )
    except ConfigurationError as e:
        shown.errors["types"] = str(e)
    if shown.errors:
        return None, shown
    return MemoryConfig(**values), shown  # type: ignore[arg-type]
