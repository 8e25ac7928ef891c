"""The panel's pages (GET) and actions (POST, each checked for its CSRF token).

Every action answers with a redirect to the page it came from and a one-shot
message (Post/Redirect/Get), except a settings form with errors, which is
shown again with the messages next to its fields (status 400), and the
preview box, which answers a ``fetch`` with the updated transcript.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, TypeVar
from urllib.parse import urlencode

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import HTTPException
from fastapi.responses import RedirectResponse

from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryRecordInvalid,
    KeyEventInvalid,
    ToubaError,
)
from touba.history._plot import PLOT_POINTS, read_points
from touba.memory import (
    ChatSession,
    EffectiveMemoryConfig,
    KeyEventsConfig,
    KeyEventService,
    resolve_memory_settings,
)
from touba.memory._fork import fork_stored_session
from touba.memory._model import (
    KEY_EVENT_STATUSES,
    ExtractionJob,
    JobStatus,
    KeyEventStatus,
    SessionMode,
)
from touba.panel._auth import COOKIE, CSRF_FIELD, CSRF_HEADER, OperatorSession, PanelAuth
from touba.panel._context_view import context_views
from touba.panel._damage import damaged_counts, problems_of
from touba.panel._forms import SettingsForm, parse_settings
from touba.panel._state import Panel, set_cookie
from touba.panel._svg import render_plot
from touba.panel._waiting import paused_turns
from touba.runtime import AgentDefinition

__all__ = ["PAGE_SIZE", "preview_session", "router"]

logger = logging.getLogger("touba.panel")

PAGE_SIZE: Final = 50
EXCHANGES_PER_PAGE: Final = 20
MAX_SHOWN_CHARS: Final = 4000
PANEL_SESSION: Final = "panel"
FETCH_HEADER: Final = "x-touba-fetch"
JOB_STATUSES: Final[tuple[JobStatus, ...]] = ("pending", "running", "done", "failed")
SETTINGS_CHANGES_SHOWN: Final = 20
OPERATOR: Final = "operator"
ModeFilter = Literal["live", "preview", "all"]
MODE_FILTERS: Final[tuple[ModeFilter, ...]] = ("live", "preview", "all")
OWNER_PREFIXES: Final = ("user:", "session:")
ERROR_CODE: Final = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*)(?::|$)")

router = APIRouter()
T = TypeVar("T")


# -- plumbing ----------------------------------------------------------------------------


def _panel(request: Request) -> Panel:
    panel: Panel = request.app.state.panel
    return panel


def _operator(request: Request) -> OperatorSession:
    session: OperatorSession | None = getattr(request.state, "operator", None)
    if session is None:
        raise HTTPException(401, "Log in with the panel's token first.")
    return session


async def _form(request: Request) -> dict[str, str]:
    """The POSTed form, after checking its CSRF token (403 when missing or wrong)."""
    session = _operator(request)
    data = await request.form()
    form = {k: v for k, v in data.items() if isinstance(v, str)}
    candidate = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
    if not PanelAuth.csrf_matches(session, candidate):
        raise HTTPException(
            403,
            "The form's CSRF token is missing or wrong (an old page, or a request from "
            "another site); nothing was changed. Reload the page and try again.",
        )
    return form


def _back(path: str, *, anchor: str | None = None, **query: str | int | None) -> RedirectResponse:
    """A 303 to ``path`` with ``query`` (empty values left out) and ``#anchor``."""
    kept = {k: v for k, v in query.items() if v not in (None, "")}
    target = path + ("?" + urlencode(kept) if kept else "") + (f"#{anchor}" if anchor else "")
    return RedirectResponse(target, status_code=303)


