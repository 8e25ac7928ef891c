"""The checks every ADK backend makes, and the errors they raise, written once.

A backend reads the session's stored fields inside its atomic step and calls
these in the order :meth:`AdkBackend.append` gives; each raises the typed error
with the same message on every store. Pure functions over plain values.
"""

from __future__ import annotations

from google.adk.errors import StaleSessionError
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.errors.session_not_found_error import SessionNotFoundError

from touba.errors import DecisionHistoryBusy, DecisionHistoryLimitExceeded
from touba.integrations.adk._backend import AdkLimits, AppendRequest, SessionKey, busy_key

__all__ = [
    "STALE_MESSAGE",
    "already_exists",
    "check_event_bytes",
    "check_hold",
    "check_hold_for",
    "check_session_bytes",
    "check_sessions",
    "check_stale",
    "expires_at",
    "hold_after",
    "is_expired",
    "is_held",
    "not_found",
]

STALE_MESSAGE = (
    "the session was modified in storage since this copy was read (another writer "
    "appended to it); reload it with get_session and append again. Nothing was written"
)


def not_found(key: SessionKey) -> SessionNotFoundError:
    """ADK's error for a session that is absent or expired."""
    return SessionNotFoundError(
        f"Session {key.session_id!r} of user {key.user_id!r} in app {key.app_name!r} "
        "not found (never created, deleted or expired); nothing was written."
    )


def already_exists(key: SessionKey) -> AlreadyExistsError:
    """ADK's error for a create of a key that is stored."""
    return AlreadyExistsError(
        f"Session with id {key.session_id} already exists (user {key.user_id!r}, app "
        f"{key.app_name!r}); the stored session was kept."
    )


def is_expired(expires: float | None, now: float) -> bool:
    """True when a session with this expiry is gone as of ``now``."""
    return expires is not None and expires <= now


def expires_at(limits: AdkLimits, now: float) -> float | None:
    """A written session's new expiry."""
    return None if limits.ttl_seconds is None else now + limits.ttl_seconds


def is_held(holder: str | None, hold_until: float | None, now: float) -> bool:
    """True when a hold is live as of ``now``."""
    return holder is not None and hold_until is not None and hold_until > now


def check_hold(
    key: SessionKey, holder: str | None, hold_until: float | None, request: AppendRequest
) -> None:
    """Refuse an append while another owner holds the session."""
    if is_held(holder, hold_until, request.now) and holder != request.owner:
        raise DecisionHistoryBusy(
            "another run is writing to this ADK session (a concurrent run_async on it); "
            "nothing was written. Wait for it to finish, or, if it crashed, call "
            "ToubaSessionService.recover(...) or let its hold expire",
            session_key=busy_key(key),
        )


def check_hold_for(
    key: SessionKey, holder: str | None, hold_until: float | None, owner: str, now: float
) -> None:
    """Refuse a hold while another owner holds the session."""
    if is_held(holder, hold_until, now) and holder != owner:
        raise DecisionHistoryBusy(
            "another run holds this ADK session (ToubaSessionService.exclusive); wait for it "
            "to finish, or, if it crashed, call ToubaSessionService.recover(...) or let its "
            "hold expire",
            session_key=busy_key(key),
        )


def hold_after(
    limits: AdkLimits, holder: str | None, hold_until: float | None, request: AppendRequest
) -> tuple[str | None, float | None]:
    """The hold (owner, until) a committed append leaves."""
    if request.owner is None:
        return (holder, hold_until) if is_held(holder, hold_until, request.now) else (None, None)
    if request.release:
        return None, None
    return request.owner, request.now + limits.hold_seconds


def check_stale(revision: int, update_time: float, request: AppendRequest) -> None:
    """Refuse an append from an outdated copy (see :class:`AppendRequest`)."""
    if request.expected_revision is not None:
        stale = revision != request.expected_revision
    elif request.expected_update_time is not None:
        stale = update_time > request.expected_update_time
    else:
        stale = False
    if stale:
        raise StaleSessionError(STALE_MESSAGE)


def check_event_bytes(limits: AdkLimits, size: int) -> None:
    """Refuse one event over ``max_event_bytes``."""
    if limits.max_event_bytes is not None and size > limits.max_event_bytes:
        raise DecisionHistoryLimitExceeded(
            f"this event's JSON is {size} bytes, over max_event_bytes="
            f"{limits.max_event_bytes}; nothing was written. Store large content elsewhere "
            "(an artifact) or raise the bound",
            limit="max_bytes",
        )


def check_session_bytes(limits: AdkLimits, byte_count: int, size: int) -> None:
    """Refuse an event that would take the session over ``max_session_bytes``."""
    if limits.max_session_bytes is not None and byte_count + size > limits.max_session_bytes:
        raise DecisionHistoryLimitExceeded(
            f"the session holds {byte_count} bytes of events and this one adds {size}, over "
            f"max_session_bytes={limits.max_session_bytes}; nothing was written. Start a new "
            "session or raise the bound",
            limit="max_retained_bytes",
        )


def check_sessions(limits: AdkLimits, live_sessions: int) -> None:
    """Refuse a create when ``max_sessions`` unexpired sessions are stored."""
    if limits.max_sessions is not None and live_sessions >= limits.max_sessions:
        raise DecisionHistoryLimitExceeded(
            f"the store holds {live_sessions} sessions, its max_sessions; nothing was "
            "written. Delete sessions, set ttl_seconds so that old ones expire, or raise "
            "the bound",
            limit="max_sessions",
        )
