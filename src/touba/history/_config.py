"""``HistoryConfig`` and ``HistoryEvent`` (SPEC section 3), ``SummaryRequest`` (section 5)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final, Literal

from touba.errors import ConfigurationError
from touba.history._common import MiB

if TYPE_CHECKING:
    from touba.history._store import HistoryStore

__all__ = [
    "Continuity",
    "EventKind",
    "HistoryConfig",
    "HistoryEvent",
    "Summarizer",
    "SummaryFailure",
    "SummaryRequest",
]

Continuity = Literal["inline", "opaque_refs"]
SummaryFailure = Literal["refuse", "trim"]
EventKind = Literal[
    "history_window",
    "history_trimmed",
    "decision_history_summary",
    "decision_history_summary_failed",
    "provider_context_count",
    "resumed_without_messages",
    "history_store_pressure",
    "history_repaired",
]


@dataclass(frozen=True, slots=True)
class SummaryRequest:
    """What a host summariser receives.

    ``turns`` holds only the exchanges that left the context since the
    previous summary, oldest first, each a tuple of message dicts with
    provider-opaque data removed (and raw arguments already projected away in
    ``opaque_refs`` continuity).
    """

    previous_summary: str | None
    turns: tuple[tuple[dict[str, Any], ...], ...]
    max_bytes: int


Summarizer = Callable[[SummaryRequest], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class HistoryEvent:
    """An observable fact about a history window. Never carries content.

    ``message_count`` and ``bytes`` describe the history window being sent
    (instructions, capability catalog and invocation input excluded). The
    other fields are set only for the kinds that define them.

    ``decision_history_summary_failed`` (no extra field) says that the
    summariser failed and, with ``HistoryConfig(on_summary_failure="trim")``,
    this decision was sent without a summary, trimmed plainly.
    ``provider_context_count`` also gives ``prior_turns``: the earlier chat
    turns in the request it counted (the guard drops them first).
    ``history_repaired`` (a stored conversation repaired, see
    :func:`~touba.history.plan_repair`): ``message_count`` and ``bytes`` of the
    repaired record, ``count`` problems found, ``removed_messages`` rows dropped
    or changed, ``added_messages`` results added, ``repaired_kinds`` the kinds of
    problem, comma-separated.
    """

    kind: EventKind
    session_key: str
    message_count: int
    bytes: int
    removed_exchanges: int | None = None
    removed_messages: int | None = None
    removed_bytes: int | None = None
    covered_exchanges: int | None = None
    fingerprint: str | None = None
    summary_bytes: int | None = None
    provider: str | None = None
    count: int | None = None
    reserve: int | None = None
    window: int | None = None
    fits: bool | None = None
    used_sessions: int | None = None
    max_sessions: int | None = None
    used_bytes: int | None = None
    max_store_bytes: int | None = None
    prior_turns: int | None = None
    added_messages: int | None = None
    repaired_kinds: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON-ready data, without the fields its kind does not use."""
        # Every field is a str, an int or a bool: no deep copy (dataclasses.asdict's).
        return {k: v for k in _EVENT_FIELDS if (v := getattr(self, k)) is not None}


_EVENT_FIELDS: Final = tuple(f.name for f in fields(HistoryEvent))


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"HistoryConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryConfig:
    """Bounds, storage and options of a decision history (SPEC section 3).

    ``on_summary_failure`` decides what a decision does when ``summarize``
    fails (raises, or returns no valid summary): ``"refuse"`` (the default)
    refuses it with ``DecisionHistorySummaryInvalid``, nothing written (an
    exception of the callback's own is chained to it as its ``__cause__``; a
    touba error, such as ``ModelSummarizer``'s provider errors, is raised as it
    is);
    ``"trim"`` sends it without a summary, its window chosen as if no
    summariser were configured, keeps the previous summary state for the
    next decision to try again, and emits ``decision_history_summary_failed``.
    """

    max_messages: int = 128
    max_bytes: int = 262144
    max_retained_bytes: int = 8 * MiB
    store: HistoryStore | None = None
    namespace: str | None = None
    on_event: Callable[[HistoryEvent], Any] | None = None
    summarize: Summarizer | None = None
    max_summary_bytes: int = 4096
    continuity: Continuity = "inline"
    on_summary_failure: SummaryFailure = "refuse"

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_bytes", "max_retained_bytes", "max_summary_bytes"):
            _positive(name, getattr(self, name))
        if self.continuity not in ("inline", "opaque_refs"):
            raise ConfigurationError(
                f"HistoryConfig.continuity must be 'inline' or 'opaque_refs', got "
                f"{self.continuity!r}"
            )
        if self.on_summary_failure not in ("refuse", "trim"):
            raise ConfigurationError(
                "HistoryConfig.on_summary_failure must be 'refuse' or 'trim', got "
                f"{self.on_summary_failure!r}"
            )
        if self.namespace is not None and (
            not isinstance(self.namespace, str) or not self.namespace
        ):
            raise ConfigurationError("HistoryConfig.namespace must be a non-empty str")
        if self.store is not None:
            if self.namespace is None:
                raise ConfigurationError(
                    "HistoryConfig.namespace is required with a store: set it from trusted "
                    "application configuration (never from the model) so that applications "
                    "and tenants sharing the store stay apart"
                )
            if not callable(getattr(self.store, "transact", None)):
                raise ConfigurationError(
                    "HistoryConfig.store must implement transact(key, operation)"
                )
        for name in ("on_event", "summarize"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigurationError(f"HistoryConfig.{name} must be callable")
        if self.summarize is not None and self.max_summary_bytes >= self.max_bytes:
            raise ConfigurationError(
                f"HistoryConfig.max_summary_bytes ({self.max_summary_bytes}) must be smaller "
                f"than max_bytes ({self.max_bytes}): a summary must fit in the window"
            )