def _page_number(request: Request) -> int:
    raw = request.query_params.get("page", "1")
    return int(raw) if raw.isdigit() and 0 < int(raw) < 1_000_000 else 1


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list: its items, its number, and whether more follow."""

    items: list[T]
    number: int
    has_next: bool
    total: int | None = None

    @property
    def last(self) -> int | None:
        if self.total is None:
            return None
        return max((self.total + PAGE_SIZE - 1) // PAGE_SIZE, 1)


def _paged(items: list[T], number: int, total: int | None = None) -> Page[T]:
    """A page from a read of ``PAGE_SIZE + 1`` items (the extra one says more follow)."""
    return Page(items[:PAGE_SIZE], number, len(items) > PAGE_SIZE, total)


def _agent(panel: Panel, name: str) -> AgentDefinition:
    agent = panel.program.agents.get(name)
    if agent is None:
        raise HTTPException(404, f"No agent named {name!r} in this program.")
    return agent


async def _settings(panel: Panel, agent: AgentDefinition) -> EffectiveMemoryConfig:
    """The agent's settings now, and where they come from (saved: when and by whom)."""
    return await resolve_memory_settings(panel.memory, agent.name, agent.memory)


def _shown(value: Any) -> str:
    """JSON-ish text of a stored value, cut to a readable size (escaped by the template)."""
    if isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, ensure_ascii=False)
        if len(text) > 100:
            text = json.dumps(value, ensure_ascii=False, indent=1)
    if len(text) > MAX_SHOWN_CHARS:
        return text[:MAX_SHOWN_CHARS] + f"… ({len(text) - MAX_SHOWN_CHARS} more characters)"
    return text


def _anonymous(owner: str) -> bool:
    return owner.startswith("session:")


# -- login ---------------------------------------------------------------------------------


@router.get("/login")
async def login_page(request: Request) -> Response:
    panel = _panel(request)
    if getattr(request.state, "operator", None) is not None:
        return _back("/")
    return panel.render(request, "login.html", 401, problem=None)


@router.post("/login")
async def login(request: Request) -> Response:
    panel = _panel(request)
    data = await request.form()
    token = data.get("token")
    if not isinstance(token, str) or not panel.auth.token_matches(token.strip()):
        return panel.render(request, "login.html", 401, problem="That token is not valid.")
    response = _back("/")
    set_cookie(panel, response, panel.auth.login())
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    panel = _panel(request)
    await _form(request)
    panel.auth.logout(_operator(request).session_id)
    response = _back("/login")
    response.delete_cookie(COOKIE, path="/")
    return response


# -- overview and agents -------------------------------------------------------------------


@router.get("/")
async def home(request: Request) -> Response:
    panel = _panel(request)
    agents = []
    for agent in panel.program.agents.values():
        effective = await _settings(panel, agent)
        agents.append(
            {
                "agent": agent,
                "config": effective.config,
                "source": effective.source,
                "saved_by": effective.saved_by,
            }
        )
    memory = panel.memory
    counts = {
        "sessions": await memory.count_sessions(),
        "owners": await memory.count_owners(),
        "jobs": await memory.count_jobs(),
    }
    usage = await panel.history.usage(purge=False) if panel.history is not None else None
    return panel.render(request, "home.html", agents=agents, counts=counts, usage=usage)


async def _agent_page(
    request: Request, panel: Panel, agent: AgentDefinition, form: SettingsForm | None, status: int
) -> Response:
    effective = await _settings(panel, agent)
    changes = await panel.memory.memory_config_history(agent.name, limit=SETTINGS_CHANGES_SHOWN)
    session = _operator(request)
    preview_id = session.previews.get(agent.name)
    turns = await panel.memory.list_turns(preview_id, limit=PAGE_SIZE) if preview_id else ()
    return panel.render(
        request,
        "agent.html",
        status,
        agent=agent,
        config=effective.config,
        source=effective.source,
        effective=effective,
        changes=changes,
        changes_shown=SETTINGS_CHANGES_SHOWN,
        form=form or SettingsForm.of(effective.config),
        preview_turns=turns,
        preview_id=preview_id,
    )


@router.get("/agents/{name}")
async def agent_page(request: Request, name: str) -> Response:
    panel = _panel(request)
    return await _agent_page(request, panel, _agent(panel, name), None, 200)


