"""The typed errors of touba (SPEC section 11).

Every error carries ``code``, equal to its class name, and a message that says
what happened and what to do next. Local refusals (busy, limits, mismatch,
invalid summary, context guard) keep their own code: they are never attributed
to the model's output format and never trigger a provider retry.
"""

from __future__ import annotations

import unicodedata
from typing import ClassVar, Literal

__all__ = [
    "AgentBudgetExceeded",
    "AgentDecisionProviderSchemaViolation",
    "AgentDecisionProviderUnavailable",
    "CheckpointStoreUnavailable",
    "ConfigurationError",
    "DecisionHistoryBusy",
    "DecisionHistoryLimitExceeded",
    "DecisionHistoryMismatch",
    "DecisionHistoryRecordInvalid",
    "DecisionHistoryStorageUnsafe",
    "DecisionHistoryStoreUnavailable",
    "DecisionHistorySummaryInvalid",
    "ExtractionLeaseLost",
    "FlowStepFailed",
    "HistoryLimit",
    "InvocationBusy",
    "KeyEventInvalid",
    "MemoryStoreUnavailable",
    "ProviderContextCountUnavailable",
    "ProviderContextGuardUnsupported",
    "ProviderContextWindowExceeded",
    "ResourceAccessDenied",
    "ResourceAccessReason",
    "ResourceBindingUnavailable",
    "ToubaError",
]

HistoryLimit = Literal[
    "max_messages",
    "max_bytes",
    "max_retained_bytes",
    "max_sessions",
    "max_store_bytes",
]

ResourceAccessReason = Literal[
    "scope_not_declared",
    "no_scope_key",
    "permission_not_declared",
    "permission_not_granted",
]


class ToubaError(Exception):
    """Base class of every error touba raises on purpose."""

    code: ClassVar[str] = "ToubaError"
    transient: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = cls.__name__

    @property
    def message(self) -> str:
        """The human-readable message the error was raised with ("" when none)."""
        return str(self.args[0]) if self.args else ""

    @property
    def retryable(self) -> bool:
        """True when the same step may succeed later unchanged (a server down, a
        conversation busy, a full store): an invocation that fails with such an
        error keeps a checkpoint that ``runtime.resume`` continues. False when
        retrying cannot help (a budget spent, a model's bad output, a bound
        that the step itself exceeds): the invocation ends for good."""
        return self.transient


class ConfigurationError(ToubaError, ValueError):
    """touba was configured or called in a way it cannot honour; fix the call."""


class AgentDecisionProviderSchemaViolation(ToubaError):
    """A provider response arrived but held no valid typed decision."""

    def __init__(self, message: str, *, provider_error_code: str) -> None:
        super().__init__(message)
        self.provider_error_code = provider_error_code


_SERVER_MESSAGE_LIMIT = 500
"""Characters of a vendor's or server's error message kept in ``server_message``."""


