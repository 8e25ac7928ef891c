"""The panel's FastAPI application: :func:`create_app` and its middleware."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

try:
    from fastapi import FastAPI, Request, Response
    from fastapi.exceptions import HTTPException
    from fastapi.responses import RedirectResponse
    from fastapi.staticfiles import StaticFiles
    from jinja2 import Environment, FileSystemLoader
    from starlette.middleware.trustedhost import TrustedHostMiddleware
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'the memory panel needs FastAPI, Jinja2 and python-multipart: pip install "touba[panel]"'
    ) from e

from touba.errors import ConfigurationError
from touba.panel._approvals import router as approvals_router
from touba.panel._auth import COOKIE, PanelAuth, same_origin
from touba.panel._erase import router as erase_router
from touba.panel._format import register as register_filters
from touba.panel._limits import BodyLimit
from touba.panel._preview_stream import router as preview_stream_router
from touba.panel._repair import router as repair_router
from touba.panel._routes import router
from touba.panel._state import Panel, set_cookie
from touba.panel._stores import HistoryView, MemoryAdmin
from touba.runtime import Program, Runtime

__all__ = ["LOOPBACK_HOSTS", "create_app"]

logger = logging.getLogger("touba.panel")

HERE: Final = Path(__file__).parent
LOOPBACK_HOSTS: Final = ("127.0.0.1", "localhost", "::1", "[::1]")
PUBLIC_PATHS: Final = ("/login", "/static/")
CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS: Final = {
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
    "permissions-policy": "camera=(), microphone=(), geolocation=()",
}


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every value from the stores is untrusted text
        trim_blocks=True,
        lstrip_blocks=True,
    )
    register_filters(env)  # when, size, plural: every template writes them one way
    return env


def create_app(
    program: Program,
    memory: MemoryAdmin,
    history: HistoryView | None = None,
    *,
    token: str,
    allow_remote: bool = False,
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
    runtime: Runtime | None = None,
) -> FastAPI:
    """The panel over open stores (the caller opens and closes them).

    ``token`` is the access token (at least 16 characters): a browser sends
    it once, as ``/?token=...``, and gets an HttpOnly, SameSite=Strict
    session cookie. ``allowed_hosts``: the ``Host`` names accepted (loopback
    by default; DNS rebinding is refused). ``allow_remote``: served behind a
    TLS proxy (any host name; the cookie is ``Secure``; ``https`` origins).
    ``runtime``: the application's runtime over ``program``, whose checkpoint
    store the approvals page lists and whose ``resume`` (or a chat session's)
    an approval goes through; None: the page says how to give one.
    ConfigurationError when ``program`` is not a Program, or ``runtime`` does
    not run it.
    """
    if not isinstance(program, Program):
        raise ConfigurationError("the panel needs a touba.Program (see --program)")
    if runtime is not None and (not isinstance(runtime, Runtime) or runtime.program is not program):
        raise ConfigurationError("runtime must be a touba.Runtime running the panel's program")
    panel = Panel(
        program=program,
        memory=memory,
        history=history,
        auth=PanelAuth(token),
        templates=_environment(),
        remote=allow_remote,
        approvals=runtime,
    )
    app = FastAPI(title="touba memory panel", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.panel = panel
    app.include_router(router)
    app.include_router(approvals_router)
    app.include_router(preview_stream_router)
    app.include_router(erase_router)
    app.include_router(repair_router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.exception_handler(HTTPException)
    async def refused(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 401:
            return panel.render(request, "login.html", 401, problem=exc.detail)
        return panel.render(
            request, "error.html", exc.status_code, status=exc.status_code, problem=exc.detail
        )

    @app.middleware("http")
    async def authenticate(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        response = await _authenticated(panel, request, call_next)
        elapsed = (time.perf_counter() - started) * 1000
        for name, value in SECURITY_HEADERS.items():
            response.headers[name] = value
        if not request.url.path.startswith("/static/"):
            response.headers["cache-control"] = "no-store"
        response.headers["server-timing"] = f"app;dur={elapsed:.2f}"
        # Never the query string: the token arrives in it once.
        logger.info(
            "%s %s %s %.1fms", request.method, request.url.path, response.status_code, elapsed
        )
        return response

    def too_large(request: Request, problem: str) -> Response:
        return panel.render(request, "error.html", 413, status=413, problem=problem)

    # Outermost but for the host check: a body is bounded before anything reads it.
    app.add_middleware(BodyLimit, auth=panel.auth, refuse=too_large)
    hosts = ["*"] if allow_remote else list(allowed_hosts)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)
    return app


async def _authenticated(
    panel: Panel, request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """Exchange a token for a cookie, or let a session through, or refuse with 401."""
    token = request.query_params.get("token")
    if token is not None:
        if not panel.auth.token_matches(token):
            return panel.render(request, "login.html", 401, problem="That token is not valid.")
        session = panel.auth.login()
        kept = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
        target = request.url.path + ("?" + _query(kept) if kept else "")
        response: Response = RedirectResponse(target, status_code=303)
        set_cookie(panel, response, session)
        return response
    session_found = panel.auth.session(request.cookies.get(COOKIE))
    request.state.operator = session_found
    path = request.url.path
    if session_found is None and not path.startswith(PUBLIC_PATHS):
        if request.method == "POST":
            return panel.render(
                request, "login.html", 401, problem="Log in with the panel's token first."
            )
        return panel.render(request, "login.html", 401, problem=None)
    if request.method == "POST" and not same_origin(
        request.headers.get("origin"),
        request.headers.get("referer"),
        request.headers.get("host"),
        https_allowed=panel.remote,
    ):
        return panel.render(
            request,
            "error.html",
            403,
            status=403,
            problem="This request did not come from the panel's own pages (Origin check); "
            "nothing was changed.",
        )
    return await call_next(request)


def _query(items: list[tuple[str, str]]) -> str:
    from urllib.parse import urlencode

    return urlencode(items)