@router.post("/agents/{name}/memory")
async def save_settings(request: Request, name: str) -> Response:
    panel = _panel(request)
    agent = _agent(panel, name)
    form = await _form(request)
    config, shown = parse_settings(form)
    if config is None:
        return await _agent_page(request, panel, agent, shown, 400)
    saved = await panel.memory.load_memory_config(agent.name)
    if saved == config:
        _operator(request).flash("ok", "These are the saved settings already: nothing changed.")
        return _back(f"/agents/{agent.name}")
    await panel.memory.save_memory_config(agent.name, config, actor=OPERATOR)
    logger.info("memory settings of agent %s saved by the operator", agent.name)
    _operator(request).flash(
        "ok", f"Saved. Sessions of {agent.name} use these settings from their next turn."
    )
    return _back(f"/agents/{agent.name}")


@router.post("/agents/{name}/memory/reset")
async def reset_settings(request: Request, name: str) -> Response:
    """Delete the settings saved for the agent (confirmed by the form's ``confirm=yes``):
    the program's apply again from each session's next turn; the change is recorded."""
    panel = _panel(request)
    agent = _agent(panel, name)
    form = await _form(request)
    session = _operator(request)
    if form.get("confirm") != "yes":
        session.flash(
            "error",
            "Nothing done: tick the box to confirm that the saved settings are to be deleted.",
        )
        return _back(f"/agents/{agent.name}", anchor="reset")
    if await panel.memory.reset_memory_config(agent.name, actor=OPERATOR):
        logger.info("memory settings of agent %s reset by the operator", agent.name)
        follows = "the program's settings" if agent.memory is not None else "the defaults"
        session.flash(
            "ok",
            f"Reset. Sessions of {agent.name} use {follows} from their next turn.",
        )
    else:
        session.flash("error", "No settings were saved for this agent: nothing to reset.")
    return _back(f"/agents/{agent.name}")


@router.post("/agents/{name}/preview")
async def preview(request: Request, name: str) -> Response:
    panel = _panel(request)
    agent = _agent(panel, name)
    form = await _form(request)
    session = _operator(request)
    if form.get("reset"):
        session.previews.pop(agent.name, None)
        return _back(f"/agents/{agent.name}", anchor="preview")
    text = form.get("message", "")
    problem = None
    if text.strip():
        preview_id = session.previews.setdefault(agent.name, f"preview-{uuid.uuid4().hex}")
        problem = await _run_preview(panel, agent, preview_id, text)
    else:
        problem = "Type a message first."
    preview_id_now = session.previews.get(agent.name)
    if request.headers.get(FETCH_HEADER):
        turns = (
            await panel.memory.list_turns(preview_id_now, limit=PAGE_SIZE)
            if (preview_id_now)
            else ()
        )
        return panel.render(
            request, "_preview.html", 200, preview_turns=turns, problem=problem, agent=agent
        )
    if problem:
        session.flash("error", problem)
    return _back(f"/agents/{agent.name}", anchor="preview")


def preview_session(panel: Panel, agent: AgentDefinition, preview_id: str) -> ChatSession:
    """The preview box's chat session: blank memory, no key event, the panel's runtime."""
    return ChatSession(
        panel.preview_runtime(),
        agent.name,
        None,
        preview_id,
        store=panel.memory,
        mode="preview",
        extract_in_background=False,
    )


async def _run_preview(
    panel: Panel, agent: AgentDefinition, preview_id: str, text: str
) -> str | None:
    """One preview turn; calls awaiting approval are refused (a preview approves nothing)."""
    try:
        async with preview_session(panel, agent, preview_id) as chat:
            turn = await chat.send(text)
            while turn.status == "awaiting_approval":
                turn = await chat.resume({c.call_id: False for c in turn.result.pending})
    except ToubaError as e:
        return f"{e.code}: {e.message}"
    error = turn.result.error
    if turn.status == "failed" and error is not None:
        return f"{error.code}: {error.message}"
    return None


# -- users, sessions, turns ----------------------------------------------------------------


def _mode_filter(request: Request, default: ModeFilter) -> ModeFilter:
    """The ``mode`` of a sessions list: live (real users), preview, or all."""
    raw = request.query_params.get("mode")
    return next((mode for mode in MODE_FILTERS if mode == raw), default)


def _session_mode(shown: ModeFilter) -> SessionMode | None:
    return None if shown == "all" else shown