_FORMAT_CONTROLS = frozenset("\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Line and paragraph separators and bidirectional overrides, removed like control characters."""


def _bounded_server_message(text: str | None) -> str | None:
    """``text`` without control characters (line breaks and tabs become spaces),
    stripped, at most 500 characters; None when empty."""
    if text is None:
        return None
    kept = "".join(
        (" " if c.isspace() else "")
        if unicodedata.category(c) == "Cc" or c in _FORMAT_CONTROLS
        else c
        for c in str(text)
    ).strip()
    if not kept:
        return None
    if len(kept) > _SERVER_MESSAGE_LIMIT:
        kept = kept[: _SERVER_MESSAGE_LIMIT - 3].rstrip() + "..."
    return kept


class _ServerAnswered(ToubaError):
    """An error that may carry what a vendor or server said (see the subclasses)."""

    transient = True

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        server_message: str | None = None,
        retryable: bool = True,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.server_message = _bounded_server_message(server_message)
        self._retryable = retryable

    def __str__(self) -> str:
        if self.server_message is None:
            return self.message
        return f'{self.message} (the server said: "{self.server_message}")'

    @property
    def retryable(self) -> bool:
        """True unless the vendor or server refused this very request (see the class)."""
        return self._retryable


class AgentDecisionProviderUnavailable(_ServerAnswered):
    """The transport or the provider failed; no decision was received; nothing was stored.

    ``status_code``: the HTTP status the vendor or server answered (None when no
    answer came: a connection failure, a timeout, a stream cut).
    ``server_message``: what it said in its error body (its ``message``, or a
    validation error's fields and reasons), at most 500 characters with control
    characters removed; None when the answer carried no message. It may quote
    parts of the request, so touba keeps it out of trace events, checkpoints,
    job records and logs: it is in ``str(error)`` (after touba's own words) and
    in this attribute, never in ``error.message``, which is touba's words only.

    ``retryable`` (see :attr:`ToubaError.retryable`) says whether the same request
    may succeed later: True for no answer, a timeout, HTTP 408, 409, 429 and a
    5xx server failure; False when the vendor or server refused the request
    itself: any other 4xx (a wrong key, an unknown model, a request it cannot
    take), or a 5xx whose message is a request validation or chat template
    error (llama-cpp-python answers both as HTTP 500). Then the message says
    what to change instead of "retry later".
    """


class AgentBudgetExceeded(ToubaError):
    """An invocation used its ``max_decisions`` without reaching a final output.

    ``max_decisions`` is the limit that was reached. Raise it on the agent
    (``program.agent(..., max_decisions=...)``) or give the model a task it
    can finish in fewer steps.
    """

    def __init__(self, message: str, *, max_decisions: int) -> None:
        super().__init__(message)
        self.max_decisions = max_decisions


class DecisionHistoryBusy(ToubaError):
    """Another operation holds this conversation (or held it and crashed)."""

    transient = True

    def __init__(self, message: str, *, session_key: str) -> None:
        super().__init__(message)
        self.session_key = session_key


class DecisionHistoryLimitExceeded(ToubaError):
    """A bound would be exceeded; nothing was written."""

    def __init__(self, message: str, *, limit: HistoryLimit) -> None:
        super().__init__(message)
        self.limit: HistoryLimit = limit

    @property
    def retryable(self) -> bool:
        """A full store may have room later; a conversation or window over its own
        bound will not."""
        return self.limit in ("max_sessions", "max_store_bytes")


class DecisionHistoryMismatch(ToubaError):
    """The stored conversation does not match the identity or observations given."""


class DecisionHistoryRecordInvalid(DecisionHistoryMismatch):
    """A stored record is corrupt or of a version this touba cannot read.

    A subclass of :class:`DecisionHistoryMismatch` (the stored state disagrees
    with what this process expects); it is never overwritten silently.
    """


class DecisionHistoryStoreUnavailable(ToubaError):
    """The history store's server or disk failed; nothing was saved.

    Raised by the PostgreSQL and Redis stores for driver failures during use,
    and by the SQLite store when its file fails (disk full, I/O error,
    read-only file system, a file that cannot be opened); the driver's or the
    OS's exception is chained and the previous state is kept. A conversation
    whose reservation could not be released either answers ``DecisionHistoryBusy``
    to other workers until the same store object's next operation on it releases
    it (by its token), or until recovered; the message says so when that happens.
    """

    transient = True


class DecisionHistorySummaryInvalid(ToubaError):
    """The host summariser returned something other than a bounded non-empty string."""


class DecisionHistoryStorageUnsafe(ToubaError):
    """The storage location could expose conversation data to other users."""


class ProviderContextWindowExceeded(ToubaError):
    """Even the minimal request does not fit the host's context window."""


class ProviderContextCountUnavailable(_ServerAnswered):
    """The provider's token count could not be obtained; nothing was generated.

    ``status_code``, ``server_message`` and ``retryable`` as on
    :class:`AgentDecisionProviderUnavailable`: a count request the vendor refused
    (a 4xx, a validation error) is not retryable, and what it said is in
    ``server_message`` and ``str(error)``, never in ``error.message``.
    """


class ProviderContextGuardUnsupported(ToubaError):
    """The context guard cannot vouch for this client or request shape."""


class KeyEventInvalid(ToubaError):
    """A key-event tool call had a wrong parameter (type, id, status, length).

    The message is safe to show to the model, and to keep in a job's
    ``last_error``: it names the parameter and, for a wrong type, the allowed
    types (and the configured type it nearly matches); the model's own value,
    or the name of a parameter it made up, is described by its type and size,
    never echoed. An id of another owner reads as not found.
    """

    def __init__(
        self,
        message: str,
        *,
        parameter: str | None = None,
        allowed_types: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.allowed_types = allowed_types


class MemoryStoreUnavailable(ToubaError):
    """The chat memory store failed, stayed locked, or holds data this touba cannot read.

    The driver's exception is chained; the step that failed wrote nothing.
    """

    transient = True


class ExtractionLeaseLost(ToubaError):
    """This worker no longer holds the extraction job's lease; nothing was changed.

    The lease expired and another worker claimed the job, or it was finished.
    Applied key-event operations are idempotent: the other worker's run is safe.
    """

    def __init__(self, message: str, *, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


class FlowStepFailed(ToubaError):
    """A step of a ``kind="flow"`` agent did not produce its output; the flow stopped.

    ``step`` names the step. A capability step fails when its call is denied
    (a check or a reviewer refused it), raises, or when a reference in its
    arguments finds nothing in the data it points at; a model step fails
    through the provider's own typed errors instead. Mark a capability step
    ``on_error="continue"`` to let the flow go on without its output.
    """

    def __init__(self, message: str, *, step: str) -> None:
        super().__init__(message)
        self.step = step


class ResourceAccessDenied(ToubaError):
    """A capability's read or write of a business resource was refused.

    ``reason``: ``scope_not_declared`` (the resource has no such scope),
    ``no_scope_key`` (this invocation has no trusted key for the scope, e.g.
    no user id), ``permission_not_declared`` (the capability does not declare
    the resource's permission) or ``permission_not_granted`` (the agent is not
    granted it). Raised inside the capability, which may catch it; otherwise
    its call ends in an ``error`` observation. Nothing was read or written.
    """

    def __init__(
        self, message: str, *, resource: str, operation: str, reason: ResourceAccessReason
    ) -> None:
        super().__init__(message)
        self.resource = resource
        self.operation = operation
        self.reason: ResourceAccessReason = reason


class CheckpointStoreUnavailable(ToubaError):
    """The checkpoint store's server or file failed, or stayed locked.

    Raised by ``touba.runtime.PostgresCheckpointStore`` for driver failures
    during use, and by ``SqliteCheckpointStore`` when its file fails or
    another connection keeps it locked past ``timeout`` (the driver's
    exception is chained). The operation's transaction was rolled back,
    unless the connection broke during its COMMIT: then it may have
    committed, and ``get``/``list`` tell which.
    """

    transient = True


class ResourceBindingUnavailable(ToubaError):
    """The resource binding's server or file failed, or stayed locked.

    Raised by ``touba.runtime.PostgresResourceBinding`` for driver failures
    during use, and by ``SqliteResourceBinding`` when its file fails or stays
    locked past ``timeout`` (the driver's exception is chained), inside the
    capability that made the operation. As for checkpoints, the write was
    rolled back unless the connection broke during its COMMIT.
    """

    transient = True


class InvocationBusy(ConfigurationError):
    """A checkpoint belongs to an invocation that a worker is running (or ran and crashed).

    A :class:`ConfigurationError` (this resume cannot be honoured now), like
    the resume of a checkpoint already consumed.

    ``holder`` describes that worker (``worker_id``, ``pid``, ``host``,
    ``since``). Wait for it; if it crashed, stop and check it, then resume with
    ``runtime.resume(checkpoint_id, worker_stopped=True)``: calls it had started
    are answered as of unknown outcome, never run again.
    """

    transient = True

    def __init__(self, message: str, *, checkpoint_id: str, holder: dict[str, object]) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.holder = holder
