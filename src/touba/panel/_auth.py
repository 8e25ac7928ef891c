"""The panel's sessions, token exchange, CSRF and origin checks (decisions: see the package).

Pure bookkeeping, no I/O: a :class:`PanelAuth` holds the access token and the
operator sessions that exchanged it (in this process's memory: a restart of
the panel logs everyone out, and the token is needed again).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

__all__ = [
    "COOKIE",
    "CSRF_FIELD",
    "CSRF_HEADER",
    "MAX_SESSIONS",
    "SESSION_SECONDS",
    "OperatorSession",
    "PanelAuth",
    "new_token",
    "same_origin",
]

COOKIE: Final = "touba_panel"
CSRF_FIELD: Final = "csrf"
CSRF_HEADER: Final = "x-csrf-token"
MAX_SESSIONS: Final = 64
SESSION_SECONDS: Final = 12 * 3600
MIN_TOKEN_CHARS: Final = 16


def new_token() -> str:
    """A fresh access token (32 random bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


@dataclass(slots=True)
class OperatorSession:
    """One browser that exchanged the token: its CSRF token and one-shot messages."""

    session_id: str
    csrf: str
    created: float
    flashes: list[tuple[str, str]] = field(default_factory=list)
    previews: dict[str, str] = field(default_factory=dict)

    def flash(self, kind: str, text: str) -> None:
        """Queue a message shown once on the next page (``kind``: ok or error)."""
        self.flashes.append((kind, text))
        del self.flashes[:-5]

    def take_flashes(self) -> list[tuple[str, str]]:
        taken, self.flashes = self.flashes, []
        return taken


class PanelAuth:
    """The access token and the sessions that exchanged it.

    ``token``: at least 16 characters (``ValueError`` otherwise). Comparisons
    of the token and of CSRF tokens are constant-time. At most
    :data:`MAX_SESSIONS` sessions are kept (the oldest is dropped), each for
    :data:`SESSION_SECONDS`.
    """

    def __init__(self, token: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"the panel token must be a str of at least {MIN_TOKEN_CHARS} characters"
            )
        self._token = token.encode("utf-8")
        self._clock = clock
        self._sessions: OrderedDict[str, OperatorSession] = OrderedDict()

    def token_matches(self, candidate: str | None) -> bool:
        """Whether ``candidate`` is the access token (constant-time)."""
        if not candidate:
            return False
        return hmac.compare_digest(candidate.encode("utf-8"), self._token)

    def login(self) -> OperatorSession:
        """A new operator session (call only after ``token_matches``)."""
        session = OperatorSession(
            secrets.token_urlsafe(32), secrets.token_urlsafe(32), self._clock()
        )
        self._sessions[session.session_id] = session
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    def session(self, session_id: str | None) -> OperatorSession | None:
        """The live session of a cookie value, or None (unknown or expired)."""
        if not session_id:
            return None
        found = None
        for known, candidate in self._sessions.items():  # constant-time on each id
            if hmac.compare_digest(known.encode("utf-8"), session_id.encode("utf-8")):
                found = candidate
        if found is None:
            return None
        if self._clock() - found.created > SESSION_SECONDS:
            self.logout(found.session_id)
            return None
        return found

    def logout(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    @staticmethod
    def csrf_matches(session: OperatorSession, candidate: str | None) -> bool:
        """Whether ``candidate`` is the session's CSRF token (constant-time)."""
        if not candidate:
            return False
        return hmac.compare_digest(candidate.encode("utf-8"), session.csrf.encode("utf-8"))


def same_origin(
    origin: str | None, referer: str | None, host: str | None, *, https_allowed: bool
) -> bool:
    """Whether a state-changing request comes from the panel's own pages.

    ``Origin`` (or, when a browser sent none, ``Referer``) must name the
    scheme, host and port the request was sent to (``Host``); ``https`` is
    accepted only when the panel sits behind a TLS proxy (``https_allowed``).
    A request with neither header is refused: browsers send ``Origin`` on
    every POST.
    """
    if not host:
        return False
    source = origin if origin and origin != "null" else None
    if source is None and referer:
        parts = urlsplit(referer)
        source = f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else None
    if source is None:
        return False
    schemes = ("http", "https") if https_allowed else ("http",)
    return any(hmac.compare_digest(source, f"{scheme}://{host}") for scheme in schemes)