def _owner_candidates(raw: str) -> tuple[str, ...]:
    """The owners a typed name may mean: itself when it has its prefix, else a user
    of that id, else the anonymous session of that id."""
    if raw.startswith(OWNER_PREFIXES):
        return (raw,)
    return tuple(prefix + raw for prefix in OWNER_PREFIXES)


async def _find_owner(panel: Panel, raw: str) -> str | None:
    """The owner ``raw`` names (with or without ``user:``) that has a session or a
    key event in the memory store, or None."""
    if any(ord(c) < 32 or c == "\x7f" for c in raw):
        return None  # no owner id holds a control character (and PostgreSQL refuses NUL)
    for owner in _owner_candidates(raw):
        if await panel.memory.count_sessions(owner=owner) or await panel.memory.count_events(
            owner, include_closed=True
        ):
            return owner
    return None


def _no_such_user(request: Request, panel: Panel, raw: str) -> Response:
    return panel.render(request, "no_user.html", 404, raw=raw, candidates=_owner_candidates(raw))


@router.get("/users")
async def users(request: Request) -> Response:
    panel = _panel(request)
    shown = _mode_filter(request, "live")
    mode = _session_mode(shown)
    number = _page_number(request)
    found = await panel.memory.list_owners(
        limit=PAGE_SIZE + 1, offset=(number - 1) * PAGE_SIZE, mode=mode
    )
    total = await panel.memory.count_owners(mode=mode)
    return panel.render(
        request, "users.html", page=_paged(found, number, total), shown=shown, modes=MODE_FILTERS
    )


@router.get("/user")
async def user(request: Request) -> Response:
    panel = _panel(request)
    raw = request.query_params.get("owner", "").strip()
    if not raw:
        return _back("/users")
    owner = await _find_owner(panel, raw)
    if owner is None:
        return _no_such_user(request, panel, raw)
    shown = _mode_filter(request, "all")
    if owner != raw:  # one address per owner: links and bookmarks name it whole
        kept = {k: v for k, v in request.query_params.items() if k != "owner"}
        return _back("/user", owner=owner, **kept)
    mode = _session_mode(shown)
    number = _page_number(request)
    found = await panel.memory.list_sessions(
        owner=owner, limit=PAGE_SIZE + 1, offset=(number - 1) * PAGE_SIZE, mode=mode
    )
    total = await panel.memory.count_sessions(owner=owner, mode=mode)
    open_events = await panel.memory.count_events(owner)
    all_events = await panel.memory.count_events(owner, include_closed=True)
    return panel.render(
        request,
        "user.html",
        owner=owner,
        anonymous=_anonymous(owner),
        erasable=None if _anonymous(owner) else owner.removeprefix("user:"),
        page=_paged(found, number, total),
        open_events=open_events,
        all_events=all_events,
        shown=shown,
        modes=MODE_FILTERS,
    )


@router.get("/session")
async def session_page(request: Request) -> Response:
    panel = _panel(request)
    session_id = request.query_params.get("id", "")
    meta = await panel.memory.get_session(session_id) if session_id else None
    if meta is None:
        raise HTTPException(404, "No such chat session (it may have been deleted).")
    number = _page_number(request)
    # Newest first: the turn a complaint is about is the last one, at the top.
    turns = await panel.memory.list_turns(
        session_id, limit=PAGE_SIZE + 1, offset=(number - 1) * PAGE_SIZE, newest_first=True
    )
    return panel.render(
        request,
        "session.html",
        meta=meta,
        anonymous=_anonymous(meta.owner),
        page=_paged(list(turns), number, meta.turns),
        page_size=PAGE_SIZE,
        shown=_shown,
        paused=await paused_turns(panel.approvals, panel.memory, session_id),
        given=await context_views(turns[:PAGE_SIZE], panel.history),
    )


