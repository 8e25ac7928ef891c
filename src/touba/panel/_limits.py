"""How many bytes of a request body the panel reads: before and after authentication.

A body is bounded before any of it is parsed, so a request from any local process (the
panel's ``Origin`` is easy to forge outside a browser) cannot make the panel hold more
than a few KiB before its token or session is checked:

- **Not logged in** (no live session cookie): at most :data:`LOGIN_BODY_BYTES`, the
  login form with its token and room to spare.
- **Logged in**: at most :data:`FORM_BODY_BYTES` for any form (the largest real one, a
  preview message or a key event, is far smaller).

A ``Content-Length`` above the limit is refused with 413 before a byte is read (the
server holds the rest to what it declared); a body sent without one (chunked) is read
here as it arrives, refused with 413 as soon as it passes the limit, and otherwise
handed to the page whole, so the panel never holds more than the limit and one chunk. The
refusal says which limit applied; the body is never echoed or logged.
"""

from __future__ import annotations

from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from typing import Final

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from touba.panel._auth import COOKIE, PanelAuth

__all__ = ["FORM_BODY_BYTES", "LOGIN_BODY_BYTES", "BodyLimit", "too_large"]

KiB: Final = 1024
LOGIN_BODY_BYTES: Final = 4 * KiB
FORM_BODY_BYTES: Final = 1024 * KiB


def too_large(limit: int, *, logged_in: bool) -> str:
    """The 413 page's text: which limit, and why."""
    if logged_in:
        return (
            f"This form is larger than the panel accepts ({limit // KiB} KiB); "
            "nothing was changed. Shorten what you typed and send it again."
        )
    return (
        f"A request before login may carry at most {limit // KiB} KiB (the token); "
        "nothing was read. Log in with the panel's token."
    )


class BodyLimit:
    """ASGI middleware bounding every request body (see the module docstring).

    ``auth``: the panel's sessions, to tell a logged-in request from another;
    ``refuse``: the 413 response for a request (rendered as the panel's error page).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        auth: PanelAuth,
        refuse: Callable[[Request, str], Response],
    ) -> None:
        self.app = app
        self.auth = auth
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        logged_in = self.auth.session(_cookie(headers.get("cookie"))) is not None
        limit = FORM_BODY_BYTES if logged_in else LOGIN_BODY_BYTES
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            response = self.refuse(Request(scope), too_large(limit, logged_in=logged_in))
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        if declared is None and scope["method"] not in ("GET", "HEAD"):
            # Chunked: read it here, up to the limit, then hand it over whole.
            body = await _read_bounded(receive, limit)
            if body is None:
                response = self.refuse(Request(scope), too_large(limit, logged_in=logged_in))
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


async def _read_bounded(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes ``limit`` (the rest never read)."""
    parts: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left: the app sees an empty body and its own disconnect
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then waits on the real one (disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _cookie(header: str | None) -> str | None:
    if not header:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except CookieError:
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None
