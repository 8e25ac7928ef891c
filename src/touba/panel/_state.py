"""``Panel``, the state every route shares, and the session cookie it sets.

Below both :mod:`touba.panel._app` (which builds the application around a
``Panel``) and :mod:`touba.panel._routes` (whose pages read it from
``request.app.state``), so that the application imports the routes and
nothing imports back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from fastapi.responses import HTMLResponse
from jinja2 import Environment

from touba.panel._auth import COOKIE, SESSION_SECONDS, OperatorSession, PanelAuth
from touba.panel._stores import HistoryView, MemoryAdmin
from touba.runtime import Program, Runtime

__all__ = ["Panel", "set_cookie"]


@dataclass
class Panel:
    """Everything the routes share: the stores, the program and the auth state."""

    program: Program
    memory: MemoryAdmin
    history: HistoryView | None
    auth: PanelAuth
    templates: Environment
    remote: bool = False
    runtime: Runtime | None = field(default=None)
    approvals: Runtime | None = None
    """The application's runtime: the approvals pages list and resume its checkpoints."""

    def preview_runtime(self) -> Runtime:
        """The runtime of preview turns (built once: a Program is sealed by its first)."""
        if self.runtime is None:
            self.runtime = Runtime(self.program)
        return self.runtime

    def render(
        self,
        request: Request,
        template: str,
        status_code: int = 200,
        **context: Any,
    ) -> HTMLResponse:
        """The page ``template`` rendered with ``context``, the session's CSRF token and flashes."""
        session: OperatorSession | None = getattr(request.state, "operator", None)
        page = self.templates.get_template(template).render(
            request=request,
            csrf=session.csrf if session is not None else "",
            flashes=session.take_flashes() if session is not None else [],
            logged_in=session is not None,
            **context,
        )
        return HTMLResponse(page, status_code=status_code)


def set_cookie(panel: Panel, response: Response, session: OperatorSession) -> None:
    """Give ``response`` the session cookie (HttpOnly, SameSite=Strict, Secure when remote)."""
    response.set_cookie(
        COOKIE,
        session.session_id,
        max_age=SESSION_SECONDS,
        path="/",
        httponly=True,
        samesite="strict",
        secure=panel.remote,
    )