@router.post("/session/fork")
async def fork_session(request: Request) -> Response:
    """The "Fork from this turn" button: a new session holding turns 1 .. ``turn`` of session ``id``
    (each whole; the original unchanged), then its page."""
    panel = _panel(request)
    form = await _form(request)
    session_id, raw = form.get("id", ""), form.get("turn", "")
    operator = _operator(request)
    turn = int(raw) if raw.isdigit() and len(raw) < 10 else None
    if turn is None:
        operator.flash("error", "Nothing done: the turn to fork from was not a turn number.")
        return _back("/session", id=session_id)
    try:
        meta = await fork_stored_session(panel.memory, session_id, turn)
    except ConfigurationError as e:
        operator.flash("error", f"Nothing done: {e.message}")
        return _back("/session", id=session_id)
    logger.info("chat session forked at turn %d by the operator", turn)
    operator.flash(
        "ok",
        f"Forked from turn {turn} of session {session_id}: this session holds its turns "
        f"1 to {turn}; the original is unchanged.",
    )
    return _back("/session", id=meta.session_id)


# -- key events ----------------------------------------------------------------------------


def _status_filter(raw: str | None) -> KeyEventStatus | None:
    for status in KEY_EVENT_STATUSES:
        if raw == status:
            return status
    return None


@router.get("/events")
async def events(request: Request) -> Response:
    """One owner's key events, or every owner's (the search), filtered and paged."""
    panel = _panel(request)
    params = request.query_params
    raw = params.get("owner", "").strip()
    type_ = params.get("type") or None
    status = _status_filter(params.get("status"))
    text = (params.get("text") or "").strip() or None
    closed = params.get("closed") == "1"
    filters = {"type": type_, "status": status, "text": text, "include_closed": closed}
    owner = ""
    if raw:
        found_owner = await _find_owner(panel, raw)
        if found_owner is None:
            return _no_such_user(request, panel, raw)
        owner = found_owner
    number = _page_number(request)
    include_closed = closed or status == "closed"
    offset = (number - 1) * PAGE_SIZE
    try:
        if owner:
            found = await panel.memory.query_events(
                owner,
                type=type_,
                status=status,
                text=text,
                include_closed=include_closed,
                limit=PAGE_SIZE + 1,
                offset=offset,
            )
            total = await panel.memory.count_events(
                owner, type=type_, status=status, text=text, include_closed=include_closed
            )
        else:
            found = await panel.memory.query_all_events(
                type=type_,
                status=status,
                text=text,
                include_closed=include_closed,
                limit=PAGE_SIZE + 1,
                offset=offset,
            )
            total = await panel.memory.count_all_events(
                type=type_, status=status, text=text, include_closed=include_closed
            )
    except ConfigurationError as e:  # a filter no store can match (a NUL character)
        raise HTTPException(400, f"{e.message}; change the filter.") from e
    return panel.render(
        request,
        "events.html",
        owner=owner,
        anonymous=_anonymous(owner),
        filters=filters,
        statuses=KEY_EVENT_STATUSES,
        page=_paged(found, number, total),
    )


async def _event_page(
    request: Request,
    panel: Panel,
    owner: str,
    event_id: str,
    errors: dict[str, str] | None = None,
    values: dict[str, str] | None = None,
) -> Response:
    event = await panel.memory.get_event(owner, event_id) if owner and event_id else None
    if event is None:
        raise HTTPException(404, "No such key event for this owner.")
    return panel.render(
        request,
        "event.html",
        400 if errors else 200,
        event=event,
        statuses=KEY_EVENT_STATUSES,
        errors=errors or {},
        values=values or {"status": event.status, "title": event.title, "details": event.details},
        anonymous=_anonymous(owner),
    )


@router.get("/event")
async def event_page(request: Request) -> Response:
    panel = _panel(request)
    params = request.query_params
    return await _event_page(request, panel, params.get("owner", ""), params.get("id", ""))


@router.post("/event/edit")
async def edit_event(request: Request) -> Response:
    panel = _panel(request)
    form = await _form(request)
    owner, event_id = form.get("owner", ""), form.get("id", "")
    values = {k: form.get(k, "") for k in ("status", "title", "details")}
    # Only the fields are validated here (lengths, statuses): an operator edits any type.
    service = KeyEventService(panel.memory, KeyEventsConfig())
    try:
        updated = await service.update(
            owner,
            event_id,
            status=values["status"],
            title=values["title"],
            details=values["details"].replace("\r\n", "\n"),
            session_id=PANEL_SESSION,
            actor="operator",
        )
    except KeyEventInvalid as e:
        field = e.parameter if e.parameter in values else "form"
        if e.parameter == "event_id":
            raise HTTPException(404, "No such key event for this owner.") from e
        return await _event_page(request, panel, owner, event_id, {field: e.message}, values)
    except ConfigurationError as e:
        raise HTTPException(400, e.message) from e
    logger.info("key event %s edited by the operator", updated.id)
    _operator(request).flash("ok", "Saved; the change is recorded as made by the operator.")
    return _back("/event", owner=owner, id=event_id)


