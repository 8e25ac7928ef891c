"""Damaged conversations in the panel: shown, and repaired behind a confirmation.

- The conversations list marks each damaged conversation of the page shown (its
  problems counted), and a conversation's page lists its problems (kind, where,
  why: positions and kinds, never content), with a link to the repair. Both read
  the rows as stored (``store.read_raw``, which refuses nothing and changes
  nothing), one conversation per row of the page: what a page costs stays
  bounded by its size.
- ``GET /conversation/repair?key=...`` shows the smallest fix
  (:func:`~touba.history.plan_repair`), a link to download the originals in the
  export format first (``GET /conversation/originals?key=...``, JSON Lines, the
  format ``touba history repair --backup`` writes), and a form whose checkbox
  confirms it. ``POST /conversation/repair`` (CSRF and authentication as every
  POST) applies it only when confirmed and when the conversation is still
  exactly the one the page showed (its digest travels in the form): otherwise
  nothing is written and the page says why. A reserved conversation is refused
  (``DecisionHistoryBusy``), as the store refuses it.
- The repair is logged as the ``history_repaired`` event (counts and kinds, no
  content) and the operator's action, without the conversation's content.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import UTC, datetime

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import HTTPException

import touba
from touba.errors import DecisionHistoryBusy
from touba.history import RawConversation, plan_repair
from touba.history._repair import export_lines
from touba.panel._damage import raw_of as _raw
from touba.panel._routes import _back, _form, _history, _listed, _operator, _panel

__all__ = ["router"]

logger = logging.getLogger("touba.panel")
router = APIRouter()


def _digest(raw: RawConversation) -> str:
    """What the confirmation was given for: the stored texts, hashed."""
    parts = [raw.head, *(f"{r.exchange}:{r.bytes}:{r.body}" for r in raw.rows)]
    text = json.dumps([raw.split, raw.exchanges, raw.messages, raw.bytes, parts])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@router.get("/conversation/repair")
async def repair_page(request: Request) -> Response:
    panel = _panel(request)
    store = _history(panel)
    key = request.query_params.get("key", "")
    listed = await _listed(store, key)
    raw = await _raw(store, key)
    plan = None if raw is None else plan_repair(raw)
    return panel.render(
        request,
        "repair.html",
        row=listed,
        plan=plan,
        digest="" if raw is None else _digest(raw),
    )


@router.get("/conversation/originals")
async def originals(request: Request) -> Response:
    """The conversation as stored now, in the export format (a download)."""
    panel = _panel(request)
    store = _history(panel)
    key = request.query_params.get("key", "")
    await _listed(store, key)
    raw = await _raw(store, key)
    if raw is None:
        raise HTTPException(404, "No such conversation (absent or expired).")
    lines = export_lines(
        plan_repair(raw),
        touba_version=touba.__version__,
        created_at=datetime.now(UTC).isoformat(),
    )
    name = f"touba-repair-{hashlib.sha256(key.encode()).hexdigest()[:12]}.jsonl"
    return Response(
        "".join(line + "\n" for line in lines),
        media_type="application/x-ndjson",
        headers={"content-disposition": f'attachment; filename="{name}"'},
    )


@router.post("/conversation/repair")
async def repair(request: Request) -> Response:
    panel = _panel(request)
    store = _history(panel)
    form = await _form(request)
    key = form.get("key", "")
    session = _operator(request)
    if form.get("confirm") != "yes":
        session.flash("error", "Nothing done: tick the box to confirm the repair shown.")
        return _back("/conversation/repair", key=key)
    raw = await _raw(store, key)
    if raw is None or _digest(raw) != form.get("digest"):
        session.flash(
            "error",
            "Nothing done: the conversation changed since the page was shown (or is gone). "
            "Review the repair again.",
        )
        return _back("/conversation/repair", key=key)
    plan = plan_repair(raw)
    if plan.record is None:
        session.flash("error", "Nothing to repair here (healthy, or it cannot be repaired).")
        return _back("/conversation", key=key)
    try:
        await store.repair(plan)
    except DecisionHistoryBusy:
        session.flash(
            "error", "That conversation is active (reserved) or changed; it was not repaired."
        )
        return _back("/conversation/repair", key=key)
    event = plan.event()
    logger.info("history_repaired %s", json.dumps(event.to_dict(), sort_keys=True))
    logger.info("a conversation repaired by the operator")
    session.flash(
        "ok",
        f"Repaired: {len(plan.problems)} problem(s) fixed ({', '.join(plan.kinds)}). The "
        "conversation passes the window check again.",
    )
    return _back("/conversation", key=key)