# -- decision-history conversations ------------------------------------------------------


def _history(panel: Panel) -> Any:
    if panel.history is None:
        raise HTTPException(
            404,
            "No decision-history store was given: start the panel with --history-db, "
            "--history-dsn or --redis-url.",
        )
    return panel.history


async def _listed(store: Any, key: str) -> Any:
    """The store's listed row of the conversation ``key``; 404 when absent or expired
    (a reserved one stays, as a purge keeps it). Reads only: it purges nothing."""
    listed = next((r for r in await store.list(purge=False) if r.key == key), None)
    if listed is None or (listed.expired and not listed.active):
        raise HTTPException(404, "No such conversation (absent or expired).")
    return listed


@router.get("/conversations")
async def conversations(request: Request) -> Response:
    panel = _panel(request)
    if panel.history is None:
        return panel.render(request, "conversations.html", page=None, usage=None)
    number = _page_number(request)
    start = (number - 1) * PAGE_SIZE
    recent = getattr(panel.history, "list_recent", None)
    if recent is not None:  # SQLite, PostgreSQL: one page read, however many are stored
        rows, total = await recent(limit=PAGE_SIZE + 1, offset=start)
    else:  # every conversation read, then one page kept
        rows = [r for r in await panel.history.list(purge=False) if r.active or not r.expired]
        rows.sort(key=lambda r: r.updated_at, reverse=True)
        rows, total = rows[start : start + PAGE_SIZE + 1], len(rows)
    usage = await panel.history.usage(purge=False)
    page = _paged(rows, number, total)
    damaged = await damaged_counts(panel.history, [r.key for r in page.items])
    return panel.render(request, "conversations.html", page=page, usage=usage, damaged=damaged)


@router.get("/conversation")
async def conversation(request: Request) -> Response:
    panel = _panel(request)
    store = _history(panel)
    key = request.query_params.get("key", "")
    listed = await _listed(store, key)
    record = None
    busy = False
    problems = await problems_of(store, key)
    if not listed.active:
        try:
            record = await store.read(key, purge=False)
        except DecisionHistoryBusy:
            busy = True
        except DecisionHistoryRecordInvalid:  # unreadable as stored: its problems say why
            record = None
    else:
        busy = True
    exchanges: list[Any] = []
    number = _page_number(request)
    pages = 1
    points = []
    if record is not None:
        every = record.get("exchanges")
        every = every if isinstance(every, list) else []
        pages = max((len(every) + EXCHANGES_PER_PAGE - 1) // EXCHANGES_PER_PAGE, 1)
        number = min(number, pages)
        start = (number - 1) * EXCHANGES_PER_PAGE
        exchanges = list(enumerate(every[start : start + EXCHANGES_PER_PAGE], start))
        points = read_points(record)
    return panel.render(
        request,
        "conversation.html",
        row=listed,
        record=record,
        busy=busy,
        exchanges=exchanges,
        number=number,
        pages=pages,
        plot=render_plot(points),
        points=points,
        ring=PLOT_POINTS,
        shown=_shown,
        problems=problems,
    )


@router.get("/conversation/recover")
async def recover_page(request: Request) -> Response:
    panel = _panel(request)
    store = _history(panel)
    key = request.query_params.get("key", "")
    listed = await _listed(store, key)
    return panel.render(request, "recover.html", row=listed)


@router.post("/conversation/recover")
async def recover(request: Request) -> Response:
    panel = _panel(request)
    store = _history(panel)
    form = await _form(request)
    key = form.get("key", "")
    session = _operator(request)
    if form.get("worker_stopped") != "yes":
        session.flash(
            "error",
            "Nothing done: confirm that you stopped and checked the worker that holds the "
            "reservation.",
        )
        return _back("/conversation/recover", key=key)
    freed = await store.recover(key, worker_stopped=True)
    logger.info("reservation of a conversation %s by the operator", "freed" if freed else "absent")
    session.flash(
        "ok" if freed else "error",
        "Reservation freed: the conversation is available again (storage only; check any "
        "uncertain business effect yourself)."
        if freed
        else "There was no reservation on that conversation.",
    )
    return _back("/conversation", key=key)


@router.post("/conversation/delete")
async def delete_conversation(request: Request) -> Response:
    panel = _panel(request)
    store = _history(panel)
    form = await _form(request)
    key = form.get("key", "")
    session = _operator(request)
    try:
        deleted = await store.delete(key)
    except DecisionHistoryBusy:
        session.flash("error", "That conversation is active (reserved); it was not deleted.")
        return _back("/conversation", key=key)
    session.flash("ok" if deleted else "error", "Deleted." if deleted else "No such conversation.")
    return _back("/conversations")


# -- extraction jobs -------------------------------------------------------------------------


@router.get("/jobs")
async def jobs(request: Request) -> Response:
    panel = _panel(request)
    raw = request.query_params.get("status")
    status = next((s for s in JOB_STATUSES if s == raw), None)
    number = _page_number(request)
    found = await panel.memory.list_jobs(
        status=status, limit=PAGE_SIZE + 1, offset=(number - 1) * PAGE_SIZE
    )
    counts = await panel.memory.count_jobs()
    total = counts.get(status, 0) if status else sum(counts.values())
    return panel.render(
        request,
        "jobs.html",
        page=_paged(found, number, total),
        status=status,
        statuses=JOB_STATUSES,
        counts=counts,
    )


def _error_code(last_error: str | None) -> str | None:
    """The code a failed attempt's ``last_error`` starts with (a touba error's code, or
    an exception's type), or None when it names none."""
    if not last_error:
        return None
    found = ERROR_CODE.match(last_error)
    return found.group(1) if found else None


def _op_rows(job: ExtractionJob) -> list[dict[str, Any]]:
    """Each recorded op with what it became: the event it created or updated, or why it
    was rejected. Fields are named, with their sizes: the events hold the text."""
    result = job.result if isinstance(job.result, dict) else {}
    created = iter(_strings(result.get("created")))
    updated = iter(_strings(result.get("updated")))
    rejected = {}
    for entry in result.get("rejected") or ():
        if isinstance(entry, dict) and isinstance(entry.get("op"), int):
            rejected[entry["op"]] = str(entry.get("error", ""))
    rows = []
    for index, op in enumerate(job.ops or ()):
        row: dict[str, Any] = {"index": index, "op": op, "event": None, "rejected": None}
        if job.status != "done":
            pass  # not applied yet (or applied in part by an attempt that then failed)
        elif index in rejected:
            row["rejected"] = rejected[index]
        else:
            row["event"] = next(created if op.kind == "create" else updated, None)
        rows.append(row)
    return rows


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


@router.get("/job")
async def job_page(request: Request) -> Response:
    """One extraction job: its owner, attempts, next attempt, ops and their outcome,
    or its error code (never its lease token)."""
    panel = _panel(request)
    job_id = request.query_params.get("id", "").strip()
    job = await panel.memory.get_job(job_id) if job_id else None
    if job is None:
        raise HTTPException(
            404,
            "No such extraction job: the id may be mistyped, or the job's store is another "
            "one. The jobs are listed on Extraction jobs.",
        )
    return panel.render(
        request,
        "job.html",
        job=job,
        code=_error_code(job.last_error),
        ops=_op_rows(job),
    )


@router.post("/jobs/requeue")
async def requeue(request: Request) -> Response:
    panel = _panel(request)
    form = await _form(request)
    session = _operator(request)
    try:
        job = await panel.memory.requeue_job(form.get("id", ""))
    except ConfigurationError as e:
        session.flash("error", e.message)
    else:
        session.flash("ok", f"Job {job.id} is pending again, with fresh attempts.")
    if form.get("back") == "job":
        return _back("/job", id=form.get("id", ""))
    return _back("/jobs", status=form.get("status") or None)
